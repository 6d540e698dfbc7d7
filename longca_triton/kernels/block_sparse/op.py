r"""Block-sparse attention in Triton (uniform and variable blocks): forward, backward, GQA, lse.

Math
----
A ``BlockSparseMask`` cuts queries at ``q_bounds`` and keys at ``k_bounds`` and keeps, per pattern
``p``, the block pairs where ``block_map[p, I, J]`` is set. Query head ``h`` uses pattern
``p(h) = h // (Hq / P)`` and KV head ``h // (Hq / Hkv)``. For query row ``i`` (in block ``I``)::

    s_ij  = softmax_scale * q_i . k_j          for j in a kept block J of row I
    lse_i = log sum_j exp(s_ij)                (-inf when row I keeps no block)
    o_i   = sum_j exp(s_ij - lse_i) v_j        (0 when row I keeps no block)

Backward, with ``dO`` (and ``dlse`` when the caller differentiates through lse)::

    delta_i = rowsum(dO_i * o_i) - dlse_i
    dv_j   += sum_i p_ij dO_i
    ds_ij   = p_ij (dO_i . v_j - delta_i)
    dq_i    = softmax_scale * sum_j ds_ij k_j
    dk_j   += softmax_scale * sum_i ds_ij q_i  (summed over the query heads of a KV head)

Everything runs in the log2 domain (``exp2``, scores times ``softmax_scale * log2 e``), fp32
accumulators, natural-log lse stored as float32 ``[B, Hq, Sq]``.

Tiling
------
One tile grid serves uniform and variable blocks (``plan.py`` builds it on the GPU): every block is
processed in sub-tiles of a fixed size, each carrying its valid length.

* A *row tile* is ``BLOCK_M`` consecutive query rows inside one query block (the block's last
  sub-tile may be short: its missing rows load as zeros and are never stored). The dQ pass may stack
  ``DQ_HEADS`` query heads of one GQA group that share a pattern into one tile of
  ``DQ_HEADS * DQ_BLOCK_M`` rows, so small positions still make 128-row matrix products.
* Its key list is the runs of kept key blocks cut into ``BLOCK_N`` tiles ``[start, end)``. Only a
  tile shorter than ``BLOCK_N`` (a run's ragged tail, or the last block of a ragged ``Sk``) needs
  masking; when every block is a multiple of ``BLOCK_N`` (uniform blocks) the mask is compiled
  out (``EVEN_N``) and the loop is a plain flash-attention loop over an index list.
* The dK/dV pass is the same on the transposed map: a program owns a key tile and walks its list of
  query tiles for every query head of its KV head's group.

Variable blocks cut into fixed tiles leave ragged pieces that cost whole tiles; the backward's
``ragged_bwd`` treatment (``config.pass_plans``) cuts that: packed lists (a list's runs end to end, so
only its last tile is short), whole entries first, short entries last, and blocks' remainders in tail
launches of smaller tiles.

K/V tiles are read through tensor descriptors (TMA on Hopper; arbitrary start rows, zero fill past
``Sk``); Q / dO tiles through pointer loads with row masks. Launch order: row tiles heaviest first,
head packs fastest-varying. Head dims: ``q, k`` share ``D_qk`` and ``v`` may have its own ``D_v``
(up to 256), in tiles padded to powers of two.

Kernels: ``block_sparse_fwd_kernel`` (``fwd.py``), ``block_sparse_bwd_dkdv_kernel`` and
``block_sparse_bwd_dq_kernel`` (``bwd.py``), delta from ``dense.launch_bwd_preprocess``.
Shapes: ``q [B, Sq, Hq, D_qk]``, ``k [B, Sk, Hkv, D_qk]``, ``v [B, Sk, Hkv, D_v]``, unit last
stride; ``out [B, Sq, Hq, D_v]``.
"""

from __future__ import annotations

from typing import Optional

import torch

import longca_triton.kernels.block_sparse.plan as _plan
from longca_triton.kernels.block_sparse.bwd import block_sparse_bwd_dkdv_kernel, block_sparse_bwd_dq_kernel
from longca_triton.kernels.block_sparse.config import CONFIG_KEYS, _SPEC, pass_plans, resolve_config, stack
from longca_triton.kernels.block_sparse.fwd import block_sparse_fwd_kernel
from longca_triton.kernels.block_sparse.plan import SideTables
from longca_triton.kernels.core.autograd import attention_function, fake_bwd, fake_fwd, register_op_autograd
from longca_triton.kernels.core.runtime import bsh_strides as _bsh_strides
from longca_triton.kernels.core.runtime import check_qkv as _check_qkv
from longca_triton.kernels.core.runtime import config_head_dim, head_dim_meta
from longca_triton.kernels.core.runtime import descriptor_ready as _descriptor_ready
from longca_triton.kernels.core.runtime import ensure_allocator as _ensure_allocator
from longca_triton.kernels.core.runtime import resolve_scale as _resolve_scale
from longca_triton.kernels.core.runtime import compile_disabled, side_stream
from longca_triton.kernels.dense.op import launch_bwd_preprocess

__all__ = [
    "block_sparse_attention", "varblock_attention", "block_sparse_attention_op",
    "block_sparse_attention_from_tables", "tables_for", "table_build_time", "block_sparse_fwd",
    "block_sparse_bwd", "BlockSparseAttentionFunction",
]

LOG2E = 1.4426950408889634

# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _check_inputs(q, k, v, mask):
    _check_qkv(q, k, v, "block-sparse attention")
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    if hq % mask.num_patterns:
        raise ValueError(f"the mask's {mask.num_patterns} patterns do not divide {hq} query heads")
    if mask.seqlen_q != sq or mask.seqlen_k != sk:
        raise ValueError(f"mask is {mask.seqlen_q} x {mask.seqlen_k} but q/k have Sq={sq}, Sk={sk}")
    if sq * hq * d >= 2**31:
        # the dK/dV loop addresses query rows with 32-bit offsets inside one batch entry
        raise ValueError(f"Sq * Hq * D = {sq * hq * d} >= 2^31 elements per batch entry; split the heads")


def tables_for(mask, cfg: dict, device) -> dict:
    """The tables one fwd+bwd with config ``cfg`` needs (``plan.tables_for``, cached)."""
    return _plan.tables_for(mask, pass_plans(cfg), device)


def table_build_time(mask, head_dim: int, device, config: Optional[dict] = None, repeats: int = 5,
                     heads: Optional[tuple] = None) -> dict:
    """Median ms to build each table from scratch on ``device`` (fwd, dq, dkdv), cache bypassed; ``heads``
    (query heads, KV heads) as ``resolve_config`` takes it."""
    return _plan.table_build_ms(mask, pass_plans(resolve_config(mask, head_dim, config, heads=heads)), device,
                                repeats)


def _heads(q, k, mask):
    hq, hkv = q.shape[2], k.shape[2]
    return hq // hkv, hq // mask.num_patterns


def block_sparse_fwd(q, k, v, mask, t: SideTables, softmax_scale: float, cfg: dict):
    """Forward launch over table ``t``. Returns ``out [B, Sq, Hq, D_v]`` (q's dtype) and ``lse [B, Hq, Sq]``
    float32."""
    q, k, v = (_descriptor_ready(x) for x in (q, k, v))
    b, sq, hq, _ = q.shape
    group, hpp = _heads(q, k, mask)
    out = torch.empty((b, sq, hq, v.shape[3]), device=q.device, dtype=q.dtype)
    lse = torch.empty((b, hq, sq), device=q.device, dtype=torch.float32)
    if b * hq * sq == 0 or t.num_tiles == 0:
        return out, lse
    _ensure_allocator(q.device)
    block_sparse_fwd_kernel[(t.num_tiles * b * hq,)](
        q, k, v, out, lse,
        *_bsh_strides(q, k, v, out),
        *t.lists(),
        softmax_scale * LOG2E,
        sq, k.shape[1], t.num_row_blocks, b * hq, hq, group, hpp,
        **head_dim_meta(q.shape[3], v.shape[3]), BLOCK_M=t.tile_rows, BLOCK_N=cfg["BLOCK_N"], EVEN_N=t.even_cols,
        LIST_CHUNK=pass_plans(cfg)["fwd"].chunk, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, lse


def _full_entries(t: SideTables) -> bool:
    """Whether a dK/dV table's steps (all, or with ``full_first`` its first part) are full, unpacked entries."""
    return (t.even_cols and not t.packed) or t.full_first


def block_sparse_bwd(dout, q, k, v, out, lse, mask, tables: dict, softmax_scale: float, cfg: dict,
                     dlse=None, passes=("dkdv", "dq")):
    """Backward launches (delta, dK/dV, dQ; each pass's tail tiles in a launch of their own when
    ``tables`` has them: ``tables_for``). Returns ``dq, dk, dv`` in the inputs' dtype.

    ``passes`` picks the kernels to launch after the delta preprocess (for timing them apart); a skipped
    pass leaves its outputs uninitialised. With ``bwd_streams`` the dQ launches run on a second stream
    beside dK/dV's; a dK/dV tail launch runs first (on that stream when there is one), so the main
    launch's programs fill its last waves.
    """
    q, k, v, out, dout = (_descriptor_ready(x) for x in (q, k, v, out, dout))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group, hpp = _heads(q, k, mask)
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)  # [B, Sq, Hq, D_qk]
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)  # [B, Sk, Hkv, D_qk]
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)  # [B, Sk, Hkv, D_v]
    dims = head_dim_meta(d, v.shape[3])
    if b * hq * sq * sk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    _ensure_allocator(q.device)
    lse = lse.contiguous()
    plans = pass_plans(cfg)
    stats_tma = bool(cfg["dkdv_stats_tma"]) and "dkdv" in passes and _full_entries(tables["dkdv"])
    # delta = rowsum(dO * O) - dlse: the dense kernels' preprocess; with stats_tma also the [B, Hq, Sq, 4]
    # rows (lse, delta, 0, 0) the dK/dV steps read by TMA boxes
    if stats_tma:
        delta, stats = launch_bwd_preprocess(out, dout, dlse, lse=lse)
    else:
        delta = launch_bwd_preprocess(out, dout, dlse)
    qk_scale = softmax_scale * LOG2E
    # a KV head's key tiles in its own pattern's order: only where the whole group walks one pattern
    pattern_order = bool(cfg["dkdv_pattern_order"]) and hpp % group == 0

    def launch_dkdv(tk: SideTables, warps: int, qmajor: bool):
        # per table: a tail table may not be full; query-major steps hold their rows' stats as two values a
        # thread, which the pointers load for less than a box costs
        tma = stats_tma and _full_entries(tk) and not qmajor
        block_sparse_bwd_dkdv_kernel[(tk.num_tiles * b * hkv,)](
            q, k, v, dout, lse, delta, dk, dv,
            *_bsh_strides(q, k, v, dout, dk, dv),
            *tk.lists(),
            softmax_scale, qk_scale,
            sq, sk, tk.num_row_blocks, b * hkv, hq, hkv, group, hpp,
            **dims, BLOCK_M=tk.tile_cols, BLOCK_N=tk.tile_rows, EVEN_M=tk.even_cols, LIST_CHUNK=plans["dkdv"].chunk,
            PACKED=tk.packed, PATTERN_ORDER=pattern_order, STATS_TMA=tma, QMAJOR=qmajor,
            Stats=stats if tma else None, COL_FULL=tk.col_full, FULL_FIRST=tk.full_first,
            num_warps=warps, num_stages=cfg["dkdv_num_stages"],
        )

    def launch_dq(tq: SideTables, heads: int, warps: int):
        num_packs = b * hq // heads
        block_sparse_bwd_dq_kernel[(tq.num_tiles * num_packs,)](
            q, k, v, dout, lse, delta, dq,
            *_bsh_strides(q, k, v, dout, dq),
            *tq.lists(), tq.ptr if tq.col_split is None else tq.col_split,
            softmax_scale, qk_scale,
            sq, sk, tq.num_row_blocks, num_packs, hq, group, hpp,
            **dims, BLOCK_M=tq.tile_rows, BLOCK_N=cfg["DQ_BLOCK_N"], HEADS=heads, EVEN_N=tq.even_cols,
            LIST_CHUNK=plans["dq"].chunk, PACKED=tq.packed, SHORT_N=tq.short_cols,
            num_warps=warps, num_stages=cfg["dq_num_stages"],
        )

    def has(name):  # the pass runs and its table has row tiles
        return name.split("_")[0] in passes and tables.get(name) is not None and tables[name].num_tiles > 0

    first, dkdv_chain, dq_chain = [], [], []  # first: launched on the side stream before everything else
    if "dkdv" in passes:
        dkdv_chain.append(lambda: launch_dkdv(tables["dkdv"], cfg["dkdv_num_warps"], False))
    if has("dkdv_tail"):
        # the tails step their query rows query-major on 4 warps (one exponential a score)
        first.append(lambda: launch_dkdv(tables["dkdv_tail"], 4, True))
    if "dq" in passes:
        dq_chain.append(lambda: launch_dq(tables["dq"], stack(cfg["DQ_HEADS"], group, hpp), cfg["dq_num_warps"]))
    if has("dq_tail"):
        dq_chain.append(lambda: launch_dq(tables["dq_tail"], 1, 4))
    both = "dkdv" in passes and "dq" in passes
    with side_stream(q.device, cfg["bwd_streams"] and both) as beside:
        with beside():
            for launch in first:
                launch()
        for launch in dkdv_chain:
            launch()
        with beside():
            for launch in dq_chain:
                launch()
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------


def _bs_fwd(q, k, v, mask, tables, softmax_scale, cfg):
    return block_sparse_fwd(q, k, v, mask, tables["fwd"], softmax_scale, cfg)


def _bs_bwd(dout, dlse, q, k, v, out, lse, mask, tables, softmax_scale, cfg):
    return block_sparse_bwd(dout, q, k, v, out, lse, mask, tables, softmax_scale, cfg, dlse=dlse)


#: ``apply(q, k, v, mask, tables, softmax_scale, cfg) -> (out, lse)``
BlockSparseAttentionFunction = attention_function(
    "BlockSparseAttentionFunction", _bs_fwd, _bs_bwd,
    """``(q, k, v) -> (out, lse)``; mask, tables and config ride along as non-tensor arguments.""")


# ----------------------------------------------------------------------------------------------
# torch.library custom ops (for torch.compile): the tables travel as lists of int32 tensors
# ----------------------------------------------------------------------------------------------

#: per pass, the main table's 9 lists (row_start, row_end, row_block, order, ptr, col_start, col_end,
#: col_next, col_count), its col_split and col_full (each empty without one), then its tail table's
#: (``_op_lists``: row lists empty when the pass has none)
_TABLE_LEN = 22


class _Patterns:
    """What the launchers read off a mask: its number of patterns."""

    def __init__(self, num_patterns: int):
        self.num_patterns = int(num_patterns)


def _tables_from_tensors(ts, tile_rows: int, tile_cols: int, num_patterns: int, even_cols, packed,
                         short_cols: int = 0) -> SideTables:
    row_start, row_end, row_block, order, ptr, col_start, col_end, col_next, col_count, col_split, col_full = ts
    split = col_split.numel() > 0  # an empty one: no short entries split off (_op_lists)
    return SideTables(tile_rows=int(tile_rows), tile_cols=int(tile_cols),
                      num_row_blocks=(ptr.shape[0] - 1) // num_patterns, num_patterns=num_patterns,
                      row_start=row_start, row_end=row_end, row_block=row_block, order=order, ptr=ptr,
                      col_start=col_start, col_end=col_end, col_next=col_next, col_count=col_count,
                      even_rows=False, even_cols=bool(even_cols), build_ms=0.0, packed=bool(packed),
                      short_cols=int(short_cols) if split else 0, col_split=col_split if split else None,
                      col_full=col_full if col_full.numel() > 0 else None)


def _cfg_to_list(cfg: dict) -> list[int]:
    return [int(cfg[k]) for k in CONFIG_KEYS]


def _cfg_from_list(cfg_list) -> dict:
    cfg = dict(zip(CONFIG_KEYS, (int(x) for x in cfg_list)))
    for key in _SPEC.bool_keys:
        cfg[key] = bool(cfg[key])
    return cfg


def op_meta(tables: dict, num_patterns: int) -> list[int]:
    """What the ops need to know of ``tables`` besides their tensors: ``[num_patterns, then even_cols
    and packed of the fwd, dq and dkdv tables, then the same of their tail tables]`` (the main table's
    flags where there is none)."""
    names = ("fwd", "dq", "dkdv")
    return [int(num_patterns)] + [int(flag) for t in [tables[n] for n in names]
                                  + [tables.get(n + "_tail", tables[n]) for n in names]
                                  for flag in (t.even_cols, t.packed)]


def _op_lists(tables: dict, name: str) -> list[torch.Tensor]:
    """Pass ``name``'s main and tail tables as the ops carry them: each table's ``lists()`` and its
    ``col_split`` and ``col_full`` (each empty where it has none), eleven tensors a table."""
    main = tables[name]
    tail = tables.get(name + "_tail")
    if tail is None:  # no tail tiles: empty row lists, the launch is skipped
        tail = main.without_rows()

    def splits(t: SideTables) -> list[torch.Tensor]:
        return [t.ptr[:0] if x is None else x for x in (t.col_split, t.col_full)]

    return main.lists() + splits(main) + tail.lists() + splits(tail)


def _op_tables(c: dict, meta, fwd=None, dq=None, dkdv=None) -> dict:
    """``meta`` from ``op_meta``; the lists from ``_op_lists``."""
    plans, P = pass_plans(c), int(meta[0])
    out = {}
    for i, (name, lists) in enumerate((("fwd", fwd), ("dq", dq), ("dkdv", dkdv))):
        if lists is not None:
            pp = plans[name]
            even, packed = meta[1 + 2 * i], meta[2 + 2 * i]
            out[name] = _tables_from_tensors(lists[:11], pp.rows, pp.cols, P, even, packed, pp.short_cols)
            tail = _tables_from_tensors(lists[11:], pp.tail_rows or pp.rows, pp.tail_cols, P, meta[7 + 2 * i],
                                        meta[8 + 2 * i], pp.short_cols)
            if tail.num_tiles:
                out[name + "_tail"] = tail
    return out


@torch.library.custom_op("longca_triton::block_sparse_attention_fwd", mutates_args=())
def _block_sparse_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fwd_tables: list[torch.Tensor],
                         dq_tables: list[torch.Tensor], dkdv_tables: list[torch.Tensor], meta: list[int],
                         softmax_scale: float, cfg: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    # dq_tables / dkdv_tables are not read here: they ride along so that the backward has them
    c = _cfg_from_list(cfg)
    t = _op_tables(c, meta, fwd=fwd_tables)
    return block_sparse_fwd(q, k, v, _Patterns(meta[0]), t["fwd"], softmax_scale, c)


@_block_sparse_fwd_op.register_fake
def _(q, k, v, fwd_tables, dq_tables, dkdv_tables, meta, softmax_scale, cfg):
    return fake_fwd(q, v)


@torch.library.custom_op("longca_triton::block_sparse_attention_bwd", mutates_args=())
def _block_sparse_bwd_op(dout: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dq_tables: list[torch.Tensor],
                         dkdv_tables: list[torch.Tensor], meta: list[int], softmax_scale: float,
                         cfg: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = _cfg_from_list(cfg)
    tables = _op_tables(c, meta, dq=dq_tables, dkdv=dkdv_tables)
    return block_sparse_bwd(dout, q, k, v, out, lse, _Patterns(meta[0]), tables, softmax_scale, c, dlse=dlse)


@_block_sparse_bwd_op.register_fake
def _(dout, dlse, q, k, v, out, lse, dq_tables, dkdv_tables, meta, softmax_scale, cfg):
    return fake_bwd(q, k, v)


register_op_autograd("longca_triton::block_sparse_attention_fwd", _block_sparse_bwd_op, _TABLE_LEN)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, softmax_scale=None,
                           return_lse: bool = False, config: Optional[dict] = None, deterministic: bool = False):
    """Attention of ``q [B, Sq, Hq, D_qk]`` over ``k [B, Sk, Hkv, D_qk]``, ``v [B, Sk, Hkv, D_v]``
    under a ``BlockSparseMask`` (``out [B, Sq, Hq, D_v]``).

    Any block bounds (uniform or variable). Differentiable in q, k, v (and through ``lse``).
    ``config`` overrides launch parameters (``config.CONFIG_KEYS``). Returns ``out`` in q's dtype, or
    ``(out, lse)`` with ``lse [B, Hq, Sq]`` float32 (natural log; ``-inf`` and a zero output row
    where a query row keeps no block). The tables are built on q's device on first use and cached.

    ``deterministic``: accepted for the API's sake and always honoured, at no cost: the backward
    has no atomics (dK/dV summed over a GQA group in registers, dQ owned by one program per tile),
    so its gradients are bitwise identical run to run whatever the flag.
    """
    _check_inputs(q, k, v, mask)
    softmax_scale = _resolve_scale(softmax_scale, q.shape[-1])
    cfg = resolve_config(mask, config_head_dim(q.shape[-1], v.shape[-1]), config, q=q, k=k, v=v)
    tables = tables_for(mask, cfg, q.device)
    out, lse = BlockSparseAttentionFunction.apply(q, k, v, mask, tables, softmax_scale, cfg)
    return (out, lse) if return_lse else out


#: variable blocks go through the same kernels (sub-tiles carrying their valid length)
varblock_attention = block_sparse_attention


def block_sparse_attention_op(q, k, v, mask, softmax_scale=None, return_lse=False, config=None,
                              deterministic=False):
    """Same as :func:`block_sparse_attention`, through the ``torch.library`` ops
    (``longca_triton::block_sparse_attention_fwd`` / ``_bwd``), so ``torch.compile`` can trace it.

    The tables are looked up (built once, cached) outside the graph: under ``torch.compile`` that
    lookup is a graph break. Build them beforehand (``tables_for``) and call
    :func:`block_sparse_attention_from_tables` for a graph without breaks (``fullgraph=True``).
    ``deterministic``: always honoured (no atomics, see :func:`block_sparse_attention`).
    """
    _check_inputs(q, k, v, mask)
    softmax_scale = _resolve_scale(softmax_scale, q.shape[-1])
    cfg = resolve_config(mask, config_head_dim(q.shape[-1], v.shape[-1]), config, q=q, k=k, v=v)
    tables = _tables_no_compile(mask, cfg, q.device)
    return block_sparse_attention_from_tables(q, k, v, tables, mask.num_patterns, softmax_scale, cfg, return_lse)


@compile_disabled
def _tables_no_compile(mask, cfg, device):
    return tables_for(mask, cfg, device)


def block_sparse_attention_from_tables(q, k, v, tables: dict, num_patterns: int, softmax_scale: float, cfg: dict,
                                       return_lse: bool = False):
    """The custom-op path given ready tables (``tables_for(mask, cfg, device)``, ``cfg`` from
    ``resolve_config``): traceable by ``torch.compile`` without graph breaks."""
    meta = op_meta(tables, num_patterns)
    out, lse = torch.ops.longca_triton.block_sparse_attention_fwd(
        q, k, v, _op_lists(tables, "fwd"), _op_lists(tables, "dq"), _op_lists(tables, "dkdv"), meta,
        float(softmax_scale), _cfg_to_list(cfg))
    return (out, lse) if return_lse else out

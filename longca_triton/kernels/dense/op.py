r"""Dense attention with structured masks in Triton: forward, backward, GQA, lse.

Math
----
For a query head ``h`` (KV head ``h // G`` with ``G = Hq / Hkv``), query row ``i`` and key ``j``::

    s_ij  = softmax_scale * q_i . k_j                      (only where allowed(i, j))
    lse_i = log sum_{j allowed} exp(s_ij)                  (-inf when row i allows nothing)
    p_ij  = exp(s_ij - lse_i)
    o_i   = sum_j p_ij v_j                                 (0 when row i allows nothing)

Backward, with ``dO`` (and optionally ``dlse``)::

    delta_i = sum_d dO_id * o_id - dlse_i
    dv_j   += sum_i p_ij dO_i
    ds_ij   = p_ij * (dO_i . v_j - delta_i)
    dq_i    = softmax_scale * sum_j ds_ij k_j
    dk_j   += softmax_scale * sum_i ds_ij q_i              (summed over the G heads of a group)

The kernels work in the log2 domain: scores are multiplied by ``softmax_scale * log2(e)`` and
exponentiated with ``exp2``; the stored lse is the natural log (float32, ``[B, Hq, Sq]``).

Tiling
------
The ``Sq x Sk`` plane is cut into ``BLOCK_M x BLOCK_N`` tiles. The mask IR gives, per tile size,
which tiles are *full* (no mask math), *partial* (element mask from the per-row intervals
``OR_t lo[i,t] <= j < hi[i,t]``) or empty (never touched); ``plan.py`` turns those lists into
contiguous runs and orders tiles heaviest first. Metadata is ``O(S + tiles)``.

* forward (``fwd.py``): one program per (query tile, query head): full runs, then partial runs,
  online softmax in fp32.
* backward (``bwd.py``): ``delta`` preprocess; key-major dK/dV, one program per (key tile, KV head)
  looping over all ``G`` query heads of the group (no atomics); query-major dQ, optionally on a second
  CUDA stream beside dK/dV (``bwd_streams``: the dQ programs fill the SMs of dK/dV's last wave).
  Every tile of dq, dk, dv has one owner summing in a fixed order, so gradients are bitwise
  reproducible in every config (``deterministic=True`` costs nothing).

GQA: query heads are the fastest-varying program index, so the ``G`` programs of one group run
side by side and read the same K/V tiles from L2.

All tile loads and stores go through tensor descriptors (TMA on Hopper), which zero-fill
out-of-range rows and clip out-of-range stores: ragged ``S`` needs no bounds masks in the full loop.

Head dims: ``q, k`` share ``D_qk`` and ``v`` (so ``out``) may have its own ``D_v``: every multiple of 8
from 8 to 256 for each (``core.runtime.head_dim_reason``). Tiles are padded on the head-dim axis to
powers of two (``BLOCK_DQK``, ``BLOCK_DV``); the descriptors zero-fill the padding on load and drop it
on store, so results and the FLOP count are those of the true dims.

Configs
-------
``CONFIG_KEYS``: the forward tile ``BLOCK_M x BLOCK_N`` with ``num_warps`` / ``num_stages``; dK/dV
``DKDV_BLOCK_M x DKDV_BLOCK_N`` (a program owns a key tile of ``DKDV_BLOCK_N``) with ``dkdv_num_warps`` /
``dkdv_num_stages``; dQ ``DQ_BLOCK_M x DQ_BLOCK_N`` (a program owns a query tile) with ``dq_num_stages``
(the dQ kernel always runs ``DQ_NUM_WARPS``); ``dkdv_sweep`` the order of a dK/dV program's (query head,
query tile) steps (0 head-major, 1 row-major, 2 row-major descending; ``bwd.py``); ``bwd_streams``;
``dq_skew`` (the dQ GEMM one step late, ``core.dq_skewed_scores``). The defaults are the shipped table
``kernels/tuning/dense.toml``, which names the results that measured each row; ``resolve_config`` is
explicit config > the user's autotune cache > that table, then validation.

Entry points
------------
``dense_attention(q, k, v, mask, softmax_scale=None, return_lse=False, config=None)`` (autograd),
the ``torch.library`` ops ``longca_triton::dense_attention_fwd`` / ``_bwd`` (``torch.compile``),
and the low-level launchers ``dense_fwd`` / ``dense_bwd`` that take a :class:`TilePlan`.
Shapes: ``q [B, Sq, Hq, D_qk]``, ``k [B, Sk, Hkv, D_qk]``, ``v [B, Sk, Hkv, D_v]``, any strides
with a unit last stride; ``out [B, Sq, Hq, D_v]``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from longca_triton.kernels.core import config as _config_mod
from longca_triton.kernels.core.autograd import attention_function, fake_bwd, fake_fwd, register_op_autograd
from longca_triton.kernels.core.config import ConfigSpec, check_dkdv_sweep
from longca_triton.kernels.core.config import resolve as _resolve
from longca_triton.kernels.core.jit import LOG2E, bwd_preprocess_kernel
from longca_triton.kernels.core.runtime import block_head_dim, config_head_dim, head_dim_meta
from longca_triton.kernels.core.runtime import bsh_strides as _bsh_strides
from longca_triton.kernels.core.runtime import check_qkv as _check_qkv
from longca_triton.kernels.core.runtime import descriptor_ready as _descriptor_ready
from longca_triton.kernels.core.runtime import ensure_allocator as _ensure_allocator
from longca_triton.kernels.core.runtime import interpreting as _interpreting
from longca_triton.kernels.core.runtime import resolve_scale as _resolve_scale
from longca_triton.kernels.core.runtime import compile_disabled, side_stream
from longca_triton.kernels.dense.bwd import dense_bwd_dkdv_kernel, dense_bwd_dq_kernel
from longca_triton.kernels.dense.fwd import dense_fwd_kernel
from longca_triton.kernels.dense.plan import TilePlan, get_tile_plan
from longca_triton.kernels.tuning import Problem, load_table, table_config

__all__ = [
    "dense_attention", "dense_attention_op", "dense_attention_from_plans", "plans_for",
    "default_config", "resolve_config", "dense_fwd", "dense_bwd", "launch_bwd_preprocess",
    "launch_bwd_dkdv", "launch_bwd_dq", "DenseAttentionFunction", "CONFIG_KEYS", "CONFIG_SPEC",
    "DKDV_TILE_KEYS", "DQ_NUM_WARPS", "UNEVEN_SHARE", "check_deterministic", "check_plan", "mask_kind",
    "table_dim",
]

# ----------------------------------------------------------------------------------------------
# Launch configs
# ----------------------------------------------------------------------------------------------

#: every key a ``config`` dict may carry (the module docstring says what each does)
CONFIG_KEYS = (
    "BLOCK_M", "BLOCK_N", "num_warps", "num_stages",
    "DKDV_BLOCK_M", "DKDV_BLOCK_N", "dkdv_num_warps", "dkdv_num_stages",
    "DQ_BLOCK_M", "DQ_BLOCK_N", "dq_num_stages",
    "dkdv_sweep", "bwd_streams", "dq_skew",
)
#: the keys of the dK/dV tile: a config that sets one of them without ``dkdv_sweep`` runs head-major
#: (the table's sweep was measured on its own tile only); FlashMask follows the same rule
DKDV_TILE_KEYS = ("DKDV_BLOCK_M", "DKDV_BLOCK_N", "dkdv_num_warps", "dkdv_num_stages")
#: warps of the dQ kernel: two warpgroups, what every shipped row measured best
DQ_NUM_WARPS = 8
#: ``core.tuned.uneven_key_work`` at or above which a range mask is ``"uneven"`` (``mask_kind``)
UNEVEN_SHARE = 0.25

#: what ``resolve`` checks a dense config against; ``tuned_name`` is the autotune cache's kernel name
CONFIG_SPEC = ConfigSpec("dense-attention", CONFIG_KEYS,
                         tile_keys=("BLOCK_M", "BLOCK_N", "DKDV_BLOCK_M", "DKDV_BLOCK_N", "DQ_BLOCK_M", "DQ_BLOCK_N"),
                         bool_keys=("bwd_streams", "dq_skew"), tuned_name="triton")


def table_dim(head_dim: int) -> int:
    """The tuning table's ``head_dim``: the padded tile dim ``head_dim`` is configured by (64, 128 or 256)."""
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def mask_kind(mask) -> Optional[str]:
    """The tuning table's ``mask`` field: ``"full"`` (every pair allowed), ``"uneven"`` (a share of at least
    ``UNEVEN_SHARE`` of the key tiles off the median tile's work: causal, document, prefix-LM masks) or
    ``"even"`` (sliding windows); None without a mask."""
    if mask is None:
        return None
    from longca_triton.kernels.core.tuned import mask_class, uneven_key_work

    if mask_class(mask) == "full":
        return "full"
    return "even" if uneven_key_work(mask) < UNEVEN_SHARE else "uneven"


def default_config(head_dim: int, dtype: torch.dtype = torch.bfloat16, mask=None, group: int = 1,
                   exact_dims: Optional[bool] = None) -> dict:
    """The shipped table's config (``kernels/tuning/dense.toml``) for padded head dim ``head_dim``
    (``core.runtime.config_head_dim(D_qk, D_v)``; any int is accepted), ``mask`` (its ``mask_kind``), GQA
    ``group`` (query heads per KV head) and ``exact_dims`` (whether the true dims fill the tile; None:
    unknown), in the interpreter its ``cpu`` row; a fresh dict."""
    dim = table_dim(head_dim)
    rows = load_table("dense", CONFIG_KEYS).rows
    # the mask's kind costs a look at its key tiles: only where a row of this head dim asks
    needs_kind = any("mask" in r.match and r.match.get("head_dim", dim) == dim for r in rows)
    problem = Problem(arch="cpu" if _interpreting() else None, head_dim=dim, dtype=str(dtype).replace("torch.", ""),
                      mask=mask_kind(mask) if needs_kind else None, group=group, exact_dims=exact_dims)
    return table_config("dense", problem, CONFIG_KEYS)


def resolve_config(head_dim: int, dtype: torch.dtype, config: Optional[dict] = None, *, q=None, k=None,
                   mask=None, v=None, spec: ConfigSpec = CONFIG_SPEC) -> dict:
    """``config``, else (given ``q, k, mask``; ``v`` when its head dim differs) the autotune cache's entry
    under ``spec.tuned_name``, overlaid on ``default_config`` (for the GQA group of ``q`` / ``k``);
    unknown keys, bad tiles and a ``dkdv_sweep`` outside ``core.config.DKDV_SWEEPS`` raise ValueError.
    A config that names a ``DKDV_TILE_KEYS`` key but not ``dkdv_sweep`` runs head-major.
    ``head_dim``: the padded dim configs are chosen by (``config_head_dim``). FlashMask resolves its
    config here with its own ``spec`` (same keys, same table)."""
    group = q.shape[2] // k.shape[2] if q is not None and k is not None else 1
    if config is None:
        config = _config_mod.tuned_config(spec, q, k, mask, v)  # (looked up through the module: tests patch it)
    dims = [t.shape[-1] for t in (q, v) if t is not None]
    base = default_config(head_dim, dtype, mask, group, exact_dims=all(d == head_dim for d in dims) if dims else None)
    if config and "dkdv_sweep" not in config and any(key in config for key in DKDV_TILE_KEYS):
        base["dkdv_sweep"] = 0
    return check_dkdv_sweep(_resolve(spec, base, config or {}), spec.what)


def check_deterministic(cfg: dict, deterministic: bool, what: str = "dense attention") -> None:
    """Whether ``cfg`` may run under ``deterministic=True``: every dense backward config may (no atomics:
    each dq / dk / dv tile has one owner that sums in a fixed order), so this never raises; families
    that run the dense backward ask it the same question as their own kernels."""
    del cfg, deterministic, what


def _config_for(q, k, v, mask, config, deterministic):
    """The resolved config of one call, memoised on the mask: it depends on the mask, the head dims,
    dtype, GQA group, device, the explicit config and the autotune cache, nothing else."""
    from longca_triton.kernels.core.plan_cache import mask_memo
    from longca_triton.kernels.core.tuned import generation

    key = ("dense", q.shape[-1], v.shape[-1], q.dtype, q.shape[2] // k.shape[2], str(q.device), _interpreting(),
           None if config is None else repr(sorted(config.items())), generation())
    cfg = mask_memo(mask, key, lambda: resolve_config(config_head_dim(q.shape[-1], v.shape[-1]), q.dtype, config,
                                                      q=q, k=k, v=v, mask=mask))
    check_deterministic(cfg, deterministic)
    return dict(cfg)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

def _check_inputs(q, k, v, plan_sq=None, plan_sk=None):
    _check_qkv(q, k, v, "dense attention")
    sq, sk = q.shape[1], k.shape[1]
    if plan_sq is not None and (plan_sq != sq or plan_sk != sk):
        raise ValueError(f"mask is {plan_sq} x {plan_sk} but q/k have Sq={sq}, Sk={sk}")


def check_plan(plan: TilePlan, block_m: int, block_n: int, what: str):
    """Raise ValueError unless ``plan`` was built for ``block_m x block_n`` tiles (``what`` names the pass)."""
    if plan.block_m != block_m or plan.block_n != block_n:
        raise ValueError(f"{what} plan is for tiles {plan.block_m}x{plan.block_n}, "
                         f"config says {block_m}x{block_n}")


def dense_fwd(q, k, v, plan: TilePlan, softmax_scale: float, cfg: dict, out_dtype=None):
    """Launch the forward kernel. Returns ``out [B, Sq, Hq, D_v]`` (q's dtype, or ``out_dtype``:
    context parallelism asks for float32 partial outputs so that merging them rounds once),
    ``lse [B, Hq, Sq]``."""
    check_plan(plan, cfg["BLOCK_M"], cfg["BLOCK_N"], "forward")
    q, k, v = (_descriptor_ready(t) for t in (q, k, v))
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = torch.empty((b, sq, hq, v.shape[3]), device=q.device, dtype=out_dtype or q.dtype)
    lse = torch.empty((b, hq, sq), device=q.device, dtype=torch.float32)
    if b * hq * sq == 0:
        return out, lse
    _ensure_allocator(q.device)
    grid = (plan.num_m * b * hq,)
    dense_fwd_kernel[grid](
        q, k, v, out, lse,
        *_bsh_strides(q, k, v, out),
        plan.lo, plan.hi, plan.q_order, *plan.q_full, *plan.q_part,
        softmax_scale * LOG2E,
        sq, sk, b * hq, hq, hq // hkv,
        **head_dim_meta(q.shape[3], v.shape[3]),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], NUM_IV=plan.num_iv,
        HAS_PARTIAL_TILES=plan.q_part[1].numel() > 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, lse


def dense_bwd(dout, q, k, v, out, lse, dkdv_plan: TilePlan, dq_plan: TilePlan,
              softmax_scale: float, cfg: dict, dlse=None, grad_dtype=None, dq_dtype=None, after_dkdv=None):
    """Launch preprocess, dK/dV and dQ. Returns ``dq, dk, dv`` in the inputs' dtype (or
    ``grad_dtype``: float32 partial gradients for context parallelism's accumulation; ``dq_dtype``
    overrides it for dQ alone).

    ``after_dkdv(dk, dv)`` is called once dK/dV are enqueued and before dQ is: context parallelism
    posts the transfer of dK/dV there so that it overlaps the dQ kernel."""
    check_plan(dkdv_plan, cfg["DKDV_BLOCK_M"], cfg["DKDV_BLOCK_N"], "dK/dV")
    check_plan(dq_plan, cfg["DQ_BLOCK_M"], cfg["DQ_BLOCK_N"], "dQ")
    q, k, v, out, dout = (_descriptor_ready(t) for t in (q, k, v, out, dout))
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    dk = torch.empty(k.shape, device=k.device, dtype=grad_dtype or k.dtype)  # [B, Sk, Hkv, D_qk]
    dv = torch.empty(v.shape, device=v.device, dtype=grad_dtype or v.dtype)  # [B, Sk, Hkv, D_v]
    dq_dtype = dq_dtype or grad_dtype or q.dtype
    hook = after_dkdv or (lambda dk_, dv_: None)
    if b * hq * d == 0 or sq == 0 or sk == 0:
        dk.zero_(), dv.zero_()
        hook(dk, dv)
        return q.new_zeros((b, sq, hq, d), dtype=dq_dtype), dk, dv
    _ensure_allocator(q.device)
    lse = lse.contiguous()
    delta = launch_bwd_preprocess(out, dout, dlse)  # [B, Hq, Sq] float32
    dq = torch.empty((b, sq, hq, d), device=q.device, dtype=dq_dtype)
    with side_stream(q.device, cfg["bwd_streams"]) as beside:
        launch_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, dkdv_plan, softmax_scale, cfg)
        hook(dk, dv)
        with beside():
            launch_bwd_dq(q, k, v, dout, lse, delta, dq, dq_plan, softmax_scale, cfg)
    return dq, dk, dv


def launch_bwd_preprocess(out, dout, dlse=None, block: int = 64, lse=None):
    """``delta [B, Hq, Sq] = rowsum(dO * O) - dlse`` (float32); ``out, dout [B, Sq, Hq, D_v]``. Given the
    forward's ``lse [B, Hq, Sq]``, returns ``(delta, stats)`` with ``stats [B, Hq, Sq, 4] = (lse, delta, 0,
    0)`` (float32: rows a dK/dV step can read by one TMA box, as the block-sparse kernels do)."""
    b, sq, hq, d = out.shape
    delta = torch.empty((b, hq, sq), device=out.device, dtype=torch.float32)
    stats = torch.empty((b, hq, sq, 4), device=out.device, dtype=torch.float32) if lse is not None else None
    has_dlse = dlse is not None
    bwd_preprocess_kernel[(triton.cdiv(sq, block), b * hq)](
        out, dout, dlse.contiguous() if has_dlse else delta, delta,
        lse.contiguous() if lse is not None else delta, stats if stats is not None else delta,
        *_bsh_strides(out, dout),
        sq, hq, HEAD_DIM=d, BLOCK_D=block_head_dim(d), BLOCK=block, HAS_DLSE=has_dlse, STATS=stats is not None,
    )
    return delta if stats is None else (delta, stats)


def launch_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, plan: TilePlan, softmax_scale, cfg):
    """Key-major dK/dV into ``dk [B, Sk, Hkv, D_qk]``, ``dv [B, Sk, Hkv, D_v]`` with ``cfg``'s ``DKDV_*`` /
    ``dkdv_*`` keys; inputs already descriptor-ready, ``lse`` / ``delta`` ``[B, Hq, Sq]`` float32."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    dense_bwd_dkdv_kernel[(plan.num_n * b * hkv,)](
        q, k, v, dout, lse, delta, dk, dv, delta,  # (the second delta: the kernel's Unused)
        *_bsh_strides(q, k, v, dout, dk, dv), 0, 0, 0,
        plan.lo, plan.hi, plan.k_order, *plan.k_full, *plan.k_part,
        softmax_scale, softmax_scale * LOG2E,
        sq, sk, b * hkv, hq, hkv, hq // hkv,
        **head_dim_meta(q.shape[3], v.shape[3]), BLOCK_M=cfg["DKDV_BLOCK_M"], BLOCK_N=cfg["DKDV_BLOCK_N"],
        NUM_IV=plan.num_iv, HAS_PARTIAL_TILES=plan.k_part[1].numel() > 0, SWEEP=cfg["dkdv_sweep"],
        num_warps=cfg["dkdv_num_warps"], num_stages=cfg["dkdv_num_stages"],
    )


def launch_bwd_dq(q, k, v, dout, lse, delta, dq, plan: TilePlan, softmax_scale, cfg):
    """Query-major dQ into ``dq`` ([B, Sq, Hq, D_qk]); inputs already descriptor-ready."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    dense_bwd_dq_kernel[(plan.num_m * b * hq,)](
        q, k, v, dout, lse, delta, dq,
        *_bsh_strides(q, k, v, dout, dq),
        plan.lo, plan.hi, plan.q_order, *plan.q_full, *plan.q_part,
        softmax_scale, softmax_scale * LOG2E,
        sq, sk, b * hq, hq, hq // hkv,
        **head_dim_meta(q.shape[3], v.shape[3]), BLOCK_M=cfg["DQ_BLOCK_M"], BLOCK_N=cfg["DQ_BLOCK_N"],
        NUM_IV=plan.num_iv, HAS_PARTIAL_TILES=plan.q_part[1].numel() > 0, SKEW=cfg["dq_skew"],
        num_warps=DQ_NUM_WARPS, num_stages=cfg["dq_num_stages"],
    )


def plans_for(mask, cfg: dict, device):
    """The three tile plans one fwd+bwd needs (cached per mask, tile size and device)."""
    fwd = get_tile_plan(mask, cfg["BLOCK_M"], cfg["BLOCK_N"], device)
    dkdv = get_tile_plan(mask, cfg["DKDV_BLOCK_M"], cfg["DKDV_BLOCK_N"], device)
    dq = get_tile_plan(mask, cfg["DQ_BLOCK_M"], cfg["DQ_BLOCK_N"], device)
    return fwd, dkdv, dq


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------


def _dense_fwd3(q, k, v, fwd_plan, dkdv_plan, dq_plan, softmax_scale, cfg):
    return dense_fwd(q, k, v, fwd_plan, softmax_scale, cfg)


def _dense_bwd3(dout, dlse, q, k, v, out, lse, fwd_plan, dkdv_plan, dq_plan, softmax_scale, cfg):
    return dense_bwd(dout, q, k, v, out, lse, dkdv_plan, dq_plan, softmax_scale, cfg, dlse=dlse)


#: ``apply(q, k, v, fwd_plan, dkdv_plan, dq_plan, softmax_scale, cfg) -> (out, lse)``
DenseAttentionFunction = attention_function(
    "DenseAttentionFunction", _dense_fwd3, _dense_bwd3,
    """``(q, k, v) -> (out, lse)`` with the plans and config carried as non-tensor arguments.""")


# ----------------------------------------------------------------------------------------------
# torch.library custom ops (for torch.compile): the plans travel as lists of int32 tensors
# ----------------------------------------------------------------------------------------------

_PLAN_LEN = 9  # lo, hi, order, full (ptr, start, end), part (ptr, start, end)


def _plan_from_tensors(ts, block_m, block_n, sq, sk, major):
    lo, hi, order, fp, fs, fe, pp, ps, pe = ts
    num = order.shape[0]
    kw = dict(q_order=order, q_full=(fp, fs, fe), q_part=(pp, ps, pe),
              k_order=order, k_full=(fp, fs, fe), k_part=(pp, ps, pe))
    return TilePlan(seqlen_q=sq, seqlen_k=sk, block_m=block_m, block_n=block_n,
                    num_m=num if major == "q" else triton.cdiv(sq, block_m),
                    num_n=num if major == "k" else triton.cdiv(sk, block_n),
                    num_iv=lo.shape[1], lo=lo, hi=hi, area_tiles=-1, **kw)


def _cfg_from_list(cfg_list):
    return resolve_config(0, torch.float16, dict(zip(CONFIG_KEYS, cfg_list)))


def _cfg_to_list(cfg):
    return [int(cfg[k]) for k in CONFIG_KEYS]


@torch.library.custom_op("longca_triton::dense_attention_fwd", mutates_args=())
def _dense_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_plan: list[torch.Tensor],
                  dkdv_plan: list[torch.Tensor], dq_plan: list[torch.Tensor],
                  softmax_scale: float, cfg: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    # dkdv_plan / dq_plan are not read here: they ride along so that the backward has them
    c = _cfg_from_list(cfg)
    plan = _plan_from_tensors(q_plan, c["BLOCK_M"], c["BLOCK_N"], q.shape[1], k.shape[1], "q")
    return dense_fwd(q, k, v, plan, softmax_scale, c)


@_dense_fwd_op.register_fake
def _(q, k, v, q_plan, dkdv_plan, dq_plan, softmax_scale, cfg):
    return fake_fwd(q, v)


@torch.library.custom_op("longca_triton::dense_attention_bwd", mutates_args=())
def _dense_bwd_op(dout: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  dkdv_plan: list[torch.Tensor], dq_plan: list[torch.Tensor],
                  softmax_scale: float, cfg: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = _cfg_from_list(cfg)
    sq, sk = q.shape[1], k.shape[1]
    kp = _plan_from_tensors(dkdv_plan, c["DKDV_BLOCK_M"], c["DKDV_BLOCK_N"], sq, sk, "k")
    qp = _plan_from_tensors(dq_plan, c["DQ_BLOCK_M"], c["DQ_BLOCK_N"], sq, sk, "q")
    return dense_bwd(dout, q, k, v, out, lse, kp, qp, softmax_scale, c, dlse=dlse)


@_dense_bwd_op.register_fake
def _(dout, dlse, q, k, v, out, lse, dkdv_plan, dq_plan, softmax_scale, cfg):
    return fake_bwd(q, k, v)


register_op_autograd("longca_triton::dense_attention_fwd", _dense_bwd_op, _PLAN_LEN)


# ----------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, softmax_scale=None,
                    return_lse: bool = False, config: Optional[dict] = None, deterministic: bool = False):
    """Attention of ``q [B, Sq, Hq, D_qk]`` over ``k [B, Sk, Hkv, D_qk]``, ``v [B, Sk, Hkv, D_v]``
    under a ``RangeMask``.

    Differentiable in q, k, v (and through ``lse`` when returned). ``config`` overrides launch
    parameters (keys: ``CONFIG_KEYS``); defaults come from :func:`resolve_config`. Returns ``out``
    ``[B, Sq, Hq, D_v]`` in q's dtype, or ``(out, lse)`` with ``lse [B, Hq, Sq]`` float32 (natural
    log; ``-inf`` and a zero output row where a query row attends nothing).

    ``deterministic=True``: bitwise-identical gradients run to run; every config gives them at no cost
    (the backward has no atomics).
    """
    _check_inputs(q, k, v, int(mask.seqlen_q), int(mask.seqlen_k))
    softmax_scale = _resolve_scale(softmax_scale, q.shape[-1])
    cfg = _config_for(q, k, v, mask, config, deterministic)
    fwd_plan, dkdv_plan, dq_plan = plans_for(mask, cfg, q.device)
    out, lse = DenseAttentionFunction.apply(q, k, v, fwd_plan, dkdv_plan, dq_plan, softmax_scale,
                                            cfg)
    return (out, lse) if return_lse else out


def dense_attention_op(q, k, v, mask, softmax_scale=None, return_lse=False, config=None, deterministic=False):
    """Same as :func:`dense_attention`, through the ``torch.library`` ops (``torch.compile``-able).

    Build the plans outside the compiled region if you can (``plans_for``); here they are
    looked up (cached) on each call, which ``torch.compile`` treats as a graph break.
    """
    _check_inputs(q, k, v, int(mask.seqlen_q), int(mask.seqlen_k))
    softmax_scale = _resolve_scale(softmax_scale, q.shape[-1])
    cfg = _config_for(q, k, v, mask, config, deterministic)
    fwd_plan, dkdv_plan, dq_plan = _plans_no_compile(mask, cfg, q.device)
    return dense_attention_from_plans(q, k, v, fwd_plan, dkdv_plan, dq_plan, softmax_scale, cfg,
                                      return_lse)


@compile_disabled
def _plans_no_compile(mask, cfg, device):
    return plans_for(mask, cfg, device)


def dense_attention_from_plans(q, k, v, fwd_plan, dkdv_plan, dq_plan, softmax_scale, cfg,
                               return_lse=False):
    """The custom-op path given ready plans: traceable by ``torch.compile`` without breaks."""
    out, lse = torch.ops.longca_triton.dense_attention_fwd(
        q, k, v, fwd_plan.q_tensors(), dkdv_plan.k_tensors(), dq_plan.q_tensors(),
        float(softmax_scale), _cfg_to_list(cfg))
    return (out, lse) if return_lse else out



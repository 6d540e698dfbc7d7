r"""FlashMask in Triton: attention under column-interval masks, forward and backward, GQA, lse.

A port of the algorithm of *FlashMask: Efficient and Rich Mask Extension of FlashAttention*
(Wang et al., 2024) onto our Triton tiling, so that FlashMask's way of masking can be measured on
the same GPU, with the same online softmax and tensor-descriptor loads, as our ``triton`` kernel
(``kernels/dense``, which classifies tiles from block tables of per-*row* intervals instead).

Math
----
The same as ``kernels/dense/op.py``'s docstring (forward, lse, backward with ``delta = rowsum(dO * O) - dlse``,
dK/dV summed over a GQA group, fully masked rows giving out 0 and lse ``-inf``); only *which*
pairs ``(i, j)`` are allowed is described differently. Scores are multiplied by
``softmax_scale * log2(e)`` and exponentiated with ``exp2``; the stored lse is the natural log.

The column form
---------------
FlashMask describes a mask by four int32 vectors over the *key* columns
(``longca_triton.masks.lowerings.flashmask_columns``)::

    row i is masked for column j  <=>  LTS[j] <= i < LTE[j]   (lower-triangle interval, "LT")
                                   or  UTS[j] <= i < UTE[j]   (upper-triangle interval, "UT")

e.g. causal is ``UT = [0, j)``, ``LT`` empty; causal documents add ``LT = [end(doc(j)), Sq)``.
All twelve static masks of docs/masks.md fit; a column with more than one allowed gap does not.
Metadata is ``4 * Sk`` int32, whatever the mask.

Tile classification (FlashMask's Algorithm 1)
----------------------------------------------
Preprocessing (``tile_bounds``, torch ops on the device, ``O(Sk)``): for each key tile of
``BLOCK_N`` columns, the min and max of each vector: 8 int32 per tile
``[LTS_min, LTS_max, LTE_min, LTE_max, UTS_min, UTS_max, UTE_min, UTE_max]``.

At run time (``_classify``, ``fwd.py``), a query tile with rows ``[m0, m1)`` (``m1``
clipped to ``Sq``) against a key tile is

* **EMPTY** (skipped: no load, no matmul) when one interval covers the rows in every column:
  ``m0 >= LTS_max and m1 <= LTE_min``, or the same with ``UTS/UTE``;
* **PARTIAL** (element mask from the tile's column vectors) when some column's interval may
  touch the rows: ``m1 > LTS_min and m0 < LTE_max``, or the same with ``UTS/UTE``; also the last
  key tile when ``Sk`` is not a multiple of ``BLOCK_N`` (its padding keys are masked out);
* **FULL** otherwise: no mask math at all.

Both tests are conservative (a tile whose rows are covered by LT in some columns and UT in
others is PARTIAL, not EMPTY), never wrong. As in FlashMask, every program walks over *all* key
(or, in dK/dV, query) tiles in order and classifies each by this test; EMPTY tiles are skipped
without any load. The loop range is not narrowed from the mask (FlashMask narrows it only for its
built-in causal flag, which here is just ``UT = [0, j)``), so a skipped tile still costs its
8 scalar loads and compares. ``HAS_LT`` / ``HAS_UT`` (``tl.constexpr``, from the columns) drop
an interval that no column uses, from the test and from the element mask, like FlashMask's
specialisations on the number of bound vectors.

How the skip is written: the walk (``_next_run``) finds the next *run* of consecutive
non-EMPTY tiles, and a plain ``tl.range`` loop processes the run (FULL or PARTIAL per tile by
the same test; the column vectors are loaded only for PARTIAL tiles). Triton 3.6 software-
pipelines the TMA loads of a loop only when they are not under an ``if``: with the skip as an
``if`` around each tile's body, the sm_90 code issued and awaited every K/V load back to back;
with runs, K and V are triple-buffered within each run. Runs per program are few for the
static masks (one for causal, document and window masks; a handful for share_question or
global+window), and each pays one pipeline fill.

Before the min/max, the columns are normalised (clipped to ``[0, Sq]``, empty LT intervals
written ``[Sq, Sq)`` and empty UT ones ``[0, 0)``) so that empty intervals do not weaken the
tests; the ragged last key tile is padded by repeating its last real column, so the padding does
not change min or max.

Tiling
------
* forward (``flashmask_fwd_kernel``): one program per (query tile, query head), heaviest query
  tiles first (the last ones, for causal-like masks); online softmax in fp32.
* backward: ``delta`` preprocess (``core.bwd_preprocess_kernel``, shared); key-major dK/dV
  (``flashmask_bwd_dkdv_kernel``), one program per (key tile, KV head) looping over the ``G``
  query heads of the group and over all query tiles, so dK/dV accumulate in registers (no
  atomics); the program's column vectors are loaded once; query-major dQ
  (``flashmask_bwd_dq_kernel``), one program per (query tile, query head), on a second CUDA stream
  beside dK/dV where the config's ``bwd_streams`` says so.

All tile loads and stores go through tensor descriptors (TMA on Hopper), which zero-fill
out-of-range rows and clip out-of-range stores. Query rows past ``Sq`` (zero ``q`` and ``dO``,
lse read as 0) contribute nothing to dK/dV; key columns past ``Sk`` are masked in every kernel.

Head dims: ``q, k`` share ``D_qk``, ``v`` may have its own ``D_v`` (multiples of 8 up to 256), in
tiles padded to powers of two by the tensor descriptors, as in the dense kernels.

Configs: the dense family's (``dense.op.CONFIG_KEYS``, resolved from the same table,
``kernels/tuning/dense.toml``, under this kernel's autotune name ``triton-flashmask``), so the two
masking schemes are compared on equal tiling. Two keys read differently here: ``dkdv_sweep`` 1 and 2
both run this kernel's row-major sweep ascending (the descending order is not ported), and
``dq_skew`` is not read (this dQ kernel has no skewed form).

Entry point: ``flashmask_attention(q, k, v, mask_or_columns, softmax_scale=None,
return_lse=False, config=None)`` with a ``RangeMask`` (lowered by ``flashmask_columns``) or a
``FlashMaskColumns``. Shapes: ``q [B, Sq, Hq, D_qk]``, ``k [B, Sk, Hkv, D_qk]``,
``v [B, Sk, Hkv, D_v]``.

Files: ``fwd.py`` (forward kernel, tile classification), ``bwd.py`` (dK/dV, dQ), ``plan.py`` (columns on
the device, tile bounds, cache); shared pieces in ``kernels/core/jit.py``; this file: configs,
launchers, autograd and the public function.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton

from longca_triton.kernels.core.jit import LOG2E
from longca_triton.masks.ir import RangeMask

from longca_triton.kernels.core.autograd import attention_function
from longca_triton.kernels.core.runtime import bsh_strides as _bsh_strides
from longca_triton.kernels.core.runtime import check_qkv as _check_qkv
from longca_triton.kernels.core.runtime import config_head_dim, head_dim_meta
from longca_triton.kernels.core.runtime import descriptor_ready as _descriptor_ready
from longca_triton.kernels.core.runtime import ensure_allocator as _ensure_allocator
from longca_triton.kernels.core.runtime import resolve_scale as _resolve_scale
from longca_triton.kernels.core.runtime import side_stream
from longca_triton.kernels.dense.op import CONFIG_KEYS, CONFIG_SPEC, DQ_NUM_WARPS, launch_bwd_preprocess
from longca_triton.kernels.dense.op import resolve_config as dense_resolve_config
from longca_triton.kernels.flashmask.bwd import flashmask_bwd_dkdv_kernel, flashmask_bwd_dq_kernel
from longca_triton.kernels.flashmask.fwd import flashmask_classify_kernel, flashmask_fwd_kernel
from longca_triton.kernels.flashmask.plan import FlashMaskPlan, _columns_of, classify_tiles, flashmask_plan, tile_bounds

__all__ = [
    "flashmask_attention", "FlashMaskAttentionFunction", "FlashMaskPlan", "flashmask_plan",
    "resolve_config", "tile_bounds", "classify_tiles", "flashmask_fwd", "flashmask_bwd", "CONFIG_KEYS",
    "CONFIG_SPEC", "EMPTY", "PARTIAL", "FULL", "flashmask_fwd_kernel", "flashmask_bwd_dkdv_kernel",
    "flashmask_bwd_dq_kernel", "flashmask_classify_kernel",
]

#: tile classes as ``classify_tiles`` reports them
EMPTY, PARTIAL, FULL = 0, 1, 2

#: the dense family's config spec under this kernel's name in the autotune cache
FLASHMASK_SPEC = dataclasses.replace(CONFIG_SPEC, what="flashmask", tuned_name="triton-flashmask")


def resolve_config(head_dim: int, dtype: torch.dtype, config: Optional[dict] = None, *, q=None, k=None,
                   mask=None, v=None) -> dict:
    """The dense family's ``resolve_config`` (same keys, same table, the same rules for a ``RangeMask``;
    none for ``FlashMaskColumns``) under this kernel's autotune name."""
    return dense_resolve_config(head_dim, dtype, config, q=q, k=k, v=v, spec=FLASHMASK_SPEC,
                                mask=mask if isinstance(mask, RangeMask) else None)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _check_inputs(q, k, v, sq_mask: Optional[int], sk_cols: int):
    _check_qkv(q, k, v, "flashmask attention")
    sq, sk = q.shape[1], k.shape[1]
    if sq_mask is not None and sq_mask != sq:
        raise ValueError(f"mask is {sq_mask} x {sk_cols} but q/k have Sq={sq}, Sk={sk}")
    if sk_cols != sk:
        raise ValueError(f"the columns describe Sk={sk_cols} keys but k/v have Sk={sk}")


def flashmask_fwd(q, k, v, plan: FlashMaskPlan, softmax_scale: float, cfg: dict):
    """Launch the forward kernel. Returns ``out [B, Sq, Hq, D_v]`` (q's dtype), ``lse [B, Hq, Sq]``."""
    q, k, v = (_descriptor_ready(t) for t in (q, k, v))
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = torch.empty((b, sq, hq, v.shape[3]), device=q.device, dtype=q.dtype)
    lse = torch.empty((b, hq, sq), device=q.device, dtype=torch.float32)
    if b * hq * sq == 0:
        return out, lse
    if sk == 0:  # nothing to attend: every row fully masked
        return out.zero_(), lse.fill_(float("-inf"))
    _ensure_allocator(q.device)
    grid = (triton.cdiv(sq, cfg["BLOCK_M"]) * b * hq,)
    flashmask_fwd_kernel[grid](
        q, k, v, out, lse, plan.cols, plan.bounds_for(cfg["BLOCK_N"]),
        *_bsh_strides(q, k, v, out),
        softmax_scale * LOG2E,
        sq, sk, b * hq, hq, hq // hkv,
        **head_dim_meta(q.shape[3], v.shape[3]), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        HAS_LT=plan.has_lt, HAS_UT=plan.has_ut,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, lse


def flashmask_bwd(dout, q, k, v, out, lse, plan: FlashMaskPlan, softmax_scale: float, cfg: dict,
                  dlse=None):
    """Launch preprocess, dK/dV and dQ. Returns ``dq, dk, dv`` in the inputs' dtype."""
    q, k, v, out, dout = (_descriptor_ready(t) for t in (q, k, v, out, dout))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)  # [B, Sq, Hq, D_qk]
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)  # [B, Sk, Hkv, D_qk]
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)  # [B, Sk, Hkv, D_v]
    if b * hq * d == 0 or sq == 0 or sk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    _ensure_allocator(q.device)
    lse = lse.contiguous()
    delta = launch_bwd_preprocess(out, dout, dlse)  # [B, Hq, Sq] float32
    with side_stream(q.device, cfg["bwd_streams"]) as beside:
        flashmask_bwd_dkdv_kernel[(triton.cdiv(sk, cfg["DKDV_BLOCK_N"]) * b * hkv,)](
            q, k, v, dout, lse, delta, dk, dv, plan.cols, plan.bounds_for(cfg["DKDV_BLOCK_N"]),
            *_bsh_strides(q, k, v, dout, dk, dv),
            softmax_scale, softmax_scale * LOG2E,
            sq, sk, b * hkv, hq, hkv, hq // hkv,
            **head_dim_meta(d, v.shape[3]), BLOCK_M=cfg["DKDV_BLOCK_M"], BLOCK_N=cfg["DKDV_BLOCK_N"],
            HAS_LT=plan.has_lt, HAS_UT=plan.has_ut, SWEEP=min(cfg["dkdv_sweep"], 1),
            num_warps=cfg["dkdv_num_warps"], num_stages=cfg["dkdv_num_stages"],
        )
        with beside():
            flashmask_bwd_dq_kernel[(triton.cdiv(sq, cfg["DQ_BLOCK_M"]) * b * hq,)](
                q, k, v, dout, lse, delta, dq, plan.cols, plan.bounds_for(cfg["DQ_BLOCK_N"]),
                *_bsh_strides(q, k, v, dout, dq),
                softmax_scale, softmax_scale * LOG2E,
                sq, sk, b * hq, hq, hq // hkv,
                **head_dim_meta(d, v.shape[3]), BLOCK_M=cfg["DQ_BLOCK_M"], BLOCK_N=cfg["DQ_BLOCK_N"],
                HAS_LT=plan.has_lt, HAS_UT=plan.has_ut,
                num_warps=DQ_NUM_WARPS, num_stages=cfg["dq_num_stages"],
            )
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Autograd and the public function
# ----------------------------------------------------------------------------------------------


def _fm_bwd(dout, dlse, q, k, v, out, lse, plan, softmax_scale, cfg):
    return flashmask_bwd(dout, q, k, v, out, lse, plan, softmax_scale, cfg, dlse=dlse)


#: ``apply(q, k, v, plan, softmax_scale, cfg) -> (out, lse)``
FlashMaskAttentionFunction = attention_function(
    "FlashMaskAttentionFunction", flashmask_fwd, _fm_bwd,
    """``(q, k, v) -> (out, lse)`` with the plan and config carried as non-tensor arguments.""")


def flashmask_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_or_columns,
                        softmax_scale=None, return_lse: bool = False,
                        config: Optional[dict] = None, deterministic: bool = False):
    """FlashMask attention of ``q [B, Sq, Hq, D_qk]`` over ``k [B, Sk, Hkv, D_qk]``,
    ``v [B, Sk, Hkv, D_v]`` (``out [B, Sq, Hq, D_v]``).

    ``mask_or_columns`` is a ``RangeMask`` (lowered with ``flashmask_columns``; a mask that is not
    column intervals raises ``NotExpressible``, a ``ValueError``) or a ``FlashMaskColumns`` of
    ``Sk`` columns. Differentiable in q, k, v (and through ``lse`` when returned). ``config``
    overrides launch parameters (``CONFIG_KEYS``). Returns ``out`` in q's dtype, or
    ``(out, lse)`` with ``lse [B, Hq, Sq]`` float32 (natural log; ``-inf`` and a zero output row
    where a query row attends nothing).

    ``deterministic``: accepted for the API's sake and always honoured, at no cost: the backward
    has no atomics (dK/dV summed over a GQA group in registers, one dQ program per tile), so its
    gradients are bitwise identical run to run whatever the flag.
    """
    cols = _columns_of(mask_or_columns)
    sq_mask = int(mask_or_columns.seqlen_q) if isinstance(mask_or_columns, RangeMask) else None
    if isinstance(mask_or_columns, RangeMask) and int(mask_or_columns.seqlen_k) != len(cols.lts):
        raise ValueError("mask and its columns disagree on Sk")  # pragma: no cover - IR invariant
    _check_inputs(q, k, v, sq_mask, len(cols.lts))
    softmax_scale = _resolve_scale(softmax_scale, q.shape[-1])
    cfg = resolve_config(config_head_dim(q.shape[-1], v.shape[-1]), q.dtype, config, q=q, k=k, v=v,
                         mask=mask_or_columns if isinstance(mask_or_columns, RangeMask) else None)
    plan = flashmask_plan(cols, q.shape[1], q.device)
    out, lse = FlashMaskAttentionFunction.apply(q, k, v, plan, softmax_scale, cfg)
    return (out, lse) if return_lse else out

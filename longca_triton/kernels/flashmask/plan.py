"""FlashMask's preprocessing: the columns on the device and the per-key-tile min/max
(``tile_bounds``), cached per mask (see ``longca_triton/kernels/flashmask/op.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton

from longca_triton.masks.ir import BlockSparseMask, RangeMask
from longca_triton.masks.lowerings import FlashMaskColumns, NotExpressible, flashmask_columns

from longca_triton.kernels.flashmask.fwd import flashmask_classify_kernel
from longca_triton.kernels.core.plan_cache import PlanCache

__all__ = ["FlashMaskPlan", "flashmask_plan", "tile_bounds", "classify_tiles"]

_CACHE = PlanCache(64)


@dataclass
class FlashMaskPlan:
    """Device metadata of one mask: the normalised columns and, per ``BLOCK_N``, the tile bounds."""

    seqlen_q: int
    seqlen_k: int
    cols: torch.Tensor  # int32 [4, Sk]: LTS, LTE, UTS, UTE
    has_lt: bool
    has_ut: bool
    bounds: dict  # BLOCK_N -> int32 [cdiv(Sk, BLOCK_N), 8]

    def bounds_for(self, block_n: int) -> torch.Tensor:
        if block_n not in self.bounds:
            self.bounds[block_n] = tile_bounds(self.cols, block_n)
        return self.bounds[block_n]


def _normalised_columns(cols: FlashMaskColumns, seqlen_q: int, device) -> torch.Tensor:
    """int32 ``[4, Sk]`` on ``device``: clipped to ``[0, Sq]``; empty LT -> ``[Sq, Sq)``, empty UT
    -> ``[0, 0)`` (the same mask; the tile min/max are then as tight as the mask allows)."""
    t = torch.stack([torch.as_tensor(np.asarray(getattr(cols, n)), dtype=torch.int64)
                     for n in ("lts", "lte", "uts", "ute")]).to(device)
    t = t.clamp_(0, seqlen_q)
    lts, lte, uts, ute = t.unbind(0)
    lt_empty = lte <= lts
    ut_empty = ute <= uts
    lts = torch.where(lt_empty, seqlen_q, lts)
    lte = torch.where(lt_empty, seqlen_q, lte)
    uts = torch.where(ut_empty, 0, uts)
    ute = torch.where(ut_empty, 0, ute)
    return torch.stack([lts, lte, uts, ute]).to(torch.int32).contiguous()


def tile_bounds(cols: torch.Tensor, block_n: int) -> torch.Tensor:
    """FlashMask's preprocessing: per key tile of ``block_n`` columns, int32 ``[num_tiles, 8]``
    ``[LTS_min, LTS_max, LTE_min, LTE_max, UTS_min, UTS_max, UTE_min, UTE_max]``.

    ``cols`` is int32 ``[4, Sk]`` (LTS, LTE, UTS, UTE). Torch ops on ``cols``' device, ``O(Sk)``.
    The ragged last tile is padded with its last real column, which leaves min and max unchanged.
    """
    sk = cols.shape[1]
    num_n = triton.cdiv(sk, block_n)
    if num_n == 0:
        return torch.zeros((0, 8), dtype=torch.int32, device=cols.device)
    pad = num_n * block_n - sk
    if pad:
        cols = torch.cat([cols, cols[:, -1:].expand(4, pad)], dim=1)
    t = cols.reshape(4, num_n, block_n)
    mm = torch.stack([t.amin(dim=2), t.amax(dim=2)], dim=2)  # [4, num_n, 2]
    return mm.permute(1, 0, 2).reshape(num_n, 8).to(torch.int32).contiguous()


def _columns_of(mask_or_columns) -> FlashMaskColumns:
    if isinstance(mask_or_columns, FlashMaskColumns):
        return mask_or_columns
    if isinstance(mask_or_columns, BlockSparseMask):
        raise NotExpressible("FlashMask columns need a RangeMask; block-sparse masks are not "
                             "column intervals")
    if isinstance(mask_or_columns, RangeMask):
        return flashmask_columns(mask_or_columns)  # raises NotExpressible with the column
    raise ValueError(f"mask_or_columns must be a RangeMask or FlashMaskColumns, got "
                     f"{type(mask_or_columns).__name__}")


def flashmask_plan(mask_or_columns, seqlen_q: int, device) -> FlashMaskPlan:
    """The device metadata for a ``RangeMask`` or ``FlashMaskColumns``, cached (``PlanCache``) on
    the columns object (for a mask, its lowering, cached on the mask) per ``Sq`` and device."""
    cols = _columns_of(mask_or_columns)
    sk = len(cols.lts)
    if not (len(cols.lte) == len(cols.uts) == len(cols.ute) == sk):
        raise ValueError("FlashMaskColumns vectors have different lengths: "
                         f"{len(cols.lts)}, {len(cols.lte)}, {len(cols.uts)}, {len(cols.ute)}")

    def build(dev):
        t = _normalised_columns(cols, int(seqlen_q), dev)
        has_lt = bool((t[1] > t[0]).any().item())
        has_ut = bool((t[3] > t[2]).any().item())
        return FlashMaskPlan(int(seqlen_q), sk, t, has_lt, has_ut, {})

    return _CACHE.get(cols, (int(seqlen_q),), device, build)


def classify_tiles(plan: FlashMaskPlan, block_m: int, block_n: int) -> torch.Tensor:
    """int8 ``[cdiv(Sq, block_m), cdiv(Sk, block_n)]`` of ``EMPTY / PARTIAL / FULL``, computed by
    the kernels' own ``_classify`` (a Triton launch: CUDA, or the interpreter on a CPU)."""
    num_m, num_n = triton.cdiv(plan.seqlen_q, block_m), triton.cdiv(plan.seqlen_k, block_n)
    out = torch.empty((num_m, num_n), dtype=torch.int8, device=plan.cols.device)
    if num_m * num_n:
        flashmask_classify_kernel[(num_m, num_n)](
            plan.bounds_for(block_n), out, plan.seqlen_q, plan.seqlen_k, BLOCK_M=block_m,
            BLOCK_N=block_n, HAS_LT=plan.has_lt, HAS_UT=plan.has_ut)
    return out

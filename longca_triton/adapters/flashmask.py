"""``flashmask``: FlashMask's own PyTorch build (PaddlePaddle/flash-attention, ``flashmask_v2``:
``flashmask_interface.flashmask_attention``), when importable.

Lowering (``flashmask_startend``): the IR's FlashMask columns (``flashmask_columns``: per key
column ``j`` the masked rows ``[LTS, LTE) ∪ [UTS, UTE)``) in the most compact of FlashMask's
four encodings of ``startend_row_indices [B, 1, Sk, n]``:

* ``causal=True,  n=1``: masked = ``[0, j) ∪ [LTS, Sq)``
* ``causal=True,  n=2``: masked = ``[0, j) ∪ [LTS, LTE)``
* ``causal=False, n=2``: masked = ``[0, UTE) ∪ [LTS, Sq)``
* ``causal=False, n=4``: masked = ``[UTS, UTE) ∪ [LTS, LTE)``

The causal forms are used when every column's upper masked interval is exactly ``[0, j)``.
Block-sparse masks are not column intervals and are reported unsupported. A Paddle-only install
is reported unavailable (bridging Paddle's autograd into PyTorch is not done here). Absent on our
GPU host: "not measured here" (docs/backends.md).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch

from longca_triton.masks import flashmask_columns

from ._common import PlannedBackend, try_import
from .base import Problem, register

__all__ = ["FlashMask", "flashmask_startend"]

_MODULES = ("flashmask_interface", "flashmask.flashmask_interface", "flash_mask.flashmask_interface")


def flashmask_startend(mask) -> tuple[np.ndarray, bool]:
    """``(startend [Sk, n] int32, causal)`` for ``flashmask_attention``; raises ``NotExpressible``."""
    cols = flashmask_columns(mask)
    Sq, Sk = mask.seqlen_q, mask.seqlen_k
    lts, lte, uts, ute = (np.asarray(getattr(cols, n), dtype=np.int64) for n in ("lts", "lte", "uts", "ute"))
    j = np.arange(Sk, dtype=np.int64)
    # an empty LT interval may be written as [Sq, Sq): normalise so comparisons below see it
    empty_lt = lte <= lts
    lts = np.where(empty_lt, Sq, lts)
    lte = np.where(empty_lt, Sq, lte)
    causal = Sq == Sk and bool(np.all(((uts == 0) & (ute == j)) | ((ute <= uts) & (j == 0))))
    if causal:
        if np.all(lte == Sq):
            return lts[:, None].astype(np.int32), True
        return np.stack([lts, lte], axis=1).astype(np.int32), True
    empty_ut = ute <= uts
    uts = np.where(empty_ut, 0, uts)
    ute = np.where(empty_ut, 0, ute)
    if np.all(uts == 0) and np.all(lte == Sq):
        return np.stack([lts, ute], axis=1).astype(np.int32), False
    return np.stack([lts, lte, uts, ute], axis=1).astype(np.int32), False


@dataclass
class _FMPlan:
    fn: object
    startend: torch.Tensor
    causal: bool
    lse_kw: dict


class FlashMask(PlannedBackend):
    name = "flashmask"
    description = "FlashMask (PaddlePaddle/flash-attention flashmask_v2, PyTorch build): column-interval masks"
    lowering = "flashmask_columns -> startend_row_indices (1, 2 or 4 columns) + causal"
    head_dims = (64, 128, 256)

    def _module(self):
        reasons = []
        for name in _MODULES:
            mod, why = try_import(name)
            if mod is not None and hasattr(mod, "flashmask_attention"):
                return mod, ""
            reasons.append(why or f"{name} has no flashmask_attention")
        return None, "; ".join(reasons)

    def available(self):
        mod, why = self._module()
        if mod is None:
            paddle, _ = try_import("paddle")
            if paddle is not None:
                return False, "only Paddle's FlashMask is installed; the Paddle-to-PyTorch bridge is not implemented"
            return False, f"FlashMask's PyTorch build is not installed ({why})"
        return super().available()

    def lower(self, problem: Problem):
        return flashmask_startend(problem.mask)

    def materialize(self, problem: Problem, lowered, device) -> _FMPlan:
        startend, causal = lowered
        mod, _ = self._module()
        t = torch.as_tensor(startend, device=device)[None, None].expand(problem.batch, 1, -1, -1).contiguous()
        params = inspect.signature(mod.flashmask_attention).parameters
        lse_kw = {"return_softmax_lse": True} if "return_softmax_lse" in params else {}
        return _FMPlan(fn=mod.flashmask_attention, startend=t, causal=causal, lse_kw=lse_kw)

    def run(self, plan: _FMPlan, q, k, v, scale: float):
        res = plan.fn(q, k, v, startend_row_indices=plan.startend, causal=plan.causal, softmax_scale=scale, **plan.lse_kw)
        if isinstance(res, tuple):
            out, lse = res[0], (res[1] if len(res) > 1 else None)
        else:
            out, lse = res, None
        return out, (lse.float() if lse is not None else None)


register(FlashMask())

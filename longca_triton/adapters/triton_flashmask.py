"""Our Triton port of FlashMask (``longca_triton/kernels/flashmask.py``) as the ``flashmask-triton`` backend.

The mask is lowered to FlashMask's column form (``flashmask_columns``: per key column the masked
rows ``[LTS, LTE) ∪ [UTS, UTE)``); the kernels classify each tile at run time from per-key-tile
min/max of those vectors and build partial tiles' element masks from the column vectors. Masks
that are not column intervals (block-sparse, or a column with two allowed gaps) are unsupported.
Launch configs are the kernel's defaults (no autotune entry).
"""

from __future__ import annotations

import importlib
import os

import torch

from longca_triton.masks import BlockSparseMask, NotExpressible, flashmask_columns

from .base import Backend, Problem, Unsupported, register

_DTYPES = (torch.float16, torch.bfloat16)


def _runs_here(device_type: str) -> tuple[bool, str]:
    if device_type == "cuda":
        return True, ""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, ""
    return False, "Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on a CPU, for testing)"


class TritonFlashMask(Backend):
    name = "flashmask-triton"
    description = ("Triton port of FlashMask's column-interval algorithm (LTS/LTE/UTS/UTE, "
                   "per-tile min/max classification), fwd+bwd")

    def available(self):
        try:
            importlib.import_module("triton")
        except ImportError as e:  # pragma: no cover - triton is a core dependency
            return False, f"triton not importable: {e}"
        return True, ""

    def supports(self, problem: Problem):
        from longca_triton.kernels.flashmask import SUPPORTED_HEAD_DIMS

        if isinstance(problem.mask, BlockSparseMask):
            return False, "block-sparse masks are not FlashMask column intervals"
        ok, why = _runs_here(problem.device)
        if not ok:
            return False, why
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        if problem.dtype not in _DTYPES and not (interp and problem.dtype == torch.float32):
            return False, f"dtype {problem.dtype} (kernels take float16 and bfloat16)"
        if problem.head_dim not in SUPPORTED_HEAD_DIMS:
            return False, f"head_dim {problem.head_dim} (supported: {SUPPORTED_HEAD_DIMS})"
        if problem.heads_kv < 1 or problem.heads_q % problem.heads_kv:
            return False, f"heads_q {problem.heads_q} is not a multiple of heads_kv {problem.heads_kv}"
        try:
            flashmask_columns(problem.mask)  # cached on the mask
        except NotExpressible as e:
            return False, f"not expressible as FlashMask columns: {e}"
        return True, ""

    def attention(self, q, k, v, mask, softmax_scale=None, return_lse=False):
        from longca_triton.kernels.flashmask import flashmask_attention

        return flashmask_attention(q, k, v, mask, softmax_scale=softmax_scale, return_lse=return_lse)

    def prepare(self, problem: Problem, q, k, v):
        """Lower the mask and build the device metadata (columns, tile min/max) now, outside any
        timer; the returned call runs the kernels only."""
        from longca_triton.kernels.flashmask import flashmask_plan, resolve_config

        ok, why = self.check(problem)
        if not ok:
            raise Unsupported(why)
        plan = flashmask_plan(problem.mask, q.shape[1], q.device)
        cfg = resolve_config(q.shape[-1], q.dtype)
        for key in ("BLOCK_N", "DKDV_BLOCK_N", "DQ_BLOCK_N"):
            plan.bounds_for(cfg[key])
        return super().prepare(problem, q, k, v)


register(TritonFlashMask())

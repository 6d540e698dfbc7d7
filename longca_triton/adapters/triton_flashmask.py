"""Our Triton port of FlashMask (``longca_triton/kernels/flashmask/op.py``) as the ``triton-flashmask``
backend (old name ``flashmask-triton``, still accepted by ``get_backend``).

The mask is lowered to FlashMask's column form (``flashmask_columns``: per key column the masked
rows ``[LTS, LTE) ∪ [UTS, UTE)``); the kernels classify each tile at run time from per-key-tile
min/max of those vectors and build partial tiles' element masks from the column vectors. Masks
that are not column intervals (block-sparse, or a column with two allowed gaps) are unsupported.
Launch configs: the autotune cache's entry if it has one, else the kernel's defaults.
"""

from __future__ import annotations

from longca_triton.masks import BlockSparseMask, NotExpressible, flashmask_columns

from .base import Problem, register
from .triton_base import TritonBackend


class TritonFlashMask(TritonBackend):
    name = "triton-flashmask"
    description = ("our Triton port of FlashMask's column-interval algorithm (LTS/LTE/UTS/UTE, "
                   "per-tile min/max classification), GQA, fwd+bwd")
    attention_op = ("longca_triton.kernels.flashmask.op", "flashmask_attention")

    def mask_reason(self, problem: Problem) -> str:
        if isinstance(problem.mask, BlockSparseMask):
            return "block-sparse masks are not FlashMask column intervals"
        try:
            flashmask_columns(problem.mask)  # cached on the mask
        except NotExpressible as e:
            return f"not expressible as FlashMask columns: {e}"
        return ""

    def plan(self, problem: Problem, q, config):
        """The column lowering and the device metadata (columns, per-tile min/max)."""
        from longca_triton.kernels.core.runtime import config_head_dim
        from longca_triton.kernels.flashmask.op import flashmask_plan, resolve_config

        plan = flashmask_plan(problem.mask, q.shape[1], q.device)
        cfg = resolve_config(config_head_dim(problem.head_dim, problem.d_v), problem.dtype, config)
        for key in ("BLOCK_N", "DKDV_BLOCK_N", "DQ_BLOCK_N"):
            plan.bounds_for(cfg[key])


register(TritonFlashMask())

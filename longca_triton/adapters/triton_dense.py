"""Our dense Triton kernel (``longca_triton/kernels/dense*.py``) as the ``triton`` backend.

The kernel classifies tiles from the IR's block tables and masks partial tiles from per-row
intervals. Launch configs come from the autotune cache when it has this problem class, else
from the kernel's defaults (``TritonBackend``); ``prepare`` builds the tile plans untimed.
"""

from __future__ import annotations

from longca_triton.masks import BlockSparseMask

from .base import Problem, register
from .triton_base import TritonBackend


class TritonDense(TritonBackend):
    name = "triton"
    description = "longca-triton's dense Triton kernel: block tables, full/partial tiles, GQA, fwd+bwd"
    attention_op = ("longca_triton.kernels.dense.op", "dense_attention")

    def mask_reason(self, problem: Problem) -> str:
        if isinstance(problem.mask, BlockSparseMask):
            return "block-sparse masks run on triton-sparse / triton-varblock"
        return ""

    def plan(self, problem: Problem, q, config):
        from longca_triton.kernels.core.runtime import config_head_dim
        from longca_triton.kernels.dense.op import plans_for, resolve_config

        cfg = resolve_config(config_head_dim(problem.head_dim, problem.d_v), problem.dtype, config, mask=problem.mask)
        plans_for(problem.mask, cfg, q.device)


register(TritonDense())

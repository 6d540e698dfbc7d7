"""Our dense Triton kernel (``longca_triton/kernels/dense*.py``) as the ``triton`` backend.

The kernel classifies tiles from the IR's block tables and masks partial tiles from per-row
intervals. Launch configs come from the autotune cache when it has this problem class, else
from the kernel's defaults.
"""

from __future__ import annotations

import os

import torch

from longca_triton.masks import BlockSparseMask

from .base import Backend, Problem, register

_DTYPES = (torch.float16, torch.bfloat16)


def _runs_here(device_type: str) -> tuple[bool, str]:
    if device_type == "cuda":
        return True, ""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, ""
    return False, "Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on a CPU, for testing)"


class TritonDense(Backend):
    name = "triton"
    description = "longca-triton's dense Triton kernel: block tables, full/partial tiles, GQA, fwd+bwd"

    def available(self):
        try:
            import triton  # noqa: F401
        except ImportError as e:  # pragma: no cover - triton is a core dependency
            return False, f"triton not importable: {e}"
        return True, ""

    def supports(self, problem: Problem):
        from longca_triton.kernels.dense import SUPPORTED_HEAD_DIMS

        if isinstance(problem.mask, BlockSparseMask):
            return False, "block-sparse masks run on triton-sparse / triton-varblock"
        ok, why = _runs_here(problem.device)
        if not ok:
            return False, why
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        if problem.dtype not in _DTYPES and not (interp and problem.dtype == torch.float32):
            return False, f"dtype {problem.dtype} (kernels take float16 and bfloat16)"
        if problem.head_dim not in SUPPORTED_HEAD_DIMS:
            return False, f"head_dim {problem.head_dim} (supported: {SUPPORTED_HEAD_DIMS})"
        return True, ""

    def attention(self, q, k, v, mask, softmax_scale=None, return_lse=False):
        from longca_triton.kernels.tuned import lookup
        from longca_triton.kernels.dense import dense_attention

        return dense_attention(q, k, v, mask, softmax_scale=softmax_scale, return_lse=return_lse,
                               config=lookup(self.name, q, k, mask))


register(TritonDense())

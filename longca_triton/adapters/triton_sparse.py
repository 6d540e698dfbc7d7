"""Our block-sparse Triton kernels as backends: ``triton-sparse`` (uniform blocks) and
``triton-varblock`` (any block bounds). Both run ``longca_triton/kernels/block_sparse.py``: one tile grid where
every block is processed in fixed-size sub-tiles carrying their valid length; for uniform
power-of-two blocks the sub-tile is the block and the tail mask compiles away.

``prepare`` builds the GPU tables (q→k lists and their k→q transposes) before returning the timed
callable; ``table_build_ms(problem)`` reports that build time separately. Launch configs come from
the autotune cache when it has the problem class (``longca-triton autotune --block 64|128`` for
``triton-sparse``, ``--varblock`` for ``triton-varblock``), else from the kernel's defaults. Under
``torch.compile`` too: ``attention`` calls the kernels through their ``torch.library`` ops.
"""

from __future__ import annotations

import os

import torch

from longca_triton.masks import BlockSparseMask

from .base import Backend, Problem, Unsupported, register

__all__ = ["TritonSparse", "TritonVarblock"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class _TritonBlockSparse(Backend):
    modes = ("fwd", "bwd", "fwd_bwd")
    returns_lse = True

    def available(self):
        try:
            import triton  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return False, f"cannot import triton ({type(e).__name__}: {e})"
        if not torch.cuda.is_available() and not _interpreting():
            return False, "needs a CUDA GPU (or TRITON_INTERPRET=1 for the CPU interpreter)"
        return True, ""

    def _mask_ok(self, mask: BlockSparseMask) -> str:
        return ""

    def supports(self, problem: Problem):
        from longca_triton.kernels.block_sparse import SUPPORTED_HEAD_DIMS

        mask = problem.mask
        if not isinstance(mask, BlockSparseMask):
            return False, f"{self.name} takes block-sparse masks (BlockSparseMask), not {type(mask).__name__}"
        why = self._mask_ok(mask)
        if why:
            return False, why
        allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if _interpreting() else ())
        if problem.dtype not in allowed:
            return False, f"dtype {problem.dtype} not supported (takes float16, bfloat16)"
        if problem.head_dim not in SUPPORTED_HEAD_DIMS:
            return False, f"head_dim {problem.head_dim} not supported (takes {SUPPORTED_HEAD_DIMS})"
        if problem.heads_q % problem.heads_kv:
            return False, f"heads_q {problem.heads_q} is not a multiple of heads_kv {problem.heads_kv}"
        if problem.heads_q % mask.num_patterns:
            return False, f"the mask's {mask.num_patterns} patterns do not divide {problem.heads_q} query heads"
        if problem.device != "cuda" and not _interpreting():
            return False, f"{self.name} runs on CUDA (problem device: {problem.device})"
        if problem.seqlen_q * problem.heads_q * problem.head_dim >= 2**31:
            return False, "Sq * Hq * D >= 2^31 per batch entry (32-bit row offsets in the dK/dV loop)"
        return True, ""

    @torch.compiler.disable
    def launch_config(self, q, k, mask):
        """An explicit ``self.config``, else the autotune cache's entry for this problem class
        (``longca-triton autotune --block N`` / ``--varblock``), else None (the kernel's defaults)."""
        explicit = getattr(self, "config", None)
        if explicit is not None:
            return explicit
        from longca_triton.kernels.tuned import lookup

        return lookup(self.name, q, k, mask)

    def attention(self, q, k, v, mask, softmax_scale=None, return_lse=False):
        """Through the ``torch.library`` ops (same kernels, same numbers as the autograd path), so
        that a ``torch.compile``'d caller captures the kernels as graph nodes. Why always, and not
        only when compiling: TorchDynamo skips every file under a ``triton/backends`` path (its rule
        for Triton's own backends also matches ``longca_triton/adapters``), so this frame always
        runs eagerly and cannot tell whether it was called from a compiled region; Dynamo then
        compiles the kernel wrapper it calls as a frame of its own, and only the op path traces."""
        from longca_triton.kernels import block_sparse as BS

        config = self.launch_config(q, k, mask)
        return BS.block_sparse_attention_op(q, k, v, mask, softmax_scale=softmax_scale, return_lse=return_lse,
                                            config=config)

    def prepare(self, problem: Problem, q, k, v):
        from longca_triton.kernels import block_sparse as BS

        ok, why = self.check(problem)
        if not ok:
            raise Unsupported(why)
        config = problem.extra.get("config")
        if config is None:
            config = self.launch_config(q, k, problem.mask)
        cfg = BS.resolve_config(problem.mask, problem.head_dim, config)
        BS.tables_for(problem.mask, cfg, q.device)  # built (and cached) here, outside the timer
        mask, scale = problem.mask, problem.softmax_scale

        def fn():
            return BS.block_sparse_attention(q, k, v, mask, softmax_scale=scale, return_lse=True, config=config)

        return fn

    def table_build_ms(self, problem: Problem, device="cuda") -> dict:
        """Median ms to build the fwd / dq / dkdv tables on ``device`` (from scratch, no cache)."""
        from longca_triton.kernels.block_sparse import table_build_time

        return table_build_time(problem.mask, problem.head_dim, device, problem.extra.get("config"))


class TritonSparse(_TritonBlockSparse):
    name = "triton-sparse"
    description = ("our Triton block-sparse kernel, uniform blocks (tile = block, power of two >= 16), "
                   "fwd + bwd, GQA, lse")

    def _mask_ok(self, mask):
        ub = mask.uniform_block
        if ub is None:
            return "blocks are not uniform (use triton-varblock)"
        if ub < 16 or ub & (ub - 1):
            return f"uniform block {ub} is not a power of two >= 16 (use triton-varblock)"
        return ""


class TritonVarblock(_TritonBlockSparse):
    name = "triton-varblock"
    description = ("our Triton block-sparse kernel, any block bounds (blocks in 64-row sub-tiles "
                   "carrying their valid length), fwd + bwd, GQA, lse")


register(TritonSparse())
register(TritonVarblock())

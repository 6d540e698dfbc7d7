"""Our block-sparse Triton kernels as backends: ``triton-sparse`` (uniform blocks) and
``triton-varblock`` (any block bounds). Both run ``longca_triton/kernels/block_sparse/op.py``: one tile grid where
every block is processed in fixed-size sub-tiles carrying their valid length; for uniform
power-of-two blocks the sub-tile is the block and the tail mask compiles away.

``prepare`` builds the GPU tables (q→k lists and their k→q transposes) before returning the timed
callable; ``table_build_ms(problem)`` reports that build time separately. Launch configs come from
the autotune cache when it has the problem class (``longca-triton autotune --block 64|128`` for
``triton-sparse``, ``--varblock`` for ``triton-varblock``), else from the kernel's defaults. Under
``torch.compile`` too: ``attention`` calls the kernels through their ``torch.library`` ops.
"""

from __future__ import annotations

from longca_triton.masks import BlockSparseMask

from .base import Problem, register
from .triton_base import TritonBackend

__all__ = ["TritonSparse", "TritonVarblock"]


class _TritonBlockSparse(TritonBackend):

    def _mask_ok(self, mask: BlockSparseMask) -> str:
        return ""

    def mask_reason(self, problem: Problem) -> str:
        mask = problem.mask
        if not isinstance(mask, BlockSparseMask):
            return f"{self.name} takes block-sparse masks (BlockSparseMask), not {type(mask).__name__}"
        why = self._mask_ok(mask)
        if why:
            return why
        if problem.heads_q % mask.num_patterns:
            return f"the mask's {mask.num_patterns} patterns do not divide {problem.heads_q} query heads"
        if problem.seqlen_q * problem.heads_q * problem.head_dim >= 2**31:
            return "Sq * Hq * D >= 2^31 per batch entry (32-bit row offsets in the dK/dV loop)"
        return ""

    #: the representative mask ``check_config`` resolves a config on (make_mask's name and parameters)
    probe_mask = ("block_sparse", dict(block=128, density=0.5))

    def check_config(self, config):
        from longca_triton.kernels.block_sparse.op import resolve_config
        from longca_triton.masks import make_mask

        name, params = self.probe_mask
        resolve_config(make_mask(name, 1024, patterns=2, seed=0, **params), 128, config, heads=(8, 2))

    def launch(self, q, k, v, mask, scale, return_lse, config, deterministic=False):
        from longca_triton.kernels.block_sparse.op import block_sparse_attention

        return block_sparse_attention(q, k, v, mask, softmax_scale=scale, return_lse=return_lse, config=config,
                                      deterministic=deterministic)

    def run_kernels(self, q, k, v, mask, scale, return_lse, deterministic):
        """Through the ``torch.library`` ops (same kernels, same numbers as the autograd path), so
        that a ``torch.compile``'d caller captures the kernels as graph nodes. Why always, and not
        only when compiling: TorchDynamo skips every file under a ``triton/backends`` path (its rule
        for Triton's own backends also matches ``longca_triton/adapters``), so this frame always
        runs eagerly and cannot tell whether it was called from a compiled region; Dynamo then
        compiles the kernel wrapper it calls as a frame of its own, and only the op path traces."""
        from longca_triton.kernels.block_sparse.op import block_sparse_attention_op

        return block_sparse_attention_op(q, k, v, mask, softmax_scale=scale, return_lse=return_lse,
                                         config=self.launch_config(q, k, mask, v), deterministic=deterministic)

    def plan(self, problem: Problem, q, config):
        """The GPU tables (q->k lists and their k->q transposes), built and cached here."""
        from longca_triton.kernels.block_sparse import op as BS
        from longca_triton.kernels.core.runtime import config_head_dim

        cfg = BS.resolve_config(problem.mask, config_head_dim(problem.head_dim, problem.d_v), config,
                                heads=(problem.heads_q, problem.heads_kv))
        BS.tables_for(problem.mask, cfg, q.device)

    def table_build_ms(self, problem: Problem, device="cuda") -> dict:
        """Median ms to build the fwd / dq / dkdv tables on ``device`` (from scratch, no cache)."""
        from longca_triton.kernels.core.runtime import config_head_dim
        from longca_triton.kernels.block_sparse.op import table_build_time

        return table_build_time(problem.mask, config_head_dim(problem.head_dim, problem.d_v), device,
                                problem.extra.get("config"), heads=(problem.heads_q, problem.heads_kv))


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
    probe_mask = ("varblock_sparse", dict(block=256, min_block=128, density=0.5))


register(TritonSparse())
register(TritonVarblock())

"""FlashInfer block-sparse attention (``flashinfer-python``) on our ``BlockSparseMask``; forward only.

* ``flashinfer-bsr``: ``BlockSparseAttentionWrapper`` (BSR: one block size ``R x C``, ``indptr``
  over query blocks, ``indices`` of kept key blocks). Its BSR is head-independent, so it takes a
  mask with one pattern (``P = 1``); ``Sk`` must be a multiple of the block (``N % C == 0``), the
  last query block may be short.
* ``flashinfer-varblock``: ``VariableBlockSparseAttentionWrapper`` (any bounds: ``block_row_sz`` /
  ``block_col_sz`` and a block map per KV head). Takes ``P = Hkv`` (pattern per KV head, shared by
  its query heads, as the wrapper defines it) or ``P = 1`` (broadcast to every KV head).

Both are planned in ``materialize`` (``wrapper.plan``: index building, host copies and the JIT
compile of the kernel on first use), outside any timed region; ``run`` is ``wrapper.run`` only.
No batch dimension in either wrapper: batch 1. Layouts: the BSR wrapper takes ``q [S, Hq, D]``
(our ``q[0]``, a view); the variable one takes ``[H, S, D]`` and rearranges internally. lse:
FlashInfer's log-sum-exp is base 2; the adapter returns ``lse · ln 2`` as ``[B, Hq, S]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from longca_triton.masks import BlockSparseMask

from ._common import PlannedBackend, dist_version, try_import
from .base import Problem, Unsupported, register

__all__ = ["BsrArgs", "VarblockArgs", "bsr_lowering", "bsr_to_dense", "varblock_lowering", "varblock_to_dense",
           "FlashInferBSR", "FlashInferVarblock"]

LN2 = math.log(2.0)
WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class BsrArgs:
    indptr: np.ndarray  # int32 [MB + 1]
    indices: np.ndarray  # int32 [nnz]
    M: int  # Sq
    N: int  # Sk
    R: int  # block rows
    C: int  # block cols


def bsr_lowering(mask) -> BsrArgs:
    """``BlockSparseAttentionWrapper.plan`` arguments; raises ``Unsupported`` saying why not."""
    if not isinstance(mask, BlockSparseMask):
        raise Unsupported(f"FlashInfer BSR takes block-sparse masks, not {type(mask).__name__}")
    ub = mask.uniform_block
    if ub is None:
        raise Unsupported("BSR needs one block size (use flashinfer-varblock for variable blocks)")
    if mask.num_patterns != 1:
        raise Unsupported(f"BSR is head-independent: one pattern, the mask has P = {mask.num_patterns} "
                          "(flashinfer-varblock takes a pattern per KV head)")
    if mask.seqlen_k % ub:
        raise Unsupported(f"BSR needs Sk ({mask.seqlen_k}) to be a multiple of the block ({ub})")
    bm = mask.block_map[0].numpy()
    counts = bm.sum(axis=1).astype(np.int64)
    indptr = np.zeros(bm.shape[0] + 1, dtype=np.int64)
    indptr[1:] = np.cumsum(counts)
    indices = np.nonzero(bm)[1]  # row-major: ascending key blocks per query block
    return BsrArgs(indptr.astype(np.int32), indices.astype(np.int32), mask.seqlen_q, mask.seqlen_k, ub, ub)


def bsr_to_dense(a: BsrArgs) -> torch.Tensor:
    """bool ``[M, N]`` the BSR arguments allow (for tests)."""
    mb, nb = len(a.indptr) - 1, a.N // a.C
    tiles = np.zeros((mb, nb), dtype=bool)
    for i in range(mb):
        tiles[i, a.indices[a.indptr[i]:a.indptr[i + 1]]] = True
    dense = np.repeat(np.repeat(tiles, a.R, axis=0), a.C, axis=1)
    return torch.from_numpy(dense[: a.M, : a.N])


@dataclass(frozen=True)
class VarblockArgs:
    block_mask_map: torch.Tensor  # bool [Hkv, MB, NB]
    block_row_sz: torch.Tensor  # int32 [Hkv, MB]
    block_col_sz: torch.Tensor  # int32 [Hkv, NB]


def varblock_lowering(mask, heads_q: int, heads_kv: int) -> VarblockArgs:
    """``VariableBlockSparseAttentionWrapper.plan`` arguments (CPU tensors)."""
    if not isinstance(mask, BlockSparseMask):
        raise Unsupported(f"FlashInfer variable-block takes block-sparse masks, not {type(mask).__name__}")
    P = mask.num_patterns
    if P == 1:
        bm = mask.block_map.expand(heads_kv, -1, -1).contiguous()
    elif P == heads_kv:
        bm = mask.block_map
    else:
        raise Unsupported(f"the wrapper takes one pattern per KV head (P = {heads_kv}) or a shared one (P = 1); "
                          f"the mask has P = {P}" + (" (per query head)" if P == heads_q else ""))
    rows = torch.as_tensor(np.diff(mask.q_block_bounds), dtype=torch.int32)
    cols = torch.as_tensor(np.diff(mask.k_block_bounds), dtype=torch.int32)
    return VarblockArgs(bm.contiguous(), rows.expand(heads_kv, -1).contiguous(), cols.expand(heads_kv, -1).contiguous())


def varblock_to_dense(a: VarblockArgs) -> torch.Tensor:
    """bool ``[Hkv, Sq, Sk]`` the variable-block arguments allow (for tests)."""
    out = []
    for h in range(a.block_mask_map.shape[0]):
        m = a.block_mask_map[h].repeat_interleave(a.block_row_sz[h].long(), 0)
        out.append(m.repeat_interleave(a.block_col_sz[h].long(), 1))
    return torch.stack(out)


class _FlashInfer(PlannedBackend):
    modes = ("fwd",)
    dtypes = (torch.bfloat16, torch.float16)
    head_dims = (64, 128, 256)
    requires = "flashinfer"

    def version(self):
        return dist_version("flashinfer-python", "flashinfer")

    def static_checks(self, problem: Problem) -> str:
        if problem.batch != 1:
            return f"the wrapper plans one sequence (batch 1), got batch {problem.batch}"
        return ""


class FlashInferBSR(_FlashInfer):
    name = "flashinfer-bsr"
    description = "FlashInfer BlockSparseAttentionWrapper (BSR, one pattern for all heads), forward only"
    lowering = "uniform block map (P = 1) -> BSR indptr / indices, R = C = block"

    def lower(self, problem: Problem):
        return bsr_lowering(problem.mask)

    def materialize(self, problem: Problem, args: BsrArgs, device):
        fi = try_import("flashinfer")[0]
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        w = fi.BlockSparseAttentionWrapper(ws)
        w.plan(torch.as_tensor(args.indptr, device=device), torch.as_tensor(args.indices, device=device),
               args.M, args.N, args.R, args.C, problem.heads_q, problem.heads_kv, problem.head_dim,
               sm_scale=problem.scale, q_data_type=problem.dtype, o_data_type=problem.dtype)
        return w

    def run(self, plan, q, k, v, scale):
        out, lse = plan.run(q[0], k[0], v[0], return_lse=True)  # [S, Hq, D], [S, Hq]
        return out[None], (lse.float() * LN2).transpose(0, 1)[None]


class FlashInferVarblock(_FlashInfer):
    name = "flashinfer-varblock"
    description = ("FlashInfer VariableBlockSparseAttentionWrapper (any block bounds, a pattern per KV head), "
                   "forward only")
    lowering = "block map per KV head + block_row_sz / block_col_sz from the IR bounds"

    def lower(self, problem: Problem):
        return varblock_lowering(problem.mask, problem.heads_q, problem.heads_kv)

    def materialize(self, problem: Problem, args: VarblockArgs, device):
        fi = try_import("flashinfer")[0]
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        w = fi.VariableBlockSparseAttentionWrapper(ws)
        w.plan(args.block_mask_map.to(device), args.block_row_sz.to(device), args.block_col_sz.to(device),
               problem.heads_q, problem.heads_kv, problem.head_dim, sm_scale=problem.scale,
               q_data_type=problem.dtype)
        return w

    def run(self, plan, q, k, v, scale):
        qh, kh, vh = (t[0].transpose(0, 1) for t in (q, k, v))  # [H, S, D] views
        out, lse = plan.run(qh, kh, vh, return_lse=True)  # [Hq, S, D], [Hq, S]
        return out.transpose(0, 1)[None], (lse.float() * LN2)[None]


register(FlashInferBSR())
register(FlashInferVarblock())

"""VSA block-sparse attention (``fastvideo-kernel``) on our ``BlockSparseMask``: two honest rows.

* ``vsa-cuda``: its Hopper CUDA kernel (ThunderKittens, ``fastvideo_kernel._C`` ops
  ``block_sparse_fwd`` / ``block_sparse_bwd``, reached through the custom op
  ``fastvideo_kernel::block_sparse_attn_sm90``); loads only where its bundled libraries match the
  driver and the torch ABI.
* ``vsa-triton``: its Triton kernels (``fastvideo_kernel::block_sparse_attn_triton``), runs
  anywhere Triton does.

Lowering (``vsa_index_tensors``): VSA works on 64-token tiles, so a uniform mask with block
``64 · r`` is expanded to 64-token tiles (``r × r`` copies of every kept block: the same mask).
Per query head ``h`` its pattern's row of the map becomes ``q2k_idx [B, Hq, Nq64, K]`` (kept
key tiles first, ``-1`` padding, ``K`` = the most any row keeps) and ``q2k_num [B, Hq, Nq64]``
(the same for every batch entry); ``variable_block_sizes [Nk64]`` is all 64 (no padded tiles).
The backward's k→q transpose is built by VSA itself inside its backward op (counted in its time).

Limits (each an ``unsupported`` reason): uniform blocks that are a multiple of 64 with
``Sq, Sk`` multiples of 64; VSA's fixed scale ``1/sqrt(D)``; bf16 (its Triton kernel casts P to
bf16; the CUDA kernel is built for bf16, D = 128); no GQA in the kernel: K/V are repeated to the
query heads inside the call (counted in its time; autograd sums dK/dV back). Layout: VSA takes
``[B, H, S, D]``; the transposes are inside the call too. lse: the Triton path's ``M`` is base 2
(``lse = M · ln 2``); the CUDA path's lse format is undocumented, so ``vsa-cuda`` returns none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from longca_triton.masks import BlockSparseMask

from ._common import PlannedBackend, dist_version, try_import
from .base import Problem, Unsupported, register

__all__ = ["VSA_TILE", "VsaLowering", "vsa_lowering", "vsa_index_tensors", "vsa_to_dense", "VsaCuda", "VsaTriton"]

VSA_TILE = 64
LN2 = math.log(2.0)


@dataclass(frozen=True)
class VsaLowering:
    repeat: int  # 64-token tiles per mask block, per axis
    num_q_tiles: int
    num_k_tiles: int


def vsa_lowering(mask, heads_q: int) -> VsaLowering:
    """Check that the mask fits VSA's 64-token tiles; raise ``Unsupported`` saying why not."""
    if not isinstance(mask, BlockSparseMask):
        raise Unsupported(f"VSA takes block-sparse masks, not {type(mask).__name__}")
    ub = mask.uniform_block
    if ub is None:
        raise Unsupported("VSA needs uniform blocks (its variable_block_sizes pads 64-token tiles; "
                          "it cannot express blocks of different lengths in one sequence)")
    if ub % VSA_TILE:
        raise Unsupported(f"VSA tiles are 64 tokens; block {ub} is not a multiple of 64")
    if mask.seqlen_q % VSA_TILE or mask.seqlen_k % VSA_TILE:
        raise Unsupported(f"VSA needs Sq and Sk to be multiples of 64 (got {mask.seqlen_q}, {mask.seqlen_k})")
    if heads_q % mask.num_patterns:
        raise Unsupported(f"{mask.num_patterns} patterns do not divide {heads_q} query heads")
    return VsaLowering(ub // VSA_TILE, mask.seqlen_q // VSA_TILE, mask.seqlen_k // VSA_TILE)


def vsa_index_tensors(mask, heads_q: int, device="cpu"):
    """``(q2k_idx [1, Hq, Nq64, K] int32, q2k_num [1, Hq, Nq64] int32, variable_block_sizes [Nk64])``."""
    low = vsa_lowering(mask, heads_q)
    r = low.repeat
    bm = mask.block_map.to(device)
    if r > 1:
        bm = bm.repeat_interleave(r, dim=1).repeat_interleave(r, dim=2)
    bm = bm[torch.as_tensor(mask.pattern_of_head(heads_q), device=device)]  # [Hq, Nq64, Nk64]
    num = bm.sum(-1, dtype=torch.int32)
    width = max(1, int(num.max().item()))
    # kept tiles first, ascending (stable sort on "not kept"), then -1 padding
    idx = torch.argsort((~bm).to(torch.int8), dim=-1, stable=True)[..., :width].to(torch.int32)
    slot = torch.arange(width, device=device)
    idx = torch.where(slot[None, None, :] < num[..., None], idx, torch.full_like(idx, -1))
    sizes = torch.full((low.num_k_tiles,), VSA_TILE, dtype=torch.int32, device=device)
    return idx[None].contiguous(), num[None].contiguous(), sizes


def vsa_to_dense(q2k_idx, q2k_num, variable_block_sizes, seqlen_q: int) -> torch.Tensor:
    """Inverse of the lowering, for tests: bool ``[Hq, Sq, Sk]`` the VSA arguments allow."""
    _, H, nq, _ = q2k_idx.shape
    nk = variable_block_sizes.numel()
    tiles = torch.zeros(H, nq, nk, dtype=torch.bool)
    for h in range(H):
        for i in range(nq):
            n = int(q2k_num[0, h, i])
            tiles[h, i, q2k_idx[0, h, i, :n].long()] = True
    cols = torch.arange(VSA_TILE)[None, :] < variable_block_sizes.cpu()[:, None]  # [nk, 64] valid keys
    dense = tiles.repeat_interleave(VSA_TILE, 1).repeat_interleave(VSA_TILE, 2)
    return (dense & cols.reshape(1, 1, -1))[:, :seqlen_q]


@dataclass
class _VsaPlan:
    q2k_idx: torch.Tensor
    q2k_num: torch.Tensor
    sizes: torch.Tensor
    group: int


class _Vsa(PlannedBackend):
    dtypes = (torch.bfloat16,)
    op_name = ""
    requires = "fastvideo_kernel.block_sparse_attn"

    def static_checks(self, problem: Problem) -> str:
        if not problem.scale_is_default:
            return f"VSA fixes the softmax scale at 1/sqrt(D) = {1 / math.sqrt(problem.head_dim):.6g}"
        return ""

    def lower(self, problem: Problem):
        return vsa_lowering(problem.mask, problem.heads_q)

    def materialize(self, problem: Problem, args, device):
        idx, num, sizes = vsa_index_tensors(problem.mask, problem.heads_q, device)
        if problem.batch > 1:  # VSA indexes its lists by (batch, head, query tile)
            idx = idx.expand(problem.batch, -1, -1, -1).contiguous()
            num = num.expand(problem.batch, -1, -1).contiguous()
        return _VsaPlan(idx, num, sizes, problem.heads_q // problem.heads_kv)

    def _op(self):
        raise NotImplementedError

    def run(self, plan: _VsaPlan, q, k, v, scale):
        op = self._op()
        if plan.group > 1:  # VSA has no GQA: repeat K/V to the query heads (autograd sums dK/dV)
            k = k.repeat_interleave(plan.group, dim=2)
            v = v.repeat_interleave(plan.group, dim=2)
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # [B, H, S, D]
        out, m = op(qh, kh, vh, plan.q2k_idx, plan.q2k_num, plan.sizes)
        return out.transpose(1, 2), self._lse(m)

    def _lse(self, m):
        return None


class VsaTriton(_Vsa):
    name = "vsa-triton"
    description = ("VSA (fastvideo-kernel) block-sparse attention, its Triton kernels; 64-token tiles, "
                   "K/V repeated for GQA inside the call")
    lowering = "uniform blocks -> 64-token q2k index lists (block 64·r expanded r×r)"

    def version(self):
        return dist_version("fastvideo-kernel", "fastvideo_kernel")

    def _op(self):
        mod = try_import("fastvideo_kernel.block_sparse_attn")[0]
        return mod.block_sparse_attn_triton

    def _lse(self, m):
        return m.float() * LN2  # its M is max·log2(e) + log2(l): a base-2 lse


class VsaCuda(_Vsa):
    name = "vsa-cuda"
    description = ("VSA (fastvideo-kernel) block-sparse attention, its Hopper CUDA (ThunderKittens) kernels; "
                   "64-token tiles, K/V repeated for GQA inside the call; no lse")
    lowering = VsaTriton.lowering
    head_dims = (128,)
    returns_lse = False

    def available(self):
        ok, why = super().available()
        if not ok:
            return ok, why
        ext, why = try_import("fastvideo_kernel._C")
        if ext is None:
            return False, f"its CUDA extension does not load here: {why}"
        ops = getattr(ext, "fastvideo_kernel_ops", None)
        if ops is None or getattr(ops, "block_sparse_fwd", None) is None or getattr(ops, "block_sparse_bwd", None) is None:
            return False, "its CUDA extension has no block_sparse_fwd / block_sparse_bwd"
        if torch.cuda.get_device_capability() != (9, 0):
            return False, f"the CUDA kernel is built for sm_90 (Hopper); this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
        return True, ""

    def _op(self):
        mod = try_import("fastvideo_kernel.block_sparse_attn")[0]
        return mod.block_sparse_attn_sm90


register(VsaTriton())
register(VsaCuda())


"""Merging partial attention results by their log-sum-exp.

``out = sum_i exp(lse_i - lse) out_i`` and ``lse = logsumexp_i lse_i``, in float32 (float64 for
float64 inputs); rows with ``lse = -inf`` everywhere stay zero / ``-inf``, never NaN.

* :func:`merge_` in PyTorch ops, in place (any device);
* :func:`merge_into` one fused Triton pass on CUDA: reads the previous result (any dtype), the new
  partial and both lse, writes the merged result into a destination that may be the previous
  buffer (in place, float32) or a fresh one in the output dtype (the last merge of a ring writes
  the final bf16 output directly, so two partials cost one pass).
"""

from __future__ import annotations

import torch

__all__ = ["FUSED_MERGE", "merge_", "merge_into", "use_fused"]

#: whether the CP schemes merge by :func:`merge_into` (None: on CUDA tensors; True / False forces it,
#: tests use True with the interpreter)
FUSED_MERGE: bool | None = None


def use_fused(t: torch.Tensor) -> bool:
    """Whether merges of partials of ``t``'s device take the fused Triton pass (``FUSED_MERGE``)."""
    return t.is_cuda if FUSED_MERGE is None else FUSED_MERGE


def merge_(out: torch.Tensor, lse: torch.Tensor, out_i: torch.Tensor, lse_i: torch.Tensor) -> None:
    """In place: ``out [B, L, H, D]``, ``lse [B, H, L]`` (accumulation dtype) absorb one partial."""
    new = torch.logaddexp(lse, lse_i.to(lse.dtype))
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    w_old = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(lse_i.to(lse.dtype) - safe).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).addcmul_(out_i, w_new)
    lse.copy_(new)


_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def lse_merge_kernel(P, PL, O, OL, Dst, DstL,
                         sp_b, sp_l, sp_h, so_b, so_l, so_h, sd_b, sd_l, sd_h,
                         spl_b, spl_h, sol_b, sol_h, sdl_b, sdl_h,
                         L, H,
                         HEAD_D: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
        pid_l = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        rows = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
        rmask = rows < L
        neg = float("-inf")
        lp = tl.load(PL + b * spl_b + h * spl_h + rows, mask=rmask, other=neg).to(tl.float32)
        lo = tl.load(OL + b * sol_b + h * sol_h + rows, mask=rmask, other=neg).to(tl.float32)
        m = tl.maximum(lp, lo)
        m_safe = tl.where(m == neg, 0.0, m)
        wp = tl.exp(lp - m_safe)
        wo = tl.exp(lo - m_safe)
        s = wp + wo
        new = tl.where(s > 0, m_safe + tl.log(s), neg)
        inv = tl.where(s > 0, 1.0 / s, 0.0)
        wp = wp * inv
        wo = wo * inv
        d = tl.arange(0, BLOCK_D)
        msk = rmask[:, None] & (d[None, :] < HEAD_D)
        p = tl.load(P + b * sp_b + rows[:, None] * sp_l + h * sp_h + d[None, :], mask=msk, other=0.0).to(tl.float32)
        o = tl.load(O + b * so_b + rows[:, None] * so_l + h * so_h + d[None, :], mask=msk, other=0.0).to(tl.float32)
        r = p * wp[:, None] + o * wo[:, None]
        tl.store(Dst + b * sd_b + rows[:, None] * sd_l + h * sd_h + d[None, :], r.to(Dst.dtype.element_ty), mask=msk)
        tl.store(DstL + b * sdl_b + h * sdl_h + rows, new, mask=rmask)

    _KERNEL = lse_merge_kernel
    return _KERNEL


def merge_into(prev: torch.Tensor, prev_lse: torch.Tensor, out_i: torch.Tensor, lse_i: torch.Tensor,
               dst: torch.Tensor, dst_lse: torch.Tensor) -> None:
    """``dst, dst_lse = merge((prev, prev_lse), (out_i, lse_i))`` in one Triton pass.

    ``prev, out_i, dst [B, L, H, D]`` (unit stride on D), ``*lse [B, H, L]`` (unit stride on L);
    ``dst`` may be ``prev`` and ``dst_lse`` may be ``prev_lse`` (in place).
    """
    import triton

    B, L, H, D = prev.shape
    for t in (prev, out_i, dst):
        assert t.stride(-1) == 1, "merge_into needs a unit stride on head_dim"
    for t in (prev_lse, lse_i, dst_lse):
        assert t.stride(-1) == 1, "merge_into needs a unit stride on the sequence of lse"
    BLOCK_L = 64
    grid = (triton.cdiv(L, BLOCK_L), B * H)
    _kernel()[grid](
        prev, prev_lse, out_i, lse_i, dst, dst_lse,
        prev.stride(0), prev.stride(1), prev.stride(2),
        out_i.stride(0), out_i.stride(1), out_i.stride(2),
        dst.stride(0), dst.stride(1), dst.stride(2),
        prev_lse.stride(0), prev_lse.stride(1), lse_i.stride(0), lse_i.stride(1), dst_lse.stride(0), dst_lse.stride(1),
        L, H, HEAD_D=D, BLOCK_L=BLOCK_L, BLOCK_D=triton.next_power_of_2(D), num_warps=4,
    )

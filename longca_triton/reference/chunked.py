"""The chunked reference: online softmax over key chunks, ``O(S · D)`` memory, exact gradients.

Forward, per query chunk (rows ``[q0, q1)``), over the key chunks the mask touches::

    m_new = max(m, rowmax(S_c));  l = l·e^(m - m_new) + rowsum(e^(S_c - m_new));
    acc = acc·e^(m - m_new) + e^(S_c - m_new) V_c;      O = acc / l,  lse = m + log l

Backward recomputes ``P = exp(S - lse)`` chunk by chunk (FlashAttention-2's equations)::

    delta = rowsum(dO ∘ O);  dV += Pᵀ dO;  dP = dO Vᵀ;  dS = P ∘ (dP - delta);
    dQ += scale · dS K;      dK += scale · dSᵀ Q

Empty chunk pairs are skipped using the mask's own block tables at the chunk size, and each
chunk's element mask is built from the row intervals (or the block map), never from ``S × S``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from longca_triton.masks import BlockSparseMask, Mask, RangeMask


def chunk_mask(mask: Mask, q0: int, q1: int, k0: int, k1: int, num_heads_q: int, device) -> torch.Tensor:
    """bool ``[Hq or 1, q1 - q0, k1 - k0]`` for one chunk pair."""
    if isinstance(mask, RangeMask):
        lo, hi = mask.row_intervals()
        lo = torch.as_tensor(lo[q0:q1], device=device)[:, :, None]  # [cq, K, 1]
        hi = torch.as_tensor(hi[q0:q1], device=device)[:, :, None]
        j = torch.arange(k0, k1, device=device)[None, None, :]
        return ((j >= lo) & (j < hi)).any(dim=1)[None]
    assert isinstance(mask, BlockSparseMask)
    qb = np.searchsorted(mask.q_block_bounds, np.arange(q0, q1), side="right") - 1
    kb = np.searchsorted(mask.k_block_bounds, np.arange(k0, k1), side="right") - 1
    pat = mask.pattern_of_head(num_heads_q)
    bm = mask.block_map[pat][:, qb][:, :, kb]
    return bm.to(device)


def _chunk_pairs(mask: Mask, chunk: int, num_heads_q: int):
    """For each query chunk, the key chunks any head's pattern touches (ascending)."""
    t = mask.block_tables(chunk, chunk)
    full, part = t.to_dense_tiles()
    touched = full | part
    if touched.ndim == 3:
        touched = touched.any(axis=0)
    return [np.nonzero(touched[m])[0].tolist() for m in range(t.num_m)]


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, chunk):
        B, Sq, Hq, _ = q.shape
        Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
        g = Hq // Hkv
        qh = q.transpose(1, 2)  # [B, Hq, Sq, D]
        kh = k.transpose(1, 2).repeat_interleave(g, dim=1)  # [B, Hq, Sk, D]
        vh = v.transpose(1, 2).repeat_interleave(g, dim=1)  # [B, Hq, Sk, Dv]
        out = torch.zeros(B, Hq, Sq, Dv, dtype=q.dtype, device=q.device)
        lse = torch.full((B, Hq, Sq), float("-inf"), dtype=q.dtype, device=q.device)
        pairs = _chunk_pairs(mask, chunk, Hq)
        for m, ks in enumerate(pairs):
            q0, q1 = m * chunk, min(Sq, (m + 1) * chunk)
            row_max = torch.full((B, Hq, q1 - q0), float("-inf"), dtype=q.dtype, device=q.device)
            row_sum = torch.zeros_like(row_max)
            acc = torch.zeros(B, Hq, q1 - q0, Dv, dtype=q.dtype, device=q.device)
            for n in ks:
                k0, k1 = n * chunk, min(Sk, (n + 1) * chunk)
                s = torch.matmul(qh[:, :, q0:q1], kh[:, :, k0:k1].transpose(-1, -2)) * scale
                s = s.masked_fill(~chunk_mask(mask, q0, q1, k0, k1, Hq, q.device)[None], float("-inf"))
                new_max = torch.maximum(row_max, s.amax(-1))
                safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
                alpha = torch.exp(row_max - safe)
                p = torch.exp(s - safe[..., None])
                row_sum = row_sum * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + torch.matmul(p, vh[:, :, k0:k1])
                row_max = new_max
            has = row_sum > 0
            out[:, :, q0:q1] = torch.where(has[..., None], acc / torch.where(has, row_sum, 1)[..., None], 0)
            lse[:, :, q0:q1] = torch.where(has, row_max + torch.log(torch.where(has, row_sum, 1)), float("-inf"))
        out = out.transpose(1, 2).contiguous()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.scale, ctx.chunk, ctx.pairs = mask, scale, chunk, pairs
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        mask, scale, chunk = ctx.mask, ctx.scale, ctx.chunk
        B, Sq, Hq, D = q.shape
        Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
        g = Hq // Hkv
        qh, doh = q.transpose(1, 2), dout.transpose(1, 2)
        kh = k.transpose(1, 2).repeat_interleave(g, dim=1)
        vh = v.transpose(1, 2).repeat_interleave(g, dim=1)
        delta = (dout * out).sum(-1).transpose(1, 2)  # [B, Hq, Sq]
        if dlse is not None:
            # lse is an output too: d lse / d s = P, which enters dS like -delta
            delta = delta - dlse
        safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        dq, dk, dv = torch.zeros_like(qh), torch.zeros_like(kh), torch.zeros_like(vh)
        for m, ks in enumerate(ctx.pairs):
            q0, q1 = m * chunk, min(Sq, (m + 1) * chunk)
            for n in ks:
                k0, k1 = n * chunk, min(Sk, (n + 1) * chunk)
                s = torch.matmul(qh[:, :, q0:q1], kh[:, :, k0:k1].transpose(-1, -2)) * scale
                s = s.masked_fill(~chunk_mask(mask, q0, q1, k0, k1, Hq, q.device)[None], float("-inf"))
                p = torch.exp(s - safe_lse[:, :, q0:q1, None])
                dv[:, :, k0:k1] += torch.matmul(p.transpose(-1, -2), doh[:, :, q0:q1])
                dp = torch.matmul(doh[:, :, q0:q1], vh[:, :, k0:k1].transpose(-1, -2))
                ds = p * (dp - delta[:, :, q0:q1, None])
                dq[:, :, q0:q1] += torch.matmul(ds, kh[:, :, k0:k1]) * scale
                dk[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), qh[:, :, q0:q1]) * scale
        dk = dk.view(B, Hkv, g, Sk, D).sum(2).transpose(1, 2)
        dv = dv.view(B, Hkv, g, Sk, Dv).sum(2).transpose(1, 2)
        return dq.transpose(1, 2), dk, dv, None, None, None


def chunked_attention(q, k, v, mask: Mask, softmax_scale: float | None = None, return_lse: bool = False, chunk: int = 256):
    """Same contract as ``naive_attention`` (``v`` may have its own head dim), in ``O(S · D)`` memory
    (plus one chunk of scores)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = _ChunkedAttention.apply(q, k, v, mask, scale, chunk)
    return (out, lse) if return_lse else out

r"""Backward step 1 — the gradient formulas in PyTorch, with ``P`` and ``dS`` materialised.

What it is
----------
Given the forward's output ``O`` and log-sum-exp ``lse`` and the incoming gradient ``dO``, for one
query head (KV head ``h // G``)::

    P     = exp(scale · Q Kᵀ - lse)        [Sq, Sk]  recomputed from lse: no softmax needed
    dV    = Pᵀ dO                           [Sk, D]
    dP    = dO Vᵀ                           [Sq, Sk]
    delta = rowsum(dO ∘ O)                  [Sq]      (= rowsum(P ∘ dP), but O(S·D) to compute)
    dS    = P ∘ (dP - delta)                [Sq, Sk]  the softmax Jacobian, applied row by row
    dQ    = scale · dS K                    [Sq, D]
    dK    = scale · dSᵀ Q                   [Sk, D]   (dK, dV summed over the G heads of a group)

This is what autograd computes through ``naive_attention`` (the tests check that), written out
so the later steps can be read against it. Matmuls in the input dtype, elementwise work in fp32.

Why it is slow
--------------
Five ``Sq x Sk`` tensors (S, P, dP, dS and a copy or two) stream through HBM, and the memory is
``O(S²)`` per head, so heads are processed a few at a time (``MEMORY_BUDGET``). Masked-out
pairs are computed and then zeroed.

Measured (H100, causal, S=16K)
------------------------------
16.6 TFLOP/s (660.9 ms, median of 6): the backward baseline, 3% of sdpa-cudnn (529.8 TFLOP/s
in the same run); peak 6,804 MiB above the inputs with one head per chunk. Backward TFLOP/s count
2.5x the forward's FLOPs (five matmuls) over allowed pairs, whatever a step recomputes.
(B=1, Hq:Hkv=64:8, D=128, bf16; H100 80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0;
``experiments/results/h100/ladder/ladder.md``, chart ``ladder_bwd.png`` next to it.)
"""

from __future__ import annotations

import torch

from ._common import check_shapes, dense_mask_on, softmax_scale_or_default

MEMORY_BUDGET = 6 << 30


def _bytes_per_head(batch: int, seqlen_q: int, seqlen_k: int) -> int:
    return 5 * batch * seqlen_q * seqlen_k * 4  # S, P, dP, dS (fp32) and one temporary


def limit(batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int, head_dim: int) -> str | None:
    """Why this step cannot run at this size (``None`` when it can)."""
    need = _bytes_per_head(batch, seqlen_q, seqlen_k)
    if need > 4 * MEMORY_BUDGET:
        return f"O(S²) memory: one head's P, dP, dS need {need / 2**30:.0f} GiB"
    return None


def backward(q, k, v, mask, out, lse, dout, softmax_scale=None):
    """-> ``dq [B, Sq, Hq, D], dk, dv [B, Sk, Hkv, D]`` (inputs' dtype); ``lse [B, Hq, Sq]`` fp32."""
    check_shapes(q, k, v, mask)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = softmax_scale_or_default(softmax_scale, D)
    allowed = dense_mask_on(mask, q.device)  # [Sq, Sk]
    dq = torch.empty_like(q)
    dk32 = torch.zeros(B, Sk, Hkv, D, device=k.device, dtype=torch.float32)
    dv32 = torch.zeros(B, Sk, Hkv, D, device=v.device, dtype=torch.float32)
    step = max(1, MEMORY_BUDGET // _bytes_per_head(B, Sq, Sk))  # query heads per chunk
    for h0 in range(0, Hq, step):
        h1 = min(Hq, h0 + step)
        kv = torch.arange(h0, h1, device=q.device) // G  # KV head of each query head
        qh = q[:, :, h0:h1].transpose(1, 2)  # [B, h, Sq, D]
        oh = out[:, :, h0:h1].transpose(1, 2)
        doh = dout[:, :, h0:h1].transpose(1, 2)
        kh = k.index_select(2, kv).transpose(1, 2)  # [B, h, Sk, D]
        vh = v.index_select(2, kv).transpose(1, 2)
        lse_h = lse[:, h0:h1].float()  # [B, h, Sq]
        # why: a row that allows nothing has lse = -inf; +inf makes its P exactly 0 instead of NaN
        lse_h = torch.where(torch.isinf(lse_h), float("inf"), lse_h)
        s = torch.matmul(qh, kh.transpose(-1, -2)).float() * scale  # [B, h, Sq, Sk]
        p = torch.exp(s - lse_h[..., None]).masked_fill(~allowed, 0.0)  # [B, h, Sq, Sk]
        dvh = torch.matmul(p.transpose(-1, -2).to(q.dtype), doh)  # [B, h, Sk, D]
        dp = torch.matmul(doh, vh.transpose(-1, -2)).float()  # [B, h, Sq, Sk]
        delta = (doh.float() * oh.float()).sum(-1)  # [B, h, Sq]
        ds = p * (dp - delta[..., None])  # [B, h, Sq, Sk]
        dq[:, :, h0:h1] = (torch.matmul(ds.to(q.dtype), kh).float() * scale).to(q.dtype).transpose(1, 2)
        dkh = torch.matmul(ds.transpose(-1, -2).to(q.dtype), qh).float() * scale  # [B, h, Sk, D]
        # GQA: the G query heads of a group all add into their KV head's gradient
        dk32.index_add_(2, kv, dkh.transpose(1, 2))
        dv32.index_add_(2, kv, dvh.float().transpose(1, 2))
    return dq, dk32.to(k.dtype), dv32.to(v.dtype)

r"""Step 3 — online softmax: one pass over the keys (the FlashAttention-2 loop).

What changed (from step 2)
--------------------------
Step 2 already rescaled the running *sum* whenever the running max grew. Apply the same rescaling
to the running *output* and the second pass disappears::

    for each key tile c:
        S     = scale·log2(e) · Q Kᶜᵀ                      [BLOCK_M, BLOCK_N]   (masked: -inf)
        m_new = max(m, rowmax(S))
        alpha = 2^(m - m_new)                              [BLOCK_M]  how much the old terms shrink
        P     = 2^(S - m_new)                              unnormalised probabilities
        l     = alpha · l + rowsum(P)
        acc   = alpha · acc + P Vᶜ                         [BLOCK_M, D]
        m     = m_new
    O = acc / l          (divide once at the end, not per tile)
    lse = (m + log2 l) · ln 2

This is FlashAttention's recurrence in FlashAttention-2's form: the division by ``l`` is deferred
to the end, and the loop over keys is the inner loop of a program that owns a query tile, so
``acc`` stays in registers and no other program ever touches it (no synchronisation).

Why it should help
------------------
Step 2 computed ``Q Kᵀ`` twice and read K twice; now each key tile is read once and its scores
computed once: 2 matmuls per tile instead of 3, so the ideal speed-up on matmul-bound work is 1.5x.
The extra cost is one ``[BLOCK_M, D]`` multiply by ``alpha`` per tile, which is cheap next to a matmul.

What is left
------------
The loop still visits *every* key tile and applies the element mask to all of them. For a causal
mask half of the tiles are entirely masked (pure waste) and most of the rest are entirely allowed
(the mask math is waste there). Step 4 uses the mask IR's block tables to fix both.

Measured (H100, causal, S=16K)
------------------------------
160.8 TFLOP/s (27.3 ms): 1.59× step 2, 27% of sdpa-cudnn; peak 256 MiB above the inputs. A little
above the 1.5x of matmul counting, because dropping pass 2 also drops its second load of every K
tile, its second element mask and its second ``exp2`` over every score tile.
(B=1, Hq:Hkv=64:8, D=128, bf16; H100 80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0;
``experiments/results/h100/ladder/ladder.md``, chart ``ladder_fwd.png`` next to it.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LOG2E, check_shapes, interval_mask, row_interval_arrays, softmax_scale_or_default, tile_config


@triton.jit
def online_softmax_fwd_kernel(
    Q, K, V, Out, LO, HI,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_ob, stride_os, stride_oh,
    qk_scale,  # softmax_scale * log2(e)
    Sq, Sk, num_heads_q, group_size,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_IV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // num_heads_q).to(tl.int64)
    h = bh % num_heads_q
    h_kv = h // group_size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq

    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_kb + h_kv * stride_kh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, Sk, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_range = offs_n[:, None] < Sk
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=in_range, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        # why: a row with nothing allowed so far has m_new = -inf, and -inf - -inf is NaN;
        # subtracting 0 instead keeps p = 2^-inf = 0 and alpha = 0 (acc and l are still 0 anyway)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)  # [BLOCK_M]
        p = tl.math.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=in_range, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # [BLOCK_M, D]
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # rows that allow nothing: acc = 0 -> 0
    tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])


def forward(q, k, v, mask, softmax_scale=None):
    """``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``, a ``RangeMask`` -> ``out [B, Sq, Hq, D]``."""
    check_shapes(q, k, v, mask)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    scale = softmax_scale_or_default(softmax_scale, D)
    lo, hi, num_iv = row_interval_arrays(mask, q.device)
    cfg = tile_config(D, q.dtype)
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(Sq, cfg["BLOCK_M"]), B * Hq)
    online_softmax_fwd_kernel[grid](
        q, k, v, out, lo, hi,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        scale * LOG2E, Sq, Sk, Hq, Hq // Hkv,
        HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], NUM_IV=num_iv,
        num_warps=cfg["num_warps"], num_stages=1,
    )
    return out

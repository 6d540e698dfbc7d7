r"""Step 2 — tiles of ``BLOCK_M`` query rows: matrix multiplies on tensor cores.

What changed (from step 1)
--------------------------
One program now owns a *tile* of ``BLOCK_M`` query rows of one head instead of a single row.
The two passes are the same as in step 1, but every score computation becomes a matrix multiply::

    S_tile = Q_tile · K_chunkᵀ           [BLOCK_M, D] x [D, BLOCK_N] -> [BLOCK_M, BLOCK_N]   (tl.dot)
    pass 1: running row max m and row sum l   (vectors of BLOCK_M, rescaled as in step 1)
    pass 2: P = 2^(S - m) / l;  O_tile += P · V_chunk    [BLOCK_M, BLOCK_N] x [BLOCK_N, D]

Still two passes over all key tiles, still the element mask on every tile (from the per-row
intervals), still no tile skipped.

Why it should help
------------------
Two reasons, both about arithmetic intensity. ``tl.dot`` on ``[BLOCK_M, D] x [D, BLOCK_N]`` tiles
runs on the tensor cores (wgmma on Hopper), an order of magnitude more FLOP/s than the CUDA-core
dot products of step 1. And each K/V tile loaded from memory now serves ``BLOCK_M`` rows instead
of one, so the bytes moved per FLOP drop by ``BLOCK_M``.

What is left
------------
Pass 2 recomputes ``Q Kᵀ`` and reloads K: a third of the matmul work is done twice. Step 3 removes
the second pass.

Measured (H100, causal, S=16K)
------------------------------
100.9 TFLOP/s (43.6 ms): 52.7× step 1 (4.4x step 0), 17% of sdpa-cudnn; peak 256 MiB above the
inputs. The jump is the two effects above together: tensor cores, and each K/V tile serving
128 query rows (``BLOCK_M = 128``) instead of one.
(B=1, Hq:Hkv=64:8, D=128, bf16; H100 80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0;
``experiments/results/h100/ladder/ladder.md``, chart ``ladder_fwd.png`` next to it.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LOG2E, check_shapes, interval_mask, row_interval_arrays, softmax_scale_or_default, tile_config


@triton.jit
def tiled_two_pass_fwd_kernel(
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

    # ---- pass 1: row statistics over every key tile
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(0, Sk, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :],
                    mask=offs_n[:, None] < Sk, other=0.0)  # [BLOCK_N, D]
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N] on tensor cores
        s = tl.where(interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        # why: rows with nothing allowed so far have m_new = -inf; -inf - -inf would be NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.math.exp2(m_i - m_safe) + tl.sum(tl.math.exp2(s - m_safe[:, None]), 1)
        m_i = m_new

    # ---- pass 2: normalised P times V over every key tile
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    inv_l = tl.where(l_i == 0.0, 0.0, 1.0 / tl.where(l_i == 0.0, 1.0, l_i))  # empty rows: zeros
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, Sk, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_range = offs_n[:, None] < Sk
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=in_range, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # recomputed: the price of two passes
        s = tl.where(interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV), s, float("-inf"))
        p = tl.math.exp2(s - m_safe[:, None]) * inv_l[:, None]  # [BLOCK_M, BLOCK_N], final values
        v = tl.load(v_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=in_range, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc)  # [BLOCK_M, D]
    tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None])


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
    tiled_two_pass_fwd_kernel[grid](
        q, k, v, out, lo, hi,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        scale * LOG2E, Sq, Sk, Hq, Hq // Hkv,
        HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], NUM_IV=num_iv,
        # why num_stages=1: no software pipelining yet; that is step 6's idea
        num_warps=cfg["num_warps"], num_stages=1,
    )
    return out

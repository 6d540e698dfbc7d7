r"""Backward step 2 — FlashAttention-2's backward in Triton: recompute P tile by tile, two kernels.

What changed (from backward step 1)
-----------------------------------
No ``Sq x Sk`` tensor exists any more. ``P`` is recomputed per tile from the forward's ``lse``
(``P = 2^(S·log2(e) - lse·log2(e))``: no max, no sum, no second pass), and the work is split
by what each gradient is a sum over::

    0. preprocess      delta_i = rowsum(dO_i ∘ O_i)                       [B, Hq, Sq] fp32
    1. key-major       one program per (key tile, query head): K_j, V_j stay in registers,
                       loop over ALL query tiles i:
                           Pᵀ = 2^(K Qᵢᵀ · c - lse_i)            [BLOCK_N, BLOCK_M]
                           dV_j += Pᵀ dOᵢ
                           dSᵀ = Pᵀ ∘ (V dOᵢᵀ - delta_i)
                           dK_j += dSᵀ Qᵢ                        (· scale at the end)
    2. query-major     one program per (query tile, query head): Q_i, dO_i in registers,
                       loop over ALL key tiles j:
                           P = 2^(Q Kⱼᵀ · c - lse_i);  dS = P ∘ (dO Vⱼᵀ - delta_i)
                           dQ_i += dS Kⱼ                          (· scale at the end)

Each program owns its output tile, so nothing is shared and no atomics are needed; the price is
that ``Q Kᵀ`` and ``dO Vᵀ`` are computed twice (once per kernel): 7 tile matmuls per pair instead
of 5. Like forward steps 1–3, every tile is visited and masked element by element from the
row intervals (a masked pair gets ``P = 0``).

GQA here is the simplest thing that works: the key-major kernel runs per *query* head and
writes fp32 partial ``dK, dV`` of shape ``[B, Sk, Hq, D]``; PyTorch then sums each group's ``G``
partials. (Backward step 4 removes that buffer.)

Why it should help
------------------
``O(S·D)`` memory instead of ``O(S²)``, and the matmuls run on tensor cores with operands in
registers and shared memory instead of round trips of ``S x S`` tensors through HBM.

Measured (H100, causal, S=16K)
------------------------------
120.8 TFLOP/s (91.0 ms): 7.26× bwd1, 23% of sdpa-cudnn; peak 1,412 MiB above the inputs against
6,804: 1 GiB of it is the two fp32 ``[B, Sk, Hq, D]`` partial buffers of the GQA path
(2 x 16K x 64 x 128 x 4 bytes), which backward step 4 removes.
(B=1, Hq:Hkv=64:8, D=128, bf16; H100 80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0;
``experiments/results/h100/ladder/ladder.md``, chart ``ladder_bwd.png`` next to it.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LOG2E, check_shapes, interval_mask, row_interval_arrays, softmax_scale_or_default, tile_config


@triton.jit
def delta_bwd_kernel(
    Out, DOut, Delta,
    stride_ob, stride_os, stride_oh,
    Sq, num_heads_q,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    """``delta[b, h, i] = sum_d dO[b, i, h, d] · O[b, i, h, d]`` (dO has O's strides)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // num_heads_q).to(tl.int64)
    h = bh % num_heads_q
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    ptrs = b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
    o = tl.load(Out + ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)  # [BLOCK, D]
    do = tl.load(DOut + ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(Delta + bh.to(tl.int64) * Sq + offs_m, tl.sum(o * do, 1), mask=row_ok)


@triton.jit
def load_row_stats(Lse, Delta, row_base, offs_m, Sq):
    """``lse`` in the log2 domain and ``delta`` for rows ``offs_m``.

    why +inf: a row that allows nothing has lse = -inf, and 2^(s - (-inf)) would be inf;
    with +inf all its P are 2^-inf = 0. Rows >= Sq read 0 (finite; their q and dO are zeros).
    """
    row_ok = offs_m < Sq
    lse = tl.load(Lse + row_base + offs_m, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(Delta + row_base + offs_m, mask=row_ok, other=0.0)
    return lse2, delta


@triton.jit
def two_kernels_dkdv_bwd_kernel(
    Q, K, V, DOut, Lse, Delta, DKp, DVp, LO, HI,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_pb, stride_ps, stride_ph,
    softmax_scale, qk_scale,
    Sq, Sk, num_heads_q, group_size,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_IV: tl.constexpr,
):
    pid_n = tl.program_id(0)  # key tile
    bh = tl.program_id(1)  # batch * Hq + query head
    b = (bh // num_heads_q).to(tl.int64)
    h = bh % num_heads_q
    h_kv = h // group_size
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n < Sk
    kv_ptrs = b * stride_kb + h_kv * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
    k = tl.load(K + kv_ptrs, mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D]
    v = tl.load(V + kv_ptrs, mask=key_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    q_base = b * stride_qb + h * stride_qh  # Q, dO share strides
    row_base = bh.to(tl.int64) * Sq

    for start_m in range(0, Sq, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < Sq
        q_ptrs = q_base + offs_m[:, None] * stride_qs + offs_d[None, :]
        q = tl.load(Q + q_ptrs, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
        do = tl.load(DOut + q_ptrs, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
        lse2, delta = load_row_stats(Lse, Delta, row_base, offs_m, Sq)
        # transposed tile: rows are this program's keys, columns the loop's queries
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])  # [BLOCK_N, BLOCK_M]
        allowed = interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV)  # [BLOCK_M, BLOCK_N]
        p_t = tl.where(tl.trans(allowed), p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)  # [BLOCK_N, D]
        dp_t = tl.dot(v, tl.trans(do))  # [BLOCK_N, BLOCK_M]
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)  # [BLOCK_N, D]

    # fp32 partials per query head; the launcher sums each GQA group
    p_ptrs = b * stride_pb + h * stride_ph + offs_n[:, None] * stride_ps + offs_d[None, :]
    tl.store(DKp + p_ptrs, dk * softmax_scale, mask=key_ok[:, None])
    tl.store(DVp + p_ptrs, dv, mask=key_ok[:, None])


@triton.jit
def two_kernels_dq_bwd_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, LO, HI,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    softmax_scale, qk_scale,
    Sq, Sk, num_heads_q, group_size,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_IV: tl.constexpr,
):
    pid_m = tl.program_id(0)  # query tile
    bh = tl.program_id(1)
    b = (bh // num_heads_q).to(tl.int64)
    h = bh % num_heads_q
    h_kv = h // group_size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    q_ptrs = b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    q = tl.load(Q + q_ptrs, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
    do = tl.load(DOut + q_ptrs, mask=row_ok[:, None], other=0.0)
    lse2, delta = load_row_stats(Lse, Delta, bh.to(tl.int64) * Sq, offs_m, Sq)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv_base = b * stride_kb + h_kv * stride_kh

    for start_n in range(0, Sk, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_ptrs = kv_base + offs_n[:, None] * stride_ks + offs_d[None, :]
        k = tl.load(K + kv_ptrs, mask=offs_n[:, None] < Sk, other=0.0)  # [BLOCK_N, D]
        v = tl.load(V + kv_ptrs, mask=offs_n[:, None] < Sk, other=0.0)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])  # [BLOCK_M, BLOCK_N]
        p = tl.where(interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV), p, 0.0)
        dp = tl.dot(do, tl.trans(v))  # [BLOCK_M, BLOCK_N]
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)  # [BLOCK_M, D]
    tl.store(DQ + q_ptrs, (dq * softmax_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


def prepare_inputs(q, k, v, out, dout):
    """Unit last stride, and one stride set for (q, dO, O) and one for (k, v) — copies otherwise."""
    q, k, v, out, dout = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, out, dout))
    if not (q.stride() == dout.stride() == out.stride()):
        q, out, dout = q.contiguous(), out.contiguous(), dout.contiguous()
    if k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    return q, k, v, out, dout


def compute_delta(out, dout, block: int = 64):
    """``delta [B, Hq, Sq] = rowsum(dO ∘ O)`` in fp32 (``out`` and ``dout`` share strides)."""
    B, Sq, Hq, D = out.shape
    delta = torch.empty((B, Hq, Sq), device=out.device, dtype=torch.float32)
    delta_bwd_kernel[(triton.cdiv(Sq, block), B * Hq)](
        out, dout, delta, out.stride(0), out.stride(1), out.stride(2), Sq, Hq,
        HEAD_DIM=D, BLOCK=block,
    )
    return delta


def backward(q, k, v, mask, out, lse, dout, softmax_scale=None):
    """-> ``dq [B, Sq, Hq, D], dk, dv [B, Sk, Hkv, D]`` (inputs' dtype); ``lse [B, Hq, Sq]`` fp32."""
    check_shapes(q, k, v, mask)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    q, k, v, out, dout = prepare_inputs(q, k, v, out, dout)
    lse = lse.float().contiguous()
    scale = softmax_scale_or_default(softmax_scale, D)
    cfg = tile_config(D, q.dtype)
    lo, hi, num_iv = row_interval_arrays(mask, q.device)
    dq = torch.empty_like(q)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), torch.zeros_like(k), torch.zeros_like(v)
    delta = compute_delta(out, dout)

    bm, bn = cfg["DKDV_BLOCK_M"], cfg["DKDV_BLOCK_N"]
    dk_part = torch.empty((B, Sk, Hq, D), device=q.device, dtype=torch.float32)
    dv_part = torch.empty_like(dk_part)
    two_kernels_dkdv_bwd_kernel[(triton.cdiv(Sk, bn), B * Hq)](
        q, k, v, dout, lse, delta, dk_part, dv_part, lo, hi,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        dk_part.stride(0), dk_part.stride(1), dk_part.stride(2),
        scale, scale * LOG2E, Sq, Sk, Hq, G,
        HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, NUM_IV=num_iv,
        num_warps=cfg["dkdv_num_warps"], num_stages=1,
    )
    bm, bn = cfg["DQ_BLOCK_M"], cfg["DQ_BLOCK_N"]
    two_kernels_dq_bwd_kernel[(triton.cdiv(Sq, bm), B * Hq)](
        q, k, v, dout, lse, delta, dq, lo, hi,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        scale, scale * LOG2E, Sq, Sk, Hq, G,
        HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, NUM_IV=num_iv,
        num_warps=cfg["dq_num_warps"], num_stages=1,
    )
    # GQA: sum the G query heads' partials of each KV head (an extra pass over [B, Sk, Hq, D] fp32)
    dk = dk_part.view(B, Sk, Hkv, G, D).sum(3).to(k.dtype)
    dv = dv_part.view(B, Sk, Hkv, G, D).sum(3).to(v.dtype)
    return dq, dk, dv

r"""Backward step 3 — block tables in both directions: skip empty tiles, no mask math on full ones.

What changed (from backward step 2)
-----------------------------------
Forward step 4's idea, applied to both backward kernels. The mask IR's block tables come in two
orientations, and each kernel uses the one that matches its loop::

    key-major  (dK/dV kernel, a program owns key tile j):   k_full_idx[k_full_ptr[j]:...]
               the query tiles that see key tile j fully, then k_part_* those that see it partly
    query-major (dQ kernel, a program owns query tile i):   q_full_* / q_part_*, as in the forward

Each kernel runs two loops — full tiles without mask math, partial tiles with the element mask
from the row intervals — and never touches an empty tile. The key-major list is the transpose of
the query-major one (``BlockTables`` builds both from the same classification), so the two kernels
agree exactly on which pairs exist.

Ragged edges: in the dQ kernel the last key tile is never "full" when ``Sk % BLOCK_N != 0``
(``_common.tile_tables`` moves it to the partial list), so keys past ``Sk`` never get a nonzero
``P``. In the dK/dV kernel padding query rows load ``q = dO = 0`` and ``lse = delta = 0``, which
makes their ``P = 1`` but every product they enter zero: no mask needed on full tiles.

Why it should help
------------------
As in the forward: causal does half the tile pairs of step 2, and 98% of those without mask
math (16K, 128-wide tiles); sparse masks gain in proportion to their emptiness. GQA still goes
through the fp32 partial buffer of step 2.

Measured (H100, causal, S=16K)
------------------------------
294.2 TFLOP/s (37.4 ms): 2.44× bwd2, 56% of sdpa-cudnn; peak 1,412 MiB above the inputs (the
same partial buffers). As in forward step 4, more than the 2x from skipped tiles: the full tiles
also run without mask math.
(B=1, Hq:Hkv=64:8, D=128, bf16; H100 80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0;
``experiments/results/h100/ladder/ladder.md``, chart ``ladder_bwd.png`` next to it.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LOG2E, check_shapes, interval_mask, row_interval_arrays, softmax_scale_or_default, tile_config, tile_tables
from .bwd2_two_kernels import compute_delta, load_row_stats, prepare_inputs


@triton.jit
def dkdv_tiles(dk, dv, k, v, Q, DOut, Lse, Delta, q_base, row_base, stride_qs, offs_n, offs_d,
               TILE_IDX, t_lo, t_hi, LO, HI, Sq, qk_scale,
               BLOCK_M: tl.constexpr, MASKED: tl.constexpr, NUM_IV: tl.constexpr):
    """Key-major: the query tiles ``TILE_IDX[t_lo:t_hi]`` against this program's key tile."""
    for t in range(t_lo, t_hi):
        offs_m = tl.load(TILE_IDX + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < Sq
        q_ptrs = q_base + offs_m[:, None] * stride_qs + offs_d[None, :]
        q = tl.load(Q + q_ptrs, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
        do = tl.load(DOut + q_ptrs, mask=row_ok[:, None], other=0.0)
        lse2, delta = load_row_stats(Lse, Delta, row_base, offs_m, Sq)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])  # [BLOCK_N, BLOCK_M]
        if MASKED:
            allowed = interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV)  # [BLOCK_M, BLOCK_N]
            p_t = tl.where(tl.trans(allowed), p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)  # [BLOCK_N, D]
        dp_t = tl.dot(v, tl.trans(do))  # [BLOCK_N, BLOCK_M]
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)  # [BLOCK_N, D]
    return dk, dv


@triton.jit
def mask_skipping_dkdv_bwd_kernel(
    Q, K, V, DOut, Lse, Delta, DKp, DVp, LO, HI,
    FULL_PTR, FULL_IDX, PART_PTR, PART_IDX,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_pb, stride_ps, stride_ph,
    softmax_scale, qk_scale,
    Sq, Sk, num_heads_q, group_size,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_IV: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
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
    q_base = b * stride_qb + h * stride_qh
    row_base = bh.to(tl.int64) * Sq

    dk, dv = dkdv_tiles(dk, dv, k, v, Q, DOut, Lse, Delta, q_base, row_base, stride_qs, offs_n, offs_d,
                        FULL_IDX, tl.load(FULL_PTR + pid_n), tl.load(FULL_PTR + pid_n + 1),
                        LO, HI, Sq, qk_scale, BLOCK_M, False, NUM_IV)
    dk, dv = dkdv_tiles(dk, dv, k, v, Q, DOut, Lse, Delta, q_base, row_base, stride_qs, offs_n, offs_d,
                        PART_IDX, tl.load(PART_PTR + pid_n), tl.load(PART_PTR + pid_n + 1),
                        LO, HI, Sq, qk_scale, BLOCK_M, True, NUM_IV)

    p_ptrs = b * stride_pb + h * stride_ph + offs_n[:, None] * stride_ps + offs_d[None, :]
    tl.store(DKp + p_ptrs, dk * softmax_scale, mask=key_ok[:, None])
    tl.store(DVp + p_ptrs, dv, mask=key_ok[:, None])


@triton.jit
def dq_tiles(dq, q, do, lse2, delta, K, V, kv_base, stride_ks, offs_m, offs_d,
             TILE_IDX, t_lo, t_hi, LO, HI, Sq, Sk, qk_scale,
             BLOCK_N: tl.constexpr, MASKED: tl.constexpr, NUM_IV: tl.constexpr):
    """Query-major: the key tiles ``TILE_IDX[t_lo:t_hi]`` against this program's query tile."""
    for t in range(t_lo, t_hi):
        offs_n = tl.load(TILE_IDX + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_ptrs = kv_base + offs_n[:, None] * stride_ks + offs_d[None, :]
        if MASKED:
            k = tl.load(K + kv_ptrs, mask=offs_n[:, None] < Sk, other=0.0)  # [BLOCK_N, D]
            v = tl.load(V + kv_ptrs, mask=offs_n[:, None] < Sk, other=0.0)
        else:
            k = tl.load(K + kv_ptrs)  # a full tile never reaches past Sk (see the docstring)
            v = tl.load(V + kv_ptrs)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])  # [BLOCK_M, BLOCK_N]
        if MASKED:
            p = tl.where(interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV), p, 0.0)
        dp = tl.dot(do, tl.trans(v))  # [BLOCK_M, BLOCK_N]
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)  # [BLOCK_M, D]
    return dq


@triton.jit
def mask_skipping_dq_bwd_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, LO, HI,
    FULL_PTR, FULL_IDX, PART_PTR, PART_IDX,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    softmax_scale, qk_scale,
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
    q_ptrs = b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    q = tl.load(Q + q_ptrs, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
    do = tl.load(DOut + q_ptrs, mask=row_ok[:, None], other=0.0)
    lse2, delta = load_row_stats(Lse, Delta, bh.to(tl.int64) * Sq, offs_m, Sq)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv_base = b * stride_kb + h_kv * stride_kh

    dq = dq_tiles(dq, q, do, lse2, delta, K, V, kv_base, stride_ks, offs_m, offs_d,
                  FULL_IDX, tl.load(FULL_PTR + pid_m), tl.load(FULL_PTR + pid_m + 1),
                  LO, HI, Sq, Sk, qk_scale, BLOCK_N, False, NUM_IV)
    dq = dq_tiles(dq, q, do, lse2, delta, K, V, kv_base, stride_ks, offs_m, offs_d,
                  PART_IDX, tl.load(PART_PTR + pid_m), tl.load(PART_PTR + pid_m + 1),
                  LO, HI, Sq, Sk, qk_scale, BLOCK_N, True, NUM_IV)
    tl.store(DQ + q_ptrs, (dq * softmax_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


def launch_dq(q, k, v, dout, lse, delta, dq, lo, hi, num_iv, mask, scale, cfg):
    """The query-major dQ kernel (reused unchanged by backward step 4)."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    t = tile_tables(mask, cfg["DQ_BLOCK_M"], cfg["DQ_BLOCK_N"], q.device)
    mask_skipping_dq_bwd_kernel[(t.num_m, B * Hq)](
        q, k, v, dout, lse, delta, dq, lo, hi,
        t.q_full_ptr, t.q_full_idx, t.q_part_ptr, t.q_part_idx,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        scale, scale * LOG2E, Sq, Sk, Hq, Hq // Hkv,
        HEAD_DIM=D, BLOCK_M=cfg["DQ_BLOCK_M"], BLOCK_N=cfg["DQ_BLOCK_N"], NUM_IV=num_iv,
        num_warps=cfg["dq_num_warps"], num_stages=1,
    )


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

    t = tile_tables(mask, cfg["DKDV_BLOCK_M"], cfg["DKDV_BLOCK_N"], q.device)  # key-major lists
    dk_part = torch.empty((B, Sk, Hq, D), device=q.device, dtype=torch.float32)
    dv_part = torch.empty_like(dk_part)
    mask_skipping_dkdv_bwd_kernel[(t.num_n, B * Hq)](
        q, k, v, dout, lse, delta, dk_part, dv_part, lo, hi,
        t.k_full_ptr, t.k_full_idx, t.k_part_ptr, t.k_part_idx,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        dk_part.stride(0), dk_part.stride(1), dk_part.stride(2),
        scale, scale * LOG2E, Sq, Sk, Hq, G,
        HEAD_DIM=D, BLOCK_M=cfg["DKDV_BLOCK_M"], BLOCK_N=cfg["DKDV_BLOCK_N"], NUM_IV=num_iv,
        num_warps=cfg["dkdv_num_warps"], num_stages=1,
    )
    launch_dq(q, k, v, dout, lse, delta, dq, lo, hi, num_iv, mask, scale, cfg)
    dk = dk_part.view(B, Sk, Hkv, G, D).sum(3).to(k.dtype)
    dv = dv_part.view(B, Sk, Hkv, G, D).sum(3).to(v.dtype)
    return dq, dk, dv

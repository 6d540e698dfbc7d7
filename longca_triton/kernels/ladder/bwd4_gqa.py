r"""Backward step 4 — GQA in the dK/dV kernel: one program sums its whole KV group in registers.

What changed (from backward step 3)
-----------------------------------
``dK_j`` and ``dV_j`` of a KV head are sums over the ``G`` query heads that read it. Backward
step 3 computed one fp32 partial per *query* head into a ``[B, Sk, Hq, D]`` buffer and let
PyTorch sum the groups afterwards. Now a dK/dV program owns (key tile, *KV* head) and loops over
the ``G`` query heads of its group itself::

    load K_j, V_j once                                         [BLOCK_N, D]
    for g in 0..G-1:                    query head h = h_kv · G + g
        for each (full, then partial) query tile i of key tile j:
            dV_j += Pᵀ dOᵢ;  dK_j += dSᵀ Qᵢ                      fp32 registers
    store dK_j · scale, dV_j in the inputs' dtype             once

The dQ kernel is unchanged (``bwd3_mask_skipping.launch_dq``): dQ is per query head anyway.

Why it should help
------------------
The ``2 x [B, Sk, Hq, D]`` fp32 partial buffers disappear (at 16K with 64 heads of 128: 1 GiB of
writes plus the reduction's reads), K and V tiles are loaded ``G`` times less often, and there
are ``G`` times fewer dK/dV programs, each doing ``G`` times more work, still without atomics.
Two things can eat the gain. Fewer, longer programs can leave SMs idle at the end of the grid
when ``B · Hkv · Sk / BLOCK_N`` is small (at 16K with 8 KV heads and 64-key tiles: 2,048
programs for 132 SMs, fine). And the group loop costs registers: compiled for sm_90 at the
production tile (32 x 64, 4 warps) ptxas reports about 1.2 KB of spills per thread for this
kernel against about 0.5 KB for step 3's — per-element pointer tensors are expensive, which is
one more reason the production kernel loads through TMA descriptors.

Measured (H100, causal, S=16K)
------------------------------
293.2 TFLOP/s (37.5 ms): 1.00× bwd3 (0.997; p20–p80 37.37–38.09 ms against 37.21–38.13: a tie),
55% of sdpa-cudnn; peak 324 MiB above the inputs against bwd3's 1,412. The measured win is memory:
the 1 GiB of partial buffers is gone.
(B=1, Hq:Hkv=64:8, D=128, bf16; H100 80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0;
``experiments/results/h100/ladder/ladder.md``, chart ``ladder_bwd.png`` next to it.)

Why it is not faster. The work this step removes is memory traffic, and little of it: writing the
1 GiB of fp32 partials and reading it back in the reduction, about 2 GiB, well under a millisecond
at the H100's nominal 3.35 TB/s of HBM bandwidth, i.e. a couple of percent of 37 ms. The matmuls,
and the loads of Q, dO, lse and delta inside the query loop, are unchanged: every (key tile, query
head, query tile) triple is still visited once, the group loop only moves the head loop into the
program. K and V were already loaded once per program, outside the loop, so loading them ``G``
times less often saves almost nothing. The dQ kernel (3 of the 7 tile matmuls per pair) is the
same launch. Against the small saving stand 8x fewer, 8x longer dK/dV programs (2,048 instead of
16,384, a longer tail while the grid drains) and the extra register spills described above.

Why it is worth learning. Memory: the partial buffers are ``8·B·Sk·Hq·D`` bytes, 1 GiB here and
8 GiB at 128K with these heads, so this is what lets the backward run long sequences. Their cost
in time grows relative to the matmuls when the mask leaves little work per key (sliding windows,
sparse documents, short sequences): the traffic scales with ``Sk·Hq``, the matmuls with the allowed
area. And it is the structure of the production backward (backward step 5), which then recovers
speed with TMA and pipelining (1.36x).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LOG2E, check_shapes, row_interval_arrays, softmax_scale_or_default, tile_config, tile_tables
from .bwd2_two_kernels import compute_delta, prepare_inputs
from .bwd3_mask_skipping import dkdv_tiles, launch_dq


@triton.jit
def gqa_dkdv_bwd_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, LO, HI,
    FULL_PTR, FULL_IDX, PART_PTR, PART_IDX,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    softmax_scale, qk_scale,
    Sq, Sk, num_heads_q, num_heads_kv, group_size,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_IV: tl.constexpr,
):
    pid_n = tl.program_id(0)  # key tile
    bkv = tl.program_id(1)  # batch * Hkv + KV head
    b = (bkv // num_heads_kv).to(tl.int64)
    h_kv = bkv % num_heads_kv
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n < Sk
    kv_ptrs = b * stride_kb + h_kv * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
    k = tl.load(K + kv_ptrs, mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D], loaded once for G heads
    v = tl.load(V + kv_ptrs, mask=key_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    f_lo = tl.load(FULL_PTR + pid_n)
    f_hi = tl.load(FULL_PTR + pid_n + 1)
    p_lo = tl.load(PART_PTR + pid_n)
    p_hi = tl.load(PART_PTR + pid_n + 1)

    for g in range(0, group_size):
        h = h_kv * group_size + g  # every query head of the group adds into the same registers
        q_base = b * stride_qb + h * stride_qh
        row_base = (b * num_heads_q + h) * Sq
        dk, dv = dkdv_tiles(dk, dv, k, v, Q, DOut, Lse, Delta, q_base, row_base, stride_qs, offs_n, offs_d,
                            FULL_IDX, f_lo, f_hi, LO, HI, Sq, qk_scale, BLOCK_M, False, NUM_IV)
        dk, dv = dkdv_tiles(dk, dv, k, v, Q, DOut, Lse, Delta, q_base, row_base, stride_qs, offs_n, offs_d,
                            PART_IDX, p_lo, p_hi, LO, HI, Sq, qk_scale, BLOCK_M, True, NUM_IV)

    # dK, dV have k's strides (the launcher allocates them so); written once, in the inputs' dtype
    tl.store(DK + kv_ptrs, (dk * softmax_scale).to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + kv_ptrs, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


def backward(q, k, v, mask, out, lse, dout, softmax_scale=None):
    """-> ``dq [B, Sq, Hq, D], dk, dv [B, Sk, Hkv, D]`` (inputs' dtype); ``lse [B, Hq, Sq]`` fp32."""
    check_shapes(q, k, v, mask)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    q, k, v, out, dout = prepare_inputs(q, k, v, out, dout)
    lse = lse.float().contiguous()
    scale = softmax_scale_or_default(softmax_scale, D)
    cfg = tile_config(D, q.dtype)
    lo, hi, num_iv = row_interval_arrays(mask, q.device)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)  # same strides as k: the kernel stores through k's offsets
    dv = torch.empty_like(k)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = compute_delta(out, dout)

    t = tile_tables(mask, cfg["DKDV_BLOCK_M"], cfg["DKDV_BLOCK_N"], q.device)
    gqa_dkdv_bwd_kernel[(t.num_n, B * Hkv)](
        q, k, v, dout, lse, delta, dk, dv, lo, hi,
        t.k_full_ptr, t.k_full_idx, t.k_part_ptr, t.k_part_idx,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        scale, scale * LOG2E, Sq, Sk, Hq, Hkv, Hq // Hkv,
        HEAD_DIM=D, BLOCK_M=cfg["DKDV_BLOCK_M"], BLOCK_N=cfg["DKDV_BLOCK_N"], NUM_IV=num_iv,
        num_warps=cfg["dkdv_num_warps"], num_stages=1,
    )
    launch_dq(q, k, v, dout, lse, delta, dq, lo, hi, num_iv, mask, scale, cfg)
    return dq, dk, dv.to(v.dtype)

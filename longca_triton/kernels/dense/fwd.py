"""Forward kernel of the dense structured-mask attention (the math: ``kernels/dense/op.py``).

One program computes one query tile ``[BLOCK_M, D_v]`` of one query head. Its key tiles come from
the tile plan (``kernels/dense/plan.py``) as contiguous runs: first the *full* runs (no mask math at all),
then the *partial* runs (element mask from the per-row intervals). Online softmax in fp32 in the
log2 domain (scores pre-multiplied by ``softmax_scale * log2(e)``, then ``exp2``). Head dims:
``HEAD_DIM_QK`` for q and k, ``HEAD_DIM_V`` for v and out, in tiles padded to ``BLOCK_DQK`` /
``BLOCK_DV`` by the tensor descriptors (``core.tile_desc``).
"""

import triton
import triton.language as tl

from longca_triton.kernels.core.jit import (
    LN2, LOG2E, fwd_tile_setup, interval_mask, query_program, softmax_finish, softmax_step,
)

__all__ = ["dense_fwd_kernel", "LOG2E", "LN2"]


@triton.jit
def _fwd_full_run(acc, m_i, l_i, q, k_desc, v_desc, n_lo, n_hi, qk_scale, BLOCK_N: tl.constexpr):
    """Key tiles ``[n_lo, n_hi)``, all fully allowed: the plain flash-attention step."""
    for n in tl.range(n_lo, n_hi):
        start_n = n * BLOCK_N
        k = k_desc.load([start_n, 0])  # [BLOCK_N, BLOCK_DQK]
        qk = tl.dot(q, k.T)  # [BLOCK_M, BLOCK_N]
        acc, m_i, l_i = softmax_step(acc, m_i, l_i, qk, v_desc, start_n, qk_scale, False, False)
    return acc, m_i, l_i


@triton.jit
def _fwd_part_run(acc, m_i, l_i, q, k_desc, v_desc, n_lo, n_hi, qk_scale, offs_m, LO, HI, Sq,
                  BLOCK_N: tl.constexpr, NUM_IV: tl.constexpr):
    """Key tiles ``[n_lo, n_hi)`` that need the element mask; rows may stay fully masked."""
    for n in tl.range(n_lo, n_hi):
        start_n = n * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = k_desc.load([start_n, 0])  # [BLOCK_N, BLOCK_DQK]
        qk = tl.dot(q, k.T)  # [BLOCK_M, BLOCK_N]
        allowed = interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV)
        s = tl.where(allowed, qk * qk_scale, float("-inf"))
        acc, m_i, l_i = softmax_step(acc, m_i, l_i, s, v_desc, start_n, qk_scale, True, True)
    return acc, m_i, l_i


@triton.jit
def dense_fwd_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    LO, HI, ORDER,
    FULL_PTR, FULL_START, FULL_END, PART_PTR, PART_START, PART_END,
    qk_scale,  # softmax_scale * log2(e)
    Sq, Sk, num_bh, num_heads_q, group_size,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_IV: tl.constexpr, HAS_PARTIAL_TILES: tl.constexpr,
):
    # why: batch*head is the fastest-varying index, so the programs running at the same time
    # share a query-tile rank (heaviest first) and the query heads of one GQA group sit next to
    # each other and read the same K/V tiles from L2.
    rank, bh, b, h, h_kv = query_program(num_bh, num_heads_q, group_size)
    tile_m = tl.load(ORDER + rank)
    start_m, q, k_desc, v_desc, o_desc, offs_m, acc, m_i, l_i = fwd_tile_setup(
        Q, K, V, Out, b, h, h_kv, tile_m, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks,
        stride_kh, stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh, Sq, Sk,
        BLOCK_M, BLOCK_N, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)

    for r in range(tl.load(FULL_PTR + tile_m), tl.load(FULL_PTR + tile_m + 1)):
        acc, m_i, l_i = _fwd_full_run(acc, m_i, l_i, q, k_desc, v_desc,
                                      tl.load(FULL_START + r), tl.load(FULL_END + r), qk_scale, BLOCK_N)
    # why a constexpr switch: a plan without partial tiles (full mask, tile-aligned documents)
    # compiles without the masked loop, whose code and registers otherwise stay in the kernel
    if HAS_PARTIAL_TILES:
        for r in range(tl.load(PART_PTR + tile_m), tl.load(PART_PTR + tile_m + 1)):
            acc, m_i, l_i = _fwd_part_run(acc, m_i, l_i, q, k_desc, v_desc,
                                          tl.load(PART_START + r), tl.load(PART_END + r), qk_scale,
                                          offs_m, LO, HI, Sq, BLOCK_N, NUM_IV)

    # fully masked rows (l_i == 0): out = 0, lse = -inf
    out, lse = softmax_finish(acc, m_i, l_i)  # [BLOCK_M, BLOCK_DV], [BLOCK_M]
    # the descriptor drops rows >= Sq and the padded columns >= HEAD_DIM_V
    o_desc.store([start_m, 0], out.to(Out.dtype.element_ty))
    tl.store(Lse + bh.to(tl.int64) * Sq + offs_m, lse, mask=offs_m < Sq)

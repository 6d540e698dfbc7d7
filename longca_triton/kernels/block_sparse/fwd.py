"""Block-sparse forward kernel: one program per (row tile, head pack), online softmax over the tile's
key list (``op.py``'s docstring has the math and the tiling).

Head dims: q and k ``HEAD_DIM_QK``, v and out ``HEAD_DIM_V``, in tiles padded to ``BLOCK_DQK`` /
``BLOCK_DV``. K/V come through descriptors (zero fill past the true dim); q and out are pointer
accesses, masked on the head dim only when it is padded (``BLOCK_D* != HEAD_DIM_*``).

``LIST_CHUNK`` (a pass of three or more stages, ``config.list_chunk``): the key list is read in
register chunks, so the K/V loads depend on no load of their own loop and are prefetched
``num_stages - 1`` steps ahead (a table load in the loop holds the prefetch to one step).
"""

import triton
import triton.language as tl

from longca_triton.kernels.core.jit import (
    entry_at, entry_chunk, entry_pick, head_dim_offsets, kv_descs, softmax_finish, softmax_init, softmax_step,
)

__all__ = ["block_sparse_fwd_kernel", "pack_program_at"]


@triton.jit
def pack_program_at(pid, ROW_START, ROW_END, ROW_BLOCK, ORDER, num_packs, num_heads_q, group_size,
                    heads_per_pattern, BLOCK_M: tl.constexpr, HEADS: tl.constexpr):
    """A query-major program's row tile: ``(b, h0, h_kv, pat, head, pos, row_ok, blk)``.

    The tile's rows are ``HEADS`` heads x ``BLOCK_M`` positions: ``head, pos, row_ok`` are
    ``[HEADS * BLOCK_M]``; ``blk`` is the query block whose key list the tile walks. The head pack
    is the fastest-varying index, so programs running together share a row tile (heaviest first)
    and the heads of one GQA group read the same K/V tiles from L2.
    """
    rank = pid // num_packs
    pack = pid % num_packs
    packs_per_batch = num_heads_q // HEADS
    b = pack // packs_per_batch
    h0 = (pack % packs_per_batch) * HEADS
    h_kv = h0 // group_size
    pat = h0 // heads_per_pattern
    tile = tl.load(ORDER + rank)
    m_start = tl.load(ROW_START + tile)
    m_end = tl.load(ROW_END + tile)
    blk = tl.load(ROW_BLOCK + tile)
    offs_r = tl.arange(0, HEADS * BLOCK_M)
    head = h0 + offs_r // BLOCK_M
    pos = m_start + offs_r % BLOCK_M
    row_ok = pos < m_end
    return b, h0, h_kv, pat, head, pos, row_ok, blk


@triton.jit
def _fwd_step(acc, m_i, l_i, q, k_desc, v_desc, start_n, end_n, qk_scale, BLOCK_N: tl.constexpr,
              EVEN_N: tl.constexpr):
    """One online-softmax step over the keys ``[start_n, end_n)`` of a list entry (``core.entry_at``)."""
    k = k_desc.load([start_n, 0])  # [BLOCK_N, BLOCK_DQK]
    qk = tl.dot(q, k.T)  # [BLOCK_M, BLOCK_N]
    if not EVEN_N:
        # a ragged tile: keys past its end belong to another block (or lie past Sk)
        qk = tl.where((start_n + tl.arange(0, BLOCK_N))[None, :] < end_n, qk, float("-inf"))
    # every tile has at least one valid key, so m_ij is finite and no row can turn NaN
    acc, m_ij, l_i = softmax_step(acc, m_i, l_i, qk, v_desc, start_n, qk_scale, False, False)
    return acc, m_ij, l_i


@triton.jit
def block_sparse_fwd_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    ROW_START, ROW_END, ROW_BLOCK, ORDER, PTR, COL_START, COL_END, COL_NEXT, COL_COUNT,
    qk_scale,  # softmax_scale * log2(e)
    Sq, Sk, num_row_blocks, num_packs, num_heads_q, group_size, heads_per_pattern,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, LIST_CHUNK: tl.constexpr,
):
    """Grid: row tiles x (batch, query head); ``out [B, Sq, Hq, D_v]``, ``lse [B, Hq, Sq]``."""
    b, h0, h_kv, pat, head, pos, row_ok, blk = pack_program_at(
        tl.program_id(0), ROW_START, ROW_END, ROW_BLOCK, ORDER, num_packs, num_heads_q, group_size,
        heads_per_pattern, BLOCK_M, 1)
    offs_dqk, dqk_ok = head_dim_offsets(HEAD_DIM_QK, BLOCK_DQK)
    offs_dv, dv_ok = head_dim_offsets(HEAD_DIM_V, BLOCK_DV)
    b64 = b.to(tl.int64)
    pos64 = pos.to(tl.int64)
    q_ptrs = Q + b64 * stride_qb + head * stride_qh + pos64 * stride_qs
    q_ok = row_ok[:, None]  # [BLOCK_M, 1]
    if BLOCK_DQK != HEAD_DIM_QK:
        q_ok = q_ok & dqk_ok[None, :]  # [BLOCK_M, BLOCK_DQK]: padded columns load as 0
    q = tl.load(q_ptrs[:, None] + offs_dqk[None, :], mask=q_ok, other=0.0)  # [BLOCK_M, BLOCK_DQK]
    k_desc, v_desc = kv_descs(K, V, b64, h_kv, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, Sk,
                              BLOCK_N, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)

    acc, m_i, l_i = softmax_init(BLOCK_M, BLOCK_DV)  # acc [BLOCK_M, BLOCK_DV]
    e_lo = tl.load(PTR + pat * num_row_blocks + blk)
    e_hi = tl.load(PTR + pat * num_row_blocks + blk + 1)
    if LIST_CHUNK == 0:
        for e in tl.range(e_lo, e_hi):
            start_n, end_n, _ = entry_at(COL_START, COL_END, COL_NEXT, e, EVEN_N, False)
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_desc, v_desc, start_n, end_n, qk_scale, BLOCK_N, EVEN_N)
    else:
        for c0 in range(e_lo, e_hi, LIST_CHUNK):
            starts, ends, nexts = entry_chunk(COL_START, COL_END, COL_NEXT, c0, e_hi, LIST_CHUNK,
                                              EVEN_N, False)  # [LIST_CHUNK] each
            for j in tl.range(0, tl.minimum(e_hi - c0, LIST_CHUNK)):
                start_n, end_n, _ = entry_pick(starts, ends, nexts, j, LIST_CHUNK, EVEN_N, False)
                acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_desc, v_desc, start_n, end_n, qk_scale, BLOCK_N,
                                          EVEN_N)

    # a row whose block keeps nothing never entered the loop: out = 0, lse = -inf
    out, lse = softmax_finish(acc, m_i, l_i)  # [BLOCK_M, BLOCK_DV], [BLOCK_M]
    o_ptrs = Out + b64 * stride_ob + head * stride_oh + pos64 * stride_os
    o_ok = row_ok[:, None]  # [BLOCK_M, 1]
    if BLOCK_DV != HEAD_DIM_V:
        o_ok = o_ok & dv_ok[None, :]  # [BLOCK_M, BLOCK_DV]: the padded columns are not stored
    tl.store(o_ptrs[:, None] + offs_dv[None, :], out.to(Out.dtype.element_ty), mask=o_ok)
    tl.store(Lse + (b64 * num_heads_q + head) * Sq + pos, lse, mask=row_ok)

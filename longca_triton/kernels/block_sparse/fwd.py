"""Block-sparse forward kernel (see ``longca_triton/kernels/block_sparse/op.py`` for the math and
the tiling): one program per (row tile, head pack), online softmax over the tile's key list.

Head dims: q and k ``HEAD_DIM_QK``, v and out ``HEAD_DIM_V``, in tiles padded to ``BLOCK_DQK`` /
``BLOCK_DV``. K/V come through descriptors (zero fill past the true dim); q and out are pointer
accesses, masked on the head dim only when it is padded (``BLOCK_D* != HEAD_DIM_*``).

``PACKED`` (packed key lists, ``block_sparse_tables``): a key tile may be two pieces of two runs,
so K/V rows are gathered by pointer loads (``core.gather_rows``) instead of read as one box."""

import triton
import triton.language as tl

from longca_triton.kernels.core.jit import (
    entry_at,
    entry_chunk,
    entry_pick,
    gather_rows,
    head_dim_offsets,
    kv_sources,
    last_count,
    packed_count,
    packed_positions,
    softmax_finish,
    softmax_init,
    softmax_rescale,
    softmax_step,
)

__all__ = ["block_sparse_fwd_kernel", "_pack_program"]


@triton.jit
def _pack_program(ROW_START, ROW_END, ROW_BLOCK, ORDER, num_packs, num_heads_q, group_size,
                  heads_per_pattern, BLOCK_M: tl.constexpr, HEADS: tl.constexpr):
    """A query-major program's row tile: ``(b, h0, h_kv, pat, head, pos, row_ok, blk)``.

    The tile's rows are ``HEADS`` heads x ``BLOCK_M`` positions: ``head, pos, row_ok`` are
    ``[HEADS * BLOCK_M]``; ``blk`` is the query block whose key list the tile walks.
    why: the head pack is the fastest-varying index, so programs running together share a row
    tile (heaviest first) and the heads of one GQA group read the same K/V tiles from L2.
    """
    return _pack_program_at(tl.program_id(0), ROW_START, ROW_END, ROW_BLOCK, ORDER, num_packs, num_heads_q,
                            group_size, heads_per_pattern, BLOCK_M, HEADS)


@triton.jit
def _pack_program_at(pid, ROW_START, ROW_END, ROW_BLOCK, ORDER, num_packs, num_heads_q, group_size,
                     heads_per_pattern, BLOCK_M: tl.constexpr, HEADS: tl.constexpr):
    """``_pack_program`` for the program index ``pid`` (a one-launch backward numbers each set from 0)."""
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
def _fwd_step(acc, m_i, l_i, q, k_src, v_src, stride_ks, stride_vs, start_n, end_n, next_n, count, offs_dqk, dqk_ok,
              offs_dv, dv_ok, qk_scale, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, PACKED: tl.constexpr,
              EVEN_QK: tl.constexpr, EVEN_V: tl.constexpr):
    """One online-softmax step over a list entry (``core.entry_at``: its keys from ``start_n``).

    ``k_src`` / ``v_src``: the K/V descriptors, or with ``PACKED`` the KV head's base pointers (the
    entry's keys, two pieces at most, gathered; the missing ones of the list's last tile masked)."""
    if PACKED:
        cols, ok = packed_positions(tl.arange(0, BLOCK_N), start_n, end_n, next_n, count)  # [BLOCK_N] each
        k = gather_rows(k_src, cols, ok, stride_ks, offs_dqk, dqk_ok, EVEN_QK)  # [BLOCK_N, BLOCK_DQK]
        qk = tl.where(ok[None, :], tl.dot(q, k.T), float("-inf"))  # [HM, BLOCK_N]
        p, acc, m_ij, l_i = softmax_rescale(acc, m_i, l_i, qk, qk_scale, False, False)
        v = gather_rows(v_src, cols, ok, stride_vs, offs_dv, dv_ok, EVEN_V)  # [BLOCK_N, BLOCK_DV]
        acc = tl.dot(p.to(v.dtype), v, acc)  # [HM, BLOCK_DV]
    else:
        k = k_src.load([start_n, 0])  # [BLOCK_N, BLOCK_DQK]
        qk = tl.dot(q, k.T)  # [HM, BLOCK_N]
        if not EVEN_N:
            # a ragged tile: keys past its end belong to another block (or lie past Sk)
            qk = tl.where((start_n + tl.arange(0, BLOCK_N))[None, :] < end_n, qk, float("-inf"))
        # every tile has at least one valid key, so m_ij is finite and no row can turn NaN
        acc, m_ij, l_i = softmax_step(acc, m_i, l_i, qk, v_src, start_n, qk_scale, False, False)
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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
    EVEN_N: tl.constexpr, WARP_SPEC: tl.constexpr, LIST_CHUNK: tl.constexpr, PACKED: tl.constexpr,
):
    b, h0, h_kv, pat, head, pos, row_ok, blk = _pack_program(
        ROW_START, ROW_END, ROW_BLOCK, ORDER, num_packs, num_heads_q, group_size, heads_per_pattern,
        BLOCK_M, HEADS)
    offs_dqk, dqk_ok = head_dim_offsets(HEAD_DIM_QK, BLOCK_DQK)
    offs_dv, dv_ok = head_dim_offsets(HEAD_DIM_V, BLOCK_DV)
    b64 = b.to(tl.int64)
    pos64 = pos.to(tl.int64)
    q_ptrs = Q + b64 * stride_qb + head * stride_qh + pos64 * stride_qs
    q_ok = row_ok[:, None]  # [HM, 1]
    if BLOCK_DQK != HEAD_DIM_QK:
        q_ok = q_ok & dqk_ok[None, :]  # [HM, BLOCK_DQK]: padded columns load as 0
    q = tl.load(q_ptrs[:, None] + offs_dqk[None, :], mask=q_ok, other=0.0)  # [HM, BLOCK_DQK]

    EVEN_QK: tl.constexpr = BLOCK_DQK == HEAD_DIM_QK
    EVEN_V: tl.constexpr = BLOCK_DV == HEAD_DIM_V
    k_src, v_src = kv_sources(K, V, b64, h_kv, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, Sk,
                              BLOCK_N, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, PACKED)

    acc, m_i, l_i = softmax_init(HEADS * BLOCK_M, BLOCK_DV)  # acc [HM, BLOCK_DV]
    e_lo = tl.load(PTR + pat * num_row_blocks + blk)
    e_hi = tl.load(PTR + pat * num_row_blocks + blk + 1)
    last = last_count(COL_COUNT, e_lo, e_hi, PACKED)
    if LIST_CHUNK == 0:
        for e in tl.range(e_lo, e_hi, warp_specialize=WARP_SPEC):
            start_n, end_n, next_n = entry_at(COL_START, COL_END, COL_NEXT, e, EVEN_N, PACKED)
            count = packed_count(e, e_hi, last, BLOCK_N)
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_src, v_src, stride_ks, stride_vs, start_n, end_n, next_n,
                                      count, offs_dqk, dqk_ok, offs_dv, dv_ok, qk_scale, BLOCK_N, EVEN_N, PACKED,
                                      EVEN_QK, EVEN_V)
    else:
        # the key list in register chunks (``block_sparse_bwd._dq_program`` says why)
        for c0 in range(e_lo, e_hi, LIST_CHUNK):
            starts, ends, nexts = entry_chunk(COL_START, COL_END, COL_NEXT, c0, e_hi, LIST_CHUNK,
                                                      EVEN_N, PACKED)  # [LIST_CHUNK] each
            for j in tl.range(0, tl.minimum(e_hi - c0, LIST_CHUNK), warp_specialize=WARP_SPEC):
                start_n, end_n, next_n = entry_pick(starts, ends, nexts, j, LIST_CHUNK, EVEN_N, PACKED)
                count = packed_count(c0 + j, e_hi, last, BLOCK_N)
                acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_src, v_src, stride_ks, stride_vs, start_n, end_n,
                                          next_n, count, offs_dqk, dqk_ok, offs_dv, dv_ok, qk_scale, BLOCK_N, EVEN_N,
                                          PACKED, EVEN_QK, EVEN_V)

    # a row whose block keeps nothing never entered the loop: out = 0, lse = -inf
    out, lse = softmax_finish(acc, m_i, l_i)  # [HM, BLOCK_DV], [HM]
    o_ptrs = Out + b64 * stride_ob + head * stride_oh + pos64 * stride_os
    o_ok = row_ok[:, None]  # [HM, 1]
    if BLOCK_DV != HEAD_DIM_V:
        o_ok = o_ok & dv_ok[None, :]  # [HM, BLOCK_DV]: the padded columns are not stored
    tl.store(o_ptrs[:, None] + offs_dv[None, :], out.to(Out.dtype.element_ty), mask=o_ok)
    tl.store(Lse + (b64 * num_heads_q + head) * Sq + pos, lse, mask=row_ok)

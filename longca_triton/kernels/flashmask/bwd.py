"""FlashMask backward kernels: key-major dK/dV and query-major dQ (the math and the tile classification:
``kernels/flashmask/op.py``); delta comes from ``core.bwd_preprocess_kernel``. No atomics in either.
Head dims as in the forward: ``HEAD_DIM_QK`` / ``HEAD_DIM_V`` in descriptor tiles padded to
``BLOCK_DQK`` / ``BLOCK_DV``.
"""

import triton
import triton.language as tl

from longca_triton.kernels.core.jit import (
    dkdv_update, dq_tile_setup, dq_update, group_sweep_inputs, head_inputs, key_program_at, kv_descs,
    load_row_stats, query_program_at, recompute_p, store_dkdv, tile_desc,
)
from longca_triton.kernels.flashmask.fwd import _allowed, _classify, _load_columns, _next_run, _tile_allowed

__all__ = ["flashmask_bwd_dkdv_kernel", "flashmask_bwd_dq_kernel"]


@triton.jit
def _dkdv_tile(dk, dv, k, v, q, do, lse2, delta, offs_m, masked, col_ok, lts, lte, uts, ute, qk_scale,
               HAS_LT: tl.constexpr, HAS_UT: tl.constexpr):
    """One query tile (``q, do [BLOCK_M, D]``) against the program's key tile: P^T recomputed, the
    element mask from the column vectors on a PARTIAL tile, the dK/dV update."""
    p_t = recompute_p(k, q, lse2, qk_scale, True)  # [BLOCK_N, BLOCK_M]
    if masked:
        allowed_t = _allowed(offs_m[None, :], col_ok, lts, lte, uts, ute, HAS_LT, HAS_UT)  # [BLOCK_N, BLOCK_M]
        p_t = tl.where(allowed_t, p_t, 0.0)
    dk, dv, _ = dkdv_update(dk, dv, p_t, q, do, v, delta)
    return dk, dv


@triton.jit
def flashmask_bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, Cols, Bounds,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    softmax_scale, qk_scale,
    Sq, Sk, num_bkv, num_heads_q, num_heads_kv, group_size,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LT: tl.constexpr, HAS_UT: tl.constexpr, SWEEP: tl.constexpr,
):
    """Key-major dK/dV (grid: key tiles x B x Hkv): one program per key tile of one KV head (``Bounds`` for
    ``BLOCK_N``-wide key tiles).

    ``SWEEP`` (config ``dkdv_sweep``) orders the GQA group's (query head, query tile) steps: 0
    head-major (each head walks the runs in turn), 1 row-major (per query tile every head of the
    group, one flat pipelined loop per run: the dense kernel's sweep (``kernels/dense/bwd.py``),
    ascending; a FlashMask column mask is the same for every head, so the group always shares it)."""
    tile_n, b, h_kv = key_program_at(tl.program_id(0), num_bkv, num_heads_kv)
    start_n = tile_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    num_m = tl.cdiv(Sq, BLOCK_M)
    b64 = b.to(tl.int64)

    k_desc, v_desc = kv_descs(K, V, b64, h_kv, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                              stride_vh, Sk, BLOCK_N, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)
    k = k_desc.load([start_n, 0])  # [BLOCK_N, BLOCK_DQK]
    v = v_desc.load([start_n, 0])  # [BLOCK_N, BLOCK_DV]
    # the program's key tile is fixed: its column vectors are loaded once, as [BLOCK_N, 1]
    # columns of the transposed [BLOCK_N, BLOCK_M] tiles below
    lts, lte, uts, ute, col_ok = _load_columns(Cols, offs_n, Sk)
    lts = lts[:, None]
    lte = lte[:, None]
    uts = uts[:, None]
    ute = ute[:, None]
    col_ok = col_ok[:, None]
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    if SWEEP != 0:
        # the group's query heads are adjacent: one 3-d descriptor each for q and dO
        q3_desc, do3_desc, row_base0 = group_sweep_inputs(
            Q, DOut, b64, h_kv, num_heads_q, group_size, stride_qb, stride_qs, stride_qh, stride_db, stride_ds,
            stride_dh, Sq, BLOCK_M, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)
        m_next = tl.full([], 0, tl.int32)
        while m_next < num_m:
            m_lo, m_hi = _next_run(Bounds, m_next, num_m, tile_n, Sq, Sk, BLOCK_M, BLOCK_N, True,
                                   HAS_LT, HAS_UT)
            # heads innermost: the pipeliner prefetches across head and tile boundaries alike
            for i in tl.range(0, (m_hi - m_lo) * group_size):
                mt = m_lo + i // group_size
                g = i % group_size
                _, masked = _classify(Bounds, mt, tile_n, Sq, Sk, BLOCK_M, BLOCK_N, HAS_LT, HAS_UT)
                start_m = mt * BLOCK_M
                offs_m = start_m + tl.arange(0, BLOCK_M)
                q = q3_desc.load([start_m, g, 0]).reshape(BLOCK_M, BLOCK_DQK)  # [BLOCK_M, BLOCK_DQK]
                do = do3_desc.load([start_m, g, 0]).reshape(BLOCK_M, BLOCK_DV)  # [BLOCK_M, BLOCK_DV]
                lse2, delta = load_row_stats(Lse, Delta, row_base0 + g * Sq, offs_m, Sq)  # [BLOCK_M] each
                dk, dv = _dkdv_tile(dk, dv, k, v, q, do, lse2, delta, offs_m, masked, col_ok, lts, lte, uts, ute,
                                    qk_scale, HAS_LT, HAS_UT)
            m_next = m_hi
    else:
        # GQA: every query head of the group adds into the same dK/dV registers (no atomics)
        for g in range(0, group_size):
            h = h_kv * group_size + g
            q_desc, do_desc, row_base = head_inputs(Q, DOut, b64, h, num_heads_q, stride_qb, stride_qs, stride_qh,
                                                    stride_db, stride_ds, stride_dh, Sq, BLOCK_M, HEAD_DIM_QK,
                                                    HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)
            # every query tile is classified against this key tile; EMPTY ones are skipped, the
            # others run in pipelined loops (see the forward)
            m_next = tl.full([], 0, tl.int32)
            while m_next < num_m:
                m_lo, m_hi = _next_run(Bounds, m_next, num_m, tile_n, Sq, Sk, BLOCK_M, BLOCK_N, True,
                                       HAS_LT, HAS_UT)
                for mt in tl.range(m_lo, m_hi):
                    _, masked = _classify(Bounds, mt, tile_n, Sq, Sk, BLOCK_M, BLOCK_N,
                                          HAS_LT, HAS_UT)
                    start_m = mt * BLOCK_M
                    offs_m = start_m + tl.arange(0, BLOCK_M)
                    q = q_desc.load([start_m, 0])  # [BLOCK_M, BLOCK_DQK]
                    do = do_desc.load([start_m, 0])  # [BLOCK_M, BLOCK_DV]
                    lse2, delta = load_row_stats(Lse, Delta, row_base, offs_m, Sq)  # [BLOCK_M] each
                    dk, dv = _dkdv_tile(dk, dv, k, v, q, do, lse2, delta, offs_m, masked, col_ok, lts, lte, uts,
                                        ute, qk_scale, HAS_LT, HAS_UT)
                m_next = m_hi

    store_dkdv(DK, DV, dk, dv, softmax_scale, b64, h_kv, start_n, Sk, stride_dkb, stride_dkh, stride_dks, stride_dvb,
               stride_dvh, stride_dvs, BLOCK_N, HEAD_DIM_QK, BLOCK_DQK, HEAD_DIM_V, BLOCK_DV)


@triton.jit
def flashmask_bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, Cols, Bounds,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dqb, stride_dqs, stride_dqh,
    softmax_scale, qk_scale,
    Sq, Sk, num_bh, num_heads_q, group_size,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LT: tl.constexpr, HAS_UT: tl.constexpr,
):
    """Query-major dQ (grid: query tiles x B x Hq): one program per query tile of one query head (``Bounds``
    for ``BLOCK_N``-wide key tiles)."""
    rank, bh, b, h, h_kv = query_program_at(tl.program_id(0), num_bh, num_heads_q, group_size)
    num_m = tl.cdiv(Sq, BLOCK_M)
    num_n = tl.cdiv(Sk, BLOCK_N)
    tile_m = num_m - 1 - rank  # heaviest (last) query tiles first, as in the forward
    start_m, offs_m, b64, q, do, k_desc, v_desc, lse2, delta, dq = dq_tile_setup(
        Q, K, V, DOut, Lse, Delta, b, h, h_kv, bh, tile_m, stride_qb, stride_qs, stride_qh, stride_kb,
        stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh, Sq, Sk,
        BLOCK_M, BLOCK_N, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)

    # runs of non-EMPTY key tiles, as in the forward
    n_next = tl.full([], 0, tl.int32)
    while n_next < num_n:
        n_lo, n_hi = _next_run(Bounds, n_next, num_n, tile_m, Sq, Sk, BLOCK_M, BLOCK_N, False,
                               HAS_LT, HAS_UT)
        for n in tl.range(n_lo, n_hi):
            _, masked = _classify(Bounds, tile_m, n, Sq, Sk, BLOCK_M, BLOCK_N, HAS_LT, HAS_UT)
            start_n = n * BLOCK_N
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = k_desc.load([start_n, 0])  # [BLOCK_N, BLOCK_DQK]
            v = v_desc.load([start_n, 0])  # [BLOCK_N, BLOCK_DV]
            p = recompute_p(q, k, lse2, qk_scale, False)  # [BLOCK_M, BLOCK_N]
            if masked:
                allowed = _tile_allowed(Cols, offs_m, offs_n, Sk, HAS_LT, HAS_UT)  # [BLOCK_M, BLOCK_N]
                p = tl.where(allowed, p, 0.0)
            dq = dq_update(dq, p, do, v, k, delta)  # [BLOCK_M, BLOCK_DQK]
        n_next = n_hi

    dq_desc = tile_desc(DQ + b64 * stride_dqb + h * stride_dqh, Sq, stride_dqs, BLOCK_M, HEAD_DIM_QK, BLOCK_DQK)
    dq_desc.store([start_m, 0], (dq * softmax_scale).to(DQ.dtype.element_ty))

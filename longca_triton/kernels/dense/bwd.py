"""Backward kernels of the dense structured-mask attention (the math: ``kernels/dense/op.py``).

Three launches, fp32 accumulation everywhere, no atomics (so gradients are bitwise identical run to run):

1. ``bwd_preprocess_kernel`` (``core.jit``, shared with the other families):
   ``delta_i = rowsum(dO_i * O_i) - dlse_i``.
2. ``dense_bwd_dkdv_kernel`` (key-major): one program owns one key tile ``[BLOCK_N, D]`` of one KV head and
   sweeps the query tiles of the key-major plan for *every* query head of its GQA group, so dK/dV of the group
   accumulate in registers and are written once.
3. ``dense_bwd_dq_kernel`` (query-major): one program owns one query tile ``[BLOCK_M, D]`` of one query head.
   It recomputes ``S`` and ``dP`` (7 matmuls per tile pair in all, against 5 in the math).

Both recompute ``P = exp2(S * log2(e) - lse * log2(e))`` from the forward's lse; the tile bodies are
``core.recompute_p`` / ``core.dkdv_update`` / ``core.dq_update``.

Sweep order (config ``dkdv_sweep``, ``SWEEP``): a dK/dV program visits the (query head, query tile) pairs of
its GQA group head-major (0), or row-major (every head of the group per query tile; 1 ascending, 2 descending)
through one 3-d descriptor over the group's heads (``core.group_desc``): one pipelined loop of ``group_size`` x
more steps per run instead of one loop per head. The tuning table says where each wins.

``dq_skew`` (``SKEW``): the dQ kernel issues each step's ``dS K`` GEMM in the next step, after that step's ``S``
and ``dP``, so it runs while the exponentials are computed (``core.dq_skewed_scores``); same sums, same order.

A kernel's optional ``PID`` is its program index (default ``tl.program_id(0)``): the ladder's one-launch
step inlines both kernels in one grid and numbers each program set from 0. Head dims: q, k, dq, dk are
``HEAD_DIM_QK`` wide, v, dO, dv ``HEAD_DIM_V``, in descriptor tiles padded to ``BLOCK_DQK`` / ``BLOCK_DV``.
"""

import triton
import triton.language as tl

from longca_triton.kernels.core.jit import (
    dkdv_update, dq_skewed_scores, dq_tile_setup, dq_update, group_sweep_inputs, head_inputs, interval_mask,
    key_program_at, kv_descs, load_row_stats, query_program_at, recompute_p, store_dkdv, tile_desc,
)

__all__ = ["dense_bwd_dkdv_kernel", "dense_bwd_dq_kernel"]


@triton.jit
def _dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, offs_m, offs_n, LO, HI, Sq, MASKED: tl.constexpr,
               NUM_IV: tl.constexpr):
    """One query tile's update of the key tile's ``dk``, ``dv``: ``P^T`` recomputed, masked by the
    row intervals where the tile is partial."""
    p_t = recompute_p(k, q, lse2, qk_scale, True)  # [BLOCK_N, BLOCK_M]
    if MASKED:
        allowed = interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV)  # [BLOCK_M, BLOCK_N]
        p_t = tl.where(allowed.T, p_t, 0.0)
    dk, dv, _ = dkdv_update(dk, dv, p_t, q, do, v, delta)
    return dk, dv


@triton.jit
def _dkdv_run(dk, dv, k, v, q_desc, do_desc, Lse, Delta, row_base, m_lo, m_hi, offs_n, qk_scale, LO, HI, Sq,
              BLOCK_M: tl.constexpr, MASKED: tl.constexpr, NUM_IV: tl.constexpr):
    """Query tiles ``[m_lo, m_hi)`` of one head against the program's key tile, in transposed form."""
    for mt in tl.range(m_lo, m_hi):
        start_m = mt * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = q_desc.load([start_m, 0])  # [BLOCK_M, BLOCK_DQK]
        do = do_desc.load([start_m, 0])  # [BLOCK_M, BLOCK_DV]
        # the rows' offsets taken again after the loads (not offs_m): the order of the compiled code
        lse2, delta = load_row_stats(Lse, Delta, row_base, start_m + tl.arange(0, BLOCK_M), Sq)  # [BLOCK_M] each
        dk, dv = _dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, offs_m, offs_n, LO, HI, Sq, MASKED, NUM_IV)
    return dk, dv


@triton.jit
def _dkdv_run_rows(dk, dv, k, v, q3_desc, do3_desc, Lse, Delta, row_base0, m_lo, m_hi, offs_n, qk_scale,
                   LO, HI, Sq, group_size,
                   BLOCK_M: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                   MASKED: tl.constexpr, NUM_IV: tl.constexpr, DESCENDING: tl.constexpr):
    """Query tiles ``[m_lo, m_hi)`` of *every* query head of the GQA group against the program's key
    tile, the heads innermost (``SWEEP`` 1 ascending, 2 descending; ``dense_bwd_dkdv_kernel``).

    One flat loop of ``(m_hi - m_lo) * group_size`` steps, so the software pipeliner prefetches
    across head and tile boundaries alike. ``q3_desc`` / ``do3_desc`` are ``core.group_desc``
    descriptors of the group's heads; ``row_base0`` is the lse / delta row of the group's first head.
    """
    for i in tl.range(0, (m_hi - m_lo) * group_size):
        if DESCENDING:
            mt = m_hi - 1 - i // group_size
        else:
            mt = m_lo + i // group_size
        g = i % group_size
        start_m = mt * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = q3_desc.load([start_m, g, 0]).reshape(BLOCK_M, BLOCK_DQK)  # [BLOCK_M, BLOCK_DQK]
        do = do3_desc.load([start_m, g, 0]).reshape(BLOCK_M, BLOCK_DV)  # [BLOCK_M, BLOCK_DV]
        lse2, delta = load_row_stats(Lse, Delta, row_base0 + g * Sq, start_m + tl.arange(0, BLOCK_M), Sq)
        dk, dv = _dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, offs_m, offs_n, LO, HI, Sq, MASKED, NUM_IV)
    return dk, dv


@triton.jit
def _dq_run(dq, ds, prev, q, do, lse2, delta, k_desc, v_desc, n_lo, n_hi, qk_scale, offs_m, LO, HI, Sq,
            BLOCK_N: tl.constexpr, MASKED: tl.constexpr, NUM_IV: tl.constexpr, SKEW: tl.constexpr):
    """Key tiles ``[n_lo, n_hi)`` of one run into ``dq``. ``SKEW`` (``core.dq_skewed_scores``): each step
    adds the previous step's ``dS K`` (``ds`` float32 ``[BLOCK_M, BLOCK_N]``, its key tile at row ``prev``),
    carried from run to run; returns ``(dq, ds, prev)`` (the last two unchanged without it)."""
    for n in tl.range(n_lo, n_hi):
        start_n = n * BLOCK_N
        k = k_desc.load([start_n, 0])  # [BLOCK_N, BLOCK_DQK]
        v = v_desc.load([start_n, 0])  # [BLOCK_N, BLOCK_DV]
        if SKEW:
            k_prev = k_desc.load([prev, 0])  # [BLOCK_N, BLOCK_DQK]
            dq, p, dp = dq_skewed_scores(dq, ds, k_prev, q, do, k, v, lse2, qk_scale)
            if MASKED:
                offs_n = start_n + tl.arange(0, BLOCK_N)
                p = tl.where(interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV), p, 0.0)
            ds = p * (dp - delta[:, None])  # [BLOCK_M, BLOCK_N]
            prev = start_n
        else:
            p = recompute_p(q, k, lse2, qk_scale, False)  # [BLOCK_M, BLOCK_N]
            if MASKED:
                offs_n = start_n + tl.arange(0, BLOCK_N)
                p = tl.where(interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV), p, 0.0)
            dq = dq_update(dq, p, do, v, k, delta)  # [BLOCK_M, BLOCK_DQK]
    return dq, ds, prev


@triton.jit
def dense_bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, Unused,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    unused_b, unused_s, unused_h,
    LO, HI, ORDER,
    FULL_PTR, FULL_START, FULL_END, PART_PTR, PART_START, PART_END,
    softmax_scale, qk_scale,
    Sq, Sk, num_bkv, num_heads_q, num_heads_kv, group_size,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_IV: tl.constexpr, HAS_PARTIAL_TILES: tl.constexpr, SWEEP: tl.constexpr, PID=None,
):
    """Key-major dK/dV (grid: key tiles x B x Hkv): key tile ``[BLOCK_N, D]`` of one KV head against the query
    tiles of its GQA group, in the order ``SWEEP`` says. ``PID``: the program's index in the key-major set
    (``[0, num_key_tiles * B * Hkv)``), ``tl.program_id(0)`` when None; a caller that inlines the kernel in a
    launch of two program sets passes it. ``Unused`` and ``unused_*`` are never read: they keep the parameter
    list, and with it the compiled code, of the kernel the tuning table's rows measured (without them ptxas
    input differs by a few reordered instructions)."""
    if PID is None:
        pid = tl.program_id(0)
    else:
        pid = PID
    rank, b, h_kv = key_program_at(pid, num_bkv, num_heads_kv)
    tile_n = tl.load(ORDER + rank)
    start_n = tile_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    b64 = b.to(tl.int64)

    k_desc, v_desc = kv_descs(K, V, b64, h_kv, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                              stride_vh, Sk, BLOCK_N, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)
    k = k_desc.load([start_n, 0])  # [BLOCK_N, BLOCK_DQK]
    v = v_desc.load([start_n, 0])  # [BLOCK_N, BLOCK_DV]
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    f_lo = tl.load(FULL_PTR + tile_n)
    f_hi = tl.load(FULL_PTR + tile_n + 1)
    p_lo = tl.load(PART_PTR + tile_n)
    p_hi = tl.load(PART_PTR + tile_n + 1)
    if SWEEP != 0:
        # the group's query heads are adjacent: one 3-d descriptor each for q and dO
        q3_desc, do3_desc, row_base0 = group_sweep_inputs(
            Q, DOut, b64, h_kv, num_heads_q, group_size, stride_qb, stride_qs, stride_qh, stride_db, stride_ds,
            stride_dh, Sq, BLOCK_M, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)
        for rr in range(f_lo, f_hi):
            # descending: the runs in reverse too, so the whole sweep goes from the last query tile down
            r = rr
            if SWEEP == 2:
                r = f_hi - 1 - (rr - f_lo)
            dk, dv = _dkdv_run_rows(dk, dv, k, v, q3_desc, do3_desc, Lse, Delta, row_base0,
                                    tl.load(FULL_START + r), tl.load(FULL_END + r), offs_n, qk_scale,
                                    LO, HI, Sq, group_size, BLOCK_M, BLOCK_DQK, BLOCK_DV, False, NUM_IV,
                                    SWEEP == 2)
        if HAS_PARTIAL_TILES:
            for r in range(p_lo, p_hi):
                dk, dv = _dkdv_run_rows(dk, dv, k, v, q3_desc, do3_desc, Lse, Delta, row_base0,
                                        tl.load(PART_START + r), tl.load(PART_END + r), offs_n, qk_scale,
                                        LO, HI, Sq, group_size, BLOCK_M, BLOCK_DQK, BLOCK_DV, True, NUM_IV,
                                        SWEEP == 2)
    else:
        # GQA: every query head of the group adds into the same dK/dV registers (no atomics)
        for g in range(0, group_size):
            h = h_kv * group_size + g
            q_desc, do_desc, row_base = head_inputs(Q, DOut, b64, h, num_heads_q, stride_qb, stride_qs, stride_qh,
                                                    stride_db, stride_ds, stride_dh, Sq, BLOCK_M, HEAD_DIM_QK,
                                                    HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)
            for r in range(f_lo, f_hi):
                dk, dv = _dkdv_run(dk, dv, k, v, q_desc, do_desc, Lse, Delta, row_base,
                                   tl.load(FULL_START + r), tl.load(FULL_END + r), offs_n, qk_scale,
                                   LO, HI, Sq, BLOCK_M, False, NUM_IV)
            if HAS_PARTIAL_TILES:
                for r in range(p_lo, p_hi):
                    dk, dv = _dkdv_run(dk, dv, k, v, q_desc, do_desc, Lse, Delta, row_base,
                                       tl.load(PART_START + r), tl.load(PART_END + r), offs_n, qk_scale,
                                       LO, HI, Sq, BLOCK_M, True, NUM_IV)

    store_dkdv(DK, DV, dk, dv, softmax_scale, b64, h_kv, start_n, Sk, stride_dkb, stride_dkh, stride_dks, stride_dvb,
               stride_dvh, stride_dvs, BLOCK_N, HEAD_DIM_QK, BLOCK_DQK, HEAD_DIM_V, BLOCK_DV)


@triton.jit
def dense_bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dqb, stride_dqs, stride_dqh,
    LO, HI, ORDER,
    FULL_PTR, FULL_START, FULL_END, PART_PTR, PART_START, PART_END,
    softmax_scale, qk_scale,
    Sq, Sk, num_bh, num_heads_q, group_size,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_IV: tl.constexpr, HAS_PARTIAL_TILES: tl.constexpr, SKEW: tl.constexpr = False, PID=None,
):
    """Query-major dQ (grid: query tiles x B x Hq): query tile ``[BLOCK_M, D]`` of one query head against its
    key tiles. ``PID`` as in ``dense_bwd_dkdv_kernel`` (here in ``[0, num_query_tiles * B * Hq)``)."""
    if PID is None:
        pid = tl.program_id(0)
    else:
        pid = PID
    rank, bh, b, h, h_kv = query_program_at(pid, num_bh, num_heads_q, group_size)
    tile_m = tl.load(ORDER + rank)
    start_m, offs_m, b64, q, do, k_desc, v_desc, lse2, delta, dq = dq_tile_setup(
        Q, K, V, DOut, Lse, Delta, b, h, h_kv, bh, tile_m, stride_qb, stride_qs, stride_qh, stride_kb,
        stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh, Sq, Sk,
        BLOCK_M, BLOCK_N, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)
    # SKEW: the step before the first adds dS = 0 (with key tile 0, any tile would do), the last
    # step's dS K is added after the runs
    ds = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    prev = 0

    for r in range(tl.load(FULL_PTR + tile_m), tl.load(FULL_PTR + tile_m + 1)):
        dq, ds, prev = _dq_run(dq, ds, prev, q, do, lse2, delta, k_desc, v_desc, tl.load(FULL_START + r),
                               tl.load(FULL_END + r), qk_scale, offs_m, LO, HI, Sq, BLOCK_N, False, NUM_IV, SKEW)
    if HAS_PARTIAL_TILES:
        for r in range(tl.load(PART_PTR + tile_m), tl.load(PART_PTR + tile_m + 1)):
            dq, ds, prev = _dq_run(dq, ds, prev, q, do, lse2, delta, k_desc, v_desc, tl.load(PART_START + r),
                                   tl.load(PART_END + r), qk_scale, offs_m, LO, HI, Sq, BLOCK_N, True, NUM_IV, SKEW)
    if SKEW:
        k_prev = k_desc.load([prev, 0])  # [BLOCK_N, BLOCK_DQK]
        dq = tl.dot(ds.to(k_prev.dtype), k_prev, dq)  # [BLOCK_M, BLOCK_DQK]

    dq_desc = tile_desc(DQ + b64 * stride_dqb + h * stride_dqh, Sq, stride_dqs, BLOCK_M, HEAD_DIM_QK, BLOCK_DQK)
    dq_desc.store([start_m, 0], (dq * softmax_scale).to(DQ.dtype.element_ty))

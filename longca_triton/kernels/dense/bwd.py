"""Backward kernels of the dense structured-mask attention (see ``longca_triton/kernels/dense/op.py`` for the math).

Three launches (default), fp32 accumulation everywhere, no atomics:

1. ``dense_bwd_preprocess_kernel`` (``core.bwd_preprocess_kernel``, the one all three kernels use):
   ``delta_i = rowsum(dO_i * O_i) - dlse_i``.
2. ``dense_bwd_dkdv_kernel`` (key-major): one program owns one key tile of one KV head and sweeps
   the query tiles of the key-major plan for *every* query head of its GQA group, so dK/dV of the
   group accumulate in registers and are written once.
3. ``dense_bwd_dq_kernel`` (query-major): one program owns one query tile of one query head.
   It recomputes ``S`` and ``dP`` (7 matmuls per tile pair in all, against 5 in the math).

   Variant ``FUSED_DQ`` (config ``fused_dq=True``): the dK/dV kernel also forms
   ``dS @ K`` and adds it into an fp32 dQ buffer (a TMA reduce-add on Hopper, as FlashAttention-3
   does; ``tl.atomic_add`` in the interpreter), so no tile pair is computed twice. dQ then depends
   on the order of fp32 additions: it is not bitwise deterministic.

Variant one launch (config ``one_launch=True``; ``dense_bwd_one_launch_kernel``): steps 2 and 3
as two program sets of one grid, as FlexAttention's Triton backward does: programs
``[0, n_dkdv)`` run the dK/dV body and ``[n_dkdv, n_dkdv + n_dq)`` the dQ body (``bwd_order``
puts dQ first or interleaves the sets), with one ``bwd_num_warps`` / ``bwd_num_stages``. Same
tiles, same plans, no atomics: deterministic like the two-kernel default. The delta preprocess
stays a launch of its own: both program sets read delta from their first tile on, and a grid
has no barrier to wait for a preprocess part of itself (dQ programs could form their own rows'
delta, dK/dV programs read every row's).
Measured (H100, S = 16K, GQA 64:8, D = 128, ``experiments/results/h100/bwd_variants/``): one launch
0.89-0.96x of the two kernels at best, ``fused_dq`` 0.36-0.48x; both stay off by default.
Two kernels after the dP^T-first update (``core.dkdv_update``) and, for full masks, the 64x64 dK/dV
tile (``dense.HOPPER_FULL_MASK``; ``experiments/results/h100/bwd_order/``): full 433-448 TFLOP/s
(1.08-1.12x Flex's backward, 0.82x cuDNN), causal 388-402 (1.02-1.04x Flex, 0.75-0.78x cuDNN). The
dK/dV kernel takes ~60 % of the time; the dQ kernel runs its three matmuls at ~630 TFLOP/s, so what
is left is the 7-matmul structure (dQ recomputes S and dP) rather than either kernel's schedule.

Sweep order (config ``dkdv_sweep``, ``SWEEP``): a dK/dV program visits (query head, query tile)
pairs of its GQA group head-major by default; 1 / 2 visit them row-major (every head of the group
per query tile, tiles ascending / descending) through one 3-d descriptor over the group's heads
(``core.group_desc``). Why: ``experiments/results/h100/bwd_diag/`` measured causal's dK/dV kernel
19 % slower than that of a mask of the same area in full tiles (17.2 vs 14.5 ms), while its dQ
kernel is not behind; the dK/dV step has 2 x ``BLOCK_N`` FLOP per byte of q / dO, so it needs the
programs of a KV head to read the same tiles together from L2, and head-major programs of unequal
length (causal) drift apart at every head switch. Measured (H100, 16K, GQA 64:8, D = 128,
``experiments/results/h100/bwd_sweep/``): sweep 2 on the 64x64 tile cuts causal's dK/dV from
16.7-17.0 ms to 15.3-15.4 (the equal-work ``full_document/2``: 14.5-14.7), and 8-10 % on the document
and prefix-LM masks, but loses on even masks (full, sliding windows) and on the 32x64 tile; so it
is the default only for GQA calls on uneven masks (``dense.HOPPER_UNEVEN_MASK``). The L2 reason
above did not survive Nsight Compute: the sweep *lowers* the kernel's L2 hit rate (84 % -> 63 % on
the same tile) and wins on issue rate (6.0 vs 7.6 cycles per issued instruction); what else it
changes is one pipelined loop of ``group_size`` x more steps per run instead of one per head.

Tried and not kept (H100, 16K, ``experiments/results/h100/session20/``): each tile's runs (partial, full,
partial on the windows) walked as one loop with the partial tiles masked behind a uniform branch: dK/dV
2-6 % slower on the windows, dQ -5 to +1 %; 4- and 5-stage rings and other tiles on the windows: within
the spread. What the dense backward took from that session is ``bwd_streams`` (``dense.HOPPER_EVEN_MASK``).

The kernel bodies are ``_dkdv_program`` / ``_dq_program`` of a program index; the two kernels
call them with ``tl.program_id(0)``, which Triton inlines into the code they compiled to before.

Both recompute ``P = exp2(S * log2(e) - lse * log2(e))`` from the forward's lse; the tile bodies
are ``core.recompute_p`` / ``core.dkdv_update`` / ``core.dq_update``. Head dims: q, k, dq, dk are
``HEAD_DIM_QK`` wide, v, dO, dv ``HEAD_DIM_V``, in descriptor tiles padded to ``BLOCK_DQK`` /
``BLOCK_DV`` (zero fill on load, clipped on store; see ``core.tile_desc``).
"""

import triton
import triton.language as tl

from longca_triton.kernels.core.jit import (
    bwd_preprocess_kernel,
    dkdv_update,
    dkdv_update_qmajor,
    dq_skewed_scores,
    dq_update,
    group_sweep_inputs,
    head_inputs,
    head_dim_offsets,
    interval_mask,
    key_program_at,
    key_program_outer,
    kv_descs,
    load_row_stats,
    lse_log2,
    one_launch_split,
    query_program_at,
    recompute_p,
    stats_box,
    stats_desc,
    tile_desc,
)

#: the one delta preprocess (``core.bwd_preprocess_kernel``), under its old name
dense_bwd_preprocess_kernel = bwd_preprocess_kernel
_load_row_stats = load_row_stats  # old name, kept importable


@triton.jit
def _row_stats(Lse, Delta, row_base, stat_bh, start_m, Sq, BLOCK_M: tl.constexpr, STATS_TMA: tl.constexpr):
    """``load_row_stats`` of rows ``start_m .. start_m + BLOCK_M`` (log2-domain lse, delta); with ``STATS_TMA``
    by one box of head ``stat_bh`` of the stats' ``core.stats_desc`` (rows past ``Sq`` read 0 either way)."""
    if STATS_TMA:
        lse, delta = stats_box(Lse, stat_bh, start_m, BLOCK_M)
        lse2 = lse_log2(lse)
    else:
        lse2, delta = load_row_stats(Lse, Delta, row_base, start_m + tl.arange(0, BLOCK_M), Sq)
    return lse2, delta


@triton.jit
def _dkdv_run(dk, dv, k, v, q_desc, do_desc, Lse, Delta, row_base, m_lo, m_hi, offs_n, qk_scale,
              LO, HI, Sq, dq_target, stride_dqa_s, softmax_scale,
              BLOCK_M: tl.constexpr, HEAD_DIM_QK: tl.constexpr, BLOCK_DQK: tl.constexpr,
              MASKED: tl.constexpr, NUM_IV: tl.constexpr, FUSED_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
              STATS_TMA: tl.constexpr = False, stat_bh=0, QMAJOR: tl.constexpr = False):
    """Query tiles ``[m_lo, m_hi)`` against the program's key tile, in transposed form.

    With ``FUSED_DQ``, ``dq_target`` is the fp32 dQ accumulator of this head: a tensor
    descriptor (``DQ_TMA``) or a base pointer. ``STATS_TMA``: ``Lse`` is the stats' ``core.stats_desc``
    and ``stat_bh`` the head's index ``b * Hq + h`` in it (``Delta`` is not read). ``QMAJOR`` (config
    ``dkdv_qmajor``): the scores query-major (``core.dkdv_update_qmajor``).
    """
    for mt in tl.range(m_lo, m_hi):
        start_m = mt * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = q_desc.load([start_m, 0])  # [BLOCK_M, BLOCK_DQK]
        do = do_desc.load([start_m, 0])  # [BLOCK_M, BLOCK_DV]
        lse2, delta = _row_stats(Lse, Delta, row_base, stat_bh, start_m, Sq, BLOCK_M, STATS_TMA)
        if QMAJOR:
            p = recompute_p(q, k, lse2, qk_scale, False)  # [BLOCK_M, BLOCK_N]
            if MASKED:
                p = tl.where(interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV), p, 0.0)
            dk, dv, ds = dkdv_update_qmajor(dk, dv, p, q, do, v, delta)  # ds [BLOCK_M, BLOCK_N]
        else:
            p_t = recompute_p(k, q, lse2, qk_scale, True)  # [BLOCK_N, BLOCK_M]
            if MASKED:
                allowed = interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV)  # [BLOCK_M, BLOCK_N]
                p_t = tl.where(allowed.T, p_t, 0.0)
            dk, dv, ds_t = dkdv_update(dk, dv, p_t, q, do, v, delta)
            ds = ds_t.T  # [BLOCK_M, BLOCK_N] (read only by the fused dQ)
        if FUSED_DQ:
            dq_part = tl.dot(ds, k) * softmax_scale  # [BLOCK_M, BLOCK_DQK]
            if DQ_TMA:
                dq_target.atomic_add([start_m, 0], dq_part)
            else:
                offs_d, d_ok = head_dim_offsets(HEAD_DIM_QK, BLOCK_DQK)
                ok = (offs_m < Sq)[:, None]  # [BLOCK_M, 1]
                if BLOCK_DQK != HEAD_DIM_QK:
                    ok = ok & d_ok[None, :]  # [BLOCK_M, BLOCK_DQK]: no padded column is written
                tl.atomic_add(dq_target + offs_m[:, None] * stride_dqa_s + offs_d[None, :], dq_part,
                              mask=ok)
    return dk, dv


@triton.jit
def _dkdv_run_rows(dk, dv, k, v, q3_desc, do3_desc, Lse, Delta, row_base0, m_lo, m_hi, offs_n, qk_scale,
                   LO, HI, Sq, group_size,
                   BLOCK_M: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                   MASKED: tl.constexpr, NUM_IV: tl.constexpr, DESCENDING: tl.constexpr,
                   STATS_TMA: tl.constexpr = False, stat_bh0=0):
    """Query tiles ``[m_lo, m_hi)`` of *every* query head of the GQA group against the program's key
    tile, the heads innermost (``SWEEP`` 1 ascending, 2 descending; ``_dkdv_program``).

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
        lse2, delta = _row_stats(Lse, Delta, row_base0 + g * Sq, stat_bh0 + g, start_m, Sq, BLOCK_M, STATS_TMA)
        p_t = recompute_p(k, q, lse2, qk_scale, True)  # [BLOCK_N, BLOCK_M]
        if MASKED:
            allowed = interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV)  # [BLOCK_M, BLOCK_N]
            p_t = tl.where(allowed.T, p_t, 0.0)
        dk, dv, _ = dkdv_update(dk, dv, p_t, q, do, v, delta)
    return dk, dv


@triton.jit
def _dkdv_program(
    pid,
    Q, K, V, DOut, Lse, Delta, DK, DV, DQAcc,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dqab, stride_dqas, stride_dqah,
    LO, HI, ORDER,
    FULL_PTR, FULL_START, FULL_END, PART_PTR, PART_START, PART_END,
    softmax_scale, qk_scale,
    Sq, Sk, num_bkv, num_heads_q, num_heads_kv, group_size, num_key_tiles,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_IV: tl.constexpr, FUSED_DQ: tl.constexpr, DQ_TMA: tl.constexpr, HAS_PARTIAL_TILES: tl.constexpr,
    SWEEP: tl.constexpr, HEAD_OUTER: tl.constexpr, STATS_TMA: tl.constexpr = False, QMAJOR: tl.constexpr = False,
):
    """dK/dV program ``pid`` of the key-major set (``pid`` in ``[0, num_key_tiles * B * Hkv)``).

    ``SWEEP`` orders the (query head, query tile) steps of the GQA group: 0 head-major (each head
    sweeps its query tiles in turn: the default), 1 row-major (per query tile every head of the
    group, tiles ascending), 2 row-major with tiles descending: one pipelined loop of
    ``group_size`` x more steps per run instead of one loop per head. Built on the idea that
    head-major programs of unequal work (causal) drift apart and lose the L2 reuse of q / dO; the
    H100 showed the gain (2 on the 64x64 tile, uneven masks) but not that reason (the module
    docstring). Not with ``FUSED_DQ`` (``dense.resolve_config`` rejects the pair).

    ``HEAD_OUTER`` (config ``dkdv_head_outer``): the (batch, KV head) slowest in ``pid``
    (``core.key_program_outer``), as in the block-sparse kernel where it won 4-13 %; here within +-3 %.

    ``STATS_TMA`` (config ``dkdv_stats_tma``): ``Lse`` is the ``[B, Hq, Sq, 4]`` stats of the preprocess
    (lse, delta, 0, 0 a row), read a step at a time by one TMA box (``core.stats_desc``).
    """
    if HEAD_OUTER:
        rank, b, h_kv = key_program_outer(pid, num_key_tiles, num_heads_kv)
    else:
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
    if STATS_TMA:
        Lse = stats_desc(Lse, (num_bkv // num_heads_kv) * num_heads_q, Sq, BLOCK_M)
    bh0 = b * num_heads_q + h_kv * group_size  # the group's first head among the stats' B * Hq

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
                                    SWEEP == 2, STATS_TMA, bh0)
        if HAS_PARTIAL_TILES:
            for r in range(p_lo, p_hi):
                dk, dv = _dkdv_run_rows(dk, dv, k, v, q3_desc, do3_desc, Lse, Delta, row_base0,
                                        tl.load(PART_START + r), tl.load(PART_END + r), offs_n, qk_scale,
                                        LO, HI, Sq, group_size, BLOCK_M, BLOCK_DQK, BLOCK_DV, True, NUM_IV,
                                        SWEEP == 2, STATS_TMA, bh0)
    else:
        # GQA: every query head of the group adds into the same dK/dV registers (no atomics)
        for g in range(0, group_size):
            h = h_kv * group_size + g
            q_desc, do_desc, row_base = head_inputs(Q, DOut, b64, h, num_heads_q, stride_qb, stride_qs, stride_qh,
                                                    stride_db, stride_ds, stride_dh, Sq, BLOCK_M, HEAD_DIM_QK,
                                                    HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)
            dq_target = DQAcc + b64 * stride_dqab + h * stride_dqah
            if FUSED_DQ:
                if DQ_TMA:
                    dq_target = tile_desc(dq_target, Sq, stride_dqas, BLOCK_M, HEAD_DIM_QK, BLOCK_DQK)
            for r in range(f_lo, f_hi):
                dk, dv = _dkdv_run(dk, dv, k, v, q_desc, do_desc, Lse, Delta, row_base,
                                   tl.load(FULL_START + r), tl.load(FULL_END + r), offs_n, qk_scale,
                                   LO, HI, Sq, dq_target, stride_dqas, softmax_scale,
                                   BLOCK_M, HEAD_DIM_QK, BLOCK_DQK, False, NUM_IV, FUSED_DQ, DQ_TMA, STATS_TMA,
                                   bh0 + g, QMAJOR)
            if HAS_PARTIAL_TILES:
                for r in range(p_lo, p_hi):
                    dk, dv = _dkdv_run(dk, dv, k, v, q_desc, do_desc, Lse, Delta, row_base,
                                       tl.load(PART_START + r), tl.load(PART_END + r), offs_n, qk_scale,
                                       LO, HI, Sq, dq_target, stride_dqas, softmax_scale,
                                       BLOCK_M, HEAD_DIM_QK, BLOCK_DQK, True, NUM_IV, FUSED_DQ, DQ_TMA,
                                       STATS_TMA, bh0 + g, QMAJOR)

    dk_desc = tile_desc(DK + b64 * stride_dkb + h_kv * stride_dkh, Sk, stride_dks, BLOCK_N, HEAD_DIM_QK, BLOCK_DQK)
    dv_desc = tile_desc(DV + b64 * stride_dvb + h_kv * stride_dvh, Sk, stride_dvs, BLOCK_N, HEAD_DIM_V, BLOCK_DV)
    # s = softmax_scale * q.k, so dK picks up the scale once here
    dk_desc.store([start_n, 0], (dk * softmax_scale).to(DK.dtype.element_ty))
    dv_desc.store([start_n, 0], dv.to(DV.dtype.element_ty))


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
def _dq_program(
    pid,
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
    NUM_IV: tl.constexpr, HAS_PARTIAL_TILES: tl.constexpr, SKEW: tl.constexpr = False,
):
    """dQ program ``pid`` of the query-major set (``pid`` in ``[0, num_query_tiles * B * Hq)``)."""
    rank, bh, b, h, h_kv = query_program_at(pid, num_bh, num_heads_q, group_size)
    tile_m = tl.load(ORDER + rank)
    start_m = tile_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    b64 = b.to(tl.int64)

    q_desc = tile_desc(Q + b64 * stride_qb + h * stride_qh, Sq, stride_qs, BLOCK_M, HEAD_DIM_QK, BLOCK_DQK)
    do_desc = tile_desc(DOut + b64 * stride_db + h * stride_dh, Sq, stride_ds, BLOCK_M, HEAD_DIM_V, BLOCK_DV)
    k_desc, v_desc = kv_descs(K, V, b64, h_kv, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                              stride_vh, Sk, BLOCK_N, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)
    q = q_desc.load([start_m, 0])  # [BLOCK_M, BLOCK_DQK]
    do = do_desc.load([start_m, 0])  # [BLOCK_M, BLOCK_DV]
    lse2, delta = load_row_stats(Lse, Delta, bh.to(tl.int64) * Sq, offs_m, Sq)
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], tl.float32)
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


# ----------------------------------------------------------------------------------------------
# The launches: two kernels (default), or one launch running both program sets
# ----------------------------------------------------------------------------------------------


@triton.jit
def dense_bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, DQAcc,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dqab, stride_dqas, stride_dqah,
    LO, HI, ORDER,
    FULL_PTR, FULL_START, FULL_END, PART_PTR, PART_START, PART_END,
    softmax_scale, qk_scale,
    Sq, Sk, num_bkv, num_heads_q, num_heads_kv, group_size,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_IV: tl.constexpr, FUSED_DQ: tl.constexpr, DQ_TMA: tl.constexpr, HAS_PARTIAL_TILES: tl.constexpr,
    SWEEP: tl.constexpr, HEAD_OUTER: tl.constexpr, STATS_TMA: tl.constexpr = False, QMAJOR: tl.constexpr = False,
):
    """Key-major dK/dV (grid: key tiles x B x Hkv); optionally dQ by fp32 reduce-add (``FUSED_DQ``);
    ``SWEEP``: the order of the GQA group's (head, query tile) steps; ``STATS_TMA``: ``Lse`` is the
    preprocess's stats, read by TMA boxes (``_dkdv_program``)."""
    _dkdv_program(
        tl.program_id(0), Q, K, V, DOut, Lse, Delta, DK, DV, DQAcc,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_db, stride_ds, stride_dh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
        stride_dqab, stride_dqas, stride_dqah,
        LO, HI, ORDER, FULL_PTR, FULL_START, FULL_END, PART_PTR, PART_START, PART_END,
        softmax_scale, qk_scale, Sq, Sk, num_bkv, num_heads_q, num_heads_kv, group_size,
        tl.num_programs(0) // num_bkv,
        HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N,
        NUM_IV, FUSED_DQ, DQ_TMA, HAS_PARTIAL_TILES, SWEEP, HEAD_OUTER, STATS_TMA, QMAJOR)


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
    NUM_IV: tl.constexpr, HAS_PARTIAL_TILES: tl.constexpr, SKEW: tl.constexpr = False,
):
    """Query-major dQ (grid: query tiles x B x Hq); ``SKEW``: each step's ``dS K`` issued in the next step
    (``core.dq_skewed_scores``)."""
    _dq_program(
        tl.program_id(0), Q, K, V, DOut, Lse, Delta, DQ,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_db, stride_ds, stride_dh, stride_dqb, stride_dqs, stride_dqh,
        LO, HI, ORDER, FULL_PTR, FULL_START, FULL_END, PART_PTR, PART_START, PART_END,
        softmax_scale, qk_scale, Sq, Sk, num_bh, num_heads_q, group_size,
        HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, NUM_IV, HAS_PARTIAL_TILES, SKEW)


@triton.jit
def dense_bwd_one_launch_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, DQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dqb, stride_dqs, stride_dqh,
    K_LO, K_HI, K_ORDER, K_FULL_PTR, K_FULL_START, K_FULL_END, K_PART_PTR, K_PART_START, K_PART_END,  # key-major plan
    Q_LO, Q_HI, Q_ORDER, Q_FULL_PTR, Q_FULL_START, Q_FULL_END, Q_PART_PTR, Q_PART_START, Q_PART_END,  # query-major plan
    softmax_scale, qk_scale,
    Sq, Sk, num_bkv, num_bh, num_heads_q, num_heads_kv, group_size, n_dkdv, n_dq,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    DKDV_BLOCK_M: tl.constexpr, DKDV_BLOCK_N: tl.constexpr, DQ_BLOCK_M: tl.constexpr, DQ_BLOCK_N: tl.constexpr,
    K_NUM_IV: tl.constexpr, Q_NUM_IV: tl.constexpr,
    K_HAS_PARTIAL: tl.constexpr, Q_HAS_PARTIAL: tl.constexpr, ORDER: tl.constexpr, SWEEP: tl.constexpr,
    HEAD_OUTER: tl.constexpr,
):
    """dK/dV and dQ in one launch of ``n_dkdv + n_dq`` programs (FlexAttention's backward layout).

    The two program sets are the two kernels above, unchanged (same tiles, same plans); this only
    saves a launch and lets dQ programs fill the SMs while the last dK/dV programs run (and back).
    No atomics: every output tile has one owner, so the result is bitwise deterministic. One
    ``num_warps`` / ``num_stages`` serves both sets (``bwd_num_warps`` / ``bwd_num_stages``)."""
    is_dkdv, idx = one_launch_split(tl.program_id(0), n_dkdv, n_dq, ORDER)
    if is_dkdv:
        # DQAcc is a placeholder (Delta): FUSED_DQ is off, it is never read
        _dkdv_program(
            idx, Q, K, V, DOut, Lse, Delta, DK, DV, Delta,
            stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_db, stride_ds, stride_dh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
            0, 0, 0,
            K_LO, K_HI, K_ORDER, K_FULL_PTR, K_FULL_START, K_FULL_END, K_PART_PTR, K_PART_START, K_PART_END,
            softmax_scale, qk_scale, Sq, Sk, num_bkv, num_heads_q, num_heads_kv, group_size, n_dkdv // num_bkv,
            HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, DKDV_BLOCK_M, DKDV_BLOCK_N,
            K_NUM_IV, False, False, K_HAS_PARTIAL, SWEEP, HEAD_OUTER)
    else:
        _dq_program(
            idx, Q, K, V, DOut, Lse, Delta, DQ,
            stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_db, stride_ds, stride_dh, stride_dqb, stride_dqs, stride_dqh,
            Q_LO, Q_HI, Q_ORDER, Q_FULL_PTR, Q_FULL_START, Q_FULL_END, Q_PART_PTR, Q_PART_START, Q_PART_END,
            softmax_scale, qk_scale, Sq, Sk, num_bh, num_heads_q, group_size,
            HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, DQ_BLOCK_M, DQ_BLOCK_N, Q_NUM_IV, Q_HAS_PARTIAL)

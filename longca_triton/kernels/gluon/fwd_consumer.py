"""The Gluon forward's consumer partition: one warpgroup's walk of its query tiles' key tiles
(``_kv_step``, the loop body), their epilogue, and the persistent work loop. ``fwd.py``'s
docstring has the design.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma_wait,
)

from longca_triton.kernels.gluon.fwd_parts import (
    LN2,
    M_WG,
    ROWSUM_N,
    _a_layout,
    _acc_layout,
    _advance,
    _index,
    _sched_pass,
    _sched_wait,
    _store_box,
    _tile_head,
    _tile_plan,
    _work_index,
)
from longca_triton.kernels.gluon.fwd_softmax import (
    _interval_mask,
    _mask_tile,
    _merge_load,
    _merge_rows,
    _o_stage,
    _p_operand,
    _pv,
    _qk,
    _row_interval,
    _rowsum_mma,
    _scale_rows,
    _softmax,
    _store_piece,
    _wait_pv,
)


@gluon.jit
def _fwd_consumer(WG: gl.constexpr, q_smem, k_smem, v_smem, p_smem, o_smem, ones_smem, bars, o_desc, Out, Lse,
                  LO, HI, RUN_START, RUN_END, work, qk_scale, Sq, stride_ob, stride_os, stride_oh,
                  HEAD_DIM_V: gl.constexpr, DQK0: gl.constexpr, DQK1: gl.constexpr, QK_USED: gl.constexpr,
                  DV0: gl.constexpr, DV1: gl.constexpr, BLOCK_N: gl.constexpr, NUM_IV: gl.constexpr,
                  NUM_STAGES: gl.constexpr, HAS_PARTIAL_TILES: gl.constexpr,
                  PINGPONG: gl.constexpr, STORE_TMA: gl.constexpr, CONSUMERS: gl.constexpr,
                  P_SMEM: gl.constexpr, O_OWN: gl.constexpr, PERSISTENT: gl.constexpr,
                  SNAKE: gl.constexpr, MERGE: gl.constexpr,
                  MASK_HEAD: gl.constexpr, ROWSUM_MMA: gl.constexpr, PV_SYNC: gl.constexpr):
    """One consumer warpgroup: rows ``[WG * 64, WG * 64 + 64)`` of its CTA's query tile, or with
    ``PERSISTENT`` of each query tile its CTA takes from the work list (``_tile_plan``: tiles
    ``program_id, program_id + num_programs, ...``).

    ``q_smem``, ``k_smem``, ``v_smem``, ``o_desc``: tuples over the head-dim pieces (one, or two
    with ``DQK1`` / ``DV1 > 0``); ``p_smem``: the ``[CONSUMERS, M_WG, BLOCK_N]`` P buffers (read only
    with ``P_SMEM``); ``o_smem``: O's own staging buffers (``O_OWN``, else unused).

    The ring position continues across a CTA's tiles: ``g`` counts the key tiles consumed so far
    (stage ``g % NUM_STAGES``, phase ``(g // NUM_STAGES) & 1``), ``it`` the query tiles (Q's phase),
    ``sk`` the ping-pong token's turns. With one tile a CTA they are the constants 0 (the compiler
    folds them: no loop-carried registers in the consumers, whose 160 registers at three consumers
    leave none to spare)."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched = bars
    if WG == CONSUMERS - 1:
        if PINGPONG:
            # the token starts with consumer 0
            mbarrier.arrive(sched.index(0))
    if PERSISTENT:
        num_work, num_bh, num_heads_q, group_size, ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT = work
        g = 0
        sk = 0
        it = 0
        for k in range(0, gl.cdiv(num_work, gl.num_programs(0))):
            w = _work_index(k, SNAKE)
            if w < num_work:
                item = _tile_plan(w, num_bh, ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT, CONSUMERS)
                g, sk = _consume_tile(WG, item, w % num_bh, num_heads_q, g, sk, it, q_smem, k_smem, v_smem, p_smem,
                                      o_smem, ones_smem, bars, o_desc, Out, Lse, LO, HI, RUN_START, RUN_END, qk_scale,
                                      Sq, stride_ob, stride_os, stride_oh, HEAD_DIM_V, DQK0, DQK1, QK_USED, DV0, DV1,
                                      BLOCK_N, NUM_IV, NUM_STAGES, HAS_PARTIAL_TILES, PINGPONG, STORE_TMA, CONSUMERS,
                                      P_SMEM, O_OWN, PERSISTENT, MERGE, MASK_HEAD, ROWSUM_MMA,
                                      PV_SYNC)
                it += 1
        # the last tile's O store must have read its buffer before the CTA ends
        tma.store_wait(0)
    else:
        # one tile a CTA, planned before the partitions split (``gluon_fwd_kernel``)
        start_m, r0, num_full, num_tiles, bh, num_heads_q, group_size = work
        _consume_tile(WG, (start_m, r0, num_full, num_tiles), bh, num_heads_q, 0, 0, 0, q_smem, k_smem, v_smem,
                      p_smem, o_smem, ones_smem, bars, o_desc, Out, Lse, LO, HI, RUN_START, RUN_END, qk_scale, Sq,
                      stride_ob, stride_os, stride_oh, HEAD_DIM_V, DQK0, DQK1, QK_USED, DV0, DV1,
                      BLOCK_N, NUM_IV, NUM_STAGES, HAS_PARTIAL_TILES, PINGPONG, STORE_TMA, CONSUMERS,
                      P_SMEM, O_OWN, PERSISTENT, MERGE, MASK_HEAD, ROWSUM_MMA,
                                      PV_SYNC)
        if O_OWN:
            # O's own buffers: the tile's store is still in flight (staged in Q's buffers, the
            # epilogue has waited for it already)
            tma.store_wait(0)


@gluon.jit
def _kv_step(j, g, sk, WG: gl.constexpr, q, k_smem, v_smem, p_buf, ones_smem, p_op, acc, acc_l, m_i, l_i, r, n, e,
             r0, num_full, bars, offs_m, iv, s_zero, LO, HI, RUN_START, RUN_END, qk_scale, Sq, MASK: gl.constexpr,
             s_layout: gl.constexpr, p_layout: gl.constexpr, p1_layout: gl.constexpr, pl_layout: gl.constexpr,
             row_o: gl.constexpr, row_o1: gl.constexpr, row_l: gl.constexpr, DQK0: gl.constexpr,
             DQK1: gl.constexpr, QK_USED: gl.constexpr, DV1: gl.constexpr, BLOCK_N: gl.constexpr,
             NUM_IV: gl.constexpr, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr,
             P_SMEM: gl.constexpr, HOLD_IV: gl.constexpr, ROWSUM_MMA: gl.constexpr,
             PV_SYNC: gl.constexpr):
    """Step ``j >= 1`` of a query tile's key walk (``_consume_tile``): ``S_j = Q K_j^T`` issued, then
    ``P_{j-1} V_{j-1}`` beside it, ``S_j``'s softmax while that runs, O rescaled. ``MASK``: 0 no mask,
    1 the interval mask on partial runs only (a branch: ``HAS_PARTIAL_TILES``), 2 the interval mask
    always (``MASK_HEAD``'s peeled step 1). With ``ROWSUM_MMA`` the row sums ride with ``P V`` as one
    more GEMM (``acc_l``). Returns ``(acc, acc_l, m_i, l_i, p_op, r, n, e)``."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched = bars
    dtype: gl.constexpr = k_smem[0].dtype
    # async wgmma groups one P V step issues (one per V piece, one for the row sums): the wait for
    # S_j leaves them in flight
    NUM_PV: gl.constexpr = (2 if DV1 > 0 else 1) + (1 if ROWSUM_MMA else 0)
    st = (g + j) % NUM_STAGES
    pst = (g + j - 1) % NUM_STAGES
    _sched_wait(sched, WG, sk + j, PINGPONG)
    if PV_SYNC:
        # (config pv_sync) no overlap inside the warpgroup: P_{j-1} V_{j-1} first and finished, then S_j, so
        # P_{j-1}'s registers are free before S_j's accumulator is live (three consumers with register P within
        # their registers); the other warpgroups' GEMMs keep the tensor cores busy meanwhile
        mbarrier.wait(v_ready.index(pst), ((g + j - 1) // NUM_STAGES) & 1)
        acc = _pv(p_op, _index(v_smem, pst, DV1), acc, DV1, p1_layout, P_SMEM)
        if ROWSUM_MMA:
            acc_l = _rowsum_mma(p_op, ones_smem, acc_l, pl_layout, P_SMEM)
        acc, acc_l = _wait_pv(acc, acc_l, DV1, ROWSUM_MMA)
        mbarrier.arrive(v_empty.index(pst))
        mbarrier.wait(k_ready.index(st), ((g + j) // NUM_STAGES) & 1)
        s = _qk(q, _index(k_smem, st, DQK1), s_zero, DQK0, DQK1, QK_USED)
        _sched_pass(sched, WG, PINGPONG, CONSUMERS)
        s = warpgroup_mma_wait(0, deps=(s,))
    else:
        mbarrier.wait(k_ready.index(st), ((g + j) // NUM_STAGES) & 1)
        s = _qk(q, _index(k_smem, st, DQK1), s_zero, DQK0, DQK1, QK_USED)
        mbarrier.wait(v_ready.index(pst), ((g + j - 1) // NUM_STAGES) & 1)
        acc = _pv(p_op, _index(v_smem, pst, DV1), acc, DV1, p1_layout, P_SMEM)
        if ROWSUM_MMA:
            acc_l = _rowsum_mma(p_op, ones_smem, acc_l, pl_layout, P_SMEM)
        _sched_pass(sched, WG, PINGPONG, CONSUMERS)
        # S_j is done when at most the P V groups are still in flight
        s = warpgroup_mma_wait(NUM_PV, deps=(s,))
    mbarrier.arrive(k_empty.index(st))
    if MASK == 1:
        if r >= r0 + num_full:
            s = _mask_tile(s, offs_m, n, LO, HI, Sq, iv, s_layout, BLOCK_N, NUM_IV, HOLD_IV)
    elif MASK == 2:
        s = _interval_mask(s, offs_m, n, LO, HI, Sq, s_layout, BLOCK_N, NUM_IV)
    m_i, l_i, p, alpha = _softmax(s, m_i, l_i, qk_scale, ROWSUM_MMA)
    if not PV_SYNC:
        acc, acc_l = _wait_pv(acc, acc_l, DV1, ROWSUM_MMA)
        mbarrier.arrive(v_empty.index(pst))
    acc = _scale_rows(acc, alpha, row_o, row_o1, DV1)
    if ROWSUM_MMA:
        acc_l = acc_l * gl.expand_dims(gl.convert_layout(alpha, row_l), 1)
    # P_j into P_{j-1}'s place: the wait above has retired the P V that read it
    p_op = _p_operand(p, p_buf, dtype, p_layout, P_SMEM)
    r, n, e = _advance(r, n, e, RUN_START, RUN_END)
    return acc, acc_l, m_i, l_i, p_op, r, n, e


@gluon.jit
def _consume_tile(WG: gl.constexpr, item, bh, num_heads_q, g, sk, it, q_smem, k_smem, v_smem, p_smem, o_smem,
                  ones_smem, bars, o_desc, Out, Lse, LO, HI, RUN_START, RUN_END, qk_scale, Sq, stride_ob, stride_os,
                  stride_oh, HEAD_DIM_V: gl.constexpr, DQK0: gl.constexpr, DQK1: gl.constexpr,
                  QK_USED: gl.constexpr, DV0: gl.constexpr, DV1: gl.constexpr, BLOCK_N: gl.constexpr,
                  NUM_IV: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_PARTIAL_TILES: gl.constexpr,
                  PINGPONG: gl.constexpr, STORE_TMA: gl.constexpr, CONSUMERS: gl.constexpr,
                  P_SMEM: gl.constexpr, O_OWN: gl.constexpr, PERSISTENT: gl.constexpr,
                  MERGE: gl.constexpr, MASK_HEAD: gl.constexpr,
                  ROWSUM_MMA: gl.constexpr, PV_SYNC: gl.constexpr):
    """One query tile of consumer ``WG`` (``_fwd_consumer``): ``item = (start_m, r0, num_full,
    num_tiles)`` (``_tile_plan``) of batch*head ``bh``; ring position ``g``, token turn ``sk`` and Q
    phase ``it`` at entry. Returns ``(g, sk)`` after it."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched = bars
    dtype: gl.constexpr = q_smem[0].dtype
    # Q's buffer is free once the tile's last S is computed, unless it stages O for the TMA store
    Q_EARLY: gl.constexpr = O_OWN or not STORE_TMA
    s_layout: gl.constexpr = _acc_layout(BLOCK_N)
    o_layout: gl.constexpr = _acc_layout(DV0)
    # P goes to the second GEMM from registers: the accumulator of S and the A operand of P V
    # hold the same elements in the same threads (k_width = 2 bf16 per 32-bit register)
    p_layout: gl.constexpr = _a_layout(o_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    # the second V piece's accumulator (unused without one: DV1 == 0 never reads these)
    o1_layout: gl.constexpr = _acc_layout(max(DV1, 8))
    p1_layout: gl.constexpr = _a_layout(o1_layout)
    row_o1: gl.constexpr = gl.SliceLayout(1, o1_layout)
    # the row sums' accumulator (ROWSUM_MMA; unused without)
    l_layout: gl.constexpr = _acc_layout(ROWSUM_N)
    pl_layout: gl.constexpr = _a_layout(l_layout)
    row_l: gl.constexpr = gl.SliceLayout(1, l_layout)

    start_m, r0, num_full, num_tiles = item
    row0 = start_m + WG * M_WG
    offs_m = row0 + gl.arange(0, M_WG, layout=row_s)  # [M_WG]
    m_i = gl.full([M_WG], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([M_WG], gl.float32, row_s)
    acc = (gl.zeros([M_WG, DV0], gl.float32, o_layout),)  # [M_WG, DV0]
    if DV1 > 0:
        acc = (acc[0], gl.zeros([M_WG, DV1], gl.float32, o1_layout))  # and [M_WG, DV1]
    acc_l = gl.zeros([M_WG, ROWSUM_N], gl.float32, l_layout)  # ROWSUM_MMA's row sums
    s_zero = gl.zeros([M_WG, BLOCK_N], gl.float32, s_layout)
    q = _index(q_smem, WG, DQK1)  # [M_WG, DQK0] (and [M_WG, DQK1])
    p_buf = p_smem.index(WG)  # [M_WG, BLOCK_N] (P_SMEM only)
    mbarrier.wait(q_ready.index(WG), it & 1)
    # the rows' key interval, held for the whole loop where a row has one and two consumers share
    # the registers (``_mask_tile``)
    HOLD_IV: gl.constexpr = HAS_PARTIAL_TILES and NUM_IV == 1 and CONSUMERS == 2
    iv = (offs_m, offs_m)  # never read unless HOLD_IV
    if HOLD_IV:
        iv = _row_interval(offs_m, LO, HI, Sq)

    if num_tiles > 0:
        r = r0
        n = gl.load(RUN_START + r)
        e = gl.load(RUN_END + r)
        # ---- step 0: S_0 and its softmax; there is no P V yet
        st = g % NUM_STAGES
        _sched_wait(sched, WG, sk, PINGPONG)
        mbarrier.wait(k_ready.index(st), (g // NUM_STAGES) & 1)
        s = _qk(q, _index(k_smem, st, DQK1), s_zero, DQK0, DQK1, QK_USED)
        _sched_pass(sched, WG, PINGPONG, CONSUMERS)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(st))
        if HAS_PARTIAL_TILES:
            if r >= r0 + num_full:
                s = _mask_tile(s, offs_m, n, LO, HI, Sq, iv, s_layout, BLOCK_N, NUM_IV, HOLD_IV)
        elif MASK_HEAD > 0:
            # the item's first key tile (of its first MASK_HEAD, the only partial ones; full ones pass
            # the rows' intervals whole): masked without a branch, which keeps the loop on the uniform
            # datapath (a branch on S anywhere does not)
            s = _interval_mask(s, offs_m, n, LO, HI, Sq, s_layout, BLOCK_N, NUM_IV)
        m_i, l_i, p, alpha = _softmax(s, m_i, l_i, qk_scale, ROWSUM_MMA)
        p_op = _p_operand(p, p_buf, dtype, p_layout, P_SMEM)  # [M_WG, BLOCK_N]
        r, n, e = _advance(r, n, e, RUN_START, RUN_END)

        if MASK_HEAD == 2:
            # ---- step 1, out of the loop: the item's second key tile is masked without a branch too
            # (the plan gives every item that walks any key tile at least two: a fully masked
            # neighbour where it has one)
            acc, acc_l, m_i, l_i, p_op, r, n, e = _kv_step(
                1, g, sk, WG, q, k_smem, v_smem, p_buf, ones_smem, p_op, acc, acc_l, m_i, l_i, r, n, e, r0,
                num_full, bars, offs_m, iv, s_zero, LO, HI, RUN_START, RUN_END, qk_scale, Sq, 2, s_layout, p_layout,
                p1_layout, pl_layout, row_o, row_o1, row_l, DQK0, DQK1, QK_USED, DV1, BLOCK_N, NUM_IV, NUM_STAGES,
                PINGPONG, CONSUMERS, P_SMEM, HOLD_IV, ROWSUM_MMA, PV_SYNC)
        # ---- steps J0 .. T-1: S_j and P_{j-1} V_{j-1} in flight together
        J0: gl.constexpr = 2 if MASK_HEAD == 2 else 1
        for j in range(J0, num_tiles):
            acc, acc_l, m_i, l_i, p_op, r, n, e = _kv_step(
                j, g, sk, WG, q, k_smem, v_smem, p_buf, ones_smem, p_op, acc, acc_l, m_i, l_i, r, n, e, r0,
                num_full, bars, offs_m, iv, s_zero, LO, HI, RUN_START, RUN_END, qk_scale, Sq,
                1 if HAS_PARTIAL_TILES else 0, s_layout, p_layout, p1_layout, pl_layout, row_o, row_o1, row_l, DQK0,
                DQK1, QK_USED, DV1, BLOCK_N, NUM_IV, NUM_STAGES, PINGPONG, CONSUMERS, P_SMEM, HOLD_IV,
                ROWSUM_MMA, PV_SYNC)

        if Q_EARLY and PERSISTENT:
            # every S of the tile is done: the producer may load the next tile's Q while this
            # one's last P V and epilogue run
            mbarrier.arrive(q_empty.index(WG))
        # ---- the last P V
        lst = (g + num_tiles - 1) % NUM_STAGES
        _sched_wait(sched, WG, sk + num_tiles, PINGPONG)
        mbarrier.wait(v_ready.index(lst), ((g + num_tiles - 1) // NUM_STAGES) & 1)
        acc = _pv(p_op, _index(v_smem, lst, DV1), acc, DV1, p1_layout, P_SMEM)
        if ROWSUM_MMA:
            acc_l = _rowsum_mma(p_op, ones_smem, acc_l, pl_layout, P_SMEM)
        _sched_pass(sched, WG, PINGPONG, CONSUMERS)
        if MERGE:
            # the split launch's second half: these rows' (O, lse) over their full tiles, written by
            # the first launch, read while the last P V runs (earlier, held through the loop, they
            # cost two persistent consumers 56 B of spills: the loop's registers are full)
            o_a, lse_a = _merge_load(Out, Lse, bh, num_heads_q, row0, offs_m, Sq, stride_ob, stride_os, stride_oh,
                                     DV0, HEAD_DIM_V, o_layout)
        acc, acc_l = _wait_pv(acc, acc_l, DV1, ROWSUM_MMA)
        mbarrier.arrive(v_empty.index(lst))
    else:
        if Q_EARLY and PERSISTENT:
            mbarrier.arrive(q_empty.index(WG))
        if MERGE:
            o_a, lse_a = _merge_load(Out, Lse, bh, num_heads_q, row0, offs_m, Sq, stride_ob, stride_os, stride_oh,
                                     DV0, HEAD_DIM_V, o_layout)
    g += num_tiles
    # the token's turns: one per GEMM issue of the tile, num_tiles + 1 where it has any
    sk += num_tiles + (num_tiles > 0).to(gl.int32)

    # ---- epilogue: fully masked rows (l_i == 0) give out = 0, lse = -inf
    # the tile's batch and head only now, for the stores: computed before the loop they would hold
    # registers through it (three consumers at 160 have none to spare: ptxas, spills in the loop)
    b, h, _ = _tile_head(bh, num_heads_q, 1)
    if ROWSUM_MMA:
        # every column of the row-sum accumulator holds the row's sum
        l_i = gl.convert_layout(gl.max(acc_l, axis=1), row_s)
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
    out = _scale_rows(acc, 1.0 / l_safe, row_o, row_o1, DV1)  # [M_WG, DV0] (and [M_WG, DV1])
    if MERGE:
        # merged with this launch's (O, lse) over the partial tiles
        out, lse = _merge_rows(out[0], lse, o_a, lse_a, row_o)
        out = (out,)
    gl.store(Lse + bh.to(gl.int64) * Sq + offs_m, lse, mask=offs_m < Sq)
    if STORE_TMA:
        # O staged in shared memory for a TMA store (clipped at Sq and at HEAD_DIM_V), piece by
        # piece: its own buffers (O_OWN: the previous tile's store must have read them), or Q's,
        # no longer read (the launcher asks for STORE_TMA only where O's pieces fit Q's)
        if O_OWN:
            tma.store_wait(0)
            o0_smem = o_smem[0].index(WG)
        else:
            o0_smem = _o_stage(q[0], WG, q_smem[0], DQK0, DV0, CONSUMERS)
        o0_smem.store(out[0].to(dtype))
        if DV1 > 0:
            if O_OWN:
                o1_smem = o_smem[1].index(WG)
            else:
                o1_smem = _o_stage(q[1], WG, q_smem[1], DQK1, DV1, CONSUMERS)
            o1_smem.store(out[1].to(dtype))
        fence_async_shared()
        _store_box(o_desc[0], b, row0, h, 0, o0_smem, PERSISTENT)
        if DV1 > 0:
            _store_box(o_desc[1], b, row0, h, DV0, o1_smem, PERSISTENT)
        if not O_OWN:
            tma.store_wait(0)
            if PERSISTENT:
                # Q's buffer has staged O: only now may the next tile's Q land there
                mbarrier.arrive(q_empty.index(WG))
    else:
        # another output dtype (float32 partial outputs for context parallelism)
        o_base = Out + b.to(gl.int64) * stride_ob + h * stride_oh
        _store_piece(out[0], o_base, row0, Sq, stride_os, 0, DV0, HEAD_DIM_V, o_layout)
        if DV1 > 0:
            _store_piece(out[1], o_base, row0, Sq, stride_os, DV0, DV1, HEAD_DIM_V, o1_layout)
    return g, sk

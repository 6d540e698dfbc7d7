r"""Backward of the dense structured-mask attention in Gluon on sm_90: dQ and dK/dV in two kernels.

Math (``kernels/dense/op.py``; log2 domain, ``lse2 = lse * log2(e)``, ``delta = rowsum(dO * O) - dlse``)::

    p_ij  = exp2(s_ij * qk_scale - lse2_i)        (0 where masked; a row that attends nothing has
                                                    lse = -inf and every entry masked: p = 0)
    ds_ij = p_ij * (dO_i . v_j - delta_i)
    dQ_i  = softmax_scale * sum_j ds_ij k_j          dK_j = softmax_scale * sum_i ds_ij q_i
    dV_j  = sum_i p_ij dO_i                         (dK, dV summed over the G heads of a group)

Why two kernels and not FA3's one kernel with dQ by atomics: Gluon 3.6 exposes no TMA reduce on
Hopper, and a separate dQ pass costs 7 GEMMs per tile pair instead of 5 but needs no atomics (each
dQ, dK, dV tile is written once by one program: bitwise reproducible).

``gluon_bwd_dq_kernel``: query-major like the forward. One CTA = a 128-row query tile (two
consumer warpgroups of 64 rows) of one query head; a producer warp loads Q and dO once and K_j,
V_j into a ring. Per key tile the consumer issues ``S_j = Q K_j^T``, ``dP_j = dO V_j^T`` and the
previous tile's ``dQ += dS_{j-1} K_{j-1}`` back to back, waits for the first two only, computes
``dS_j`` while the third runs.

``gluon_bwd_dkdv_kernel``: key-major. One CTA = a 128-row key tile (two consumer warpgroups of 64
keys, each holding its dK and dV in registers) of one KV head; it walks, for each of the G query
heads of the group, the query tiles (64 rows) of the key-major plan: the producer loads K, V once
and Q_i, dO_i into a ring; the consumer issues ``S^T = K Q_i^T``, ``dP^T = V dO_i^T`` and the
previous tile's ``dV += P^T dO``, ``dK += dS^T Q`` back to back and computes ``P^T, dS^T`` of
this tile while the last two run.

With ``MASK_HEAD`` (the D = 128 default, ``config.bwd_tiles``; ``op.dq_plan``) the dQ kernel walks
the forward's head plan: each query tile's (at most two) partial key tiles first, masked without a
branch (step 1 peeled out of the loop, ``_dq_step``), so the loop is compiled without the mask path
(sm_90a: 256 instructions a step instead of 444, no spills).

Both use the merged run lists of ``plan.py`` (the dK/dV kernel's wrap to the next query head at
the end of the list). Rows >= Sq and keys >= Sk are zero-filled by TMA and contribute nothing
(zero dO rows, zero delta); stores are clipped by the descriptors.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from longca_triton.kernels.core import jit as _core
from longca_triton.kernels.gluon.fwd_parts import (
    M_WG,
    _a_layout,
    _acc_layout,
    _advance,
    _load_kv_ring,
    _program,
    _ring,
    _tile_desc,
)
from longca_triton.kernels.gluon.fwd_softmax import _interval_mask

__all__ = ["gluon_bwd_dq_kernel", "gluon_bwd_dkdv_kernel"]

LOG2E = gl.constexpr(_core.LOG2E)


@gluon.jit
def _ds(s2, dp, lse2, delta):
    """``(p, ds)`` of one tile: ``s2`` the scores in log2 units (``s * qk_scale``, -inf where
    masked), ``dp = dO . v``; ``lse2`` and ``delta`` already broadcast to the tile's shape."""
    p = gl.exp2(s2 - lse2)
    return p, p * (dp - delta)


@gluon.jit
def _row_stats(Lse, Delta, offs, Sq):
    """``(lse2, delta)`` of query rows ``offs``: lse in log2 units, -inf rows (nothing allowed)
    mapped to 0 so that their masked entries give exp2(-inf) = 0 instead of NaN."""
    ok = offs < Sq
    lse = gl.load(Lse + offs, mask=ok, other=0.0)
    lse2 = gl.where(lse == float("-inf"), 0.0, lse * LOG2E)
    return lse2, gl.load(Delta + offs, mask=ok, other=0.0)


# ----------------------------------------------------------------------------------------------
# dQ (query-major)
# ----------------------------------------------------------------------------------------------

@gluon.jit
def _dq_step(j, q, do, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, dq, ds_op, r, n, e, r0, num_full,
             offs_m, s_zero, lse2, delta, LO, HI, RUN_START, RUN_END, qk_scale, Sq, MASK: gl.constexpr,
             s_layout: gl.constexpr, op_layout: gl.constexpr, BLOCK_N: gl.constexpr, NUM_IV: gl.constexpr,
             NUM_STAGES: gl.constexpr):
    """Step ``j >= 1`` of the dQ kernel's key walk: ``S_j``, ``dP_j`` and the previous tile's ``dQ +=
    dS_{j-1} K_{j-1}`` issued back to back, ``dS_j`` computed while the last runs. ``MASK``: 0 none, 1
    the interval mask on partial runs (a branch: ``HAS_PARTIAL_TILES``), 2 always (``MASK_HEAD``'s
    peeled step 1). Returns ``(dq, ds_op, r, n, e)``."""
    dtype: gl.constexpr = k_smem.dtype
    st = j % NUM_STAGES
    pst = (j - 1) % NUM_STAGES
    ph = (j // NUM_STAGES) & 1
    mbarrier.wait(k_ready.index(st), ph)
    mbarrier.wait(v_ready.index(st), ph)
    s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp = warpgroup_mma(do, v_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dq = warpgroup_mma(ds_op, k_smem.index(pst), dq, is_async=True)
    # S_j and dP_j are done when only the dQ GEMM may still be in flight
    s, dp = warpgroup_mma_wait(1, deps=(s, dp))
    mbarrier.arrive(v_empty.index(st))
    if MASK == 1:
        if r >= r0 + num_full:
            s = _interval_mask(s, offs_m, n, LO, HI, Sq, s_layout, BLOCK_N, NUM_IV)
    elif MASK == 2:
        s = _interval_mask(s, offs_m, n, LO, HI, Sq, s_layout, BLOCK_N, NUM_IV)
    p, ds = _ds(s * qk_scale, dp, lse2, delta)
    dq = warpgroup_mma_wait(0, deps=(dq,))
    mbarrier.arrive(k_empty.index(pst))
    ds_op = gl.convert_layout(ds.to(dtype), op_layout)
    r, n, e = _advance(r, n, e, RUN_START, RUN_END)
    return dq, ds_op, r, n, e


@gluon.jit
def _dq_consumer(WG: gl.constexpr, q_smem, do_smem, k_smem, v_smem, bars, dq_desc, Lse, Delta,
                 LO, HI, RUN_START, RUN_END, plan, qk_scale, softmax_scale, Sq,
                 HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_IV: gl.constexpr,
                 NUM_STAGES: gl.constexpr, HAS_PARTIAL_TILES: gl.constexpr, MASK_HEAD: gl.constexpr):
    in_bar, k_ready, k_empty, v_ready, v_empty = bars
    start_m, bh, r0, num_full, num_tiles = plan
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _acc_layout(BLOCK_N)
    o_layout: gl.constexpr = _acc_layout(HEAD_DIM)
    op_layout: gl.constexpr = _a_layout(o_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    row0 = start_m + WG * M_WG
    offs_m = row0 + gl.arange(0, M_WG, layout=row_s)  # [M_WG]
    lse2, delta = _row_stats(Lse + bh.to(gl.int64) * Sq, Delta + bh.to(gl.int64) * Sq, offs_m, Sq)
    lse2 = gl.expand_dims(lse2, 1)
    delta = gl.expand_dims(delta, 1)
    s_zero = gl.zeros([M_WG, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([M_WG, HEAD_DIM], gl.float32, o_layout)
    q = q_smem.index(WG)
    do = do_smem.index(WG)
    mbarrier.wait(in_bar, 0)

    if num_tiles > 0:
        r = r0
        n = gl.load(RUN_START + r)
        e = gl.load(RUN_END + r)
        mbarrier.wait(k_ready.index(0), 0)
        mbarrier.wait(v_ready.index(0), 0)
        s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do, v_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s, dp = warpgroup_mma_wait(0, deps=(s, dp))
        mbarrier.arrive(v_empty.index(0))
        if HAS_PARTIAL_TILES:
            if r >= r0 + num_full:
                s = _interval_mask(s, offs_m, n, LO, HI, Sq, s_layout, BLOCK_N, NUM_IV)
        elif MASK_HEAD > 0:
            # the walk's first key tiles are its only partial ones (``plan.build_ws_plan(part="head")``,
            # as the forward's ``MASK_HEAD``): masked without a branch, the loop compiled without the
            # mask path (with it the loop is 444 sm_90a instructions instead of 255)
            s = _interval_mask(s, offs_m, n, LO, HI, Sq, s_layout, BLOCK_N, NUM_IV)
        p, ds = _ds(s * qk_scale, dp, lse2, delta)
        ds_op = gl.convert_layout(ds.to(dtype), op_layout)
        r, n, e = _advance(r, n, e, RUN_START, RUN_END)
        if MASK_HEAD == 2:
            # step 1 out of the loop, masked without a branch too (every walk has >= 2 tiles: the plan
            # pads a one-tile walk with a tile none of its rows may see)
            dq, ds_op, r, n, e = _dq_step(1, q, do, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, dq, ds_op,
                                          r, n, e, r0, num_full, offs_m, s_zero, lse2, delta, LO, HI, RUN_START,
                                          RUN_END, qk_scale, Sq, 2, s_layout, op_layout, BLOCK_N, NUM_IV, NUM_STAGES)
        J0: gl.constexpr = 2 if MASK_HEAD == 2 else 1
        for j in range(J0, num_tiles):
            dq, ds_op, r, n, e = _dq_step(j, q, do, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, dq, ds_op,
                                          r, n, e, r0, num_full, offs_m, s_zero, lse2, delta, LO, HI, RUN_START,
                                          RUN_END, qk_scale, Sq, 1 if HAS_PARTIAL_TILES else 0, s_layout,
                                          op_layout, BLOCK_N, NUM_IV, NUM_STAGES)
        lst = (num_tiles - 1) % NUM_STAGES
        dq = warpgroup_mma(ds_op, k_smem.index(lst), dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq,))
        mbarrier.arrive(k_empty.index(lst))

    # Q is no longer read: its buffer stages dQ for a TMA store (clipped at Sq)
    q.store((dq * softmax_scale).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [row0, 0], q)
    tma.store_wait(0)


@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, bars,
                 RUN_START, RUN_END, plan, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    in_bar, k_ready, k_empty, v_ready, v_empty = bars
    start_m, bh, r0, num_full, num_tiles = plan
    mbarrier.expect(in_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [start_m + w * M_WG, 0], in_bar, q_smem.index(w))
        tma.async_copy_global_to_shared(do_desc, [start_m + w * M_WG, 0], in_bar, do_smem.index(w))
    # one head-dim piece each (the forward's ring also takes split head dims, ``SPLIT_D``)
    _load_kv_ring((k_desc,), (v_desc,), (k_smem,), (v_smem,), k_ready, k_empty, v_ready, v_empty, RUN_START,
                  RUN_END, r0, num_tiles, BLOCK_N, NUM_STAGES, 0, 0, 0, 0)


@gluon.jit
def gluon_bwd_dq_kernel(
    Q, K, V, DO, DQ, Lse, Delta,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    LO, HI, ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT, RUN_START, RUN_END,
    qk_scale, softmax_scale,
    Sq, Sk, num_bh, num_heads_q, group_size,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_IV: gl.constexpr,
    NUM_STAGES: gl.constexpr, HAS_PARTIAL_TILES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, MASK_HEAD: gl.constexpr,
):
    rank, bh, b, h, h_kv = _program(num_bh, num_heads_q, group_size)
    tile_m = gl.load(ORDER + rank)
    start_m = tile_m * (2 * M_WG)
    r0 = gl.load(RUN_PTR + tile_m)
    plan = (start_m, bh, r0, gl.load(RUN_NFULL + tile_m), gl.load(RUN_COUNT + tile_m))

    dtype: gl.constexpr = Q.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M_WG, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    b64 = b.to(gl.int64)
    q_desc = _tile_desc(Q + b64 * stride_qb + h * stride_qh, Sq, stride_qs, M_WG, HEAD_DIM, q_layout)
    do_desc = _tile_desc(DO + b64 * stride_dob + h * stride_doh, Sq, stride_dos, M_WG, HEAD_DIM, q_layout)
    dq_desc = _tile_desc(DQ + b64 * stride_dqb + h * stride_dqh, Sq, stride_dqs, M_WG, HEAD_DIM, q_layout)
    k_desc = _tile_desc(K + b64 * stride_kb + h_kv * stride_kh, Sk, stride_ks, BLOCK_N, HEAD_DIM, kv_layout)
    v_desc = _tile_desc(V + b64 * stride_vb + h_kv * stride_vh, Sk, stride_vs, BLOCK_N, HEAD_DIM, kv_layout)

    q_smem = gl.allocate_shared_memory(dtype, [2, M_WG, HEAD_DIM], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, M_WG, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    in_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    mbarrier.init(in_bar, count=1)
    k_ready, k_empty = _ring(NUM_STAGES, 2)
    v_ready, v_empty = _ring(NUM_STAGES, 2)
    bars = (in_bar, k_ready, k_empty, v_ready, v_empty)

    # the two consumers (warpgroup index first), then the producer: one comprehension, as the forward's
    gl.warp_specialize([
        (_dq_consumer, (wg, q_smem, do_smem, k_smem, v_smem, bars, dq_desc, Lse, Delta, LO, HI,
                        RUN_START, RUN_END, plan, qk_scale, softmax_scale, Sq, HEAD_DIM, BLOCK_N,
                        NUM_IV, NUM_STAGES, HAS_PARTIAL_TILES, MASK_HEAD)) if wg < 2 else
        (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, bars,
                        RUN_START, RUN_END, plan, BLOCK_N, NUM_STAGES))
        for wg in (0, 1, 2)
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# dK / dV (key-major)
# ----------------------------------------------------------------------------------------------

@gluon.jit
def _advance_wrap(r, n, e, g, r0, r_end, RUN_START, RUN_END):
    """``_advance`` over the key tile's run list, wrapping to its start (and the next query head
    of the group, ``g``) after the last run."""
    n = n + 1
    if n == e:
        r = r + 1
        if r == r_end:
            r = r0
            g = g + 1
        n = gl.load(RUN_START + r)
        e = gl.load(RUN_END + r)
    return r, n, e, g


@gluon.jit
def _interval_mask_t(s_t, offs_k, offs_q, LO, HI, Sq, NUM_IV: gl.constexpr):
    """The transposed element mask: ``s_t [keys, queries]`` with -inf where query ``i`` (column)
    does not attend key ``j`` (row). Query rows >= Sq read empty intervals."""
    ok = offs_q < Sq
    keys = gl.expand_dims(offs_k, 1)  # [KEYS, 1]
    lo = gl.load(LO + offs_q * NUM_IV, mask=ok, other=0)
    hi = gl.load(HI + offs_q * NUM_IV, mask=ok, other=0)
    allowed = (keys >= gl.expand_dims(lo, 0)) & (keys < gl.expand_dims(hi, 0))
    for t in gl.static_range(1, NUM_IV):
        lo = gl.load(LO + offs_q * NUM_IV + t, mask=ok, other=0)
        hi = gl.load(HI + offs_q * NUM_IV + t, mask=ok, other=0)
        allowed = allowed | ((keys >= gl.expand_dims(lo, 0)) & (keys < gl.expand_dims(hi, 0)))
    return gl.where(allowed, s_t, float("-inf"))


@gluon.jit
def _dkdv_step_math(s_t, dp_t, g, m, offs_k, partial, Lse, Delta, LO, HI, lse_base, qk_scale, Sq,
                    t_layout: gl.constexpr, BLOCK_MQ: gl.constexpr, NUM_IV: gl.constexpr,
                    HAS_PARTIAL_TILES: gl.constexpr):
    """``(P^T, dS^T)`` of query tile ``m`` of group head ``g`` for this warpgroup's keys."""
    offs_q = m * BLOCK_MQ + gl.arange(0, BLOCK_MQ, layout=gl.SliceLayout(0, t_layout))
    base = (lse_base + g).to(gl.int64) * Sq
    lse2, delta = _row_stats(Lse + base, Delta + base, offs_q, Sq)
    if HAS_PARTIAL_TILES:
        if partial:
            s_t = _interval_mask_t(s_t, offs_k, offs_q, LO, HI, Sq, NUM_IV)
    return _ds(s_t * qk_scale, dp_t, gl.expand_dims(lse2, 0), gl.expand_dims(delta, 0))


@gluon.constexpr_function
def _key_major_layouts(block_mq, head_dim):
    """``(t_layout, acc_layout, op_layout)`` of a key-major consumer warpgroup: S^T, dP^T
    ``[64 keys, BLOCK_MQ queries]``; dK, dV ``[64 keys, D]``; P^T / dS^T as a register A operand."""
    acc_layout = _acc_layout(head_dim)
    return _acc_layout(block_mq), acc_layout, _a_layout(acc_layout)


@gluon.jit
def _run_cursor(r0, RUN_START, RUN_END):
    """The run-list cursor ``(r, m, e, g)`` at a key tile's first query tile (``_advance_wrap``)."""
    r = r0
    m = gl.load(RUN_START + r)
    e = gl.load(RUN_END + r)
    g = 0
    return r, m, e, g


@gluon.jit
def _key_major_consumer_start(WG: gl.constexpr, k_smem, v_smem, kv_bar, start_n, t_layout: gl.constexpr,
                              acc_layout: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_MQ: gl.constexpr):
    """A key-major consumer warpgroup's keys ``key0 ..`` (``offs_k``), the zero S^T accumulator,
    zero dK, dV, and its K, V halves once ``kv_bar`` has seen them loaded."""
    key0 = start_n + WG * M_WG
    offs_k = key0 + gl.arange(0, M_WG, layout=gl.SliceLayout(1, t_layout))
    t_zero = gl.zeros([M_WG, BLOCK_MQ], gl.float32, t_layout)
    dk = gl.zeros([M_WG, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([M_WG, HEAD_DIM], gl.float32, acc_layout)
    k = k_smem.index(WG)
    v = v_smem.index(WG)
    mbarrier.wait(kv_bar, 0)
    return key0, offs_k, t_zero, dk, dv, k, v


@gluon.jit
def _store_dkdv(dk, dv, k, v, dk_desc, dv_desc, key0, softmax_scale):
    """K and V are no longer read: their buffers stage dK and dV for TMA stores (clipped at Sk)."""
    dtype: gl.constexpr = k.dtype
    k.store((dk * softmax_scale).to(dtype))
    v.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [key0, 0], k)
    tma.async_copy_shared_to_global(dv_desc, [key0, 0], v)
    tma.store_wait(0)


@gluon.jit
def _dkdv_consumer(WG: gl.constexpr, k_smem, v_smem, q_smem, do_smem, bars, dk_desc, dv_desc,
                   Lse, Delta, LO, HI, RUN_START, RUN_END, plan, qk_scale, softmax_scale, Sq,
                   HEAD_DIM: gl.constexpr, BLOCK_MQ: gl.constexpr, NUM_IV: gl.constexpr,
                   NUM_STAGES: gl.constexpr, HAS_PARTIAL_TILES: gl.constexpr):
    kv_bar, in_ready, in_empty = bars
    start_n, lse_base, r0, r_end, num_full, num_steps = plan
    dtype: gl.constexpr = k_smem.dtype
    t_layout: gl.constexpr = _key_major_layouts(BLOCK_MQ, HEAD_DIM)[0]
    acc_layout: gl.constexpr = _key_major_layouts(BLOCK_MQ, HEAD_DIM)[1]
    op_layout: gl.constexpr = _key_major_layouts(BLOCK_MQ, HEAD_DIM)[2]
    key0, offs_k, t_zero, dk, dv, k, v = _key_major_consumer_start(WG, k_smem, v_smem, kv_bar, start_n, t_layout,
                                                                   acc_layout, HEAD_DIM, BLOCK_MQ)

    # one tile at a time: no P^T, dS^T operands carried across steps (fewer live registers);
    # the two warpgroups overlap each other's math and GEMMs
    r, m, e, g = _run_cursor(r0, RUN_START, RUN_END)
    for j in range(num_steps):
        st = j % NUM_STAGES
        mbarrier.wait(in_ready.index(st), (j // NUM_STAGES) & 1)
        s_t = warpgroup_mma(k, q_smem.index(st).permute((1, 0)), t_zero, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v, do_smem.index(st).permute((1, 0)), t_zero, use_acc=False, is_async=True)
        s_t, dp_t = warpgroup_mma_wait(0, deps=(s_t, dp_t))
        p_t, ds_t = _dkdv_step_math(s_t, dp_t, g, m, offs_k, r >= r0 + num_full, Lse, Delta, LO,
                                    HI, lse_base, qk_scale, Sq, t_layout, BLOCK_MQ, NUM_IV,
                                    HAS_PARTIAL_TILES)
        dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), op_layout), do_smem.index(st), dv,
                           is_async=True)
        dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), op_layout), q_smem.index(st), dk,
                           is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        mbarrier.arrive(in_empty.index(st))
        r, m, e, g = _advance_wrap(r, m, e, g, r0, r_end, RUN_START, RUN_END)

    _store_dkdv(dk, dv, k, v, dk_desc, dv_desc, key0, softmax_scale)


@gluon.jit
def _dkdv_producer(k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, bars,
                   RUN_START, RUN_END, plan, HEAD_DIM: gl.constexpr, BLOCK_MQ: gl.constexpr,
                   NUM_STAGES: gl.constexpr):
    kv_bar, in_ready, in_empty = bars
    start_n, lse_base, r0, r_end, num_full, num_steps = plan
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [start_n + w * M_WG, 0], kv_bar, k_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [start_n + w * M_WG, 0], kv_bar, v_smem.index(w))
    r, m, e, g = _run_cursor(r0, RUN_START, RUN_END)
    for j in range(num_steps):
        st = j % NUM_STAGES
        mbarrier.wait(in_empty.index(st), ((j // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(in_ready.index(st), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        # the [Sq, Hq * D] view of one batch entry: query head lse_base + g is column block g
        col = g * HEAD_DIM
        tma.async_copy_global_to_shared(q_desc, [m * BLOCK_MQ, col], in_ready.index(st), q_smem.index(st))
        tma.async_copy_global_to_shared(do_desc, [m * BLOCK_MQ, col], in_ready.index(st), do_smem.index(st))
        r, m, e, g = _advance_wrap(r, m, e, g, r0, r_end, RUN_START, RUN_END)


@gluon.jit
def _key_major_program(ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT, num_bkv, num_heads_q, num_heads_kv, group_size):
    """The key-major program ``pid`` (the dK/dV kernel): ``(b, h_kv, plan)``, ``plan`` the
    cursor tuple ``(start_n, lse_base, r0, r_end, n_full, steps)`` of its 128-row key tile, where
    ``steps`` counts the tile's query tiles over every query head of the KV group."""
    pid = gl.program_id(0)
    rank = pid // num_bkv
    bkv = pid % num_bkv
    b = bkv // num_heads_kv
    h_kv = bkv % num_heads_kv
    tile_n = gl.load(ORDER + rank)
    start_n = tile_n * (2 * M_WG)
    r0 = gl.load(RUN_PTR + tile_n)
    r_end = gl.load(RUN_PTR + tile_n + 1)
    # (b, first query head of the group): the lse / delta rows are [B, Hq, Sq]
    lse_base = b * num_heads_q + h_kv * group_size
    plan = (start_n, lse_base, r0, r_end, gl.load(RUN_NFULL + tile_n),
            gl.load(RUN_COUNT + tile_n) * group_size)
    return b, h_kv, plan


@gluon.jit
def _key_major_descs(Q, K, V, DO, DK, DV, stride_qb, stride_qs, stride_dob, stride_dos,
                     stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                     stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                     b, h_kv, group_size, Sq, Sk, HEAD_DIM: gl.constexpr, BLOCK_MQ: gl.constexpr):
    """TMA descriptors of a key-major program: Q and dO of the whole KV group as one
    ``[Sq, G * D]`` matrix in ``[BLOCK_MQ, D]`` tiles (heads contiguous: the launchers check), and
    K, V, dK, dV of its KV head in ``[64, D]`` tiles (one per consumer warpgroup)."""
    dtype: gl.constexpr = Q.dtype.element_ty
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M_WG, HEAD_DIM], dtype)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_MQ, HEAD_DIM], dtype)
    b64 = b.to(gl.int64)
    hq0 = h_kv * group_size
    q_desc = tma.make_tensor_descriptor(Q + b64 * stride_qb + hq0 * HEAD_DIM, [Sq, group_size * HEAD_DIM],
                                        [stride_qs, 1], [BLOCK_MQ, HEAD_DIM], q_layout)
    do_desc = tma.make_tensor_descriptor(DO + b64 * stride_dob + hq0 * HEAD_DIM, [Sq, group_size * HEAD_DIM],
                                         [stride_dos, 1], [BLOCK_MQ, HEAD_DIM], q_layout)
    k_desc = _tile_desc(K + b64 * stride_kb + h_kv * stride_kh, Sk, stride_ks, M_WG, HEAD_DIM, kv_layout)
    v_desc = _tile_desc(V + b64 * stride_vb + h_kv * stride_vh, Sk, stride_vs, M_WG, HEAD_DIM, kv_layout)
    dk_desc = _tile_desc(DK + b64 * stride_dkb + h_kv * stride_dkh, Sk, stride_dks, M_WG, HEAD_DIM, kv_layout)
    dv_desc = _tile_desc(DV + b64 * stride_dvb + h_kv * stride_dvh, Sk, stride_dvs, M_WG, HEAD_DIM, kv_layout)
    return q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc


@gluon.jit
def _key_major_buffers(dtype: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_MQ: gl.constexpr,
                       NUM_STAGES: gl.constexpr):
    """Shared memory of a key-major program: K and V (one 64-row half per consumer, loaded once
    behind ``kv_bar``) and the ``NUM_STAGES`` ring of Q / dO tiles with its ready/empty barriers
    (empty: both consumers arrive)."""
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M_WG, HEAD_DIM], dtype)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_MQ, HEAD_DIM], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [2, M_WG, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, M_WG, HEAD_DIM], kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_MQ, HEAD_DIM], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_MQ, HEAD_DIM], q_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    in_ready, in_empty = _ring(NUM_STAGES, 2)
    return k_smem, v_smem, q_smem, do_smem, kv_bar, in_ready, in_empty


@gluon.jit
def gluon_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, Lse, Delta,
    stride_qb, stride_qs, stride_dob, stride_dos,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    LO, HI, ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT, RUN_START, RUN_END,
    qk_scale, softmax_scale,
    Sq, Sk, num_bkv, num_heads_q, num_heads_kv, group_size,
    HEAD_DIM: gl.constexpr, BLOCK_MQ: gl.constexpr, NUM_IV: gl.constexpr,
    NUM_STAGES: gl.constexpr, HAS_PARTIAL_TILES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    b, h_kv, plan = _key_major_program(ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT, num_bkv, num_heads_q,
                                       num_heads_kv, group_size)
    q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc = _key_major_descs(
        Q, K, V, DO, DK, DV, stride_qb, stride_qs, stride_dob, stride_dos, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
        b, h_kv, group_size, Sq, Sk, HEAD_DIM, BLOCK_MQ)
    k_smem, v_smem, q_smem, do_smem, kv_bar, in_ready, in_empty = _key_major_buffers(
        Q.dtype.element_ty, HEAD_DIM, BLOCK_MQ, NUM_STAGES)
    bars = (kv_bar, in_ready, in_empty)

    gl.warp_specialize([
        (_dkdv_consumer, (wg, k_smem, v_smem, q_smem, do_smem, bars, dk_desc, dv_desc, Lse, Delta, LO,
                          HI, RUN_START, RUN_END, plan, qk_scale, softmax_scale, Sq, HEAD_DIM,
                          BLOCK_MQ, NUM_IV, NUM_STAGES, HAS_PARTIAL_TILES)) if wg < 2 else
        (_dkdv_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, bars,
                          RUN_START, RUN_END, plan, HEAD_DIM, BLOCK_MQ, NUM_STAGES))
        for wg in (0, 1, 2)
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

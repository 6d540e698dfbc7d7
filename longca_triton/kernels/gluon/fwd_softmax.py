"""The Gluon forward consumer's math: the interval mask, the online softmax, the two GEMMs
(``S = Q K^T``, ``O += P V``) over the head-dim pieces, the row sums on the tensor cores, and the
epilogue pieces (O staging, the masked store, the split launch's merge). ``fwd.py``'s docstring
has the design.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from longca_triton.kernels.gluon.fwd_parts import (
    LN2,
    LOG2E,
    M_WG,
    _tile_head,
)


@gluon.jit
def _key_cols(n, s_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """The key indices of tile ``n`` as a ``[1, BLOCK_N]`` row in ``s``'s column layout."""
    return gl.expand_dims(n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)


@gluon.jit
def _in_interval(cols, lo, hi):
    """``[M_WG, BLOCK_N]``: whether key ``cols[j]`` lies in row ``i``'s ``[lo[i], hi[i])``."""
    return (cols >= gl.expand_dims(lo, 1)) & (cols < gl.expand_dims(hi, 1))


@gluon.jit
def _interval_mask(s, offs_m, n, LO, HI, Sq, s_layout: gl.constexpr,
                   BLOCK_N: gl.constexpr, NUM_IV: gl.constexpr):
    """``s`` with ``-inf`` where key ``j`` is outside every interval ``[lo[i,t], hi[i,t])`` of
    row ``i``. Rows >= Sq read empty intervals."""
    cols = _key_cols(n, s_layout, BLOCK_N)  # [1, BLOCK_N]
    row_ok = offs_m < Sq
    lo = gl.load(LO + offs_m * NUM_IV, mask=row_ok, other=0)
    hi = gl.load(HI + offs_m * NUM_IV, mask=row_ok, other=0)
    allowed = _in_interval(cols, lo, hi)  # [M_WG, BLOCK_N]
    for t in gl.static_range(1, NUM_IV):
        lo = gl.load(LO + offs_m * NUM_IV + t, mask=row_ok, other=0)
        hi = gl.load(HI + offs_m * NUM_IV + t, mask=row_ok, other=0)
        allowed = allowed | _in_interval(cols, lo, hi)
    return gl.where(allowed, s, float("-inf"))


@gluon.jit
def _row_interval(offs_m, LO, HI, Sq):
    """The one key interval ``[lo, hi)`` of rows ``offs_m`` (``NUM_IV == 1``), ``[M_WG]`` each,
    loaded once before the key loop (``_mask_tile``). Rows >= Sq read an empty interval."""
    row_ok = offs_m < Sq
    return gl.load(LO + offs_m, mask=row_ok, other=0), gl.load(HI + offs_m, mask=row_ok, other=0)


@gluon.jit
def _mask_tile(s, offs_m, n, LO, HI, Sq, iv, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_IV: gl.constexpr, HOLD_IV: gl.constexpr):
    """``s`` of key tile ``n`` with ``-inf`` outside its rows' intervals: with ``HOLD_IV`` (one
    interval a row, two consumers) from its bounds held in registers (``iv``, ``_row_interval``),
    else ``_interval_mask`` (loads per partial tile).

    why hold them: a row's interval is the same for every key tile, and loading it per partial tile
    put global loads between the wait for ``S_j`` and its softmax (ptxas, sm_90a: 6 -> 2 loads a
    step); with three consumers (160 registers) the two registers spill, and a second interval's
    make the loops spill more, so only with one interval and two consumers."""
    if HOLD_IV:
        s = gl.where(_in_interval(_key_cols(n, s_layout, BLOCK_N), iv[0], iv[1]), s, float("-inf"))
    else:
        s = _interval_mask(s, offs_m, n, LO, HI, Sq, s_layout, BLOCK_N, NUM_IV)
    return s


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, ROWSUM_MMA: gl.constexpr):
    """Fold raw scores ``s [M_WG, BLOCK_N]`` (masked entries -inf) into the row max ``m_i`` and
    row sum ``l_i`` (log2 domain; with ``ROWSUM_MMA`` the tensor cores sum the rows, ``l_i`` passes
    through). Returns ``(m_new, l_new, p, alpha)``."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)  # [M_WG]
    # why: a row with nothing allowed so far has m_new = -inf, and -inf - -inf is NaN;
    # subtracting 0 instead keeps p = exp2(-inf) = 0 and alpha = 0.
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    # one FFMA + EX2 per score: the scale is folded into the exponent
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_sub, 1))  # [M_WG, BLOCK_N]
    alpha = gl.exp2(m_i - m_sub)  # [M_WG]
    l_new = l_i
    if not ROWSUM_MMA:
        # one FADD per score (ROWSUM_MMA: none, the P V step's extra GEMM against ones sums P)
        l_new = l_i * alpha + gl.sum(p, axis=1)
    return m_new, l_new, p, alpha


@gluon.jit
def _qk(q, k, s_zero, DQK0: gl.constexpr, DQK1: gl.constexpr, QK_USED: gl.constexpr):
    """``S = Q K^T`` issued as async wgmma; ``q``, ``k``: the head-dim pieces' buffers.

    One piece: over the first ``QK_USED`` columns of the padded tile: all ``DQK0`` of them, or
    (``QK_USED < DQK0``, D_qk in 136..192 on a 256-wide tile) the first half and a quarter, two
    chained GEMMs that skip the zero-filled last quarter. Two pieces (``DQK1 > 0``):
    ``Q0 K0^T + Q1 K1^T``, two chained GEMMs over the exact dim. Returns ``[M_WG, BLOCK_N]``."""
    if DQK1 > 0:
        s = warpgroup_mma(q[0], k[0].permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q[1], k[1].permute((1, 0)), s, is_async=True)
    elif QK_USED == DQK0:
        s = warpgroup_mma(q[0], k[0].permute((1, 0)), s_zero, use_acc=False, is_async=True)
    else:
        HALF: gl.constexpr = DQK0 // 2
        REST: gl.constexpr = QK_USED - HALF
        s = warpgroup_mma(q[0].slice(0, HALF, dim=1), k[0].slice(0, HALF, dim=1).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        s = warpgroup_mma(q[0].slice(HALF, REST, dim=1), k[0].slice(HALF, REST, dim=1).permute((1, 0)), s,
                          is_async=True)
    return s


@gluon.jit
def _pv(p_op, v, acc, DV1: gl.constexpr, p1_layout: gl.constexpr, P_SMEM: gl.constexpr):
    """``O += P V`` issued as async wgmma per head-dim piece of V: ``acc`` is ``(O0,)`` or
    ``(O0, O1)``; both GEMMs take the same P as A operand: registers (``p1_layout`` is the A
    layout of piece 1's accumulator: the same registers, a layout with that parent), or with
    ``P_SMEM`` the warpgroup's shared P buffer (``p_op``), read by both as it is."""
    a0 = warpgroup_mma(p_op, v[0], acc[0], is_async=True)
    out = (a0,)
    if DV1 > 0:
        if P_SMEM:
            out = (a0, warpgroup_mma(p_op, v[1], acc[1], is_async=True))
        else:
            out = (a0, warpgroup_mma(gl.convert_layout(p_op, p1_layout), v[1], acc[1], is_async=True))
    return out


@gluon.jit
def _p_operand(p, p_buf, dtype: gl.constexpr, p_layout: gl.constexpr, P_SMEM: gl.constexpr):
    """The A operand of the next ``P V`` from the softmax's ``p [M_WG, BLOCK_N]`` (fp32): the
    registers in the wgmma A layout, or with ``P_SMEM`` the warpgroup's shared buffer ``p_buf``
    after storing ``p`` there (the caller has waited for the ``P V`` that last read it).

    why the fence: the store goes through the generic proxy and wgmma reads through the async
    proxy; ``fence_async_shared`` orders the two (the compiler's barrier analysis adds the
    warpgroup's ``bar.sync`` before the wgmma, which reads every thread's part)."""
    if P_SMEM:
        p_buf.store(p.to(dtype))
        fence_async_shared()
        p_op = p_buf
    else:
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    return p_op


@gluon.jit
def _rowsum_mma(p_op, ones_smem, acc_l, pl_layout: gl.constexpr, P_SMEM: gl.constexpr):
    """``L += P 1`` (``ROWSUM_MMA``): the row sums of P as one more async wgmma, ``acc_l [M_WG,
    ROWSUM_N]`` (every column the row's sum), issued after the ``P V`` ones; P from registers in the
    A layout of that accumulator (``pl_layout``: the same registers) or from its shared buffer."""
    if P_SMEM:
        a = p_op
    else:
        a = gl.convert_layout(p_op, pl_layout)
    return warpgroup_mma(a, ones_smem.permute((1, 0)), acc_l, is_async=True)


@gluon.jit
def _wait_pv(acc, acc_l, DV1: gl.constexpr, ROWSUM_MMA: gl.constexpr):
    """Wait for every ``P V`` GEMM (and with ``ROWSUM_MMA`` the row sums'): ``(acc, acc_l)``, ``acc``
    a tuple of finished accumulators."""
    if ROWSUM_MMA:
        if DV1 > 0:
            a0, a1, lsum = warpgroup_mma_wait(0, deps=(acc[0], acc[1], acc_l))
            out = ((a0, a1), lsum)
        else:
            a0, lsum = warpgroup_mma_wait(0, deps=(acc[0], acc_l))
            out = ((a0,), lsum)
    elif DV1 > 0:
        out = (warpgroup_mma_wait(0, deps=(acc[0], acc[1])), acc_l)
    else:
        out = ((warpgroup_mma_wait(0, deps=(acc[0],)),), acc_l)
    return out


@gluon.jit
def _scale_rows(acc, x, row_o: gl.constexpr, row_o1: gl.constexpr, DV1: gl.constexpr):
    """Every accumulator piece times the per-row factor ``x [M_WG]``."""
    a0 = acc[0] * gl.expand_dims(gl.convert_layout(x, row_o), 1)
    out = (a0,)
    if DV1 > 0:
        out = (a0, acc[1] * gl.expand_dims(gl.convert_layout(x, row_o1), 1))
    return out


@gluon.jit
def _o_stage(q, WG: gl.constexpr, q_smem, DQK: gl.constexpr, DV: gl.constexpr, CONSUMERS: gl.constexpr):
    """The shared buffer that stages one O piece ``[M_WG, DV]`` for its TMA store: this warpgroup's
    Q buffer ``q`` of the same piece (no longer read), or where O's piece is narrower, its first
    ``[M_WG, DV]`` tile (a view of the ``[CONSUMERS, M_WG, DQK]`` buffers as ``CONSUMERS * DQK / DV``
    tiles)."""
    if DV == DQK:
        o_smem = q
    else:
        # the launcher asks for STORE_TMA only when DV <= DQK (``o_fits_q``)
        RATIO: gl.constexpr = DQK // DV
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M_WG, DV], q_smem.dtype)
        o_smem = q_smem._reinterpret(q_smem.dtype, [CONSUMERS * RATIO, M_WG, DV], layout).index(WG * RATIO)
    return o_smem


@gluon.jit
def _store_piece(out, Out, row0, Sq, stride_os, C0: gl.constexpr, DV: gl.constexpr,
                 HEAD_DIM_V: gl.constexpr, o_layout: gl.constexpr):
    """Masked pointer store of one O piece ``out [M_WG, DV]`` to columns ``[C0, C0 + DV)`` (those
    >= ``HEAD_DIM_V``, the padding, are not stored)."""
    rows = row0 + gl.arange(0, M_WG, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    if C0 > 0:
        cols = C0 + cols
    ptrs = Out + gl.expand_dims(rows.to(gl.int64) * stride_os, 1) + gl.expand_dims(cols, 0)
    if C0 + DV <= HEAD_DIM_V:
        gl.store(ptrs, out.to(Out.dtype.element_ty), mask=gl.expand_dims(rows < Sq, 1))
    else:  # the padded columns >= HEAD_DIM_V are not stored
        ok = gl.expand_dims(rows < Sq, 1) & gl.expand_dims(cols < HEAD_DIM_V, 0)
        gl.store(ptrs, out.to(Out.dtype.element_ty), mask=ok)


@gluon.jit
def _merge_load(Out, Lse, bh, num_heads_q, row0, offs_m, Sq, stride_ob, stride_os, stride_oh, DV: gl.constexpr,
                HEAD_DIM_V: gl.constexpr, o_layout: gl.constexpr):
    """The ``(O_a, lse_a)`` an earlier launch stored for rows ``offs_m`` of batch*head ``bh`` (``MERGE``,
    the split launch): ``O_a [M_WG, DV]`` in its stored dtype (``o_layout``; rows >= Sq and columns >=
    HEAD_DIM_V 0), ``lse_a [M_WG]`` (-inf beyond Sq)."""
    b, h, _ = _tile_head(bh, num_heads_q, 1)
    o_base = Out + b.to(gl.int64) * stride_ob + h * stride_oh
    ok = offs_m < Sq
    lse_a = gl.load(Lse + bh.to(gl.int64) * Sq + offs_m, mask=ok, other=float("-inf"))
    rows = row0 + gl.arange(0, M_WG, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    ptrs = o_base + gl.expand_dims(rows.to(gl.int64) * stride_os, 1) + gl.expand_dims(cols, 0)
    ld_ok = gl.expand_dims(rows < Sq, 1) & gl.expand_dims(cols < HEAD_DIM_V, 0)
    return gl.load(ptrs, mask=ld_ok, other=0.0), lse_a


@gluon.jit
def _merge_rows(out, lse, o_a, lse_a, row_o: gl.constexpr):
    """``(out, lse)`` of some rows merged with the ``(O_a, lse_a)`` an earlier launch stored for them
    (``_merge_load``): with ``lse = logaddexp(lse_a, lse_b)`` the softmax over both key sets is ``O =
    O_a exp(lse_a - lse) + O_b exp(lse_b - lse)``. A row neither launch allowed anything keeps 0 and
    -inf; a row only one of them did gets that one's values (weight 1, the other 0).
    ``out [M_WG, DV]`` fp32 (one head-dim piece), ``lse [M_WG]``."""
    mx = gl.maximum(lse_a, lse)
    mx_s = gl.where(mx == float("-inf"), 0.0, mx)
    w_a = gl.exp2((lse_a - mx_s) * LOG2E)  # [M_WG]: 0 where lse_a = -inf
    w_b = gl.exp2((lse - mx_s) * LOG2E)
    tot = w_a + w_b
    tot_s = gl.where(tot == 0.0, 1.0, tot)
    lse_new = gl.where(mx == float("-inf"), float("-inf"), mx_s + gl.log2(tot_s) * LN2)
    wa = gl.expand_dims(gl.convert_layout(w_a / tot_s, row_o), 1)
    wb = gl.expand_dims(gl.convert_layout(w_b / tot_s, row_o), 1)
    return o_a.to(gl.float32) * wa + out * wb, lse_new

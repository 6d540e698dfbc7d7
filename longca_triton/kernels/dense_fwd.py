"""Forward kernel of the dense structured-mask attention (see ``longca_triton/kernels/dense.py`` for the math).

One program computes one query tile ``[BLOCK_M, D]`` of one query head. Its key tiles come from
the tile plan (``dense_tables.py``) as contiguous runs: first the *full* runs (no mask math at all),
then the *partial* runs (element mask from the per-row intervals). Online softmax in fp32 in the
log2 domain (scores pre-multiplied by ``softmax_scale * log2(e)``, then ``exp2``).
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV: tl.constexpr):
    """``allowed[i, j] = OR_t lo[i, t] <= j < hi[i, t]`` for rows ``offs_m``, columns ``offs_n``.

    Rows outside ``[0, Sq)`` read empty intervals, so they allow nothing; ``hi <= Sk`` keeps
    out-of-range keys out. Shape ``[len(offs_m), len(offs_n)]``.
    """
    row_ok = offs_m < Sq
    lo = tl.load(LO + offs_m * NUM_IV, mask=row_ok, other=0)
    hi = tl.load(HI + offs_m * NUM_IV, mask=row_ok, other=0)
    allowed = (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])
    for t in tl.static_range(1, NUM_IV):
        lo = tl.load(LO + offs_m * NUM_IV + t, mask=row_ok, other=0)
        hi = tl.load(HI + offs_m * NUM_IV + t, mask=row_ok, other=0)
        allowed = allowed | ((offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None]))
    return allowed


@triton.jit
def _fwd_full_run(acc, m_i, l_i, q, k_desc, v_desc, n_lo, n_hi, qk_scale,
                  BLOCK_N: tl.constexpr, WARP_SPEC: tl.constexpr):
    """Key tiles ``[n_lo, n_hi)``, all fully allowed: the plain flash-attention step."""
    for n in tl.range(n_lo, n_hi, warp_specialize=WARP_SPEC):
        start_n = n * BLOCK_N
        k = k_desc.load([start_n, 0])  # [BLOCK_N, D]
        qk = tl.dot(q, k.T)  # [BLOCK_M, BLOCK_N]
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # [BLOCK_M]
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = v_desc.load([start_n, 0])  # [BLOCK_N, D]
        acc = tl.dot(p.to(v.dtype), v, acc)  # [BLOCK_M, D]
        m_i = m_ij
    return acc, m_i, l_i


@triton.jit
def _fwd_part_run(acc, m_i, l_i, q, k_desc, v_desc, n_lo, n_hi, qk_scale, offs_m, LO, HI, Sq,
                  BLOCK_N: tl.constexpr, NUM_IV: tl.constexpr):
    """Key tiles ``[n_lo, n_hi)`` that need the element mask; rows may stay fully masked."""
    for n in tl.range(n_lo, n_hi):
        start_n = n * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = k_desc.load([start_n, 0])
        qk = tl.dot(q, k.T)  # [BLOCK_M, BLOCK_N]
        allowed = _interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV)
        s = tl.where(allowed, qk * qk_scale, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        # why: a row with nothing allowed so far has m_ij = -inf, and -inf - -inf is NaN;
        # subtracting 0 instead keeps p = exp2(-inf) = 0 and alpha = 0.
        m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = v_desc.load([start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
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
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_IV: tl.constexpr, WARP_SPEC: tl.constexpr, HAS_PARTIAL_TILES: tl.constexpr,
):
    # why: batch*head is the fastest-varying index, so the programs running at the same time
    # share a query-tile rank (heaviest first) and the query heads of one GQA group sit next to
    # each other and read the same K/V tiles from L2.
    pid = tl.program_id(0)
    rank = pid // num_bh
    bh = pid % num_bh
    b = bh // num_heads_q
    h = bh % num_heads_q
    h_kv = h // group_size
    tile_m = tl.load(ORDER + rank)
    start_m = tile_m * BLOCK_M

    b64 = b.to(tl.int64)
    q_desc = tl.make_tensor_descriptor(Q + b64 * stride_qb + h * stride_qh, shape=[Sq, HEAD_DIM],
                                       strides=[stride_qs, 1], block_shape=[BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K + b64 * stride_kb + h_kv * stride_kh, shape=[Sk, HEAD_DIM],
                                       strides=[stride_ks, 1], block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + b64 * stride_vb + h_kv * stride_vh, shape=[Sk, HEAD_DIM],
                                       strides=[stride_vs, 1], block_shape=[BLOCK_N, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(Out + b64 * stride_ob + h * stride_oh, shape=[Sq, HEAD_DIM],
                                       strides=[stride_os, 1], block_shape=[BLOCK_M, HEAD_DIM])

    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # rows >= Sq are zero-filled by the descriptor load: finite scores, never stored
    q = q_desc.load([start_m, 0])  # [BLOCK_M, D]

    for r in range(tl.load(FULL_PTR + tile_m), tl.load(FULL_PTR + tile_m + 1)):
        acc, m_i, l_i = _fwd_full_run(acc, m_i, l_i, q, k_desc, v_desc,
                                      tl.load(FULL_START + r), tl.load(FULL_END + r), qk_scale,
                                      BLOCK_N, WARP_SPEC)
    # why a constexpr switch: a plan without partial tiles (full mask, tile-aligned documents)
    # compiles without the masked loop, whose code and registers otherwise stay in the kernel
    if HAS_PARTIAL_TILES:
        for r in range(tl.load(PART_PTR + tile_m), tl.load(PART_PTR + tile_m + 1)):
            acc, m_i, l_i = _fwd_part_run(acc, m_i, l_i, q, k_desc, v_desc,
                                          tl.load(PART_START + r), tl.load(PART_END + r), qk_scale,
                                          offs_m, LO, HI, Sq, BLOCK_N, NUM_IV)

    # fully masked rows (l_i == 0): out = 0, lse = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    o_desc.store([start_m, 0], out.to(Out.dtype.element_ty))
    tl.store(Lse + bh.to(tl.int64) * Sq + offs_m, lse, mask=offs_m < Sq)

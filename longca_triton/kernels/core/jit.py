"""The ``@triton.jit`` pieces shared by the dense, FlashMask and block-sparse kernels.

Triton inlines ``@triton.jit`` helper calls, so a kernel built from these compiles to the same
code as one that spells them out: each helper is one stretch of a kernel's loop body, in the
kernels' order of operations. Variants are switched by ``tl.constexpr`` arguments.

Conventions (the math: ``kernels/dense/op.py``): scores in the log2 domain (``qk_scale =
softmax_scale * log2(e)``, ``exp2``), fp32 accumulators, natural-log lse ``[B, Hq, Sq]``.

Head dims: q and k share ``HEAD_DIM_QK``, v (and out) have ``HEAD_DIM_V``; tiles are padded on the
head-dim axis to powers of two ``BLOCK_DQK`` / ``BLOCK_DV`` (``core.runtime.head_dim_meta``). Tensor
descriptors carry the true dim as their shape and the padded one as their block: padded columns
load as zeros (they add nothing to ``q . k`` nor to ``P @ V``) and are never stored. Where a
power-of-two dim makes the two equal, the code is what it was before padding existed.
Also here: the one ``delta`` preprocess kernel of the three backward passes.
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def tile_desc(base, rows, stride_s, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tensor descriptor over the ``[rows, HEAD_DIM]`` matrix of one head at ``base`` (row
    stride ``stride_s``, unit last stride), read or written in ``[BLOCK, BLOCK_D]`` tiles.

    why two dims: ``BLOCK_D`` is ``HEAD_DIM`` padded to a power of two; the descriptor's bounds
    (``HEAD_DIM``) zero-fill the padded columns on load (TMA, and the interpreter alike) and
    drop them on store, so a head dim of 80 or 96 needs no mask anywhere in the loops."""
    return tl.make_tensor_descriptor(base, shape=[rows, HEAD_DIM], strides=[stride_s, 1],
                                     block_shape=[BLOCK, BLOCK_D])


@triton.jit
def store_dkdv(DK, DV, dk, dv, softmax_scale, b64, h_kv, start_n, Sk, stride_dkb, stride_dkh, stride_dks, stride_dvb,
               stride_dvh, stride_dvs, BLOCK_N: tl.constexpr, HEAD_DIM_QK: tl.constexpr, BLOCK_DQK: tl.constexpr,
               HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Write one key tile's ``dk`` and ``dv`` by TMA (``s = softmax_scale * q.k``: dK takes the scale here)."""
    dk_desc = tile_desc(DK + b64 * stride_dkb + h_kv * stride_dkh, Sk, stride_dks, BLOCK_N, HEAD_DIM_QK, BLOCK_DQK)
    dv_desc = tile_desc(DV + b64 * stride_dvb + h_kv * stride_dvh, Sk, stride_dvs, BLOCK_N, HEAD_DIM_V, BLOCK_DV)
    dk_desc.store([start_n, 0], (dk * softmax_scale).to(DK.dtype.element_ty))
    dv_desc.store([start_n, 0], dv.to(DV.dtype.element_ty))


@triton.jit
def group_desc(base, rows, heads, stride_s, stride_h, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Tensor descriptor over the ``[rows, heads, HEAD_DIM]`` block of ``heads`` adjacent heads at
    ``base`` (a GQA group's query heads), read in ``[BLOCK, 1, BLOCK_D]`` tiles: one head's tile of
    ``tile_desc``, with the head picked by the middle coordinate, so one descriptor serves a loop
    that changes head every step (``dense_bwd``'s row-major dK/dV sweep)."""
    return tl.make_tensor_descriptor(base, shape=[rows, heads, HEAD_DIM], strides=[stride_s, stride_h, 1],
                                     block_shape=[BLOCK, 1, BLOCK_D])


@triton.jit
def head_inputs(Q, DOut, b64, h, num_heads_q, stride_qb, stride_qs, stride_qh, stride_db, stride_ds, stride_dh, Sq,
                BLOCK_M: tl.constexpr, HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """What a head-major dK/dV step over query head ``h`` of batch ``b64`` reads: ``(q_desc, do_desc,
    row_base)``, ``tile_desc`` of q and of dO and the head's lse / delta row."""
    q_desc = tile_desc(Q + b64 * stride_qb + h * stride_qh, Sq, stride_qs, BLOCK_M, HEAD_DIM_QK, BLOCK_DQK)
    do_desc = tile_desc(DOut + b64 * stride_db + h * stride_dh, Sq, stride_ds, BLOCK_M, HEAD_DIM_V, BLOCK_DV)
    return q_desc, do_desc, (b64 * num_heads_q + h) * Sq


@triton.jit
def group_sweep_inputs(Q, DOut, b64, h_kv, num_heads_q, group_size, stride_qb, stride_qs, stride_qh, stride_db,
                       stride_ds, stride_dh, Sq, BLOCK_M: tl.constexpr, HEAD_DIM_QK: tl.constexpr,
                       HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """What a row-major dK/dV sweep over KV head ``h_kv``'s query heads (adjacent: ``h_kv * group_size``
    on) of batch ``b64`` reads: ``(q3_desc, do3_desc, row_base0)``, ``group_desc`` of q and of dO and
    the lse / delta row of the group's first head."""
    h0 = h_kv * group_size
    q3_desc = group_desc(Q + b64 * stride_qb + h0 * stride_qh, Sq, group_size, stride_qs, stride_qh,
                         BLOCK_M, HEAD_DIM_QK, BLOCK_DQK)
    do3_desc = group_desc(DOut + b64 * stride_db + h0 * stride_dh, Sq, group_size, stride_ds, stride_dh,
                          BLOCK_M, HEAD_DIM_V, BLOCK_DV)
    return q3_desc, do3_desc, (b64 * num_heads_q + h0) * Sq


@triton.jit
def head_dim_offsets(HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """``(offs_d [BLOCK_D], d_ok [BLOCK_D])`` for pointer loads and stores along the head dim.

    ``d_ok`` is all True when ``BLOCK_D == HEAD_DIM``; a pointer access ANDs it into its row mask
    only under ``if BLOCK_D != HEAD_DIM`` (a constexpr test), so power-of-two dims keep unmasked
    columns."""
    offs_d = tl.arange(0, BLOCK_D)
    return offs_d, offs_d < HEAD_DIM


@triton.jit
def query_program(num_bh, num_heads_q, group_size):
    """``(rank, bh, b, h, h_kv)`` of a query-major program (one query tile of one query head).

    why: batch*head is the fastest-varying index, so the programs running at the same time share
    a query-tile rank (heaviest first) and the query heads of one GQA group sit next to each
    other and read the same K/V tiles from L2.
    """
    return query_program_at(tl.program_id(0), num_bh, num_heads_q, group_size)


@triton.jit
def query_program_at(pid, num_bh, num_heads_q, group_size):
    """``query_program`` for the program index ``pid`` (a kernel running two program sets in one
    launch numbers each set from 0)."""
    rank = pid // num_bh
    bh = pid % num_bh
    b = bh // num_heads_q
    h = bh % num_heads_q
    h_kv = h // group_size
    return rank, bh, b, h, h_kv


@triton.jit
def key_program(num_bkv, num_heads_kv):
    """``(rank, b, h_kv)`` of a key-major dK/dV program (one key tile of one KV head)."""
    return key_program_at(tl.program_id(0), num_bkv, num_heads_kv)


@triton.jit
def key_program_at(pid, num_bkv, num_heads_kv):
    """``key_program`` for the program index ``pid``."""
    rank = pid // num_bkv
    bkv = pid % num_bkv
    b = bkv // num_heads_kv
    h_kv = bkv % num_heads_kv
    return rank, b, h_kv


@triton.jit
def key_program_outer(pid, num_key_tiles, num_heads_kv):
    """``key_program_at`` with the (batch, KV head) slowest: ``pid = bkv * num_key_tiles + rank``, so
    the programs that run together are key tiles of one KV head (config ``dkdv_head_outer``)."""
    rank = pid % num_key_tiles
    bkv = pid // num_key_tiles
    return rank, bkv // num_heads_kv, bkv % num_heads_kv


@triton.jit
def one_launch_split(pid, n_dkdv, n_dq, ORDER: tl.constexpr):
    """``(is_dkdv, index within its set)`` of program ``pid`` of a one-launch backward (block-sparse: a
    dK/dV program set of ``n_dkdv`` and a dQ set of ``n_dq``).

    ``ORDER`` 0: the dK/dV set first (its programs are the heaviest: each sweeps ``G`` query heads),
    then dQ; 1: dQ first; 2: the two sets interleaved one to one while both last, then the rest of
    the larger one. Each set keeps its plan's order (heaviest tiles first)."""
    if ORDER == 0:
        is_dkdv = pid < n_dkdv
        idx = tl.where(is_dkdv, pid, pid - n_dkdv)
    elif ORDER == 1:
        is_dkdv = pid >= n_dq
        idx = tl.where(is_dkdv, pid - n_dq, pid)
    else:
        n_pairs = tl.minimum(n_dkdv, n_dq)
        paired = pid < 2 * n_pairs
        is_dkdv = tl.where(paired, pid % 2 == 0, n_dkdv > n_dq)
        idx = tl.where(paired, pid // 2, pid - n_pairs)
    return is_dkdv, idx


@triton.jit
def kv_descs(K, V, b64, h_kv, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, Sk,
             BLOCK_N: tl.constexpr, HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
             BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The K and V descriptors of KV head ``h_kv`` of batch entry ``b64``, in ``[BLOCK_N, BLOCK_DQK]``
    and ``[BLOCK_N, BLOCK_DV]`` tiles."""
    k_desc = tile_desc(K + b64 * stride_kb + h_kv * stride_kh, Sk, stride_ks, BLOCK_N, HEAD_DIM_QK, BLOCK_DQK)
    v_desc = tile_desc(V + b64 * stride_vb + h_kv * stride_vh, Sk, stride_vs, BLOCK_N, HEAD_DIM_V, BLOCK_DV)
    return k_desc, v_desc


@triton.jit
def kv_sources(K, V, b64, h_kv, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, Sk,
               BLOCK_N: tl.constexpr, HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
               BLOCK_DV: tl.constexpr, PACKED: tl.constexpr):
    """Where a block-sparse query-major pass reads K/V tiles from: ``kv_descs``, or for a packed list
    (rows gathered: ``gather_rows``) the KV head's base pointers (no descriptor, whose device-side
    creation is not free)."""
    if PACKED:
        k_src = K + b64 * stride_kb + h_kv * stride_kh
        v_src = V + b64 * stride_vb + h_kv * stride_vh
    else:
        k_src, v_src = kv_descs(K, V, b64, h_kv, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                Sk, BLOCK_N, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)
    return k_src, v_src


@triton.jit
def list_chunk(LIST, c0, e_hi, CHUNK: tl.constexpr):
    """Entries ``c0 .. c0 + CHUNK`` of an int32 list (0 past ``e_hi``), in registers: ``[CHUNK]``."""
    offs = c0 + tl.arange(0, CHUNK)
    return tl.load(LIST + offs, mask=offs < e_hi, other=0)


@triton.jit
def chunk_pick(chunk, j, CHUNK: tl.constexpr):
    """Element ``j`` of a ``list_chunk`` (a select and a warp reduction, no memory access)."""
    return tl.sum(tl.where(tl.arange(0, CHUNK) == j, chunk, 0), axis=0)


@triton.jit
def entry_at(COL_START, COL_END, COL_NEXT, e, EVEN: tl.constexpr, PACKED: tl.constexpr):
    """``(start, end, next)`` of block-sparse list entry ``e`` (``block_sparse_tables``), loaded: ``end``
    only for ragged lists (not ``EVEN``; a packed list is always ragged: ``block_sparse_tables`` packs
    only lists whose tiles are not all full), ``next`` only for packed ones; a value a list does not
    need is ``start`` (never read). A packed entry's valid count is ``packed_count``'s, not a load."""
    start = tl.load(COL_START + e)
    end = start
    nxt = start
    if not EVEN:
        end = tl.load(COL_END + e)
    if PACKED:
        nxt = tl.load(COL_NEXT + e)
    return start, end, nxt


@triton.jit
def last_count(COL_COUNT, e_lo, e_hi, PACKED: tl.constexpr):
    """The valid count of a packed list's last entry (the only one that may be short), read once
    before the list's loop; 0 for an empty or unpacked list."""
    count = 0
    if PACKED:
        count = tl.load(COL_COUNT + tl.maximum(e_hi - 1, 0), mask=e_hi > e_lo, other=0)
    return count


@triton.jit
def packed_count(e, e_hi, last, BLOCK: tl.constexpr):
    """Entry ``e``'s valid count in a packed list ending at ``e_hi`` whose last entry has ``last``.

    why not a table load per entry: a load mask that comes from a load inside the loop holds the
    pipeliner's prefetch of the masked tile back; from the loop index it does not."""
    return tl.where(e == e_hi - 1, last, BLOCK)


@triton.jit
def entry_chunk(COL_START, COL_END, COL_NEXT, c0, e_hi, CHUNK: tl.constexpr, EVEN: tl.constexpr,
                PACKED: tl.constexpr):
    """Entries ``c0 .. c0 + CHUNK`` of the lists ``entry_at`` reads, in registers (``list_chunk``), for
    ``entry_pick``. why all of them: a tile's rows (and the mask its loads carry) must not depend on a
    load inside the loop, or the pipeliner prefetches it one step ahead at most."""
    starts = list_chunk(COL_START, c0, e_hi, CHUNK)
    ends = starts
    nxts = starts
    if not EVEN:
        ends = list_chunk(COL_END, c0, e_hi, CHUNK)
    if PACKED:
        nxts = list_chunk(COL_NEXT, c0, e_hi, CHUNK)
    return starts, ends, nxts


@triton.jit
def entry_pick(starts, ends, nxts, j, CHUNK: tl.constexpr, EVEN: tl.constexpr, PACKED: tl.constexpr):
    """``entry_at`` for entry ``c0 + j`` of an ``entry_chunk``."""
    start = chunk_pick(starts, j, CHUNK)
    end = start
    nxt = start
    if not EVEN:
        end = chunk_pick(ends, j, CHUNK)
    if PACKED:
        nxt = chunk_pick(nxts, j, CHUNK)
    return start, end, nxt


@triton.jit
def packed_positions(j, start, end, nxt, count):
    """Rows / columns of a list entry at tile offsets ``j`` (``block_sparse_tables``: a packed tile may
    cross from one run into the next): ``(pos, ok)``, ``pos = start + j`` before ``end``, ``nxt + j``
    after, ``ok = j < count``."""
    first = start + j
    return tl.where(first < end, first, nxt + j), j < count


@triton.jit
def gather_rows(base, pos, ok, stride_s, offs_d, d_ok, EVEN_D: tl.constexpr):
    """Rows ``pos`` (``[N]``, any order) of the ``[rows, D]`` matrix at ``base`` with row stride
    ``stride_s``: ``[N, BLOCK_D]``, zero where ``ok`` is False (and, unless ``EVEN_D``, past the head dim)."""
    m = ok[:, None]  # [N, 1]
    if not EVEN_D:
        m = m & d_ok[None, :]  # [N, BLOCK_D]
    return tl.load(base + pos.to(tl.int64)[:, None] * stride_s + offs_d[None, :], mask=m, other=0.0)


@triton.jit
def interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV: tl.constexpr):
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


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def softmax_init(ROWS: tl.constexpr, BLOCK_DV: tl.constexpr):
    """``(acc [ROWS, BLOCK_DV], m_i [ROWS], l_i [ROWS])`` of an online softmax: 0, -inf, 0 (fp32)."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_DV], tl.float32)
    return acc, m_i, l_i


@triton.jit
def softmax_step(acc, m_i, l_i, qk, v_desc, start_n, qk_scale,
                 PRESCALED: tl.constexpr, GUARD_EMPTY: tl.constexpr):
    """One online-softmax step: fold the scores ``qk [BLOCK_M, BLOCK_N]`` of the key tile at
    ``start_n`` into ``acc [BLOCK_M, D]``, row max ``m_i`` and row sum ``l_i`` (log2 domain).

    ``qk`` is the raw ``q . k`` (masked entries ``-inf``), or, with ``PRESCALED``, already times
    ``qk_scale``. ``GUARD_EMPTY`` (masked tiles): a row may have nothing allowed yet. ``acc`` is
    ``[BLOCK_M, BLOCK_DV]``; V's padded columns load as zeros and stay zero in ``acc``.
    """
    p, acc, m_ij, l_i = softmax_rescale(acc, m_i, l_i, qk, qk_scale, PRESCALED, GUARD_EMPTY)
    v = v_desc.load([start_n, 0])  # [BLOCK_N, BLOCK_DV]
    acc = tl.dot(p.to(v.dtype), v, acc)  # [BLOCK_M, BLOCK_DV]
    return acc, m_ij, l_i


@triton.jit
def softmax_rescale(acc, m_i, l_i, qk, qk_scale, PRESCALED: tl.constexpr, GUARD_EMPTY: tl.constexpr):
    """``softmax_step`` up to the ``P V`` product: ``(p [BLOCK_M, BLOCK_N] fp32, acc rescaled, m_ij,
    l_i)``; the caller adds ``p @ v`` into ``acc`` with V from wherever its tile comes."""
    if PRESCALED:
        m_ij = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M]
    else:
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # [BLOCK_M]
    if GUARD_EMPTY:
        # why: a row with nothing allowed so far has m_ij = -inf, and -inf - -inf is NaN;
        # subtracting 0 instead keeps p = exp2(-inf) = 0 and alpha = 0.
        m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
    else:
        m_sub = m_ij
    if PRESCALED:
        p = tl.math.exp2(qk - m_sub[:, None])  # [BLOCK_M, BLOCK_N]
    else:
        p = tl.math.exp2(qk * qk_scale - m_sub[:, None])  # [BLOCK_M, BLOCK_N]
    alpha = tl.math.exp2(m_i - m_sub)  # [BLOCK_M]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return p, acc, m_ij, l_i


@triton.jit
def softmax_finish(acc, m_i, l_i):
    """``(out [BLOCK_M, BLOCK_DV] fp32, lse [BLOCK_M] natural log)``; fully masked rows (``l_i == 0``)
    give out = 0, lse = -inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    # back to the natural log: * ln(2) (a literal, since jit code reads no plain Python globals)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    return out, lse


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


@triton.jit
def bwd_preprocess_kernel(
    Out, DOut, DLse, Delta, Lse, Stats,
    stride_ob, stride_os, stride_oh,
    stride_db, stride_ds, stride_dh,
    Sq, num_heads_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, HAS_DLSE: tl.constexpr,
    STATS: tl.constexpr = False,
):
    """``delta_i = rowsum(dO_i * O_i) - dlse_i`` (float32 ``[B, Hq, Sq]``), for all three kernels.
    ``HEAD_DIM`` is the value head dim (O and dO are ``[B, Sq, Hq, D_v]``), ``BLOCK_D`` its padded tile.
    ``STATS``: also ``Stats [B, Hq, Sq, 4] = (lse, delta, 0, 0)`` from ``Lse [B, Hq, Sq]``, rows of 16 bytes
    that a dK/dV step reads by one TMA box from any row (``stats_desc``; 16 bytes a query row and head more
    memory, written only where a launch reads them)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // num_heads_q).to(tl.int64)
    h = bh % num_heads_q
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_d, d_ok = head_dim_offsets(HEAD_DIM, BLOCK_D)
    row_ok = offs_m < Sq
    ok = row_ok[:, None]  # [BLOCK, 1]
    if BLOCK_D != HEAD_DIM:
        ok = ok & d_ok[None, :]  # [BLOCK, BLOCK_D]: padded columns read 0, add nothing to the sum
    o = tl.load(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
                mask=ok, other=0.0).to(tl.float32)  # [BLOCK, BLOCK_D]
    do = tl.load(DOut + b * stride_db + h * stride_dh + offs_m[:, None] * stride_ds + offs_d[None, :],
                 mask=ok, other=0.0).to(tl.float32)  # [BLOCK, BLOCK_D]
    delta = tl.sum(o * do, 1)  # [BLOCK]
    row = bh.to(tl.int64) * Sq + offs_m
    if HAS_DLSE:
        # d lse_i / d s_ij = p_ij, so a gradient on lse enters exactly like -delta
        delta -= tl.load(DLse + row, mask=row_ok, other=0.0)
    tl.store(Delta + row, delta, mask=row_ok)
    if STATS:
        lse = tl.load(Lse + row, mask=row_ok, other=0.0)  # [BLOCK]
        col = tl.arange(0, 4)
        # [BLOCK, 4]: lse, delta, 0, 0
        vals = tl.where(col[None, :] == 0, lse[:, None], tl.where(col[None, :] == 1, delta[:, None], 0.0))
        tl.store(Stats + row[:, None] * 4 + col[None, :], vals, mask=row_ok[:, None])


@triton.jit
def stats_desc(Stats, num_bh, Sq, BLOCK_M: tl.constexpr):
    """``Stats [B * Hq, Sq, 4]`` (``bwd_preprocess_kernel``'s ``STATS``: lse, delta, 0, 0 a row) as a
    descriptor of ``[1, BLOCK_M, 4]`` boxes; a box's rows past its head's ``Sq`` read 0, as ``load_row_stats``'s.

    why: loaded by pointers in a dK/dV step, the ``[BLOCK_M]`` stats take the layout of the ``P^T``
    accumulator's columns, in which every thread copies its own share (16 of 64 values each) into shared
    memory (sm_90a: ~35 four-byte cp.async a step with their addresses and predicates); one TMA box copies
    them once. Rows of 16 bytes, because a box may start at any row but a 1-D box only 16-byte aligned."""
    return tl.make_tensor_descriptor(Stats, shape=[num_bh, Sq, 4], strides=[Sq * 4, 4, 1],
                                     block_shape=[1, BLOCK_M, 4])


@triton.jit
def stats_box(desc, bh, row, BLOCK_M: tl.constexpr):
    """lse (natural log) and delta of rows ``row .. row + BLOCK_M`` of head ``bh`` from a ``stats_desc``."""
    box = desc.load([bh, row, 0]).reshape(BLOCK_M, 2, 2)  # [BLOCK_M, 2, 2]: (lse, delta), (0, 0)
    lse_delta, _ = tl.split(box.permute(0, 2, 1))  # [BLOCK_M, 2]: lse, delta
    lse, delta = tl.split(lse_delta)
    return lse, delta


@triton.jit
def lse_log2(lse):
    """lse to the log2 domain; fully masked rows (lse = -inf) get +inf.

    why +inf: such a row has lse = -inf, and exp2(s - (-inf)) would be inf; with +inf every p of
    the row is exp2(-inf) = 0, so it contributes nothing.
    """
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


@triton.jit
def load_row_stats(Lse, Delta, row_base, offs_m, Sq):
    """lse (to log2 domain, ``lse_log2``) and delta for rows ``offs_m``, ``[BLOCK_M]`` each.

    Rows >= Sq read 0: finite, and their zero-filled q / dO rows make every product vanish.
    """
    row_ok = offs_m < Sq
    lse = tl.load(Lse + row_base + offs_m, mask=row_ok, other=0.0)
    lse2 = lse_log2(lse)
    delta = tl.load(Delta + row_base + offs_m, mask=row_ok, other=0.0)
    return lse2, delta


@triton.jit
def recompute_p(a, b, lse2, qk_scale, KEY_MAJOR: tl.constexpr, LSE_NATURAL: tl.constexpr = False):
    """``P`` recomputed from the forward's lse: ``exp2(a . b^T * qk_scale - lse2)``.

    Query-major (dQ): ``a = q [M, BLOCK_DQK]``, ``b = k [N, BLOCK_DQK]``, result ``[M, N]``. ``KEY_MAJOR``
    (dK/dV): ``a = k``, ``b = q``, result ``P^T [N, M]``. ``LSE_NATURAL``: ``lse2`` is still the
    natural-log lse (no -inf rows: block-sparse dK/dV, either orientation), converted here after the matmul.
    """
    qk = tl.dot(a, b.T)
    if KEY_MAJOR:
        if LSE_NATURAL:
            p = tl.math.exp2(qk * qk_scale - (lse2 * 1.4426950408889634)[None, :])  # [BLOCK_N, BLOCK_M]
        else:
            p = tl.math.exp2(qk * qk_scale - lse2[None, :])  # [BLOCK_N, BLOCK_M]
    elif LSE_NATURAL:
        p = tl.math.exp2(qk * qk_scale - (lse2 * 1.4426950408889634)[:, None])  # [BLOCK_M, BLOCK_N]
    else:
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])  # [BLOCK_M, BLOCK_N]
    return p


@triton.jit
def dkdv_update(dk, dv, p_t, q, do, v, delta):
    """Add one query tile into ``dk [BLOCK_N, BLOCK_DQK]`` (unscaled) and ``dv [BLOCK_N, BLOCK_DV]``
    from the masked ``P^T``; returns ``dS^T [BLOCK_N, BLOCK_M]`` (q's dtype) too, for a caller that forms dQ.

    why dP^T before dV (128-wide head-dim tiles): ``dP^T = V dO^T`` does not need ``P^T``, so
    issued first its wgmma runs while the warps compute ``exp2`` for ``P^T`` (sm_90a SASS: the
    MUFU.EX2 sit between its HGMMAs; in the other order they ran between two waits with the tensor
    cores idle). Only at 128-wide head-dim tiles (D = 128, and 80 / 96 padded to 128): at the other
    dims' default tiles the early ``dP^T`` accumulator makes the dK/dV kernel spill, so there the order
    stays dV first."""
    DP_FIRST: tl.constexpr = (q.shape[1] == 128) and (do.shape[1] == 128)
    if DP_FIRST:
        dp_t = tl.dot(v, do.T)  # [BLOCK_N, BLOCK_M]
        dv = tl.dot(p_t.to(do.dtype), do, dv)  # [BLOCK_N, BLOCK_DV]
    else:
        dv = tl.dot(p_t.to(do.dtype), do, dv)  # [BLOCK_N, BLOCK_DV]
        dp_t = tl.dot(v, do.T)  # [BLOCK_N, BLOCK_M]
    ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)  # [BLOCK_N, BLOCK_M]
    dk = tl.dot(ds_t, q, dk)  # [BLOCK_N, BLOCK_DQK]
    return dk, dv, ds_t


@triton.jit
def dkdv_update_qmajor(dk, dv, p, q, do, v, delta):
    """``dkdv_update`` from the query-major ``P [BLOCK_M, BLOCK_N]`` (``recompute_p(q, k, ...)``, masked):
    ``dP = dO V^T`` and ``dS`` query-major too, transposed only as the A operands of ``dV += P^T dO`` and
    ``dK += dS^T Q`` (through shared memory); returns ``dS [BLOCK_M, BLOCK_N]`` (q's dtype) too.

    why: key-major, a thread's share of ``P^T [BLOCK_N, BLOCK_M]`` spans 16 of the 64 query columns, so it
    loads and converts 16 lse and 16 delta values a step; query-major it holds 2 rows (sm_90a, a 64-key x
    64-row step on 4 warps: 507 instructions against 713). And the chained-dot layout (warps stacked along
    M) duplicates a key-major ``[64 keys, rows]`` score tile on 8 warps, which query-major 128 rows do not."""
    dp = tl.dot(do, v.T)  # [BLOCK_M, BLOCK_N]
    ds = (p * (dp - delta[:, None])).to(q.dtype)  # [BLOCK_M, BLOCK_N]
    dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv)  # [BLOCK_N, BLOCK_DV]
    dk = tl.dot(tl.trans(ds), q, dk)  # [BLOCK_N, BLOCK_DQK]
    return dk, dv, ds


@triton.jit
def dq_update(dq, p, do, v, k, delta):
    """Add one key tile into ``dq [BLOCK_M, BLOCK_DQK]`` (unscaled) from the masked ``P``."""
    dp = tl.dot(do, v.T)  # [BLOCK_M, BLOCK_N]
    ds = p * (dp - delta[:, None])  # [BLOCK_M, BLOCK_N]
    dq = tl.dot(ds.to(k.dtype), k, dq)  # [BLOCK_M, BLOCK_DQK]
    return dq


@triton.jit
def dq_skewed_scores(dq, ds_prev, k_prev, q, do, k, v, lse2, qk_scale):
    """One step of the skewed dQ loop (config ``dq_skew``): ``S`` and ``dP`` of this key tile, then
    the *previous* step's ``dq += dS_prev K_prev``; returns ``(dq, p, dp)``, ``p`` unmasked.

    why: Triton 3.6 waits for every wgmma whose result the step itself reads (``S``, ``dP``) right
    after issuing it; only the loop-carried ``dq`` GEMM stays in flight into the next step. In the
    plain order (``dq_update``) that GEMM needs this step's ``dS``, so the ``dS`` arithmetic runs
    between ``dP``'s wait and the GEMM's issue with the tensor cores idle (the exponentials already
    overlap ``dP``'s HGMMAs). Issued one step late, after this step's ``S`` and ``dP``, the GEMM runs
    while this step's ``dS`` is formed (sm_90a SASS of the full-mask kernel: the ``dS`` FADD / FMUL
    interleave with its HGMMAs; in the causal kernel ptxas schedules them ahead of the HGMMAs and
    the gain is gone). ``ds_prev`` is carried in float32 (the
    accumulator layout) and rounded here: carried already rounded, the compiler staged it in shared
    memory, which makes the GEMM wait at once (``dotCanBeProperlyAsync``: a shared operand must be
    multi-buffered). ``k_prev`` is reloaded by the caller (one more TMA tile a step, from L2)."""
    qk = tl.dot(q, k.T)  # [BLOCK_M, BLOCK_N]
    dp = tl.dot(do, v.T)  # [BLOCK_M, BLOCK_N]
    dq = tl.dot(ds_prev.to(k_prev.dtype), k_prev, dq)  # [BLOCK_M, BLOCK_DQK]
    p = tl.math.exp2(qk * qk_scale - lse2[:, None])  # [BLOCK_M, BLOCK_N]
    return dq, p, dp


@triton.jit
def fwd_tile_setup(Q, K, V, Out, b, h, h_kv, tile_m,
                   stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                   stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh, Sq, Sk,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                   BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """What a forward program over query tile ``tile_m`` of query head ``h`` (KV head ``h_kv``, batch ``b``)
    starts from (dense and FlashMask): ``(start_m, q [BLOCK_M, BLOCK_DQK], k_desc, v_desc, o_desc, offs_m, acc,
    m_i, l_i)``, the softmax state empty. Rows >= Sq (and columns >= HEAD_DIM_QK) of q load as zeros: finite
    scores, never stored."""
    start_m = tile_m * BLOCK_M
    b64 = b.to(tl.int64)
    q_desc = tile_desc(Q + b64 * stride_qb + h * stride_qh, Sq, stride_qs, BLOCK_M, HEAD_DIM_QK, BLOCK_DQK)
    k_desc, v_desc = kv_descs(K, V, b64, h_kv, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                              stride_vh, Sk, BLOCK_N, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)
    o_desc = tile_desc(Out + b64 * stride_ob + h * stride_oh, Sq, stride_os, BLOCK_M, HEAD_DIM_V, BLOCK_DV)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    acc, m_i, l_i = softmax_init(BLOCK_M, BLOCK_DV)  # acc [BLOCK_M, BLOCK_DV]
    q = q_desc.load([start_m, 0])  # [BLOCK_M, BLOCK_DQK]
    return start_m, q, k_desc, v_desc, o_desc, offs_m, acc, m_i, l_i


@triton.jit
def dq_tile_setup(Q, K, V, DOut, Lse, Delta, b, h, h_kv, bh, tile_m,
                  stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                  stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh, Sq, Sk,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                  BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """What a dQ program over query tile ``tile_m`` of query head ``h`` (row ``bh`` of the stats, batch ``b``)
    starts from (dense and FlashMask): ``(start_m, offs_m, b64, q, do, k_desc, v_desc, lse2, delta, dq)`` with
    ``dq [BLOCK_M, BLOCK_DQK]`` zero."""
    start_m = tile_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    b64 = b.to(tl.int64)
    q_desc = tile_desc(Q + b64 * stride_qb + h * stride_qh, Sq, stride_qs, BLOCK_M, HEAD_DIM_QK, BLOCK_DQK)
    do_desc = tile_desc(DOut + b64 * stride_db + h * stride_dh, Sq, stride_ds, BLOCK_M, HEAD_DIM_V, BLOCK_DV)
    k_desc, v_desc = kv_descs(K, V, b64, h_kv, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                              stride_vh, Sk, BLOCK_N, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)
    q = q_desc.load([start_m, 0])  # [BLOCK_M, BLOCK_DQK]
    do = do_desc.load([start_m, 0])  # [BLOCK_M, BLOCK_DV]
    lse2, delta = load_row_stats(Lse, Delta, bh.to(tl.int64) * Sq, offs_m, Sq)  # [BLOCK_M] each
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], tl.float32)
    return start_m, offs_m, b64, q, do, k_desc, v_desc, lse2, delta, dq

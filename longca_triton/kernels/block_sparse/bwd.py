"""Block-sparse backward kernels: key-major dK/dV and query-major dQ (see
``longca_triton/kernels/block_sparse/op.py``); delta comes from ``core.bwd_preprocess_kernel``.
Two kernels (default), or both program sets in one launch (``block_sparse_bwd_one_launch_kernel``,
config ``one_launch``; ``core.one_launch_split`` orders them); the bodies are ``_dkdv_program`` /
``_dq_program`` of a program index either way. No atomics in any of them.

Head dims as in the forward: K/V tiles through descriptors padded to ``BLOCK_DQK`` / ``BLOCK_DV``;
the pointer accesses (q, dO, dq, dk, dv) AND a head-dim mask into their row masks only when the
dim is padded.

``PACKED`` (packed lists, ``block_sparse_tables``): an entry's rows (dK/dV: query rows; dQ: keys)
may be two pieces of two runs; the dK/dV pass reads q / dO by pointers anyway and only computes
the rows differently, the dQ pass gathers K/V rows (``core.gather_rows``) instead of reading boxes.

``STATS_TMA`` (config ``dkdv_stats_tma``, full unpacked entries): a dK/dV step reads its rows' lse and delta
from the preprocess's 16-byte rows by one TMA box (``core.stats_desc``) instead of by pointers."""

import triton
import triton.language as tl

from longca_triton.kernels.block_sparse.fwd import _pack_program_at
from longca_triton.kernels.core.jit import (
    dkdv_update,
    dkdv_update_qmajor,
    dq_skewed_scores,
    dq_update,
    entry_at,
    entry_chunk,
    entry_pick,
    gather_rows,
    head_dim_offsets,
    key_program_at,
    key_program_outer,
    kv_descs,
    kv_sources,
    last_count,
    lse_log2,
    one_launch_split,
    packed_count,
    packed_positions,
    recompute_p,
    stats_box,
    stats_desc,
)

__all__ = ["block_sparse_bwd_dkdv_kernel", "block_sparse_bwd_dkdv_merged_kernel", "block_sparse_bwd_dq_kernel",
           "block_sparse_bwd_one_launch_kernel"]


@triton.jit
def _head_rows(Q, DOut, b64, h0, r_head, stride_qb, stride_qh, stride_db, stride_dh, num_heads_q, Sq):
    """Per tile row (``HEADS`` stacked heads from ``h0``; ``r_head`` each row's head offset): the q and
    dO row bases and the lse / delta row offset, ``[HM]`` each."""
    head = h0 + r_head  # [HM]
    return (Q + b64 * stride_qb + head * stride_qh, DOut + b64 * stride_db + head * stride_dh,
            (b64 * num_heads_q + head) * Sq)


@triton.jit
def _dkdv_step(dk, dv, k, v, q_rows, do_rows, stat_rows, Lse, Delta, start, end, nxt, count, r_pos,
               offs_dqk, dqk_ok, offs_dv, dv_ok, stride_qs, stride_ds, qk_scale,
               EVEN_M: tl.constexpr, EVEN_QK: tl.constexpr, EVEN_V: tl.constexpr, PACKED: tl.constexpr,
               STATS_TMA: tl.constexpr = False, stat_bh=0, QMAJOR: tl.constexpr = False):
    """One dK/dV step: the rows of a query-list entry (``core.entry_at``: its first row ``start``;
    ``r_pos``: each tile row's position in it) of the heads whose rows ``_head_rows`` gave, against
    the program's keys, its scores key-major (``P^T``) or, with ``QMAJOR``, query-major
    (``core.dkdv_update_qmajor``). ``STATS_TMA`` (one head a tile): ``Lse`` is the stats' ``core.stats_desc`` and
    ``stat_bh`` the head's index ``b * Hq + h`` in it; ``Delta`` is then not read."""
    if PACKED:
        # the entry may continue in the next run of kept query blocks (block_sparse_tables)
        pos, ok = packed_positions(r_pos, start, end, nxt, count)  # [HM] each
    else:
        pos = start + r_pos  # [HM]
    q_ptrs = q_rows[:, None] + pos[:, None] * stride_qs + offs_dqk[None, :]  # [HM, BLOCK_DQK]
    do_ptrs = do_rows[:, None] + pos[:, None] * stride_ds + offs_dv[None, :]  # [HM, BLOCK_DV]
    if EVEN_M:
        if EVEN_QK:
            q = tl.load(q_ptrs)  # [HM, BLOCK_DQK]
        else:
            q = tl.load(q_ptrs, mask=dqk_ok[None, :], other=0.0)
        if EVEN_V:
            do = tl.load(do_ptrs)  # [HM, BLOCK_DV]
        else:
            do = tl.load(do_ptrs, mask=dv_ok[None, :], other=0.0)
        if STATS_TMA:
            # full, unpacked entries (the launcher's rule): the rows are start + j, one box
            lse, delta = stats_box(Lse, stat_bh, start, r_pos.shape[0])
        else:
            lse = tl.load(Lse + stat_rows + pos)
            delta = tl.load(Delta + stat_rows + pos)
    else:
        # (no stats boxes here: on variable blocks' packed lists a second box and two selects a value cost
        # more than the boxes save, H100 session 22)
        tl.static_assert(not STATS_TMA)
        # rows past the sub-tile's end belong to another block: their q / dO / delta load as zeros,
        # so every product they enter is exactly zero (lse loads as 0 too, as in the dense kernels'
        # ``load_row_stats``: p = 1 there, times zeros)
        if not PACKED:
            ok = pos < end
        q_ok = ok[:, None]  # [HM, 1]
        do_ok = ok[:, None]
        if not EVEN_QK:
            q_ok = q_ok & dqk_ok[None, :]  # [HM, BLOCK_DQK]
        if not EVEN_V:
            do_ok = do_ok & dv_ok[None, :]  # [HM, BLOCK_DV]
        q = tl.load(q_ptrs, mask=q_ok, other=0.0)
        do = tl.load(do_ptrs, mask=do_ok, other=0.0)
        lse = tl.load(Lse + stat_rows + pos, mask=ok, other=0.0)
        delta = tl.load(Delta + stat_rows + pos, mask=ok, other=0.0)
    if QMAJOR:
        # query-major scores (configs dkdv_qmajor / dkdv_tail_cols): P [HM, BLOCK_N]
        p = recompute_p(q, k, lse, qk_scale, False, True)
        dk, dv, _ = dkdv_update_qmajor(dk, dv, p, q, do, v, delta)
        return dk, dv
    p_t = recompute_p(k, q, lse, qk_scale, True, True)  # [BLOCK_N, HM]
    dk, dv, _ = dkdv_update(dk, dv, p_t, q, do, v, delta)
    return dk, dv


@triton.jit
def _dkdv_program(
    pid,
    Q, K, V, DOut, Lse, Delta, DK, DV,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    ROW_START, ROW_END, ROW_BLOCK, ORDER, PTR, COL_START, COL_END, COL_NEXT, COL_COUNT,  # key-major tables
    softmax_scale, qk_scale,
    Sq, Sk, num_row_blocks, num_bkv, num_heads_q, num_heads_kv, group_size, heads_per_pattern, num_key_tiles,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
    EVEN_M: tl.constexpr, SWEEP: tl.constexpr, HEAD_OUTER: tl.constexpr, LIST_CHUNK: tl.constexpr,
    PACKED: tl.constexpr, PATTERN_ORDER: tl.constexpr = False, STATS_TMA: tl.constexpr = False,
    QMAJOR: tl.constexpr = False, Stats=None, COL_FULL=None, FULL_FIRST: tl.constexpr = False,
):
    """dK/dV program ``pid`` (one key sub-tile of one KV head). ``SWEEP`` as in the dense kernel
    (``dense_bwd._dkdv_program``): 0 head-major, 1 row-major, 2 row-major descending.

    ``PATTERN_ORDER`` (config ``dkdv_pattern_order``; the launcher passes it only where the GQA group
    shares one pattern): a KV head's key tiles run heaviest first by its own pattern's lists
    (``order[T * (1 + p):]``, ``block_sparse_tables``) instead of by the work summed over all patterns.

    ``HEAD_OUTER`` (config ``dkdv_head_outer``): the (batch, KV head) is the slowest program index
    instead of the fastest, so the programs running together are key tiles of one KV head, which
    read the same q / dO rows (the group's query heads, one shared pattern or eight of one group)
    while they walk their ascending key lists; with the KV head fastest, ~16 key tiles of each of
    eight KV heads run together and share little (``experiments/results/h100/bwd_sweep/``: L2 hit
    rate 10 % in this kernel, 73 % in Flex's backward, whose grid has the head slowest).

    ``STATS_TMA`` (config ``dkdv_stats_tma``; the launcher passes it only with one head a tile and full,
    unpacked entries, or with ``FULL_FIRST``): each full step's lse / delta by one TMA box of ``Stats``
    (``core.stats_desc``).

    ``FULL_FIRST`` (config ``dkdv_full_first``; a table built with ``full_first``, ``COL_FULL`` its ``col_full``):
    each list's whole contiguous entries, first in the list, run as an even, unpacked list's steps (no row
    masks, no per-row selects, the stats by box), the rest through the packed / ragged path."""
    tile, b, h_kv = _key_tile_at(pid, ORDER, num_key_tiles, num_bkv, num_heads_kv, group_size, heads_per_pattern,
                                 HEAD_OUTER, PATTERN_ORDER)
    _dkdv_tile(
        tile, b, h_kv, Q, K, V, DOut, Lse, Delta, DK, DV,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_db, stride_ds, stride_dh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
        ROW_START, ROW_END, ROW_BLOCK, PTR, COL_START, COL_END, COL_NEXT, COL_COUNT,
        softmax_scale, qk_scale, Sq, Sk, num_row_blocks, num_bkv, num_heads_q, num_heads_kv, group_size,
        heads_per_pattern, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, HEADS, EVEN_M, SWEEP,
        LIST_CHUNK, PACKED, STATS_TMA, QMAJOR, Stats, COL_FULL, FULL_FIRST)


@triton.jit
def _key_tile_at(pid, ORDER, num_key_tiles, num_bkv, num_heads_kv, group_size, heads_per_pattern,
                 HEAD_OUTER: tl.constexpr, PATTERN_ORDER: tl.constexpr):
    """``(tile, b, h_kv)`` of dK/dV program ``pid`` of ``num_key_tiles`` a (batch, KV head): its rank by
    ``HEAD_OUTER`` (``_dkdv_program``), its tile from ``ORDER`` (with ``PATTERN_ORDER``, its KV head's pattern's
    order ``ORDER[num_key_tiles * (1 + p):]``)."""
    if HEAD_OUTER:
        rank, b, h_kv = key_program_outer(pid, num_key_tiles, num_heads_kv)
    else:
        rank, b, h_kv = key_program_at(pid, num_bkv, num_heads_kv)
    if PATTERN_ORDER:
        tile = tl.load(ORDER + num_key_tiles * (1 + (h_kv * group_size) // heads_per_pattern) + rank)
    else:
        tile = tl.load(ORDER + rank)
    return tile, b, h_kv


@triton.jit
def _dkdv_tile(
    tile, b, h_kv,
    Q, K, V, DOut, Lse, Delta, DK, DV,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    ROW_START, ROW_END, ROW_BLOCK, PTR, COL_START, COL_END, COL_NEXT, COL_COUNT,  # key-major tables
    softmax_scale, qk_scale,
    Sq, Sk, num_row_blocks, num_bkv, num_heads_q, num_heads_kv, group_size, heads_per_pattern,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
    EVEN_M: tl.constexpr, SWEEP: tl.constexpr, LIST_CHUNK: tl.constexpr,
    PACKED: tl.constexpr, STATS_TMA: tl.constexpr, QMAJOR: tl.constexpr,
    Stats=None, COL_FULL=None, FULL_FIRST: tl.constexpr = False,
):
    """The dK/dV of key tile ``tile`` of table (``ROW_START`` ...) for batch ``b``, KV head ``h_kv``
    (``_dkdv_program``'s body, after its program-to-tile map)."""
    n_start = tl.load(ROW_START + tile)
    n_end = tl.load(ROW_END + tile)
    blk = tl.load(ROW_BLOCK + tile)
    b64 = b.to(tl.int64)
    offs_dqk, dqk_ok = head_dim_offsets(HEAD_DIM_QK, BLOCK_DQK)
    offs_dv, dv_ok = head_dim_offsets(HEAD_DIM_V, BLOCK_DV)
    # why: a padded head dim is masked like a short row tile, so EVEN_M alone no longer means
    # "load without a mask"
    EVEN_QK: tl.constexpr = BLOCK_DQK == HEAD_DIM_QK
    EVEN_V: tl.constexpr = BLOCK_DV == HEAD_DIM_V

    k_desc, v_desc = kv_descs(K, V, b64, h_kv, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                              stride_vh, Sk, BLOCK_N, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)
    # keys past n_end belong to the next block (or are zero fill past Sk): computed, never stored
    # the full steps' stats: boxes of the [B * Hq, Sq, 4] rows (lse, delta, 0, 0), or the pointers
    if STATS_TMA:
        Full_lse = stats_desc(Stats, (num_bkv // num_heads_kv) * num_heads_q, Sq, BLOCK_M)
    else:
        Full_lse = Lse
    if FULL_FIRST:
        tl.static_assert(SWEEP == 0 and LIST_CHUNK == 0, "dkdv_full_first: the head-major loop, entry by entry")
    k = k_desc.load([n_start, 0])  # [BLOCK_N, BLOCK_DQK]
    v = v_desc.load([n_start, 0])  # [BLOCK_N, BLOCK_DV]
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    offs_r = tl.arange(0, HEADS * BLOCK_M)
    r_head = offs_r // BLOCK_M
    r_pos = offs_r % BLOCK_M
    if SWEEP != 0:
        # row-major: per key-list entry, every head chunk of the group (the launcher passes SWEEP only
        # when the whole group shares one pattern, so one list serves every head); 2: entries descending.
        # The list is read entry by entry here (LIST_CHUNK applies to the head-major loop below)
        pat = (h_kv * group_size) // heads_per_pattern
        e_lo = tl.load(PTR + pat * num_row_blocks + blk)
        e_hi = tl.load(PTR + pat * num_row_blocks + blk + 1)
        last = last_count(COL_COUNT, e_lo, e_hi, PACKED)
        chunks = group_size // HEADS
        for i in tl.range(0, (e_hi - e_lo) * chunks):
            if SWEEP == 2:
                e = e_hi - 1 - i // chunks
            else:
                e = e_lo + i // chunks
            h0 = h_kv * group_size + (i % chunks) * HEADS
            q_rows, do_rows, stat_rows = _head_rows(Q, DOut, b64, h0, r_head,
                                                    stride_qb, stride_qh, stride_db, stride_dh, num_heads_q, Sq)
            start, end, nxt = entry_at(COL_START, COL_END, COL_NEXT, e, EVEN_M, PACKED)
            count = packed_count(e, e_hi, last, BLOCK_M)
            dk, dv = _dkdv_step(dk, dv, k, v, q_rows, do_rows, stat_rows, Full_lse, Delta, start, end, nxt, count,
                                r_pos, offs_dqk, dqk_ok, offs_dv, dv_ok, stride_qs, stride_ds, qk_scale, EVEN_M, EVEN_QK,
                                EVEN_V, PACKED, STATS_TMA, b * num_heads_q + h0, QMAJOR)
    else:
        # GQA: every query head of the group adds into the same dK/dV registers (no atomics)
        for g in range(0, group_size, HEADS):
            h0 = h_kv * group_size + g
            pat = h0 // heads_per_pattern
            q_rows, do_rows, stat_rows = _head_rows(Q, DOut, b64, h0, r_head, stride_qb, stride_qh, stride_db,
                                                    stride_dh, num_heads_q, Sq)
            e_lo = tl.load(PTR + pat * num_row_blocks + blk)
            e_hi = tl.load(PTR + pat * num_row_blocks + blk + 1)
            last = last_count(COL_COUNT, e_lo, e_hi, PACKED)
            if FULL_FIRST:
                # the whole contiguous entries: rows start .. start + BLOCK_M of one run, every one valid
                e_mid = tl.load(COL_FULL + pat * num_row_blocks + blk)
                for e in tl.range(e_lo, e_mid):
                    start = tl.load(COL_START + e)
                    dk, dv = _dkdv_step(dk, dv, k, v, q_rows, do_rows, stat_rows, Full_lse, Delta, start, start,
                                        start, BLOCK_M, r_pos, offs_dqk, dqk_ok, offs_dv, dv_ok, stride_qs, stride_ds,
                                        qk_scale, True, EVEN_QK, EVEN_V, False, STATS_TMA, b * num_heads_q + h0,
                                        QMAJOR)
                # the rest (entries crossing into the next run, the list's short last one): by pointers, masked
                for e in tl.range(e_mid, e_hi):
                    start, end, nxt = entry_at(COL_START, COL_END, COL_NEXT, e, EVEN_M, PACKED)
                    count = packed_count(e, e_hi, last, BLOCK_M)
                    dk, dv = _dkdv_step(dk, dv, k, v, q_rows, do_rows, stat_rows, Lse, Delta, start, end, nxt, count,
                                        r_pos, offs_dqk, dqk_ok, offs_dv, dv_ok, stride_qs, stride_ds, qk_scale, EVEN_M,
                                        EVEN_QK, EVEN_V, PACKED, False, b * num_heads_q + h0, QMAJOR)
            elif LIST_CHUNK == 0:
                for e in tl.range(e_lo, e_hi):
                    start, end, nxt = entry_at(COL_START, COL_END, COL_NEXT, e, EVEN_M, PACKED)
                    count = packed_count(e, e_hi, last, BLOCK_M)
                    dk, dv = _dkdv_step(dk, dv, k, v, q_rows, do_rows, stat_rows, Full_lse, Delta, start, end, nxt,
                                        count, r_pos, offs_dqk, dqk_ok, offs_dv, dv_ok, stride_qs, stride_ds, qk_scale,
                                        EVEN_M, EVEN_QK, EVEN_V, PACKED, STATS_TMA, b * num_heads_q + h0, QMAJOR)
            else:
                # the query list in register chunks, as in _dq_program: the q / dO loads then depend
                # on no load of their own loop and are prefetched num_stages - 1 steps ahead
                for c0 in range(e_lo, e_hi, LIST_CHUNK):
                    starts, ends, nxts = entry_chunk(COL_START, COL_END, COL_NEXT, c0, e_hi, LIST_CHUNK, EVEN_M,
                                                     PACKED)  # [LIST_CHUNK] each
                    for j in tl.range(0, tl.minimum(e_hi - c0, LIST_CHUNK)):
                        start, end, nxt = entry_pick(starts, ends, nxts, j, LIST_CHUNK, EVEN_M, PACKED)
                        count = packed_count(c0 + j, e_hi, last, BLOCK_M)
                        dk, dv = _dkdv_step(dk, dv, k, v, q_rows, do_rows, stat_rows, Full_lse, Delta, start, end,
                                            nxt, count, r_pos, offs_dqk, dqk_ok, offs_dv, dv_ok, stride_qs, stride_ds,
                                            qk_scale, EVEN_M, EVEN_QK, EVEN_V, PACKED, STATS_TMA,
                                            b * num_heads_q + h0, QMAJOR)

    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_end
    dk_ok = n_ok[:, None]  # [BLOCK_N, 1]
    dv_ok_2d = n_ok[:, None]
    if not EVEN_QK:
        dk_ok = dk_ok & dqk_ok[None, :]  # [BLOCK_N, BLOCK_DQK]: padded columns are not stored
    if not EVEN_V:
        dv_ok_2d = dv_ok_2d & dv_ok[None, :]  # [BLOCK_N, BLOCK_DV]
    # s = softmax_scale * q.k, so dK picks up the scale once here
    dk_ptrs = DK + b64 * stride_dkb + h_kv * stride_dkh + offs_n.to(tl.int64) * stride_dks
    dv_ptrs = DV + b64 * stride_dvb + h_kv * stride_dvh + offs_n.to(tl.int64) * stride_dvs
    tl.store(dk_ptrs[:, None] + offs_dqk[None, :], (dk * softmax_scale).to(DK.dtype.element_ty), mask=dk_ok)
    tl.store(dv_ptrs[:, None] + offs_dv[None, :], dv.to(DV.dtype.element_ty), mask=dv_ok_2d)


@triton.jit
def _dq_step(dq, ds, prev, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, start_n, end_n, next_n, count,
             offs_dqk, dqk_ok, offs_dv, dv_ok, qk_scale, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
             PACKED: tl.constexpr, EVEN_QK: tl.constexpr, EVEN_V: tl.constexpr, SKEW: tl.constexpr):
    """One dQ step: the keys of a list entry (``core.entry_at``) against the program's rows; ``k_src`` /
    ``v_src`` as in ``block_sparse_fwd._fwd_step`` (with ``PACKED``, rows gathered). ``SKEW`` (unpacked
    lists only; ``core.dq_skewed_scores``): the step adds the previous step's ``dS K`` (``ds`` float32,
    its keys at row ``prev``) and leaves its own in ``ds``; returns ``(dq, ds, prev)``."""
    if SKEW:
        tl.static_assert(not PACKED, "dq_skew reloads the previous step's key tile by TMA: unpacked lists only")
        k = k_src.load([start_n, 0])  # [BLOCK_N, BLOCK_DQK]
        v = v_src.load([start_n, 0])  # [BLOCK_N, BLOCK_DV]
        k_prev = k_src.load([prev, 0])  # [BLOCK_N, BLOCK_DQK]
        dq, p, dp = dq_skewed_scores(dq, ds, k_prev, q, do, k, v, lse2, qk_scale)  # p, dp [HM, BLOCK_N]
        if not EVEN_N:
            p = tl.where((start_n + tl.arange(0, BLOCK_N))[None, :] < end_n, p, 0.0)
        ds = p * (dp - delta[:, None])  # [HM, BLOCK_N]
        prev = start_n
    else:
        if PACKED:
            cols, ok = packed_positions(tl.arange(0, BLOCK_N), start_n, end_n, next_n, count)  # [BLOCK_N] each
            k = gather_rows(k_src, cols, ok, stride_ks, offs_dqk, dqk_ok, EVEN_QK)  # [BLOCK_N, BLOCK_DQK]
            v = gather_rows(v_src, cols, ok, stride_vs, offs_dv, dv_ok, EVEN_V)  # [BLOCK_N, BLOCK_DV]
            # the missing keys of a list's last tile: their zero rows would still give p = exp2(-lse)
            p = tl.where(ok[None, :], recompute_p(q, k, lse2, qk_scale, False), 0.0)
        else:
            k = k_src.load([start_n, 0])  # [BLOCK_N, BLOCK_DQK]
            v = v_src.load([start_n, 0])  # [BLOCK_N, BLOCK_DV]
            p = recompute_p(q, k, lse2, qk_scale, False)  # [HM, BLOCK_N]
            if not EVEN_N:
                p = tl.where((start_n + tl.arange(0, BLOCK_N))[None, :] < end_n, p, 0.0)
        dq = dq_update(dq, p, do, v, k, delta)  # [HM, BLOCK_DQK]
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
    ROW_START, ROW_END, ROW_BLOCK, ORDER, PTR, COL_START, COL_END, COL_NEXT, COL_COUNT,  # query-major tables
    softmax_scale, qk_scale,
    Sq, Sk, num_row_blocks, num_packs, num_heads_q, group_size, heads_per_pattern,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
    EVEN_N: tl.constexpr, LIST_CHUNK: tl.constexpr, PACKED: tl.constexpr, SKEW: tl.constexpr = False,
    COL_SPLIT=None, SHORT_N: tl.constexpr = 0, COL_FULL=None, FULL_FIRST: tl.constexpr = False,
):
    """dQ program ``pid`` (one row tile of ``HEADS`` stacked query heads). ``SHORT_N`` (config
    ``dq_short_keys``; ``COL_SPLIT`` the table's ``col_split``): each list's entries from ``COL_SPLIT``
    on hold at most ``SHORT_N`` keys (``block_sparse_tables``) and are walked after the others in
    ``[SHORT_N]``-key tiles. ``FULL_FIRST`` (config ``dq_full_first``; ``COL_FULL`` the table's ``col_full``):
    each list's whole contiguous entries, first, are walked as an even list's (no key mask), the rest as before."""
    b, h0, h_kv, pat, head, pos, row_ok, blk = _pack_program_at(
        pid, ROW_START, ROW_END, ROW_BLOCK, ORDER, num_packs, num_heads_q, group_size, heads_per_pattern,
        BLOCK_M, HEADS)
    offs_dqk, dqk_ok = head_dim_offsets(HEAD_DIM_QK, BLOCK_DQK)
    offs_dv, dv_ok = head_dim_offsets(HEAD_DIM_V, BLOCK_DV)
    b64 = b.to(tl.int64)
    pos64 = pos.to(tl.int64)
    q_ok = row_ok[:, None]  # [HM, 1]
    do_ok = row_ok[:, None]
    if BLOCK_DQK != HEAD_DIM_QK:
        q_ok = q_ok & dqk_ok[None, :]  # [HM, BLOCK_DQK]: padded columns load as 0, are not stored
    if BLOCK_DV != HEAD_DIM_V:
        do_ok = do_ok & dv_ok[None, :]  # [HM, BLOCK_DV]
    q = tl.load((Q + b64 * stride_qb + head * stride_qh + pos64 * stride_qs)[:, None] + offs_dqk[None, :],
                mask=q_ok, other=0.0)  # [HM, BLOCK_DQK]
    do = tl.load((DOut + b64 * stride_db + head * stride_dh + pos64 * stride_ds)[:, None]
                 + offs_dv[None, :], mask=do_ok, other=0.0)  # [HM, BLOCK_DV]
    stat = (b64 * num_heads_q + head) * Sq + pos
    lse = tl.load(Lse + stat, mask=row_ok, other=float("inf"))
    # rows outside the tile (and, defensively, rows that attend nothing) get lse2 = +inf: p = 0
    lse2 = lse_log2(lse)
    delta = tl.load(Delta + stat, mask=row_ok, other=0.0)

    EVEN_QK: tl.constexpr = BLOCK_DQK == HEAD_DIM_QK
    EVEN_V: tl.constexpr = BLOCK_DV == HEAD_DIM_V
    k_src, v_src = kv_sources(K, V, b64, h_kv, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, Sk,
                              BLOCK_N, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, PACKED)
    dq = tl.zeros([HEADS * BLOCK_M, BLOCK_DQK], tl.float32)
    # SKEW: the step before the first adds dS = 0 (with key tile 0), the last step's dS K follows the loop
    ds = tl.zeros([HEADS * BLOCK_M, BLOCK_N], tl.float32)
    prev = 0
    e_lo = tl.load(PTR + pat * num_row_blocks + blk)
    e_hi = tl.load(PTR + pat * num_row_blocks + blk + 1)
    last = last_count(COL_COUNT, e_lo, e_hi, PACKED)
    if FULL_FIRST:
        tl.static_assert(LIST_CHUNK == 0 and not PACKED and not SKEW,
                         "dq_full_first: unpacked lists read entry by entry, no dq_skew")
        # the whole contiguous entries: BLOCK_N keys from start, no mask
        e_full = tl.load(COL_FULL + pat * num_row_blocks + blk)
        for e in tl.range(e_lo, e_full):
            start_n = tl.load(COL_START + e)
            dq, ds, prev = _dq_step(dq, ds, prev, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, start_n,
                                    start_n, start_n, BLOCK_N, offs_dqk, dqk_ok, offs_dv, dv_ok, qk_scale, BLOCK_N,
                                    True, False, EVEN_QK, EVEN_V, False)
        e_lo = e_full
    if SHORT_N > 0:
        tl.static_assert(LIST_CHUNK == 0 and not PACKED and not SKEW,
                         "short key entries: unpacked lists read entry by entry, no dq_skew")
        e_mid = tl.load(COL_SPLIT + pat * num_row_blocks + blk)
        for e in tl.range(e_lo, e_mid):
            start_n, end_n, next_n = entry_at(COL_START, COL_END, COL_NEXT, e, EVEN_N, PACKED)
            dq, ds, prev = _dq_step(dq, ds, prev, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, start_n,
                                    end_n, next_n, BLOCK_N, offs_dqk, dqk_ok, offs_dv, dv_ok, qk_scale, BLOCK_N,
                                    EVEN_N, PACKED, EVEN_QK, EVEN_V, SKEW)
        # the lists' short entries (a key run's remainder of <= SHORT_N keys) in tiles of their own size
        k_short, v_short = kv_sources(K, V, b64, h_kv, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                      stride_vh, Sk, SHORT_N, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, PACKED)
        for e in tl.range(e_mid, e_hi):
            start_n, end_n, next_n = entry_at(COL_START, COL_END, COL_NEXT, e, False, PACKED)
            dq, ds, prev = _dq_step(dq, ds, prev, q, do, lse2, delta, k_short, v_short, stride_ks, stride_vs, start_n,
                                    end_n, next_n, SHORT_N, offs_dqk, dqk_ok, offs_dv, dv_ok, qk_scale, SHORT_N, False,
                                    PACKED, EVEN_QK, EVEN_V, SKEW)
    elif LIST_CHUNK == 0:
        for e in tl.range(e_lo, e_hi):
            start_n, end_n, next_n = entry_at(COL_START, COL_END, COL_NEXT, e, EVEN_N, PACKED)
            count = packed_count(e, e_hi, last, BLOCK_N)
            dq, ds, prev = _dq_step(dq, ds, prev, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, start_n,
                                    end_n, next_n, count, offs_dqk, dqk_ok, offs_dv, dv_ok, qk_scale, BLOCK_N, EVEN_N,
                                    PACKED, EVEN_QK, EVEN_V, SKEW)
    else:
        # the key list in chunks held in registers: the loop's K/V loads then depend on no load of
        # the same loop, so the pipeliner prefetches them num_stages - 1 steps ahead (a table load
        # in the chain holds the prefetch to one step, issued after the step's GEMMs)
        for c0 in range(e_lo, e_hi, LIST_CHUNK):
            starts, ends, nexts = entry_chunk(COL_START, COL_END, COL_NEXT, c0, e_hi, LIST_CHUNK,
                                                      EVEN_N, PACKED)  # [LIST_CHUNK] each
            for j in tl.range(0, tl.minimum(e_hi - c0, LIST_CHUNK)):
                start_n, end_n, next_n = entry_pick(starts, ends, nexts, j, LIST_CHUNK, EVEN_N, PACKED)
                count = packed_count(c0 + j, e_hi, last, BLOCK_N)
                dq, ds, prev = _dq_step(dq, ds, prev, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs,
                                        start_n, end_n, next_n, count, offs_dqk, dqk_ok, offs_dv, dv_ok, qk_scale,
                                        BLOCK_N, EVEN_N, PACKED, EVEN_QK, EVEN_V, SKEW)
    if SKEW:
        k_prev = k_src.load([prev, 0])  # [BLOCK_N, BLOCK_DQK]
        dq = tl.dot(ds.to(k_prev.dtype), k_prev, dq)  # [HM, BLOCK_DQK]

    dq_ptrs = DQ + b64 * stride_dqb + head * stride_dqh + pos64 * stride_dqs
    tl.store(dq_ptrs[:, None] + offs_dqk[None, :], (dq * softmax_scale).to(DQ.dtype.element_ty), mask=q_ok)


# ----------------------------------------------------------------------------------------------
# The launches: two kernels (default), or one launch running both program sets
# ----------------------------------------------------------------------------------------------


@triton.jit
def block_sparse_bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    ROW_START, ROW_END, ROW_BLOCK, ORDER, PTR, COL_START, COL_END, COL_NEXT, COL_COUNT,  # key-major tables
    softmax_scale, qk_scale,
    Sq, Sk, num_row_blocks, num_bkv, num_heads_q, num_heads_kv, group_size, heads_per_pattern,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
    EVEN_M: tl.constexpr, SWEEP: tl.constexpr, HEAD_OUTER: tl.constexpr, LIST_CHUNK: tl.constexpr,
    PACKED: tl.constexpr, PATTERN_ORDER: tl.constexpr = False, STATS_TMA: tl.constexpr = False,
    QMAJOR: tl.constexpr = False, Stats=None, COL_FULL=None, FULL_FIRST: tl.constexpr = False,
):
    """Key-major dK/dV (grid: key sub-tiles x B x Hkv). ``Stats``: the preprocess's ``[B * Hq, Sq, 4]`` rows
    (with ``STATS_TMA``); ``COL_FULL``: the table's ``col_full`` (with ``FULL_FIRST``, ``_dkdv_program``)."""
    _dkdv_program(
        tl.program_id(0), Q, K, V, DOut, Lse, Delta, DK, DV,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_db, stride_ds, stride_dh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
        ROW_START, ROW_END, ROW_BLOCK, ORDER, PTR, COL_START, COL_END, COL_NEXT, COL_COUNT,
        softmax_scale, qk_scale,
        Sq, Sk, num_row_blocks, num_bkv, num_heads_q, num_heads_kv, group_size, heads_per_pattern,
        tl.num_programs(0) // num_bkv,
        HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, HEADS, EVEN_M, SWEEP, HEAD_OUTER,
        LIST_CHUNK, PACKED, PATTERN_ORDER, STATS_TMA, QMAJOR, Stats, COL_FULL, FULL_FIRST)


@triton.jit
def block_sparse_bwd_dkdv_merged_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    ROW_START, ROW_END, ROW_BLOCK, ORDER, PTR, COL_START, COL_END, COL_NEXT, COL_COUNT,  # the main key tiles' table
    # the tails' table; its T_ORDER is both tables' order, [(1 + P) * (main + tail tiles)], main tiles as 0 .., tail
    # tiles after them (block_sparse_tables.merge_tails); the main table's ORDER is not read
    T_ROW_START, T_ROW_END, T_ROW_BLOCK, T_ORDER, T_PTR, T_COL_START, T_COL_END, T_COL_NEXT, T_COL_COUNT,
    softmax_scale, qk_scale,
    Sq, Sk, num_row_blocks, num_bkv, num_heads_q, num_heads_kv, group_size, heads_per_pattern, num_main,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr, TAIL_M: tl.constexpr, TAIL_N: tl.constexpr,
    EVEN_M: tl.constexpr, TAIL_EVEN_M: tl.constexpr, HEAD_OUTER: tl.constexpr, LIST_CHUNK: tl.constexpr,
    PACKED: tl.constexpr, TAIL_PACKED: tl.constexpr, PATTERN_ORDER: tl.constexpr = False,
    QMAJOR: tl.constexpr = False, TAIL_QMAJOR: tl.constexpr = True,
):
    """Key-major dK/dV with a key block's remainder tile in the same launch as its full tiles (config
    ``dkdv_tail_order`` 3; grid: (main + tail tiles) x B x Hkv; the main tiles stack ``HEADS`` query heads,
    the tails take one). ``T_ORDER`` places each tail right after its block's last main tile, so it runs while its siblings, which read the same q / dO
    rows, still run (a launch of its own streams them from DRAM: L2 hit rate 27 %, H200 session 26). The
    tails step ``TAIL_M`` query rows; with ``TAIL_QMAJOR`` their scores are query-major (``_dkdv_step``), one
    exponential a score on this launch's warps; ``QMAJOR`` (config ``dkdv_qmajor``) does the same for the main
    tiles. Every step reads lse / delta by pointers (``Lse`` is the forward's lse: no stats boxes here)."""
    tile, b, h_kv = _key_tile_at(tl.program_id(0), T_ORDER, tl.num_programs(0) // num_bkv, num_bkv, num_heads_kv,
                                 group_size, heads_per_pattern, HEAD_OUTER, PATTERN_ORDER)
    if tile < num_main:
        _dkdv_tile(
            tile, b, h_kv, Q, K, V, DOut, Lse, Delta, DK, DV,
            stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_db, stride_ds, stride_dh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
            ROW_START, ROW_END, ROW_BLOCK, PTR, COL_START, COL_END, COL_NEXT, COL_COUNT,
            softmax_scale, qk_scale, Sq, Sk, num_row_blocks, num_bkv, num_heads_q, num_heads_kv, group_size,
            heads_per_pattern, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, HEADS, EVEN_M, 0,
            LIST_CHUNK, PACKED, False, QMAJOR)
    else:
        _dkdv_tile(
            tile - num_main, b, h_kv, Q, K, V, DOut, Lse, Delta, DK, DV,
            stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_db, stride_ds, stride_dh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
            T_ROW_START, T_ROW_END, T_ROW_BLOCK, T_PTR, T_COL_START, T_COL_END, T_COL_NEXT, T_COL_COUNT,
            softmax_scale, qk_scale, Sq, Sk, num_row_blocks, num_bkv, num_heads_q, num_heads_kv, group_size,
            heads_per_pattern, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, TAIL_M, TAIL_N, 1, TAIL_EVEN_M, 0,
            LIST_CHUNK, TAIL_PACKED, False, TAIL_QMAJOR)


@triton.jit
def block_sparse_bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dqb, stride_dqs, stride_dqh,
    ROW_START, ROW_END, ROW_BLOCK, ORDER, PTR, COL_START, COL_END, COL_NEXT, COL_COUNT,  # query-major tables
    COL_SPLIT,  # the table's col_split (any int32 pointer when SHORT_N == 0: not read)
    softmax_scale, qk_scale,
    Sq, Sk, num_row_blocks, num_packs, num_heads_q, group_size, heads_per_pattern,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
    EVEN_N: tl.constexpr, LIST_CHUNK: tl.constexpr, PACKED: tl.constexpr, SKEW: tl.constexpr = False,
    SHORT_N: tl.constexpr = 0, COL_FULL=None, FULL_FIRST: tl.constexpr = False,
):
    """Query-major dQ (grid: row tiles x head packs); ``SKEW``: each step's ``dS K`` issued in the next step
    (``core.dq_skewed_scores``); ``SHORT_N``: short entries last, in their own tiles; ``FULL_FIRST``: whole
    entries first, unmasked (``_dq_program``)."""
    _dq_program(
        tl.program_id(0), Q, K, V, DOut, Lse, Delta, DQ,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_db, stride_ds, stride_dh, stride_dqb, stride_dqs, stride_dqh,
        ROW_START, ROW_END, ROW_BLOCK, ORDER, PTR, COL_START, COL_END, COL_NEXT, COL_COUNT,
        softmax_scale, qk_scale,
        Sq, Sk, num_row_blocks, num_packs, num_heads_q, group_size, heads_per_pattern,
        HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, HEADS, EVEN_N, LIST_CHUNK, PACKED, SKEW,
        COL_SPLIT, SHORT_N, COL_FULL, FULL_FIRST)


@triton.jit
def block_sparse_bwd_one_launch_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, DQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dqb, stride_dqs, stride_dqh,
    K_ROW_START, K_ROW_END, K_ROW_BLOCK, K_ORDER, K_PTR, K_COL_START, K_COL_END, K_COL_NEXT, K_COL_COUNT,  # key-major
    Q_ROW_START, Q_ROW_END, Q_ROW_BLOCK, Q_ORDER, Q_PTR, Q_COL_START, Q_COL_END, Q_COL_NEXT, Q_COL_COUNT,  # query-major
    softmax_scale, qk_scale,
    Sq, Sk, k_num_row_blocks, q_num_row_blocks, num_bkv, num_packs, num_heads_q, num_heads_kv, group_size,
    heads_per_pattern, n_dkdv, n_dq,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    DKDV_BLOCK_M: tl.constexpr, DKDV_BLOCK_N: tl.constexpr, DKDV_HEADS: tl.constexpr, EVEN_M: tl.constexpr,
    DQ_BLOCK_M: tl.constexpr, DQ_BLOCK_N: tl.constexpr, DQ_HEADS: tl.constexpr, EVEN_N: tl.constexpr,
    DKDV_LIST_CHUNK: tl.constexpr, DQ_LIST_CHUNK: tl.constexpr, ORDER: tl.constexpr, SWEEP: tl.constexpr,
    HEAD_OUTER: tl.constexpr, DKDV_PACKED: tl.constexpr, DQ_PACKED: tl.constexpr,
    DKDV_PATTERN_ORDER: tl.constexpr = False,
):
    """dK/dV (``n_dkdv`` programs) and dQ (``n_dq``) in one launch; the bodies of the two kernels
    above, unchanged, so no atomics and the same bits."""
    is_dkdv, idx = one_launch_split(tl.program_id(0), n_dkdv, n_dq, ORDER)
    if is_dkdv:
        _dkdv_program(
            idx, Q, K, V, DOut, Lse, Delta, DK, DV,
            stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_db, stride_ds, stride_dh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
            K_ROW_START, K_ROW_END, K_ROW_BLOCK, K_ORDER, K_PTR, K_COL_START, K_COL_END, K_COL_NEXT, K_COL_COUNT,
            softmax_scale, qk_scale,
            Sq, Sk, k_num_row_blocks, num_bkv, num_heads_q, num_heads_kv, group_size, heads_per_pattern,
            n_dkdv // num_bkv,
            HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, DKDV_BLOCK_M, DKDV_BLOCK_N, DKDV_HEADS, EVEN_M, SWEEP,
            HEAD_OUTER, DKDV_LIST_CHUNK, DKDV_PACKED, DKDV_PATTERN_ORDER)
    else:
        _dq_program(
            idx, Q, K, V, DOut, Lse, Delta, DQ,
            stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_db, stride_ds, stride_dh, stride_dqb, stride_dqs, stride_dqh,
            Q_ROW_START, Q_ROW_END, Q_ROW_BLOCK, Q_ORDER, Q_PTR, Q_COL_START, Q_COL_END, Q_COL_NEXT, Q_COL_COUNT,
            softmax_scale, qk_scale,
            Sq, Sk, q_num_row_blocks, num_packs, num_heads_q, group_size, heads_per_pattern,
            HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, DQ_BLOCK_M, DQ_BLOCK_N, DQ_HEADS, EVEN_N, DQ_LIST_CHUNK,
            DQ_PACKED)

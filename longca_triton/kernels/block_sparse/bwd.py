"""Block-sparse backward kernels: key-major dK/dV and query-major dQ (``op.py``'s docstring has the
math and the tiling); delta comes from the shared preprocess (``dense.launch_bwd_preprocess``). No
atomics: dK/dV of a KV head sum its GQA group's query heads in registers, dQ is owned by one program.

Head dims as in the forward: K/V tiles through descriptors padded to ``BLOCK_DQK`` / ``BLOCK_DV``;
the pointer accesses (q, dO, dq, dk, dv) AND a head-dim mask into their row masks only when the
dim is padded.

``PACKED`` (packed lists, ``plan.py``): an entry's rows (dK/dV: query rows; dQ: keys) may be two
pieces of two runs; the dK/dV pass reads q / dO by pointers anyway and only computes the rows
differently, the dQ pass gathers K/V rows (``core.gather_rows``) instead of reading boxes.

``STATS_TMA`` (config ``dkdv_stats_tma``, full unpacked entries): a dK/dV step reads its rows' lse and
delta from the preprocess's 16-byte rows by one TMA box (``core.stats_desc``) instead of by pointers.
``LIST_CHUNK``: the lists in register chunks, as in the forward (``fwd.py``).
"""

import triton
import triton.language as tl

from longca_triton.kernels.block_sparse.fwd import pack_program_at
from longca_triton.kernels.core.jit import (
    dkdv_update, dkdv_update_qmajor, dq_update, entry_at, entry_chunk, entry_pick, gather_rows,
    head_dim_offsets, key_program_outer, kv_descs, kv_sources, last_count, lse_log2, packed_count,
    packed_positions, recompute_p, stats_box, stats_desc,
)

__all__ = ["block_sparse_bwd_dkdv_kernel", "block_sparse_bwd_dq_kernel"]


@triton.jit
def _head_rows(Q, DOut, b64, h0, r_head, stride_qb, stride_qh, stride_db, stride_dh, num_heads_q, Sq):
    """Per tile row (``r_head`` each row's head offset from ``h0``): the q and dO row bases and the
    lse / delta row offset, ``[BLOCK_M]`` each."""
    head = h0 + r_head  # [BLOCK_M]
    return (Q + b64 * stride_qb + head * stride_qh, DOut + b64 * stride_db + head * stride_dh,
            (b64 * num_heads_q + head) * Sq)


@triton.jit
def _dkdv_step(dk, dv, k, v, q_rows, do_rows, stat_rows, Lse, Delta, start, end, nxt, count, r_pos,
               offs_dqk, dqk_ok, offs_dv, dv_ok, stride_qs, stride_ds, qk_scale,
               EVEN_M: tl.constexpr, EVEN_QK: tl.constexpr, EVEN_V: tl.constexpr, PACKED: tl.constexpr,
               STATS_TMA: tl.constexpr = False, stat_bh=0, QMAJOR: tl.constexpr = False):
    """One dK/dV step: the rows of a query-list entry (``core.entry_at``: its first row ``start``;
    ``r_pos``: each tile row's position in it) against the program's keys, its scores key-major
    (``P^T``) or, with ``QMAJOR`` (the tail tiles), query-major (``core.dkdv_update_qmajor``).
    ``STATS_TMA``: ``Lse`` is the stats' ``core.stats_desc`` and ``stat_bh`` the head's index
    ``b * Hq + h`` in it; ``Delta`` is then not read."""
    if PACKED:
        # the entry may continue in the next run of kept query blocks (plan.py)
        pos, ok = packed_positions(r_pos, start, end, nxt, count)  # [BLOCK_M] each
    else:
        pos = start + r_pos  # [BLOCK_M]
    q_ptrs = q_rows[:, None] + pos[:, None] * stride_qs + offs_dqk[None, :]  # [BLOCK_M, BLOCK_DQK]
    do_ptrs = do_rows[:, None] + pos[:, None] * stride_ds + offs_dv[None, :]  # [BLOCK_M, BLOCK_DV]
    if EVEN_M:
        if EVEN_QK:
            q = tl.load(q_ptrs)  # [BLOCK_M, BLOCK_DQK]
        else:
            q = tl.load(q_ptrs, mask=dqk_ok[None, :], other=0.0)
        if EVEN_V:
            do = tl.load(do_ptrs)  # [BLOCK_M, BLOCK_DV]
        else:
            do = tl.load(do_ptrs, mask=dv_ok[None, :], other=0.0)
        if STATS_TMA:
            # full, unpacked entries (the launcher's rule): the rows are start + j, one box
            lse, delta = stats_box(Lse, stat_bh, start, r_pos.shape[0])
        else:
            lse = tl.load(Lse + stat_rows + pos)
            delta = tl.load(Delta + stat_rows + pos)
    else:
        # (no stats boxes on ragged entries: a second box and two selects a value cost more than they save)
        tl.static_assert(not STATS_TMA)
        # rows past the sub-tile's end belong to another block: their q / dO / delta load as zeros,
        # so every product they enter is exactly zero (lse loads as 0 too, as in the dense kernels'
        # ``load_row_stats``: p = 1 there, times zeros)
        if not PACKED:
            ok = pos < end
        q_ok = ok[:, None]  # [BLOCK_M, 1]
        do_ok = ok[:, None]
        if not EVEN_QK:
            q_ok = q_ok & dqk_ok[None, :]  # [BLOCK_M, BLOCK_DQK]
        if not EVEN_V:
            do_ok = do_ok & dv_ok[None, :]  # [BLOCK_M, BLOCK_DV]
        q = tl.load(q_ptrs, mask=q_ok, other=0.0)
        do = tl.load(do_ptrs, mask=do_ok, other=0.0)
        lse = tl.load(Lse + stat_rows + pos, mask=ok, other=0.0)
        delta = tl.load(Delta + stat_rows + pos, mask=ok, other=0.0)
    if QMAJOR:
        # query-major scores: P [BLOCK_M, BLOCK_N]
        p = recompute_p(q, k, lse, qk_scale, False, True)
        dk, dv, _ = dkdv_update_qmajor(dk, dv, p, q, do, v, delta)
        return dk, dv
    p_t = recompute_p(k, q, lse, qk_scale, True, True)  # [BLOCK_N, BLOCK_M]
    dk, dv, _ = dkdv_update(dk, dv, p_t, q, do, v, delta)
    return dk, dv


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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr, LIST_CHUNK: tl.constexpr,
    PACKED: tl.constexpr, PATTERN_ORDER: tl.constexpr = False, STATS_TMA: tl.constexpr = False,
    QMAJOR: tl.constexpr = False, Stats=None, COL_FULL=None, FULL_FIRST: tl.constexpr = False,
):
    """Key-major dK/dV. Grid: (batch, KV head) x key sub-tiles, the KV head slowest, so the programs
    running together are key tiles of one KV head, which read the same q / dO rows; each program owns
    ``BLOCK_N`` keys and walks, for every query head of its group, the transposed list (kept query-block
    runs cut into ``BLOCK_M`` sub-tiles); dK/dV accumulate in registers and are written once.

    ``PATTERN_ORDER`` (config ``dkdv_pattern_order``; the launcher passes it only where the GQA group
    shares one pattern): a KV head's key tiles run heaviest first by its own pattern's lists
    (``ORDER[T * (1 + p):]``, ``plan.py``) instead of by the work summed over all patterns.
    ``STATS_TMA``: each full step's lse / delta by one TMA box of ``Stats`` (the preprocess's
    ``[B * Hq, Sq, 4]`` rows). ``FULL_FIRST`` (``ragged_bwd``; ``COL_FULL`` the table's ``col_full``):
    each list's whole contiguous entries, first in the list, run as an even, unpacked list's steps (no
    row masks, the stats by box), the rest through the packed / ragged path."""
    pid = tl.program_id(0)
    num_key_tiles = tl.num_programs(0) // num_bkv
    rank, b, h_kv = key_program_outer(pid, num_key_tiles, num_heads_kv)
    if PATTERN_ORDER:
        tile = tl.load(ORDER + num_key_tiles * (1 + (h_kv * group_size) // heads_per_pattern) + rank)
    else:
        tile = tl.load(ORDER + rank)
    n_start = tl.load(ROW_START + tile)
    n_end = tl.load(ROW_END + tile)
    blk = tl.load(ROW_BLOCK + tile)
    b64 = b.to(tl.int64)
    offs_dqk, dqk_ok = head_dim_offsets(HEAD_DIM_QK, BLOCK_DQK)
    offs_dv, dv_ok = head_dim_offsets(HEAD_DIM_V, BLOCK_DV)
    # a padded head dim is masked like a short row tile, so EVEN_M alone does not mean "load without a mask"
    EVEN_QK: tl.constexpr = BLOCK_DQK == HEAD_DIM_QK
    EVEN_V: tl.constexpr = BLOCK_DV == HEAD_DIM_V

    k_desc, v_desc = kv_descs(K, V, b64, h_kv, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                              stride_vh, Sk, BLOCK_N, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)
    # keys past n_end belong to the next block (or are zero fill past Sk): computed, never stored.
    # The full steps' stats: boxes of the [B * Hq, Sq, 4] rows (lse, delta, 0, 0), or the pointers
    if STATS_TMA:
        Full_lse = stats_desc(Stats, (num_bkv // num_heads_kv) * num_heads_q, Sq, BLOCK_M)
    else:
        Full_lse = Lse
    if FULL_FIRST:
        tl.static_assert(LIST_CHUNK == 0, "full entries first: the lists read entry by entry")
    k = k_desc.load([n_start, 0])  # [BLOCK_N, BLOCK_DQK]
    v = v_desc.load([n_start, 0])  # [BLOCK_N, BLOCK_DV]
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    offs_r = tl.arange(0, BLOCK_M)
    r_head = offs_r // BLOCK_M
    r_pos = offs_r % BLOCK_M
    # GQA: every query head of the group adds into the same dK/dV registers (no atomics)
    for g in range(0, group_size, 1):
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
def _dq_step(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, start_n, end_n, next_n, count,
             offs_dqk, dqk_ok, offs_dv, dv_ok, qk_scale, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
             PACKED: tl.constexpr, EVEN_QK: tl.constexpr, EVEN_V: tl.constexpr):
    """One dQ step: the keys of a list entry (``core.entry_at``) against the program's rows; ``k_src`` /
    ``v_src``: the K/V descriptors, or with ``PACKED`` the KV head's base pointers (rows gathered)."""
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
    return dq_update(dq, p, do, v, k, delta)  # [HM, BLOCK_DQK]


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
    EVEN_N: tl.constexpr, LIST_CHUNK: tl.constexpr, PACKED: tl.constexpr, SHORT_N: tl.constexpr = 0,
):
    """Query-major dQ. Grid: row tiles x head packs; a row tile is ``HEADS`` query heads of one GQA
    group (sharing the pattern and the KV head) x ``BLOCK_M`` positions, ``HM = HEADS * BLOCK_M`` rows.
    ``SHORT_N`` (``ragged_bwd``; ``COL_SPLIT`` the table's ``col_split``): each list's entries from
    ``COL_SPLIT`` on hold at most ``SHORT_N`` keys (``plan.py``) and are walked after the others in
    ``SHORT_N``-key tiles."""
    b, h0, h_kv, pat, head, pos, row_ok, blk = pack_program_at(
        tl.program_id(0), ROW_START, ROW_END, ROW_BLOCK, ORDER, num_packs, num_heads_q, group_size,
        heads_per_pattern, BLOCK_M, HEADS)
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
    e_lo = tl.load(PTR + pat * num_row_blocks + blk)
    e_hi = tl.load(PTR + pat * num_row_blocks + blk + 1)
    last = last_count(COL_COUNT, e_lo, e_hi, PACKED)
    if SHORT_N > 0:
        tl.static_assert(LIST_CHUNK == 0 and not PACKED, "short key entries: unpacked lists read entry by entry")
        e_mid = tl.load(COL_SPLIT + pat * num_row_blocks + blk)
        for e in tl.range(e_lo, e_mid):
            start_n, end_n, next_n = entry_at(COL_START, COL_END, COL_NEXT, e, EVEN_N, PACKED)
            dq = _dq_step(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, start_n, end_n, next_n,
                          BLOCK_N, offs_dqk, dqk_ok, offs_dv, dv_ok, qk_scale, BLOCK_N, EVEN_N, PACKED, EVEN_QK,
                          EVEN_V)
        # the lists' short entries (a key run's remainder of <= SHORT_N keys) in tiles of their own size
        k_short, v_short = kv_sources(K, V, b64, h_kv, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                      stride_vh, Sk, SHORT_N, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, PACKED)
        for e in tl.range(e_mid, e_hi):
            start_n, end_n, next_n = entry_at(COL_START, COL_END, COL_NEXT, e, False, PACKED)
            dq = _dq_step(dq, q, do, lse2, delta, k_short, v_short, stride_ks, stride_vs, start_n, end_n, next_n,
                          SHORT_N, offs_dqk, dqk_ok, offs_dv, dv_ok, qk_scale, SHORT_N, False, PACKED, EVEN_QK,
                          EVEN_V)
    elif LIST_CHUNK == 0:
        for e in tl.range(e_lo, e_hi):
            start_n, end_n, next_n = entry_at(COL_START, COL_END, COL_NEXT, e, EVEN_N, PACKED)
            count = packed_count(e, e_hi, last, BLOCK_N)
            dq = _dq_step(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, start_n, end_n, next_n, count,
                          offs_dqk, dqk_ok, offs_dv, dv_ok, qk_scale, BLOCK_N, EVEN_N, PACKED, EVEN_QK, EVEN_V)
    else:
        for c0 in range(e_lo, e_hi, LIST_CHUNK):
            starts, ends, nexts = entry_chunk(COL_START, COL_END, COL_NEXT, c0, e_hi, LIST_CHUNK,
                                              EVEN_N, PACKED)  # [LIST_CHUNK] each
            for j in tl.range(0, tl.minimum(e_hi - c0, LIST_CHUNK)):
                start_n, end_n, next_n = entry_pick(starts, ends, nexts, j, LIST_CHUNK, EVEN_N, PACKED)
                count = packed_count(c0 + j, e_hi, last, BLOCK_N)
                dq = _dq_step(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, start_n, end_n, next_n,
                              count, offs_dqk, dqk_ok, offs_dv, dv_ok, qk_scale, BLOCK_N, EVEN_N, PACKED, EVEN_QK,
                              EVEN_V)

    dq_ptrs = DQ + b64 * stride_dqb + head * stride_dqh + pos64 * stride_dqs
    tl.store(dq_ptrs[:, None] + offs_dqk[None, :], (dq * softmax_scale).to(DQ.dtype.element_ty), mask=q_ok)

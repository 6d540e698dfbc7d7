"""FlashMask forward kernel and the tile classification it shares with the backward
(see ``longca_triton/kernels/flashmask/op.py`` for the math, the column form and FlashMask's test).
"""

import triton
import triton.language as tl

from longca_triton.kernels.core.jit import fwd_tile_setup, query_program, softmax_finish, softmax_step

__all__ = ["flashmask_fwd_kernel", "flashmask_classify_kernel"]


@triton.jit
def _classify(Bounds, tile_m, tile_n, Sq, Sk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HAS_LT: tl.constexpr, HAS_UT: tl.constexpr):
    """``(run, masked)`` for query tile ``tile_m`` against key tile ``tile_n``: FlashMask's test.

    ``run`` is False for an EMPTY tile (skip it); ``masked`` says a visited tile is PARTIAL.
    ``Bounds`` holds the 8 per-key-tile min/max of ``LTS, LTE, UTS, UTE`` (module docstring).
    """
    m0 = tile_m * BLOCK_M
    # rows past Sq do not exist: they must not stop a tile from being EMPTY
    m1 = tl.minimum(m0 + BLOCK_M, Sq)
    b = Bounds + tile_n * 8
    # start from "not empty" (a tile always has a row), as a scalar tensor of the right type
    empty = m1 <= m0
    # a key tile running past Sk is never FULL: its padding keys need the element mask
    masked = (tile_n + 1) * BLOCK_N > Sk
    if HAS_LT:
        empty, masked = _band_test(b, m0, m1, empty, masked)
    if HAS_UT:
        empty, masked = _band_test(b + 4, m0, m1, empty, masked)
    return ~empty, masked


@triton.jit
def _band_test(bounds, m0, m1, empty, masked):
    """``_classify``'s test against one masked band ``[start, end)`` of the columns (lower: ``LTS, LTE``,
    upper: ``UTS, UTE``), its 4 bounds at ``bounds``: min / max start, min / max end. Rows ``[m0, m1)`` are
    EMPTY when every column masks all of them, and need the element mask when some column masks some."""
    start_min = tl.load(bounds + 0)
    start_max = tl.load(bounds + 1)
    end_min = tl.load(bounds + 2)
    end_max = tl.load(bounds + 3)
    return empty | ((m0 >= start_max) & (m1 <= end_min)), masked | ((m1 > start_min) & (m0 < end_max))


@triton.jit
def _next_run(Bounds, start, num_tiles, fixed_tile, Sq, Sk,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEY_MAJOR: tl.constexpr,
              HAS_LT: tl.constexpr, HAS_UT: tl.constexpr):
    """``[lo, hi)``: the next run of non-EMPTY tiles at or after tile ``start``.

    Walks the tiles one by one with ``_classify``: the EMPTY ones before the run are skipped
    (never loaded), the run stops at the next EMPTY tile or at ``num_tiles``; ``lo == hi ==
    num_tiles`` when nothing is left. The walk is over key tiles against query tile
    ``fixed_tile``, or, with ``KEY_MAJOR`` (dK/dV), over query tiles against key tile
    ``fixed_tile``.
    """
    lo = start
    scanning = lo < num_tiles
    while scanning:
        if KEY_MAJOR:
            run, _ = _classify(Bounds, lo, fixed_tile, Sq, Sk, BLOCK_M, BLOCK_N, HAS_LT, HAS_UT)
        else:
            run, _ = _classify(Bounds, fixed_tile, lo, Sq, Sk, BLOCK_M, BLOCK_N, HAS_LT, HAS_UT)
        lo = tl.where(run, lo, lo + 1)
        scanning = (~run) & (lo < num_tiles)
    hi = lo
    scanning = hi < num_tiles
    while scanning:
        if KEY_MAJOR:
            run, _ = _classify(Bounds, hi, fixed_tile, Sq, Sk, BLOCK_M, BLOCK_N, HAS_LT, HAS_UT)
        else:
            run, _ = _classify(Bounds, fixed_tile, hi, Sq, Sk, BLOCK_M, BLOCK_N, HAS_LT, HAS_UT)
        hi = tl.where(run, hi + 1, hi)
        scanning = run & (hi < num_tiles)
    return lo, hi


@triton.jit
def _load_columns(Cols, offs_n, Sk):
    """The column vectors ``LTS, LTE, UTS, UTE`` (``Cols`` is int32 ``[4, Sk]``) and ``col_ok``."""
    col_ok = offs_n < Sk
    lts = tl.load(Cols + offs_n, mask=col_ok, other=0)
    lte = tl.load(Cols + Sk + offs_n, mask=col_ok, other=0)
    uts = tl.load(Cols + 2 * Sk + offs_n, mask=col_ok, other=0)
    ute = tl.load(Cols + 3 * Sk + offs_n, mask=col_ok, other=0)
    return lts, lte, uts, ute, col_ok


@triton.jit
def _tile_allowed(Cols, offs_m, offs_n, Sk, HAS_LT: tl.constexpr, HAS_UT: tl.constexpr):
    """``_allowed`` of a query-major tile: rows ``offs_m`` against the keys ``offs_n``, their column vectors
    loaded here: ``[BLOCK_M, BLOCK_N]``."""
    lts, lte, uts, ute, col_ok = _load_columns(Cols, offs_n, Sk)  # [BLOCK_N] each
    return _allowed(offs_m[:, None], col_ok[None, :], lts[None, :], lte[None, :], uts[None, :], ute[None, :],
                    HAS_LT, HAS_UT)


@triton.jit
def _allowed(rows, col_ok, lts, lte, uts, ute, HAS_LT: tl.constexpr, HAS_UT: tl.constexpr):
    """FlashMask's element mask: row not in ``[LTS, LTE)`` nor in ``[UTS, UTE)`` of its column.

    The arguments come pre-broadcast: ``rows`` along one axis, the column vectors along the
    other (``[M, 1]`` and ``[1, N]`` in the forward and dQ, ``[1, M]`` and ``[N, 1]`` in the
    transposed dK/dV), so the result is ``[M, N]`` or ``[N, M]``.
    """
    # rows >= 0 always holds: it only broadcasts col_ok to the full tile shape
    allowed = col_ok & (rows >= 0)
    if HAS_LT:
        allowed = allowed & ((rows < lts) | (rows >= lte))
    if HAS_UT:
        allowed = allowed & ((rows < uts) | (rows >= ute))
    return allowed



@triton.jit
def flashmask_fwd_kernel(
    Q, K, V, Out, Lse, Cols, Bounds,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    qk_scale,  # softmax_scale * log2(e)
    Sq, Sk, num_bh, num_heads_q, group_size,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LT: tl.constexpr, HAS_UT: tl.constexpr,
):
    # why: batch*head is the fastest-varying index, so the query heads of one GQA group run side
    # by side and read the same K/V tiles from L2; query tiles go last-first, because under
    # causal-like masks the last query tiles have the most non-EMPTY key tiles.
    rank, bh, b, h, h_kv = query_program(num_bh, num_heads_q, group_size)
    num_m = tl.cdiv(Sq, BLOCK_M)
    num_n = tl.cdiv(Sk, BLOCK_N)
    tile_m = num_m - 1 - rank
    # head-dim tiles padded to BLOCK_DQK / BLOCK_DV: the descriptors zero-fill and clip the padding
    start_m, q, k_desc, v_desc, o_desc, offs_m, acc, m_i, l_i = fwd_tile_setup(
        Q, K, V, Out, b, h, h_kv, tile_m, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks,
        stride_kh, stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh, Sq, Sk,
        BLOCK_M, BLOCK_N, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV)

    # every key tile is classified; EMPTY ones are skipped, the others come in runs of
    # consecutive tiles
    # why runs: Triton pipelines the K/V loads of a loop only when they are not under an `if`,
    # so the skip happens between the runs and each run is a plain pipelined loop
    n_next = tl.full([], 0, tl.int32)
    while n_next < num_n:
        n_lo, n_hi = _next_run(Bounds, n_next, num_n, tile_m, Sq, Sk, BLOCK_M, BLOCK_N, False,
                               HAS_LT, HAS_UT)
        for n in tl.range(n_lo, n_hi):
            _, masked = _classify(Bounds, tile_m, n, Sq, Sk, BLOCK_M, BLOCK_N, HAS_LT, HAS_UT)
            start_n = n * BLOCK_N
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = k_desc.load([start_n, 0])  # [BLOCK_N, BLOCK_DQK]
            qk = tl.dot(q, k.T)  # [BLOCK_M, BLOCK_N]
            if masked:
                # why here and not with K: loaded for every tile, the column vectors were
                # pipelined into registers and spilled (sm_90, D >= 64); under the `if` only
                # PARTIAL tiles load them (4 * BLOCK_N int32, unpipelined, from L2)
                allowed = _tile_allowed(Cols, offs_m, offs_n, Sk, HAS_LT, HAS_UT)  # [BLOCK_M, BLOCK_N]
                qk = tl.where(allowed, qk, float("-inf"))
            acc, m_i, l_i = softmax_step(acc, m_i, l_i, qk, v_desc, start_n, qk_scale, False, True)
        n_next = n_hi

    # fully masked rows (l_i == 0): out = 0, lse = -inf
    out, lse = softmax_finish(acc, m_i, l_i)
    o_desc.store([start_m, 0], out.to(Out.dtype.element_ty))
    tl.store(Lse + bh.to(tl.int64) * Sq + offs_m, lse, mask=offs_m < Sq)



@triton.jit
def flashmask_classify_kernel(Bounds, Out, Sq, Sk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              HAS_LT: tl.constexpr, HAS_UT: tl.constexpr):
    """The classification alone (``classify_tiles``): one program per (query tile, key tile)."""
    tile_m = tl.program_id(0)
    tile_n = tl.program_id(1)
    run, masked = _classify(Bounds, tile_m, tile_n, Sq, Sk, BLOCK_M, BLOCK_N, HAS_LT, HAS_UT)
    cls = tl.where(run, tl.where(masked, 1, 2), 0)  # EMPTY 0, PARTIAL 1, FULL 2
    tl.store(Out + tile_m * tl.num_programs(1) + tile_n, cls.to(tl.int8))

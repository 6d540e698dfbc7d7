"""The mask IR (docs/masks.md §1–2) and its lowerings.

Two representations, both immutable:

* ``RangeMask(seqlen_q, seqlen_k, slices)``: a union of slices
  ``(q_start, q_end, k_start, k_end, kind)``, kind one of FULL, CAUSAL, INVCAUSAL, BICAUSAL with
  FlashAttention's alignment (CAUSAL bottom-right, INVCAUSAL top-left).  Static masks.
* ``BlockSparseMask(q_block_bounds, k_block_bounds, block_map)``: per pattern ``p`` a boolean map
  over (query block, key block).  Dynamic masks.

Every lowering is a pure function of the mask, computed once and cached on the instance:

* ``to_dense()``              bool ``[Sq, Sk]`` (``[P, Sq, Sk]`` for block-sparse), for tests and small S;
* ``row_intervals()``         per query row its allowed keys as merged ``[lo, hi)`` intervals, ``O(S)``;
* ``col_intervals()``         the same per key column (the transpose);
* ``block_tables(bm, bn)``    per query tile the full and partial key tiles, and the transpose;
* ``tile_segments(bm, bn)``   the same as runs of tiles, what tile plans read (``key_tile_segments``: by key tile);
* ``area``                    allowed pairs, from the intervals, never from a dense tensor.

FlashMask columns, the varlen form and Flex ``BlockMask`` live in ``lowerings.py``.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import torch

__all__ = [
    "SliceKind",
    "Mask",
    "RangeMask",
    "BlockSparseMask",
    "BlockTables",
    "FLOP_MODES",
]

FLOP_MODES = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


class SliceKind(enum.IntEnum):
    FULL = 0
    CAUSAL = 1
    INVCAUSAL = 2
    BICAUSAL = 3

    @classmethod
    def parse(cls, kind: Any) -> "SliceKind":
        if isinstance(kind, SliceKind):
            return kind
        if isinstance(kind, str) and kind.upper() in cls.__members__:
            return cls[kind.upper()]
        if isinstance(kind, (int, np.integer)) and not isinstance(kind, bool) and int(kind) in {k.value for k in cls}:
            return cls(int(kind))
        valid = ", ".join(k.name.lower() for k in cls)
        raise ValueError(f"unknown slice kind {kind!r}; valid kinds: {valid}")


def _cached(fn):
    """Cache a lowering on the (immutable) mask instance, keyed by its arguments."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        key = (fn.__name__, args, tuple(sorted(kwargs.items())))
        cache = self.__dict__.setdefault("_lowering_cache", {})
        if key not in cache:
            cache[key] = fn(self, *args, **kwargs)
        return cache[key]

    return wrapper


@dataclass(frozen=True)
class BlockTables:
    """Tile-level structure of a mask at tile size ``(block_m, block_n)``.

    CSR lists (int32 numpy arrays). Query-major: for query tile ``m`` the key tiles
    ``q_full_idx[q_full_ptr[m]:q_full_ptr[m+1]]`` are fully allowed (no element masking needed) and
    ``q_part_idx[q_part_ptr[m]:q_part_ptr[m+1]]`` are partially allowed; both ascending. Key-major
    (``k_*``) is the transpose: for key tile ``n`` its full / partial query tiles. Empty tiles are in
    neither list. "Full" means every in-range pair (``i < Sq``, ``j < Sk``) is allowed, so a ragged
    edge tile can be full and still need bounds masking.

    For a ``BlockSparseMask`` with ``P`` patterns the ``*_ptr`` arrays are ``[P, num + 1]`` with
    offsets into the shared ``*_idx`` arrays; for a ``RangeMask`` they are ``[num + 1]``.
    """

    block_m: int
    block_n: int
    num_m: int
    num_n: int
    q_full_ptr: np.ndarray
    q_full_idx: np.ndarray
    q_part_ptr: np.ndarray
    q_part_idx: np.ndarray
    k_full_ptr: np.ndarray
    k_full_idx: np.ndarray
    k_part_ptr: np.ndarray
    k_part_idx: np.ndarray

    @property
    def num_full(self) -> int:
        return int(self.q_full_idx.size)

    @property
    def num_partial(self) -> int:
        return int(self.q_part_idx.size)

    @staticmethod
    def from_classification(block_m: int, block_n: int, full: np.ndarray, touched: np.ndarray) -> "BlockTables":
        """Build the CSR lists from boolean tile maps ``[P, num_m, num_n]`` (or ``[num_m, num_n]``)."""
        squeeze = full.ndim == 2
        if squeeze:
            full, touched = full[None], touched[None]
        part = touched & ~full
        P, num_m, num_n = full.shape

        def csr(tiles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            # tiles [P, rows, cols] -> ptr [P, rows + 1] (global offsets), idx (ascending col per row)
            counts = tiles.sum(axis=2).astype(np.int64)  # [P, rows]
            ptr = np.zeros((P, tiles.shape[1] + 1), dtype=np.int64)
            ptr[:, 1:] = np.cumsum(counts, axis=1)
            base = np.concatenate([[0], np.cumsum(ptr[:, -1])[:-1]])
            ptr += base[:, None]
            idx = np.nonzero(tiles)[2]  # row-major order: by pattern, row, then ascending col
            ptr, idx = ptr.astype(np.int32), idx.astype(np.int32)
            return (ptr[0] if squeeze else ptr), idx

        qf_ptr, qf_idx = csr(full)
        qp_ptr, qp_idx = csr(part)
        kf_ptr, kf_idx = csr(np.ascontiguousarray(full.transpose(0, 2, 1)))
        kp_ptr, kp_idx = csr(np.ascontiguousarray(part.transpose(0, 2, 1)))
        return BlockTables(block_m, block_n, num_m, num_n, qf_ptr, qf_idx, qp_ptr, qp_idx, kf_ptr, kf_idx, kp_ptr, kp_idx)

    def to_dense_tiles(self) -> tuple[np.ndarray, np.ndarray]:
        """(full, partial) boolean tile maps ``[num_m, num_n]`` (``[P, ...]`` for block-sparse)."""
        ptr_f, ptr_p = np.atleast_2d(self.q_full_ptr), np.atleast_2d(self.q_part_ptr)
        P = ptr_f.shape[0]
        out = []
        for ptr, idx in ((ptr_f, self.q_full_idx), (ptr_p, self.q_part_idx)):
            tiles = np.zeros((P, self.num_m, self.num_n), dtype=bool)
            for p in range(P):
                counts = np.diff(ptr[p])
                rows = np.repeat(np.arange(self.num_m), counts)
                tiles[p, rows, idx[ptr[p, 0] : ptr[p, -1]]] = True
            out.append(tiles[0] if self.q_full_ptr.ndim == 1 else tiles)
        return out[0], out[1]


def _check_block_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def merge_intervals(num_pos: int, pos: np.ndarray, lo: np.ndarray, hi: np.ndarray, extent: int):
    """Merge per-position half-open intervals into disjoint ascending ones.

    ``pos, lo, hi`` are flat arrays (one entry per (position, interval)); positions run in
    ``[0, num_pos)``, intervals in ``[0, extent]``. Touching intervals merge. Returns flat
    ``(pos, lo, hi)`` sorted by position then ``lo``; empty intervals are dropped.
    """
    keep = hi > lo
    pos, lo, hi = pos[keep].astype(np.int64), lo[keep].astype(np.int64), hi[keep].astype(np.int64)
    if pos.size == 0:
        return pos, lo, hi
    order = np.lexsort((lo, pos))
    pos, lo, hi = pos[order], lo[order], hi[order]
    # Offsetting every position by (extent + 1) makes one running maximum valid across all rows:
    # a row's first interval always starts past the previous row's largest end.
    big = extent + 1
    lo_o, hi_o = lo + pos * big, hi + pos * big
    run_max = np.maximum.accumulate(hi_o)
    starts = np.ones(pos.size, dtype=bool)
    starts[1:] = lo_o[1:] > run_max[:-1]
    start_idx = np.nonzero(starts)[0]
    m_hi = np.maximum.reduceat(hi_o, start_idx)
    m_pos = pos[start_idx]
    return m_pos, lo_o[start_idx] - m_pos * big, m_hi - m_pos * big


def _pad_intervals(num_pos: int, pos: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat merged intervals -> ``[num_pos, K]`` int32 arrays (unused slots ``lo == hi == 0``)."""
    if pos.size == num_pos and (num_pos == 0 or (pos[0] == 0 and pos[-1] == num_pos - 1)) \
            and np.all(pos[1:] > pos[:-1]):  # one interval at every position: no scatter
        return lo.astype(np.int32).reshape(-1, 1), hi.astype(np.int32).reshape(-1, 1)
    if pos.size == 0 or np.all(pos[1:] > pos[:-1]):  # at most one interval per position
        out_lo = np.zeros((num_pos, 1), dtype=np.int32)
        out_hi = np.zeros((num_pos, 1), dtype=np.int32)
        out_lo[pos, 0], out_hi[pos, 0] = lo, hi
        return out_lo, out_hi
    counts = np.bincount(pos, minlength=num_pos)
    K = max(1, int(counts.max()) if counts.size else 1)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slot = np.arange(pos.size) - first[pos]
    out_lo = np.zeros((num_pos, K), dtype=np.int32)
    out_hi = np.zeros((num_pos, K), dtype=np.int32)
    out_lo[pos, slot] = lo
    out_hi[pos, slot] = hi
    return out_lo, out_hi


def _csr(major: np.ndarray, minor: np.ndarray, num: int) -> tuple[np.ndarray, np.ndarray]:
    """int32 CSR ``(ptr [num + 1], idx)`` of pairs already sorted by ``major`` then ``minor``."""
    ptr = np.zeros(num + 1, dtype=np.int64)
    np.cumsum(np.bincount(major, minlength=num), out=ptr[1:])
    return ptr.astype(np.int32), minor.astype(np.int32)


def _row_segments(rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray | None:
    """Merged row intervals with one interval per row as linear pieces: int64 ``[P, 6]`` rows
    ``(r0, r1, lo0, hi0, a, b)``, rows ``r0 <= r < r1`` attending ``[lo0 + a (r - r0), hi0 + b (r - r0))``
    with slopes ``a, b`` in {0, 1} (documents, causal and window masks are a few pieces per slice).
    None where some row has several intervals (its tile bounds are then read row by row)."""
    n = rows.size
    if n == 0 or (n > 1 and not np.all(rows[1:] > rows[:-1])):
        return None
    d_row, d_lo, d_hi = np.diff(rows), np.diff(lo), np.diff(hi)
    ok = d_row == 1
    ok &= (d_lo == 0) | (d_lo == 1)
    ok &= (d_hi == 0) | (d_hi == 1)
    slope = d_lo * 2
    slope += d_hi
    brk = ~ok  # a piece ends after row i where step i is no unit step or the slope changes
    if n > 2:
        changed = slope[1:] != slope[:-1]
        brk[1:] |= changed
    starts = np.concatenate([[0], np.flatnonzero(brk) + 1])
    ends = np.append(starts[1:], n)
    single = ends - starts == 1
    a = np.where(single, 0, d_lo[np.minimum(starts, max(n - 2, 0))] if n > 1 else 0)
    b = np.where(single, 0, d_hi[np.minimum(starts, max(n - 2, 0))] if n > 1 else 0)
    return np.stack([rows[starts], rows[ends - 1] + 1, lo[starts], hi[starts], a, b], axis=1).astype(np.int64)


def _progression(first: np.ndarray, end: np.ndarray, step: int) -> np.ndarray:
    """Every ``first[i] + k * step < end[i]`` (k >= 0), for all i, concatenated."""
    count = np.maximum(0, -(-(end - first) // step))
    total = int(count.sum())
    k = np.arange(total, dtype=np.int64)
    k -= np.repeat(np.cumsum(count) - count, count)
    k *= step
    k += np.repeat(first, count)
    return k


def _piece_rows(seg: np.ndarray, Sq: int, bm: int) -> tuple:
    """What ``_piece_tile_segments`` reads of linear pieces at query tiles of ``bm`` rows, whatever the key
    tiles: per (piece, query tile) pair, in row order, its tile and the bounds ``lo``, ``hi`` at its first
    and at its last row; per query tile with pairs, its first pair and whether its pieces hold all its rows."""
    r0, r1, lo0, hi0, a, b = seg.T
    t_first, t_end = r0 // bm, (r1 - 1) // bm + 1
    t = _progression(t_first, t_end, 1)  # the query tile of every pair
    p = np.repeat(np.arange(r0.size), t_end - t_first)
    start, lo, hi, a, b = r0[p], lo0[p], hi0[p], a[p], b[p]
    f = np.maximum(start, t * bm)
    f -= start
    last = np.minimum(r1[p], (t + 1) * bm)
    last -= start + 1
    first = np.flatnonzero(np.append(True, t[1:] != t[:-1]))
    held = np.add.reduceat(last - f + 1, first)
    whole = held == np.minimum(bm, Sq - t[first] * bm)
    return t, lo + a * f, lo + a * last, hi + b * f, hi + b * last, first, whole


def _piece_tile_segments(seg: np.ndarray, Sq: int, Sk: int, bm: int, bn: int, rows: tuple | None = None) -> tuple:
    """``_tile_segments`` from linear pieces, per (piece, query tile) pair rather than per event;
    ``rows``: their ``_piece_rows`` at ``bm`` already built.

    Along a piece ``lo`` and ``hi`` never fall, so its rows ``f..l`` within a query tile touch the key
    tiles ``[floor(lo_f / bn), ceil(hi_l / bn))`` (one range: a row's interval is never empty) and all
    cover ``[ceil(lo_l / bn), floor(hi_f / bn))`` (the ragged last tile when ``hi_f == Sk``). A query tile's
    full tiles are those every piece in it covers, where its pieces hold all of its rows; its touched
    tiles are the union of its pieces' ranges. ``O(pieces + query tiles)``."""
    num_n = -(-Sk // bn)
    t, lo_f, lo_l, hi_f, hi_l, first, whole = _piece_rows(seg, Sq, bm) if rows is None else rows
    ta = lo_f // bn
    tb = -(-hi_l // bn)
    fa = -(-lo_l // bn)
    fb = np.where(hi_f == Sk, num_n, hi_f // bn)
    tiles = t[first]
    full_lo, full_hi = np.maximum.reduceat(fa, first), np.minimum.reduceat(fb, first)
    has_full = whole & (full_hi > full_lo)
    # the union of each query tile's touched ranges (offset per tile: a tile's ranges start past every
    # end of the tile before, so one running maximum serves all)
    if not np.all((t[1:] > t[:-1]) | (ta[1:] >= ta[:-1])):
        order = np.lexsort((ta, t))
        t, ta, tb = t[order], ta[order], tb[order]
    width = num_n + 1
    end = tb + t * width
    reach = np.maximum.accumulate(end)
    new = np.ones(t.size, dtype=bool)
    np.greater(ta[1:] + t[1:] * width, reach[:-1], out=new[1:])
    u = np.flatnonzero(new)
    m, u_lo = t[u], ta[u]
    u_hi = np.maximum.reduceat(end, u) - m * width
    # each touched range is partial, or partial / full / partial around its tile's full tiles
    k = np.searchsorted(tiles, m)
    f_lo, f_hi = full_lo[k], full_hi[k]
    inside = has_full[k] & (u_lo <= f_lo) & (f_hi <= u_hi)
    n0, n1 = np.empty((m.size, 3), np.int64), np.empty((m.size, 3), np.int64)
    n0[:, 0], n0[:, 1], n0[:, 2] = u_lo, f_lo, f_hi
    n1[:, 0], n1[:, 1], n1[:, 2] = np.where(inside, f_lo, u_hi), f_hi, u_hi
    keep = n1 > n0
    keep[:, 1:] &= inside[:, None]
    keep = np.flatnonzero(keep)
    return m[keep // 3], n0.ravel()[keep], n1.ravel()[keep], keep % 3 == 1


def _tile_segments(rows, lo, hi, Sq: int, Sk: int, bm: int, bn: int, segments: np.ndarray | None = None,
                   piece_rows: tuple | None = None) -> tuple:
    """The touched ``(query tile, key tile)`` pairs of merged row intervals as segments, without a dense map.

    Per query tile ``m`` the intervals become events along the key tiles: ``+1`` where an interval starts
    to touch a tile and ``-1`` past its last, and (weighted by how many rows share them) where it starts
    and stops covering whole tiles. Between two events of a tile the counts are constant: touched where
    the touch count is positive, full where the cover count equals the tile's rows. Consecutive rows
    whose four tile bounds agree are one weighted interval, so structured masks give a few events per
    tile; the cost is ``O(S + events log events)``. From linear ``segments`` (``_row_segments``) it is
    ``_piece_tile_segments`` (``piece_rows``: their ``_piece_rows`` at ``bm``). Returns int64
    ``(m, n0, n1)`` and bool ``full``: per query tile its touched key tiles as ascending segments
    ``[n0, n1)``, each all full or all partial, one of a class never followed directly by another of
    that class (maximal runs), sorted by ``m`` then ``n0``."""
    num_n = -(-Sk // bn)
    if (rows.size if segments is None else len(segments)) == 0:  # a mask that allows nothing
        z = np.zeros(0, np.int64)
        return z, z, z, np.zeros(0, dtype=bool)
    if segments is not None:
        return _piece_tile_segments(segments, Sq, Sk, bm, bn, piece_rows)
    # the four tile bounds of each row's interval and its query tile (named arrays, int32 where the
    # positions fit: an unnamed temporary of this length costs numpy a slow check on some hosts)
    it = np.int32 if max(Sq, Sk) < 2**31 - 2 * max(bm, bn) else np.int64
    rows, lo, hi = (np.asarray(x, dtype=it) for x in (rows, lo, hi))
    t = rows // bm
    ta = lo // bn  # touched key tiles [ta, tb)
    tb = hi + (bn - 1)
    tb //= bn
    fa = lo + (bn - 1)  # wholly covered key tiles [fa, fb)
    fa //= bn
    fb = hi // bn
    np.copyto(fb, num_n, where=hi == Sk)
    weight = np.ones(t.size, np.int64)
    # consecutive rows with equal bounds are one weighted interval
    new = np.zeros(t.size, dtype=bool)
    new[0] = True
    for bnd in (t, ta, tb, fa, fb):  # a run starts where any bound changes
        changed = bnd[1:] != bnd[:-1]
        new[1:] |= changed
    first = np.flatnonzero(new)
    weight = np.add.reduceat(weight, first)
    t, ta, tb, fa, fb = (x[first].astype(np.int64) for x in (t, ta, tb, fa, fb))
    covers = fb > fa
    width = num_n + 1
    t *= width
    tc = t[covers]
    key = np.concatenate([t + ta, t + tb, tc + fa[covers], tc + fb[covers]])
    nt, nc = ta.size, tc.size
    d_touch = np.zeros(key.size, np.int64)
    d_touch[:nt], d_touch[nt:2 * nt] = 1, -1
    d_cover = np.zeros(key.size, np.int64)
    d_cover[2 * nt:2 * nt + nc] = weight[covers]
    d_cover[2 * nt + nc:] = -d_cover[2 * nt:2 * nt + nc]
    order = np.argsort(key, kind="stable")
    key = key[order]
    # the counts after each distinct key's last event (every tile's events sum to 0: one running sum serves all)
    end = np.flatnonzero(key[1:] != key[:-1])
    touch = np.cumsum(d_touch[order])[end]
    cover = np.cumsum(d_cover[order])[end]
    m, n = np.divmod(key, width)
    same = m[end] == m[end + 1]  # [n_i, n_{i+1}) within one query tile
    seg = end[same]
    m, n0, n1, touch, cover = m[seg], n[seg], n[seg + 1], touch[same], cover[same]
    full = cover == np.minimum(bm, Sq - m * bm)
    keep = (touch > 0) | full
    return join_segments(m[keep], n0[keep], n1[keep], full[keep])


def join_segments(m: np.ndarray, n0: np.ndarray, n1: np.ndarray, full: np.ndarray) -> tuple:
    """Tile segments ``(m, [n0, n1), full)`` sorted by ``m`` then ``n0``, each one that continues the one
    before in its tile and class joined to it (maximal runs)."""
    joins = np.zeros(m.size, dtype=bool)
    joins[1:] = (m[1:] == m[:-1]) & (n0[1:] == n1[:-1]) & (full[1:] == full[:-1])
    if not joins.any():
        return m, n0, n1, full
    first = np.flatnonzero(~joins)
    last = np.append(first[1:], m.size) - 1
    return m[first], n0[first], n1[last], full[first]


def _run_indices(n0: np.ndarray, n1: np.ndarray) -> np.ndarray:
    """Every ``n`` of the non-empty runs ``[n0, n1)``, int64, run after run."""
    length = n1 - n0
    idx = np.ones(int(length.sum()), np.int64)  # a step of 1 within a run, a jump at each run's start
    if idx.size:
        first = np.cumsum(length)
        first -= length
        jump = n0.copy()
        jump[1:] -= n1[:-1] - 1
        idx[first] = jump
        np.cumsum(idx, out=idx)
    return idx


def _expand(m: np.ndarray, n0: np.ndarray, n1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-empty segments ``(m, [n0, n1))`` -> int64 pairs ``(m, n)``, in segment order."""
    return np.repeat(m, n1 - n0), _run_indices(n0, n1)


def _segment_csr(segments: tuple, num: int) -> list:
    """``_tile_segments``' output (by ``m``, then ``n0``) as int32 CSR lists ``[full_ptr, full_idx, part_ptr,
    part_idx]`` over ``num`` major tiles."""
    m, n0, n1, full = segments
    out = []
    for sel in (np.flatnonzero(full), np.flatnonzero(~full)):
        start, end = n0[sel], n1[sel]
        ptr = np.zeros(num + 1, np.int64)
        np.cumsum(np.bincount(m[sel], weights=end - start, minlength=num).astype(np.int64), out=ptr[1:])
        out += [ptr.astype(np.int32), _run_indices(start, end).astype(np.int32)]
    return out


def _split_pairs(m: np.ndarray, n0: np.ndarray, n1: np.ndarray, full: np.ndarray) -> tuple:
    """``_tile_segments``' output as the full and partial pairs ``(full_m, full_n, part_m, part_n)``."""
    full, part = np.flatnonzero(full), np.flatnonzero(~full)
    return (*_expand(m[full], n0[full], n1[full]), *_expand(m[part], n0[part], n1[part]))


def _tile_lists(rows, lo, hi, Sq: int, Sk: int, bm: int, bn: int, segments: np.ndarray | None = None) -> tuple:
    """The full and partial ``(query tile, key tile)`` pairs of ``_tile_segments``, as
    ``(full_m, full_n, part_m, part_n)`` sorted by ``m`` then ``n``."""
    return _split_pairs(*_tile_segments(rows, lo, hi, Sq, Sk, bm, bn, segments))


def _piecewise_linear(num: int, r0: np.ndarray, r1: np.ndarray, v0: np.ndarray, slope: np.ndarray) -> np.ndarray:
    """int32 ``[num]``: ``v0 + slope * (r - r0)`` on the rows ``r0 <= r < r1`` of each piece (sorted, disjoint),
    0 elsewhere: per run of rows (the pieces and the gaps between them) its value repeated, or where
    some slope is 1 its steps repeated and summed (one array of ``num``, no per-row index array)."""
    edges = np.empty(2 * r0.size + 2, np.int64)
    edges[0], edges[1:-1:2], edges[2:-1:2], edges[-1] = 0, r0, r1, num
    runs = np.diff(edges)  # gap, piece, gap, ..., piece, gap
    c, step = np.zeros(runs.size, np.int32), np.zeros(runs.size, np.int32)
    c[1::2], step[1::2] = v0 - slope * r0, slope  # the value at row r is c + step * r
    if not step.any():
        return np.repeat(c, runs)
    keep = runs > 0
    c, step, start, runs = c[keep], step[keep], edges[:-1][keep], runs[keep]
    jump = c + step * start  # each run's first value, less the last value of the run before
    jump[1:] -= (c + step * (start + runs - 1))[:-1]
    out = np.repeat(step, runs)
    out[start] = jump
    return np.cumsum(out, dtype=np.int32, out=out)


class Mask:
    """Common interface of both IRs. Subclasses set ``seqlen_q``, ``seqlen_k``, ``name``, ``params``."""

    seqlen_q: int
    seqlen_k: int
    name: str
    params: dict

    @property
    def num_patterns(self) -> int:
        return 1

    def head_areas(self, num_heads_q: int) -> list[int]:
        raise NotImplementedError

    def flops(self, num_heads_q: int, head_dim: int, mode: str = "fwd", head_dim_v: int | None = None) -> float:
        """docs/masks.md §5: ``2 · (D_qk + D_v) · Σ_heads area_h`` (``4 · D · Σ area`` when ``head_dim_v``
        is None or equal: ``q . k`` costs ``2 D_qk`` per allowed pair, ``P V`` ``2 D_v``); bwd is
        2.5×, fwd_bwd 3.5× the forward count. True head dims count, never padded tiles."""
        if mode not in FLOP_MODES:
            raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(FLOP_MODES)}")
        d_v = head_dim if head_dim_v is None else head_dim_v
        return 2.0 * (head_dim + d_v) * float(sum(self.head_areas(num_heads_q))) * FLOP_MODES[mode]

    @property
    def density(self) -> float:
        area = self.area
        total = sum(area) if isinstance(area, list) else area
        return total / (self.seqlen_q * self.seqlen_k * self.num_patterns)

    def describe(self) -> str:
        hidden = ("doc_bounds", "k_doc_bounds", "q_block_bounds", "k_block_bounds")
        shown = {k: v for k, v in self.params.items() if k not in hidden}
        return f"{self.name}(Sq={self.seqlen_q}, Sk={self.seqlen_k}, {shown})"


class RangeMask(Mask):
    """Union of ``(q_start, q_end, k_start, k_end, kind)`` slices (docs/masks.md §1)."""

    def __init__(self, seqlen_q: int, seqlen_k: int, slices: Iterable[Sequence[Any]], *, name: str = "range", params: dict | None = None):
        self.seqlen_q = _check_block_size("seqlen_q", seqlen_q)
        self.seqlen_k = _check_block_size("seqlen_k", seqlen_k)
        parsed = []
        for n, s in enumerate(slices):
            parsed.append(self._check_slice(n, s))
        self.slices: tuple[tuple[int, int, int, int, SliceKind], ...] = tuple(parsed)
        self.name = name
        self.params = dict(params or {})

    def _check_slice(self, n: int, s: Sequence[Any]) -> tuple[int, int, int, int, SliceKind]:
        if isinstance(s, (str, bytes)) or not hasattr(s, "__len__") or len(s) != 5:
            raise ValueError(f"slice {n} {s!r}: expected (q_start, q_end, k_start, k_end, kind)")
        try:
            kind = SliceKind.parse(s[4])
        except ValueError as e:
            raise ValueError(f"slice {n} {tuple(s)!r}: {e}") from None
        vals = []
        for label, v in zip(("q_start", "q_end", "k_start", "k_end"), s[:4]):
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = int(v.item())
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"slice {n} {tuple(s)!r}: {label} must be an integer, got {v!r}")
            vals.append(int(v))
        qs, qe, ks, ke = vals
        for label, start, end, limit in (("q", qs, qe, self.seqlen_q), ("k", ks, ke, self.seqlen_k)):
            if start >= end:
                raise ValueError(f"slice {n} {tuple(s)!r}: empty or reversed {label} range [{start}, {end})")
            if start < 0 or end > limit:
                raise ValueError(f"slice {n} {tuple(s)!r}: {label} range [{start}, {end}) lies outside [0, {limit})")
        return qs, qe, ks, ke, kind

    def __repr__(self) -> str:
        return f"RangeMask({self.describe()}, {len(self.slices)} slices)"

    def content_key(self) -> tuple:
        """What the mask allows as a hashable value: its sizes and slices, not its name or params. Every
        lowering is a function of it, so caches of what is built from a mask key on it
        (``kernels.core.plan_cache``) and serve an equal mask built again."""
        return ("range", self.seqlen_q, self.seqlen_k, self.slices)

    # ------------------------------------------------------------------ constructors (masks/construct.py)
    @classmethod
    def from_cu_seqlens(cls, cu_seqlens_q, cu_seqlens_k=None, causal: bool = False, window_size=(-1, -1)) -> "RangeMask":
        """Packed documents, each (optionally) causal or windowed with its own bottom-right alignment
        (``masks.construct.from_cu_seqlens``)."""
        from .construct import from_cu_seqlens

        return from_cu_seqlens(cu_seqlens_q, cu_seqlens_k, causal, window_size)

    @classmethod
    def from_mask_mod(cls, mask_mod, seqlen_q: int, seqlen_k: int, device="cpu", **kwargs) -> "RangeMask":
        """A Flex-style predicate ``mask_mod(b, h, q_idx, kv_idx)`` evaluated in row chunks, never as an
        ``Sq x Sk`` tensor (``masks.construct.from_mask_mod``)."""
        from .construct import from_mask_mod

        return from_mask_mod(mask_mod, seqlen_q, seqlen_k, device, **kwargs)

    @classmethod
    def from_dense(cls, dense, **kwargs) -> "RangeMask":
        """A bool ``[Sq, Sk]`` tensor as slices (``masks.construct.from_dense``)."""
        from .construct import from_dense

        return from_dense(dense, **kwargs)

    # ------------------------------------------------------------------ semantics
    @staticmethod
    def slice_allows(kind: SliceKind, r, c, sq: int, sk: int):
        """The predicate of docs/masks.md §1 on in-slice coordinates (works on ints, numpy and torch)."""
        if kind == SliceKind.FULL:
            return (r >= 0) & (c >= 0)
        if kind == SliceKind.CAUSAL:
            return c <= r + (sk - sq)
        if kind == SliceKind.INVCAUSAL:
            return c >= r
        return (c >= r) & (c <= r + (sk - sq))

    @_cached
    def to_dense(self) -> torch.Tensor:
        """bool ``[Sq, Sk]``, evaluated slice by slice from the definition (True = attend)."""
        dense = torch.zeros(self.seqlen_q, self.seqlen_k, dtype=torch.bool)
        for qs, qe, ks, ke, kind in self.slices:
            r = torch.arange(qe - qs)[:, None]
            c = torch.arange(ke - ks)[None, :]
            dense[qs:qe, ks:ke] |= self.slice_allows(kind, r, c, qe - qs, ke - ks)
        return dense

    @_cached
    def _slice_arrays(self) -> np.ndarray:
        """The slices as int64 ``[N, 5]`` rows ``(q_start, q_end, k_start, k_end, kind)`` (read-only: shared)."""
        out = np.array(self.slices, dtype=np.int64).reshape(-1, 5)
        out.setflags(write=False)
        return out

    def _slice_intervals(self, by_row: bool):
        """Flat ``(pos, lo, hi)`` triples, one per (slice, row) (``by_row``) or (slice, key column): each
        slice allows one key interval per row and one query interval per column. All slices at once
        (a few array operations over the positions, not a loop over slices)."""
        sl = self._slice_arrays()
        z = np.zeros(0, np.int64)
        if not len(sl):
            return z, z, z
        qs, qe, ks, ke, kind = sl.T
        sq, sk = qe - qs, ke - ks
        # positions along the axis walked: rows (by_row) or key columns; ``n`` of them per slice
        start, n, other0 = (qs, sq, ks) if by_row else (ks, sk, qs)
        total = int(n.sum())
        if total == 0:
            return z, z, z
        # Every array below is a named one updated in place: numpy's check for reusing an unnamed
        # temporary costs a millisecond per call on a 128K-row array on some hosts, the arithmetic 50 us.
        def each(x):  # a per-slice value at each of the slice's positions (repeat: no gather)
            return np.repeat(x, n)

        local = np.arange(total, dtype=np.int64)
        local -= each(np.cumsum(n) - n)
        lower = np.isin(kind, (int(SliceKind.CAUSAL), int(SliceKind.BICAUSAL)))  # keys up to the diagonal
        upper = np.isin(kind, (int(SliceKind.INVCAUSAL), int(SliceKind.BICAUSAL)))  # keys from the diagonal
        # row r of a slice: keys [r if upper, r + (sk - sq) + 1 if lower) within [0, sk];
        # column c of a slice: rows [c - (sk - sq) if lower, c + 1 if upper) within [0, sq]
        extent = each(sk if by_row else sq)
        lo, hi = np.zeros(total, np.int64), extent.copy()
        starts_at_diag, ends_at_diag = (upper, lower) if by_row else (lower, upper)
        if starts_at_diag.any():
            d = each(np.zeros_like(sk) if by_row else sk - sq)
            np.subtract(local, d, out=d)
            np.clip(d, 0, extent, out=d)
            np.copyto(lo, d, where=each(starts_at_diag))
        if ends_at_diag.any():
            d = each(sk - sq + 1 if by_row else np.ones_like(sk))
            d += local
            np.clip(d, 0, extent, out=d)
            np.copyto(hi, d, where=each(ends_at_diag))
        base = each(other0)
        lo += base
        hi += base
        local += each(start)
        return local, lo, hi

    def _merged(self, by_row: bool):
        """``merge_intervals`` of ``_slice_intervals``; where the slices' ranges along the axis do not
        overlap (documents, windows built per document) each position has one interval already and
        only the empty ones go (no sort)."""
        pos, lo, hi = self._slice_intervals(by_row)
        extent, num = (self.seqlen_k, self.seqlen_q) if by_row else (self.seqlen_q, self.seqlen_k)
        if pos.size and np.all(pos[1:] > pos[:-1]):
            keep = hi > lo
            return (pos, lo, hi) if keep.all() else (pos[keep], lo[keep], hi[keep])
        return merge_intervals(num, pos, lo, hi, extent=extent)

    def _disjoint_slices(self, start: int) -> np.ndarray | None:
        """``_slice_arrays`` sorted by column ``start`` (0: the query range's start, 2: the key range's),
        or None where there are none or two of those ranges overlap."""
        sl = self._slice_arrays()
        if not len(sl):
            return None
        sl = sl[np.argsort(sl[:, start], kind="stable")]
        return None if np.any(sl[1:, start] < sl[:-1, start + 1]) else sl

    @_cached
    def _disjoint_row_pieces(self) -> np.ndarray | None:
        """Where the slices' query ranges do not overlap (documents, per-document windows), the row
        intervals straight from the slices as ``_row_segments``' linear pieces (empty rows left out):
        no per-row pass at all. None where some query ranges overlap (their rows must be merged)."""
        sl = self._disjoint_slices(0)
        if sl is None:
            return None
        qs, qe, ks, ke, kind = sl.T
        sq, sk = qe - qs, ke - ks
        d = sk - sq  # the diagonal's offset (bottom-right aligned)
        r0, r1 = np.zeros_like(sq), sq.copy()
        lo0, hi0, a, b = np.zeros_like(sq), sk.copy(), np.zeros_like(sq), np.zeros_like(sq)
        causal, inv, bi = (kind == int(SliceKind.CAUSAL)), (kind == int(SliceKind.INVCAUSAL)), (kind == int(SliceKind.BICAUSAL))
        # CAUSAL: row r attends [0, r + d + 1): empty before row -d, then growing by one key a row
        r0[causal] = np.maximum(0, -d[causal])
        hi0[causal] = r0[causal] + d[causal] + 1
        b[causal] = 1
        # INVCAUSAL: [r, sk): rows past the last key attend nothing
        r1[inv] = np.minimum(sq[inv], sk[inv])
        a[inv] = 1
        # BICAUSAL: [r, r + d + 1): a band of d + 1 keys, empty throughout when d < 0
        hi0[bi] = d[bi] + 1
        a[bi], b[bi] = 1, 1
        r1[bi & (d < 0)] = 0
        pieces = np.stack([r0 + qs, r1 + qs, lo0 + ks, hi0 + ks, a, b], axis=1)
        return pieces[pieces[:, 1] > pieces[:, 0]]

    @_cached
    def _disjoint_col_pieces(self) -> np.ndarray | None:
        """``_disjoint_row_pieces`` of the key columns: where the slices' key ranges do not overlap, each
        column's attending rows straight from the slices as linear pieces ``(c0, c1, lo0, hi0, a, b)``,
        columns ``c0 <= c < c1`` attended by rows ``[lo0 + a (c - c0), hi0 + b (c - c0))``. None where
        some key ranges overlap."""
        sl = self._disjoint_slices(2)
        if sl is None:
            return None
        qs, qe, ks, ke, kind = (x[:, None] for x in sl.T)
        sq, sk = qe - qs, ke - ks
        d = sk - sq
        # column c is attended by rows [max(0, c - d) if lower else 0, min(c + 1, sq) if upper else sq)
        lower = (kind == int(SliceKind.CAUSAL)) | (kind == int(SliceKind.BICAUSAL))
        upper = (kind == int(SliceKind.INVCAUSAL)) | (kind == int(SliceKind.BICAUSAL))
        rises_from = np.clip(d + 1, 0, sk)  # where the lower bound starts to rise
        grows_to = np.minimum(sq, sk)  # where the upper bound stops growing
        bounds = np.sort(np.concatenate([np.zeros_like(sk), rises_from, grows_to, sk], axis=1), axis=1)
        c0, c1 = bounds[:, :-1], bounds[:, 1:]  # three column ranges per slice, each one linear piece
        a = (lower & (c0 >= rises_from)).astype(np.int64)
        b = (upper & (c1 <= grows_to)).astype(np.int64)

        def rows_at(c):
            return np.where(lower, np.maximum(0, c - d), 0), np.where(upper, np.minimum(c + 1, sq), sq)

        lo0, hi0 = rows_at(c0)
        lo1, hi1 = rows_at(c1 - 1)
        keep = (c1 > c0) & (lo0 < hi0) & (lo1 < hi1)
        pieces = np.stack([c0 + ks, c1 + ks, lo0 + qs, hi0 + qs, a, b], axis=2)
        return pieces[keep]

    @_cached
    def merged_row_intervals(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flat ``(row, lo, hi)``: each row's allowed keys as disjoint ascending intervals."""
        pieces = self._disjoint_row_pieces()
        if pieces is None:
            return self._merged(by_row=True)
        r0, r1, lo0, hi0, a, b = pieces.T
        n = r1 - r0
        total = int(n.sum())
        local = np.arange(total, dtype=np.int64)
        local -= np.repeat(np.cumsum(n) - n, n)
        rows, lo, hi = np.repeat(r0, n), np.repeat(lo0, n), np.repeat(hi0, n)
        rows += local
        for v, slope in ((lo, a), (hi, b)):
            if slope.any():
                step = np.repeat(slope, n)
                step *= local
                v += step
        return rows, lo, hi

    @_cached
    def merged_col_intervals(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flat ``(col, lo, hi)``: each key column's allowed query rows as disjoint intervals."""
        return self._merged(by_row=False)

    @_cached
    def row_intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)`` int32 ``[Sq, K]``: row ``i`` attends ``∪_t [lo[i,t], hi[i,t])``; unused slots 0."""
        pieces = self._disjoint_row_pieces()
        if pieces is None:
            return _pad_intervals(self.seqlen_q, *self.merged_row_intervals())
        # one interval per row, straight from the pieces (no per-row int64 arrays)
        r0, r1, lo0, hi0, a, b = pieces.T
        return tuple(_piecewise_linear(self.seqlen_q, r0, r1, v0, slope).reshape(-1, 1)
                     for v0, slope in ((lo0, a), (hi0, b)))

    @_cached
    def col_intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)`` int32 ``[Sk, K]``: column ``j`` is attended by rows ``∪_t [lo[j,t], hi[j,t])``."""
        return _pad_intervals(self.seqlen_k, *self.merged_col_intervals())

    @property
    def area(self) -> int:
        pieces = self._disjoint_row_pieces()
        if pieces is None:
            _, lo, hi = self.merged_row_intervals()
            return int((hi - lo).sum())
        # a piece's interval widens by b - a per row: n rows of hi0 - lo0, plus (b - a) * (0 + ... + n - 1)
        r0, r1, lo0, hi0, a, b = pieces.T
        n = r1 - r0
        return int((n * (hi0 - lo0) + (b - a) * (n * (n - 1) // 2)).sum())

    @_cached
    def key_tile_areas(self, block_n: int) -> np.ndarray:
        """int64 ``[ceil(Sk / block_n)]``: allowed (query, key) pairs per key tile of ``block_n``
        keys, the work of a key-major program. O(S) from the row intervals (each column's count of
        attending rows by a difference array)."""
        bn = _check_block_size("block_n", block_n)
        _, lo, hi = self.merged_row_intervals()
        sk = self.seqlen_k
        per_col = np.cumsum(np.bincount(lo, minlength=sk + 1) - np.bincount(hi, minlength=sk + 1))[:sk]
        return np.add.reduceat(per_col, np.arange(0, sk, bn)) if sk else np.zeros(0, np.int64)

    def head_areas(self, num_heads_q: int) -> list[int]:
        return [self.area] * num_heads_q

    @_cached
    def row_segments(self) -> np.ndarray | None:
        """The row intervals as linear pieces (``_row_segments``), or None where a row has several."""
        pieces = self._disjoint_row_pieces()
        return pieces if pieces is not None else _row_segments(*self.merged_row_intervals())

    @_cached
    def tile_segments(self, block_m: int, block_n: int) -> tuple:
        """Per query tile of ``block_m`` rows its touched key tiles of ``block_n`` keys as maximal runs of
        full or of partial tiles: int64 ``(m, n0, n1)`` and bool ``full`` (``_tile_segments``), what
        ``block_tables`` lists one tile at a time."""
        bm = _check_block_size("block_m", block_m)
        bn = _check_block_size("block_n", block_n)
        pieces = self.row_segments()
        if pieces is None:
            return _tile_segments(*self.merged_row_intervals(), self.seqlen_q, self.seqlen_k, bm, bn)
        return _tile_segments(None, None, None, self.seqlen_q, self.seqlen_k, bm, bn, pieces,
                              self._piece_rows(False, bm) if len(pieces) else None)

    @_cached
    def _piece_rows(self, by_key: bool, block: int) -> tuple:
        """``_piece_rows`` of the row (``by_key``: the column) pieces at tiles of ``block`` rows (columns),
        shared by the tile segments of every tile size with that side."""
        if by_key:
            return _piece_rows(self._disjoint_col_pieces(), self.seqlen_k, block)
        return _piece_rows(self.row_segments(), self.seqlen_q, block)

    @_cached
    def key_tile_segments(self, block_m: int, block_n: int) -> tuple | None:
        """``tile_segments`` transposed: per key tile its touched query tiles as maximal runs of full or of
        partial tiles, int64 ``(n, m0, m1)`` and bool ``full``, from the columns' linear pieces (the same
        classification: a tile is full when every pair in range is allowed); None where the slices'
        key ranges overlap (``block_tables`` then lists them)."""
        bm = _check_block_size("block_m", block_m)
        bn = _check_block_size("block_n", block_n)
        pieces = self._disjoint_col_pieces()
        if pieces is None:
            return None
        return _tile_segments(None, None, None, self.seqlen_k, self.seqlen_q, bn, bm, pieces,
                              self._piece_rows(True, bn) if len(pieces) else None)

    @_cached
    def block_tables(self, block_m: int, block_n: int) -> BlockTables:
        """Classify every (query tile, key tile) as empty, partial or full, from the row intervals.

        Per row and interval ``[lo, hi)`` the key tiles it fully covers are
        ``[ceil(lo/bn), floor(hi/bn))`` (the ragged last tile counts when ``hi == Sk``) and the ones it
        touches ``[floor(lo/bn), ceil(hi/bn))``. A tile is full when all of its rows cover it, touched
        when any row does (``tile_segments``: no dense tile map, the cost follows the tiles visited).
        The key-major lists are ``key_tile_segments`` listed, else the query-major ones transposed.
        """
        bm = _check_block_size("block_m", block_m)
        bn = _check_block_size("block_n", block_n)
        Sq, Sk = self.seqlen_q, self.seqlen_k
        num_m, num_n = -(-Sq // bm), -(-Sk // bn)
        by_key = self.key_tile_segments(bm, bn)
        if by_key is not None:
            return BlockTables(bm, bn, num_m, num_n, *_segment_csr(self.tile_segments(bm, bn), num_m),
                               *_segment_csr(by_key, num_n))
        fm, fn, pm, pn = _split_pairs(*self.tile_segments(bm, bn))
        lists = []
        for major, minor, num in ((fm, fn, num_m), (pm, pn, num_m), (fn, fm, num_n), (pn, pm, num_n)):
            if num is num_n:  # the transpose: by key tile, query tiles ascending (a stable sort keeps them so)
                order = np.argsort(major.astype(np.uint16) if num_n < 1 << 16 else major, kind="stable")
                major, minor = major[order], minor[order]
            lists += _csr(major, minor, num)
        return BlockTables(bm, bn, num_m, num_n, *lists)


class BlockSparseMask(Mask):
    """Per-pattern block map over query/key blocks with explicit bounds (docs/masks.md §2)."""

    def __init__(self, q_block_bounds, k_block_bounds, block_map, *, name: str = "block_sparse", params: dict | None = None):
        self.q_block_bounds = self._check_bounds("q_block_bounds", q_block_bounds)
        self.k_block_bounds = self._check_bounds("k_block_bounds", k_block_bounds)
        bm = torch.as_tensor(block_map)
        if bm.dtype != torch.bool:
            raise ValueError(f"block_map must be a bool tensor, got dtype {bm.dtype}")
        if bm.dim() == 2:
            bm = bm[None]
        nq, nk = len(self.q_block_bounds) - 1, len(self.k_block_bounds) - 1
        if bm.dim() != 3 or bm.shape[1:] != (nq, nk):
            raise ValueError(f"block_map must have shape [P, {nq}, {nk}] to match the block bounds, got {tuple(bm.shape)}")
        if bm.shape[0] < 1:
            raise ValueError("block_map needs at least one pattern (P >= 1)")
        self.block_map = bm.cpu().contiguous()
        self.seqlen_q = int(self.q_block_bounds[-1])
        self.seqlen_k = int(self.k_block_bounds[-1])
        self.name = name
        self.params = dict(params or {})

    @staticmethod
    def _check_bounds(label: str, bounds) -> np.ndarray:
        b = np.asarray(torch.as_tensor(bounds).cpu().numpy() if isinstance(bounds, torch.Tensor) else bounds)
        if b.ndim != 1 or b.size < 2 or not np.issubdtype(b.dtype, np.integer):
            raise ValueError(f"{label} must be a 1-D integer list [0 = b0 < b1 < ... < bN = S] with N >= 1, got {bounds!r}")
        if b[0] != 0:
            raise ValueError(f"{label} must start at 0, got {int(b[0])}")
        bad = np.nonzero(np.diff(b) <= 0)[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{label} must be strictly increasing: bound {i} = {int(b[i])} >= bound {i + 1} = {int(b[i + 1])}")
        return b.astype(np.int64)

    def __repr__(self) -> str:
        return f"BlockSparseMask({self.describe()}, P={self.num_patterns}, blocks={tuple(self.block_map.shape[1:])})"

    @property
    def num_patterns(self) -> int:
        return int(self.block_map.shape[0])

    def pattern_of_head(self, num_heads_q: int) -> list[int]:
        """Pattern used by each query head: shared (P = 1) or one per group of ``Hq / P`` heads."""
        P = self.num_patterns
        if num_heads_q % P:
            raise ValueError(f"{P} mask patterns do not divide {num_heads_q} query heads")
        return [h // (num_heads_q // P) for h in range(num_heads_q)]

    @property
    def uniform_block(self) -> int | None:
        """The block size when every block but possibly the last has one size on both axes."""
        sizes = np.concatenate([np.diff(self.q_block_bounds)[:-1], np.diff(self.k_block_bounds)[:-1]])
        first = int(np.diff(self.q_block_bounds)[0])
        if sizes.size and not np.all(sizes == first):
            return None
        if np.diff(self.q_block_bounds)[-1] > first or np.diff(self.k_block_bounds)[-1] > first:
            return None
        return first

    @_cached
    def to_dense(self) -> torch.Tensor:
        """bool ``[P, Sq, Sk]``."""
        qs = torch.as_tensor(np.diff(self.q_block_bounds))
        ks = torch.as_tensor(np.diff(self.k_block_bounds))
        return self.block_map.repeat_interleave(qs, dim=1).repeat_interleave(ks, dim=2)

    @property
    def area(self) -> list[int]:
        """Allowed pairs per pattern (cached: harness rows ask for it per point)."""
        cache = self.__dict__.setdefault("_lowering_cache", {})
        if "area" not in cache:
            qs = np.diff(self.q_block_bounds).astype(np.int64)
            ks = np.diff(self.k_block_bounds).astype(np.int64)
            bm = self.block_map.numpy()
            # why per pattern: an int64 copy of a 128K-token, 64-pattern block map is ~2 GB
            cache["area"] = [int(qs @ (bm[p].astype(np.int64) @ ks)) for p in range(self.num_patterns)]
        return list(cache["area"])

    def head_areas(self, num_heads_q: int) -> list[int]:
        area = self.area
        return [area[p] for p in self.pattern_of_head(num_heads_q)]

    @_cached
    def row_segments(self) -> np.ndarray | None:
        """The row intervals as linear pieces (``_row_segments``), or None where a row has several."""
        pieces = self._disjoint_row_pieces()
        return pieces if pieces is not None else _row_segments(*self.merged_row_intervals())

    @_cached
    def block_tables(self, block_m: int, block_n: int) -> BlockTables:
        """Tile classification per pattern: a tile is full when every block it overlaps is kept,
        touched when any is (2-D prefix sums over the block map, ``O(P · (blocks + tiles))``)."""
        bm = _check_block_size("block_m", block_m)
        bn = _check_block_size("block_n", block_n)
        num_m, num_n = -(-self.seqlen_q // bm), -(-self.seqlen_k // bn)

        def block_span(bounds: np.ndarray, tile: int, num: int):
            starts = np.arange(num) * tile
            ends = np.minimum(starts + tile, bounds[-1])
            first = np.searchsorted(bounds, starts, side="right") - 1
            last = np.searchsorted(bounds, ends, side="left")  # exclusive block index
            return first, last

        qa, qb = block_span(self.q_block_bounds, bm, num_m)
        ka, kb = block_span(self.k_block_bounds, bn, num_n)
        m = self.block_map.numpy().astype(np.int64)
        pref = np.zeros((m.shape[0], m.shape[1] + 1, m.shape[2] + 1), dtype=np.int64)
        pref[:, 1:, 1:] = m.cumsum(1).cumsum(2)
        rect = pref[:, qb][:, :, kb] - pref[:, qa][:, :, kb] - pref[:, qb][:, :, ka] + pref[:, qa][:, :, ka]
        size = (qb - qa)[:, None] * (kb - ka)[None, :]
        return BlockTables.from_classification(bm, bn, rect == size[None], rect > 0)

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


def _segment_bounds(seg: np.ndarray, Sk: int, bm: int, bn: int, num_n: int):
    """``(t, ta, tb, fa, fb, weight)`` of ``_tile_lists`` from linear pieces: the tile bounds change
    only at a piece's start, a query-tile boundary, or where ``lo`` / ``hi`` cross a key-tile boundary
    (or ``hi`` reaches ``Sk``), so only those rows are evaluated."""
    r0, r1, lo0, hi0, a, b = seg.T
    cand = [r0, _progression((r0 // bm + 1) * bm, r1, bm)]
    for slope_of, v0 in ((a, lo0), (b, hi0)):
        moving = slope_of == 1
        if moving.any():
            for res in (0, 1):  # rows where the bound is = res (mod bn)
                cand.append(_progression(r0[moving] + (res - v0[moving]) % bn, r1[moving], bn))
    up = (b == 1) & (hi0 <= Sk) & (r0 + (Sk - hi0) < r1)
    cand.append(r0[up] + (Sk - hi0[up]))
    r = np.unique(np.concatenate(cand))
    piece = np.searchsorted(r0, r, side="right") - 1
    off = r - r0[piece]
    lo = lo0[piece] + a[piece] * off
    hi = hi0[piece] + b[piece] * off
    nxt = np.append(r[1:], np.iinfo(np.int64).max)
    weight = np.minimum(nxt, r1[piece]) - r
    t = r // bm
    ta, tb = lo // bn, -(-hi // bn)
    fa, fb = -(-lo // bn), np.where(hi == Sk, num_n, hi // bn)
    return t, ta, tb, fa, fb, weight


def _tile_lists(rows, lo, hi, Sq: int, Sk: int, bm: int, bn: int, segments: np.ndarray | None = None) -> tuple:
    """The full and partial ``(query tile, key tile)`` pairs of merged row intervals, without a dense map.

    Per query tile ``m`` the intervals become events along the key tiles: ``+1`` where an interval starts
    to touch a tile and ``-1`` past its last, and (weighted by how many rows share them) where it starts
    and stops covering whole tiles. Between two events of a tile the counts are constant: touched where
    the touch count is positive, full where the cover count equals the tile's rows. Consecutive rows
    whose four tile bounds agree are one weighted interval, so structured masks give a few events per
    tile; the cost is ``O(S + events log events + visited tiles)``. Returns the pairs as
    ``(full_m, full_n, part_m, part_n)``, sorted by ``m`` then ``n``."""
    num_n = -(-Sk // bn)
    if rows.size == 0:  # a mask that allows nothing
        return (np.zeros(0, np.int64),) * 4
    if segments is not None:
        t, ta, tb, fa, fb, weight = _segment_bounds(segments, Sk, bm, bn, num_n)
    else:
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
    # consecutive rows (pieces) with equal bounds are one weighted interval
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
    key = np.concatenate([t * width + ta, t * width + tb, t[covers] * width + fa[covers],
                          t[covers] * width + fb[covers]])
    d_touch = np.concatenate([np.ones_like(ta), -np.ones_like(tb), np.zeros(2 * int(covers.sum()), np.int64)])
    d_cover = np.concatenate([np.zeros(2 * ta.size, np.int64), weight[covers], -weight[covers]])
    order = np.argsort(key, kind="stable")
    key, d_touch, d_cover = key[order], d_touch[order], d_cover[order]
    at = np.flatnonzero(np.append(True, key[1:] != key[:-1]))  # one event position per distinct key
    key = key[at]
    touch = np.cumsum(np.add.reduceat(d_touch, at))  # every tile's events sum to 0: one running sum serves all
    cover = np.cumsum(np.add.reduceat(d_cover, at))
    m, n = key // width, key % width
    seg = np.flatnonzero(m[:-1] == m[1:])  # [n_i, n_{i+1}) within one query tile
    m_s, n0, n1 = m[seg], n[seg], n[seg + 1]
    rows_in_tile = np.minimum(bm, Sq - m_s * bm)
    is_full = cover[seg] == rows_in_tile
    is_part = (touch[seg] > 0) & ~is_full

    def expand(sel):
        length = (n1 - n0)[sel]
        tile = np.repeat(m_s[sel], length)
        start = np.repeat(n0[sel] - np.cumsum(length) + length, length)
        return tile, start + np.arange(int(length.sum()))

    return (*expand(is_full), *expand(is_part))


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

    def _slice_arrays(self) -> np.ndarray:
        """The slices as int64 ``[N, 5]`` rows ``(q_start, q_end, k_start, k_end, kind)``."""
        return np.asarray([tuple(int(x) for x in sl) for sl in self.slices], dtype=np.int64).reshape(-1, 5)

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

    @_cached
    def _disjoint_row_pieces(self) -> np.ndarray | None:
        """Where the slices' query ranges do not overlap (documents, per-document windows), the row
        intervals straight from the slices as ``_row_segments``' linear pieces (empty rows left out):
        no per-row pass at all. None where some query ranges overlap (their rows must be merged)."""
        sl = self._slice_arrays()
        if not len(sl):
            return None
        sl = sl[np.argsort(sl[:, 0], kind="stable")]
        if np.any(sl[1:, 0] < sl[:-1, 1]):
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
        return _pad_intervals(self.seqlen_q, *self.merged_row_intervals())

    @_cached
    def col_intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)`` int32 ``[Sk, K]``: column ``j`` is attended by rows ``∪_t [lo[j,t], hi[j,t])``."""
        return _pad_intervals(self.seqlen_k, *self.merged_col_intervals())

    @property
    def area(self) -> int:
        _, lo, hi = self.merged_row_intervals()
        return int((hi - lo).sum())

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
    def block_tables(self, block_m: int, block_n: int) -> BlockTables:
        """Classify every (query tile, key tile) as empty, partial or full, from the row intervals.

        Per row and interval ``[lo, hi)`` the key tiles it fully covers are
        ``[ceil(lo/bn), floor(hi/bn))`` (the ragged last tile counts when ``hi == Sk``) and the ones it
        touches ``[floor(lo/bn), ceil(hi/bn))``. A tile is full when all of its rows cover it, touched
        when any row does (``_tile_lists``: no dense tile map, the cost follows the tiles visited).
        """
        bm = _check_block_size("block_m", block_m)
        bn = _check_block_size("block_n", block_n)
        Sq, Sk = self.seqlen_q, self.seqlen_k
        num_m, num_n = -(-Sq // bm), -(-Sk // bn)
        fm, fn, pm, pn = _tile_lists(*self.merged_row_intervals(), Sq, Sk, bm, bn, self.row_segments())
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

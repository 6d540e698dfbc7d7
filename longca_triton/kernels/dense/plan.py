"""Tile plans for the dense structured-mask kernels: mask metadata, reshaped for the loops.

The mask IR (``longca_triton.masks.RangeMask``) lowers to two things this module consumes:

* per-row intervals ``lo, hi: int32 [Sq, K]`` -- query row ``i`` attends key ``j`` iff
  ``OR_t lo[i, t] <= j < hi[i, t]`` (unused slots are ``lo == hi == 0``);
* block tables for a tile size ``(block_m, block_n)`` -- per query tile the CSR lists of key tiles
  that are *full* (every in-range pair allowed) and *partial*, and the key-major transpose.

The kernels do not walk those index lists one tile at a time. A list of key tiles is almost always
a handful of contiguous runs (causal: one run; a document: one run; share_question: question + own
document), and a loop over a contiguous run has an affine address, which the software pipeliner
prefetches without an indirect load. So each CSR list becomes a CSR list of runs
``[run_start, run_end)``. Everything here is ``O(S + tiles)``; nothing is ``S x S``.

Two fix-ups make the kernels' inner loops cheaper:

* Forward / dQ (query-major): when ``Sk`` is not a multiple of ``block_n``, the last key tile can
  be "full" and still hold out-of-range keys. It is moved to the partial list, whose element mask
  (from ``hi <= Sk``) drops those keys, so the full-tile loop carries no bounds check at all.
  (In dK/dV out-of-range rows are zero-filled by the tensor-descriptor loads and contribute zero.)
* Launch order: tiles are sorted by work, heaviest first, so documents' uneven rows do not leave
  a long tail of one busy SM (longest-processing-time-first scheduling).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from longca_triton.kernels.core.plan_cache import PlanCache
from longca_triton.masks.ir import join_segments

__all__ = ["TilePlan", "MaskArrays", "build_tile_plan", "get_tile_plan", "mask_arrays"]


@dataclasses.dataclass(frozen=True)
class MaskArrays:
    """Host-side (numpy) lowering of a mask: what :func:`build_tile_plan` needs."""

    seqlen_q: int
    seqlen_k: int
    lo: np.ndarray  # int32 [Sq, K]
    hi: np.ndarray  # int32 [Sq, K]
    # callable (block_m, block_n) -> BlockTables-like object (numpy int32 fields)
    block_tables: object
    # callables (block_m, block_n) -> ``RangeMask.tile_segments`` / ``key_tile_segments``, or None
    tile_segments: object = None
    key_tile_segments: object = None


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Device-resident metadata for one (mask, block_m, block_n, device).

    ``q_*`` is query-major (forward and dQ), ``k_*`` key-major (dK/dV). Every ``*_ptr`` is a CSR
    offset array into the matching ``*_start``/``*_end`` run arrays (int32, on the device).
    """

    seqlen_q: int
    seqlen_k: int
    block_m: int
    block_n: int
    num_m: int
    num_n: int
    num_iv: int  # K, padded to a power of two (padding slots are empty intervals)
    lo: torch.Tensor  # int32 [Sq, num_iv]
    hi: torch.Tensor  # int32 [Sq, num_iv]
    q_order: torch.Tensor  # int32 [num_m]   query tiles, heaviest first
    q_full: tuple  # (ptr [num_m+1], start [R], end [R])
    q_part: tuple
    k_order: torch.Tensor  # int32 [num_n]
    k_full: tuple
    k_part: tuple
    area_tiles: int  # number of non-empty tiles (for reports)

    def q_tensors(self) -> list:
        """The query-major metadata as a flat list (custom-op friendly)."""
        return [self.lo, self.hi, self.q_order, *self.q_full, *self.q_part]

    def k_tensors(self) -> list:
        return [self.lo, self.hi, self.k_order, *self.k_full, *self.k_part]


def _np32(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a)).astype(np.int32)


def _csr_rows(ptr: np.ndarray) -> np.ndarray:
    """Row id of every CSR entry."""
    counts = np.diff(ptr.astype(np.int64))
    return np.repeat(np.arange(len(counts), dtype=np.int64), counts)


def _to_runs(ptr: np.ndarray, idx: np.ndarray, num_rows: int):
    """CSR list of ascending tile indices -> CSR list of contiguous runs [start, end)."""
    idx = idx.astype(np.int64)
    rows = _csr_rows(ptr)
    n = len(idx)
    if n == 0:
        return np.zeros(num_rows + 1, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32)
    new_run = np.ones(n, dtype=bool)
    new_run[1:] = (idx[1:] != idx[:-1] + 1) | (rows[1:] != rows[:-1])
    starts = np.flatnonzero(new_run)
    lengths = np.diff(np.append(starts, n))
    run_start = idx[starts]
    run_end = run_start + lengths
    run_ptr = np.zeros(num_rows + 1, np.int64)
    np.cumsum(np.bincount(rows[starts], minlength=num_rows), out=run_ptr[1:])
    return _np32(run_ptr), _np32(run_start), _np32(run_end)


def _move_ragged_last(full_ptr, full_idx, part_ptr, part_idx, num_rows, last):
    """Move entry ``last`` from the full lists to the partial lists (kept ascending per row)."""
    f_rows = _csr_rows(full_ptr)
    moved = full_idx == last
    if not moved.any():
        return full_ptr, full_idx, part_ptr, part_idx
    keep = ~moved
    nf_rows, nf_idx = f_rows[keep], full_idx[keep]
    p_rows = np.concatenate([_csr_rows(part_ptr), f_rows[moved]])
    p_idx = np.concatenate([part_idx.astype(np.int64), full_idx[moved].astype(np.int64)])
    order = np.lexsort((p_idx, p_rows))
    p_rows, p_idx = p_rows[order], p_idx[order]

    def ptr_of(rows):
        out = np.zeros(num_rows + 1, np.int64)
        np.cumsum(np.bincount(rows, minlength=num_rows), out=out[1:])
        return out

    return ptr_of(nf_rows), nf_idx, ptr_of(p_rows), p_idx


def _move_ragged_last_segments(segments, last: int) -> tuple:
    """``_move_ragged_last`` on ``RangeMask.tile_segments``: key tile ``last`` taken out of the full runs
    (a full run ending there keeps the tiles before it) into a partial run of its own, joined to a
    partial run just before it."""
    m, n0, n1, full = segments
    cut = full & (n1 == last + 1)
    if not cut.any():
        return segments
    rest, moved = ~cut | (n0 < last), np.flatnonzero(cut)
    m = np.concatenate([m[rest], m[moved]])
    n0 = np.concatenate([n0[rest], np.full(moved.size, last)])
    n1 = np.concatenate([np.where(cut, last, n1)[rest], n1[moved]])
    full = np.concatenate([full[rest], np.zeros(moved.size, dtype=bool)])
    order = np.lexsort((n0, m))
    return join_segments(*(x[order] for x in (m, n0, n1, full)))


def _segment_runs(segments, num_rows: int):
    """The runs of ``RangeMask.tile_segments`` / ``key_tile_segments`` (maximal per class: the runs
    already) as ``(full (ptr, start, end), partial (ptr, start, end), full tiles per row, partial tiles per row)``."""
    m, n0, n1, full = segments
    by_class = m * 2 + ~full  # per row its full, then its partial runs
    runs = np.bincount(by_class, minlength=2 * num_rows).reshape(num_rows, 2)
    tiles = np.bincount(by_class, weights=n1 - n0, minlength=2 * num_rows).reshape(num_rows, 2).astype(np.int64)
    order = np.argsort(~full, kind="stable")  # the full runs, then the partial ones, each in row order
    start, end, split = n0[order], n1[order], int(full.sum())
    ptr = np.zeros((2, num_rows + 1), np.int64)
    np.cumsum(runs.T, axis=1, out=ptr[:, 1:])
    return ((ptr[0], start[:split], end[:split]), (ptr[1], start[split:], end[split:]), tiles[:, 0], tiles[:, 1])


def _tiles_per_row(ptr: np.ndarray) -> np.ndarray:
    """Entries per row of a CSR list."""
    return np.diff(ptr.astype(np.int64))


def _heavy_first(num_full: np.ndarray, num_part: np.ndarray) -> np.ndarray:
    """Rows (tiles) by their full and partial tile counts, heaviest first.
    A partial tile costs a little more than a full one (mask math), hence 1.25."""
    work = num_full * 4 + num_part * 5
    if work.size and work.max() < 1 << 15:
        work = work.astype(np.int16)  # a stable sort of 16-bit keys is a radix sort
    return _np32(np.argsort(-work, kind="stable"))


def mask_arrays(mask) -> MaskArrays:
    """Read what the kernels need off a ``RangeMask`` (or anything with the same methods)."""
    for attr in ("seqlen_q", "seqlen_k", "row_intervals", "block_tables"):
        if not hasattr(mask, attr):
            raise TypeError(
                f"dense attention needs a RangeMask-like mask with .{attr}; got {type(mask).__name__}"
            )
    lo, hi = mask.row_intervals()
    return MaskArrays(int(mask.seqlen_q), int(mask.seqlen_k), np.asarray(lo), np.asarray(hi), mask.block_tables,
                      getattr(mask, "tile_segments", None), getattr(mask, "key_tile_segments", None))


def row_tensors(arrays: MaskArrays, device) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(num_iv, lo, hi)``: the row intervals as the kernels read them, int32 ``[Sq, num_iv]`` on
    ``device``, ``num_iv`` a power of two (the kernels unroll over it; padding slots are empty) and
    every bound clamped into ``[0, Sk]``. One copy per mask and device serves all its plans (on the
    host none where the mask's arrays are that already)."""
    sq, sk = arrays.seqlen_q, arrays.seqlen_k
    lo, hi = np.asarray(arrays.lo), np.asarray(arrays.hi)
    if lo.ndim != 2 or lo.shape != hi.shape or lo.shape[0] != sq:
        raise ValueError(f"row intervals must be [Sq={sq}, K]; got lo {lo.shape}, hi {hi.shape}")
    k = max(1, lo.shape[1])
    num_iv = 1 << (k - 1).bit_length()
    if (lo.dtype == hi.dtype == np.int32 and lo.shape[1] == num_iv and lo.flags.c_contiguous
            and hi.flags.c_contiguous and lo.min() >= 0 and hi.max() <= sk and (hi >= lo).all()):
        out_lo, out_hi = lo, hi
    else:
        out_lo, out_hi = np.zeros((sq, num_iv), np.int32), np.zeros((sq, num_iv), np.int32)
        # in place on named arrays (an unnamed 128K-row temporary costs numpy a slow check on some hosts)
        np.clip(lo, 0, sk, out=out_lo[:, :lo.shape[1]], casting="unsafe")
        np.clip(hi, 0, sk, out=out_hi[:, :hi.shape[1]], casting="unsafe")
        np.maximum(out_hi, out_lo, out=out_hi)
    dev = torch.device(device)
    return num_iv, torch.from_numpy(out_lo).to(dev), torch.from_numpy(out_hi).to(dev)


def _list_runs(bt, major: str, num_rows: int, last=None):
    """``(full runs, partial runs, full tiles per row, partial tiles per row)`` of a ``BlockTables``' query-major
    (``major="q"``) or key-major (``"k"``) lists; ``last``: a key tile moved from the full lists to the partial
    ones (``_move_ragged_last``)."""
    f_ptr, f_idx, p_ptr, p_idx = (_np32(getattr(bt, f"{major}_{kind}")) for kind in ("full_ptr", "full_idx",
                                                                                     "part_ptr", "part_idx"))
    if last is not None:
        f_ptr, f_idx, p_ptr, p_idx = _move_ragged_last(f_ptr, f_idx, p_ptr, p_idx, num_rows, last)
    return (_to_runs(f_ptr, f_idx, num_rows), _to_runs(p_ptr, p_idx, num_rows),
            _tiles_per_row(f_ptr), _tiles_per_row(p_ptr))


def build_tile_plan(arrays: MaskArrays, block_m: int, block_n: int, device, rows=None) -> TilePlan:
    """Lower a mask's arrays to a :class:`TilePlan` on ``device`` (host work, then one copy);
    ``rows``: :func:`row_tensors` already built for this mask and device. The runs come straight from
    the mask's tile segments where it has them, else from its block tables' per-tile lists."""
    sq, sk = arrays.seqlen_q, arrays.seqlen_k
    num_iv, lo_t, hi_t = rows if rows is not None else row_tensors(arrays, device)
    num_m, num_n = -(-sq // block_m), -(-sk // block_n)
    last = num_n - 1 if sk % block_n else None
    q_seg, k_seg = (None if f is None else f(block_m, block_n)
                    for f in (arrays.tile_segments, arrays.key_tile_segments))
    bt = arrays.block_tables(block_m, block_n) if q_seg is None or k_seg is None else None
    if q_seg is not None:
        q_full, q_part, nf, npart = _segment_runs(q_seg if last is None else _move_ragged_last_segments(q_seg, last),
                                                  num_m)
    else:
        q_full, q_part, nf, npart = _list_runs(bt, "q", num_m, last)
    k_full, k_part, kf, kpart = _segment_runs(k_seg, num_n) if k_seg is not None else _list_runs(bt, "k", num_n)

    dev = torch.device(device)

    def t(a):
        return torch.from_numpy(_np32(a)).to(dev)

    return TilePlan(
        seqlen_q=sq, seqlen_k=sk, block_m=block_m, block_n=block_n, num_m=num_m, num_n=num_n,
        num_iv=num_iv, lo=lo_t, hi=hi_t,
        q_order=t(_heavy_first(nf, npart)),
        q_full=tuple(t(x) for x in q_full), q_part=tuple(t(x) for x in q_part),
        k_order=t(_heavy_first(kf, kpart)),
        k_full=tuple(t(x) for x in k_full), k_part=tuple(t(x) for x in k_part),
        area_tiles=int(nf.sum() + npart.sum()),
    )


_CACHE = PlanCache(64)


def get_tile_plan(mask, block_m: int, block_n: int, device) -> TilePlan:
    """Cached :func:`build_tile_plan`, keyed on the mask's content (``plan_cache.content_key``, else the
    mask object), tile sizes and device: an equal mask built again gets the same plan.

    Call it once outside any timed region: the first call per key does host work and a copy.
    """
    def build(dev):
        arrays = mask_arrays(mask)
        rows = _CACHE.get(mask, ("rows",), dev, lambda d: row_tensors(arrays, d))
        return build_tile_plan(arrays, int(block_m), int(block_n), dev, rows)

    return _CACHE.get(mask, (int(block_m), int(block_n)), device, build)

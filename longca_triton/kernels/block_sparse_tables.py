"""Tile tables for the block-sparse kernels, built on the GPU from a ``BlockSparseMask``.

A ``BlockSparseMask`` is ``(q_bounds [Nq+1], k_bounds [Nk+1], block_map [P, Nq, Nk])``. The kernels
never look at the block map itself; they walk two lists built from it with a handful of torch ops
on the device (``nonzero`` / ``cumsum`` / ``repeat_interleave``; no Python loop over blocks):

Query-major (forward and dQ), for a tile size ``(tile_rows, tile_cols)``:

* row tiles: every query block ``[q_bounds[i], q_bounds[i+1])`` is cut into sub-tiles of
  ``tile_rows`` rows (the last one short): ``row_start[t], row_end[t], row_block[t]``. All rows of a
  sub-tile belong to one block, so they share one list of keys.
* column lists: per (pattern ``p``, query block ``i``) the kept key blocks, merged into runs of
  consecutive kept blocks (a run is one contiguous key range), each run cut into sub-tiles of
  ``tile_cols`` keys: ``col_start[e], col_end[e]`` for ``e`` in ``ptr[p*Nq + i] : ptr[p*Nq + i + 1]``.
  Merging runs first means a ragged tail costs once per run, not once per block.
* ``order``: row tiles sorted by their total work over patterns, heaviest first.

Key-major (dK/dV) is the same construction on the transposed map: key blocks cut into sub-tiles of
keys, and per (pattern, key block) the runs of kept *query* blocks cut into sub-tiles of queries.

For uniform blocks whose size is a multiple of the tile, every sub-tile is full and the kernels
compile the tail mask away (``even_cols``). Everything is ``O(P · Nq · Nk)`` bits in and
``O(kept tiles)`` int32 out; build once per (mask, tile sizes, device), outside any timed region.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from .plan_cache import PlanCache

__all__ = ["SideTables", "build_side_tables", "get_side_tables", "table_build_ms"]


@dataclasses.dataclass(frozen=True)
class SideTables:
    """One direction (query-major or key-major) of a block-sparse mask at one tile size.

    "rows" are the side a program owns (query rows for the forward, keys for dK/dV), "cols" the
    side it loops over. All tensors are int32 on the device.
    """

    tile_rows: int
    tile_cols: int
    num_row_blocks: int  # Nq (query-major) or Nk (key-major)
    num_patterns: int
    row_start: torch.Tensor  # [T]  first row of each row tile
    row_end: torch.Tensor  # [T]  one past its last row (inside its block)
    row_block: torch.Tensor  # [T]  its block index
    order: torch.Tensor  # [T]  row tiles, heaviest first
    ptr: torch.Tensor  # [P * num_row_blocks + 1]  CSR offsets into col_start / col_end
    col_start: torch.Tensor  # [E]
    col_end: torch.Tensor  # [E]
    even_rows: bool  # every row tile is exactly tile_rows long
    even_cols: bool  # every column tile is exactly tile_cols long
    build_ms: float  # wall time of the build (device synchronised)

    @property
    def num_tiles(self) -> int:
        return int(self.row_start.numel())

    @property
    def num_entries(self) -> int:
        return int(self.col_start.numel())

    def lists(self) -> list[torch.Tensor]:
        return [self.row_start, self.row_end, self.row_block, self.order, self.ptr,
                self.col_start, self.col_end]


def _chunk(lo: torch.Tensor, hi: torch.Tensor, tile: int):
    """Cut ranges ``[lo, hi)`` into pieces of ``tile``: returns (owner range, start, end) per piece."""
    n = torch.div(hi - lo + tile - 1, tile, rounding_mode="floor")  # [R] pieces per range
    total = int(n.sum().item())
    owner = torch.repeat_interleave(torch.arange(lo.numel(), device=lo.device), n, output_size=total)
    first = torch.cumsum(n, 0) - n
    k = torch.arange(total, device=lo.device) - first[owner]
    start = lo[owner] + k * tile
    end = torch.minimum(start + tile, hi[owner])
    return owner, start, end, n


def build_side_tables(row_bounds, col_bounds, block_map: torch.Tensor, tile_rows: int,
                      tile_cols: int, device) -> SideTables:
    """Tables for programs owning row tiles of ``tile_rows`` and looping over column tiles.

    ``row_bounds [R+1]``, ``col_bounds [C+1]`` (ints), ``block_map [P, R, C]`` bool (any device).
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    rb = torch.as_tensor(np.asarray(row_bounds, dtype=np.int64)).to(dev)
    cb = torch.as_tensor(np.asarray(col_bounds, dtype=np.int64)).to(dev)
    bm = block_map.to(dev, non_blocking=True)
    P, R, C = bm.shape

    # row tiles: every block cut into tile_rows pieces
    _, row_start, row_end, _ = _chunk(rb[:-1], rb[1:], tile_rows)
    row_blocks = torch.repeat_interleave(
        torch.arange(R, device=dev),
        torch.div(rb[1:] - rb[:-1] + tile_rows - 1, tile_rows, rounding_mode="floor"))

    # runs of consecutive kept column blocks, in (pattern, row, col) order
    prev = torch.nn.functional.pad(bm[:, :, :-1], (1, 0), value=False)
    nxt = torch.nn.functional.pad(bm[:, :, 1:], (0, 1), value=False)
    run_first = torch.nonzero((bm & ~prev).reshape(-1)).squeeze(1)  # flat index of each run start
    run_last = torch.nonzero((bm & ~nxt).reshape(-1)).squeeze(1)  # ... and of its last block
    run_row = torch.div(run_first, C, rounding_mode="floor")  # p * R + r
    lo = cb[run_first % C]
    hi = cb[run_last % C + 1]
    _, col_start, col_end, pieces = _chunk(lo, hi, tile_cols)

    counts = torch.zeros(P * R, dtype=torch.int64, device=dev)
    counts.index_add_(0, run_row, pieces)
    ptr = torch.zeros(P * R + 1, dtype=torch.int64, device=dev)
    ptr[1:] = torch.cumsum(counts, 0)
    work = counts.view(P, R).sum(0)[row_blocks] * (row_end - row_start)  # per row tile
    order = torch.argsort(work, descending=True, stable=True)

    rsz = np.diff(np.asarray(row_bounds, dtype=np.int64))
    csz = np.diff(np.asarray(col_bounds, dtype=np.int64))
    i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    out = SideTables(
        tile_rows=int(tile_rows), tile_cols=int(tile_cols), num_row_blocks=int(R), num_patterns=int(P),
        row_start=i32(row_start), row_end=i32(row_end), row_block=i32(row_blocks), order=i32(order),
        ptr=i32(ptr), col_start=i32(col_start), col_end=i32(col_end),
        even_rows=bool(np.all(rsz % tile_rows == 0)), even_cols=bool(np.all(csz % tile_cols == 0)),
        build_ms=0.0,
    )
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return dataclasses.replace(out, build_ms=(time.perf_counter() - t0) * 1e3)


_CACHE = PlanCache(64)


def get_side_tables(mask, major: str, tile_rows: int, tile_cols: int, device) -> SideTables:
    """Cached tables for ``mask`` (``major`` = "q" for forward/dQ, "k" for dK/dV).

    The cache keeps the mask object alive with its entry, so its ``id`` cannot be reused meanwhile.
    """
    if major not in ("q", "k"):
        raise ValueError(f"major must be 'q' or 'k', got {major!r}")

    def build(dev):
        if major == "q":
            return build_side_tables(mask.q_block_bounds, mask.k_block_bounds, mask.block_map,
                                     tile_rows, tile_cols, dev)
        return build_side_tables(mask.k_block_bounds, mask.q_block_bounds,
                                 mask.block_map.transpose(1, 2).contiguous(), tile_rows, tile_cols, dev)

    return _CACHE.get(mask, (major, int(tile_rows), int(tile_cols)), device, build)


def table_build_ms(mask, tile_sizes: dict, device, repeats: int = 5) -> dict:
    """Median wall time (ms) of building each table from scratch (no cache), per direction.

    ``tile_sizes``: ``{"fwd": (rows, cols), "dq": (rows, cols), "dkdv": (rows, cols)}`` as in a
    resolved config (``block_sparse.tile_sizes(cfg)``). The first build (allocator warm-up) is dropped.
    """
    out = {}
    for name, (tr, tc) in tile_sizes.items():
        major = "k" if name == "dkdv" else "q"
        bm = mask.block_map if major == "q" else mask.block_map.transpose(1, 2).contiguous()
        rows, cols = ((mask.q_block_bounds, mask.k_block_bounds) if major == "q"
                      else (mask.k_block_bounds, mask.q_block_bounds))
        times = [build_side_tables(rows, cols, bm, tr, tc, device).build_ms for _ in range(repeats + 1)]
        out[name] = float(np.median(times[1:]))
    return out

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
* ``order``: row tiles sorted by their total work over patterns, heaviest first (``order[:T]``), then
  for each pattern ``p`` the row tiles sorted by that pattern's work alone (``order[T * (1 + p):][:T]``:
  the dK/dV kernel's ``PATTERN_ORDER``, where a KV head's programs walk one pattern's lists). A tile's work
  is its list's entries times its valid rows, or (``by_steps``) its entries alone: a short row tile runs
  the same steps as a full one, and the tiles of one block (one list) then stay next to each other.

Packed column lists (``pack_cols``, variable blocks): cutting each run into tiles leaves a ragged
tail per run, a whole tile's work for a fraction of its keys (mean-256 blocks at 32K, density 0.3:
the tiles' area is 1.23x the kept area at 64 x 64). Packed, a list's runs are laid end to end and
cut into tiles of ``tile_cols`` *kept* keys, so only the list's last tile is short (1.13x there,
what the row tiles' own tails leave). A packed tile may cross from one run into the next; when
every column block is at least ``tile_cols`` long it crosses at most once, and entry ``e`` reads::

    key j of the tile (0 <= j < tile_cols):  start + j  if start + j < end  else  next + j
    valid:                                   j < count

(``next`` = the second run's first key minus the keys taken from the first). An unpacked table
carries the same four arrays with ``next = start`` and ``count = end - start``, so the formula holds
for every table; the kernels switch to it (gathered rows instead of contiguous tiles) only where a
table says ``packed``. Every packed entry but a list's last is full, so the kernels read a list's
last ``count`` once and take ``tile_cols`` for the others (``core.packed_count``).

Tail row tiles (``tail_rows``, variable blocks): a block of ``L`` rows cut into ``tile_rows`` pieces
ends in a short piece of ``r = L mod tile_rows`` rows that costs a whole tile. With a tail size
``t < tile_rows`` the rows split into two tables over the same lists: ``part="big"`` keeps the
``tile_rows`` pieces (a remainder ``r > t`` stays one short big piece) and ``part="tail"`` holds the
remainders ``0 < r <= t`` as pieces of ``t`` rows, run by a second launch with ``t``-row tiles. The
big tiles keep the large tile's efficiency; a remainder wastes less than ``t`` rows either way.

Short entries last (``short_cols``, unpacked lists only; variable blocks' dQ pass): a run's last tile
holds ``L mod tile_cols`` keys, a whole tile's work for a fraction of them. With ``short_cols < tile_cols``
each list is reordered so its entries of at most ``short_cols`` columns come after all the others (each
part in its original order), and ``col_split[l]`` is list ``l``'s first short entry (``ptr[l + 1]`` when it
has none): a kernel walks the long entries with ``tile_cols`` tiles and the short ones with
``short_cols`` tiles, so a remainder of at most ``short_cols`` keys wastes less than ``short_cols``.

Full entries first (``full_first``, ragged lists, packed or not; variable blocks' dK/dV passes): a list's entries
that are one contiguous whole tile (``end - start == tile_cols``: inside one run, every column valid) come before
the others (each part in its original order), and ``col_full[l]`` is where the rest starts. A kernel walks the
first part as it walks an even, unpacked list (no row masks, contiguous rows: the stats by a TMA box) and only the
rest through the packed / ragged path. The rest keeps the list's last entry last, so ``core.packed_count``'s rule
(only a list's last entry may be short) still holds. With ``short_cols`` too, the short entries stay last: whole
entries, then the other long ones, then the short ones (``col_full <= col_split``).

Key-major (dK/dV) is the same construction on the transposed map: key blocks cut into sub-tiles of
keys, and per (pattern, key block) the runs of kept *query* blocks cut into sub-tiles of queries.

For uniform blocks whose size is a multiple of the tile, every sub-tile is full and the kernels
compile the tail mask away (``even_cols``). Everything is ``O(P · Nq · Nk)`` bits in and
``O(kept tiles)`` int32 out; build once per (mask, tile sizes, device), outside any timed region.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import numpy as np
import torch

from longca_triton.kernels.core.plan_cache import PlanCache

__all__ = ["SideTables", "build_side_tables", "get_side_tables", "table_build_ms", "tables_for"]


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
    order: torch.Tensor  # [(1 + P) * T]  row tiles, heaviest first: over all patterns, then per pattern
    ptr: torch.Tensor  # [P * num_row_blocks + 1]  CSR offsets into col_start / col_end
    col_start: torch.Tensor  # [E]  first column of the tile
    col_end: torch.Tensor  # [E]  one past the last column of its first run piece
    col_next: torch.Tensor  # [E]  column of tile offset j >= end - start is next + j (packed), else start
    col_count: torch.Tensor  # [E]  valid columns of the tile
    even_rows: bool  # every row tile is exactly tile_rows long
    even_cols: bool  # every column tile is exactly tile_cols long
    build_ms: float  # wall time of the build (device synchronised)
    packed: bool = False  # column tiles may cross from one run of kept blocks into the next
    short_cols: int = 0  # with col_split: entries of at most this many columns last in each list
    col_split: Optional[torch.Tensor] = None  # [P * num_row_blocks]  first short entry of each list
    col_full: Optional[torch.Tensor] = None  # [P * num_row_blocks]  first entry that is not one whole contiguous tile

    @property
    def full_first(self) -> bool:
        """Whether each list's whole contiguous entries come first (``col_full``)."""
        return self.col_full is not None

    @property
    def num_tiles(self) -> int:
        return int(self.row_start.numel())

    @property
    def num_entries(self) -> int:
        return int(self.col_start.numel())

    def lists(self) -> list[torch.Tensor]:
        return [self.row_start, self.row_end, self.row_block, self.order, self.ptr,
                self.col_start, self.col_end, self.col_next, self.col_count]

    def without_rows(self) -> "SideTables":
        """The same lists with no row tiles: a launch over it runs no program."""
        return dataclasses.replace(self, **{f: getattr(self, f)[:0] for f in ("row_start", "row_end", "row_block",
                                                                                "order")})

    def columns(self, e: int) -> list[int]:
        """The columns of list entry ``e`` (host side; for tests and tools)."""
        start, end, nxt, count = (int(t[e]) for t in (self.col_start, self.col_end, self.col_next, self.col_count))
        return [start + j if start + j < end else nxt + j for j in range(count)]


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


def _pack_runs(lo, hi, run_row, num_lists: int, tile: int):
    """Runs ``[lo, hi)`` of lists ``run_row`` (sorted by list, ascending inside one) laid end to end
    per list and cut into ``tile`` kept columns: ``(start, end, next, count, tiles per list)``.
    Every run must be at least ``tile`` long (a tile then crosses at most one run boundary)."""
    dev = lo.device
    length = hi - lo  # [R]
    total = torch.zeros(num_lists, dtype=torch.int64, device=dev).index_add_(0, run_row, length)
    tiles = torch.div(total + tile - 1, tile, rounding_mode="floor")  # [L]
    # a virtual axis: list l owns [base[l], base[l] + tiles[l] * tile), its runs end to end from base[l]
    base = torch.cumsum(tiles * tile, 0) - tiles * tile
    list_first = torch.cumsum(total, 0) - total  # where list l starts among all runs' columns
    run_v = base[run_row] + (torch.cumsum(length, 0) - length) - list_first[run_row]  # [R]
    owner, _, _, _ = _chunk(torch.zeros_like(tiles), tiles, 1)  # [E] the list of each tile
    k = torch.arange(owner.numel(), device=dev) - (torch.cumsum(tiles, 0) - tiles)[owner]
    v0 = base[owner] + k * tile
    r1 = torch.searchsorted(run_v, v0, right=True) - 1  # the run holding the tile's first column
    start = lo[r1] + (v0 - run_v[r1])
    end = torch.minimum(hi[r1], start + tile)
    count = torch.minimum(total[owner] - k * tile, torch.full_like(k, tile))
    crosses = (end - start) < count
    r2 = torch.clamp(r1 + 1, max=max(lo.numel() - 1, 0))
    nxt = torch.where(crosses, lo[r2] - (end - start), start)
    return start, end, nxt, count, tiles


def _row_pieces(rb, tile_rows: int, part: str, tail_rows: int):
    """Row tiles of blocks ``[rb[i], rb[i+1])``: ``(block, start, end, piece size)`` (module docstring)."""
    lo, hi = rb[:-1], rb[1:]
    if part == "all":
        owner, start, end, _ = _chunk(lo, hi, tile_rows)
        return owner, start, end, tile_rows
    whole = lo + torch.div(hi - lo, tile_rows, rounding_mode="floor") * tile_rows  # end of the whole pieces
    small = (hi - whole) <= tail_rows  # the remainder (possibly none) goes to the tail table
    if part == "big":
        owner, start, end, _ = _chunk(lo, torch.where(small, whole, hi), tile_rows)
        return owner, start, end, tile_rows
    owner, start, end, _ = _chunk(whole, torch.where(small, hi, whole), tail_rows)
    return owner, start, end, tail_rows


def build_side_tables(row_bounds, col_bounds, block_map: torch.Tensor, tile_rows: int,
                      tile_cols: int, device, pack_cols: bool = False, part: str = "all",
                      tail_rows: int = 0, short_cols: int = 0, by_steps: bool = False,
                      full_first: bool = False) -> SideTables:
    """Tables for programs owning row tiles of ``tile_rows`` and looping over column tiles.

    ``row_bounds [R+1]``, ``col_bounds [C+1]`` (ints), ``block_map [P, R, C]`` bool (any device).
    ``pack_cols``: pack each list's runs (module docstring) where that changes anything (some run
    length is not a multiple of ``tile_cols``) and is possible (every column block at least
    ``tile_cols`` long); the result says whether it did (``packed``). ``part`` ("all", "big", "tail")
    and ``tail_rows``: the row tiles of one of the two launches of tail row tiles (module docstring);
    the tail table's ``tile_rows`` is ``tail_rows``. ``short_cols`` (``0 < short_cols < tile_cols``): each
    list's entries of at most that many columns last, ``col_split`` where they start (module docstring);
    a packed table ignores it (only its lists' last entries are short). ``by_steps``: ``order`` by each tile's
    list entries alone (module docstring). ``full_first``: each list's contiguous whole-tile entries first,
    ``col_full`` where the others start (module docstring); an even table ignores it (every entry is whole).
    """
    if short_cols and not 0 < short_cols < tile_cols:
        raise ValueError(f"short_cols must be 0 or in (0, tile_cols={tile_cols}); got {short_cols}")
    if part not in ("all", "big", "tail") or (part != "all" and not 0 < tail_rows < tile_rows):
        raise ValueError(f"part must be 'all', or 'big' / 'tail' with 0 < tail_rows < tile_rows; got {part!r}, "
                         f"tail_rows={tail_rows}, tile_rows={tile_rows}")
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    rb = torch.as_tensor(np.asarray(row_bounds, dtype=np.int64)).to(dev)
    cb = torch.as_tensor(np.asarray(col_bounds, dtype=np.int64)).to(dev)
    bm = block_map.to(dev, non_blocking=True)
    P, R, C = bm.shape

    # row tiles: every block cut into tile_rows pieces (or this part's pieces of them)
    row_blocks, row_start, row_end, piece = _row_pieces(rb, tile_rows, part, tail_rows)

    # runs of consecutive kept column blocks, in (pattern, row, col) order
    prev = torch.nn.functional.pad(bm[:, :, :-1], (1, 0), value=False)
    nxt = torch.nn.functional.pad(bm[:, :, 1:], (0, 1), value=False)
    run_first = torch.nonzero((bm & ~prev).reshape(-1)).squeeze(1)  # flat index of each run start
    run_last = torch.nonzero((bm & ~nxt).reshape(-1)).squeeze(1)  # ... and of its last block
    run_row = torch.div(run_first, C, rounding_mode="floor")  # p * R + r
    lo = cb[run_first % C]
    hi = cb[run_last % C + 1]
    rsz = np.diff(np.asarray(row_bounds, dtype=np.int64))
    csz = np.diff(np.asarray(col_bounds, dtype=np.int64))
    even_cols = bool(np.all(csz % tile_cols == 0))
    packed = bool(pack_cols and not even_cols and csz.size and csz.min() >= tile_cols)
    if packed:
        col_start, col_end, col_next, col_count, counts = _pack_runs(lo, hi, run_row, P * R, tile_cols)
    else:
        _, col_start, col_end, pieces = _chunk(lo, hi, tile_cols)
        col_next, col_count = col_start, col_end - col_start
        counts = torch.zeros(P * R, dtype=torch.int64, device=dev)
        counts.index_add_(0, run_row, pieces)
    ptr = torch.zeros(P * R + 1, dtype=torch.int64, device=dev)
    ptr[1:] = torch.cumsum(counts, 0)
    col_split = col_full = None
    split = bool(short_cols and not packed)
    full_first = bool(full_first and not even_cols)
    if split or full_first:
        # entries are grouped by list already (runs come in list order): a stable sort on (list, part) moves each
        # list's short entries behind its long ones, and (full_first) its whole contiguous entries before the rest
        owner = torch.repeat_interleave(torch.arange(P * R, device=dev), counts, output_size=int(col_start.numel()))
        width = col_end - col_start  # [E]: a packed entry's first run piece
        short = (width <= short_cols) if split else torch.zeros_like(width, dtype=torch.bool)  # [E]
        # not whole: crosses into the next run, or is short (a run's remainder, a packed list's last entry)
        rest = (width != tile_cols) if full_first else torch.zeros_like(short)  # [E]
        part = rest.to(owner.dtype) + short.to(owner.dtype)  # 0 whole, 1 the other long ones, 2 short
        perm = torch.argsort(owner * 3 + part, stable=True)
        col_start, col_end, col_next, col_count = (t[perm] for t in (col_start, col_end, col_next, col_count))

        def first_of(before):  # [P * R]: each list's first entry past those flagged ``before``
            return ptr[:-1] + torch.zeros(P * R, dtype=torch.int64, device=dev).index_add_(0, owner,
                                                                                           before.to(torch.int64))
        if split:
            col_split = first_of(~short)
        if full_first:
            col_full = first_of(~rest)
    work = counts.view(P, R)[:, row_blocks]  # [P, T]: per pattern and row tile, its steps
    if not by_steps:
        work = work * (row_end - row_start)  # ... times its valid rows
    order = torch.cat([torch.argsort(work.sum(0), descending=True, stable=True),
                       torch.argsort(work, dim=1, descending=True, stable=True).reshape(-1)])

    i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    out = SideTables(
        tile_rows=int(piece), tile_cols=int(tile_cols), num_row_blocks=int(R), num_patterns=int(P),
        row_start=i32(row_start), row_end=i32(row_end), row_block=i32(row_blocks), order=i32(order),
        ptr=i32(ptr), col_start=i32(col_start), col_end=i32(col_end), col_next=i32(col_next),
        col_count=i32(col_count), even_rows=bool(np.all(rsz % tile_rows == 0)), even_cols=even_cols,
        build_ms=0.0, packed=packed, short_cols=int(short_cols) if col_split is not None else 0,
        col_split=None if col_split is None else i32(col_split), col_full=None if col_full is None else i32(col_full),
    )
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return dataclasses.replace(out, build_ms=(time.perf_counter() - t0) * 1e3)


_CACHE = PlanCache(64)


def get_side_tables(mask, major: str, tile_rows: int, tile_cols: int, device, pack_cols: bool = False,
                    part: str = "all", tail_rows: int = 0, short_cols: int = 0, by_steps: bool = False,
                    full_first: bool = False) -> SideTables:
    """Cached tables for ``mask`` (``major`` = "q" for forward/dQ, "k" for dK/dV; ``pack_cols``,
    ``part``, ``tail_rows``, ``short_cols``, ``by_steps`` and ``full_first`` as in ``build_side_tables``).

    The cache keeps the mask object alive with its entry, so its ``id`` cannot be reused meanwhile.
    """
    if major not in ("q", "k"):
        raise ValueError(f"major must be 'q' or 'k', got {major!r}")

    def build(dev):
        if major == "q":
            return build_side_tables(mask.q_block_bounds, mask.k_block_bounds, mask.block_map,
                                     tile_rows, tile_cols, dev, pack_cols, part, tail_rows, short_cols, by_steps,
                                     full_first)
        return build_side_tables(mask.k_block_bounds, mask.q_block_bounds, mask.block_map.transpose(1, 2).contiguous(),
                                 tile_rows, tile_cols, dev, pack_cols, part, tail_rows, short_cols, by_steps,
                                 full_first)

    key = (major, int(tile_rows), int(tile_cols), bool(pack_cols), part, int(tail_rows), int(short_cols),
           bool(by_steps), bool(full_first))
    return _CACHE.get(mask, key, device, build)


def table_build_ms(mask, plans: dict, device, repeats: int = 5) -> dict:
    """Median wall time (ms) of building each pass's main table from scratch (no cache), per pass of
    ``plans`` (``config.pass_plans``). The first build (allocator warm-up) is dropped."""
    out = {}
    for name, pp in plans.items():
        major = "k" if name == "dkdv" else "q"
        bm = mask.block_map if major == "q" else mask.block_map.transpose(1, 2).contiguous()
        rows, cols = ((mask.q_block_bounds, mask.k_block_bounds) if major == "q"
                      else (mask.k_block_bounds, mask.q_block_bounds))
        times = [build_side_tables(rows, cols, bm, pp.rows, pp.cols, device, pp.pack, short_cols=pp.short_cols,
                                   full_first=pp.full_first).build_ms for _ in range(repeats + 1)]
        out[name] = float(np.median(times[1:]))
    return out


def tables_for(mask, plans: dict, device) -> dict:
    """The tables one fwd+bwd needs (cached per mask, pass plan and device): ``fwd``, ``dq``, ``dkdv``, and
    for a pass with tail tiles (``PassPlan.tail_rows``) ``dq_tail`` / ``dkdv_tail``."""
    out = {}
    for name, pp in plans.items():
        major = "k" if name == "dkdv" else "q"
        out[name] = get_side_tables(mask, major, pp.rows, pp.cols, device, pp.pack, "big" if pp.tail_rows else "all",
                                    pp.tail_rows, pp.short_cols, pp.by_steps, pp.full_first)
        if pp.tail_rows:
            out[name + "_tail"] = get_side_tables(mask, major, pp.rows, pp.tail_cols, device, pp.pack, "tail",
                                                  pp.tail_rows, pp.short_cols, pp.by_steps, pp.full_first)
    return out

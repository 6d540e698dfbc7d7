"""The Gluon kernels' view of a tile plan: per major tile one list of minor-tile runs.

The plain-Triton forward loops over a tile's *full* runs, then over its *partial* runs, in two
loops. The warp-specialized forward cannot: its producer and its consumers must walk the same
key tiles in the same order with a software-pipelined step that crosses run boundaries. So the
two CSR run lists of :class:`~longca_triton.kernels.dense.plan.TilePlan` are merged per query
tile (full runs first), and every partition walks the merged list with one cursor
``(run r, tile n, run end e)``. A run ``r`` is partial when ``r >= run_ptr[m] + run_nfull[m]``.

Arrays (int32, on the plan's device), all ``O(number of runs)``:

* ``run_ptr [num_m + 1]``: CSR offsets into the run arrays;
* ``run_nfull [num_m]``: how many of a tile's runs are full;
* ``run_count [num_m]``: how many key tiles the tile visits (the loop trip count);
* ``run_start, run_end [R + 1]``: the runs, plus one sentinel ``(0, 0)`` so the cursor's read
  after the last tile stays in bounds.

The forward and the dQ kernel merge the query-major lists (per query tile, its key tiles); the
dK/dV kernel merges the key-major lists (per key tile, its query tiles).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from longca_triton.kernels.dense.plan import TilePlan, get_tile_plan
from longca_triton.kernels.core.plan_cache import PlanCache

__all__ = ["WsPlan", "merge_runs", "get_ws_plan", "walk"]


@dataclasses.dataclass(frozen=True)
class WsPlan:
    """A dense :class:`TilePlan` (intervals, launch order) plus the merged run lists."""

    tiles: TilePlan
    run_ptr: torch.Tensor
    run_nfull: torch.Tensor
    run_count: torch.Tensor
    run_start: torch.Tensor
    run_end: torch.Tensor
    has_partial: bool
    order: torch.Tensor  # launch order of the major tiles (heaviest first; part="partial"/"rest": those with any)
    #: ``part="head"``: how many of a tile's first key tiles may be partial (its first ``mask_head``
    #: partial tiles, moved to the front); the forward masks those steps without a branch and never
    #: masks in the loop; 0 otherwise
    mask_head: int = 0

    def tensors(self) -> list:
        """What the kernels read: ``LO, HI, ORDER`` and the merged runs, in argument order."""
        return [self.tiles.lo, self.tiles.hi, self.order, self.run_ptr, self.run_nfull,
                self.run_count, self.run_start, self.run_end]


def merge_runs(full: tuple, part: tuple, num_m: int):
    """Merge per-tile CSR run lists ``(ptr, start, end)`` (numpy), full runs first.

    Returns numpy ``(run_ptr, run_nfull, run_count, run_start, run_end)``; the run arrays end
    with one sentinel run ``(0, 0)``.
    """
    fp, fs, fe = (np.asarray(a, dtype=np.int64) for a in full)
    pp, ps, pe = (np.asarray(a, dtype=np.int64) for a in part)
    nf, npart = np.diff(fp), np.diff(pp)
    ptr = np.zeros(num_m + 1, np.int64)
    np.cumsum(nf + npart, out=ptr[1:])
    total = int(ptr[-1])
    start = np.zeros(total + 1, np.int64)
    end = np.zeros(total + 1, np.int64)
    # run i of tile m's full list goes to ptr[m] + i; of its partial list to ptr[m] + nf[m] + i
    f_tile = np.repeat(np.arange(num_m), nf)
    f_pos = ptr[f_tile] + (np.arange(len(fs)) - fp[f_tile])
    p_tile = np.repeat(np.arange(num_m), npart)
    p_pos = ptr[p_tile] + nf[p_tile] + (np.arange(len(ps)) - pp[p_tile])
    start[f_pos], end[f_pos] = fs, fe
    start[p_pos], end[p_pos] = ps, pe
    tiles_before = np.concatenate([[0], np.cumsum(end[:-1] - start[:-1])])  # per run, exclusive
    count = tiles_before[ptr[1:]] - tiles_before[ptr[:-1]]
    i32 = lambda a: np.ascontiguousarray(a).astype(np.int32)  # noqa: E731
    return i32(ptr), i32(nf), i32(count), i32(start), i32(end)


def walk(run_ptr, run_nfull, run_count, run_start, run_end, m: int) -> list[tuple[int, bool]]:
    """The key tiles query tile ``m`` visits, as ``(tile, partial)``, stepping the kernel's cursor
    (``fwd_parts._advance``) exactly: a host mirror for tests and for reading a plan."""
    r0 = int(run_ptr[m])
    r, n, e = r0, int(run_start[r0]), int(run_end[r0])
    out = []
    for _ in range(int(run_count[m])):
        out.append((n, r >= r0 + int(run_nfull[m])))
        n += 1
        if n == e:
            r += 1
            n, e = int(run_start[r]), int(run_end[r])
    return out


#: which runs a plan keeps (``build_ws_plan``): all of them, only the full ones, only the partial ones;
#: "head": the full runs behind each tile's first partial key tiles, "rest": the partial tiles but those
PARTS = ("all", "full", "partial", "head", "rest")


def split_head(part: tuple, num: int, k: int = 1):
    """A tile's first ``k`` partial key tiles apart from its others: CSR ``(ptr, start, end)`` (numpy)
    of partial runs -> ``(head, rest)``, ``head`` the runs that hold each tile's first ``k`` partial
    tiles (fewer where it has fewer), ``rest`` the same runs without them (a run taken whole
    vanishes)."""
    ptr, start, end = (np.asarray(a, dtype=np.int64) for a in part)
    counts = np.diff(ptr)
    tile = np.repeat(np.arange(num), counts)
    length = end - start
    # a run's partial tiles before it within its tile (an exclusive prefix sum restarted per tile)
    excl = np.cumsum(length) - length
    before = excl - excl[ptr[:-1][tile]]
    take = np.clip(k - before, 0, length)

    def csr(sel, s, e):
        p = np.zeros(num + 1, np.int64)
        np.cumsum(np.bincount(tile[sel], minlength=num), out=p[1:])
        return p, s[sel], e[sel]

    return csr(take > 0, start, start + take), csr(start + take < end, start + take, end)


def pad_single(runs: tuple, num: int, num_keys: int):
    """CSR runs ``(ptr, start, end)`` (numpy) of tiles over ``num_keys`` key tiles, each tile that
    walks exactly one key tile given a second, one that none of its rows may see (``mask_head=2``:
    every item that walks any tile walks two, so the forward's step 1 needs no branch): its next
    neighbour, else its previous one, else the first tile past the keys (loaded as zeros by the TMA).
    Returns the pad runs as CSR."""
    ptr, start, end = (np.asarray(a, dtype=np.int64) for a in runs)
    counts = np.diff(ptr)
    tile = np.repeat(np.arange(num), counts)
    walks = np.bincount(tile, weights=end - start, minlength=num).astype(np.int64)
    one = walks == 1
    n = start[ptr[:-1][one]]  # the one run of such a tile is one key tile long
    pad = np.where(n + 1 < num_keys, n + 1, np.where(n >= 1, n - 1, num_keys))
    p = np.zeros(num + 1, np.int64)
    np.cumsum(one.astype(np.int64), out=p[1:])
    return p, pad, pad + 1


#: how many partial tiles of each query tile the forward may mask without a branch (``mask_head``)
HEAD_TILES = (1, 2)


def build_ws_plan(tiles: TilePlan, major: str = "q", part: str = "all", head: int = 1) -> WsPlan:
    """Merge ``tiles``' query-major (``major="q"``: forward, dQ) or key-major (``"k"``: dK/dV) run
    lists; ``order`` is the matching launch order (heaviest first). ``part="full"`` / ``"partial"``
    keeps only the full / only the partial runs (the forward's split launch: the full tiles in the
    kernel compiled without the mask path, the partial ones in a second launch that merges);
    ``"head"`` each tile's first ``head`` partial key tiles (``split_head``) in front of its full runs
    (the forward masks its first ``head`` steps without a branch: ``mask_head``; with ``head=2`` a tile
    that walks one key tile walks a second that its rows cannot see, ``pad_single``) and ``"rest"``
    the partial tiles but those (query-major only)."""
    if major not in ("q", "k"):
        raise ValueError(f"major must be 'q' or 'k', got {major!r}")
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    if head not in HEAD_TILES:
        raise ValueError(f"head must be one of {HEAD_TILES} (partial tiles masked without a branch), got {head!r}")
    lists = (tiles.q_full, tiles.q_part) if major == "q" else (tiles.k_full, tiles.k_part)
    num = tiles.num_m if major == "q" else tiles.num_n
    host = [tuple(t.cpu().numpy() for t in lst) for lst in lists]
    empty = (np.zeros(num + 1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    mask_head = 0
    if part in ("head", "rest"):
        if major != "q":
            raise ValueError(f"part={part!r} is the forward's (major='q'), got major={major!r}")
        first, rest = split_head(host[1], num, head)
        if part == "head":
            # the head tiles in front of their tile's full runs, as its first "full" runs: no partial
            # runs remain, so the loop never masks (the first `head` steps do, without a branch)
            ptr, _, _, start, end = merge_runs(first, host[0], num)
            runs = (ptr, start[:-1], end[:-1])
            if head == 2:
                ptr, _, _, start, end = merge_runs(runs, pad_single(runs, num, tiles.num_n), num)
                runs = (ptr, start[:-1], end[:-1])
            host = [runs, empty]
            mask_head = head if len(first[1]) else 0
        else:
            host = [empty, rest]
    elif part != "all":
        # the dropped list becomes empty: every tile's pointer 0, no runs
        host[1 if part == "full" else 0] = empty
    arrays = merge_runs(host[0], host[1], num)
    dev = tiles.lo.device
    order = tiles.q_order if major == "q" else tiles.k_order
    if part in ("partial", "rest"):
        # the split launch's second half visits only the tiles that have partial runs: the others'
        # rows keep what the first half stored (the first half keeps every tile: it writes the base)
        keep = arrays[2][order.cpu().numpy()] > 0
        order = order[torch.from_numpy(keep).to(order.device)]
    ptr, nfull, count, start, end = (torch.from_numpy(a).to(dev) for a in arrays)
    return WsPlan(tiles=tiles, run_ptr=ptr, run_nfull=nfull, run_count=count, run_start=start,
                  run_end=end, has_partial=bool(len(host[1][1])), order=order, mask_head=mask_head)


_CACHE = PlanCache(64)


def get_ws_plan(mask, block_m: int, block_n: int, device, major: str = "q", part: str = "all",
                head: int = 1) -> WsPlan:
    """Cached :class:`WsPlan` for ``mask`` and tiles ``block_m x block_n`` (host work once);
    ``part`` and ``head`` as in :func:`build_ws_plan`."""
    return _CACHE.get(mask, ("ws", major, int(block_m), int(block_n), part, int(head)), device,
                      lambda dev: build_ws_plan(get_tile_plan(mask, block_m, block_n, dev), major, part, head))

"""Sharding plans for context parallelism and the local masks they induce.

A plan cuts the (padded) sequence into ``C = chunks_per_rank * N`` chunks of ``chunk_size`` tokens
and gives every rank the same number of chunks:

* ``contiguous``  one chunk per rank, rank ``r`` holds chunk ``r``;
* ``zigzag``      ``2N`` chunks, rank ``r`` holds chunks ``r`` and ``2N - 1 - r``;
* ``balanced``    ``chunks_per_rank * N`` chunks (default 8 per rank) assigned by their mask area
  (the allowed (query, key) pairs of the chunk's query rows): longest-processing-time first with
  a capacity of ``chunks_per_rank`` per rank, then pairwise swaps while they lower the largest load.

A rank's local sequence is its chunks concatenated in ascending order. When ``S`` does not
divide, the sequence is padded at the end; padded positions belong to no slice of the mask, so
they never attend and are never attended (their output rows are zero and their lse ``-inf``).

Local masks. The attention between the tokens of a *query layout* (the chunks of some ranks, in
order) and a *key layout* is itself a :class:`RangeMask` in local coordinates. It is built by
clipping every global slice to every (query chunk, key chunk) rectangle and shifting it. A clipped
CAUSAL / INVCAUSAL / BICAUSAL slice is in general not a slice of the same kind (the diagonal no
longer meets the rectangle's corner), so each slice is first written as a rectangle intersected
with a diagonal band ``lo_d <= j - i <= hi_d`` (CAUSAL: ``hi_d = k_end - q_end``; INVCAUSAL:
``lo_d = k_start - q_start``; BICAUSAL: both), and the clipped piece is split by rows into at most
three segments in which each row bound is either constant or on the diagonal; each segment is
exactly one FULL, CAUSAL, INVCAUSAL or BICAUSAL slice (see :func:`clip_slice`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from longca_triton.masks import Mask, RangeMask, SliceKind
from longca_triton.masks.ir import merge_intervals

__all__ = ["PLAN_KINDS", "CPPlan", "make_plan", "clip_slice", "layout_mask", "dispatch", "undispatch", "chunk_needs"]

PLAN_KINDS = ("contiguous", "zigzag", "balanced")

FULL, CAUSAL, INVCAUSAL, BICAUSAL = SliceKind.FULL, SliceKind.CAUSAL, SliceKind.INVCAUSAL, SliceKind.BICAUSAL


# ---------------------------------------------------------------------------------- clipping
def clip_slice(qs: int, qe: int, ks: int, ke: int, kind, a: int, b: int, c: int, e: int) -> list[tuple]:
    """The part of slice ``(qs, qe, ks, ke, kind)`` inside rows ``[a, b)`` x keys ``[c, e)``, exactly,
    as a list of slices in the same (global) coordinates.

    Row ``i`` of the clipped piece allows ``[max(k0, i + lo_d), min(k1, i + hi_d + 1))`` with
    ``[k0, k1)`` the clipped key range. Cutting the rows where a bound switches between constant
    and diagonal leaves segments of four shapes: both constant (FULL), upper bound diagonal
    (CAUSAL, rows with nothing dropped), lower bound diagonal (INVCAUSAL), both diagonal (BICAUSAL).
    """
    kind = SliceKind(kind)
    q0, q1 = max(qs, a), min(qe, b)
    k0, k1 = max(ks, c), min(ke, e)
    if q0 >= q1 or k0 >= k1:
        return []
    lo_d = ks - qs if kind in (INVCAUSAL, BICAUSAL) else None  # j - i >= lo_d
    hi_d = ke - qe if kind in (CAUSAL, BICAUSAL) else None  # j - i <= hi_d
    cuts = {q0, q1}
    if lo_d is not None and q0 < k0 - lo_d < q1:
        cuts.add(k0 - lo_d)  # from this row on, i + lo_d >= k0: the lower bound is diagonal
    if hi_d is not None and q0 < k1 - hi_d < q1:
        cuts.add(k1 - hi_d)  # before this row, i + hi_d + 1 <= k1: the upper bound is diagonal
    rows = sorted(cuts)
    out = []
    for r0, r1 in zip(rows, rows[1:]):
        lo_diag = lo_d is not None and r0 + lo_d >= k0
        hi_diag = hi_d is not None and r1 + hi_d <= k1
        if not lo_diag and not hi_diag:
            if k0 < k1:
                out.append((r0, r1, k0, k1, FULL))
        elif hi_diag and not lo_diag:
            r0c = max(r0, k0 - hi_d)  # rows before attend nothing
            if r0c < r1:
                out.append((r0c, r1, k0, r1 + hi_d, CAUSAL))
        elif lo_diag and not hi_diag:
            r1c = min(r1, k1 - lo_d)  # rows from here on attend nothing
            if r0 < r1c:
                out.append((r0, r1c, r0 + lo_d, k1, INVCAUSAL))
        elif hi_d >= lo_d:
            out.append((r0, r1, r0 + lo_d, r1 + hi_d, BICAUSAL))
    return out


def layout_mask(mask: RangeMask, q_segments, k_segments, len_q: int, len_k: int, name: str | None = None) -> RangeMask | None:
    """The mask between two layouts in local coordinates, or ``None`` when nothing is allowed.

    A layout is a list of ``(global_start, global_end, local_start)`` segments (global ranges may
    run past ``S``: those positions are padding and belong to no slice).
    """
    sl = np.asarray([s[:4] for s in mask.slices], dtype=np.int64).reshape(-1, 4)
    kinds = [s[4] for s in mask.slices]
    out = []
    for ga, gb, la in q_segments:
        rows_hit = np.nonzero((sl[:, 0] < gb) & (sl[:, 1] > ga))[0]
        if rows_hit.size == 0:
            continue
        for gc, ge, lc in k_segments:
            for n in rows_hit[(sl[rows_hit, 2] < ge) & (sl[rows_hit, 3] > gc)]:
                qs, qe, ks, ke = (int(x) for x in sl[n])
                for r0, r1, c0, c1, kind in clip_slice(qs, qe, ks, ke, kinds[n], ga, gb, gc, ge):
                    out.append((r0 - ga + la, r1 - ga + la, c0 - gc + lc, c1 - gc + lc, kind))
    if not out:
        return None
    return RangeMask(len_q, len_k, out, name=name or f"{mask.name}@local", params={"parent": mask.name})


# ---------------------------------------------------------------------------------- plans
@dataclass(eq=False)
class CPPlan:
    """Which global chunks each rank holds (see the module docstring)."""

    mask: RangeMask
    world_size: int
    kind: str
    chunk_size: int
    chunks: tuple[tuple[int, ...], ...]  # per rank, ascending chunk indices
    locality: bool = False  # balanced: chunks also placed to keep the keys each rank needs local
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def seqlen(self) -> int:
        return self.mask.seqlen_q

    @property
    def num_chunks(self) -> int:
        return sum(len(c) for c in self.chunks)

    @property
    def padded_len(self) -> int:
        return self.num_chunks * self.chunk_size

    @property
    def local_len(self) -> int:
        return len(self.chunks[0]) * self.chunk_size

    @property
    def padding(self) -> int:
        return self.padded_len - self.seqlen

    def segments(self, ranks) -> list[tuple[int, int, int]]:
        """Layout of the ranks' chunks concatenated in the order given: ``(g0, g1, local0)`` each."""
        out, off = [], 0
        for r in ranks:
            for ch in self.chunks[r]:
                out.append((ch * self.chunk_size, (ch + 1) * self.chunk_size, off))
                off += self.chunk_size
        return out

    def positions(self, rank: int) -> np.ndarray:
        """Global position of every local token of ``rank`` (``>= seqlen`` for padding)."""
        c = self.chunk_size
        return np.concatenate([np.arange(ch * c, (ch + 1) * c) for ch in self.chunks[rank]])

    def pair_mask(self, q_ranks, k_ranks) -> RangeMask | None:
        """Mask between the layouts of ``q_ranks`` and ``k_ranks`` (tuples of ranks), cached; ``None``
        when empty (that pair is skipped)."""
        key = (tuple(q_ranks), tuple(k_ranks))
        if key not in self._cache:
            qs, ks = self.segments(key[0]), self.segments(key[1])
            self._cache[key] = layout_mask(
                self.mask, qs, ks, len(qs) * self.chunk_size, len(ks) * self.chunk_size,
                name=f"{self.mask.name}@{self.kind}{list(key[0])}x{list(key[1])}",
            )
        return self._cache[key]

    def chunk_areas(self) -> np.ndarray:
        """Allowed pairs in the query rows of every chunk (the work a ring rank does for it)."""
        return _chunk_areas(self.mask, self.chunk_size, self.num_chunks)

    def rank_areas(self) -> np.ndarray:
        a = self.chunk_areas()
        return np.asarray([int(a[list(c)].sum()) for c in self.chunks], dtype=np.int64)

    @property
    def imbalance(self) -> float:
        """Largest rank area over the mean (1.0 = perfect)."""
        a = self.rank_areas()
        return float(a.max() / a.mean()) if a.mean() > 0 else 1.0

    def describe(self) -> str:
        return (f"CPPlan({self.kind}{'+locality' if self.locality else ''}, N={self.world_size}, S={self.seqlen}, "
                f"chunk={self.chunk_size}, chunks/rank={len(self.chunks[0])}, padding={self.padding}, "
                f"imbalance={self.imbalance:.3f})")


def _chunk_areas(mask: RangeMask, chunk: int, num_chunks: int) -> np.ndarray:
    rows, lo, hi = mask.merged_row_intervals()
    per_row = np.bincount(rows, weights=(hi - lo), minlength=mask.seqlen_q).astype(np.int64)
    padded = np.zeros(chunk * num_chunks, dtype=np.int64)
    padded[: mask.seqlen_q] = per_row
    return padded.reshape(num_chunks, chunk).sum(axis=1)


def _balance(areas: np.ndarray, world: int, per_rank: int) -> list[list[int]]:
    """Equal-cardinality min-max assignment: LPT with capacities, then improving swaps."""
    order = sorted(range(len(areas)), key=lambda i: (-int(areas[i]), i))
    bins: list[list[int]] = [[] for _ in range(world)]
    load = np.zeros(world, dtype=np.int64)
    for ch in order:
        open_ = [r for r in range(world) if len(bins[r]) < per_rank]
        r = min(open_, key=lambda r: (load[r], r))
        bins[r].append(ch)
        load[r] += int(areas[ch])
    for _ in range(50 * world * per_rank):
        hi = int(np.argmax(load))
        best = None
        for lo in range(world):
            if lo == hi:
                continue
            for x in bins[hi]:
                for y in bins[lo]:
                    d = int(areas[x]) - int(areas[y])
                    if d <= 0:
                        continue
                    new_max = max(load[hi] - d, load[lo] + d)
                    if new_max < load[hi] and (best is None or new_max < best[0]):
                        best = (new_max, lo, x, y, d)
        if best is None:
            break
        _, lo, x, y, d = best
        bins[hi][bins[hi].index(x)] = y
        bins[lo][bins[lo].index(y)] = x
        load[hi] -= d
        load[lo] += d
    return [sorted(b) for b in bins]


def chunk_needs(mask: RangeMask, chunk: int, num_chunks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat ``(chunk, lo, hi)``: the global key intervals the query rows of each chunk attend,
    merged per chunk (disjoint, ascending). Padding rows (``>= S``) attend nothing."""
    rows, lo, hi = mask.merged_row_intervals()
    return merge_intervals(num_chunks, rows // chunk, lo, hi, extent=mask.seqlen_k)


#: default area tolerance of the locality-aware ``balanced`` plan (largest rank area / mean)
BALANCE_TOL = 0.02
_MAX_ATOMS = 4096


class _NeedModel:
    """The keys each set of chunks needs from elsewhere, exactly (coarsened to ``_MAX_ATOMS``
    atoms on fragmented masks): the sequence is cut into *atoms* at every chunk boundary and every
    endpoint of a chunk's needed intervals, so a chunk needs an atom wholly or not at all."""

    def __init__(self, mask: RangeMask, chunk: int, C: int):
        cpos, clo, chi = chunk_needs(mask, chunk, C)
        bounds = np.unique(np.concatenate([clo, chi, np.arange(C + 1) * chunk]))
        if bounds.size > _MAX_ATOMS + 1:  # coarsen (the objective only; the moved keys stay exact)
            g = max(1, -(-chunk * C // _MAX_ATOMS))
            ch_lo, ch_hi = clo // chunk, (chi - 1) // chunk
            clo = np.maximum(clo // g * g, ch_lo * chunk)
            chi = np.minimum(-(-chi // g) * g, (ch_hi + 1) * chunk)
            grid = np.arange(0, C * chunk + 1, g)
            bounds = np.unique(np.concatenate([grid, np.arange(C + 1) * chunk, clo, chi]))
        A = bounds.size - 1
        diff = np.zeros((C, A + 1), dtype=np.int32)
        np.add.at(diff, (cpos, np.searchsorted(bounds, clo)), 1)
        np.add.at(diff, (cpos, np.searchsorted(bounds, chi)), -1)
        self.need = (np.cumsum(diff, axis=1)[:, :A] > 0).astype(np.int32)  # [C, A]
        owner = np.minimum(bounds[:-1] // chunk, C - 1)
        self.own = np.zeros((C, A), dtype=np.int32)
        self.own[owner, np.arange(A)] = 1
        self.length = np.diff(bounds).astype(np.int64)
        self.owner = owner

    def cost(self, chunks) -> int:
        """Tokens the holder of ``chunks`` needs from the other ranks."""
        idx = list(chunks)
        need = self.need[idx].sum(0) > 0
        own = self.own[idx].sum(0) > 0
        return int(self.length[need & ~own].sum())

    def pair_matrix(self) -> np.ndarray:
        """``W[c, c']``: tokens of chunk ``c'`` the queries of chunk ``c`` need (diagonal zero)."""
        C = self.need.shape[0]
        W = np.zeros((C, C), dtype=np.int64)
        np.add.at(W.T, self.owner, (self.need * self.length).T)
        np.fill_diagonal(W, 0)
        return W


def _pack(units, areas, world, per_rank):
    """Whole units (runs of chunks) into ``world`` bins of ``per_rank`` chunks: largest area first, each
    into the least-loaded bin with room. ``None`` when some unit finds no room."""
    bins: list[list[int]] = [[] for _ in range(world)]
    load = np.zeros(world, dtype=np.int64)
    for u in sorted(units, key=lambda u: (-int(areas[u].sum()), -len(u), u[0])):
        room = [r for r in range(world) if len(bins[r]) + len(u) <= per_rank]
        if not room:
            return None
        r = min(room, key=lambda r: (load[r], r))
        bins[r] += list(u)
        load[r] += int(areas[u].sum())
    return bins


def _units_plan(model: _NeedModel, areas, world, per_rank, budget):
    """Keep runs of chunks that need each other together (documents whole) as long as they pack
    within the area budget; split the worst run at its cheapest cut otherwise."""
    C = len(areas)
    W = model.pair_matrix()
    # cut between c - 1 and c is free when no chunk on either side needs the other side
    lo_own = np.array([min([c] + [int(x) for x in np.nonzero(W[c])[0]]) for c in range(C)])
    hi_own = np.array([max([c] + [int(x) for x in np.nonzero(W[c])[0]]) for c in range(C)])
    suf_min = np.minimum.accumulate(lo_own[::-1])[::-1]
    pre_max = np.maximum.accumulate(hi_own)
    cuts = [0] + [c for c in range(1, C) if suf_min[c] >= c and pre_max[c - 1] < c] + [C]
    units = [np.arange(a, b) for a, b in itertools.pairwise(cuts)]
    P = np.zeros((C + 1, C + 1), dtype=np.int64)
    P[1:, 1:] = W.cumsum(0).cumsum(1)

    def rect(r0, r1, c0, c1):  # W[r0:r1, c0:c1].sum()
        return P[r1, c1] - P[r0, c1] - P[r1, c0] + P[r0, c0]

    for _ in range(C):
        bins = _pack(units, areas, world, per_rank)
        if bins is not None and max(int(areas[b].sum()) for b in bins) <= budget:
            return bins
        split = [u for u in units if len(u) > 1]
        if not split:
            return None
        # too big for a rank first, else the heaviest run
        u = max(split, key=lambda u: (len(u) > per_rank if bins is None else 0, int(areas[u].sum()), len(u)))
        a, b = int(u[0]), int(u[-1]) + 1
        cost = [(int(rect(m, b, a, m) + rect(a, m, m, b)), abs(2 * m - a - b), m) for m in range(a + 1, b)]
        m = min(cost)[2]
        units = [x for x in units if x is not u] + [np.arange(a, m), np.arange(m, b)]
    return None


def _refine(model: _NeedModel, bins, areas, budget, sweeps: int = 30, partners: int = 6, max_evals: int = 840):
    """Pairwise chunk swaps that lower the total needed remote keys, loads kept within ``budget``.

    Each sweep tries, for every rank, its ``partners`` ranks with the most keys needed between the
    two (all pairs up to 7 ranks); at most ``max_evals`` rank pairs are tried in all (deterministic:
    every rank computes the same plan), so the cost stays bounded at large world sizes."""
    world = len(bins)
    bins = [np.asarray(b, dtype=np.int64) for b in bins]
    L = model.length
    evals = 0
    for _ in range(sweeps):
        rank_of = np.empty(model.need.shape[0], dtype=np.int64)
        for r, b in enumerate(bins):
            rank_of[b] = r
        needs = np.zeros((world, model.need.shape[1]), dtype=np.int64)
        np.add.at(needs, rank_of, model.need)
        owned = np.zeros((model.need.shape[1], world), dtype=np.int64)
        owned[np.arange(model.need.shape[1]), rank_of[model.owner]] = 1
        cross = ((needs > 0) * L) @ owned  # [i, j]: tokens rank i needs from rank j
        cross = cross + cross.T
        np.fill_diagonal(cross, -1)
        pairs = sorted({(min(i, j), max(i, j)) for i in range(world)
                        for j in np.argsort(-cross[i], kind="stable")[:partners] if j != i})
        improved = False
        for i, j in pairs:
            if evals >= max_evals:
                break
            evals += 1
            bi, bj = bins[i], bins[j]
            Xi, Xj = model.need[bi], model.need[bj]
            ci, cj = Xi.sum(0), Xj.sum(0)
            cols = np.nonzero((ci + cj) > 0)[0]  # atoms neither rank needs cost nothing either way
            if cols.size == 0:
                continue
            Xi, Xj, ci, cj, Lc = Xi[:, cols], Xj[:, cols], ci[cols], cj[cols], L[cols]
            Oi, Oj = model.own[bi][:, cols], model.own[bj][:, cols]
            oi, oj = Oi.sum(0), Oj.sum(0)
            cost_i = int(Lc[(ci > 0) & (oi == 0)].sum())
            cost_j = int(Lc[(cj > 0) & (oj == 0)].sum())
            ni = ((ci - Xi[:, None] + Xj[None, :]) > 0) & ((oi - Oi[:, None] + Oj[None, :]) == 0)
            nj = ((cj - Xj[None, :] + Xi[:, None]) > 0) & ((oj - Oj[None, :] + Oi[:, None]) == 0)
            gain = cost_i + cost_j - (ni @ Lc) - (nj @ Lc)
            ai, aj = areas[bi], areas[bj]
            li = int(ai.sum()) - ai[:, None] + aj[None, :]
            lj = int(aj.sum()) + ai[:, None] - aj[None, :]
            gain = np.where((li <= budget) & (lj <= budget), gain, 0)
            x, y = np.unravel_index(int(gain.argmax()), gain.shape)
            if gain[x, y] > 0:
                bi[x], bj[y] = bj[y], bi[x]
                improved = True
        if not improved or evals >= max_evals:
            break
    return [sorted(int(c) for c in b) for b in bins]


_EXACT_PAIRS = 100_000  # two ranks: every split up to this many is tried (C = 20 chunks: 92378)


def _exact_two(model: _NeedModel, areas, per_rank: int, budget: int):
    """Two ranks: the split whose busier direction moves the fewest keys (then the fewest in all), by
    trying every one that keeps both areas within ``budget`` (chunk 0 on rank 0: the mirror image
    is the same plan). ``None`` when there are more than ``_EXACT_PAIRS`` splits or none fits."""
    C = model.need.shape[0]
    if math.comb(C - 1, per_rank - 1) > _EXACT_PAIRS:
        return None
    best = None
    combos = itertools.combinations(range(1, C), per_rank - 1)
    total_area = int(areas.sum())
    while True:
        batch = list(itertools.islice(combos, 4096))
        if not batch:
            break
        M = np.zeros((len(batch), C), dtype=np.int32)
        M[:, 0] = 1
        M[np.repeat(np.arange(len(batch)), per_rank - 1), np.asarray(batch, dtype=np.int64).ravel()] = 1
        a0 = M @ areas
        fits = (a0 <= budget) & (total_area - a0 <= budget)
        if not fits.any():
            continue
        M = M[fits]
        costs = []
        for side in (M, 1 - M):
            need = (side @ model.need) > 0
            own = (side @ model.own) > 0
            costs.append((need & ~own) @ model.length)
        total, worst = costs[0] + costs[1], np.maximum(costs[0], costs[1])
        i = int(np.lexsort((total, worst))[0])
        key = (int(worst[i]), int(total[i]))
        if best is None or key < best[0]:
            best = (key, np.nonzero(M[i])[0].tolist())
    if best is None:
        return None
    b0 = best[1]
    return [b0, [c for c in range(C) if c not in set(b0)]]


def _balance_local(mask: RangeMask, chunk: int, C: int, world: int, per_rank: int, tol: float) -> list[list[int]]:
    """Area balance and locality: the largest rank area stays within
    ``budget = max(area-only balance, (1 + tol) mean)``; within it, the plan with the fewest keys
    needed from other ranks. On two ranks with up to 20 chunks: the exact optimum
    (:func:`_exact_two`, busier direction first). Otherwise the better of (a) runs of mutually
    dependent chunks (documents) kept whole and (b) the area-only plan, each improved by pairwise
    swaps (:func:`_refine`). Why exact where it is cheap: pairwise swaps stop in local optima; on
    causal_document at 16K (a 7.6K-token document that must be split) they moved 4.3K keys one way
    where the best split of the same 16 chunks moves 3.5K."""
    areas = _chunk_areas(mask, chunk, C)
    base = _balance(areas, world, per_rank)
    best_max = max(int(areas[b].sum()) for b in base)
    budget = max(best_max, math.floor(areas.sum() / world * (1 + tol)))
    model = _NeedModel(mask, chunk, C)
    exact = _exact_two(model, areas, per_rank, budget) if world == 2 else None
    if exact is not None:
        # why the busier direction first: the two directions of a two-rank all-to-all run at once,
        # so its time is the larger one's (the total-optimal split of causal_document at 16K moves
        # 36 % of an all-gather's keys but 5.5K of them one way; this one 3.5K / 41 %)
        return exact
    cands = [base]
    units = _units_plan(model, areas, world, per_rank, budget)
    if units is not None:
        cands.append(units)
    best = None
    for bins in cands:
        bins = _refine(model, bins, areas, budget)
        cost = sum(model.cost(b) for b in bins)
        if best is None or cost < best[0]:
            best = (cost, bins)
    return best[1]


def make_plan(mask: Mask, world_size: int, kind: str = "zigzag", *, chunks_per_rank: int | None = None, align: int = 1,
              locality: bool = True, balance_tol: float = BALANCE_TOL) -> CPPlan:
    """Shard ``mask``'s sequence over ``world_size`` ranks (``kind``: contiguous | zigzag | balanced).

    ``chunks_per_rank`` applies to ``balanced`` (default 8); ``align`` rounds the chunk size up to a
    multiple (e.g. the kernel's tile) at the cost of more padding. ``balanced`` also minimises the
    keys each rank needs from the others (``locality``, see :func:`_balance_local`) while keeping the
    largest rank area within ``max(best area balance, (1 + balance_tol) x mean)``; ``locality=False``
    balances area only.
    """
    if not isinstance(mask, RangeMask):
        raise ValueError(f"context parallelism needs a RangeMask (static mask); got {type(mask).__name__}")
    if mask.seqlen_q != mask.seqlen_k:
        raise ValueError(f"context parallelism shards self-attention: Sq ({mask.seqlen_q}) must equal Sk ({mask.seqlen_k})")
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if kind not in PLAN_KINDS:
        raise ValueError(f"unknown plan kind {kind!r}; valid kinds: {', '.join(PLAN_KINDS)}")
    N = int(world_size)
    per_rank = {"contiguous": 1, "zigzag": 2}.get(kind) or int(chunks_per_rank or 8)
    if kind != "balanced" and chunks_per_rank not in (None, per_rank):
        raise ValueError(f"plan {kind!r} has {per_rank} chunk(s) per rank; chunks_per_rank applies to 'balanced'")
    if per_rank < 1 or align < 1:
        raise ValueError("chunks_per_rank and align must be >= 1")
    C = per_rank * N
    chunk = math.ceil(mask.seqlen_q / C)
    chunk = math.ceil(chunk / align) * align
    if kind == "contiguous":
        chunks = [[r] for r in range(N)]
    elif kind == "zigzag":
        chunks = [[r, 2 * N - 1 - r] for r in range(N)]
    elif not locality or N == 1:
        chunks = _balance(_chunk_areas(mask, chunk, C), N, per_rank)
    else:
        if not balance_tol >= 0:
            raise ValueError(f"balance_tol must be >= 0, got {balance_tol!r}")
        chunks = _balance_local(mask, chunk, C, N, per_rank, float(balance_tol))
    return CPPlan(mask, N, kind, chunk, tuple(tuple(sorted(c)) for c in chunks), locality=kind == "balanced" and bool(locality))


# ---------------------------------------------------------------------------------- dispatch
def _index(plan: CPPlan, rank: int, device) -> torch.Tensor:
    key = ("index", rank, str(device))
    if key not in plan._cache:
        plan._cache[key] = torch.as_tensor(plan.positions(rank), device=device)
    return plan._cache[key]


def dispatch(x: torch.Tensor, plan: CPPlan, rank: int | None = None, dim: int = 1) -> torch.Tensor:
    """This rank's local part of a global tensor: ``x [B, S, ...]`` -> ``[B, local_len, ...]``
    (``dim`` is the sequence dimension; padding positions are zeros). Differentiable."""
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank()
    if x.shape[dim] != plan.seqlen:
        raise ValueError(f"dispatch: dimension {dim} has {x.shape[dim]} positions, the plan is for {plan.seqlen}")
    if plan.padding:
        shape = list(x.shape)
        shape[dim] = plan.padding
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    return x.index_select(dim, _index(plan, rank, x.device))


def assemble(parts: list[torch.Tensor], plan: CPPlan, dim: int = 1) -> torch.Tensor:
    """Inverse of dispatch given every rank's local tensor (in rank order); drops the padding."""
    cat = torch.cat(parts, dim=dim)
    order = np.argsort(np.concatenate([plan.positions(r) for r in range(plan.world_size)]), kind="stable")
    idx = torch.as_tensor(order[: plan.seqlen], device=cat.device)
    return cat.index_select(dim, idx)


class _Undispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group, dim):
        import torch.distributed as dist

        ctx.plan, ctx.dim, ctx.rank = plan, dim, dist.get_rank(group)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return assemble(parts, plan, dim)

    @staticmethod
    def backward(ctx, grad):
        return dispatch(grad, ctx.plan, ctx.rank, ctx.dim), None, None, None


def undispatch(x_local: torch.Tensor, plan: CPPlan, group=None, dim: int = 1) -> torch.Tensor:
    """Gather every rank's local tensor and restore the global order: ``[B, local_len, ...]`` ->
    ``[B, S, ...]`` on every rank. Differentiable; the backward hands each rank the gradient of its
    own positions (the loss computed from the gathered tensor is taken to be the same on every rank)."""
    import torch.distributed as dist

    if dist.get_world_size(group) != plan.world_size:
        raise ValueError(f"the plan is for {plan.world_size} ranks, the group has {dist.get_world_size(group)}")
    return _Undispatch.apply(x_local, plan, group, dim)

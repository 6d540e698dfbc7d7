"""What each rank needs from each other rank: the dispatch of the ``group_cast`` scheme.

Given a plan (which chunks every rank holds) and its mask, rank ``r``'s local queries attend the
union of their rows' key intervals. Restricted to the chunks of another rank ``s`` and written in
``s``'s local coordinates, that union is the list of key ranges ``r`` must receive from ``s``;
nothing else of ``s`` is ever read by ``r``. All of it comes from the mask's merged row
intervals (``O(S)`` once, cached on the mask) merged per chunk and per rank: ``O(intervals)``,
never an ``S x S`` object.

:class:`NeedLayout` (cached on the plan, :func:`need_layout`) holds, per (receiver, owner), the
pieces ``(global_start, global_end, owner_local_start)`` in the owner's local order, and derives:

* ``counts[r, s]``: tokens ``r`` receives from ``s`` (``0`` on the diagonal: a rank's own keys never move);
* :meth:`NeedLayout.send_index` the owner's local positions to gather, receiver after receiver (the
  input splits of one all-to-all with variable splits);
* :meth:`NeedLayout.recv_segments` the layout of the received keys (owner after owner), and
  :meth:`NeedLayout.remote_mask` the mask between the receiver's queries and those keys in their
  received coordinates (a ``RangeMask``, exact: see ``plan.layout_mask``).

Where the mask is dense, every rank needs every other rank's real keys and the traffic is that of
an all-gather of K/V (less the padding, which is never needed); it is never more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from longca_triton.masks.ir import merge_intervals

from .plan import CPPlan, chunk_needs, layout_mask

__all__ = ["NeedLayout", "chunk_needs", "need_layout"]


@dataclass(eq=False)
class NeedLayout:
    plan: CPPlan
    #: pieces[r][s]: int64 [n, 3] rows (global_start, global_end, local_start in s), ascending
    pieces: list
    counts: np.ndarray  # [N, N] tokens receiver r gets from owner s
    _cache: dict = field(default_factory=dict, repr=False)

    def recv_splits(self, r: int) -> list[int]:
        return [int(x) for x in self.counts[r]]

    def send_splits(self, s: int) -> list[int]:
        return [int(x) for x in self.counts[:, s]]

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def any_traffic(self) -> bool:
        """False when no rank needs anything remote (then no collective is issued at all)."""
        return bool(self.counts.sum())

    def num_ranges(self, r: int, s: int) -> int:
        """Merged key ranges ``r`` needs from ``s`` (pieces adjacent in ``s``'s local order count once)."""
        p = self.pieces[r][s]
        if len(p) == 0:
            return 0
        ends = p[:, 2] + (p[:, 1] - p[:, 0])
        return int(1 + np.count_nonzero(p[1:, 2] != ends[:-1]))

    def send_index(self, s: int) -> np.ndarray:
        """Local positions of ``s`` to send, receiver ``0, 1, ...`` in turn (splits: :meth:`send_splits`)."""
        key = ("send", s)
        if key not in self._cache:
            parts = [np.arange(l0, l0 + (g1 - g0)) for r in range(self.world_size) for g0, g1, l0 in self.pieces[r][s]]
            self._cache[key] = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        return self._cache[key]

    def send_ranges(self, s: int) -> list[tuple[int, int]]:
        """:meth:`send_index` as runs of consecutive local positions ``(start, end)`` (one copy each
        instead of an indexed gather)."""
        key = ("send_ranges", s)
        if key not in self._cache:
            idx = self.send_index(s)
            cut = np.nonzero(np.diff(idx) != 1)[0] + 1
            self._cache[key] = [(int(run[0]), int(run[-1]) + 1) for run in np.split(idx, cut) if run.size]
        return self._cache[key]

    def recv_segments(self, r: int) -> list[tuple[int, int, int]]:
        """Layout of the keys ``r`` receives: ``(global_start, global_end, offset in the received buffer)``."""
        out, off = [], 0
        for s in range(self.world_size):
            for g0, g1, _ in self.pieces[r][s]:
                out.append((int(g0), int(g1), off))
                off += int(g1 - g0)
        return out

    def remote_mask(self, r: int):
        """Mask between ``r``'s local queries and its received keys (``None`` when nothing is received
        or nothing received is attended)."""
        key = ("remote", r)
        if key not in self._cache:
            n = int(self.counts[r].sum())
            m = None
            if n:
                m = layout_mask(self.plan.mask, self.plan.segments((r,)), self.recv_segments(r), self.plan.local_len, n,
                                name=f"{self.plan.mask.name}@{self.plan.kind}[{r}]x(received)")
            self._cache[key] = m
        return self._cache[key]

    def _joint_segments(self, r: int) -> list[tuple[int, int, int, int]]:
        """``r``'s own and received key segments in global order: ``(global_start, global_end,
        source, source_start)``, source 0 = own local position, 1 = offset in the received buffer."""
        return sorted([(g0, g1, 0, l0) for g0, g1, l0 in self.plan.segments((r,))]
                      + [(g0, g1, 1, off) for g0, g1, off in self.recv_segments(r)])

    def joint_pieces(self, r: int) -> list[tuple[int, int, int, int]]:
        """The layout of ``group_cast``'s joint key buffer of ``r``: its own keys and the received
        ones **in global order** (so a row's keys stay one interval where they are one in the mask,
        and the kernel's tiles see the single-GPU structure), as ``(joint_start, joint_end, source,
        source_start)``; runs contiguous in both the joint buffer and their source are merged."""
        key = ("joint_pieces", r)
        if key not in self._cache:
            out, pos = [], 0
            for g0, g1, src, start in self._joint_segments(r):
                n = g1 - g0
                if out and out[-1][2] == src and out[-1][3] + (out[-1][1] - out[-1][0]) == start:
                    out[-1] = (out[-1][0], pos + n, src, out[-1][3])
                else:
                    out.append((pos, pos + n, src, start))
                pos += n
            self._cache[key] = out
        return self._cache[key]

    def joint_mask(self, r: int):
        """Mask between ``r``'s local queries and its joint key buffer (:meth:`joint_pieces`:
        own and received keys in global order; ``None`` when nothing is attended): the one call of
        ``group_cast``'s joint mode."""
        key = ("joint", r)
        if key not in self._cache:
            ks, pos = [], 0
            for g0, g1, _, _ in self._joint_segments(r):
                ks.append((g0, g1, pos))
                pos += g1 - g0
            self._cache[key] = layout_mask(self.plan.mask, self.plan.segments((r,)), ks, self.plan.local_len, pos,
                                           name=f"{self.plan.mask.name}@{self.plan.kind}[{r}]x(own+received)")
        return self._cache[key]

    def describe(self) -> str:
        recv = self.counts.sum(axis=1)
        return (f"NeedLayout(N={self.world_size}, tokens received per rank {recv.tolist()} of "
                f"{self.plan.local_len * (self.world_size - 1)} an all-gather moves)")


def need_layout(plan: CPPlan) -> NeedLayout:
    """The :class:`NeedLayout` of a plan (computed once, cached on the plan)."""
    if "need_layout" in plan._cache:
        return plan._cache["need_layout"]
    N, c, C = plan.world_size, plan.chunk_size, plan.num_chunks
    owner = np.empty(C, dtype=np.int64)
    local0 = np.empty(C, dtype=np.int64)  # local start of every chunk in its owner
    for r, chs in enumerate(plan.chunks):
        for i, ch in enumerate(chs):
            owner[ch], local0[ch] = r, i * c
    cpos, clo, chi = chunk_needs(plan.mask, c, C)
    # per receiver: the union of its chunks' needs
    rpos, rlo, rhi = merge_intervals(N, owner[cpos], clo, chi, extent=plan.mask.seqlen_k)
    # cut every interval at chunk boundaries: one piece per (interval, chunk it overlaps)
    first, last = rlo // c, (rhi - 1) // c
    span = last - first + 1
    idx = np.repeat(np.arange(rpos.size), span)
    ch = np.repeat(first, span) + (np.arange(idx.size) - np.repeat(np.cumsum(span) - span, span))
    g0 = np.maximum(rlo[idx], ch * c)
    g1 = np.minimum(rhi[idx], (ch + 1) * c)
    recv = rpos[idx]
    own = owner[ch]
    keep = own != recv  # a rank's own keys never move
    recv, own, ch, g0, g1 = recv[keep], own[keep], ch[keep], g0[keep], g1[keep]
    l0 = g0 - ch * c + local0[ch]
    order = np.lexsort((l0, own, recv))
    recv, own, g0, g1, l0 = recv[order], own[order], g0[order], g1[order], l0[order]
    counts = np.zeros((N, N), dtype=np.int64)
    np.add.at(counts, (recv, own), g1 - g0)
    rows = np.stack([g0, g1, l0], axis=1)
    bounds = np.searchsorted(recv * N + own, np.arange(N * N + 1))
    pieces = [[rows[bounds[r * N + s]: bounds[r * N + s + 1]] for s in range(N)] for r in range(N)]
    lay = NeedLayout(plan, pieces, counts)
    plan._cache["need_layout"] = lay
    return lay

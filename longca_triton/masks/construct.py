"""Building a ``RangeMask`` from per-row key intervals, and the constructors built on it.

A row of a range mask allows one or more key intervals. Where every row allows one interval
``[lo[i], hi[i]]`` (inclusive) and both ends move by 0 or 1 key per row over a run of rows, that run
is one slice of the IR (docs/masks.md §1):

==============  ==============  ===========
``lo`` per row  ``hi`` per row  slice kind
==============  ==============  ===========
constant        constant        FULL
constant        +1              CAUSAL
+1              constant        INVCAUSAL
+1              +1              BICAUSAL
==============  ==============  ===========

Any other step starts a new run, so every single-interval mask is expressible; structured masks
(causal, windows, documents) give a few slices, found in ``O(S)`` with one Python step per slice.
A row with several intervals is peeled into layers: layer ``t`` holds the ``t``-th interval of every
row, each layer becomes slices as above, and the mask is their union.

The constructors on top: FlashAttention's causal / window rule (``window_mask``), packed documents
given by ``cu_seqlens`` (``from_cu_seqlens``), a Flex-style predicate (``from_mask_mod``), a bool
tensor (``from_dense``), and a batch of masks packed on the diagonal (``block_diagonal``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from .ir import RangeMask, SliceKind

__all__ = ["block_diagonal", "from_cu_seqlens", "from_dense", "from_mask_mod", "from_row_intervals", "window_mask"]

#: up to this many documents ``from_cu_seqlens`` builds each one's slices from its breakpoints
ANALYTIC_DOCS = 2048
#: (lo step, hi step) inside a run -> the slice kind it is
_KIND_OF_STEPS = {(0, 0): SliceKind.FULL, (0, 1): SliceKind.CAUSAL, (1, 0): SliceKind.INVCAUSAL,
                  (1, 1): SliceKind.BICAUSAL}

#: booleans one chunk of a predicate's evaluation may hold (rows x keys): 4 MiB
_CHUNK_ELEMENTS = 1 << 22


def _layer_slices(lo: np.ndarray, hi: np.ndarray) -> list:
    """The slices of one layer: row ``i`` allows keys ``lo[i] .. hi[i]`` (inclusive, already clipped)."""
    n = lo.shape[0]
    live = hi >= lo
    # step code of row i from row i - 1: 2 * dlo + dhi for steps in {0, 1} between two live rows, else -1
    dlo, dhi = np.diff(lo), np.diff(hi)
    code = np.where(live[1:] & live[:-1] & (dlo >= 0) & (dlo <= 1) & (dhi >= 0) & (dhi <= 1), 2 * dlo + dhi, -1)
    # the last index of the equal-code stretch that holds each index of ``code``
    change = np.flatnonzero(np.diff(code)) if code.size else np.zeros(0, np.int64)
    stretch_end = np.repeat(np.append(change, code.size - 1), np.diff(np.concatenate(([-1], change, [code.size - 1]))))
    slices = []
    i = int(np.argmax(live)) if live.any() else n
    while i < n:
        if not live[i]:
            nxt = np.flatnonzero(live[i:])
            if nxt.size == 0:
                break
            i += int(nxt[0])
        if i + 1 < n and code[i] >= 0:  # rows i .. e share one step pattern (code[i] is row i+1's step)
            e = int(stretch_end[i]) + 1
            kind = _KIND_OF_STEPS[divmod(int(code[i]), 2)]
        else:
            e, kind = i, SliceKind.FULL
        slices.append((i, e + 1, int(lo[i]), int(hi[e]) + 1, kind))
        i = e + 1
    return slices


def from_row_intervals(lo, hi, seqlen_k: int, *, name: str = "range", params: dict | None = None) -> RangeMask:
    """The ``RangeMask`` whose row ``i`` allows keys ``lo[i] <= j <= hi[i]`` (inclusive); a row with
    ``hi[i] < lo[i]`` allows none. ``lo`` and ``hi`` are clipped to ``[0, seqlen_k)``.

    ``lo`` and ``hi`` may also be ``[Sq, K]``: row ``i`` then allows the union of its ``K`` intervals
    ``lo[i, t] .. hi[i, t]`` (a slot with ``hi < lo`` is unused); each column ``t`` becomes slices of
    its own."""
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    if lo.ndim not in (1, 2) or lo.shape != hi.shape:
        raise ValueError(f"lo and hi must have one entry per query row ([Sq], or [Sq, K] for K intervals a row), "
                         f"got shapes {lo.shape} and {hi.shape}")
    if lo.shape[0] < 1:
        raise ValueError("lo and hi need at least one query row")
    lo2, hi2 = lo.reshape(lo.shape[0], -1), hi.reshape(hi.shape[0], -1)
    lo2, hi2 = np.clip(lo2, 0, None), np.minimum(hi2, int(seqlen_k) - 1)
    slices = [s for t in range(lo2.shape[1]) for s in _layer_slices(lo2[:, t], hi2[:, t])]
    return RangeMask(lo.shape[0], int(seqlen_k), slices, name=name, params=params)


def _check_window(window_size, causal: bool) -> tuple[int, int]:
    """``(left, right)`` of FlashAttention's ``window_size`` (``-1`` unbounded), ``right = 0`` under ``causal``."""
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    for w in window_size:
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < -1:
            raise ValueError(f"window_size entries must be -1 (unbounded) or integers >= 0, got {tuple(window_size)}")
    left, right = (int(w) for w in window_size)
    return left, (0 if causal else right)


def _window_bounds(local_row, len_q, len_k, left: int, right: int):
    """Inclusive key bounds, local to a (query, key) pair of lengths ``len_q, len_k``, of FlashAttention's
    bottom-right aligned rule for local query rows ``local_row`` (numpy, broadcasting)."""
    diag = local_row + (len_k - len_q)
    lo = np.zeros_like(diag) if left < 0 else np.maximum(diag - left, 0)
    hi = len_k - 1 + np.zeros_like(diag) if right < 0 else np.minimum(diag + right, len_k - 1)
    return lo, hi


def _window_slices(len_q: int, len_k: int, left: int, right: int) -> list:
    """The slices of ``_window_bounds`` over one (query, key) pair of lengths ``len_q, len_k``, from its
    breakpoints alone (``O(1)``): the rows that attend something, cut where ``lo`` leaves 0 and where
    ``hi`` reaches ``len_k - 1``; between cuts each end is constant or moves one key a row (module doc)."""
    if len_q == 0 or len_k == 0:
        return []
    d = len_k - len_q
    r0 = 0 if right < 0 else max(0, -d - right)  # rows before r0 end before key 0
    r1 = len_q if left < 0 else min(len_q, len_k - d + left)  # rows from r1 on start past the last key
    if r0 >= r1:
        return []
    a = r1 if left < 0 else min(max(left - d, r0), r1)  # lo follows the diagonal from row a on
    b = r0 if right < 0 else min(max(len_k - d - right, r0), r1)  # hi follows it before row b
    out = []
    for s, e in zip(*(lambda c: (c[:-1], c[1:]))(sorted({r0, r1, a, b}))):
        lo_diag, hi_diag = s >= a, s < b
        k0 = s + d - left if lo_diag else 0
        k1 = (e - 1) + d + right + 1 if hi_diag else len_k
        out.append((s, e, k0, k1, _KIND_OF_STEPS[(int(lo_diag), int(hi_diag))]))
    return out


def _window_name(causal: bool, left: int, right: int) -> str:
    return "causal" if causal and left < 0 else ("full" if left < 0 and right < 0 else "window")


def window_mask(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size=(-1, -1)) -> RangeMask:
    """FlashAttention's mask: query ``i`` attends key ``j`` when
    ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (aligned to the bottom-right corner), with
    ``left`` / ``right`` of ``-1`` unbounded and ``causal`` meaning ``right = 0``. Rows that attend
    nothing (``Sq > Sk`` under causal) give zeros and ``lse = -inf``."""
    left, right = _check_window(window_size, causal)
    params = {"causal": bool(causal), "window_size": [left, right]}
    return RangeMask(int(seqlen_q), int(seqlen_k), _window_slices(int(seqlen_q), int(seqlen_k), left, right),
                     name=_window_name(causal, left, right), params=params)


def _check_cu_seqlens(label: str, cu) -> np.ndarray:
    """``cu`` (torch int32/int64, numpy or list) as an int64 numpy array ``0 = c0 <= c1 <= ... <= cB``."""
    if isinstance(cu, torch.Tensor):
        if cu.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{label} must be an int32 or int64 tensor, got {cu.dtype}")
        arr = cu.detach().cpu().numpy()
    else:
        arr = np.asarray(cu)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{label} must hold integers, got {arr.dtype}")
    if arr.ndim != 1 or arr.size < 2:
        raise ValueError(f"{label} must be 1-D [num_docs + 1] with at least one document, got shape {arr.shape}")
    arr = arr.astype(np.int64)
    if arr[0] != 0:
        raise ValueError(f"{label} must start at 0, got {int(arr[0])}")
    bad = np.flatnonzero(np.diff(arr) < 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{label} must not decrease: entry {i} = {int(arr[i])} > entry {i + 1} = {int(arr[i + 1])}")
    return arr


def from_cu_seqlens(cu_seqlens_q, cu_seqlens_k=None, causal: bool = False, window_size=(-1, -1)) -> RangeMask:
    """Packed documents: query document ``b`` (rows ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]``) attends
    key document ``b`` only, under FlashAttention's causal / window rule aligned to that pair's own
    bottom-right corner (``window_mask`` per document). ``cu_seqlens_k`` defaults to
    ``cu_seqlens_q`` (self-attention). Empty documents are allowed; a query document whose key
    document is empty attends nothing. Up to ``ANALYTIC_DOCS`` documents each becomes its few slices
    from its breakpoints; more go through the tokens' intervals (``O(total)``, no Python loop)."""
    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    cu_k = cu_q if cu_seqlens_k is None else _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k)
    if cu_k.size != cu_q.size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe as many documents, got "
                         f"{cu_q.size - 1} and {cu_k.size - 1}")
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    if total_q < 1 or total_k < 1:
        raise ValueError(f"the documents hold {total_q} query and {total_k} key tokens; both must be positive")
    left, right = _check_window(window_size, causal)
    len_q, len_k = np.diff(cu_q), np.diff(cu_k)
    params = {"doc_bounds": cu_q.tolist(), "causal": bool(causal), "window_size": [left, right]}
    if cu_seqlens_k is not None:
        params["k_doc_bounds"] = cu_k.tolist()
    name = _window_name(causal, left, right) + "_document"
    if len_q.size <= ANALYTIC_DOCS:
        # a few slices a document from its breakpoints: no pass over the tokens
        slices = [(int(cq) + s, int(cq) + e, int(ck) + k0, int(ck) + k1, kind)
                  for cq, ck, lq, lk in zip(cu_q[:-1], cu_k[:-1], len_q.tolist(), len_k.tolist())
                  for s, e, k0, k1, kind in _window_slices(lq, lk, left, right)]
        return RangeMask(total_q, total_k, slices, name=name, params=params)
    doc = np.repeat(np.arange(len_q.size), len_q)  # the document of every query row
    lo, hi = _window_bounds(np.arange(total_q) - cu_q[doc], len_q[doc], len_k[doc], left, right)
    return from_row_intervals(lo + cu_k[doc], hi + cu_k[doc], total_k, name=name, params=params)


def _row_runs(allowed: torch.Tensor, row0: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat ``(row, lo, hi)`` (half-open, sorted by row then ``lo``) of the allowed runs of a bool
    ``[R, Sk]`` chunk whose first row is ``row0``."""
    a = torch.nn.functional.pad(allowed.to(torch.int8), (1, 1))
    step = a[:, 1:] - a[:, :-1]  # +1 where a run starts, -1 one past where it ends
    starts, ends = (step == 1).nonzero().cpu().numpy(), (step == -1).nonzero().cpu().numpy()
    return starts[:, 0] + row0, starts[:, 1], ends[:, 1]


def _from_runs(seqlen_q: int, seqlen_k: int, runs: list, max_intervals: int | None, name: str,
               params: dict | None = None) -> RangeMask:
    """The ``RangeMask`` of flat ``(row, lo, hi)`` runs (chunks in row order), one layer per interval slot."""
    rows, lo, hi = (np.concatenate([r[i] for r in runs]).astype(np.int64) for i in range(3))
    counts = np.bincount(rows, minlength=seqlen_q)
    if max_intervals is not None and counts.size and counts.max() > max_intervals:
        i = int(np.argmax(counts))
        raise ValueError(f"query row {i} allows {int(counts[i])} separate key intervals, more than "
                         f"max_intervals={max_intervals}; pass a larger max_intervals (or None), or use a BlockSparseMask")
    slot = np.arange(rows.size) - (np.cumsum(counts) - counts)[rows]
    slices = []
    for t in range(int(counts.max()) if counts.size else 0):
        sel = slot == t
        lo_t, hi_t = np.zeros(seqlen_q, np.int64), np.full(seqlen_q, -1, np.int64)
        lo_t[rows[sel]], hi_t[rows[sel]] = lo[sel], hi[sel] - 1
        slices += _layer_slices(lo_t, hi_t)
    return RangeMask(seqlen_q, seqlen_k, slices, name=name, params=params)


def _check_seqlen(label: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{label} must be a positive integer, got {value!r}")
    return int(value)


def _evaluate(mask_mod: Callable, b, h, q_idx: torch.Tensor, kv_idx: torch.Tensor, row0: int) -> torch.Tensor:
    """``mask_mod`` on the chunk of rows that starts at ``row0``, as a bool ``[rows, Sk]`` tensor; its
    failures as one ``ValueError``."""
    shape = (q_idx.shape[0], kv_idx.shape[1])
    rows = f"query rows {row0}..{row0 + shape[0] - 1}"
    try:
        out = mask_mod(b, h, q_idx, kv_idx)
    except Exception as e:  # a predicate that fails on index tensors: say where, keep the cause
        raise ValueError(f"mask_mod failed on {rows} (b={int(b)}, h={int(h)}): {type(e).__name__}: {e}") from e
    out = torch.as_tensor(out)
    if out.dtype != torch.bool:
        raise ValueError(f"mask_mod must return a bool tensor, got {out.dtype}")
    try:
        return torch.broadcast_to(out, shape)
    except RuntimeError:
        raise ValueError(f"mask_mod returned shape {tuple(out.shape)} for {rows}, which does not broadcast to "
                         f"[rows, Sk] = {list(shape)}") from None


def from_mask_mod(mask_mod: Callable, seqlen_q: int, seqlen_k: int, device="cpu", *, max_intervals: int | None = 64,
                  chunk_elements: int = _CHUNK_ELEMENTS) -> RangeMask:
    """The ``RangeMask`` of a FlexAttention-style predicate ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    ``mask_mod`` is called on index tensors, ``q_idx [R, 1]`` and ``kv_idx [1, Sk]`` (int64, on
    ``device``) for chunks of ``R`` rows of at most ``chunk_elements`` pairs, so no ``Sq x Sk``
    tensor is built; it must broadcast them to a bool ``[R, Sk]`` (plain comparisons and indexing of
    lookup tensors do). Each row's allowed runs of keys become its intervals (``from_row_intervals``,
    one layer per interval slot); a row with more than ``max_intervals`` intervals is a
    ``ValueError`` (``None``: no bound).

    A range mask is one mask for every batch element and head: ``mask_mod`` is evaluated at
    ``b = h = 0``, and on the first and last chunk also at ``(b, h) = (1, 0)`` and ``(0, 1)``; a
    difference is a ``ValueError`` (build one mask per batch element and pass the list to
    ``lt.attention``). A probe that raises ``IndexError`` (a lookup table of one batch element or
    head) is skipped.
    """
    if not callable(mask_mod):
        raise ValueError(f"mask_mod must be callable as mask_mod(b, h, q_idx, kv_idx), got {type(mask_mod).__name__}")
    sq, sk = _check_seqlen("seqlen_q", seqlen_q), _check_seqlen("seqlen_k", seqlen_k)
    if max_intervals is not None:
        max_intervals = _check_seqlen("max_intervals", max_intervals)
    step = max(1, _check_seqlen("chunk_elements", chunk_elements) // sk)
    kv_idx = torch.arange(sk, device=device)[None, :]
    zero, one = torch.zeros((), dtype=torch.int64, device=device), torch.ones((), dtype=torch.int64, device=device)
    runs = []
    for r0 in range(0, sq, step):
        q_idx = torch.arange(r0, min(sq, r0 + step), device=device)[:, None]
        allowed = _evaluate(mask_mod, zero, zero, q_idx, kv_idx, r0)
        if r0 == 0 or r0 + step >= sq:
            for b, h in ((one, zero), (zero, one)):
                try:
                    other = _evaluate(mask_mod, b, h, q_idx, kv_idx, r0)
                except ValueError as e:
                    if isinstance(e.__cause__, IndexError):
                        continue
                    raise
                if not torch.equal(other, allowed):
                    raise ValueError(f"mask_mod depends on the batch or head index (b={int(b)}, h={int(h)} differs from "
                                     "b=h=0); a RangeMask is one mask for all: pass lt.attention a list of one mask per "
                                     "batch element instead")
        runs.append(_row_runs(allowed, r0))
    params = {"mask_mod": getattr(mask_mod, "__name__", type(mask_mod).__name__)}
    return _from_runs(sq, sk, runs, max_intervals, name="mask_mod", params=params)


def from_dense(dense, *, max_intervals: int | None = None) -> RangeMask:
    """The ``RangeMask`` of a bool ``[Sq, Sk]`` tensor (True = attend), row by row as its runs of
    allowed keys; ``max_intervals`` bounds the intervals of a row (``None``: no bound)."""
    if isinstance(dense, np.ndarray):
        dense = torch.from_numpy(dense)
    if not isinstance(dense, torch.Tensor) or dense.dtype != torch.bool or dense.dim() != 2:
        what = f"{dense.dtype} tensor of shape {tuple(dense.shape)}" if isinstance(dense, torch.Tensor) else type(dense).__name__
        raise ValueError(f"from_dense needs a bool [Sq, Sk] tensor, got a {what}")
    sq, sk = (_check_seqlen(label, n) for label, n in zip(("Sq", "Sk"), dense.shape))
    step = max(1, _CHUNK_ELEMENTS // sk)
    runs = [_row_runs(dense[r0:r0 + step], r0) for r0 in range(0, sq, step)]
    return _from_runs(sq, sk, runs, max_intervals, name="dense")


def block_diagonal(masks: Sequence[RangeMask]) -> RangeMask:
    """The masks placed on the diagonal of one packed sequence: mask ``b``'s rows and keys are offset by
    the query and key lengths of the masks before it, and nothing attends across two masks."""
    masks = list(masks)
    if not masks:
        raise ValueError("block_diagonal needs at least one mask")
    for n, m in enumerate(masks):
        if not isinstance(m, RangeMask):
            raise ValueError(f"mask {n} is a {type(m).__name__}; only RangeMasks pack into one range mask")
    slices, oq, ok = [], 0, 0
    for m in masks:
        slices += [(qs + oq, qe + oq, ks + ok, ke + ok, kind) for qs, qe, ks, ke, kind in m.slices]
        oq, ok = oq + m.seqlen_q, ok + m.seqlen_k
    return RangeMask(oq, ok, slices, name="block_diagonal", params={"parts": [m.name for m in masks]})

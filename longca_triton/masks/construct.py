"""Building a ``RangeMask`` from per-row key intervals, and FlashAttention's causal / window masks.

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
"""

from __future__ import annotations

import numpy as np

from .ir import RangeMask, SliceKind

__all__ = ["from_row_intervals", "window_mask"]

#: (lo step, hi step) inside a run -> the slice kind it is
_KIND_OF_STEPS = {(0, 0): SliceKind.FULL, (0, 1): SliceKind.CAUSAL, (1, 0): SliceKind.INVCAUSAL,
                  (1, 1): SliceKind.BICAUSAL}


def from_row_intervals(lo, hi, seqlen_k: int, *, name: str = "range", params: dict | None = None) -> RangeMask:
    """The ``RangeMask`` whose row ``i`` allows keys ``lo[i] <= j <= hi[i]`` (inclusive); a row with
    ``hi[i] < lo[i]`` allows none. ``lo`` and ``hi`` are clipped to ``[0, seqlen_k)``."""
    lo = np.clip(np.asarray(lo, dtype=np.int64).reshape(-1), 0, None)
    hi = np.minimum(np.asarray(hi, dtype=np.int64).reshape(-1), int(seqlen_k) - 1)
    if lo.shape != hi.shape:
        raise ValueError(f"lo and hi must have one entry per query row, got {lo.shape[0]} and {hi.shape[0]}")
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
    return RangeMask(n, int(seqlen_k), slices, name=name, params=params)


def window_mask(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size=(-1, -1)) -> RangeMask:
    """FlashAttention's mask: query ``i`` attends key ``j`` when
    ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (aligned to the bottom-right corner), with
    ``left`` / ``right`` of ``-1`` unbounded and ``causal`` meaning ``right = 0``. Rows that attend
    nothing (``Sq > Sk`` under causal) give zeros and ``lse = -inf``."""
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be -1 (unbounded) or >= 0, got {tuple(window_size)}")
    if causal:
        right = 0
    sq, sk = int(seqlen_q), int(seqlen_k)
    diag = np.arange(sq, dtype=np.int64) + (sk - sq)
    lo = np.zeros(sq, np.int64) if left < 0 else diag - left
    hi = np.full(sq, sk - 1, np.int64) if right < 0 else diag + right
    params = {"causal": bool(causal), "window_size": [left, right]}
    name = "causal" if causal and left < 0 else ("full" if left < 0 and right < 0 else "window")
    return from_row_intervals(lo, hi, sk, name=name, params=params)

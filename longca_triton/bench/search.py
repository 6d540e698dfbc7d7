"""Successive halving over launch configs: rank every candidate cheaply, time the few best fully.

Why: the exhaustive search times every candidate on every case of a problem class with full
repetitions; most candidates lose by 10-40% on any one case, which a short timing of the
heaviest case already shows. So:

1. **screen**: each candidate on one representative case (the one with the most FLOPs), few
   repetitions; candidates that fail to compile or launch drop out here;
2. **final**: the best ``keep`` of them (at least ``min_keep``) on every case, full repetitions,
   scored by the geometric mean of TFLOP/s; the best score wins.

Compiled kernels are reused between the rounds (Triton keeps them per process), so the final
round only times. ``exhaustive=True`` skips the screen (every candidate goes to the final round),
which is the search this module replaced; ``deadline`` (a ``time.monotonic()`` value, or a
callable saying whether to stop: a budget that Ctrl-C may end early) stops measuring new
candidates once passed and decides among those measured.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

__all__ = ["SearchResult", "halving_search", "geomean", "past", "planned_measurements"]


def past(deadline: float | Callable[[], bool] | None) -> bool:
    """Whether ``deadline`` has passed: a ``time.monotonic()`` value, or a callable that says so."""
    if deadline is None:
        return False
    return bool(deadline()) if callable(deadline) else time.monotonic() > deadline


def geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(max(x, 1e-9)) for x in xs) / len(xs)) if xs else 0.0


@dataclass
class SearchResult:
    best: dict | None  # the winning candidate (None: every candidate failed)
    score: float  # its final-round geometric-mean TFLOP/s
    screened: list[tuple[float, dict]] = field(default_factory=list)  # (screen score, cand), best first
    finals: list[tuple[float, dict]] = field(default_factory=list)  # (final score, cand), best first
    failures: list[str] = field(default_factory=list)
    measurements: int = 0
    stopped_by_deadline: bool = False


def _keep_count(n: int, keep_fraction: float, min_keep: int) -> int:
    return min(n, max(min_keep, math.ceil(n * keep_fraction)))


def planned_measurements(n_candidates: int, n_cases: int, *, exhaustive: bool = False,
                         keep_fraction: float = 0.25, min_keep: int = 3) -> int:
    """How many timed runs ``halving_search`` makes (for a progress bar's total)."""
    if exhaustive:
        return n_candidates * n_cases
    return n_candidates + _keep_count(n_candidates, keep_fraction, min_keep) * n_cases


def halving_search(
    candidates: Sequence[dict],
    cases: Sequence,
    measure: Callable[[dict, object, bool], float],
    *,
    weight: Callable[[object], float] | None = None,
    exhaustive: bool = False,
    keep_fraction: float = 0.25,
    min_keep: int = 3,
    deadline: float | Callable[[], bool] | None = None,
    on_measure: Callable[[str, dict, object, float | None, str], None] | None = None,
) -> SearchResult:
    """Search ``candidates`` on ``cases``.

    ``measure(candidate, case, quick)`` returns TFLOP/s (``quick``: a short timing for the screen)
    and raises on a candidate that cannot run. ``weight(case)`` picks the screening case (the
    largest; default the first case). ``on_measure(round, candidate, case, tflops or None, error)``
    is called after every timed run (progress bars, ``-v`` logs).
    """
    res = SearchResult(best=None, score=0.0)
    if not candidates or not cases:
        return res

    def timed_out() -> bool:
        return past(deadline)

    def run(round_: str, cand: dict, case, quick: bool) -> float | None:
        try:
            tf = float(measure(cand, case, quick))
        except Exception as e:  # a config that cannot compile or launch is skipped, not fatal
            msg = f"{cand}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"
            res.failures.append(msg)
            res.measurements += 1
            if on_measure:
                on_measure(round_, cand, case, None, msg)
            return None
        res.measurements += 1
        if on_measure:
            on_measure(round_, cand, case, tf, "")
        return tf

    if exhaustive:
        finalists = list(candidates)
    else:
        rep_case = max(cases, key=weight) if weight else cases[0]
        for cand in candidates:
            if timed_out() and res.screened:
                res.stopped_by_deadline = True
                break
            tf = run("screen", cand, rep_case, True)
            if tf is not None:
                res.screened.append((tf, cand))
        res.screened.sort(key=lambda t: -t[0])
        finalists = [c for _, c in res.screened[:_keep_count(len(res.screened), keep_fraction, min_keep)]]

    for cand in finalists:
        if timed_out() and res.finals:
            res.stopped_by_deadline = True
            break
        scores = []
        for case in cases:
            tf = run("final", cand, case, False)
            if tf is None:
                scores = []
                break
            scores.append(tf)
        if scores:
            res.finals.append((geomean(scores), cand))
    res.finals.sort(key=lambda t: -t[0])
    if res.finals:
        res.score, res.best = res.finals[0]
    return res

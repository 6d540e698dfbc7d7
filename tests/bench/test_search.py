"""The autotune search (successive halving) on made-up timings: it finds what the exhaustive search
finds when the screen ranks like the final round, drops failing candidates, keeps its budget."""

import time

import pytest

from longca_triton.bench.search import geomean, halving_search, planned_measurements

CANDS = [dict(BLOCK_M=m, num_warps=w, num_stages=s) for m in (64, 128) for w in (4, 8) for s in (2, 3, 4)]
CASES = ["4K", "16K"]


def speed(c, case):
    # a smooth landscape: 128 x 8 warps x 3 stages is best, 16K runs faster than 4K
    base = 300 + (c["BLOCK_M"] == 128) * 60 + (c["num_warps"] == 8) * 40 - abs(c["num_stages"] - 3) * 25
    return base * (1.2 if case == "16K" else 1.0)


def test_matches_the_exhaustive_search_and_times_less():
    calls = []

    def measure(c, case, quick):
        calls.append((quick, case))
        return speed(c, case) * (0.97 if quick else 1.0)  # the short timing is biased, not reordered

    full = halving_search(CANDS, CASES, lambda c, case, q: speed(c, case), exhaustive=True)
    fast = halving_search(CANDS, CASES, measure, weight=lambda case: 4 if case == "16K" else 1)
    assert fast.best == full.best == dict(BLOCK_M=128, num_warps=8, num_stages=3)
    assert fast.score == pytest.approx(full.score)
    assert full.measurements == len(CANDS) * len(CASES) == 24
    assert fast.measurements == planned_measurements(len(CANDS), len(CASES)) == 12 + 3 * 2
    # the screen ran on the heaviest case only, with short timings
    assert {case for quick, case in calls if quick} == {"16K"}
    assert sum(quick for quick, _ in calls) == len(CANDS)


def test_failing_candidates_are_recorded_and_skipped():
    def measure(c, case, quick):
        if c["num_stages"] == 4:
            raise RuntimeError("out of resource: shared memory\nmore lines")
        return speed(c, case)

    res = halving_search(CANDS, CASES, measure)
    assert res.best["num_stages"] != 4
    assert len(res.failures) == 4 and all("out of resource: shared memory" in f for f in res.failures)
    assert all("more lines" not in f for f in res.failures)


def test_all_failing_gives_no_winner():
    def measure(c, case, quick):
        raise ValueError("nope")

    res = halving_search(CANDS, CASES, measure)
    assert res.best is None and res.score == 0.0 and len(res.failures) == len(CANDS)


def test_deadline_stops_early_but_decides():
    def measure(c, case, quick):
        time.sleep(0.01)
        return speed(c, case)

    res = halving_search(CANDS, CASES, measure, deadline=time.monotonic() + 0.03)
    assert res.stopped_by_deadline
    assert res.best is not None and res.measurements < planned_measurements(len(CANDS), len(CASES))


def test_progress_callback_sees_every_measurement():
    seen = []
    res = halving_search(CANDS, CASES, lambda c, case, q: speed(c, case),
                         on_measure=lambda rnd, c, case, tf, err: seen.append((rnd, tf)))
    assert len(seen) == res.measurements
    assert {r for r, _ in seen} == {"screen", "final"}


def test_geomean():
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert geomean([]) == 0.0

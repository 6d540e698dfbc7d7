"""autotune's search over a made-up kernel on the CPU: it searches by successive halving, writes the
cache as tuning-table rows, and a second run over the same cases reuses the cache without timing
anything (--force tunes again); an old-format cache is no entry and one warning. Timings are
wall-clock here; only the bookkeeping is under test."""

import json
import logging
import time

import pytest
import torch

from longca_triton.bench import autotune_run as run
from longca_triton.kernels.core import tuned
from longca_triton.kernels.tuning import Problem, Row, parse_rows
from longca_triton.masks import make_mask


@pytest.fixture
def cache(autotune_cache):
    return autotune_cache


def fake_tunable(calls):
    """Candidates X = 0..7 (the default 0); X = 3 is the fastest by a few ms, so the search's path is fixed."""
    def attend(q, k, v, mask, config):
        calls.append(dict(config))
        time.sleep(0.003 * abs(config["X"] - 3))
        return q * (1.0 + config["X"])

    return run.Tunable(name="fake", groups={"fwd": "fwd"},
                       candidates=lambda group, block, head_dim: [dict(X=i) for i in range(8)],
                       run=attend, default=lambda head_dim, dtype, mask=None, group=1: dict(X=0))


def cases():
    return [run.TuneCase(make_mask(m, 64), 2, 1, 16, torch.float32, label=f"{m} S=64") for m in ("causal", "full")]


def test_tune_writes_then_reuses_the_cache(cache):
    calls = []
    t, cs = fake_tunable(calls), cases()
    first = run.tune(t, cs, 64, device="cpu")
    assert {s["reused"] for s in first} == {False}
    assert {s["search"]["method"] for s in first} == {"successive halving"}
    n_first = len(calls)
    # per class (one case each): default 1 + screen 8 + final 3 + tuned re-measure 1
    assert n_first == len(first) * (1 + 8 + 3 + 1)
    assert all(s["search"]["measurements"] == 13 for s in first)
    assert cache.exists()
    rows = tuned.device_rows(tuned.device_key("cpu"), "fake")
    assert len(rows) == len(first) and {r.mode for r in rows} == {"fwd"}
    assert sorted(r.match["mask"] for r in rows) == ["full", "masked"]
    for r, s in zip(rows, first):
        assert r.config == s["tuned"] and r.measured["cases"] == s["cases"]
        assert r.measured["tflops"]["fwd"]["tuned"] == s["tuned_tflops"]["fwd"]
        assert str(cache) in r.results and "TFLOP/s tuned vs default: fwd" in r.note

    again = run.tune(t, cs, 64, device="cpu")
    assert len(calls) == n_first, "a warm cache must not time anything"
    assert {s["reused"] for s in again} == {True}
    assert [s["tuned"] for s in again] == [s["tuned"] for s in first]

    forced = run.tune(t, cs, 64, device="cpu", force=True)
    assert len(calls) == 2 * n_first and {s["reused"] for s in forced} == {False}


def test_per_case_numbers_and_the_screen_case(cache):
    """Each class keeps default and tuned TFLOP/s per case (the summary compares the vendors there);
    the heaviest case is the one the search screens on and the vendors are timed on."""
    calls = []
    cs = [run.TuneCase(make_mask("sliding_window_causal", 256, window=w), 2, 1, 16, torch.float32, label=f"window {w}")
          for w in (16, 64, 32)]
    assert run.screen_case(cs).label == "window 64"
    (s,) = run.tune(fake_tunable(calls), cs, 64, device="cpu")
    per = s["per_case"]["fwd"]
    assert sorted(per) == sorted(c.label for c in cs) and all(set(v) == {"default", "tuned"} for v in per.values())
    assert s["tuned_tflops"]["fwd"] == pytest.approx(run.geomean([v["tuned"] for v in per.values()]))
    (again,) = run.tune(fake_tunable(calls), cs, 64, device="cpu")
    assert again["reused"] and again["per_case"] == s["per_case"]


def test_vendors_are_timed_once_per_case_and_kept_in_the_cache(cache, monkeypatch):
    """A memo shares a vendor's number on a case among the kernels tuned on it; once a class's row
    holds every vendor, a warm rerun times none."""
    timed = []
    monkeypatch.setattr(run, "_vendor_on", lambda backend, case, mode, device: timed.append(case.label) or 100.0)
    cs, memo = cases(), {}
    for _ in range(2):  # two kernels on the same cases
        got = run.vendor_tflops(cs, "fwd", ["reference"], "cpu", memo)
    assert got == {"reference": pytest.approx(100.0)} and timed == [c.label for c in cs]
    assert run.vendor_tflops(cs, "fwd", ["no-such-vendor"], "cpu", memo)["no-such-vendor"].startswith("unknown")

    t = fake_tunable([])
    summaries = run.tune(t, cs, 64, device="cpu")
    classes = run.group_classes(t, cs, 64)
    assert not any(run.vendors_cached(t, m, 64, ["reference"], "cpu") for m in classes.values())
    for s in summaries:
        members = classes[s["problem_class"]]
        run.record_vendors(t, s, members, 64, members[0].label, {"fwd": {"reference": 100.0}}, "cpu")
    assert all(run.vendors_cached(t, m, 64, ["reference"], "cpu") for m in classes.values())
    assert not run.vendors_cached(t, classes[summaries[0]["problem_class"]], 64, ["reference", "flex"], "cpu")
    again = run.tune(t, cs, 64, device="cpu")
    assert [s["vendor_case"] for s in again] == [s["vendor_case"] for s in summaries]


def test_other_cases_are_not_served_from_the_cache(cache):
    calls = []
    t = fake_tunable(calls)
    run.tune(t, cases(), 64, device="cpu")
    n = len(calls)
    other = [run.TuneCase(make_mask("causal_document", 64, doc_lens=[20, 44]), 2, 1, 16, torch.float32,
                         label="causal_document S=64")]
    res = run.tune(t, other, 64, device="cpu")
    assert res[0]["reused"] is False and len(calls) > n


def test_exhaustive_times_everything(cache):
    calls = []
    res = run.tune(fake_tunable(calls), cases()[:1], 64, device="cpu", exhaustive=True, write=False)
    # the default, the 7 other candidates (the one equal to the default reuses its timing), the winner again
    assert res[0]["search"]["measurements"] == len(calls) == 1 + 7 + 1
    assert not cache.exists()


def test_the_default_is_timed_once_per_case(cache):
    """Where the default is fastest, the final round reuses its timings and, the winner being the
    default, nothing is re-measured: each timed run is a call of its own."""
    calls = []
    t = fake_tunable(calls)
    t = run.Tunable(name="fake", groups=t.groups, candidates=t.candidates, default=t.default,
                    run=lambda q, k, v, mask, config: (time.sleep(0.003 * config["X"]),
                                                       calls.append(dict(config)), q * 1.0)[2])
    (s,) = run.tune(t, cases()[:1], 64, device="cpu", write=False)
    assert s["tuned"] == {"X": 0} and s["search"]["measurements"] == len(calls) == 1 + 8 + 2
    assert s["per_case"]["fwd"]["causal S=64"]["tuned"] == s["per_case"]["fwd"]["causal S=64"]["default"]


def test_planned_work_matches_what_tune_does(cache):
    calls = []
    t, cs = fake_tunable(calls), cases()
    planned = run.planned_work(t, cs, 64)
    run.tune(t, cs, 64, device="cpu", write=False)
    # planned counts the default and the final re-measure per mode and case, as tune does when the
    # default is no finalist and the winner differs from it
    assert planned == len(calls)


def test_the_cache_file_is_tuning_table_rows(cache):
    """The file holds one section per device and kernel whose rows parse as the shipped tables' rows,
    and ``best_row`` picks among them by problem class as ``lookup`` does on a GPU."""
    run.tune(fake_tunable([]), cases(), 64, device="cpu")
    data = json.loads(cache.read_text())
    assert data["format"] == tuned.CACHE_FORMAT == 2
    (sec,) = data["sections"]
    assert (sec["device"], sec["kernel"]) == (tuned.device_key("cpu"), "fake")
    rows = parse_rows(sec["rows"], "fake", str(cache), keys=("X",))
    causal = make_mask("causal", 64)
    assert rows[0].matches(Problem(head_dim=16, head_dim_v=16, dtype="float32", group=2, mask="masked", seqlen=64,
                                   block=64))
    best = tuned.best_row(rows, 16, torch.float32, 2, causal)
    assert best is not None and best.match["mask"] == "masked"
    assert tuned.best_row(rows, 16, torch.float32, 1, causal) is None  # another GQA group
    assert tuned.best_row(rows, 32, torch.float32, 2, causal) is None  # another head dim
    assert tuned.best_row(rows, 16, torch.float32, 2, make_mask("causal", 8192)) is None  # another S bucket


def test_rewriting_a_class_replaces_its_row(cache):
    t, cs = fake_tunable([]), cases()[:1]
    run.tune(t, cs, 64, device="cpu")
    run.tune(t, cs, 64, device="cpu", force=True)
    assert len(json.loads(cache.read_text())["sections"][0]["rows"]) == 1


def test_an_old_format_cache_is_no_entry_and_one_warning(cache, caplog):
    old = {tuned.device_key("cpu"): {"fake|D=16|float32|G=2|masked|S<=4K|block=64": {"config": {"X": 3}, "score": 1}}}
    cache.write_text(json.dumps(old))
    with caplog.at_level(logging.WARNING, logger="longca_triton.kernels.core.tuned"):
        assert tuned.load_cache() == {}
        assert tuned.load_cache() == {} and tuned.device_rows(tuned.device_key("cpu"), "fake") == ()
    (rec,) = caplog.records
    assert str(cache) in rec.getMessage() and "autotune --force" in rec.getMessage()
    # the tuner then rewrites the file in the current format
    calls = []
    res = run.tune(fake_tunable(calls), cases()[:1], 64, device="cpu")
    assert res[0]["reused"] is False and calls
    assert json.loads(cache.read_text())["format"] == 2


def test_rows_may_carry_block_and_measured_and_nothing_else():
    base = {"match": {"block": 64}, "mode": "fwd", "config": {"X": 1}, "results": "r"}
    (row,) = parse_rows([dict(base, measured={"tflops": {"fwd": {"tuned": 9.0}}})], "fake", "t")
    assert row.matches(Problem(block=64)) and not row.matches(Problem(block=128)) and not row.matches(Problem())
    assert tuned.row_score(row) == pytest.approx(9.0) and tuned.row_score(Row({}, {"X": 1}, "fwd", "r")) == 0.0
    with pytest.raises(ValueError, match="measured must be a table"):
        parse_rows([dict(base, measured=3)], "fake", "t")
    with pytest.raises(ValueError, match="unknown fields"):
        parse_rows([dict(base, score=3)], "fake", "t")


def test_a_stop_writes_the_class_under_way_and_begins_no_other(cache):
    """Past the deadline (a callable: here after the 4th timed run) the group under way decides among
    what it measured, the class is written marked cut, the next class is not begun, and a rerun
    tunes the cut class again instead of reusing it."""
    calls = []
    t, cs = fake_tunable(calls), cases()
    first = run.tune(t, cs, 64, device="cpu", deadline=lambda: len(calls) >= 4)
    # default 1, screen 3 (the stop seen before the 4th candidate), final 1, the tuned re-measured 1
    assert len(first) == 1 and len(calls) == 6
    assert first[0]["search"]["stopped_by_deadline"] and first[0]["tuned"]["X"] in (0, 1, 2)
    (row,) = tuned.device_rows(tuned.device_key("cpu"), "fake")
    assert row.measured["search"]["stopped_by_deadline"]
    again = run.tune(t, cs, 64, device="cpu")
    assert [s["reused"] for s in again] == [False, False] and not any(s["search"]["stopped_by_deadline"] for s in again)
    assert {s["reused"] for s in run.tune(t, cs, 64, device="cpu")} == {True}

"""autotune's search over a made-up kernel on the CPU: it searches by successive halving, writes the
cache, and a second run over the same cases reuses the cache without timing anything (--force
tunes again). Timings are wall-clock here; only the bookkeeping is under test."""

import pytest
import torch

from longca_triton.bench import autotune as at
from longca_triton.kernels.core import tuned
from longca_triton.masks import make_mask


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "autotune.json"
    monkeypatch.setenv(tuned.CACHE_ENV, str(path))
    tuned.reload()
    yield path
    tuned.reload()


def fake_tunable(calls):
    def run(q, k, v, mask, config):
        calls.append(dict(config))
        return q * (1.0 + config["X"])

    return at.Tunable(name="fake", groups={"fwd": "fwd"},
                      candidates=lambda group, block, head_dim: [dict(X=i) for i in range(8)],
                      run=run, default=lambda head_dim, dtype, mask=None, group=1: dict(X=0))


def cases():
    return [at.TuneCase(make_mask(m, 64), 2, 1, 16, torch.float32, label=f"{m} S=64") for m in ("causal", "full")]


def test_tune_writes_then_reuses_the_cache(cache):
    calls = []
    t, cs = fake_tunable(calls), cases()
    first = at.tune(t, cs, 64, device="cpu")
    assert {s["reused"] for s in first} == {False}
    assert {s["search"]["method"] for s in first} == {"successive halving"}
    n_first = len(calls)
    # per class (one case each): default 1 + screen 8 + final 3 + tuned re-measure 1
    assert n_first == len(first) * (1 + 8 + 3 + 1)
    assert all(s["search"]["measurements"] == 13 for s in first)
    assert cache.exists()
    entries = tuned.load_cache()[tuned.device_key("cpu")]
    assert set(entries) == {s["problem_class"] for s in first}

    again = at.tune(t, cs, 64, device="cpu")
    assert len(calls) == n_first, "a warm cache must not time anything"
    assert {s["reused"] for s in again} == {True}
    assert [s["tuned"] for s in again] == [s["tuned"] for s in first]

    forced = at.tune(t, cs, 64, device="cpu", force=True)
    assert len(calls) == 2 * n_first and {s["reused"] for s in forced} == {False}


def test_other_cases_are_not_served_from_the_cache(cache):
    calls = []
    t = fake_tunable(calls)
    at.tune(t, cases(), 64, device="cpu")
    n = len(calls)
    other = [at.TuneCase(make_mask("causal_document", 64, doc_lens=[20, 44]), 2, 1, 16, torch.float32,
                         label="causal_document S=64")]
    res = at.tune(t, other, 64, device="cpu")
    assert res[0]["reused"] is False and len(calls) > n


def test_exhaustive_times_everything(cache):
    calls = []
    res = at.tune(fake_tunable(calls), cases()[:1], 64, device="cpu", exhaustive=True, write=False)
    assert res[0]["search"]["measurements"] == 1 + 8 + 1
    assert not cache.exists()


def test_planned_work_matches_what_tune_does(cache):
    calls = []
    t, cs = fake_tunable(calls), cases()
    planned = at.planned_work(t, cs, 64)
    at.tune(t, cs, 64, device="cpu", write=False)
    # planned counts the default and the final re-measure per mode and case, as tune does
    assert planned == len(calls)

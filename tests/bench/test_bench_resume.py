"""Resume and replacement of `unsupported` rows: a row saying the machine lacked the backend (not
installed, no GPU, wrong architecture) is retried once the backend is available and the new row
supersedes it everywhere results are read (report, plots, findings, recommend); case-intrinsic
`unsupported` rows stay done; a "not installed" row never hides an earlier measurement."""

from __future__ import annotations

import json

import pytest

from longca_triton.adapters import Backend, register
from longca_triton.adapters.base import BACKENDS
from longca_triton.bench.config import Experiment
from longca_triton.bench.plot import make_plots
from longca_triton.bench.report import latest_rows, markdown_report
from longca_triton.bench.runner import run_experiment
from longca_triton.bench.store import (
    ResultStore,
    environment_unsupported,
    row_key,
    status_kind,
)
from longca_triton.reference import naive_attention
from longca_triton.study.findings import compute, load_results
from longca_triton.study.findings_report import render_appendix
from longca_triton.study.recommend import recommend


class _Toggle(Backend):
    """A backend whose package is "installed" or not, and which may refuse every case (head dim)."""

    def __init__(self, name, installed=False, refuse_case=None, refuse_device=None):
        self.name = name
        self.description = "test backend"
        self.installed = installed
        self.refuse_case = refuse_case
        self.refuse_device = refuse_device
        self.prepared = 0

    def available(self):
        return (True, "") if self.installed else (False, f"{self.name}-pkg is not installed (cannot import {self.name}_pkg)")

    def supports(self, problem):
        if self.refuse_device:
            return False, self.refuse_device
        if self.refuse_case:
            return False, self.refuse_case
        return True, ""

    def attention(self, q, k, v, mask, softmax_scale=None, return_lse=False):
        out, lse = naive_attention(q, k, v, mask, softmax_scale, return_lse=True)
        return (out, lse) if return_lse else out

    def prepare(self, problem, q, k, v):
        self.prepared += 1
        return super().prepare(problem, q, k, v)


@pytest.fixture
def toggles():
    names = []

    def add(name, **kw):
        b = register(_Toggle(name, **kw))
        names.append(name)
        return b

    yield add
    for n in names:
        BACKENDS.pop(n, None)


def _exp(backends):
    return Experiment(name="t", masks=["causal"], seqlens=[64, 96], heads=[(2, 1)], head_dims=[16], dtypes=["float32"],
                      modes=["fwd"], backends=backends, warmup_ms=0.0, rep=2, max_ms=20.0).validate()


def test_not_installed_is_retried_when_installed_and_supersedes(tmp_path, toggles):
    vendor = toggles("t-vendor")  # not installed at first
    case = toggles("t-case", installed=True, refuse_case="head dim 16 not supported (takes 64, 128)")
    dev = toggles("t-dev", installed=True, refuse_device="t-dev runs on CUDA only (problem device: cpu)")
    exp = _exp(["reference", "t-vendor", "t-case", "t-dev"])
    store = ResultStore(tmp_path / "r.jsonl")
    run_experiment(exp, store, device="cpu")
    first = store.rows()
    assert len(first) == 8
    by = {(r["backend"], r["seqlen"]): r for r in first}
    assert by[("t-vendor", 64)]["status"].startswith("unsupported: t-vendor-pkg is not installed")
    assert by[("t-vendor", 64)]["unavailable"] is True and environment_unsupported(by[("t-vendor", 64)])
    assert "unavailable" not in by[("t-case", 64)] and not environment_unsupported(by[("t-case", 64)])
    assert environment_unsupported(by[("t-dev", 64)])  # a device reason from supports(): by its text

    # still not installed: nothing is redone, no duplicate rows (the answer is the same)
    res = run_experiment(exp, store, device="cpu")
    assert res.rows == [] and res.skipped == 8 and len(store.rows()) == 8

    # installed now: only its points run again; the case-intrinsic and unchanged device refusals stay done
    vendor.installed = True
    res = run_experiment(exp, store, device="cpu")
    assert {r["backend"] for r in res.rows} == {"t-vendor"} and len(res.rows) == 2 and res.skipped == 6
    assert all(r["status"] == "ok" for r in res.rows) and case.prepared == 0 and dev.prepared == 0
    rows = store.rows()
    assert len(rows) == 10
    latest = latest_rows(rows)
    assert len(latest) == 8 and {r["status"] for r in latest if r["backend"] == "t-vendor"} == {"ok"}
    # a further rerun: everything done
    assert run_experiment(exp, store, device="cpu").rows == []

    # every reader shows the new row, not the stale one
    md = markdown_report(rows)
    assert "t-vendor-pkg is not installed" not in md and "Points: ok 4, unsupported 4" in md
    # findings read GPU rows only (CPU timings are no performance numbers): the same rows as a GPU's
    gpu_file = tmp_path / "as_gpu.jsonl"
    gpu_file.write_text("".join(json.dumps(dict(r, device="cuda", interpreted=False)) + "\n" for r in rows))
    f = compute(*load_results([gpu_file]))
    (sk,) = f.cells
    cells = f.cells[sk]["causal"]
    assert all("t-vendor" in dict(c.ranking) for c in cells)
    assert all("t-vendor" not in c.absent for c in cells)
    text = render_appendix(f, "x")
    assert "t-vendor-pkg" not in text
    plots = make_plots(rows, tmp_path / "plots")
    assert plots


def test_legacy_not_installed_row_is_retried(tmp_path, toggles):
    """A row written before rows carried `unavailable`: its reason text says the package was absent."""
    toggles("t-old", installed=True)
    exp = _exp(["t-old"])
    store = ResultStore(tmp_path / "r.jsonl")
    run_experiment(exp, store, device="cpu")
    (a, b) = store.rows()
    legacy = dict(a, status="unsupported: flash-attn-4 / fa4 is not installed (cannot import flash_attn.cute)",
                  time="2020-01-01T00:00:00+00:00")
    legacy.pop("unavailable", None)
    store.rewrite([legacy, b])
    res = run_experiment(exp, store, device="cpu")
    assert len(res.rows) == 1 and res.rows[0]["status"] == "ok" and res.skipped == 1
    assert [status_kind(r) for r in latest_rows(store.rows())] == ["ok", "ok"]


def test_not_installed_row_never_hides_a_measurement(tmp_path):
    """An older `ok` row and a newer "not installed" row of the same point (a later run without the
    vendor wheel): the measurement stands in every reader; a newer case row does supersede it."""
    base = {"schema": 1, "kind": "dense", "experiment": "t", "mask": "causal", "mask_params": {}, "seqlen": 4096, "batch": 1,
            "heads_q": 64, "heads_kv": 8, "head_dim": 128, "dtype": "bfloat16", "mode": "fwd", "gpu": "GPU-X",
            "flops": 1e12, "env": {"gpu": "GPU-X"}}
    rows = [dict(base, backend="fa4", status="ok", tflops=600.0, time_ms=1.0, time="2026-01-01T00:00:00+00:00"),
            dict(base, backend="triton", status="ok", tflops=500.0, time_ms=1.2, time="2026-01-01T00:00:01+00:00"),
            dict(base, backend="fa4", status="unsupported: flash-attn-4 / fa4 is not installed (cannot import x)",
                 time="2026-02-01T00:00:00+00:00", unavailable=True)]
    old, new = ResultStore(tmp_path / "old.jsonl"), ResultStore(tmp_path / "new.jsonl")
    old.extend(rows[:2])
    new.extend(rows[2:])
    latest = latest_rows(rows)
    assert [(r["backend"], r["status"]) for r in latest] == [("fa4", "ok"), ("triton", "ok")]
    assert "not installed" not in markdown_report(rows)
    f = compute(*load_results([new.path, old.path]))
    (sk,) = f.cells
    assert f.cells[sk]["causal"][0].winner == ("fa4", 600.0)
    rec = recommend([dict(r, _file="x") for r in rows], "causal", 4096, 1, mode="fwd")
    assert rec.kernel["backend"] == "fa4"
    # a newer row that judged the case (here: an error) does supersede the measurement
    err = dict(base, backend="fa4", status="error: RuntimeError: boom", time="2026-03-01T00:00:00+00:00")
    assert {r["backend"]: r["status"] for r in latest_rows([*rows, err])}["fa4"].startswith("error")


@pytest.mark.parametrize("status, env", [
    ("unsupported: nvidia-cudnn-frontend is not installed (cannot import cudnn (ModuleNotFoundError: ...))", True),
    ("unsupported: FlashAttention-4 (flash-attn-4) is not installed: cannot import flash_attn.cute", True),
    ("unsupported: needs compute capability >= 9.0, GPU has 8.0", True),
    ("unsupported: needs a CUDA GPU (none visible)", True),
    ("unsupported: needs an sm_90 (Hopper) GPU; the CPU interpreter cannot run Gluon", True),
    ("unsupported: the CUDA kernel is built for sm_90 (Hopper); this GPU is sm_100", True),
    ("unsupported: torch 2.5.1 has no varlen_attn", True),
    ("unsupported: PyTorch was built without cuDNN", True),
    ("unsupported: FlexAttention has no backward pass on the CPU (eager); bwd runs on CUDA", True),
    ("unsupported: head dim 96 not supported (the Gluon kernel takes 64, 128)", False),
    ("unsupported: fa3-fwd has no bwd pass (modes: fwd)", False),
    ("unsupported: row 545 attends more than one key interval, so the mask is not documents with a window", False),
    ("unsupported: SDPA's flash_attention backend takes no attn_mask and share_question is not plain full or causal", False),
    ("unsupported: materialises 1.72e+10 scores; use reference-chunked", False),
    ("error: ModuleNotFoundError: No module named 'x'", False),  # an error is retried with --retry-errors only
    ("ok", False),
])
def test_environment_unsupported_classification(status, env):
    assert environment_unsupported({"status": status}) is env


def test_row_key_ignores_the_unavailable_flag():
    r = {"backend": "fa4", "mask": "causal", "seqlen": 1024, "mode": "fwd", "status": "unsupported: x is not installed"}
    assert row_key(r) == row_key(dict(r, unavailable=True))


def test_fa2_shadowed_by_fa4s_flash_attn_package_is_an_environment_reason(monkeypatch):
    """On the H100, flash-attn-4 installs a ``flash_attn`` package without FA2's functions: the fa2
    row must say FA2 is not installed (so a resume retries it where FA2 is), not blame the case."""
    import types

    from longca_triton.adapters import flash
    from longca_triton.bench.store import environment_unsupported

    monkeypatch.setattr(flash, "try_import", lambda name: (types.ModuleType(name), ""))
    ok, why = flash.FA2().available()
    assert not ok and "flash-attn / flash_attn is not installed" in why and "flash_attn_func" in why, why
    assert environment_unsupported({"status": f"unsupported: {why}"})

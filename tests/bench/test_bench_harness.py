"""The sweep: statuses never stop it, wrong backends are caught, interruption resumes cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import longca_triton as lt
from longca_triton.adapters import Backend, Unsupported, register
from longca_triton.adapters.base import BACKENDS
from longca_triton.bench.check import compare, reference_group
from longca_triton.bench.config import (ConfigError, Experiment, load_experiment, parse_dtype, parse_heads, parse_seqlen,
                                        resolve_param)
from longca_triton.bench.plot import make_plots
from longca_triton.bench.report import markdown_report
from longca_triton.bench.runner import classify_exception, run_experiment
from longca_triton.bench.store import ResultStore, row_key, status_kind
from longca_triton.masks import RangeMask
from longca_triton.reference import naive_attention

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- config
def test_parsers():
    assert parse_seqlen("4K") == 4096 and parse_seqlen(16384) == 16384 and parse_seqlen("1M") == 2**20
    for bad in ("abc", 0, "-3", True):
        with pytest.raises(ConfigError):
            parse_seqlen(bad)
    assert parse_heads("64:8") == (64, 8) and parse_heads("32") == (32, 32)
    for bad in ("64:7", "a:b", "0:0", "1:2:3"):
        with pytest.raises(ConfigError):
            parse_heads(bad)
    assert parse_dtype("bf16") == torch.bfloat16
    with pytest.raises(ConfigError, match="valid"):
        parse_dtype("int8")
    assert resolve_param("S/3", 16384) == 5461 and resolve_param("S//16+1", 64) == 5 and resolve_param(512, 9) == 512
    with pytest.raises(ConfigError):
        resolve_param("S.__class__", 10)
    assert resolve_param("hist", 10) == "hist" and resolve_param(["S//2", "S - S//2"], 11) == [5, 6]


def test_experiment_files_load_and_match_the_study():
    e = load_experiment(REPO / "experiments" / "dense.toml").validate()
    assert set(e.masks) == set(lt.masks.STATIC_MASK_NAMES) and len(e.masks) == 12
    # 1K..48K for every backend, 64K and 128K for those that fit ([backend_max_seqlen])
    assert e.seqlens[0] == 1024 and e.seqlens[-1] == 128 * 1024 and e.backend_max_seqlen["sdpa-cudnn"] == 48 * 1024
    assert (64, 8) in e.heads and (64, 64) in e.heads and e.head_dims == [128, 64] and e.dtypes == ["bfloat16"]
    assert {"fwd", "bwd"} <= set(e.modes)
    assert e.params_for("prefix_lm_causal", 16384) == {"prefix": 5461}
    q = load_experiment(REPO / "experiments" / "dense_quick.toml").validate()
    assert set(q.masks) == {"full", "causal", "causal_document", "sliding_window_causal", "share_question", "prefix_lm_document"}
    assert sorted(q.seqlens) == [4096, 16384]
    assert {"sdpa-flash", "sdpa-cudnn", "flex", "cudnn", "varlen-fa2", "reference"} <= set(q.backends)


def test_bad_experiment_files(tmp_path):
    p = tmp_path / "e.toml"
    p.write_text('[grid]\nmasks = ["causal"]\nseqlen = [4]\n')
    with pytest.raises(ConfigError, match="unknown key"):
        load_experiment(p)
    p.write_text('[grid]\nmasks = ["causl"]\n')
    with pytest.raises(ConfigError, match="valid masks"):
        load_experiment(p).validate()
    p.write_text('[grid]\nmasks = ["causal"]\n[mask_params.causal]\nwindow = 3\n')
    with pytest.raises(ConfigError, match="unknown parameter"):
        load_experiment(p).validate()
    with pytest.raises(ConfigError, match="valid backends"):
        Experiment(backends=["nope"]).validate(known_backends=["reference"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_experiment(tmp_path / "missing.toml")


# ---------------------------------------------------------------------------- the check
def test_reference_group_matches_naive_with_empty_rows():
    S, hq, hkv, D = 96, 4, 2, 16
    # rows >= 48 attend nothing: lse -inf, out 0, no NaN in any gradient
    m = RangeMask(S, S, [(0, 48, 0, S, "causal"), (10, 30, 60, 90, "full")], name="holes")
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, S, h, D, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    ref = reference_group(m, q, k, v, do, 0.25, need_grads=True, budget_elems=1000)  # many chunks
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = naive_attention(qq, kk, vv, m, 0.25, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), do)
    hs = ref.heads_q
    assert hs == [2, 3] and ref.head_kv == 1
    torch.testing.assert_close(ref.out.double(), out[:, :, hs].double(), atol=1e-5, rtol=1e-5)
    assert torch.isinf(ref.lse[:, :, 48:]).all() and torch.isfinite(ref.lse[:, :, :48]).all()
    torch.testing.assert_close(ref.lse[:, :, :48].double(), lse[:, hs, :48].double(), atol=1e-5, rtol=1e-5)
    for a, b in ((ref.dq, dq[:, :, hs]), (ref.dk, dk[:, :, 1:2]), (ref.dv, dv[:, :, 1:2])):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5)
    # compare(): the naive result passes; a perturbed one fails with the right field
    ok = compare(ref, out, lse, (dq, dk, dv), torch.float32)
    assert ok.ok, ok.message
    bad = compare(ref, out * 1.05, lse, (dq, dk, dv), torch.float32)
    assert not bad.ok and "out rel err" in bad.message
    nan = dv.clone()
    nan[0, 0, 1, 0] = float("nan")
    assert "dv" in compare(ref, out, lse, (dq, dk, nan), torch.float32).message


# ---------------------------------------------------------------------------- statuses
class _Fake(Backend):
    """Test backends: behave in one scripted way."""

    def __init__(self, name, behaviour, after=None):
        self.name = name
        self.description = f"test backend ({behaviour})"
        self.behaviour = behaviour
        self.after = after
        self.calls = 0

    def attention(self, q, k, v, mask, softmax_scale=None, return_lse=False):
        out, lse = naive_attention(q, k, v, mask, softmax_scale, return_lse=True)
        if self.behaviour == "wrong":
            out = out * 1.1
        return (out, lse) if return_lse else out

    def prepare(self, problem, q, k, v):
        self.calls += 1
        if self.behaviour == "unsupported":
            raise Unsupported("scripted: cannot do this")
        if self.behaviour == "oom":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        if self.behaviour == "crash":
            raise RuntimeError("scripted crash\nsecond line")
        if self.behaviour == "interrupt" and self.calls >= self.after:
            raise KeyboardInterrupt
        return super().prepare(problem, q, k, v)


@pytest.fixture
def fakes():
    names = []

    def add(name, behaviour, after=None):
        b = register(_Fake(name, behaviour, after))
        names.append(name)
        return b

    yield add
    for n in names:
        BACKENDS.pop(n, None)


def _tiny(backends, **kw):
    base = dict(name="t", masks=["causal", "causal_document"], seqlens=[96], heads=[(4, 2)], head_dims=[16],
                dtypes=["float32"], modes=["fwd", "bwd"], backends=backends, warmup_ms=0.0, rep=2, max_ms=50.0,
                mask_params={"causal_document": {"doc_lens": [40, 56]}})
    base.update(kw)
    return Experiment(**base).validate()


def test_statuses_never_stop_the_sweep(tmp_path, fakes):
    for n, beh in (("t-wrong", "wrong"), ("t-unsup", "unsupported"), ("t-oom", "oom"), ("t-crash", "crash")):
        fakes(n, beh)
    exp = _tiny(["reference", "t-wrong", "t-unsup", "t-oom", "t-crash", "sdpa-math", "varlen-fa2"])
    store = ResultStore(tmp_path / "r.jsonl")
    res = run_experiment(exp, store, device="cpu")
    rows = store.rows()
    assert len(rows) == exp.num_points() == 28 and not res.interrupted and res.skipped == 0
    assert torch._functorch.config.donated_buffer is False  # bwd timing retains graphs (compiled flex)
    by = {}
    for r in rows:
        by.setdefault(r["backend"], set()).add(r["status"].split(" (")[0] if r["backend"] == "t-wrong" else r["status"])
    assert by["reference"] == {"ok"} and by["sdpa-math"] == {"ok"}
    assert by["t-wrong"] == {"error: wrong result"}
    assert by["t-unsup"] == {"unsupported: scripted: cannot do this"}
    assert by["t-oom"] == {"oom"}
    assert by["t-crash"] == {"error: RuntimeError: scripted crash"}
    assert all(s.startswith("unsupported: ") and "CUDA" in s for s in by["varlen-fa2"])
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        assert r["time_ms"] > 0 and r["p20_ms"] <= r["time_ms"] <= r["p80_ms"] and r["tflops"] > 0
        assert r["device"] == "cpu" and r["env"]["torch"] == torch.__version__ and r["params_digest"]
        assert r["flops"] == pytest.approx(lt.make_mask(r["mask"], 96, **exp.params_for(r["mask"], 96)).flops(4, 16, r["mode"]))
    sd = [r for r in ok if r["backend"] == "sdpa-math"]
    assert all(r["check"]["ok"] and "out_rel" in r["check"] for r in sd)
    assert all("dq_rel" in r["check"] for r in sd if r["mode"] == "bwd")
    wrong = [r for r in rows if r["backend"] == "t-wrong"]
    assert all(r["time_ms"] is None and r["check"]["ok"] is False for r in wrong)
    # resumable: a rerun adds nothing
    res2 = run_experiment(exp, store, device="cpu")
    assert res2.rows == [] and res2.skipped == 28 and len(store.rows()) == 28
    # --retry-errors re-runs only error/oom points
    res3 = run_experiment(exp, store, device="cpu", retry=("error", "oom"))
    assert len(res3.rows) == 4 * 3 and {r["backend"] for r in res3.rows} == {"t-wrong", "t-oom", "t-crash"}
    md = markdown_report(store.rows())
    assert "scripted crash" in md and "WRONG" in md and "OOM" in md and "| causal |" in md
    files = make_plots(store.rows(), tmp_path / "plots")
    assert {f.name.split("_")[0] for f in files} == {"tflops", "heatmap"}  # no CUDA memory numbers on the CPU


def test_rows_say_which_launch_config_ran(tmp_path, monkeypatch):
    """Our kernels' timed rows say where their launch config came from (``notes.launch_config``): the kernels'
    defaults, or an autotune cache entry spelled out, and the report says so per backend."""
    import longca_triton.kernels.core.tuned as tuned

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    exp = _tiny(["triton", "triton-sparse"], masks=["causal", "block_sparse"], modes=["fwd"], check=False,
                seqlens=[64], mask_params={"block_sparse": {"block": 32, "density": 0.5}})
    store = ResultStore(tmp_path / "r.jsonl")
    run_experiment(exp, store, device="cpu")
    ok = [r for r in store.rows() if r["status"] == "ok"]
    assert {r["backend"] for r in ok} == {"triton", "triton-sparse"}
    assert all(r["notes"]["launch_config"] == {"source": "kernel defaults"} for r in ok)
    assert "Launch configs of our kernels: triton: 1 point kernel defaults" in markdown_report(store.rows())

    # an autotune cache entry for the dense kernel (the cache is read on GPUs only: stand one in)
    pinned = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    monkeypatch.setattr(tuned, "lookup", lambda kernel, *a, **kw: dict(pinned) if kernel == "triton" else None)
    store2 = ResultStore(tmp_path / "r2.jsonl")
    run_experiment(exp, store2, device="cpu")
    by = {r["backend"]: r["notes"]["launch_config"] for r in store2.rows() if r["status"] == "ok"}
    assert by["triton"] == {"source": "autotune cache", "config": pinned}
    assert by["triton-sparse"] == {"source": "kernel defaults"}
    md = markdown_report(store2.rows())
    assert "triton: 1 point autotune cache; triton-sparse: 1 point kernel defaults" in md
    assert "`notes.launch_config.config`" in md


def test_backend_names_carry_launch_configs():
    """One of ours named with a launch config (``config_name``) is that backend with the config, one canonical name
    per config; a bad config, a vendor backend or a malformed name is a ValueError naming the problem."""
    from longca_triton.adapters import get_backend
    from longca_triton.adapters.base import canonical_name, config_name, split_backend_list, split_config_name

    b = get_backend('triton-varblock{ "ragged_bwd": false, "DQ_HEADS": 2 }')
    assert b.name == 'triton-varblock{"DQ_HEADS":2,"ragged_bwd":false}' == config_name(
        "triton-varblock", {"ragged_bwd": False, "DQ_HEADS": 2})
    assert b.config == {"ragged_bwd": False, "DQ_HEADS": 2} and "launch config" in b.description
    assert get_backend("triton-varblock").config is None  # the registered one is untouched
    assert get_backend(b.name) is b
    assert canonical_name('flashmask-triton{"BLOCK_M": 64}') == 'triton-flashmask{"BLOCK_M":64}'
    assert split_config_name("flex") == ("flex", None)
    assert split_backend_list('triton, triton{"BLOCK_M":64,"num_warps":4},flex') == [
        "triton", 'triton{"BLOCK_M":64,"num_warps":4}', "flex"]
    for name, words in (('triton{"BLOK_M":64}', "unknown dense-attention config keys ['BLOK_M']"),
                        ('triton{"BLOCK_M":48}', "power of two"),
                        ('triton-varblock{"DQ_HEADS":3}', "DQ_HEADS"),
                        ('sdpa-cudnn{"BLOCK_M":64}', "takes no launch config"),
                        ("triton{BLOCK_M:64}", "must be a JSON object"),
                        ("triton{}", "non-empty"),
                        ('triton{"BLOCK_M":[64]}', "numbers, booleans or strings"),
                        ('tritn{"BLOCK_M":64}', "unknown backend 'tritn'")):
        with pytest.raises(ValueError, match=re.escape(words)):
            get_backend(name)


def test_a_launch_config_runs_beside_the_default(tmp_path, monkeypatch):
    """The harness runs ``triton`` and ``triton{config}`` as two backends of one grid: both checked, rows recorded
    under their names with the config that ran, a rerun with the config's keys in another order resumes; a bad
    config in the grid is an error before anything runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = '{"num_warps": 4, "BLOCK_N": 32}'
    exp = _tiny(["triton", f"triton{cfg}"], masks=["causal"], modes=["fwd", "bwd"], seqlens=[80])
    store = ResultStore(tmp_path / "r.jsonl")
    run_experiment(exp, store, device="cpu")
    rows = store.rows()
    name = 'triton{"BLOCK_N":32,"num_warps":4}'
    assert sorted({r["backend"] for r in rows}) == ["triton", name] and len(rows) == 4
    assert all(r["status"] == "ok" and r["check"]["ok"] for r in rows)
    assert all(r["notes"]["launch_config"] == {"source": "config in the backend name",
                                               "config": {"BLOCK_N": 32, "num_warps": 4}}
               for r in rows if r["backend"] == name)
    again = _tiny(["triton", 'triton{"BLOCK_N":32,"num_warps":4}'], masks=["causal"], modes=["fwd", "bwd"],
                  seqlens=[80])
    assert run_experiment(again, store, device="cpu").rows == []
    with pytest.raises(ValueError, match="BLOK_N"):
        run_experiment(_tiny(['triton{"BLOK_N":32}'], masks=["causal"], seqlens=[80]), store, device="cpu")
    with pytest.raises(ConfigError, match="BLOK_N"):
        _tiny(["triton"]).with_overrides(backends='triton,triton{"BLOK_N":32,"num_warps":4}').validate(
            known_backends=["triton"])


def test_classify_exception():
    assert classify_exception(Unsupported("x")) == "unsupported: x"
    assert classify_exception(RuntimeError("CUDA out of memory.")) == "oom"
    w = [type("W", (), {"message": "Flash attention does not support attn_mask"})()]
    s = classify_exception(RuntimeError("No available kernel. Aborting execution."), w)
    assert s.startswith("unsupported: torch SDPA has no kernel") and "attn_mask" in s
    assert classify_exception(ValueError("")) == "error: ValueError"


# ---------------------------------------------------------------------------- interruption
@pytest.mark.parametrize("interleave", [False, True], ids=["sequential", "interleaved"])
def test_keyboard_interrupt_then_resume(tmp_path, fakes, interleave):
    fakes("t-ok", "ok")
    stopper = fakes("t-stop", "interrupt", after=3)
    exp = _tiny(["t-ok", "t-stop"], interleave=interleave)
    store = ResultStore(tmp_path / "r.jsonl")
    res = run_experiment(exp, store, device="cpu")
    assert res.interrupted
    first = store.rows()
    if interleave:
        # group 1: fwd (t-ok, t-stop call 1) timed together, bwd (t-ok, t-stop call 2) likewise; group 2:
        # t-ok fwd prepared, t-stop fwd -> interrupt: t-ok's fwd was never timed, so it has no row
        assert len(first) == 4 and {r["timing"] for r in first} == {"interleaved"}
    else:
        # group 1: t-ok fwd, t-ok bwd, t-stop fwd (call 1), t-stop bwd (call 2); group 2: t-ok fwd, bwd, t-stop fwd -> interrupt
        assert len(first) == 6 and {r["timing"] for r in first} == {"sequential"}
    assert store.skipped_lines == 0
    stopper.behaviour = "ok"
    res = run_experiment(exp, store, device="cpu")
    assert not res.interrupted and res.skipped == len(first) and len(res.rows) == 8 - len(first)
    rows = store.rows()
    keys = [row_key(r) for r in rows]
    assert len(rows) == exp.num_points() == 8 and len(set(keys)) == 8
    assert all(status_kind(r) == "ok" for r in rows)


def test_sigint_subprocess_then_resume(tmp_path):
    """Ctrl-C (SIGINT) to the real CLI mid-sweep: exit 130, a valid file, and a rerun that
    completes without redoing finished points."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "longca_triton.bench.cli", "bench", "dense", "--preset", "smoke", "--masks",
           "causal,full,causal_document,sliding_window_causal", "--seqlens", "256,384", "--backends",
           "reference-chunked,reference", "--rep", "6", "--out", str(out), "--no-plots"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, process_group=0)
    results = out / "results.jsonl"
    deadline = time.time() + 90
    while time.time() < deadline:
        if results.exists() and results.read_text().count("\n") >= 3:
            break
        if p.poll() is not None:
            break
        time.sleep(0.05)
    assert p.poll() is None, "the sweep finished before it could be interrupted"
    os.kill(p.pid, signal.SIGINT)
    text = p.communicate(timeout=60)[0].decode()
    assert p.returncode == 130, text
    assert "Interrupted" in text and "resume" in text
    store = ResultStore(results)
    before = store.rows()
    assert 3 <= len(before) < 32 and store.skipped_lines == 0
    p2 = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, timeout=150)
    assert p2.returncode == 0, p2.stdout.decode()[-2000:]
    after = store.rows()
    keys = [row_key(r) for r in after]
    assert len(after) == 32 and len(set(keys)) == 32 and store.skipped_lines == 0
    assert [row_key(r) for r in after[: len(before)]] == [row_key(r) for r in before]  # nothing redone
    assert (out / "report.md").exists()


def test_time_fn_fixed_warmup_counts_calls():
    """``warmup_calls``: exactly that many untimed calls, then ``rep`` calls timed one by one (host clock here)."""
    from longca_triton.bench.timing import time_fn

    calls = []
    res = time_fn(lambda: calls.append(1), rep=4, flush_l2=False, device="cpu", warmup_calls=2)
    assert len(calls) == 6 and res["reps"] == 4 and res["p20_ms"] <= res["median_ms"] <= res["p80_ms"]
    with pytest.raises(ValueError):
        time_fn(lambda: None, rep=2, device="cpu", ranks=True)  # over ranks needs a warm-up count


# ---------------------------------------------------------------------------- interleaved timing
def test_warm_up_sized_to_the_call_and_reads_the_host_cost():
    """``warmup_ms`` worth of calls, none for a call that alone lasts that long; the host cost is the
    most of the estimating call's and the first three warm-up calls' (no extra call for it)."""
    from longca_triton.bench.timing import warm_up, warm_up_calls

    assert warm_up_calls(4.0, 25.0) == 6 and warm_up_calls(30.0, 25.0) == 0 and warm_up_calls(0.0, 1.0) == 1000
    calls = []
    host = warm_up(lambda: calls.append(time.sleep(0.004 if len(calls) == 1 else 0)), 5.0, 20.0, est_host_ms=0.5)
    assert len(calls) == 4 and 4.0 <= host < 50.0
    calls.clear()
    assert warm_up(lambda: calls.append(1), 30.0, 25.0, est_host_ms=0.7) == 0.7 and not calls


def test_time_interleaved_shuffles_and_caps():
    """Round r times every function once, in an order drawn for the round (not one fixed
    predecessor for every function, and the same orders on a rerun); a slow function capped
    by ``max_ms`` drops out of the later rounds; compile, estimate and warm-up calls are untimed."""
    from longca_triton.bench.timing import time_interleaved

    log = []

    def mk(name, sleep_s=0.0):
        def f():
            log.append(name)
            if sleep_s:
                time.sleep(sleep_s)
        return f

    res = time_interleaved([mk("a"), mk("b"), mk("c")], warmup_ms=0.0, rep=4, flush_l2=False, device="cpu")
    assert [r["reps"] for r in res] == [4, 4, 4]
    # 1 compile + 1 estimate call each (no warm-up ms asked, so no warm-up call), then the rounds
    assert sorted(log[:6]) == ["a"] * 2 + ["b"] * 2 + ["c"] * 2
    rounds = ["".join(log[6 + 3 * r: 9 + 3 * r]) for r in range(4)]
    assert all(sorted(r) == list("abc") for r in rounds)
    assert len(set(rounds)) > 1
    log.clear()
    time_interleaved([mk("a"), mk("b"), mk("c")], warmup_ms=0.0, rep=4, flush_l2=False, device="cpu")
    assert ["".join(log[6 + 3 * r: 9 + 3 * r]) for r in range(4)] == rounds
    log.clear()
    res = time_interleaved([mk("fast"), mk("slow", 0.02)], warmup_ms=0.0, rep=6, max_ms=45.0, min_rep=2,
                           flush_l2=False, device="cpu")
    assert res[0]["reps"] == 6 and res[1]["reps"] == 2 and res[1]["median_ms"] >= 20.0
    rounds = log[4:]
    assert sorted(rounds[:4]) == ["fast", "fast", "slow", "slow"] and rounds[4:] == ["fast"] * 4
    assert time_interleaved([], device="cpu") == []
    with pytest.raises(ValueError):
        time_interleaved([mk("a")], rep=0, device="cpu")


class _SlowTimed(_Fake):
    """Prepares and checks like a correct backend; its calls fail after ``after`` calls (a failure
    inside the shared timing)."""

    def prepare(self, problem, q, k, v):
        fn = super().prepare(problem, q, k, v)

        def call():
            self.calls += 1
            if self.behaviour == "fail_late" and self.calls > self.after:
                raise RuntimeError("scripted late failure")
            return fn()
        return call


def test_interleaved_rows_and_fallback(tmp_path, fakes):
    """Interleaved timing: every ok row says so and carries the same clock window; a backend whose
    call fails during the shared timing sends the bucket back to one-at-a-time timing, where only
    it fails."""
    fakes("t-ok", "ok")
    late = register(_SlowTimed("t-late", "fail_late", after=3))
    try:
        exp = _tiny(["reference", "t-ok", "t-late"], masks=["causal"], modes=["fwd"])
        store = ResultStore(tmp_path / "r.jsonl")
        run_experiment(exp, store, device="cpu")
        rows = {r["backend"]: r for r in store.rows()}
        assert rows["t-late"]["status"] == "error: RuntimeError: scripted late failure"
        assert rows["reference"]["status"] == rows["t-ok"]["status"] == "ok"
        assert rows["reference"]["timing"] == rows["t-ok"]["timing"] == "sequential"  # the fallback
        assert "sm_clock_mhz" not in rows["t-ok"]  # nothing to sample on a CPU
        late.behaviour = "ok"
        store2 = ResultStore(tmp_path / "r2.jsonl")
        run_experiment(exp, store2, device="cpu")
        rows = store2.rows()
        assert len(rows) == 3 and {r["timing"] for r in rows} == {"interleaved"}
        assert all("peak_mem_bytes" in r and r["reps"] == 2 and r["time_ms"] > 0 for r in rows)
    finally:
        BACKENDS.pop("t-late", None)


def test_clock_sampler_reads_nvidia_smi(tmp_path, monkeypatch):
    """The nvidia-smi fallback parses its CSV lines (a stand-in script on PATH), with the board's power
    limit where a third column gives it; a CPU device samples nothing."""
    from longca_triton.bench.timing import ClockSampler

    with ClockSampler("cpu") as c:
        pass
    assert c.summary() == {}
    smi = tmp_path / "nvidia-smi"
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")

    def sample(lines: list[str]) -> dict:
        """The summary of a sampler reading ``lines`` from a stand-in nvidia-smi."""
        smi.write_text("#!/bin/sh\nprintf '" + "\\n".join(lines) + "\\n'\nsleep 5\n")
        smi.chmod(0o755)
        c = ClockSampler("cpu")
        c._smi("GPU-test")
        deadline = time.time() + 10
        while len(c.clock) < sum("N/A" not in x for x in lines) and time.time() < deadline:
            time.sleep(0.02)
        c.__exit__(None, None, None)
        return c.summary()

    s = sample(["1980, 650.5", "1470, 700.0", "[N/A], 1", "1755, 640.0"])
    assert s["sm_clock_mhz"] == 1755.0 and s["sm_clock_min_mhz"] == 1470.0 and s["sm_clock_max_mhz"] == 1980.0
    assert s["power_w"] == 650.5 and s["clock_samples"] == 3 and s["clock_source"] == "nvidia-smi"
    assert "power_limit_w" not in s  # no limit column
    s = sample(["1515, 695.2, 700.00", "1590, 690.0, 700.00"])
    assert s["power_limit_w"] == 700.0 and s["clock_samples"] == 2


def _timed_row(backend: str, mask: str, tflops: float, **clock) -> dict:
    return dict(kind="dense", experiment="e", mask=mask, mask_params={}, seqlen=16384, batch=1, heads_q=64,
                heads_kv=8, head_dim=96, d_qk=96, d_v=96, dtype="bfloat16", density=1.0, device="cuda",
                backend=backend, mode="fwd", status="ok", time_ms=1.0, tflops=tflops, p20_ms=1.0, p80_ms=1.0,
                time="2026-11-28T00:17:59+00:00", **clock)


def test_report_shows_clock_and_power_limit():
    """The report's tables carry each problem's sampled SM clock and board power, mark the problems timed at
    the power limit, and say how many were; rows without a clock sample (a CPU, older files) keep the old
    tables."""
    from longca_triton.bench.report import at_power_limit

    capped = dict(sm_clock_mhz=1590.0, sm_clock_max_mhz=1980.0, power_w=695.3, power_limit_w=700.0)
    below = dict(sm_clock_mhz=1650.0, sm_clock_max_mhz=1980.0, power_w=597.6, power_limit_w=700.0)
    rows = [_timed_row("a", "full", 525.8, **capped), _timed_row("b", "full", 485.8, **capped),
            _timed_row("a", "causal", 501.0, **below), _timed_row("b", "causal", 459.1, **below)]
    assert at_power_limit(rows[0]) and not at_power_limit(rows[2])
    assert not at_power_limit(dict(power_w=695.0))  # no limit recorded: never "at the limit"
    md = markdown_report(rows)
    assert "| full | 16384 | 1.000 | **525.8** | 485.8 | 1590 MHz, 695 W, at limit |" in md
    assert "| causal | 16384 | 1.000 | **501.0** | 459.1 | 1650 MHz, 598 W |" in md
    assert "median SM clock 1590–1650 MHz" in md and "2 of 4 at the board's power limit (700 W" in md
    plain = markdown_report([{k: v for k, v in r.items() if k not in capped} for r in rows])
    assert "clock" not in plain.split("## fwd")[1].split("\n")[2] and "Clock and power" not in plain


def test_interleave_setting(tmp_path):
    cfg = tmp_path / "e.toml"
    cfg.write_text('[experiment]\nname = "e"\n[grid]\nmasks = ["causal"]\n[timing]\ninterleave = false\n')
    assert load_experiment(cfg).interleave is False
    cfg.write_text('[experiment]\nname = "e"\n[grid]\nmasks = ["causal"]\n')
    assert load_experiment(cfg).interleave is True
    cfg.write_text('[experiment]\nname = "e"\n[grid]\nmasks = ["causal"]\n[timing]\ninterleave = "yes"\n')
    with pytest.raises(ConfigError, match="interleave must be true or false"):
        load_experiment(cfg)

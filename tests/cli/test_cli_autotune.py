"""The autotune command as a user meets it: on a CPU it says what it does instead of tuning and ends on
a count of its checks; on the tuning path (run here on the CPU with a made-up kernel, the device
choice pointed at the CPU) the budget and Ctrl-C stop the search cleanly, the summary in words
always prints (into a pipe too, and on stderr beside --format json), a rerun finishes what a stop
left and reuses the rest, --force tunes again; a real Ctrl-C stops a CPU run in a fresh process."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from longca_triton.bench import autotune as at
from longca_triton.bench import autotune_run as run
from longca_triton.cli import main
from longca_triton.kernels.core import tuned

REPO = Path(__file__).resolve().parents[2]


def test_cpu_run_says_what_it_does(autotune_cache):
    r = CliRunner().invoke(main, ["autotune", "--block", "64", "--kernel", "triton-sparse"])
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "block 32 instead of 64: a 160-token sequence then spans 5 blocks" in out
    assert "candidates: each key group's first one" in out and "the other candidates are not run" in out
    assert "no autotune cache is written" in out and not autotune_cache.exists()
    assert "checking triton-sparse at block 32: 1 case × 3 key groups" in out and "1 cases" not in out
    assert out.splitlines()[-1].startswith("autotune on a CPU: 3 of 3 checks ran (triton-sparse, each key group's "
                                           "first candidate), 3 ok, 0 wrong; nothing timed, no cache written;")


def test_cpu_run_with_a_wrong_check_exits_1(autotune_cache, monkeypatch):
    """A kernel that disagrees with the fp64 reference fails the run (exit 1), its rows saying WRONG."""
    import dataclasses

    real = at.TUNABLES["triton-sparse"]
    broken = dataclasses.replace(real, run=lambda q, k, v, mask, config: real.run(q, k, v, mask, config) * 2)
    monkeypatch.setitem(at.TUNABLES, "triton-sparse", broken)
    r = CliRunner().invoke(main, ["autotune", "--block", "64", "--kernel", "triton-sparse"])
    assert r.exit_code == 1, r.output
    assert "WRONG" in r.stdout and ", 3 wrong;" in r.stdout.splitlines()[-1]


def ctrl_c(args, env, after: str, wait_s: float, timeout: float = 300) -> list[str]:
    """Run ``longca-triton autotune ARGS`` in a fresh process, press Ctrl-C ``wait_s`` after a line
    starting with ``after``; its output lines (it must exit 130)."""
    p = subprocess.Popen([sys.executable, "-m", "longca_triton.cli", "autotune", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    try:
        lines = []
        for line in p.stdout:
            lines.append(line)
            if line.startswith(after):
                time.sleep(wait_s)
                p.send_signal(signal.SIGINT)
                break
        lines += p.stdout.readlines()
        assert p.wait(timeout=timeout) == 130, "".join(lines)
    finally:
        p.kill()
    return lines


def test_ctrl_c_stops_a_cpu_run_with_its_summary_and_exit_130():
    """A fresh process, as a user runs it: Ctrl-C once the checks are under way."""
    if torch.cuda.is_available():
        pytest.skip("a GPU machine tunes instead of checking")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    lines = ctrl_c(["--block", "64", "--kernel", "triton"], env, after="checking triton", wait_s=0.5, timeout=60)
    last = lines[-1]
    assert last.startswith("autotune on a CPU: ") and last.rstrip().endswith("; stopped by Ctrl-C"), "".join(lines)
    ran, rest = last.removeprefix("autotune on a CPU: ").split(" of ", 1)
    assert int(ran) < 15 and rest.startswith("15 checks ran (triton, each key group's first candidate)"), last


calls = []


@pytest.fixture
def fake(autotune_cache, monkeypatch):
    """A made-up kernel (a fwd and a bwd key group of 8 candidates; each run takes ``fake.sleep_s``,
    30 ms) on the tuning path: the command's device choice answers the CPU, not interpreted."""

    def attend(q, k, v, mask, config):
        calls.append(dict(config))
        time.sleep(fake.sleep_s)
        if len(calls) == fake.ctrl_c_at:
            os.kill(os.getpid(), signal.SIGINT)
        return q * (1.0 + config["X"] + config["Y"]) + 0 * (k.sum() + v.sum())

    calls.clear()
    fake.ctrl_c_at, fake.sleep_s = None, 0.03
    monkeypatch.setattr("longca_triton.runtime.select_device", lambda device=None: ("cpu", False))
    monkeypatch.setitem(at.TUNABLES, "fake", run.Tunable(
        name="fake", groups={"fwd": "fwd", "bwd": "bwd"},
        candidates=lambda group, block, head_dim: [dict(X=i) if group == "fwd" else dict(Y=i) for i in range(8)],
        run=attend, default=lambda head_dim, dtype, mask=None, group=1: dict(X=0, Y=0)))
    return fake


def tune(*extra):
    return CliRunner().invoke(main, ["autotune", "--kernel", "fake", "--masks", "full,causal", "--seqlens", "64",
                                     "--head-dims", "16", "--dtypes", "float16", "--heads", "2:1",
                                     "--vendors", "reference", *extra])


def cached_rows():
    tuned.reload()
    return tuned.device_rows(tuned.device_key("cpu"), "fake")


def test_budget_stops_cleanly_and_a_rerun_finishes(fake):
    fake.sleep_s = 0.1  # a class's 26 runs need 2.6 s; the 2.4 s budget gives each class about half
    r = tune("--budget-minutes", "0.04")
    assert r.exit_code == 0, r.output
    out = r.stdout  # into a pipe: the summary in words
    assert "autotune summary, CPU:" in out and "stopped by the 0.04-minute budget" in out
    for mask in ("full", "causal"):  # neither class is left out: each is cut in its part of the budget
        assert (f"fake at block 64, S ≤ 4K, {mask}: cut short: the best config measured so far, written; a rerun "
                "with a larger --budget-minutes (or --force) tunes it again (it had a share of a 0.04-minute budget)") in out
    assert "    cases: full S=64 D=16 float16" in out
    # the vendors are timed first, on the class's heaviest case, and shown beside ours there
    assert "    fwd: default " in out and "; on full S=64 D=16 float16: default " in out and ", reference " in out
    assert "skipped" not in out and "2 classes written, 0 classes reused" in out
    rows = cached_rows()
    assert len(rows) == 2 and all(r.measured["search"]["stopped_by_deadline"] for r in rows)
    assert {r.measured["search"]["budget_minutes"] for r in rows} == {0.04}

    n = len(calls)
    r = tune("--budget-minutes", "0.04")  # the same budget would get no further: both reused, nothing timed
    assert r.exit_code == 0 and r.stdout.count("reused from the cache") == 2 and len(calls) == n, r.output
    fake.sleep_s = 0.03
    r = tune("--budget-minutes", "0")  # no budget: both cut classes again, to the end
    assert r.exit_code == 0, r.output
    assert r.stdout.count(": tuned now (successive halving") == 2 and "skipped" not in r.stdout
    n = len(calls)
    r = tune()  # warm: both reused, nothing timed
    assert r.exit_code == 0 and r.stdout.count("reused from the cache") == 2 and len(calls) == n, r.output
    assert "0 classes written, 2 classes reused" in r.stdout
    r = tune("--force", "--budget-minutes", "0")
    assert r.exit_code == 0 and r.stdout.count(": tuned now") == 2 and len(calls) > n, r.output


def test_the_budget_is_shared_among_the_kernels(fake, monkeypatch):
    """Two kernels and a budget the first would spend alone: each gets its share, so each writes a
    class (cut short), and the summary says the budget stopped them."""
    first = at.TUNABLES["fake"]
    monkeypatch.setitem(at.TUNABLES, "fake2", dataclasses.replace(first, name="fake2"))
    r = CliRunner().invoke(main, ["autotune", "--kernel", "fake,fake2", "--masks", "full,causal", "--seqlens", "64",
                                  "--head-dims", "16", "--dtypes", "float16", "--heads", "2:1", "--vendors", "none",
                                  "--budget-minutes", "0.04"])  # 2.4 s; one kernel's two classes take 1.6 s
    assert r.exit_code == 0, r.output
    tuned.reload()
    for kernel in ("fake", "fake2"):
        rows = tuned.device_rows(tuned.device_key("cpu"), kernel)
        assert len(rows) >= 1, f"{kernel} got no share of the budget: {r.output}"
    assert "stopped by the 0.04-minute budget" in r.stdout
    for kernel in ("fake", "fake2"):
        assert f"{kernel} at block 64, S ≤ 4K, full: cut short" in r.stdout


def test_ctrl_c_while_timing_keeps_the_best_so_far_and_exits_130(fake):
    fake.ctrl_c_at = 5  # in the forward group's screen
    r = tune("--format", "json")
    assert r.exit_code == 130, r.output
    rows = json.loads(r.stdout)  # stdout: the table alone
    assert [(x["masks"], x["mode"], x["source"]) for x in rows] == [("full", "fwd", "successive halving, cut short")]
    err = r.stderr
    assert "stopped by Ctrl-C" in err and "fake at block 64, S ≤ 4K, full: cut short" in err
    assert "    bwd: not searched before the stop (the default config stays)" in err
    assert ", reference " in err and "causal S=64 D=16 float16): Ctrl-C came before it began" in err
    assert len(calls) < 12  # stopped within a few measurements of the Ctrl-C
    (row,) = cached_rows()
    assert row.measured["search"]["stopped_by_deadline"] and "fwd" in row.measured["tflops"]


GPU_ARGS = ["--block", "64", "--kernel", "triton", "--masks", "causal", "--force"]


@pytest.mark.gpu
def test_gpu_budget_into_a_pipe_ends_on_the_summary(autotune_cache):
    r = subprocess.run([sys.executable, "-m", "longca_triton.cli", "autotune", *GPU_ARGS, "--seqlens", "4096",
                        "--budget-minutes", "0.25", "--vendors", "sdpa-cudnn"], capture_output=True, text=True,
                       env=dict(os.environ), cwd=REPO, timeout=600)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    summary = out[out.index("autotune summary, "):]
    assert "cases: causal S=4096 D=128 bfloat16" in summary and "fwd: default " in summary and "sdpa-cudnn" in summary
    assert "cache: " in summary


@pytest.mark.gpu
def test_gpu_ctrl_c_while_timing_exits_130_with_the_summary(autotune_cache):
    args = [*GPU_ARGS, "--seqlens", "4096,16384", "--budget-minutes", "0", "--vendors", "none"]  # two classes
    out = "".join(ctrl_c(args, dict(os.environ), after="tuning triton", wait_s=5))
    assert "stopped by Ctrl-C" in out and ("cut short: the best config measured so far" in out
                                           or "Ctrl-C came before it began" in out), out


def test_each_kernel_gets_an_equal_share_of_what_is_left(monkeypatch):
    from longca_triton.bench import autotune_summary as summ

    now = [100.0]
    monkeypatch.setattr(summ.time, "monotonic", lambda: now[0])
    stop = summ.Stop(1.0)  # 60 s from t = 100
    first = stop.share(3)  # 20 s of the 60 left
    now[0] = 119.0
    assert not first() and stop.why == ""
    now[0] = 121.0
    assert first() and not stop() and stop.why == "the 1-minute budget (each kernel's and class's share of it)"
    second = stop.share(2)  # half of the 39 s left: what the first left unused carries over
    now[0] = 140.0
    assert not second()
    now[0] = 161.0
    assert second() and stop() and stop.why == "the 1-minute budget"
    assert summ.Stop(None).share(3) is not None and not summ.Stop(None).share(3)()


def test_vendors_past_their_share_still_reuse_what_another_kernel_measured(fake):
    """Once the vendors' share of the budget is spent nothing more is timed, but a class whose case
    another kernel's vendors already measured still gets those numbers."""
    from longca_triton.bench.autotune_cli import _measure_vendors
    from longca_triton.output import console

    t = at.TUNABLES["fake"]
    cs = run.build_cases(["full", "causal"], [64], [16], [torch.float16], (2, 1))
    memo = {("reference", "full S=64 D=16 float16", m): 50.0 for m in ("fwd", "bwd")}
    got = _measure_vendors(console(), t, 64, cs, ["reference"], "cpu", lambda: True, False, memo)
    ((label, by_mode),) = got.values()
    assert label == "full S=64 D=16 float16" and by_mode == {m: {"reference": pytest.approx(50.0)} for m in ("fwd", "bwd")}
    got = _measure_vendors(console(), t, 64, cs, ["reference"], "cpu", lambda: False, False, memo)
    assert len(got) == 2 and len(memo) == 4

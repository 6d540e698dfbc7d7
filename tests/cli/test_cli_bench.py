"""The bench / plot / report / doctor commands (click), on the CPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from longca_triton.bench.cli import bench, cli, doctor, plot, report
from longca_triton.bench.store import ResultStore

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def runner(monkeypatch):
    # the bench command sets TRITON_INTERPRET on a CPU machine; keep it from leaking into other tests
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    return CliRunner()


@pytest.mark.parametrize("args", [["bench", "--help"], ["bench", "dense", "--help"], ["plot", "--help"], ["report", "--help"], ["doctor", "--help"]])
def test_help_has_examples(runner, args):
    r = runner.invoke(cli, args)
    assert r.exit_code == 0 and "Example" in r.output and "longca-triton" in r.output


@pytest.mark.parametrize("flag,value,needle", [
    ("--masks", "causal,nope", "unknown mask 'nope'"),
    ("--heads", "64:7", "multiple of key/value heads"),
    ("--seqlens", "4K,abc", "sequence length 'abc'"),
    ("--mode", "up", "unknown mode 'up'"),
    ("--backends", "reference,flx", "unknown backend 'flx'"),
    ("--dtype", "int8", "dtype 'int8' unknown"),
    ("--head-dim", "x", "head dim"),
])
def test_bad_values_fail_before_running(runner, tmp_path, flag, value, needle):
    out = tmp_path / "o"
    r = runner.invoke(bench, ["dense", "--preset", "smoke", flag, value, "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert not out.exists()


def test_needs_config_or_preset(runner):
    r = runner.invoke(bench, ["dense"])
    assert r.exit_code == 2 and "--config" in r.output


def test_smoke_run_writes_results_plots_report(runner, tmp_path):
    out = tmp_path / "o"
    r = runner.invoke(bench, ["dense", "--preset", "smoke", "--masks", "causal,causal_document", "--backends",
                              "reference,sdpa-math", "--out", str(out)])
    assert r.exit_code == 0, r.output
    rows = ResultStore(out / "results.jsonl").rows()
    assert len(rows) == 2 * 2 * 2 and all(x["status"] == "ok" for x in rows)
    assert all(x["device"] == "cpu" and x["preset"] == "smoke" and x["seqlen"] == 160 for x in rows)
    assert all(x["interpreted"] is True for x in rows)
    assert (out / "report.md").read_text().startswith("# Benchmark report: smoke")
    assert "CPU run" in (out / "report.md").read_text()
    assert sorted(p.name.split("_")[0] for p in (out / "plots").iterdir()) == ["heatmap", "heatmap", "tflops", "tflops"]
    assert "this run: TFLOP/s (or status) [CPU run: not performance numbers]" in r.output and "(CPU)" in r.output
    assert "this run" in r.output and (out / "commands.txt").exists() and json.loads((out / "experiment.json").read_text())["preset"] == "smoke"
    # rerun: nothing new
    r2 = runner.invoke(bench, ["dense", "--preset", "smoke", "--masks", "causal,causal_document", "--backends",
                               "reference,sdpa-math", "--out", str(out)])
    assert r2.exit_code == 0 and "nothing new" in r2.output and len(ResultStore(out / "results.jsonl").rows()) == 8
    # report and plot commands on the same file
    r3 = runner.invoke(report, [str(out / "results.jsonl")])
    assert r3.exit_code == 0 and "| causal_document | 160 |" in r3.output
    r4 = runner.invoke(plot, [str(out), "--out", str(tmp_path / "p")])
    assert r4.exit_code == 0 and len(list((tmp_path / "p").glob("*.png"))) == 4


def test_config_on_cpu_runs_smoke_instead(runner, tmp_path):
    out = tmp_path / "o"
    r = runner.invoke(bench, ["dense", "--config", str(REPO / "experiments" / "dense_quick.toml"), "--masks", "causal",
                              "--backends", "reference", "--mode", "fwd", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "No CUDA GPU" in r.output and "smoke" in r.output
    rows = ResultStore(out / "results.jsonl").rows()
    assert len(rows) == 1 and rows[0]["preset"] == "smoke" and rows[0]["seqlen"] == 160


BAD_CONFIGS = {
    "missing": (None, "does not exist"),
    "malformed": ("[grid\nmasks = [causal\n", "invalid TOML"),
    "invalid": ('[experiment]\nkind = "{kind}"\n[grid]\nmasks = ["causl"]\n', "unknown mask 'causl'"),
}


@pytest.mark.parametrize("kind", ["dense", "sparse", "varblock"])
@pytest.mark.parametrize("problem", list(BAD_CONFIGS))
def test_bad_config_is_one_error_before_anything_runs(runner, tmp_path, kind, problem):
    """A missing, malformed or invalid --config stops the command on any machine (on a CPU too, where
    a good file would give way to the smoke preset): one line naming the file and the problem."""
    text, needle = BAD_CONFIGS[problem]
    path = tmp_path / f"{problem}.toml"
    if text is not None:
        path.write_text(text.format(kind=kind))
    out = tmp_path / "o"
    r = runner.invoke(cli, ["bench", kind, "--config", str(path), "--out", str(out)])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert str(path) in lines[0] and needle in lines[0], r.output
    assert not out.exists()


def test_report_and_plot_errors(runner, tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    assert runner.invoke(plot, [str(empty), "--out", str(tmp_path / "p")]).exit_code == 2
    assert runner.invoke(report, [str(tmp_path)]).exit_code == 2  # no results.jsonl in the directory


NOT_RESULTS = {
    "empty": ("", "it is empty"),
    "text": ("hello\nworld\n", "none of its 2 lines is a JSON object"),
    "other JSON": ('{"step": 1, "loss": 2.5}\n', "no row has all of backend, mask, seqlen, mode, status"),
}


@pytest.mark.parametrize("command", ["report", "recommend"])
@pytest.mark.parametrize("content", list(NOT_RESULTS))
def test_not_a_results_file_is_an_error(runner, tmp_path, command, content):
    from longca_triton.cli import main

    text, needle = NOT_RESULTS[content]
    path = tmp_path / "x.jsonl"
    path.write_text(text)
    args = ["report", str(path)] if command == "report" else ["recommend", "--mask", "causal", "-S", "16K", "--results", str(path)]
    r = runner.invoke(main, args)
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path} is not a results file: {needle}"), r.output


def test_doctor_lists_every_backend_with_reasons(runner):
    r = runner.invoke(doctor, ["--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    names = {b["name"]: b for b in info["backends"]}
    for n in ("reference", "sdpa-math", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "varlen-fa2", "flex", "flex-fa4",
              "cudnn", "fa2", "fa3", "fa3-fwd", "fa4", "te", "flashmask"):
        assert n in names, n
        assert names[n]["available"] or names[n]["reason"], n
    assert names["reference"]["available"] and info["env"]["torch"]
    r = runner.invoke(doctor, [])
    assert r.exit_code == 0 and "backends" in r.output and "sdpa-cudnn" in r.output


def test_report_and_plot_read_gzipped_results(runner, tmp_path):
    """report / plot take a results.jsonl.gz (named, or the one in a folder) as the plain file; a
    folder with both reads the plain one and says so."""
    import gzip

    from longca_triton.bench.report import load_rows

    plain = tmp_path / "plain" / "results.jsonl"
    ResultStore(plain).extend([{"kind": "dense", "backend": b, "mask": "causal", "mask_params": {}, "seqlen": 4096,
                                "batch": 1, "heads_q": 64, "heads_kv": 8, "head_dim": 128, "dtype": "bfloat16",
                                "mode": "fwd", "status": "ok", "tflops": t, "time_ms": 1.0, "gpu": "GPU-X",
                                "time": f"2026-11-22T00:00:0{i}+00:00"}
                               for i, (b, t) in enumerate((("triton", 500.0), ("flex", 400.0)))])
    gz = tmp_path / "gz" / "results.jsonl.gz"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    assert load_rows(gz) == load_rows(plain) == load_rows(gz.parent) and len(load_rows(gz)) == 2
    a, b = runner.invoke(report, [str(plain)]), runner.invoke(report, [str(gz)])
    assert a.exit_code == b.exit_code == 0, b.output
    assert b.output == a.output.replace(str(plain), str(gz))
    r = runner.invoke(plot, [str(gz.parent), "--out", str(tmp_path / "p")])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "p").glob("*.png"))
    (gz.parent / "results.jsonl").write_bytes(plain.read_bytes()[: plain.read_bytes().index(b"\n") + 1])
    r = runner.invoke(cli, ["report", str(gz.parent)])
    assert r.exit_code == 0 and "warning: both" in r.output and "reading results.jsonl, not results.jsonl.gz" in r.output
    assert "(1 points)" in r.output or "1 point" in r.output


def test_headline_autotune_on_a_cpu_switches_to_the_interpreter_itself():
    """`longca-triton autotune --block 64` on a machine without a GPU and without TRITON_INTERPRET set:
    the command turns the interpreter on before anything imports triton, says so, and checks the
    candidates (a fresh process, as a user runs it)."""
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("a GPU machine tunes for real")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "longca_triton.cli", "autotune", "--block", "64", "--kernel",
                        "triton-sparse", "--format", "json"], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Triton interpreter" in r.stderr
    rows = json.loads(r.stdout)
    assert rows and all(row["status"] == "ok" for row in rows)


def _points(path, device="cuda"):
    """Two measured points of one problem, on a GPU or (``device='cpu'``) through the interpreter."""
    on_cpu = dict(device="cpu", interpreted=True, gpu=None) if device == "cpu" else dict(device="cuda", gpu="GPU-X")
    ResultStore(path).extend([{"kind": "dense", "backend": b, "mask": "causal", "mask_params": {}, "seqlen": 4096,
                               "batch": 1, "heads_q": 64, "heads_kv": 8, "head_dim": 128, "dtype": "bfloat16",
                               "mode": "fwd", "status": "ok", "tflops": t, "time_ms": 1.0, **on_cpu,
                               "time": f"2026-11-22T00:00:0{i}+00:00"}
                              for i, (b, t) in enumerate((("triton", 500.0), ("flex", 400.0)))])
    return path


@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_report_machine_formats(runner, tmp_path, fmt):
    import csv
    import io

    path = _points(tmp_path / "results.jsonl", "cpu")
    r = runner.invoke(cli, ["report", str(path), "--format", fmt])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout) if fmt == "json" else list(csv.DictReader(io.StringIO(r.stdout)))
    assert [(x["backend"], float(x["tflops"])) for x in rows] == [("triton", 500.0), ("flex", 400.0)]
    assert {x["measured_on"] for x in rows} == {"cpu (Triton interpreter)"}
    out = tmp_path / f"points.{fmt}"
    r = runner.invoke(cli, ["report", str(path), "--format", fmt, "--out", str(out)])
    assert r.exit_code == 0 and r.stdout == "" and out.read_text().count("triton") == 1


def test_cpu_rows_carry_a_caveat_in_tables_and_plots(runner, tmp_path, monkeypatch):
    """A report's TFLOP/s table and every plot title of rows measured on a CPU say they are no
    performance numbers; a GPU's rows carry no such line."""
    from matplotlib.figure import Figure

    from longca_triton.bench.store import CPU_CAVEAT, CPU_TAG

    titles = []
    save = Figure.savefig

    def keep_titles(fig, *a, **kw):  # the titles a plot was saved with
        titles.append(" ".join([fig._suptitle.get_text() if fig._suptitle else ""] + [ax.get_title() for ax in fig.axes]))
        return save(fig, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", keep_titles)
    for device in ("cpu", "cuda"):
        path = _points(tmp_path / device / "results.jsonl", device)
        md = runner.invoke(cli, ["report", str(path)]).output
        assert (CPU_CAVEAT in md.split("## fwd")[1]) == (device == "cpu"), md
        titles.clear()
        assert runner.invoke(cli, ["plot", str(path), "--out", str(tmp_path / device / "p")]).exit_code == 0
        assert titles and all((CPU_TAG in t) == (device == "cpu") for t in titles), titles


@pytest.mark.parametrize("env,gpu_says", [
    (dict(torch="2.13.0+cpu", cuda=None), "none (this torch is a CPU build)"),
    (dict(torch="2.13.0+cu130", cuda="13.0"), "none (torch built for CUDA 13.0 sees no GPU"),
    (dict(torch="2.13.0+cu130", cuda="13.0", gpu="NVIDIA H100", gpu_capability="9.0", gpu_memory_gib=79.2), "NVIDIA H100"),
], ids=["cpu-build", "cuda-build-no-device", "h100"])
def test_doctor_says_none_and_why_instead_of_blanks(env, gpu_says):
    from longca_triton.bench.doctor import env_rows

    rows = {r["what"]: r["value"] for r in env_rows(env)}
    assert str(rows["gpu"]).startswith(gpu_says)
    assert all(v not in (None, "") for v in rows.values()), rows
    if "gpu" not in env:
        assert rows["gpu_capability"] == rows["gpu_memory_gib"] == rows["driver"] == "none (no GPU)"
    else:
        assert rows["driver"].startswith("unknown (") and rows["gpu_capability"] == "9.0"


def test_doctor_table_has_no_blank_field(runner):
    r = runner.invoke(doctor, [])
    assert r.exit_code == 0, r.output
    env = r.stdout.split("backends")[0]
    fields = [line.split(None, 1) for line in env.splitlines()[2:] if line.strip() and not line.strip().startswith("─")]
    assert len(fields) >= 13 and all(len(f) == 2 for f in fields), env

"""experiments/gpu/issue13_targets.py and issue17_targets.py on small result files: each target's ratio and
verdict, a missing peer reported as missing (never as met), the latest row of a retried point used, tarballs read
like folders."""

import importlib.util
import json
import sys
import tarfile
from pathlib import Path

import pytest

from longca_triton.masks import STATIC_MASK_NAMES

PATH = Path(__file__).resolve().parents[1] / "experiments" / "gpu" / "issue13_targets.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("issue13_targets", PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass resolves annotations through its module
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def row(backend, mask, S, tflops, time="2026-12-01T00:00:00", **params):
    return dict(kind="sparse" if params else "dense", backend=backend, mask=mask, mask_params=dict(seed=0, **params),
                params_digest=json.dumps(params, sort_keys=True), seqlen=S, batch=1, heads_q=64, heads_kv=8,
                head_dim=128, dtype="bfloat16", mode="bwd", status="ok", tflops=tflops, gpu="GPU-X", time=time,
                env=dict(git_commit="abc123", git_dirty=False))


def test_targets_verdicts(tool, tmp_path):
    rows = [row("triton", m, 16384, 440) for m in STATIC_MASK_NAMES]
    rows += [row("flex", m, 16384, 390) for m in STATIC_MASK_NAMES if m != "sliding_window"]  # 1.128x
    rows += [row("flex", "causal", 16384, 420, time="2026-12-01T01:00:00")]  # retried: 1.048x, the latest counts
    rows += [row("sdpa-cudnn", "full", 16384, 540), row("sdpa-cudnn", "causal", 16384, 560)]  # 0.815x, 0.786x
    for S in (32768, 65536):
        for d in (0.3, 0.5):
            for p in (8, 1):
                rows += [row("triton-sparse", "block_sparse", S, 400, block=128, density=d, patterns=p),
                         row("flex", "block_sparse", S, 370, block=128, density=d, patterns=p)]
            rows.append(row("triton-varblock", "varblock_sparse", S, 330 if d == 0.3 else 310, block=256, density=d,
                            patterns=8, min_block=128))
    merged = 'triton-varblock{"dkdv_tail_order":3}'
    rows += [row(merged, "varblock_sparse", S, 340, block=256, density=d, patterns=8, min_block=128)
             for S in (32768, 65536) for d in (0.3, 0.5)]
    rows += [row("triton-sparse", "block_sparse", 65536, 380, block=64, density=0.5, patterns=8),
             row("vsa-triton", "block_sparse", 65536, 340, block=64, density=0.5, patterns=8)]
    rows.append(dict(rows[0], mode="fwd", tflops=9999.0))  # another mode: ignored
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"cut")
    with tarfile.open(tmp_path / "run.tgz", "w:gz") as tf:
        tf.add(tmp_path / "run", arcname="run")

    for src in (tmp_path / "run", tmp_path / "run.tgz"):
        ts = {(t.name, t.case): t for t in tool.targets(tool.read_rows([src]))}
        assert len(ts) == 12 + 2 + 8 + 1 + 4
        assert ts[("dense vs Flex", "full 16K")].verdict == "met"
        assert ts[("dense vs Flex", "causal 16K")].ratio == pytest.approx(440 / 420)
        assert ts[("dense vs Flex", "causal 16K")].verdict == "NOT met"
        assert ts[("dense vs Flex", "sliding_window 16K")].verdict == "missing"
        assert ts[("dense vs cuDNN", "full 16K")].verdict == "met"
        assert ts[("dense vs cuDNN", "causal 16K")].verdict == "NOT met"
        assert all(t.verdict == "met" for (n, _), t in ts.items() if n == "block 128 vs Flex")
        assert ts[("block 64 vs VSA", "64K 0.5")].ratio == pytest.approx(380 / 340)
        assert ts[("variable vs uniform 128", "32K 0.3")].ratio == pytest.approx(330 / 400)
        assert ts[("variable vs uniform 128", "64K 0.5")].verdict == "NOT met"
    assert tool.provenance(tool._ours(tool.read_rows([tmp_path / "run"]))) == ["abc123 on GPU-X: 51 rows"]  # the retried point once
    # a launch config of the variable-block backend, by its name
    conf = {t.case: t for t in tool.targets(tool.read_rows([tmp_path / "run"]), varblock=merged)
            if t.name == "variable vs uniform 128"}
    assert all(t.ratio == pytest.approx(340 / 400) and t.verdict == "met" for t in conf.values()) and len(conf) == 4


def test_main_prints_a_table(tool, tmp_path, capsys):
    (tmp_path / "results.jsonl").write_text(json.dumps(row("triton", "full", 16384, 440)) + "\n")
    assert tool.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| dense vs Flex | full 16K | 440.0 | - | - | 1.1 | missing |" in out
    assert "0 of 27 targets met; 27 missing" in out


@pytest.fixture(scope="module")
def tool17(tool):
    spec = importlib.util.spec_from_file_location("issue17_targets", PATH.parent / "issue17_targets.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def test_issue17_targets(tool17, tmp_path):
    """issue17_targets.py: ours against cuDNN at each dim cuDNN runs, D = 96 against our D = 128 per FLOP, every
    backend's D = 96 / 128 and the backward listed."""
    def r(backend, mask, d, dv, tflops, mode="fwd", status="ok"):
        return dict(row(backend, mask, 16384, tflops), head_dim=d, d_v=dv, mode=mode, status=status,
                    params_digest=f"{mask}")
    rows = [r("triton-gluon", "full", 96, 96, 560), r("triton-gluon", "full", 128, 128, 650),
            r("sdpa-cudnn", "full", 96, 96, 480), r("sdpa-cudnn", "full", 128, 128, 600),
            r("fa3-fwd", "full", 96, 96, 540), r("fa3-fwd", "full", 128, 128, 620),
            r("triton-gluon", "full", 192, 128, 500), r("sdpa-cudnn", "full", 192, 128, 700),
            r("triton-gluon", "full", 256, 256, 600),
            r("sdpa-cudnn", "full", 256, 256, 0, status="unsupported: no such engine"),
            r("triton-gluon", "full", 128, 128, 500, mode="bwd")]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    got = tool17.read_rows([tmp_path])
    ts = {(t.name, t.case): t for t in tool17.targets(got)}
    assert ts[("triton-gluon vs cuDNN", "full D=96")].ratio == pytest.approx(560 / 480)
    assert ts[("triton-gluon vs cuDNN", "full D=192/128")].verdict == "NOT met"  # 0.71x
    assert ("triton-gluon vs cuDNN", "full D=256") not in ts  # cuDNN does not run it: no target
    assert ts[("triton-gluon vs cuDNN", "full D=64")].verdict == "missing"
    assert ts[("D=96 vs own D=128 per FLOP", "triton-gluon full")].ratio == pytest.approx(560 / 650)
    assert ts[("D=96 vs own D=128 per FLOP", "triton-gluon full")].verdict == "met"
    assert ts[("D=96 vs own D=128 per FLOP", "triton-gluon causal")].verdict == "missing"
    lines = tool17.reference_lines(got)
    assert "fa3-fwd full: D=96 540.0 / D=128 620.0 TFLOP/s = 0.871 per FLOP" in lines
    assert "triton-gluon full backward: D=128 500.0" in lines

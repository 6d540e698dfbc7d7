"""Block-sparse grids (experiments/sparse.toml, varblock.toml), `bench sparse|varblock` and
`autotune` for the block-sparse kernels, on the CPU (Triton interpreter)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from longca_triton.bench import autotune as at
from longca_triton.bench import autotune_run as run
from longca_triton.kernels.core import tuned
from longca_triton.adapters import list_backends
from longca_triton.bench.cli import bench
from longca_triton.bench.config import ConfigError, Experiment, load_experiment, resolve_params
from longca_triton.bench.report import markdown_report
from longca_triton.bench.runner import plan_points
from longca_triton.bench.store import ResultStore
from longca_triton.cli import main
from longca_triton.masks import make_mask

REPO = Path(__file__).resolve().parents[2]
KNOWN = {b.name for b in list_backends()}


@pytest.fixture
def runner(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    return CliRunner()


# ---------------------------------------------------------------------------- the experiment files
def test_sparse_toml_expands_the_full_grid():
    e = load_experiment(REPO / "experiments" / "sparse.toml").validate(known_backends=KNOWN)
    assert e.kind == "sparse" and e.masks == ["block_sparse"]
    assert e.seqlens == [32768, 65536, 131072] and e.heads == [(64, 8), (64, 64)]
    assert e.head_dims == [128] and e.dtypes == ["bfloat16"] and e.modes == ["fwd", "bwd"] and not e.check
    assert {"triton-sparse", "flex", "vsa-cuda", "vsa-triton", "flashinfer-bsr"} <= set(e.backends)
    assert e.swept("block_sparse") == ["block", "density"]
    assert [e.variant_values("block_sparse", i) for i in range(len(e.variants("block_sparse")))] == [
        {"block": b, "density": d} for b in (64, 128) for d in (0.2, 0.5, 0.8)]
    assert e.variant_label("block_sparse", 4) == "block_sparse[block=128,density=0.5]"
    # one pattern per KV head: P = 8 for GQA 64:8, 64 for MHA
    assert e.params_for("block_sparse", 32768, (64, 8), 0) == {"block": 64, "density": 0.2, "patterns": 8}
    assert e.params_for("block_sparse", 131072, (64, 64), 5) == {"block": 128, "density": 0.8, "patterns": 64}
    groups = plan_points(e)
    assert len(groups) == 6 * 3 * 2 == 36
    assert e.num_points() == sum(len(p) for _, p in groups) == 36 * 2 * len(e.backends) == 504
    # S outermost, then the variants, heads innermost
    assert [g[0][1] for g in groups[:12]] == [32768] * 12 and groups[12][0][1] == 65536
    assert [(g[0][2], g[0][3], g[0][6]) for g in groups[:3]] == [(64, 8, 0), (64, 64, 0), (64, 8, 1)]


def test_varblock_toml_expands_the_full_grid():
    e = load_experiment(REPO / "experiments" / "varblock.toml").validate(known_backends=KNOWN)
    assert e.kind == "varblock" and e.masks == ["varblock_sparse"] and e.heads == [(64, 8)]
    assert e.seqlens == [32768, 65536] and e.modes == ["fwd", "bwd"]
    assert set(e.backends) == {"triton-varblock", "flex", "flashinfer-varblock"}
    vs = e.variants("varblock_sparse")
    assert len(vs) == 4 * 5
    for i in range(len(vs)):  # min_block = "block/2" resolves in each variant's own block
        p = e.params_for("varblock_sparse", 32768, (64, 8), i)
        assert p["min_block"] == p["block"] // 2 and p["patterns"] == 8
    assert sorted({e.params_for("varblock_sparse", 32768, (64, 8), i)["block"] for i in range(20)}) == [128, 256, 512, 1024]
    assert sorted({e.params_for("varblock_sparse", 32768, (64, 8), i)["density"] for i in range(20)}) == [0.1, 0.3, 0.5, 0.7, 0.9]
    assert e.num_points() == 20 * 2 * 1 * 2 * 3 == 240 and len(plan_points(e)) == 40


def test_dense_files_are_unchanged_by_the_sweeps():
    e = load_experiment(REPO / "experiments" / "dense.toml").validate()
    assert e.kind == "dense" and all(len(e.variants(m)) == 1 for m in e.masks)
    assert e.variant_label("causal_document", 0) == "causal_document" and e.variant_values("causal", 0, 64) == {}


def test_block_sparse_labels_name_block_and_density_even_unswept():
    e = Experiment(kind="sparse", masks=["block_sparse"], mask_params={"block_sparse": {"block": 128}})
    assert e.variant_label("block_sparse") == "block_sparse[block=128,density=0.5]"  # density: the default
    e = Experiment(kind="varblock", masks=["varblock_sparse"], mask_params={"varblock_sparse": {"patterns": [1, 2]}})
    assert e.variant_label("varblock_sparse", 1) == "varblock_sparse[block=256,density=0.5,patterns=2]"


# ---------------------------------------------------------------------------- parameter resolution
def test_resolve_params():
    assert resolve_params({"block": 256, "min_block": "block/2", "patterns": "Hkv"}, 4096, (32, 4)) == \
        {"block": 256, "min_block": 128, "patterns": 4}
    assert resolve_params({"min_block": "block//4", "block": "S//16"}, 4096) == {"min_block": 64, "block": 256}
    assert resolve_params({"docs": "hist", "doc_lens": ["S//2", "S - S//2"]}, 11) == {"docs": "hist", "doc_lens": [5, 6]}
    assert resolve_params({"patterns": "Hq // 2"}, 10, (8, 2)) == {"patterns": 4}
    with pytest.raises(ConfigError, match="heads are needed"):
        resolve_params({"patterns": "Hkv"}, 64)
    with pytest.raises(ConfigError, match="cycle"):
        resolve_params({"block": "min_block*2", "min_block": "block/2"}, 64)
    with pytest.raises(ConfigError, match="unknown name 'blok'"):
        resolve_params({"block": 8, "min_block": "block + blok"}, 64)
    with pytest.raises(ConfigError, match="not a number"):
        resolve_params({"docs": "hist", "window": "docs*2"}, 64)


def test_sweeps_and_list_valued_parameters():
    e = Experiment(masks=["causal_document"], mask_params={"causal_document": {"doc_lens": ["S//2", "S - S//2"]}})
    assert e.swept("causal_document") == [] and len(e.variants("causal_document")) == 1
    e = Experiment(masks=["causal_document"], mask_params={"causal_document": {"doc_lens": [["S//2", "S - S//2"], ["S"]]}})
    assert e.swept("causal_document") == ["doc_lens"] and e.params_for("causal_document", 10, variant=1) == {"doc_lens": [10]}
    e = Experiment(kind="sparse", masks=["block_sparse"], seqlens=[256], heads=[(4, 2)], backends=["reference"],
                   mask_params={"block_sparse": {"block": [32, 64], "density": [0.25, 0.5, 1.0], "patterns": "Hkv"}}).validate()
    assert e.num_points() == 6 * 2 and len(plan_points(e)) == 6


def test_bad_sparse_grids():
    base = dict(kind="sparse", masks=["block_sparse"], seqlens=[256], heads=[(4, 2)], backends=["reference"])
    with pytest.raises(ConfigError, match="patterns do not divide 4 query heads"):
        Experiment(**base, mask_params={"block_sparse": {"patterns": 3}}).validate()
    with pytest.raises(ConfigError, match=r"block_sparse\[block=64,density=1.5\].*density must lie in"):
        Experiment(**base, mask_params={"block_sparse": {"density": [0.5, 1.5]}}).validate()
    with pytest.raises(ConfigError, match="empty list"):
        Experiment(**base, mask_params={"block_sparse": {"density": []}}).validate()
    with pytest.raises(ConfigError, match="takes block-sparse masks"):
        Experiment(**{**base, "masks": ["causal"]}).validate()
    with pytest.raises(ConfigError, match="min_block <= block"):
        Experiment(**{**base, "masks": ["varblock_sparse"]},
                   mask_params={"varblock_sparse": {"block": [64, 128], "min_block": 100}}).validate()


def test_param_overrides():
    e = load_experiment(REPO / "experiments" / "sparse.toml")
    o = e.with_overrides(params=["block=128", "block_sparse.density=0.2,0.8"], seqlens="4K")
    assert o.mask_params["block_sparse"] == {"block": 128, "density": [0.2, 0.8], "patterns": "Hkv"}
    assert len(o.variants("block_sparse")) == 2 and e.mask_params["block_sparse"]["block"] == [64, 128]
    with pytest.raises(ConfigError, match="has a parameter 'window'"):
        e.with_overrides(params=["window=3"])
    with pytest.raises(ConfigError, match="has no parameter 'window'"):
        e.with_overrides(params=["block_sparse.window=3"])


# ---------------------------------------------------------------------------- the commands
@pytest.mark.parametrize("kind,points,problems", [("sparse", 504, 36), ("varblock", 240, 40)])
def test_dry_run_lists_the_file_grid_on_any_machine(runner, tmp_path, kind, points, problems):
    out = tmp_path / "o"
    r = runner.invoke(bench, [kind, "--config", str(REPO / "experiments" / f"{kind}.toml"), "--dry-run", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert f"{points} points" in r.output and f"{problems} problems" in r.output
    assert "No CUDA GPU" not in r.output and not out.exists()
    if kind == "sparse":
        assert "block_sparse[block=128,density=0.8]" in r.output and "patterns=64" in r.output
    else:
        assert "varblock_sparse[block=1024,density=0.9]" in r.output and "min_block=512" in r.output


def test_kind_mismatch_and_help(runner):
    r = runner.invoke(bench, ["sparse", "--config", str(REPO / "experiments" / "dense.toml"), "--dry-run"])
    assert r.exit_code == 2 and "bench dense" in r.output
    for kind in ("sparse", "varblock"):
        r = runner.invoke(bench, [kind, "--help"])
        assert r.exit_code == 0 and "Example" in r.output and "--param" in r.output


def test_sparse_smoke_run_writes_ok_rows(runner, tmp_path):
    out = tmp_path / "o"
    args = ["sparse", "--preset", "smoke", "--param", "block=32", "--param", "density=0.5", "--backends",
            "reference,triton-sparse", "--out", str(out)]
    r = runner.invoke(bench, args)
    assert r.exit_code == 0, r.output
    rows = ResultStore(out / "results.jsonl").rows()
    assert len(rows) == 2 * 2 and all(x["status"] == "ok" for x in rows), [x["status"] for x in rows]
    mine = [x for x in rows if x["backend"] == "triton-sparse"]
    assert {x["mode"] for x in mine} == {"fwd", "bwd"} and all(x["check"]["ok"] for x in mine)
    for x in rows:
        assert x["kind"] == "sparse" and x["mask"] == "block_sparse" and x["interpreted"] is True
        assert x["variant"] == {"block": 32, "density": 0.5} and x["mask_label"] == "block_sparse[block=32,density=0.5]"
        assert x["mask_params"]["patterns"] == 2  # "Hkv" at heads 4:2
        m = make_mask("block_sparse", x["seqlen"], block=32, density=0.5, patterns=2)
        assert x["flops"] == pytest.approx(m.flops(4, 32, x["mode"]))
    assert "block_sparse[block=32,density=0.5]" in (out / "report.md").read_text()
    assert len(list((out / "plots").glob("tflops_*.png"))) == 2
    assert runner.invoke(bench, args).output.count("nothing new") == 1  # resumable


def test_varblock_smoke_run(runner, tmp_path):
    out = tmp_path / "o"
    r = runner.invoke(bench, ["varblock", "--preset", "smoke", "--param", "block=48", "--backends", "triton-varblock",
                              "--mode", "fwd", "--out", str(out)])
    assert r.exit_code == 0, r.output
    (row,) = ResultStore(out / "results.jsonl").rows()
    assert row["status"] == "ok" and row["check"]["ok"] and row["kind"] == "varblock"
    assert row["mask_params"]["min_block"] == 24 and row["variant"] == {"block": 48, "density": 0.5}


def test_report_keeps_variants_apart():
    rows = [dict(backend="b", mask="block_sparse", mask_label=f"block_sparse[block={blk},density=0.5]", seqlen=64,
                 heads_q=1, heads_kv=1, head_dim=16, dtype="float32", mode="fwd", batch=1, status="ok", tflops=float(blk),
                 mask_params={"block": blk}) for blk in (16, 32)]
    text = markdown_report(rows)
    assert "| block_sparse[block=16,density=0.5] | 64 |" in text and "| block_sparse[block=32,density=0.5] | 64 |" in text


# ---------------------------------------------------------------------------- autotune
def test_block_sparse_tunables_registered():
    assert {"triton", "triton-sparse", "triton-varblock"} <= set(at.TUNABLES)
    cands = at.TUNABLES["triton-sparse"].candidates
    for block in (64, 128):
        assert {c["BLOCK_N"] for c in cands("fwd", block, 128)} == {block}  # inner tile = block
        # the backward passes step over the block, or over 64-wide halves of a 128 block (the
        # defaults' steps)
        assert {c["DQ_BLOCK_N"] for c in cands("dq", block, 128)} == {64, block}
        assert {c["DKDV_BLOCK_M"] for c in cands("dkdv", block, 128)} == {64, block}
        assert all(c["BLOCK_M"] <= block for c in cands("fwd", block, 128))
    from longca_triton.kernels.block_sparse import CONFIG_KEYS

    for name in ("triton-sparse", "triton-varblock"):
        t = at.TUNABLES[name]
        for group in t.groups:
            for c in t.candidates(group, 256, 128):
                assert set(c) <= set(CONFIG_KEYS)


@pytest.mark.parametrize("args,needles", [
    (["--block", "64"], ["triton|D=128|bfloat16|G=8|masked|S<=16K|block=64",
                         "triton-sparse|D=128|bfloat16|G=8|uniform-sparse|S<=16K|block=64", "density=0.8"]),
    (["--block", "128", "--seqlens", "16384"], ["triton|D=128|bfloat16|G=8|full|S<=16K|block=128",
                                                "triton-sparse|D=128|bfloat16|G=8|uniform-sparse|S<=16K|block=128"]),
    (["--varblock"], ["triton-varblock|D=128|bfloat16|G=8|varblock-sparse|S<=4K|block=256", "mean block 256"]),
    (["--varblock", "--mean-block", "512", "--densities", "0.5"], ["varblock-sparse|S<=16K|block=512"]),
])
def test_autotune_dry_run(runner, args, needles):
    r = runner.invoke(main, ["autotune", *args, "--dry-run"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    for n in needles:
        assert n in r.output, n
    assert "candidates" in r.output
    if "--varblock" in args:
        assert "triton|" not in r.output and "triton-sparse|" not in r.output


def test_autotune_bad_density(runner):
    r = runner.invoke(main, ["autotune", "--densities", "0,0.5", "--dry-run"])
    assert r.exit_code == 2 and "densities" in r.output


@pytest.mark.parametrize("name,block,S", [("triton-sparse", 32, 96), ("triton-varblock", 48, 192)])
def test_tiny_interpreter_tune(name, block, S):
    """``tune`` end to end in the interpreter with one pinned candidate per group (no cache write)."""
    base = at.TUNABLES[name]
    pinned = {"fwd": dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1),
              "dkdv": dict(DKDV_BLOCK_M=16, DKDV_BLOCK_N=32, dkdv_num_warps=4, dkdv_num_stages=1),
              "dq": dict(DQ_BLOCK_M=32, DQ_BLOCK_N=16, DQ_HEADS=1, dq_num_warps=4, dq_num_stages=1)}
    assert set(pinned) == set(base.groups)
    tunable = dataclasses.replace(base, candidates=lambda group, blk, d: [pinned[group]])
    cases = run.cases_for(tunable, block, None, [S], [16], [torch.float16], (2, 1), [0.5])
    assert len(cases) == 1 and tunable.accepts(cases[0].mask)
    (s,) = run.tune(tunable, cases, block, device="cpu", write=False)
    kind = "uniform-sparse" if name == "triton-sparse" else "varblock-sparse"
    assert s["problem_class"].startswith(f"{name}|D=16|float16|G=2|{kind}|S<=4K|block=")
    assert not s["failures"] and set(s["tuned_tflops"]) == {"fwd", "bwd"}
    for group, cand in pinned.items():  # each group either took the pinned candidate or kept the default
        assert all(s["tuned"][k] in (v, s["default"][k]) for k, v in cand.items())


def test_cache_lookup_for_block_sparse_masks():
    from longca_triton.kernels.tuning import Row

    bf = torch.bfloat16

    def row(mask, block, score, tag):
        return Row(match=tuned.class_match(128, bf, 8, mask, block), config={"tag": tag}, mode="fwd", results="r",
                   measured={"tflops": {"fwd": {"default": 1.0, "tuned": score}}})

    m64 = make_mask("block_sparse", 4096, block=64, density=0.5, patterns=8)
    m128 = make_mask("block_sparse", 4096, block=128, density=0.5, patterns=8)
    var = make_mask("varblock_sparse", 4096, block=250, min_block=125, density=0.5, patterns=8)
    dense = make_mask("causal", 4096)
    sparse = [row(m64, 64, 1.0, "s64"), row(m128, 128, 9.0, "s128")]
    varblock = [row(var, 256, 1.0, "v256")]
    ranged = [row(dense, 64, 1.0, "d64"), row(dense, 128, 2.0, "d128")]

    def tag(rows, mask, group=8):
        r = tuned.best_row(rows, 128, bf, group, mask)
        return r and r.config["tag"]

    assert tuned.sparse_block(m64) == 64 and tuned.sparse_block(var) == 256 and tuned.sparse_block(dense) is None
    # block-sparse: only the row of the mask's own block, never a better-scoring other block
    assert tag(sparse, m64) == "s64" and tag(sparse, m128) == "s128" and tag(varblock, var) == "v256"
    assert tag(sparse, m64, group=1) is None  # another GQA group
    assert tag(ranged, dense) == "d128"  # range masks: the best block
    # no row at S<=64K: the nearest tuned bucket (S<=4K here), same block only
    m64_long = make_mask("block_sparse", 32768, block=64, density=0.5, patterns=8)
    assert tag(sparse, m64_long) == "s64"
    sparse.append(row(make_mask("block_sparse", 16384, block=64), 64, 0.5, "s64-16K"))
    assert tag(sparse, m64_long) == "s64-16K" and tag(sparse, m64) == "s64"
    q = torch.zeros(1, 4096, 8, 128, dtype=bf)
    assert tuned.lookup("triton-sparse", q, q[:, :, :1], m64) is None  # no cache off the GPU


def test_interpreted_autotune_command_checks_the_sparse_kernels(runner):
    r = runner.invoke(main, ["autotune", "--kernel", "triton-sparse", "--densities", "0.5"], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    assert "INTERPRETER" in r.output and "block_sparse block=32 density=0.5" in r.output
    assert sum(line.rstrip().endswith(" ok") for line in r.output.splitlines()) >= 3 and "WRONG" not in r.output


def test_autotune_json_summary_shape(tmp_path):
    """``tune`` summaries are JSON-serialisable (the command appends them to --out)."""
    tunable = dataclasses.replace(at.TUNABLES["triton-sparse"], candidates=lambda g, b, d: [], groups={"fwd": "fwd"})
    cases = run.cases_for(tunable, 16, None, [48], [16], [torch.float16], (1, 1), [1.0])
    (s,) = run.tune(tunable, cases, 16, device="cpu", write=False)
    assert json.loads(json.dumps(s, default=str))["tuned"] == s["default"]

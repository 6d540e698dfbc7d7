"""recommend on small results files: the measured answer, the nearest length said to be an
extrapolation, failed and unsupported rows named, CP measured or modelled (and said so), every
static mask at 4K-1M tokens and 1-64 GPUs without a traceback."""

import json

import pytest
from click.testing import CliRunner

from longca_triton.cli import main
from longca_triton.masks import STATIC_MASK_NAMES
from longca_triton.study.recommend import load_rows, recommend


def row(backend, mask, S, mode, tflops, status="ok", **kw):
    flops = 4.0 * S * S * 64 * 128 * (2.5 if mode == "bwd" else 1.0) * (0.5 if mask == "causal" else 1.0)
    r = dict(kind="dense", backend=backend, mask=mask, seqlen=S, heads_q=64, heads_kv=8, head_dim=128,
             dtype="bfloat16", mode=mode, status=status, gpu="GPU-X", flops=flops)
    if status == "ok":
        r.update(tflops=tflops, time_ms=flops / (tflops * 1e12) * 1e3)
    r.update(kw)
    return r


def cp_row(scheme, plan, eff, mask="causal", world=2, tokens=8192, mode="fwd_bwd"):
    return dict(kind="cp", backend="triton", mask=mask, seqlen=tokens * world, tokens_per_gpu=tokens, heads_q=64,
                heads_kv=8, head_dim=128, dtype="bfloat16", mode=mode, status="ok", scheme=scheme, plan=plan,
                world_size=world, efficiency=eff, gpu="GPU-Y")


@pytest.fixture
def results(tmp_path):
    rows = [
        row("triton", "causal", 16384, "fwd", 500), row("triton", "causal", 16384, "bwd", 400),
        row("fa4", "causal", 16384, "fwd", 650), row("fa4", "causal", 16384, "bwd", 600),
        row("flex", "causal", 16384, "fwd", 430), row("flex", "causal", 16384, "bwd", 0, status="error: boom"),
        row("sdpa-flash", "causal", 16384, "fwd", 0, status="unsupported: no mask"),
        row("fa2", "causal", 16384, "bwd", 0, status="unsupported: flash-attn / flash_attn is not installed: the "
            "importable 'flash_attn' module is another package's, which this adapter does not drive"),
        row("triton", "causal", 4096, "fwd", 420), row("triton", "causal", 4096, "bwd", 300),
        row("flashmask-triton", "full", 16384, "fwd", 530),
        cp_row("ring_p2p", "zigzag", 0.95), cp_row("ulysses", "contiguous", 0.90),
        cp_row("single", "none", 1.0),
    ]
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"cut line")  # a cut last line is skipped
    return path


def test_measured_kernel_and_ranking(results):
    rec = recommend(load_rows([results]), "causal", 16384, 1)
    assert rec.kernel["backend"] == "fa4" and not rec.kernel["extrapolated"]
    # fwd_bwd = forward + backward time; flex has no ok backward, so it is not ranked
    assert [b for b, _ in rec.kernel_ranking] == ["fa4", "triton"]
    assert rec.cannot_run["flex"].startswith("error: boom") and "sdpa-flash" in rec.cannot_run
    assert rec.cp is None
    text = "\n".join(rec.lines())
    assert "measured at S = 16,384" in text and "extrapolated" not in text
    # a long reason: whole in the data (and so in --format json); the text names a backend absent
    # where measured without its reason, and cuts other long reasons at a word boundary
    assert rec.cannot_run["fa2"].endswith("does not drive") and "not installed where measured: fa2\n" in text
    from longca_triton.study.recommend import _short

    assert _short("unsupported: " + "word " * 40).endswith("word [...]") and len(_short("x " * 80)) <= 100


def test_fwd_only_ranks_flex(results):
    rec = recommend(load_rows([results]), "causal", 16384, 1, mode="fwd")
    assert [b for b, _ in rec.kernel_ranking] == ["fa4", "triton", "flex"]


def test_nearest_length_is_an_extrapolation(results):
    rec = recommend(load_rows([results]), "causal", 6000, 1)
    assert rec.kernel["measured_seqlen"] == 4096 and rec.kernel["extrapolated"]
    assert "extrapolated" in "\n".join(rec.lines())


def test_renamed_backend_is_reported_under_its_current_name(results):
    rec = recommend(load_rows([results]), "full", 16384, 1, mode="fwd")
    assert rec.kernel["backend"] == "triton-flashmask"


def test_cp_measured_then_modelled(results):
    rows = load_rows([results])
    rec = recommend(rows, "causal", 16384, 2)
    assert rec.cp["scheme"] == "ring_p2p" and rec.cp["source"].startswith("measured")
    assert [n for n, _ in rec.cp_ranking] == ["ring_p2p/zigzag", "ulysses/contiguous"]  # "single" is the baseline
    rec = recommend(rows, "causal", 65536, 4)
    assert rec.cp["source"].startswith("model, not measured") and 0 < rec.cp["efficiency"] <= 1


def test_cp_model_weighs_imbalance_and_exposed_transfers(tmp_path):
    """The model separates the schemes: a document mask's zigzag plan leaves a rank busier than the
    mean, Ulysses exposes its all-to-alls, an all-gather is not hidden; schemes within half a percent
    are ordered by bytes, then by simplicity, and the answer says which rule decided."""
    rows = [row("triton", m, 16384, mode, 400) for m in ("causal", "causal_document") for mode in ("fwd", "bwd")]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    rows = load_rows([path])
    doc = recommend(rows, "causal_document", 131072, 8)
    effs = dict(doc.cp_ranking)
    assert len(set(round(e, 3) for e in effs.values())) >= 4, effs  # not every scheme at 1.00
    assert all(0 < e <= 1 for e in effs.values())
    assert doc.cp["imbalance"] >= 1.0 and "imbalance" in doc.cp["source"] and "not hidden" in doc.cp["source"]
    assert effs["ring_allgather"] < effs["ring_p2p"]  # its transfers run before the attention
    causal = recommend(rows, "causal", 131072, 8)
    assert causal.cp["scheme"] == "ring_p2p" and causal.cp["imbalance"] == pytest.approx(1.0)
    assert any("named as the simpler one" in n or "moving fewer bytes" in n for n in causal.notes), causal.notes


def test_cannot_run_says_why_and_gpus_apart_are_said():
    """'Not installed where measured' is told apart from 'cannot run this case', out of memory and
    a failure; kernel and CP figures from different GPUs are said to be so."""
    from longca_triton.study.recommend import why_not

    assert why_not("unsupported: flash-attn-3 / flash_attn_3 is not installed (cannot import x)") == \
        "not installed where measured"
    assert why_not("unsupported: flash_attn has no flash_attn_func") == "not installed where measured"
    assert why_not("unsupported: SDPA's flash_attention backend takes no attn_mask") == "cannot run this case"
    assert why_not("oom") == "out of memory" and why_not("error: boom") == "failed"


def test_kernel_and_cp_from_different_gpus_are_said(results):
    rec = recommend(load_rows([results]), "causal", 16384, 2)
    text = "\n".join(rec.lines())
    assert "not installed where measured: fa2" in text and "failed: flex (error: boom)" in text
    assert "cannot run this case: sdpa-flash (unsupported: no mask)" in text
    assert "kernel figures come from GPU-X, the CP figures from GPU-Y" in text


def test_nothing_supports_the_case(results):
    rec = recommend(load_rows([results]), "share_question", 16384, 8)
    assert rec.kernel is None and rec.cp is None
    assert "nothing measured supports this case" in "\n".join(rec.lines())


def test_every_static_mask_length_and_gpu_count_answers(results):
    rows = load_rows([results])
    for mask in STATIC_MASK_NAMES:
        for S in (4096, 131072, 1 << 20):
            for gpus in (1, 3, 8, 64):
                assert recommend(rows, mask, S, gpus).lines()


def test_bad_arguments(results):
    rows = load_rows([results])
    with pytest.raises(ValueError, match="unknown mode"):
        recommend(rows, "causal", 4096, 1, mode="both")
    with pytest.raises(ValueError, match="positive"):
        recommend(rows, "causal", 4096, 0)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows(["nope.jsonl"])


def test_cli(results):
    r = CliRunner().invoke(main, ["recommend", "--mask", "causal", "-S", "16K", "--gpus", "2", "--results", str(results)])
    assert r.exit_code == 0, r.output
    assert "kernel: fa4" in r.output and "ring_p2p (zigzag)" in r.output
    r = CliRunner().invoke(main, ["recommend", "--mask", "causal", "-S", "16K", "--results", str(results), "--format", "json"])
    assert json.loads(r.stdout)["kernel"]["backend"] == "fa4"
    r = CliRunner().invoke(main, ["recommend", "--mask", "causal", "-S", "16K", "--results", "missing.jsonl"])
    assert r.exit_code != 0 and r.output.strip().startswith("error:") and len(r.output.strip().splitlines()) == 1


def test_block_sparse_model_scales_without_building_the_mask(tmp_path):
    """At the measured block and density a block-sparse mask's work grows as S^2: the model must not
    build a million-token block map to learn that (it took tens of seconds)."""
    import time

    rows = [row("triton-sparse", "block_sparse", 4096, m, 400, mask_label="block_sparse[block=64,density=0.5]")
            for m in ("fwd", "bwd")]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    t0 = time.perf_counter()
    rec = recommend(load_rows([path]), "block_sparse", 1 << 20, 8)
    assert time.perf_counter() - t0 < 5
    assert rec.kernel["backend"] == "triton-sparse [block_sparse[block=64,density=0.5]]" and rec.kernel["extrapolated"]
    assert "x6.55e+04" in rec.cp["source"]  # (2^20 / 4096)^2


def test_gzipped_results_recommend_the_same(results, tmp_path, monkeypatch):
    """load_rows and the CLI take a results.jsonl.gz as the plain file (the cut last line skipped
    alike); the committed-results glob finds .gz files, and where a folder has both it reads the
    plain one and warns."""
    import gzip
    from dataclasses import asdict

    from longca_triton.bench.store import BothResultsWarning
    from longca_triton.study.recommend import default_results

    gz = tmp_path / "g" / "results.jsonl.gz"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress(results.read_bytes()))

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "_file"} for r in rows]

    assert strip(load_rows([gz])) == strip(load_rows([results])) and len(load_rows([gz])) == 14
    for mode in ("fwd", "fwd_bwd"):
        a, b = recommend(load_rows([results]), "causal", 16384, 2, mode=mode), recommend(load_rows([gz]), "causal", 16384, 2, mode=mode)
        assert asdict(a) | {"kernel": None} == asdict(b) | {"kernel": None}
        assert {k: v for k, v in a.kernel.items() if k != "file"} == {k: v for k, v in b.kernel.items() if k != "file"}
    r = CliRunner().invoke(main, ["recommend", "--mask", "causal", "-S", "16K", "--results", str(gz)])
    assert r.exit_code == 0 and "kernel: fa4" in r.output, r.output
    # the committed-results glob, from a checkout's root
    monkeypatch.chdir(tmp_path)
    study = tmp_path / "experiments" / "results" / "h100" / "dense-study"
    other = tmp_path / "experiments" / "results" / "h100" / "dense-16k"
    study.mkdir(parents=True)
    other.mkdir(parents=True)
    (study / "results.jsonl.gz").write_bytes(gz.read_bytes())
    (other / "results.jsonl").write_bytes(results.read_bytes())
    assert [str(p) for p in default_results()] == ["experiments/results/h100/dense-16k/results.jsonl",
                                                    "experiments/results/h100/dense-study/results.jsonl.gz"]
    (study / "results.jsonl").write_bytes(results.read_bytes())
    with pytest.warns(BothResultsWarning, match="reading results.jsonl, not results.jsonl.gz"):
        assert [str(p) for p in default_results()] == ["experiments/results/h100/dense-16k/results.jsonl",
                                                        "experiments/results/h100/dense-study/results.jsonl"]
    r = CliRunner().invoke(main, ["recommend", "--mask", "causal", "-S", "16K"])
    assert r.exit_code == 0 and "kernel: fa4" in r.output
    assert "warning: both experiments/results/h100/dense-study/results.jsonl and results.jsonl.gz" in r.output


def test_the_packaged_summary_answers_as_the_results_do(results, tmp_path, monkeypatch):
    """The compact summary recommends what its results files recommend, and the CLI outside a
    checkout answers from the summary shipped with the package, saying so."""
    from longca_triton.study.summary import packaged_rows, write_summary

    out = tmp_path / "s.jsonl.gz"
    assert write_summary([results], out) > 0
    for args in (("causal", 16384, 1), ("causal", 65536, 4), ("full", 16384, 1)):
        a, b = recommend(load_rows([results]), *args), recommend(packaged_rows(out), *args)
        assert (a.kernel_ranking, a.cp_ranking, sorted(a.cannot_run)) == (b.kernel_ranking, b.cp_ranking, sorted(b.cannot_run))
    assert str(results) in packaged_rows(out)[0]["_file"]
    monkeypatch.chdir(tmp_path)  # no experiments/results/ here
    r = CliRunner().invoke(main, ["recommend", "--mask", "causal", "-S", "16K"])
    assert r.exit_code == 0, r.output
    assert "kernel: " in r.output and "answered from the study summary shipped with the package" in r.output


def test_the_shipped_summary_is_the_committed_results(monkeypatch):
    """The shipped summary was rebuilt after the last results were committed
    (``python experiments/study_summary.py``)."""
    from pathlib import Path

    from longca_triton.study.recommend import default_results
    from longca_triton.study.summary import compact, packaged_rows

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    fresh = compact(load_rows(default_results()))

    def key(r):
        return json.dumps({k: v for k, v in r.items() if k != "_file"}, sort_keys=True)

    assert sorted(map(key, packaged_rows())) == sorted(map(key, fresh)), "rebuild it: python experiments/study_summary.py"


def test_mask_parameters_pick_their_rows_and_are_echoed(tmp_path):
    """Rows measured with the given parameters answer where there are any; otherwise the study's
    (said so); two variants of one point are never mixed; unknown parameters are one clear error."""
    from longca_triton.study.recommend import _digest_at

    S, mask = 16384, "sliding_window_causal"
    wide, narrow = (_digest_at(mask, S, {"window": w}) for w in (4096, 256))
    rows = [row(b, mask, S, m, t, params_digest=narrow) for b, t in (("triton", 500), ("fa4", 300)) for m in ("fwd", "bwd")]
    rows += [row(b, mask, S, m, t, params_digest=wide) for b, t in (("triton", 200), ("fa4", 600)) for m in ("fwd", "bwd")]
    rows += [row("flex", mask, S, m, 100, params_digest=wide) for m in ("fwd", "bwd")]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    rows = load_rows([path])
    rec = recommend(rows, mask, S, 1, params={"window": 256})
    assert rec.kernel["backend"] == "triton" and [b for b, _ in rec.kernel_ranking] == ["triton", "fa4"]
    assert rec.lines()[0].startswith("sliding_window_causal (window=256), S = 16,384")
    assert "measured with these mask parameters" in rec.notes
    rec = recommend(rows, mask, S, 1)  # no parameters: the variant measured most (here the wide one), unmixed
    assert [b for b, _ in rec.kernel_ranking] == ["fa4", "triton", "flex"]
    rec = recommend(rows, mask, S, 4, params={"window": 1000})
    assert any(n.startswith("nothing measured with window=1000") for n in rec.notes) and rec.cp is not None
    with pytest.raises(ValueError, match="unknown parameter"):
        recommend(rows, "causal", S, 1, params={"window": 8})
    r = CliRunner().invoke(main, ["recommend", "--mask", mask, "-S", "16K", "--results", str(path), "--param", "window"])
    assert r.exit_code == 2 and "is not KEY=VALUE" in r.output
    r = CliRunner().invoke(main, ["recommend", "--mask", mask, "-S", "16K", "--results", str(path), "--param", "window=256"])
    assert r.exit_code == 0 and "kernel: triton" in r.output, r.output

"""findings on small results files written through the real ResultStore: winner and margin,
crossovers (and changes of winner that are not crossovers), memory walls, the support matrix with
reasons, missing / failed / NaN rows, block-sparse density, CP efficiency; the main page's
conclusions and paper verdicts computed from the rows, the appendix holding the rest, the CLI end to
end; and `recommend` answering for every static mask, 4K-1M tokens, 1-64 GPUs on the committed
results."""

import json
import math
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from longca_triton.bench.store import ResultStore
from longca_triton.cli import main
from longca_triton.masks import STATIC_MASK_NAMES
from longca_triton.study.findings import collect_paths, compute, load_results
from longca_triton.study.findings_headline import family, headline
from longca_triton.study.findings_main import render_main
from longca_triton.study.findings_report import render_appendix

ENV = {"gpu": "GPU-X", "torch": "9.9", "triton": "3.6.0", "cuda": "13.0", "cudnn": 91900, "git_commit": "abcdef0123",
       "vendors": {"flash-attn-4": "4.0"}}
_clock = [0]


def row(backend, mask, S, mode, tflops=None, status="ok", kind="dense", **kw):
    _clock[0] += 1
    r = {"schema": 1, "kind": kind, "experiment": "t", "backend": backend, "mask": mask, "mask_params": {"seed": 0},
         "seqlen": S, "batch": 1, "heads_q": 64, "heads_kv": 8, "head_dim": 128, "dtype": "bfloat16", "mode": mode,
         "status": status, "gpu": "GPU-X", "flops": 1e12, "tflops": tflops, "time_ms": 1.0 if tflops else None,
         "env": ENV, "time": f"2026-11-22T00:00:{_clock[0] % 60:02d}+00:00"}
    r.update(kw)
    return r


def write(path: Path, rows) -> Path:
    ResultStore(path).extend(rows)
    return path


@pytest.fixture
def dense(tmp_path):
    rows = [
        # causal: triton wins at 4K, fa4 at 16K (both measured at both): a crossover
        row("triton", "causal", 4096, "fwd", 500), row("fa4", "causal", 4096, "fwd", 450),
        row("flex", "causal", 4096, "fwd", 900, status="error: RuntimeError: boom"),  # failed: never a winner
        row("triton", "causal", 16384, "fwd", 520), row("fa4", "causal", 16384, "fwd", 650),
        row("flex", "causal", 16384, "fwd", float("nan")),  # ok but NaN: not a measurement
        row("sdpa-flash", "causal", 16384, "fwd", 0.0),  # ok but zero: not a measurement
        # full: fa4 wins at 4K by 600/500; at 16K fa4 has no row and triton wins alone-ish: not a crossover
        row("fa4", "full", 4096, "fwd", 600), row("triton", "full", 4096, "fwd", 500),
        row("triton", "full", 16384, "fwd", 510), row("flex", "full", 16384, "fwd", 480),
        # memory wall: sdpa-math ok at 4K, out of memory from 16K on (an oom row and an error saying so)
        row("sdpa-math", "full", 4096, "fwd", 50),
        row("sdpa-math", "full", 16384, "fwd", status="oom", detail="CUDA out of memory. Tried to allocate 64 GiB"),
        row("sdpa-math", "full", 65536, "fwd", status="error: OutOfMemoryError: CUDA out of memory"),
        # unsupported with its reason
        row("cudnn", "share_question", 16384, "fwd", status="unsupported: row 545 attends more than one key interval"),
        row("triton", "share_question", 16384, "fwd", 380),
    ]
    return write(tmp_path / "dense" / "results.jsonl", rows)


def test_winner_margin_and_failed_rows(dense):
    rows, files = load_results([dense])
    f = compute(rows, files)
    (sk,) = f.cells
    cells = {c.seqlen: c for c in f.cells[sk]["full"]}
    assert cells[4096].winner == ("fa4", 600) and cells[4096].margin == pytest.approx(1.2)
    causal = {c.seqlen: c for c in f.cells[sk]["causal"]}
    # flex's error row (900 TFLOP/s recorded) and its NaN row, sdpa-flash's zero: never ranked
    assert [b for b, _ in causal[4096].ranking] == ["triton", "fa4"]
    assert [b for b, _ in causal[16384].ranking] == ["fa4", "triton"]
    assert causal[4096].failed["flex"].startswith("error: RuntimeError: boom")
    assert "NaN" in causal[16384].failed["flex"] or "nan" in causal[16384].failed["flex"]
    assert "sdpa-flash" in causal[16384].failed and "sdpa-flash" not in dict(causal[16384].ranking)


def test_crossover_and_not_a_crossover(dense):
    f = compute(*load_results([dense]))
    (sk,) = f.cells
    assert f.crossovers[(sk, "causal")] == [(4096, 16384, "triton", "fa4")]
    full = f.crossovers[(sk, "full")]
    # the winner changes (fa4 -> triton) only because fa4 has no row at 16K: said so, no crossover
    assert isinstance(full, str) and "fa4 at 16384" in full and "not measured" in full
    c16 = {c.seqlen: c for c in f.cells[sk]["full"]}[16384]
    assert "fa4" in c16.not_measured
    assert f.crossovers[(sk, "share_question")] == "one length measured (16384): no crossover can be stated"


def test_memory_wall_losses_and_support(dense):
    f = compute(*load_results([dense]))
    walls = [w for w in f.walls if w["backend"] == "sdpa-math"]
    assert len(walls) == 1 and walls[0]["first_fail"] == 16384 and walls[0]["last_ok"] == 4096
    assert "out of memory" in walls[0]["why"]
    assert not [w for w in f.walls if w["backend"] != "sdpa-math"]
    losses = {(d["mask"], d["S"]): d for d in f.losses}
    assert losses[("full", 4096)]["ratio"] == pytest.approx(500 / 600) and losses[("full", 4096)]["best"] == "fa4"
    assert ("causal", 4096) not in losses  # triton won there
    summary, reasons = f.support[("cudnn", "share_question")]["fwd"]
    assert summary == "unsupported" and "more than one key interval" in reasons[0]
    assert f.support[("sdpa-math", "full")]["fwd"][0].startswith("ok at 4K; memory at 16K,64K")
    text = render_appendix(f, "longca-triton findings test")
    assert "unsupported: row 545 attends more than one key interval" in text
    assert "between S = 4096 and 16384 the winner changes from triton to fa4" in text
    assert "| sdpa-math | fwd | 64:8, D 128 | 16384 | 4096 | full |" in text
    assert "GPU-X" in text and "abcdef0" in text and "flash-attn-4 4.0" in text
    assert "No block-sparse rows" in text and "No CP rows" in text


def test_sources_say_how_rows_were_timed(tmp_path):
    """The Sources table names each file's timing: interleaved rows, older rows without the field
    (timed one after the other), both, or none timed."""
    a = write(tmp_path / "a" / "results.jsonl", [row("triton", "causal", 4096, "fwd", 500, timing="interleaved"),
                                                 row("flex", "causal", 4096, "fwd", 400, timing="interleaved")])
    b = write(tmp_path / "b" / "results.jsonl", [row("triton", "full", 4096, "fwd", 500),
                                                 row("flex", "full", 4096, "fwd", 400, timing="interleaved")])
    c = write(tmp_path / "c" / "results.jsonl", [row("cudnn", "full", 8192, "fwd", status="unsupported: x")])
    text = render_appendix(compute(*load_results([a, b, c])), "cmd")
    line = {p: next(ln for ln in text.splitlines() if f"`{p}`" in ln and "| dense |" in ln) for p in (a, b, c)}
    assert "| 2 of 2 | interleaved |" in line[a]
    assert "| 2 of 2 | interleaved + sequential |" in line[b]
    assert "| 1 of 1 | — |" in line[c]
    assert "| timing |" in text


def test_latest_row_wins_across_files(tmp_path):
    a = write(tmp_path / "a.jsonl", [row("flex", "causal", 4096, "bwd", status="error: donated buffers", time="2026-11-22T01:00:00+00:00")])
    b = write(tmp_path / "b.jsonl", [row("flex", "causal", 4096, "bwd", 300, time="2026-11-22T02:00:00+00:00"),
                                     row("triton", "causal", 4096, "bwd", 250, time="2026-11-22T02:00:01+00:00")])
    rows, files = load_results([b, a])  # file order must not matter: the later row wins
    f = compute(rows, files)
    (sk,) = f.cells
    assert f.cells[sk]["causal"][0].winner == ("flex", 300)
    assert files[str(a)]["used"] == 0 and files[str(b)]["used"] == 2


def test_sparse_density_and_cp(tmp_path):
    sp = []
    for dens, t_ours, t_flex in ((0.2, 380, 300), (0.5, 440, 400)):
        v = {"block": 128, "density": dens}
        label = f"block_sparse[block=128,density={dens}]"
        sp += [row("triton-sparse", "block_sparse", 65536, "fwd", t_ours, kind="sparse", variant=v, mask_label=label,
                   density=dens, mask_params={"density": dens}),
               row("flex", "block_sparse", 65536, "fwd", t_flex, kind="sparse", variant=v, mask_label=label,
                   density=dens, mask_params={"density": dens}),
               row("flashinfer-bsr", "block_sparse", 65536, "fwd", kind="sparse", variant=v, mask_label=label, density=dens,
                   mask_params={"density": dens}, status="unsupported: one pattern only")]
    cp = [dict(row("triton", "causal", 16384, "fwd_bwd", 400, kind="cp"), scheme=s, plan=p, world_size=2,
               tokens_per_gpu=8192, efficiency=e) for s, p, e in
          (("ring_p2p", "zigzag", 0.9), ("ring_p2p", "balanced", 0.95), ("ulysses", "contiguous", 0.8),
           ("single", "none", 1.0))]
    path = write(tmp_path / "s.jsonl", sp + cp)
    f = compute(*load_results([path]))
    assert {(d["backend"], d["nominal"]) for d in f.sparse if d["tflops"]} == {
        ("triton-sparse", 0.2), ("triton-sparse", 0.5), ("flex", 0.2), ("flex", 0.5)}
    best = {d["scheme"]: d for d in f.cp}
    assert set(best) == {"ring_p2p", "ulysses"} and best["ring_p2p"]["plan"] == "balanced"
    assert best["ring_p2p"]["efficiency"] == pytest.approx(0.95)
    text = render_appendix(f, "x")
    assert "no trend against density" not in text and "0.95 (balanced)" in text
    assert "Best scheme per mask: ring_p2p on causal" in text


@pytest.mark.parametrize("backend, fam", [("triton-gluon", "ours"), ("fa3-fwd", "FlashAttention"),
                                          ("varlen-fa2", "FlashAttention"), ("flex-fa4", "Flex"), ("sdpa-cudnn", "SDPA"),
                                          ("cudnn", "cuDNN"), ("vsa-triton", "sparse vendors"),
                                          ("someone-new", "someone-new")])
def test_backends_fall_into_the_papers_families(backend, fam):
    assert family(backend) == fam


@pytest.fixture
def study(tmp_path):
    """fwd and bwd of GQA 64:8 (and one MHA row): a regular mask FlashAttention wins, a heterogeneous one
    it refuses and ours win, a block-sparse cell, a memory wall."""
    rows = []
    for S in (4096, 16384):
        for mode, fa, ours in (("fwd", 600, 500), ("bwd", 400, 300)):
            rows += [row("fa4", "causal", S, mode, fa), row("triton", "causal", S, mode, ours)]
        for mode, ours, flex in (("fwd", 450, 400), ("bwd", 300, 250)):
            rows += [row("triton", "prefix_lm_causal", S, mode, ours), row("flex", "prefix_lm_causal", S, mode, flex),
                     row("fa4", "prefix_lm_causal", S, mode, status="unsupported: row 1 attends [0, 341), not a document window")]
    rows += [row("sdpa-math", "causal", 4096, "fwd", 50),
             row("sdpa-math", "causal", 16384, "fwd", status="oom", detail="CUDA out of memory. Tried to allocate 64 GiB"),
             row("triton", "causal", 8192, "fwd", 500, peak_mem_bytes=1 << 30, peak_mem_above_bytes=1 << 28),
             row("triton", "causal", 8192, "fwd", 480, heads_kv=64, peak_mem_bytes=2 << 30, peak_mem_above_bytes=1 << 28)]
    v = {"block": 128, "density": 0.5}
    rows += [row(b, "block_sparse", 65536, "fwd", t, kind="sparse", variant=v, density=0.5, mask_params={"density": 0.5},
                 mask_label="block_sparse[block=128,density=0.5]") for b, t in (("triton-sparse", 400), ("flex", 300))]
    return write(tmp_path / "study" / "results.jsonl", rows)


def test_main_page_states_five_conclusions_with_the_numbers_of_the_rows(study):
    f = compute(*load_results([study]))
    h = headline(f)
    assert h.layout == (64, 8, 128, "bfloat16", 1) and list(h.slices) == ["fwd", "bwd"]
    assert h.classes == {"causal": "regular", "prefix_lm_causal": "heterogeneous", "block_sparse": "block-sparse"}
    text = render_main(f, "longca-triton findings --out f.md", "f-appendix.md")
    lines = text.splitlines()
    assert len(lines) <= 200 and "](f-appendix.md)" in text
    assert ("1. **Who wins, by family.** Forward, of 5 compared (mask, S) cells: ours 3, FlashAttention 2; "
            "backward, of 4 compared (mask, S) cells: FlashAttention 2, ours 2") in text  # triton alone at 8K: no win
    assert ("Where ours lose (2 of 5 forward cells, 2 of 4 backward cells), our best kernel runs at a median 0.83× the "
            "best other backend's TFLOP/s forward") in text  # 500 / 600 on causal
    assert "ours win 3 forward cells (2 on heterogeneous masks), 2 backward cells (2 on heterogeneous masks)" in text
    assert "the fastest backward reaches a median 0.67× the fastest forward's TFLOP/s (ours 0.63×)" in text
    assert "2.5× the forward's FLOPs it takes a median 3.75× the forward's time" in text
    assert "sdpa-math fails from 16K (largest run below: 4K; out of memory)" in text and "none of ours" in text
    assert "GQA's peak memory is a median 0.50× MHA's (ours 0.50×), the memory above the inputs 1.00×" in text
    assert "| causal | fa4 / fa4 | fa4 / fa4 |" in text and "| prefix_lm_causal | **1.12** flex / **1.20** flex |" in text
    assert "| block_sparse[block=128,density=0.5] | — | — | 64K: triton-sparse / — |" in text
    verdicts = {v.key: v.verdict for v in h.paper}
    assert verdicts == dict.fromkeys(("regular", "heterogeneous", "sparse", "backward", "gqa"), "agree")
    assert "FlashAttention wins 2 of 2 forward, 2 of 2 backward cells on the regular masks (causal)" in text
    assert ("every one at every length ran on ours (triton), Flex (flex); FlashAttention refused every one of them at some "
            "length") in text


def test_paper_verdicts_say_disagree_and_not_measured_from_the_numbers(dense):
    """Forward rows only, FlashAttention winning half of the regular cells: the first finding is
    disagreed with, those the rows cannot decide are not measured, and the page says so."""
    f = compute(*load_results([dense]))
    h = headline(f)
    assert {v.key: v.verdict for v in h.paper} == {"regular": "disagree", "heterogeneous": "not measured",
                                                    "sparse": "not measured", "backward": "not measured",
                                                    "gqa": "not measured"}
    text = render_main(f, "cmd", "a.md")
    assert "FlashAttention wins 2 of 4 forward cells on the regular masks" in text
    assert text.count("| **not measured** |") == 4 and "3. **The backward.** not measured" in text


def test_cli_writes_the_appendix_where_asked_and_links_both_ways(dense, tmp_path):
    out, appendix = tmp_path / "docs" / "f.md", tmp_path / "more" / "details.md"
    r = CliRunner().invoke(main, ["findings", str(dense), "--out", str(out), "--appendix", str(appendix), "--no-plots"])
    assert r.exit_code == 0, r.output
    assert "](../more/details.md)" in out.read_text() and "](../docs/f.md)" in appendix.read_text()
    assert f"--appendix {appendix}" in out.read_text() and not (tmp_path / "docs" / "f-appendix.md").exists()


def test_cli_end_to_end(dense, tmp_path):
    out = tmp_path / "docs" / "findings.md"
    r = CliRunner().invoke(main, ["findings", str(dense.parent), "--out", str(out)])
    assert r.exit_code == 0, r.output
    text, appendix = out.read_text(), (tmp_path / "docs" / "findings-appendix.md").read_text()
    assert text.startswith("# Findings") and f"longca-triton findings {dense.parent} --out {out}" in text
    assert f"longca-triton findings {dense.parent} --out {out}" in appendix and "](findings.md)" in appendix
    pngs = sorted(p.name for p in (tmp_path / "docs" / "findings").glob("*.png"))
    assert pngs == ["tflops_fwd_h64-8_d128_bfloat16.png", "winner_map_h64-8_d128_bfloat16.png",
                    "winners_fwd_h64-8_d128_bfloat16.png"]
    assert "](findings/winner_map_h64-8_d128_bfloat16.png)" in text and "](findings-appendix.md)" in text
    assert "](findings/winners_fwd_h64-8_d128_bfloat16.png)" in appendix
    # --mode keeps only that mode: no fwd rows for bwd
    r = CliRunner().invoke(main, ["findings", str(dense), "--out", str(out), "--mode", "bwd", "--no-plots"])
    assert r.exit_code != 0 and r.output.strip().startswith("error:") and "bwd" in r.output


@pytest.mark.parametrize("args, needle", [
    (["missing.jsonl"], "does not exist"),
    (["EMPTY_DIR"], "no *.jsonl"),
    (["NOT_BENCH"], "no bench result rows"),
])
def test_cli_errors_are_one_line(tmp_path, args, needle):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other.jsonl").write_text(json.dumps({"kind": "correctness", "x": 1}) + "\n")
    args = [{"EMPTY_DIR": str(tmp_path / "empty"), "NOT_BENCH": str(tmp_path / "other.jsonl")}.get(a, a) for a in args]
    r = CliRunner().invoke(main, ["findings", *args, "--out", str(tmp_path / "f.md")])
    assert r.exit_code != 0
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0]
    with pytest.raises(FileNotFoundError):
        collect_paths([tmp_path / "nope"])


def test_findings_on_the_committed_results(tmp_path):
    """The committed results give a page that says how thin they are, without inventing trends."""
    from longca_triton.study.recommend import default_results

    paths = default_results()
    if not paths:
        pytest.skip("not run from a checkout with experiments/results/")
    f = compute(*load_results(paths))
    text = render_appendix(f, "x")
    assert "one length measured (16384): no crossover can be stated" in text
    for cells in f.cells.values():
        for m in cells.values():
            for c in m:
                assert all(math.isfinite(t) and t > 0 for _, t in c.ranking)


def test_recommend_answers_every_static_mask_on_the_committed_results():
    """No traceback for any static mask at 4K, 64K, 1M tokens on 1, 8, 64 GPUs (not the whole cross
    product: the CP model's balanced plan over 64 ranks takes seconds): exit 0 with an answer (the
    library on every case, the CLI on a few)."""
    from longca_triton.study.recommend import default_results, load_rows, recommend

    paths = default_results()
    if not paths:
        pytest.skip("not run from a checkout with experiments/results/")
    rows = load_rows(paths)
    for mask in STATIC_MASK_NAMES:
        for S, gpus in ((4096, 1), (65536, 8), (1 << 20, 64), (1 << 20, 8)):
            rec = recommend(rows, mask, S, gpus)
            assert rec.kernel is not None, (mask, S, gpus)  # every static mask has measured rows
            assert rec.lines() and (gpus == 1 or rec.cp is not None), (mask, S, gpus)
    for mask, S, gpus in (("causal_document", "128K", 8), ("sliding_window", "1M", 64), ("full", "4K", 1)):
        r = CliRunner().invoke(main, ["recommend", "--mask", mask, "-S", S, "--gpus", str(gpus)])
        assert r.exit_code == 0 and "kernel:" in r.output, r.output


#: the sections the appendix holds (moved there from the main page, which links them)
APPENDIX_SECTIONS = ("## Sources", "## Summary per slice", "## Coverage", "## Winners: fwd, heads 64:8, D = 128",
                     "## Where our kernels lose", "## Memory walls", "## Support matrix",
                     "## Block-sparse: TFLOP/s against density and block", "## Context parallelism")
#: the main page's sections, in their order
MAIN_SECTIONS = ("## Five conclusions", "## Against the paper's key findings", "## Winner map",
                 "## Ours against the best other backend", "## Memory walls", "## Block-sparse", "## More")


def test_committed_findings_pages_are_the_regenerated_ones(tmp_path, monkeypatch):
    """docs/findings.md, docs/findings-appendix.md and docs/findings/*.png are what `longca-triton
    findings --out docs/findings.md` writes from the committed results, byte for byte for the pages
    (regeneration is deterministic); the main page reads in two minutes and the appendix keeps the rest."""
    from longca_triton.study.findings_main import render_pages
    from longca_triton.study.findings_plots import make_findings_plots
    from longca_triton.study.recommend import default_results

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    paths = default_results()
    if not paths or not (repo / "docs" / "findings.md").exists():
        pytest.skip("not run from a checkout with experiments/results/ and docs/findings.md")
    f = compute(*load_results(paths))
    h = headline(f)
    written = make_findings_plots(f, tmp_path / "findings", h)
    as_committed = {k: [(key, Path("docs/findings") / p.name) for key, p in v] for k, v in written.items()}
    out, appendix = Path("docs/findings.md"), Path("docs/findings-appendix.md")
    pages = render_pages(f, "longca-triton findings --out docs/findings.md", out, appendix, as_committed, h=h)
    for page, text in pages.items():
        assert text == (repo / page).read_text(), "rerun: longca-triton findings --out docs/findings.md"
    assert sorted(p.name for p in (tmp_path / "findings").glob("*.png")) == \
        sorted(p.name for p in (repo / "docs" / "findings").glob("*.png"))
    main, text = pages[out], pages[appendix]
    lines = main.splitlines()
    assert len(lines) <= 200
    assert [ln for ln in lines if ln.startswith("## ")] == list(MAIN_SECTIONS)
    conclusions = lines[lines.index("## Five conclusions") + 2:][:5]
    assert [c[:3] for c in conclusions] == ["1. ", "2. ", "3. ", "4. ", "5. "]
    assert all(re.search(r"\d", c) for c in conclusions)  # each with its numbers
    assert len(re.findall(r"^\| \d\. .* \| \*\*(agree|disagree|not measured)\*\* \|$", main, re.MULTILINE)) == 5
    assert "](findings-appendix.md)" in main and "](findings/winner_map_h64-8_d128_bfloat16.png)" in main
    assert "](masks.md" in main and "NVIDIA H100" in main and "dense-study" in main
    assert "](findings.md)" in text and all(f"\n{s}" in text for s in APPENDIX_SECTIONS)
    # the dense study's 1K-4K, its not-installed rows retried with the vendor wheels: the backends
    # still missing there are absent, not losing
    assert ("`experiments/results/h100/dense-study/results.jsonl.gz` ran without fa2, fa3, flashmask, te on its "
            "machine (not installed)") in text
    assert not [d for d in f.losses if "not installed" in str(d)]
    # 32K and 48K ran for GQA 64:8 / D = 128 only (plus fa3-fwd on every layout): a slice, said so
    # (test_coverage_calls_a_slice_of_the_grid_partial pins the wording; no length of the committed runs
    # has a backend missing on part of its problems, test_partly_absent_backends_are_said_per_length
    # pins that wording)
    assert re.search(r"32K \(\d+ problems, \d+ points, \*\*partial\*\*: \d+ of them with \d+ backends", text)


def test_partly_absent_backends_are_said_per_length(tmp_path):
    """A file where one run lacked a wheel on some problems of a length: the page says which backend,
    at which length, on how many of the problems, and it neither wins nor loses there."""
    lacking = "unsupported: flash-attn-4 / flash_attn_4 / fa4 is not installed (cannot import it)"
    rows = [row("triton", "causal", 8192, "fwd", 500), row("fa4", "causal", 8192, "fwd", 650),
            row("triton", "full", 8192, "fwd", 510), row("fa4", "full", 8192, "fwd", status=lacking),
            row("triton", "causal", 4096, "fwd", 480), row("fa4", "causal", 4096, "fwd", 600),
            row("triton", "full", 4096, "fwd", 490), row("fa4", "full", 4096, "fwd", 620)]
    path = write(tmp_path / "r.jsonl", rows)
    f = compute(*load_results([path]))
    text = render_appendix(f, "cmd", {})
    assert f"`{path}` at 8K: fa4 missing on 1 of its 2 problems (not installed)" in text
    assert "at 4K: fa4 missing" not in text
    assert not [d for d in f.losses if "not installed" in str(d)]


def _gzip(src: Path, dst: Path) -> Path:
    import gzip

    dst.write_bytes(gzip.compress(src.read_bytes(), mtime=0))
    return dst


def test_gzipped_results_give_the_same_findings(dense, tmp_path):
    """A results.jsonl.gz (how a big study is committed) gives the findings of its plain file, found
    in a folder or named; the page names the file it read."""
    gz_dir = tmp_path / "gz"
    gz_dir.mkdir()
    gz = _gzip(dense, gz_dir / "results.jsonl.gz")
    assert collect_paths([gz_dir]) == [gz] and collect_paths([gz]) == [gz]
    (rows_p, files_p), (rows_g, files_g) = load_results([dense]), load_results(collect_paths([gz_dir]))
    assert [{k: v for k, v in r.items() if k != "_file"} for r in rows_g] == \
        [{k: v for k, v in r.items() if k != "_file"} for r in rows_p]
    assert list(files_g.values()) == list(files_p.values()) and list(files_g) == [str(gz)]
    text_p = render_appendix(compute(rows_p, files_p), "x")
    text_g = render_appendix(compute(rows_g, files_g), "x")
    assert text_g == text_p.replace(str(dense), str(gz)) and str(gz) in text_g
    out = tmp_path / "f.md"
    r = CliRunner().invoke(main, ["findings", str(gz_dir), "--out", str(out), "--no-plots"])
    assert r.exit_code == 0, r.output
    assert f"from {len(rows_p)} rows of 1 files" in r.output and str(gz) in out.read_text()
    assert str(gz) in (tmp_path / "f-appendix.md").read_text()


def test_findings_folder_with_both_plain_and_gzip_reads_the_plain_one(dense, tmp_path):
    from longca_triton.bench.store import BothResultsWarning

    gz = _gzip(dense, dense.with_name("results.jsonl.gz"))
    ResultStore(dense).append(row("triton", "causal", 65536, "fwd", 530))  # the plain one moved on
    with pytest.warns(BothResultsWarning, match="reading results.jsonl, not results.jsonl.gz"):
        paths = collect_paths([dense.parent])
    assert paths == [dense]
    rows, files = load_results(paths)
    assert list(files) == [str(dense)] and any(r["seqlen"] == 65536 for r in rows)
    assert collect_paths([gz]) == [gz]  # a file named is read as named
    r = CliRunner().invoke(main, ["findings", str(dense.parent), "--out", str(tmp_path / "f.md"), "--no-plots"])
    assert r.exit_code == 0 and "reading results.jsonl, not results.jsonl.gz" in r.output


def test_coverage_calls_a_slice_of_the_grid_partial(tmp_path):
    """A length where only some problems ran with every backend (a slice: one head layout, then one
    backend retried on all of them) is partial even though it has as many problems as the fullest."""
    rows = []
    for S in (4096, 16384):
        for heads_kv in (8, 64):
            for b in ("triton", "flex", "fa4"):
                if S == 16384 and heads_kv == 64 and b != "fa4":
                    continue  # 16K: GQA with all three backends, MHA with fa4 only
                rows.append(row(b, "causal", S, "fwd", 400, heads_kv=heads_kv))
    path = write(tmp_path / "slice" / "results.jsonl", rows)
    text = render_appendix(compute(*load_results([path])), "cmd")
    line = next(x for x in text.splitlines() if x.startswith("| `") and "4K (2 problems" in x)
    assert "4K (2 problems, 6 points)" in line
    assert "16K (2 problems, 4 points, **partial**: 1 of them with 3 backends, the rest fewer)" in line


def test_cpu_rows_are_left_out_of_the_conclusions(dense, tmp_path):
    """Rows measured on a CPU (the interpreter's smoke runs) never win: findings leave them out and say
    how many, recommend refuses a file of nothing else."""
    cpu = write(tmp_path / "cpu" / "results.jsonl",
                [row("triton", "causal", 4096, "fwd", 9000, device="cpu", interpreted=True, gpu=None)])
    rows, files = load_results([dense, cpu])
    assert not any(r.get("device") == "cpu" for r in rows) and files[str(cpu)]["cpu"] == 1
    f = compute(rows, files)
    assert f.cells[next(iter(f.cells))]["causal"][0].winner[1] == 500
    assert f"`{cpu}` 1" in render_appendix(f, "longca-triton findings", {})
    r = CliRunner().invoke(main, ["findings", str(cpu), "--out", str(tmp_path / "f.md"), "--no-plots"])
    assert r.exit_code == 2 and "1 measured on a CPU" in r.output, r.output
    r = CliRunner().invoke(main, ["recommend", "--mask", "causal", "-S", "4K", "--results", str(cpu)])
    assert r.exit_code == 2 and "measured on a CPU" in r.output, r.output

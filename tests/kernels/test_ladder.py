"""The kernel ladder (``longca_triton/kernels/ladder/``, ``longca_triton/bench/ladder.py``) on the CPU.

Every step, forward and backward, passes the same correctness tests in Triton's interpreter
(float32 and float16; bf16 ``tl.dot`` is not meaningful there): causal at an awkward length,
documents, GQA with a group of 3, and a random ``RangeMask`` with ``Sq != Sk`` and fully masked
rows, against the float64 naive reference. Then the runner (check-only and a timed run through
the interpreter), its outputs and the CLI; and, in a subprocess, that the GPU-only paths
(TMA descriptors, pipelining, warp specialization) compile for sm_90.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from longca_triton.kernels.ladder import STEPS, get_step, steps_for
from longca_triton.masks import RangeMask, make_mask
from longca_triton.reference.naive import naive_attention

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a CUDA GPU")
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
# normalised max error |x - ref|_max / max(1, |ref|_max) against float64; on a GPU every case runs
# in bf16 (fp32 tl.dot would use TF32 there, and bf16 is what the kernels are for)
TOL = {torch.float32: 2e-4, torch.float16: 6e-3, torch.bfloat16: 2e-2}
interpreter_only = pytest.mark.skipif(DEVICE != "cpu", reason="exercises the CPU-interpreter path of the runner")


def _random_mask(sq, sk, seed=3):
    """Union of random slices; the first rows are outside every slice (fully masked)."""
    rng = np.random.default_rng(seed)
    slices = []
    for kind in ("FULL", "CAUSAL", "INVCAUSAL", "BICAUSAL"):
        q0, q1 = sorted(int(x) for x in rng.choice(np.arange(4, sq + 1), size=2, replace=False))
        k0, k1 = sorted(int(x) for x in rng.choice(sk + 1, size=2, replace=False))
        slices.append((q0, q1, k0, k1, kind))
    return RangeMask(sq, sk, slices, name="random")


# (id, mask factory, B, Hq, Hkv, D, dtype)
CASES = {
    "causal-S97-fp32": (lambda: make_mask("causal", 97), 1, 2, 2, 32, torch.float32),
    "docs-S120-GQA2-fp16": (lambda: make_mask("causal_document", 120, doc_lens=[37, 2, 50, 31]), 1, 4, 2, 32, torch.float16),
    "causal-S64-GQA3-D16-fp32": (lambda: make_mask("causal", 64), 1, 6, 2, 16, torch.float32),
    "random-45x70-empty-rows-fp32": (lambda: _random_mask(45, 70), 2, 2, 1, 32, torch.float32),
}
_REF = {}


def _case(case_id):
    """Inputs and float64 reference (out, lse, dq, dk, dv) of one case, computed once."""
    if case_id not in _REF:
        make, B, Hq, Hkv, D, dtype = CASES[case_id]
        dtype = dtype if DEVICE == "cpu" else torch.bfloat16
        mask = make()
        g = torch.Generator().manual_seed(0)
        q = torch.randn(B, mask.seqlen_q, Hq, D, generator=g).to(dtype)
        k = torch.randn(B, mask.seqlen_k, Hkv, D, generator=g).to(dtype)
        v = torch.randn(B, mask.seqlen_k, Hkv, D, generator=g).to(dtype)
        do = torch.randn(B, mask.seqlen_q, Hq, D, generator=g).to(dtype)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        out, lse = naive_attention(*leaves, mask, return_lse=True)
        grads = torch.autograd.grad(out, leaves, do.double())
        _REF[case_id] = dict(mask=mask, q=q.to(DEVICE), k=k.to(DEVICE), v=v.to(DEVICE), do=do.to(DEVICE),
                             out=out.detach(), lse=lse.detach(), grads=[x.detach() for x in grads], dtype=dtype)
    return _REF[case_id]


def _check(name, x, ref, dtype):
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)} vs {tuple(ref.shape)}"
    assert not torch.isnan(x).any(), f"{name}: NaN"
    err = ((x.cpu().double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()
    assert err <= TOL[dtype], f"{name}: normalised max error {err:.3e} > {TOL[dtype]:.1e}"


def _cannot_run_here(step) -> str:
    return step.device_reason(torch.device(DEVICE)) if step.device_reason else ""


def _params(mode):
    return [pytest.param(step.name, case_id, id=f"{step.name}-{case_id}",
                         marks=pytest.mark.skipif(bool(_cannot_run_here(step)), reason=_cannot_run_here(step)))
            for step in steps_for(mode) for case_id in CASES]


@pytest.mark.parametrize("step_name,case_id", _params("fwd"))
def test_forward_step(step_name, case_id):
    c = _case(case_id)
    out = get_step(step_name).fn(c["q"], c["k"], c["v"], c["mask"])
    assert out.dtype == c["dtype"]
    _check("out", out, c["out"], c["dtype"])
    empty = ~c["mask"].to_dense().any(1)
    if empty.any():  # rows that attend nothing give exact zeros
        assert torch.all(out[:, empty.to(out.device)] == 0)


@pytest.mark.parametrize("step_name,case_id", _params("bwd"))
def test_backward_step(step_name, case_id):
    c = _case(case_id)
    out = c["out"].to(c["dtype"]).to(DEVICE)
    lse = c["lse"].float().to(DEVICE)
    grads = get_step(step_name).fn(c["q"], c["k"], c["v"], c["mask"], out, lse, c["do"])
    for name, g, ref, x in zip(("dq", "dk", "dv"), grads, c["grads"], (c["q"], c["k"], c["v"])):
        assert g.dtype == x.dtype
        _check(name, g, ref, c["dtype"])


def test_backward_prepare_matches_backward():
    """``prepare_backward`` (what the timer calls) gives what ``backward`` gives."""
    c = _case("causal-S97-fp32")
    out, lse = c["out"].to(c["dtype"]).to(DEVICE), c["lse"].float().to(DEVICE)
    for step in steps_for("bwd"):
        fn = step.prepare_backward(c["q"], c["k"], c["v"], c["mask"], out, lse)
        for g, ref in zip(fn(c["do"]), c["grads"]):
            _check(step.name, g, ref, c["dtype"])


def test_non_contiguous_inputs():
    """[B, S, H, D] views of [B, H, S, D] tensors (strided heads) through every Triton step."""
    mask = make_mask("causal", 50)
    g = torch.Generator().manual_seed(1)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(1, h, 50, 32, generator=g).to(dtype).to(DEVICE).transpose(1, 2) for h in (4, 2, 2))
    ref = naive_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), mask)
    for step in steps_for("fwd"):
        if step.name != "step1_row_program" and not _cannot_run_here(step):
            _check(step.name, step.fn(q, k, v, mask), ref, dtype)


# ------------------------------------------------------------------ the registry and the docs
def test_registry_shape():
    names = [s.name for s in STEPS]
    assert len(names) == len(set(names))
    fwd, bwd = steps_for("fwd"), steps_for("bwd")
    assert fwd[0].name == "step0_naive" and fwd[-2].name == "step7_production"
    assert fwd[-1].name == "step8_warp_specialized" and fwd[-1].device_reason is not None
    assert [int(s.name[4]) for s in fwd] == list(range(len(fwd)))
    assert len(bwd) >= 3 and bwd[-2].name == "bwd5_production" and bwd[-1].name == "bwd6_one_launch"
    for s in STEPS:
        assert s.path.exists(), s.file
        doc = s.module.__doc__ or ""
        assert "Measured (H100, causal, S=16K)" in doc, f"{s.name}: docstring lacks the measured line"
        assert s.idea and s.mode in ("fwd", "bwd")
    with pytest.raises(ValueError, match="unknown ladder step"):
        get_step("step9_magic")


def test_production_steps_are_the_production_kernel():
    """Steps 7 / bwd5 call ``dense_attention`` itself, not a copy of it."""
    from longca_triton.kernels.dense import op as dense
    from longca_triton.kernels.ladder import bwd5_production, step7_production

    assert step7_production.dense_attention is dense.dense_attention
    assert bwd5_production.dense_attention is dense.dense_attention
    c = _case("causal-S97-fp32")
    torch.testing.assert_close(step7_production.forward(c["q"], c["k"], c["v"], c["mask"]),
                               dense.dense_attention(c["q"], c["k"], c["v"], c["mask"]), rtol=0, atol=0)


def test_limits_skip_with_reasons():
    s0, s1, b1 = get_step("step0_naive"), get_step("step1_row_program"), get_step("bwd1_naive")
    assert s0.limit(1, 64, 8, 16384, 16384, 128) is None  # runs, a few heads at a time
    assert "O(S²) memory" in s0.limit(1, 64, 8, 131072, 131072, 128)
    assert b1.limit(1, 64, 8, 16384, 16384, 128) is None
    assert "O(S²) memory" in b1.limit(1, 64, 8, 65536, 65536, 128)
    assert s1.limit(1, 64, 8, 16384, 16384, 128) is None
    assert "minutes" in s1.limit(1, 64, 8, 32768, 32768, 128)


def test_tile_tables_move_the_ragged_key_tile():
    """Query-major full lists never hold the last key tile when Sk % BLOCK_N != 0; the union of
    full and partial tiles is the IR's."""
    from longca_triton.kernels.ladder._common import tile_tables

    mask = make_mask("causal_document", 97, doc_lens=[40, 57])
    t = tile_tables(mask, 16, 32, "cpu")
    bt = mask.block_tables(16, 32)
    full, part = bt.to_dense_tiles()
    got_full = np.zeros_like(full)
    got_part = np.zeros_like(part)
    ptr, idx = t.q_full_ptr.numpy(), t.q_full_idx.numpy()
    for m in range(t.num_m):
        got_full[m, idx[ptr[m]:ptr[m + 1]]] = True
    ptr, idx = t.q_part_ptr.numpy(), t.q_part_idx.numpy()
    for m in range(t.num_m):
        got_part[m, idx[ptr[m]:ptr[m + 1]]] = True
    assert not got_full[:, -1].any()
    assert np.array_equal(got_full | got_part, full | part)
    assert np.array_equal(t.k_full_ptr.numpy(), bt.k_full_ptr)  # key-major lists untouched


# ------------------------------------------------------------------ the runner and the CLI
def _tiny(mode, **kw):
    from longca_triton.bench.ladder import LadderProblem, interpreter_problem

    return interpreter_problem(LadderProblem(mode=mode, **kw))


@interpreter_only
def test_run_ladder_interpreter_checks_every_step():
    from longca_triton.bench.ladder import run_ladder

    p = _tiny("bwd", mask="causal_document", seqlen=60, heads=(8, 2), head_dim=32)
    assert (p.seqlen, p.heads_q, p.heads_kv, p.head_dim, p.dtype_name) == (60, 4, 1, 32, "float32")
    rows = run_ladder(p, log=lambda s: None)
    assert [r["step"] for r in rows] == [s.name for s in steps_for("bwd")]
    for r in rows:
        assert r["status"] == "checked" and r["check"] == "ok", r
        assert r["check_err"] <= r["check_tol"]
        assert "median_ms" not in r


def test_gluon_step_is_skipped_with_its_reason_where_it_cannot_run():
    from longca_triton.bench.ladder import run_ladder

    step = get_step("step8_warp_specialized")
    if not _cannot_run_here(step):
        pytest.skip("this machine can run the Gluon step")
    p = _tiny("fwd", mask="causal", seqlen=60, heads=(8, 2), head_dim=32)
    rows = {r["step"]: r for r in run_ladder(p, steps=["step7_production", "step8_warp_specialized"],
                                             log=lambda s: None)}
    assert rows["step7_production"]["check"] == "ok"
    assert rows["step8_warp_specialized"]["status"] == "skipped"
    assert "sm_90" in rows["step8_warp_specialized"]["reason"]


@interpreter_only
def test_timed_run_and_outputs(tmp_path, monkeypatch):
    """The GPU code path (full-size run, consistency with production, timing, outputs) on the
    interpreter; the numbers are meaningless here, the plumbing is not."""
    import longca_triton.bench.ladder as L

    monkeypatch.setattr(L, "TIME_BUDGET_MS", 1.0)
    p = _tiny("fwd", mask="causal", seqlen=48, heads=(4, 2), head_dim=32)
    names = ["step0_naive", "step4_mask_skipping", "step7_production"]
    rows = L.run_ladder(p, steps=names, log=lambda s: None, timed=True)
    steps = [r for r in rows if r["kind"] == "ladder"]
    assert [r["step"] for r in steps] == names
    for r in steps:
        assert r["status"] == "ok" and r["tflops"] > 0 and r["vs_production"] <= 1e-5, r
    assert steps[1]["x_prev"] == pytest.approx(steps[1]["tflops"] / steps[0]["tflops"])
    assert rows[-1]["kind"] == "vendor" and rows[-1]["status"] == "unsupported"

    written = L.write_outputs(rows, tmp_path, command="longca-triton ladder (test)")
    assert {x.name for x in written} == {"ladder.jsonl", "ladder.md", "ladder_fwd.png"}
    md = (tmp_path / "ladder.md").read_text()
    assert "`step4_mask_skipping`" in md and "× prev" in md and "ladder_fwd.png" in md
    # a re-run of the same problem replaces its rows; another mode adds a section
    L.write_outputs(rows, tmp_path)
    lines = (tmp_path / "ladder.jsonl").read_text().splitlines()
    assert len(lines) == len(rows) and json.loads(lines[0])["step"] == "step0_naive"
    bwd = L.run_ladder(_tiny("bwd", mask="causal", seqlen=40, heads=(2, 1), head_dim=32),
                       steps=["bwd4_gqa", "bwd5_production"], log=lambda s: None)
    L.write_outputs(bwd, tmp_path)
    md = (tmp_path / "ladder.md").read_text()
    assert "## fwd: causal" in md and "## bwd: causal" in md


@interpreter_only
def test_skipped_step_is_reported(monkeypatch):
    import longca_triton.bench.ladder as L
    from longca_triton.kernels.ladder import step0_naive

    monkeypatch.setattr(L, "TIME_BUDGET_MS", 1.0)
    monkeypatch.setattr(step0_naive, "MEMORY_BUDGET", 1)  # pretend S² does not fit
    p = _tiny("fwd", mask="causal", seqlen=40, heads=(2, 2), head_dim=32)
    rows = L.run_ladder(p, steps=["step0_naive", "step3_online_softmax", "step7_production"],
                        log=lambda s: None, timed=True)
    assert rows[0]["status"] == "skipped" and "O(S²) memory" in rows[0]["reason"]
    assert "x_prev" not in rows[1] and rows[2]["prev_step"] == "step3_online_softmax"


@interpreter_only
def test_cli_help_and_interpreter_run(tmp_path):
    from click.testing import CliRunner

    from longca_triton.cli import main

    runner = CliRunner()
    res = runner.invoke(main, ["ladder", "--help"])
    assert res.exit_code == 0 and "Examples:" in res.output and "--mode" in res.output
    res = runner.invoke(main, ["ladder", "--mode", "all", "-S", "40", "--heads", "4:2", "--head-dim", "32",
                               "--steps", "step4_mask_skipping,bwd3_mask_skipping", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "correctness only" in res.output and "Speed needs a GPU" in res.output
    rows = [json.loads(x) for x in (tmp_path / "ladder.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == {"step4_mask_skipping", "bwd3_mask_skipping"}
    res = runner.invoke(main, ["ladder", "--steps", "nope"])
    assert res.exit_code != 0 and "unknown steps" in res.output
    res = runner.invoke(main, ["ladder", "--mask", "block_sparse"])
    assert res.exit_code != 0 and "static masks" in res.output


# ------------------------------------------------------------------ GPU paths compile for sm_90
_COMPILE = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from longca_triton.kernels.ladder import step5_gqa, step6_hopper, bwd4_gqa

    def sig(fn, consts):
        out = {}
        for a in fn.arg_names:
            if a in consts: out[a] = "constexpr"
            elif a in ("Q", "K", "V", "Out", "DOut", "DK", "DV"): out[a] = "*bf16"
            elif a in ("Lse", "Delta"): out[a] = "*fp32"
            elif a.isupper(): out[a] = "*i32"
            elif a in ("qk_scale", "softmax_scale"): out[a] = "fp32"
            else: out[a] = "i32"
        return out

    c = dict(HEAD_DIM=128, BLOCK_M=128, BLOCK_N=128, NUM_IV=2, GROUP=8, ROWS=16)
    jobs = [(step5_gqa.gqa_fwd_kernel, c, 1),
            (step6_hopper.hopper_fwd_kernel, dict(c, NUM_STAGES=2, WARP_SPEC=False), 1),
            (step6_hopper.hopper_fwd_kernel, dict(c, NUM_STAGES=2, WARP_SPEC=True), 1),
            (bwd4_gqa.gqa_dkdv_bwd_kernel, dict(HEAD_DIM=128, BLOCK_M=64, BLOCK_N=128, NUM_IV=1), 1)]
    for fn, consts, stages in jobs:
        k = triton.compile(ASTSource(fn, sig(fn, consts), consts), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 8, "num_stages": stages})
        ttgir = k.asm["ttgir"]
        tma = "async_tma_copy_global_to_local" in ttgir
        print(fn.__name__, consts.get("WARP_SPEC"), "tma" if tma else "no-tma", "cubin" in k.asm)
""")


@pytest.mark.slow
def test_gpu_kernels_compile_for_hopper():
    """Ahead-of-time compilation for sm_90 (no GPU needed): the Hopper step really uses TMA."""
    res = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=600)
    if res.returncode != 0 and ("ptxas" in res.stderr.lower() and "not found" in res.stderr.lower()):
        pytest.skip("no ptxas in this Triton install")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [x.split() for x in res.stdout.strip().splitlines()]  # name, WARP_SPEC, tma?, cubin?
    assert [x[0] for x in lines] == ["gqa_fwd_kernel", "hopper_fwd_kernel", "hopper_fwd_kernel", "gqa_dkdv_bwd_kernel"]
    assert lines[0][2] == "no-tma" and lines[1][2] == lines[2][2] == "tma", lines
    assert all(x[3] == "True" for x in lines), lines


@pytest.mark.gpu
def test_ladder_runner_on_gpu(tmp_path):
    """On a CUDA host: the runner's own bf16 check and full-size run pass for every step."""
    import longca_triton.bench.ladder as L

    for mode in ("fwd", "bwd"):
        p = L.LadderProblem(mask="causal_document", seqlen=2048, mode=mode, heads=(8, 2), head_dim=128,
                            check_seqlen=1024, device="cuda")
        rows = L.run_ladder(p, log=lambda s: None)
        for r in rows:
            if r["kind"] == "ladder":
                assert r["status"] in ("ok", "skipped"), r
        L.write_outputs(rows, tmp_path)
    assert (tmp_path / "ladder_fwd.png").exists() and (tmp_path / "ladder_bwd.png").exists()

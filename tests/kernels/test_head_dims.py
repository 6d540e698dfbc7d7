"""Head dims that are not powers of two (40, 80, 96) and a value head dim of its own (192/128,
48/32, 32/96) through every kernel of ours, against the float64 naive reference.

Each kernel case checks out, lse (and its -inf rows), dq, dk, dv (``utils.compare_to_reference``):
dense (``triton``) forward and backward incl. the row-major dK/dV sweep and an lse gradient, FlashMask
(``triton-flashmask``), block-sparse with uniform blocks (tile = block: the unmasked-row loads) and
variable blocks (short sub-tiles: the masked ones). Awkward sizes, GQA and fully masked rows;
fp16 and fp32 only (the interpreter's bf16 ``tl.dot`` is not reliable); the interpreter's pinned
config. Also: the references, the public API, the FLOP count, validation and the adapters' reasons.
"""

import math

import pytest
import torch
from utils import (
    DEVICE,
    compare_to_reference,
    needs_triton,
    random_range_mask,
    small_mask,
)

import longca_triton as lt
from longca_triton.adapters import Problem, get_backend
from longca_triton.kernels.block_sparse.op import block_sparse_attention
from longca_triton.kernels.dense.op import dense_attention
from longca_triton.kernels.flashmask.op import flashmask_attention
from longca_triton.masks import RangeMask, make_mask
from longca_triton.reference import chunked_attention, naive_attention

pytestmark = needs_triton

FP = {torch.float32: "fp32", torch.float16: "fp16"}


def case(kernel, S, hq, hkv, dqk, dv, dtype, mask, **kw):
    return pytest.param(kernel, S, hq, hkv, dqk, dv, dtype, mask, kw,
                        id=f"{kernel}-S={S}-Hq={hq}-Hkv={hkv}-Dqk={dqk}-Dv={dv}-{FP[dtype]}-{mask}")


def run(fn, mask, hq, hkv, dqk, dv, dtype, B=1, config=None, dlse=False):
    return compare_to_reference(lambda q, k, v: fn(q, k, v, mask, return_lse=True, config=config), mask,
                                mask.seqlen_q, mask.seqlen_k, B, hq, hkv, dqk, dtype, dv=dv, dlse=dlse)


KERNELS = {"triton": dense_attention, "triton-flashmask": flashmask_attention, "triton-sparse": block_sparse_attention,
           "triton-varblock": block_sparse_attention}


def build(kernel, name, S):
    if kernel == "triton-sparse":  # tile = block (32 in the interpreter): full row tiles, unmasked loads
        return make_mask("block_sparse", S, seed=S, block=32, density=0.4, patterns=2)
    if kernel == "triton-varblock":  # blocks in short sub-tiles: masked row loads
        return make_mask("varblock_sparse", S, seed=S, block=48, min_block=20, density=0.5, patterns=2)
    if name == "random":
        return random_range_mask(S, S, S)  # fully masked first rows
    if name == "late_causal":  # causal from row 5 on: rows 0-4 attend nothing (FlashMask columns fit)
        return RangeMask(S, S, [(5, S, 0, S, "CAUSAL")], name="late_causal")
    return small_mask(name, S, seed=S)


CASES = [
    # dense: fwd, bwd (incl. the row-major sweep's 3-d descriptors on padded dims), lse and its gradient
    case("triton", 239, 4, 2, 80, 80, torch.float32, "causal_document"),
    case("triton", 150, 4, 1, 40, 40, torch.float16, "share_question"),
    case("triton", 97, 2, 2, 96, 96, torch.float16, "global_sliding_window"),
    case("triton", 130, 4, 2, 192, 128, torch.float16, "causal"),
    case("triton", 100, 2, 1, 48, 32, torch.float32, "random"),
    case("triton", 77, 2, 1, 32, 96, torch.float32, "prefix_lm_document"),
    case("triton", 90, 4, 2, 80, 80, torch.float32, "causal_document", config={"dkdv_sweep": 2, "DKDV_BLOCK_M": 16}),
    case("triton", 70, 2, 1, 96, 64, torch.float16, "sliding_window_causal", dlse=True),
    # FlashMask
    case("triton-flashmask", 181, 4, 2, 80, 80, torch.float32, "causal_document"),
    case("triton-flashmask", 150, 2, 2, 96, 96, torch.float16, "share_question"),
    case("triton-flashmask", 130, 4, 2, 192, 128, torch.float16, "causal"),
    case("triton-flashmask", 100, 4, 1, 40, 24, torch.float32, "late_causal"),
    # block-sparse, uniform and variable blocks
    case("triton-sparse", 200, 4, 2, 40, 40, torch.float32, "block_sparse"),
    case("triton-sparse", 160, 4, 2, 192, 128, torch.float16, "block_sparse"),
    case("triton-varblock", 250, 4, 2, 80, 80, torch.float32, "varblock_sparse"),
    case("triton-varblock", 180, 2, 2, 96, 48, torch.float16, "varblock_sparse", dlse=True),
]


@pytest.mark.parametrize("kernel,S,hq,hkv,dqk,dv,dtype,name,kw", CASES)
def test_kernel_against_reference(kernel, S, hq, hkv, dqk, dv, dtype, name, kw):
    mask = build(kernel, name, S)
    out, lse = run(KERNELS[kernel], mask, hq, hkv, dqk, dv, dtype, **kw)
    assert out.shape[-1] == dv
    if name in ("random", "late_causal"):
        empty = ~mask.to_dense().any(1)
        assert empty.any() and torch.all(out[:, empty] == 0) and torch.all(lse[:, :, empty] == float("-inf"))


def test_block_sparse_rows_keeping_nothing():
    """A query block that keeps no key block: zero output rows and lse = -inf, with a padded dim."""
    bm = torch.tensor([[[True, False, True], [False, False, False], [False, True, True]]])
    mask = lt.BlockSparseMask([0, 40, 80, 121], [0, 40, 80, 121], bm)
    out, lse = run(block_sparse_attention, mask, 2, 1, 80, 48, torch.float32)
    assert torch.all(out[:, 40:80] == 0) and torch.all(lse[:, :, 40:80] == float("-inf"))


# ------------------------------------------------------------------ API, references, FLOPs
@pytest.mark.parametrize("backend", ["triton", "triton-flashmask", "reference-chunked"])
def test_public_api_with_own_value_dim(backend):
    """``lt.attention`` with ``v [B, S, Hkv, D_v]``: out has D_v, lse and gradients match the naive
    reference (in float64 for the reference backend, float32 for ours)."""
    mask = small_mask("causal_document", 120, seed=3)
    dt = torch.float64 if backend.startswith("reference") else torch.float32
    torch.manual_seed(1)
    q = torch.randn(1, 120, 4, 48, dtype=dt, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 120, 2, 48, dtype=dt, device=DEVICE, requires_grad=True)
    v = torch.randn(1, 120, 2, 32, dtype=dt, device=DEVICE, requires_grad=True)
    out, lse = lt.attention(q, k, v, mask, backend=backend, return_lse=True)
    assert out.shape == (1, 120, 4, 32)
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = naive_attention(q2, k2, v2, mask, return_lse=True)
    assert (out.double() - ref).abs().max().item() < 1e-4
    fin = torch.isfinite(ref_lse)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() < 1e-4
    do = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), do.to(dt))
    want = torch.autograd.grad(ref, (q2, k2, v2), do)
    for g, w in zip(got, want):
        assert g.shape == w.shape and (g.double() - w).abs().max().item() < 1e-3


def test_chunked_reference_matches_naive_with_own_value_dim():
    mask = make_mask("block_sparse", 96, seed=0, block=16, density=0.5, patterns=2)
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 96, h, d, dtype=torch.float64, requires_grad=True) for h, d in ((4, 24), (2, 24), (2, 40)))
    a, la = chunked_attention(q, k, v, mask, return_lse=True, chunk=32)
    b, lb = naive_attention(q, k, v, mask, return_lse=True)
    assert a.shape == (2, 96, 4, 40) and torch.allclose(a, b, atol=1e-10)
    assert torch.equal(torch.isinf(la), torch.isinf(lb))
    do = torch.randn_like(a)
    for x, y in zip(torch.autograd.grad(a, (q, k, v), do), torch.autograd.grad(b, (q, k, v), do)):
        assert torch.allclose(x, y, atol=1e-10)


def test_flops_count_each_head_dim_once():
    """docs/masks.md §5: ``2 (D_qk + D_v)`` per allowed pair and query head; equal dims give ``4 D``."""
    mask = make_mask("causal", 64)
    assert mask.flops(8, 192, "fwd", head_dim_v=128) == 2 * (192 + 128) * 8 * mask.area
    assert mask.flops(8, 96, "fwd", head_dim_v=96) == mask.flops(8, 96, "fwd") == 4 * 96 * 8 * mask.area
    assert mask.flops(8, 192, "bwd", head_dim_v=128) == 2.5 * mask.flops(8, 192, "fwd", head_dim_v=128)
    p = Problem(mask=mask, heads_q=8, heads_kv=2, head_dim=192, head_dim_v=128, mode="fwd_bwd")
    assert p.flops() == 3.5 * 2 * (192 + 128) * 8 * mask.area
    assert p.head_dim_label == "192/128" and p.scale == pytest.approx(1 / math.sqrt(192))
    q, k, v = torch.zeros(1, 64, 8, 192), torch.zeros(1, 64, 2, 192), torch.zeros(1, 64, 2, 128)
    assert Problem.from_tensors(q, k, v, mask).d_v == 128
    assert Problem.from_tensors(q, k, k, mask).head_dim_v is None


# ------------------------------------------------------------------ validation and vendors' limits
def test_validation_names_the_problem():
    mask = make_mask("causal", 16)
    q = torch.randn(1, 16, 4, 80, device=DEVICE)
    k = torch.randn(1, 16, 2, 80, device=DEVICE)
    for fn in (dense_attention, flashmask_attention):
        with pytest.raises(ValueError, match="head dim mismatch: q has 80, k has 96"):
            fn(q, torch.randn(1, 16, 2, 96), k, mask)
        with pytest.raises(ValueError, match=r"k and v must agree on \[B, Sk, Hkv\]"):
            fn(q, k, torch.randn(1, 16, 1, 80), mask)
        with pytest.raises(ValueError, match="head dim of v 36 not supported.*multiples of 8"):
            fn(q, k, torch.randn(1, 16, 2, 36), mask)
    with pytest.raises(ValueError, match="head dims of q and k differ"):
        lt.attention(q, torch.randn(1, 16, 2, 96), k, mask, backend="reference")
    bs = make_mask("block_sparse", 64, block=32, density=0.5)
    with pytest.raises(ValueError, match="head dim of q/k 264 not supported"):
        block_sparse_attention(torch.randn(1, 64, 2, 264), torch.randn(1, 64, 2, 264), torch.randn(1, 64, 2, 64), bs)


def test_backends_state_head_dim_limits():
    """Each adapter says ``unsupported: reason`` for head dims its vendor cannot run, and lets the
    ones it can through (checked on the reason alone: no vendor package or GPU needed)."""
    mask = make_mask("causal", 256)

    def reason(name, dqk, dv=None):
        p = Problem(mask=mask, heads_q=8, heads_kv=2, head_dim=dqk, head_dim_v=dv, dtype=torch.bfloat16)
        return get_backend(name).head_dim_reason(p)

    assert reason("fa3", 192, 128) == "" and reason("fa3", 96) == "" and reason("fa4", 192, 128) == ""
    assert "head_dim 80 not supported" in reason("fa3", 80)
    assert "head dims 192/64 (D_qk/D_v) not supported" in reason("fa3", 192, 64)
    assert reason("fa2", 80) == "" and "D_v 128 != D_qk 192" in reason("fa2", 192, 128)
    assert "D_v 128 != D_qk 192" in reason("sdpa-flash", 192, 128) and reason("sdpa-cudnn", 192, 128) == ""
    assert reason("sdpa-math", 40, 24) == "" and reason("flex", 96, 64) == ""
    assert "head_dim 96 not supported" in reason("flashmask", 96)
    assert "D_v" in reason("cudnn", 192, 128) and "D_v" in reason("flashinfer-varblock", 128, 64)
    # ours: any head dim from 1 to 256 (zero-padded to multiples of 8 inside), any pair
    for name, dqk, dv in (("triton", 192, 128), ("triton-flashmask", 100, 100), ("triton", 1, 59)):
        ok, why = get_backend(name).supports(Problem(mask=mask, heads_q=8, heads_kv=2, head_dim=dqk, head_dim_v=dv,
                                                     dtype=torch.float16, device=DEVICE))
        assert ok, why
    ok, why = get_backend("triton").supports(Problem(mask=mask, head_dim=264, dtype=torch.float16, device=DEVICE))
    assert not ok and "1 to 256" in why


# ------------------------------------------------------------------ the bench grid, rows, report, recommend
def test_bench_grid_takes_head_dims(tmp_path):
    from longca_triton.bench.config import ConfigError, load_experiment

    toml = tmp_path / "hd.toml"
    toml.write_text('[grid]\nmasks = ["causal"]\nseqlens = [64]\nheads = ["2:1"]\n'
                    'head_dim = ["64", "96", 128, "192/128", "80/80"]\nbackends = ["reference"]\n')
    exp = load_experiment(toml).validate()
    assert exp.head_dims == [64, 96, 128, "192/128", 80]
    assert exp.with_overrides(head_dims="40,192/128").validate().head_dims == [40, "192/128"]
    for bad in ("x", "192/0", "1/2/3"):
        with pytest.raises(ConfigError, match="D_qk/D_v"):
            exp.with_overrides(head_dims=bad).validate()


def test_bench_rows_record_both_head_dims(tmp_path):
    """A sweep at ``"24/16"``: rows carry head_dim = d_qk = 24 and d_v = 16, the FLOPs of docs/masks.md §5
    with both dims, a passing check of our kernel; the report and row keys tell 24/16 from 24."""
    from longca_triton.bench.config import Experiment
    from longca_triton.bench.report import markdown_report
    from longca_triton.bench.runner import run_experiment
    from longca_triton.bench.store import ResultStore, row_key

    exp = Experiment(masks=["causal"], seqlens=[64], heads=["2:1"], head_dims=["24/16"], dtypes=["float32"],
                     modes=["fwd", "bwd"], backends=["reference", "triton"], warmup_ms=0, rep=1, max_ms=50).validate()
    store = ResultStore(tmp_path / "r.jsonl")
    res = run_experiment(exp, store, device="cpu")
    assert len(res.rows) == 4 and all(r["status"] == "ok" for r in res.rows), [r["status"] for r in res.rows]
    area = make_mask("causal", 64).area
    for r in res.rows:
        assert (r["head_dim"], r["d_qk"], r["d_v"]) == (24, 24, 16)
        assert r["flops"] == pytest.approx(2 * (24 + 16) * 2 * area * (2.5 if r["mode"] == "bwd" else 1))
    old = dict(res.rows[0], d_v=None, d_qk=None)
    assert row_key(old) != row_key(res.rows[0]) and row_key(dict(old, d_v=24)) == row_key(old)
    report = markdown_report(store.rows())
    assert "head dim 24/16" in report


def test_recommend_reads_split_head_dims():
    from longca_triton.study.recommend import recommend

    def row(backend, tflops, **dims):
        return {"kind": "dense", "backend": backend, "mask": "causal", "seqlen": 16384, "heads_q": 64, "heads_kv": 8,
                "dtype": "bfloat16", "mode": "fwd", "status": "ok", "tflops": tflops, "time_ms": 1.0, "flops": 1e12,
                "gpu": "GPU-X", "_file": "x", **dims}

    rows = [row("old-128", 500.0, head_dim=128), row("mla", 400.0, head_dim=192, d_qk=192, d_v=128),
            row("mla-192", 450.0, head_dim=192, d_qk=192, d_v=192)]
    assert recommend(rows, "causal", 16384, heads=(64, 8), head_dim="192/128", mode="fwd").kernel["backend"] == "mla"
    assert recommend(rows, "causal", 16384, heads=(64, 8), head_dim=192, mode="fwd").kernel["backend"] == "mla-192"
    rec = recommend(rows, "causal", 16384, heads=(64, 8), head_dim="128", mode="fwd")
    assert rec.kernel["backend"] == "old-128" and "head dim 128" in rec.lines()[0]

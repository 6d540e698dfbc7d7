"""Head dims that are not powers of two (40, 80, 96) and a value head dim of its own (192/128,
48/32, 32/96) through every kernel of ours, against the float64 naive reference.

Each kernel case checks out, lse (and its -inf rows), dq, dk, dv (``utils.compare_to_reference``):
dense (``triton``) forward and backward incl. the fused-dQ variant and an lse gradient, FlashMask
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
    # dense: fwd, bwd (incl. the fused dQ's masked atomics), lse and its gradient
    case("triton", 239, 4, 2, 80, 80, torch.float32, "causal_document"),
    case("triton", 150, 4, 1, 40, 40, torch.float16, "share_question"),
    case("triton", 97, 2, 2, 96, 96, torch.float16, "global_sliding_window"),
    case("triton", 130, 4, 2, 192, 128, torch.float16, "causal"),
    case("triton", 100, 2, 1, 48, 32, torch.float32, "random"),
    case("triton", 77, 2, 1, 32, 96, torch.float32, "prefix_lm_document"),
    case("triton", 90, 4, 2, 80, 80, torch.float32, "causal_document", config={"fused_dq": True, "DKDV_BLOCK_M": 16}),
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
    """MASKS.md §5: ``2 (D_qk + D_v)`` per allowed pair and query head; equal dims give ``4 D``."""
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
    # ours: multiples of 8 up to 256, any pair
    ok, why = get_backend("triton").supports(Problem(mask=mask, heads_q=8, heads_kv=2, head_dim=192, head_dim_v=128,
                                                     dtype=torch.float16, device=DEVICE))
    assert ok, why
    ok, why = get_backend("triton-flashmask").supports(Problem(mask=mask, head_dim=100, dtype=torch.float16,
                                                               device=DEVICE))
    assert not ok and "multiples of 8" in why


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
    """A sweep at ``"24/16"``: rows carry head_dim = d_qk = 24 and d_v = 16, the FLOPs of MASKS.md §5
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


def test_gpu_script_targets_table():
    """``experiments/gpu/headdim_check.py``'s targets from rows: ours / cuDNN per dim, D=96 / D=128."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "experiments" / "gpu" / "headdim_check.py"
    spec = importlib.util.spec_from_file_location("headdim_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def row(backend, dim, mode, tflops, status="ok"):
        d_qk, d_v = (192, 128) if dim == "192/128" else (int(dim), int(dim))
        return {"backend": backend, "mask": "causal", "seqlen": 16384, "heads_q": 64, "heads_kv": 8, "head_dim": d_qk,
                "d_v": d_v, "dtype": "bfloat16", "mode": mode, "status": status, "tflops": tflops, "batch": 1}

    rows = [row("triton", "96", "fwd", 340.0), row("triton", "128", "fwd", 400.0), row("sdpa-cudnn", "96", "fwd", 500.0),
            row("triton", "192/128", "fwd", 300.0), row("sdpa-cudnn", "192/128", "fwd", 360.0),
            row("fa3", "192/128", "fwd", 0.0, "unsupported: not installed")]
    md = mod.targets(rows, ["96", "128", "192/128"])
    assert "| causal | 96 | 128 | 340 | 500 | 0.68 ✗ |" in md
    assert "| causal | 192/128 | 256/128 | 300 | 360 | 0.83 ✓ |" in md
    assert "| causal | fwd | 340 | 400 | 0.85 ✓ |" in md


# ------------------------------------------------------------------ launch configs per head dim (issue 17)
def _headdim_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "experiments" / "gpu" / "headdim_check.py"
    spec = importlib.util.spec_from_file_location("headdim_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_hopper_configs_by_head_dim():
    """The Hopper table: 80 and 96 take the measured 128 entry (unchanged), 192 and 192/128 the 256
    one; every candidate resolves to a valid config and differs from the default."""
    from longca_triton.kernels.dense import op as dense
    from longca_triton.kernels.core.runtime import config_head_dim

    measured_128 = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, warp_specialize=False,
                        DKDV_BLOCK_M=32, DKDV_BLOCK_N=64, dkdv_num_warps=4, dkdv_num_stages=3,
                        DQ_BLOCK_M=128, DQ_BLOCK_N=64, dq_num_warps=8, dq_num_stages=3, fused_dq=False,
                        one_launch=False, bwd_order=0, bwd_num_warps=8, bwd_num_stages=3, dkdv_sweep=0, dkdv_head_outer=False,
                        bwd_streams=False, dkdv_stats_tma=False, dq_skew=False, dkdv_qmajor=False)
    assert dense.HOPPER_CONFIGS[128] == measured_128
    for d in (80, 96, 128):
        assert dense.HOPPER_CONFIGS[dense._table_key(config_head_dim(d, d))] == measured_128
    assert dense._table_key(config_head_dim(192, 128)) == dense._table_key(256) == 256
    assert dense._table_key(config_head_dim(40, 40)) == 64
    for key, cands in dense.HEADDIM_CANDIDATES.items():
        full = dense.headdim_candidates(key)
        assert list(full) == ["default", *cands]
        for name, cfg in full.items():
            assert dense.resolve_config(key, torch.bfloat16, cfg) == cfg
            assert name == "default" or cfg != full["default"]
    assert list(dense.headdim_candidates(96)) == ["default"]


def test_dq_skew_only_where_the_head_dim_fills_the_tile(monkeypatch):
    """Full masks take ``dq_skew`` at D = 128 (measured a gain) but not at 80 / 96 on the same padded tile
    (D = 96 measured a loss); an explicit config still sets it."""
    from longca_triton.kernels.dense import op as dense
    from longca_triton.masks import make_mask

    monkeypatch.setattr(dense, "_interpreting", lambda: False)
    full = make_mask("full", 256)
    k = torch.empty(1, 256, 2, 128)
    for d, want in ((128, True), (96, False), (80, False)):
        q = torch.empty(1, 256, 8, d)
        kk, v = k[..., :d], k[..., :d]
        assert dense.resolve_config(128, torch.bfloat16, None, q=q, k=kk, v=v, mask=full)["dq_skew"] is want
    q = torch.empty(1, 256, 8, 128)  # D_v = 64 under a 128-wide q / k tile: not measured, off
    assert dense.resolve_config(128, torch.bfloat16, None, q=q, k=k, v=k[..., :64], mask=full)["dq_skew"] is False
    q = torch.empty(1, 256, 8, 96)
    cfg = dense.resolve_config(128, torch.bfloat16, {"dq_skew": True}, q=q, k=k[..., :96], v=k[..., :96], mask=full)
    assert cfg["dq_skew"] is True


def test_full_masks_take_their_own_dkdv_tile():
    """``HOPPER_FULL_MASK``: at D = 128 (and 80 / 96, padded to it) a mask allowing every pair gets
    the 64x64 dK/dV tile and the skewed dQ loop (``dq_skew``), any other mask (even one allowing all but one
    pair) the table's; other head dims are unchanged; an explicit config still wins over both."""
    from longca_triton.kernels.dense import op as dense
    from longca_triton.masks import make_mask

    full, causal = make_mask("full", 300), make_mask("causal", 300)
    overlay = dense.HOPPER_FULL_MASK[128]
    assert overlay == dict(DKDV_BLOCK_M=64, DKDV_BLOCK_N=64, dkdv_num_warps=4, dkdv_num_stages=2, dq_skew=True)
    for d in (96, 128):
        key = dense._table_key(d)
        # (full masks are even too: HOPPER_EVEN_MASK's bwd_streams)
        assert dense.hopper_config(d, full) == {**dense.HOPPER_CONFIGS[key], **overlay, **dense.HOPPER_EVEN_MASK[key]}
        assert dense.hopper_config(d, causal) == dense.hopper_config(d) == dense.HOPPER_CONFIGS[key]
    for d in (64, 256):
        assert dense.hopper_config(d, full) == dense.HOPPER_CONFIGS[dense._table_key(d)]
    # the interpreter keeps its one pinned config whatever the mask
    assert dense.default_config(128, torch.float16, full) == dense.INTERPRETER_CONFIG
    explicit = dense.resolve_config(128, torch.float16, {"DKDV_BLOCK_M": 16}, mask=full)
    assert explicit["DKDV_BLOCK_M"] == 16


def test_uneven_key_work_separates_the_static_masks():
    """``tuned.uneven_key_work``: the share of key tiles whose area is off the median by more than a
    quarter. The masks the row-major sweep won on (H100) are above ``UNEVEN_SHARE``, the ones it lost
    on (even programs) below it."""
    from longca_triton.kernels.dense import op as dense
    from longca_triton.kernels.core.tuned import uneven_key_work
    from longca_triton.masks import make_mask

    S = 16384  # the measured length; O(S) from the column intervals
    work = {m: uneven_key_work(make_mask(m, S, seed=0, **({"prefix": S // 3} if m == "prefix_lm_causal" else {})))
            for m in ("full", "causal", "causal_document", "share_question", "full_document", "prefix_lm_causal",
                      "sliding_window", "sliding_window_causal", "global_sliding_window")}
    assert work["full"] == 0.0
    for m in ("causal", "causal_document", "share_question", "full_document", "prefix_lm_causal"):
        assert work[m] >= dense.UNEVEN_SHARE, (m, work[m])
    for m in ("sliding_window", "sliding_window_causal", "global_sliding_window"):
        assert work[m] < dense.UNEVEN_SHARE, (m, work[m])
    assert 0.7 <= work["causal"] <= 0.8  # a quarter of the tiles sit within 25 % of the median
    assert uneven_key_work(make_mask("block_sparse", 1024, block=128, density=0.3, seed=0)) == 0.0


@pytest.mark.parametrize("sq,sk,seed", [(300, 300, 1), (100, 437, 2), (513, 90, 3)])
def test_uneven_key_work_counts_each_key_tiles_area(sq, sk, seed):
    """``RangeMask.key_tile_areas`` (behind ``uneven_key_work``: a difference array over the row
    intervals) are the dense mask's column sums per tile, Sq != Sk and empty columns included."""
    import numpy as np

    from longca_triton.kernels.core.tuned import uneven_key_work
    from utils import random_range_mask

    mask = random_range_mask(sq, sk, seed)
    cols = mask.to_dense().sum(0).numpy()  # [Sk]
    for block_n in (16, 64):
        work = np.add.reduceat(cols, np.arange(0, sk, block_n))
        assert np.array_equal(mask.key_tile_areas(block_n), work)
        work = work[work > 0]
        med = np.median(work)
        assert uneven_key_work(mask, block_n) == pytest.approx(np.mean(np.abs(work - med) > 0.25 * med))


def test_uneven_gqa_masks_take_the_row_major_sweep(monkeypatch):
    """``HOPPER_UNEVEN_MASK``: at D = 128 a GQA call on a mask of unequal dK/dV programs gets the
    descending row-major sweep on the 64x64 tile; MHA, even masks, full masks and other head dims
    do not; a config naming another dK/dV tile without ``dkdv_sweep`` goes head-major. Even masks (and
    full ones) take ``HOPPER_EVEN_MASK`` (``bwd_streams``) at D = 128."""
    from longca_triton.kernels.dense import op as dense
    from longca_triton.masks import make_mask

    monkeypatch.setattr(dense, "_interpreting", lambda: False)
    causal, window, full = make_mask("causal", 1024), make_mask("sliding_window", 16384), make_mask("full", 1024)
    table = dense.HOPPER_CONFIGS[128]
    assert dense.hopper_config(128, causal, group=8) == {**table, **dense.HOPPER_UNEVEN_MASK[128]}
    assert dense.hopper_config(96, causal, group=2)["dkdv_sweep"] == 2
    assert dense.hopper_config(128, causal, group=1) == table  # MHA: head-major
    assert dense.hopper_config(128, causal) == table  # no group given: MHA
    even = dense.HOPPER_EVEN_MASK[128]  # bwd_streams: even masks (full too), any group
    assert dense.hopper_config(128, window, group=8) == {**table, **even}
    assert dense.hopper_config(128, window, group=1) == {**table, **even}
    assert dense.hopper_config(128, full, group=8) == {**table, **dense.HOPPER_FULL_MASK[128], **even}
    assert not dense.hopper_config(128, causal, group=8)["bwd_streams"]
    assert not dense.hopper_config(128, None)["bwd_streams"]  # no mask (FlashMask columns): one stream
    assert dense.hopper_config(64, causal, group=8) == dense.HOPPER_CONFIGS[64]
    assert not dense.hopper_config(64, window, group=8)["bwd_streams"]  # measured at D = 128 only

    def resolve(config, hq=8, hkv=1):
        q, k = torch.empty(1, 1024, hq, 128), torch.empty(1, 1024, hkv, 128)
        return dense.resolve_config(128, torch.bfloat16, config, q=q, k=k, mask=causal)

    assert resolve(None)["dkdv_sweep"] == 2 and resolve(None)["DKDV_BLOCK_M"] == 64
    assert resolve(None, 8, 8)["dkdv_sweep"] == 0
    assert resolve({"BLOCK_M": 64})["dkdv_sweep"] == 2  # a forward tweak keeps the backward's pair
    assert resolve({"DKDV_BLOCK_M": 32}) == {**table, **dense.HOPPER_UNEVEN_MASK[128], "DKDV_BLOCK_M": 32,
                                             "dkdv_sweep": 0}
    assert resolve({"DKDV_BLOCK_M": 32, "dkdv_sweep": 2})["dkdv_sweep"] == 2
    # fused_dq (dQ by atomics from the dK/dV kernel) has no row-major form: asked for, it goes head-major
    assert resolve({"fused_dq": True})["dkdv_sweep"] == 0
    with pytest.raises(ValueError, match="dkdv_sweep"):
        resolve({"fused_dq": True, "dkdv_sweep": 2})


def test_gpu_script_config_entries():
    """``--configs`` times, per mode, the default and the candidates that change that mode's keys."""
    mod = _headdim_script()
    fwd = [n for n, _ in mod.config_entries(256, 256, "fwd")]
    bwd = [n for n, _ in mod.config_entries(192, 128, "bwd")]
    assert fwd == ["default", "old", "fwd64x64w8s2", "fwd128x32w8s3"]
    assert bwd == ["default", "old", "dkdv16x64w8s2", "dq64x32w8s2"]  # "old" changes dQ too
    assert [n for n, _ in mod.config_entries(96, 96, "fwd")] == ["default"]


def test_gpu_script_configs_smoke(tmp_path, monkeypatch):
    """``headdim_check.py --configs --smoke``: every config checked against float32 in the
    interpreter, then timed; the table has the default, the candidates and the vendor."""
    import sys

    mod = _headdim_script()
    monkeypatch.setattr(sys, "argv", ["headdim_check.py", "--configs", "--smoke", "--dims", "32", "--out",
                                      str(tmp_path)])
    assert mod.main() == 0
    md = (tmp_path / "configs.md").read_text()
    for name in ("default", "old", "fwd128x64w8s3", "sdpa-math"):
        assert f"| {name}" in md, md
    rows = [__import__("json").loads(x) for x in (tmp_path / "configs.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * (4 + 3) and all(r["status"] == "ok" and r["check"]["ok"] for r in rows)
    assert mod.main() == 0  # resumes: nothing left to run
    assert len((tmp_path / "configs.jsonl").read_text().splitlines()) == len(rows)


@pytest.mark.slow
def test_gpu_script_configs_smoke_wide_tiles(tmp_path, monkeypatch):
    """The 256-tile candidates (``HEADDIM_CANDIDATES[256]``) pass the float32 check in the interpreter."""
    import sys

    mod = _headdim_script()
    monkeypatch.setattr(sys, "argv", ["headdim_check.py", "--configs", "--smoke", "--dims", "136/24", "--out",
                                      str(tmp_path)])
    assert mod.main() == 0
    rows = [__import__("json").loads(x) for x in (tmp_path / "configs.jsonl").read_text().splitlines()]
    assert {r["name"] for r in rows} >= {"default", "old", "fwd64x64w8s2", "dkdv16x64w8s2"}
    assert all(r["status"] == "ok" for r in rows), [r["status"] for r in rows]


_AOT = """
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, "experiments")
from cpu_aot_headdim import compile_one, default_job_config
out = []
for label in ("256", "192/128", "64"):
    for kernel in ("fwd", "dkdv", "dq"):
        out.append(compile_one((label, "causal", kernel, default_job_config(label, kernel))))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_default_configs_compile_without_spills_for_hopper():
    """The Hopper defaults at 64, 192/128 and 256 compile for sm_90a (on the CPU) without register
    spills, within shared memory, and (256 tiles) with two warpgroups per SM. One chosen exception:
    dK/dV at D = 256 (32x64/8 warps) spills a few bytes and still ran 1.36x the spill-free 16x64
    tile on the H100 (experiments/results/h100/headdim/configs); it may spill no more than that."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", _AOT], capture_output=True, text=True, timeout=900, cwd=root,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    if res.returncode != 0 and "ptxas" in res.stderr.lower() and "not found" in res.stderr.lower():
        pytest.skip("no ptxas in this Triton install")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    for r in rows:
        assert not r["error"], r
        if (r["dims"], r["kernel"]) == ("256", "dkdv"):
            assert r["spill_stores"] <= 64 and r["spill_loads"] <= 64, r
        else:
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["blocks_per_sm"] >= 1, r
        if r["dims"] != "64":
            assert r["warps_per_sm"] >= 8, r

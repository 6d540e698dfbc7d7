"""Context parallelism (longca_triton.cp) on CPU: plans and local masks exactly, then every scheme x
plan x mask on 2, 3 and 4 gloo processes (and 8 with LONGCA_CP_WORLD8=1) against the single-process
reference (float64).

One process group per world size runs all of its cases (start-up is the expensive part).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from longca_triton import cp
from longca_triton.masks import RangeMask, make_mask

S = 151  # awkward on purpose: every plan pads


def random_range_mask(S: int, seed: int, n: int = 7) -> RangeMask:
    rng = np.random.default_rng(seed)
    slices = []
    for _ in range(n):
        qs = int(rng.integers(0, S - 1)); qe = int(rng.integers(qs + 1, min(S, qs + 80) + 1))
        ks = int(rng.integers(0, S - 1)); ke = int(rng.integers(ks + 1, min(S, ks + 80) + 1))
        slices.append((qs, qe, ks, ke, int(rng.integers(0, 4))))
    return RangeMask(S, S, slices, name="random")


def test_masks(S: int = S) -> dict:
    return {
        "full": make_mask("full", S),
        "causal": make_mask("causal", S),
        "causal_document": make_mask("causal_document", S, doc_lens=[40, 23, 60, 28]),
        "share_question": make_mask("share_question", S, doc_lens=[30, 41, 50, 30]),
        "sliding_window_causal": make_mask("sliding_window_causal", S, window=13),
        "random": random_range_mask(S, seed=3),
    }


test_masks.__test__ = False  # a helper, not a test


# ------------------------------------------------------------------------------ single process
def test_clip_slice_exact_random():
    rng = np.random.default_rng(0)
    for _ in range(1500):
        Sq, Sk = int(rng.integers(2, 25)), int(rng.integers(2, 25))
        qs = int(rng.integers(0, Sq)); qe = int(rng.integers(qs + 1, Sq + 1))
        ks = int(rng.integers(0, Sk)); ke = int(rng.integers(ks + 1, Sk + 1))
        kind = int(rng.integers(0, 4))
        m = RangeMask(Sq, Sk, [(qs, qe, ks, ke, kind)])
        a = int(rng.integers(0, Sq)); b = int(rng.integers(a + 1, Sq + 1))
        c = int(rng.integers(0, Sk)); e = int(rng.integers(c + 1, Sk + 1))
        pieces = cp.clip_slice(qs, qe, ks, ke, kind, a, b, c, e)
        want = torch.zeros(Sq, Sk, dtype=torch.bool)
        want[a:b, c:e] = m.to_dense()[a:b, c:e]
        got = RangeMask(Sq, Sk, pieces).to_dense() if pieces else torch.zeros(Sq, Sk, dtype=torch.bool)
        assert torch.equal(want, got), ((qs, qe, ks, ke, kind), (a, b, c, e), pieces)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("kind", cp.PLAN_KINDS)
def test_local_masks_match_dense(world, kind):
    for name, mask in test_masks().items():
        plan = cp.make_plan(mask, world, kind)
        dense = torch.zeros(plan.padded_len, plan.padded_len, dtype=torch.bool)
        dense[:S, :S] = mask.to_dense()
        assert all(len(c) == len(plan.chunks[0]) for c in plan.chunks)
        assert sorted(ch for c in plan.chunks for ch in c) == list(range(plan.num_chunks))
        for r in range(world):
            pr = plan.positions(r)
            for s in range(world):
                lm = plan.pair_mask((r,), (s,))
                want = dense[pr][:, plan.positions(s)]
                got = lm.to_dense() if lm is not None else torch.zeros_like(want)
                assert torch.equal(want, got), (name, kind, r, s)
        every = tuple(range(world))
        pa = np.concatenate([plan.positions(r) for r in every])
        assert torch.equal(plan.pair_mask(every, every).to_dense(), dense[pa][:, pa])


def test_dispatch_assemble_roundtrip():
    mask = make_mask("causal", S)
    x = torch.randn(2, S, 3, 4)
    for kind in cp.PLAN_KINDS:
        plan = cp.make_plan(mask, 3, kind)
        parts = [cp.dispatch(x, plan, r) for r in range(3)]
        assert all(p.shape == (2, plan.local_len, 3, 4) for p in parts)
        assert torch.equal(cp.assemble(parts, plan), x)
        for r, p in enumerate(parts):
            pad = plan.positions(r) >= S
            assert (p[:, torch.as_tensor(pad)] == 0).all()


def test_balanced_plan_balances_documents():
    for name in ("causal_document", "share_question", "causal"):
        mask = make_mask(name, 32768, seed=1)
        for world in (2, 4, 8):
            z = cp.make_plan(mask, world, "zigzag")
            b = cp.make_plan(mask, world, "balanced")
            assert b.local_len == z.local_len
            assert b.rank_areas().max() <= z.rank_areas().max() * 1.02, (name, world, b.describe(), z.describe())
            assert b.imbalance < 1.05


def test_plan_errors():
    with pytest.raises(ValueError, match="RangeMask"):
        cp.make_plan(make_mask("block_sparse", 256), 2)
    with pytest.raises(ValueError, match="Sq"):
        cp.make_plan(RangeMask(8, 12, [(0, 8, 0, 12, "full")]), 2)
    with pytest.raises(ValueError, match="plan kind"):
        cp.make_plan(make_mask("causal", 64), 2, "stripes")
    with pytest.raises(ValueError, match="divide"):
        cp.resolve_dims("ulysses", 3, 4)
    with pytest.raises(ValueError, match="window"):
        cp.resolve_dims("loongtrain", 4, 8, window=3)


def test_merge_keeps_empty_rows_clean():
    B, L, H, D = 1, 4, 2, 3
    out = torch.zeros(B, L, H, D, dtype=torch.float64)
    lse = torch.full((B, H, L), float("-inf"), dtype=torch.float64)
    o1 = torch.randn(B, L, H, D, dtype=torch.float64)
    l1 = torch.randn(B, H, L, dtype=torch.float64)
    o1[:, 0] = 0
    l1[:, :, 0] = float("-inf")  # row 0 attends nothing in this block
    cp.merge_(out, lse, torch.zeros_like(o1), torch.full_like(l1, float("-inf")))
    cp.merge_(out, lse, o1, l1)
    o2, l2 = torch.randn_like(o1), torch.randn_like(l1)
    o2[:, 0], l2[:, :, 0] = 0, float("-inf")
    cp.merge_(out, lse, o2, l2)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.isneginf(lse[:, :, 0]).all() and (out[:, 0] == 0).all()
    want_lse = torch.logaddexp(l1, l2)[:, :, 1:]
    assert torch.allclose(lse[:, :, 1:], want_lse)
    w1 = torch.exp(l1 - torch.logaddexp(l1, l2)).transpose(1, 2)[..., None]
    w2 = torch.exp(l2 - torch.logaddexp(l1, l2)).transpose(1, 2)[..., None]
    assert torch.allclose(out[:, 1:], (w1 * o1 + w2 * o2)[:, 1:])


def test_comm_model_formulas():
    kv = 2 * 1 * 4096 * 8 * 128 * 2  # L = 4096 tokens/rank, bf16
    rows = cp.model_snapshot(cp.comm_model("ring_p2p", 4, seqlen=16384, heads=(64, 8), head_dim=128, dtype_bytes=2))
    assert rows[("fwd", "p2p", "kv")] == (3, 3 * kv, 3 * kv)
    assert rows[("bwd", "p2p", "dkv")] == (3, 6 * kv, 6 * kv)  # float32 gradients
    rows = cp.model_snapshot(cp.comm_model("ulysses", 4, seqlen=16384, heads=(64, 8), head_dim=128, dtype_bytes=2))
    q = 4096 * 64 * 128 * 2
    assert rows[("fwd", "all_to_all", "q")][1] == 3 * q // 4
    assert rows[("fwd", "all_to_all", "k")][1] == 3 * (kv // 2) // 4
    rows = cp.model_snapshot(cp.comm_model("ulysses", 16, seqlen=65536, heads=(64, 8), head_dim=128))
    assert rows[("fwd", "all_to_all", "k")][1] == 15 * (4096 * 16 * 128 * 2) // 16  # KV heads replicated 8 -> 16
    rows = cp.model_snapshot(cp.comm_model("loongtrain", 8, window=4, seqlen=65536, heads=(64, 8)))
    assert rows[("fwd", "p2p_inner", "kv")][0] == 2 * 3 and rows[("fwd", "p2p_outer", "kv")][0] == 1


def test_comm_model_counts_k_and_v_at_their_own_head_dims():
    """K at D_qk, V (and out, dout, dv) at D_v: a 192/128 ring moves 320 columns per KV token."""
    L, b = 4096, 2
    rows = cp.model_snapshot(cp.comm_model("ring_p2p", 4, seqlen=16384, heads=(64, 8), head_dim=192, head_dim_v=128))
    assert rows[("fwd", "p2p", "kv")] == (3, 3 * L * 8 * (192 + 128) * b, 3 * L * 8 * (192 + 128) * b)
    rows = cp.model_snapshot(cp.comm_model("ulysses", 4, seqlen=16384, heads=(64, 8), head_dim=192, head_dim_v=128))
    assert rows[("fwd", "all_to_all", "k")][1] == 3 * (L * 8 * 192 * b) // 4
    assert rows[("fwd", "all_to_all", "v")][1] == 3 * (L * 8 * 128 * b) // 4
    assert rows[("fwd", "all_to_all", "out")][1] == 3 * (L * 64 * 128 * b) // 4
    assert rows[("bwd", "all_to_all", "dq")][1] == 3 * (L * 64 * 192 * b) // 4
    same = cp.model_snapshot(cp.comm_model("ring_allgather", 4, seqlen=16384, head_dim=128, head_dim_v=128))
    assert same == cp.model_snapshot(cp.comm_model("ring_allgather", 4, seqlen=16384, head_dim=128))


def test_comm_cli():
    from click.testing import CliRunner

    from longca_triton.cp.cli import comm_command

    r = CliRunner().invoke(comm_command, ["--scheme", "usp", "--world", "8", "--ulysses", "2", "--seqlen", "65536",
                                          "--heads", "64:8", "--head-dim", "128", "--mask", "causal"])
    assert r.exit_code == 0, r.output
    assert "all_to_all" in r.output and "p2p" in r.output
    r = CliRunner().invoke(comm_command, ["--scheme", "ulysses", "--world", "3", "--heads", "64:8"])
    assert r.exit_code != 0 and "divide" in r.output
    r = CliRunner().invoke(comm_command, ["--scheme", "ring_p2p", "--world", "2", "--head-dim", "192/128", "--format", "csv"])
    assert r.exit_code == 0 and "D=192/128" not in r.output and ",p2p,kv," in r.output, r.output


# ------------------------------------------------------------------------------ distributed
HEADS = {2: (4, 2), 3: (6, 2), 4: (4, 2), 8: (8, 2)}  # world 3: 6:2 so Ulysses runs (KV replicated 2 -> 6)


def scheme_configs(world: int):
    """(scheme, ulysses_degree, window) per world size; 2-D meshes where the size allows."""
    cfgs = [("ring_p2p", None, None), ("ring_allgather", None, None), ("ulysses", None, None),
            ("usp", None, None), ("loongtrain", None, None)]
    if world == 2:
        cfgs.append(("usp", 2, None))  # pure Ulysses through the USP path
    if world == 4:  # defaults give usp 2x2 and loongtrain 2 windows x 2
        cfgs.append(("loongtrain", 2, 1))  # Ulysses 2 x outer ring 2
    return cfgs


def _cases_worker(rank, world, outdir):
    from longca_triton.cp.check import Case, make_problem, run_case

    torch.manual_seed(0)
    results = []
    heads = HEADS[world]
    for mname, mask in test_masks().items():
        prob = make_problem(mask, 2, heads, 16, torch.float64, "cpu", seed=world)
        for kind in cp.PLAN_KINDS:
            plan = cp.make_plan(mask, world, kind)
            for scheme, U, W in scheme_configs(world):
                case = Case(scheme, plan, "reference", U, W, count_bytes=(mname == "random"),
                            label=f"{mname}/{kind}/{scheme}/U={U}/W={W}")
                results.append(run_case(case, prob))
            if mname == "random" and kind == "zigzag":  # the generic recompute-under-autograd path
                for scheme, U, W in (("ring_p2p", None, None), ("usp", None, None), ("ring_allgather", None, None)):
                    case = Case(scheme, plan, cp.AutogradStep("reference"), U, W, label=f"{mname}/{kind}/{scheme}/autograd")
                    results.append(run_case(case, prob))
    if world == 4:  # CP over subgroups: ranks {0, 1} and {2, 3} run independent 2-rank problems
        import torch.distributed as dist

        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        sub = groups[rank // 2]
        mask = test_masks()["random"]
        prob = make_problem(mask, 1, (4, 2), 16, torch.float64, "cpu", seed=11)
        plan = cp.make_plan(mask, 2, "zigzag")
        for scheme, U in (("ring_p2p", None), ("usp", 2), ("loongtrain", None)):
            results.append(run_case(Case(scheme, plan, "reference", U, label=f"subgroup/{scheme}"), prob, group=sub))
    # undispatch returns the global tensor on every rank
    mask = test_masks()["share_question"]
    plan = cp.make_plan(mask, world, "balanced")
    prob = make_problem(mask, 1, heads, 16, torch.float64, "cpu", seed=7)
    out_l = cp.attention(cp.dispatch(prob.q, plan, rank), cp.dispatch(prob.k, plan, rank), cp.dispatch(prob.v, plan, rank),
                         plan, "ring_p2p", backend="reference")
    full = cp.undispatch(out_l, plan)
    results.append({"label": "undispatch", "ok": bool(torch.allclose(full, prob.ref["out"], atol=1e-10))})
    # a clear error when the heads do not divide over Ulysses
    try:
        q = torch.zeros(1, plan.local_len, 4, 16, dtype=torch.float64)
        k = torch.zeros(1, plan.local_len, 2, 16, dtype=torch.float64)
        cp.attention(q, k, k, plan, "ulysses", backend="reference")
        results.append({"label": "heads error", "ok": world in (2, 4)})
    except ValueError as e:  # 4 query heads over 3 or 8 Ulysses ranks
        results.append({"label": "heads error", "ok": world in (3, 8) and "divide" in str(e)})
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


# world 8 (eight processes, ~30 s) is opt-in: on CI's two cores it overlaps the torchrun tests
WORLDS = [2, 3, 4] + ([8] if os.environ.get("LONGCA_CP_WORLD8") == "1" else [])


@pytest.mark.parametrize("world", WORLDS)
def test_cp_schemes_match_reference(world, spawn_ranks):
    res = spawn_ranks(_cases_worker, world)
    failures, n = [r for r in res if not r["ok"]], len(res)
    expected = len(test_masks()) * len(cp.PLAN_KINDS) * len(scheme_configs(world)) + 3 + 2 + (3 if world == 4 else 0)
    assert n == world * expected
    assert not failures, f"{len(failures)} of {n} rank-cases failed, first: {failures[:3]}"


def _triton_worker(rank, world, outdir):
    """Our Triton kernel as the step kernel (interpreter on CPU; conftest sets TRITON_INTERPRET)."""
    from longca_triton.cp import merge
    from longca_triton.cp.check import Case, make_problem, run_case

    merge.FUSED_MERGE = True  # the CUDA path: Triton merges (interpreted here)
    results = []
    for mname, mask in (("causal_document", make_mask("causal_document", 128, doc_lens=[40, 30, 58])),
                        ("random", random_range_mask(128, seed=4))):
        prob = make_problem(mask, 1, (6, 2), 16, torch.float32, "cpu", seed=1)
        for scheme, kind in (("ring_p2p", "zigzag"), ("usp", "balanced"), ("ring_allgather", "contiguous"), ("ulysses", "zigzag")):
            results.append(run_case(Case(scheme, cp.make_plan(mask, world, kind), "triton", label=f"{mname}/{scheme}/{kind}"),
                                    prob, tol=1e-4))
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def test_cp_with_triton_kernel(triton_runs, spawn_ranks):
    res = spawn_ranks(_triton_worker, 3)  # 3 ranks: merges of 3 partials (float32 accumulator, then q's dtype)
    assert len(res) == 24 and all(r["ok"] for r in res), [r for r in res if not r["ok"]][:2]


def _head_dims_worker(rank, world, outdir):
    """v with its own head dim (D_qk 48, D_v 32): every scheme on the reference step, bytes against
    the model, and our Triton step (interpreter) on the ring and all-gather paths."""
    from longca_triton.cp import merge
    from longca_triton.cp.check import Case, make_problem, run_case

    results = []
    mask = make_mask("causal_document", 96, doc_lens=[30, 41, 25])
    prob = make_problem(mask, 1, (4, 2), 48, torch.float64, "cpu", seed=5, head_dim_v=32)
    for scheme, kind in (("ring_p2p", "zigzag"), ("ring_allgather", "balanced"), ("ulysses", "contiguous"),
                         ("usp", "zigzag"), ("loongtrain", "balanced")):
        case = Case(scheme, cp.make_plan(mask, world, kind), "reference", count_bytes=True, label=f"ref/{scheme}/{kind}")
        results.append(run_case(case, prob))
    for joint in (True, False):  # group_cast's rows carry K and V side by side on the last dim
        case = Case("group_cast", cp.make_plan(mask, world, "balanced"), "reference", count_bytes=True, joint=joint,
                    label=f"ref/group_cast/{'joint' if joint else 'split'}")
        results.append(run_case(case, prob))
    prob = make_problem(mask, 1, (4, 2), 48, torch.float32, "cpu", seed=5, head_dim_v=32)
    merge.FUSED_MERGE = True  # the CUDA path: Triton merges of D_v-wide partials (interpreted here)
    for scheme in ("ring_p2p", "ring_allgather"):
        results.append(run_case(Case(scheme, cp.make_plan(mask, world, "zigzag"), "triton", label=f"triton/{scheme}"),
                                prob, tol=1e-4))
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def test_cp_value_head_dim_of_its_own(triton_runs, spawn_ranks):
    res = spawn_ranks(_head_dims_worker, 2)
    assert len(res) == 2 * 9 and all(r["ok"] for r in res), [r for r in res if not r["ok"]][:2]
    assert all(r["bytes_ok"] for r in res if r["label"].startswith("ref/"))


def test_bench_cp_smoke(tmp_path):
    """`bench cp` end to end on the CPU: torchrun, 2 gloo ranks, rows in the results store."""
    from longca_triton.cp.bench import launch

    rc = launch("smoke", {"masks": "causal_document", "schemes": "ring_p2p,ulysses,loongtrain", "plans": "zigzag,balanced",
                          "modes": "fwd_bwd"}, str(tmp_path), peer=False)
    assert rc == 0
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    cp_rows = [r for r in rows if r["scheme"] != "single"]
    assert len(cp_rows) == 3 * 2 and all(r["status"] == "ok" for r in rows), rows
    for r in cp_rows:
        assert r["world_size"] == 2 and r["median_ms"] > 0 and r["efficiency"] > 0 and r["tflops_per_gpu"] > 0
    # resuming does not redo finished points
    assert launch("smoke", {"masks": "causal_document", "schemes": "ring_p2p", "plans": "zigzag", "modes": "fwd_bwd"},
                  str(tmp_path), peer=False) == 0
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == len(rows)
    # ... but a point whose row only said this machine lacked something is retried (as in `bench dense`)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    i = next(n for n, x in enumerate(lines) if (json.loads(x)["scheme"], json.loads(x)["plan"]) == ("ring_p2p", "zigzag"))
    lines[i] = json.dumps(dict(json.loads(lines[i]), status="unsupported: not installed", unavailable=True))
    (tmp_path / "results.jsonl").write_text("\n".join(lines) + "\n")
    assert launch("smoke", {"masks": "causal_document", "schemes": "ring_p2p", "plans": "zigzag", "modes": "fwd_bwd"},
                  str(tmp_path), peer=False) == 0
    after = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(after) == len(rows) + 1 and after[-1]["scheme"] == "ring_p2p" and after[-1]["status"] == "ok"


def test_fused_merge_matches_torch_merge(triton_runs):
    from longca_triton.cp.merge import merge_into

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    B, L, H, D = 2, 70, 3, 24
    o1, o2 = (torch.randn(B, L, H, D, generator=g) for _ in range(2))
    l1, l2 = (torch.randn(B, H, L, generator=g) for _ in range(2))
    l1[:, :, 0] = l2[:, :, 0] = l2[:, :, 1] = float("-inf")  # row 0 empty in both, row 1 in one
    o1[:, 0] = o2[:, 0] = o2[:, 1] = 0
    ref_o, ref_l = o1.clone(), l1.clone()
    cp.merge_(ref_o, ref_l, o2, l2)
    a, al = o1.clone().to(dev), l1.clone().to(dev)
    with np.errstate(all="ignore"):
        merge_into(a, al, o2.to(dev), l2.to(dev), a, al)  # in place, float32
    a, al = a.cpu(), al.cpu()
    fin = torch.isfinite(ref_l)
    assert torch.equal(torch.isneginf(al), torch.isneginf(ref_l)) and not torch.isnan(a).any()
    assert torch.allclose(a, ref_o, atol=1e-5) and torch.allclose(al[fin], ref_l[fin], atol=1e-5)
    dst = torch.empty(B, L, H, D, dtype=torch.bfloat16, device=dev)
    dl = torch.empty(B, H, L, device=dev)
    with np.errstate(all="ignore"):
        merge_into(o1.bfloat16().to(dev), l1.to(dev), o2.bfloat16().to(dev), l2.to(dev), dst, dl)  # into a new bf16 buffer
    assert torch.allclose(dst.float().cpu(), ref_o, atol=5e-2)

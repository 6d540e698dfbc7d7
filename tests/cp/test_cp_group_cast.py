"""The group_cast CP scheme on CPU: the need layout exactly, its bytes against
ring_allgather's, the locality-aware balanced plan, and the scheme itself on 2, 3 and 4 gloo
processes against the single-process reference (float64; one case through the Triton kernel)."""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest
import torch
from test_cp import S, random_range_mask, test_masks

from longca_triton import cp
from longca_triton.cp.need import need_layout
from longca_triton.masks import MASK_SPECS, RangeMask, make_mask


def doc_prefix_mask(S: int, doc_lens, prefix: int) -> RangeMask:
    """Causal documents plus a global prefix every query attends (a long-context training layout)."""
    bounds = np.concatenate([[0], np.cumsum(doc_lens)])
    slices = [(int(a), int(b), int(a), int(b), "causal") for a, b in itertools.pairwise(bounds)]
    slices.append((prefix, S, 0, prefix, "full"))
    return RangeMask(S, S, slices, name="doc_prefix")


def sparse_need_mask(S: int, world: int) -> RangeMask:
    """Contiguous plan: each rank's keys are private, except the last rank's queries also read rank
    0's first keys. Ranks 1..N-2 need nothing and own nothing anyone needs; rank 0 needs nothing."""
    c = -(-S // world)
    slices = [(r * c, min(S, (r + 1) * c), r * c, min(S, (r + 1) * c), "causal") for r in range(world)]
    slices.append(((world - 1) * c, S, 0, 5, "full"))
    return RangeMask(S, S, slices, name="sparse_need")


def training_doc_lens(S: int, seed: int) -> list[int]:
    """Documents of 500-6000 tokens (a long-context training layout)."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while sum(out) < S:
        out.append(int(rng.integers(500, 6001)))
    out[-1] -= sum(out) - S
    return [x for x in out if x > 0]


def _bytes(rows, phase=None):
    return sum(r.bytes_sent + r.bytes_received for r in rows if phase is None or r.phase == phase)


# ------------------------------------------------------------------------------ single process
@pytest.mark.parametrize("world", [2, 3, 4])
def test_need_layout_exact(world):
    masks = {**test_masks(), "doc_prefix": doc_prefix_mask(S, [40, 23, 60, 28], 7), "sparse_need": sparse_need_mask(S, world)}
    for name, mask in masks.items():
        for kind in cp.PLAN_KINDS:
            plan = cp.make_plan(mask, world, kind)
            lay = need_layout(plan)
            dense = torch.zeros(plan.padded_len, plan.padded_len, dtype=torch.bool)
            dense[:S, :S] = mask.to_dense()
            for r in range(world):
                pr = plan.positions(r)
                for s in range(world):
                    ps = plan.positions(s)
                    want = dense[pr][:, ps].any(0).numpy() if s != r else np.zeros(len(ps), bool)
                    got = np.zeros(len(ps), bool)
                    for g0, g1, l0 in lay.pieces[r][s]:
                        assert not got[l0:l0 + g1 - g0].any()
                        got[l0:l0 + g1 - g0] = True
                        assert (ps[l0:l0 + g1 - g0] == np.arange(g0, g1)).all()  # local -> global
                    assert (want == got).all(), (name, kind, r, s)
                    assert lay.counts[r, s] == want.sum()
                rm = lay.remote_mask(r)
                segs = lay.recv_segments(r)
                gk = np.concatenate([np.arange(a, b) for a, b, _ in segs]) if segs else np.zeros(0, np.int64)
                want = dense[pr][:, gk]
                assert torch.equal(rm.to_dense() if rm is not None else torch.zeros_like(want), want), (name, kind, r)
                # the joint mode's one call: own and received keys interleaved in global order
                pieces = lay.joint_pieces(r)
                assert [p[0] for p in pieces] == [0] + [p[1] for p in pieces[:-1]]
                jk = np.concatenate([(pr, gk)[src][a:a + j1 - j0] for j0, j1, src, a in pieces])
                assert sorted(jk.tolist()) == jk.tolist() and len(jk) == len(pr) + len(gk)
                jm = lay.joint_mask(r)
                want = dense[pr][:, jk]
                assert torch.equal(jm.to_dense() if jm is not None else torch.zeros_like(want), want), (name, kind, r)
            for s in range(world):
                idx = lay.send_index(s)
                assert len(idx) == sum(lay.send_splits(s)) and (idx < plan.local_len).all()
                runs = lay.send_ranges(s)  # the same positions as runs of consecutive keys
                flat = np.concatenate([np.arange(a, b) for a, b in runs]) if runs else np.zeros(0, np.int64)
                assert np.array_equal(flat, idx) and all(b1 != a2 for (_, b1), (a2, _) in zip(runs, runs[1:]))


def test_sparse_need_layout_has_idle_ranks():
    for world in (3, 4):
        lay = need_layout(cp.make_plan(sparse_need_mask(S, world), world, "contiguous"))
        recv, sent = lay.counts.sum(1), lay.counts.sum(0)
        assert recv[:-1].sum() == 0 and recv[-1] == 5 and sent[0] == 5 and sent[1:].sum() == 0
    # documents aligned to the contiguous shards: no rank needs anything remote, no collective
    c = -(-S // 3)
    lay = need_layout(cp.make_plan(make_mask("causal_document", S, doc_lens=[c, c, S - 2 * c]), 3, "contiguous"))
    assert not lay.any_traffic and cp.comm_model("group_cast", 3, seqlen=S, heads=(4, 2), head_dim=16,
                                                 mask=lay.plan.mask, plan=lay.plan) == []


@pytest.mark.parametrize("world", [2, 3, 4])
def test_group_cast_bytes_never_exceed_allgather(world):
    """Every static mask, every plan, every rank: fwd and bwd bytes <= ring_allgather's; dense masks
    whose length divides move exactly ring_allgather's bytes."""
    S_ = 960
    for name, spec in MASK_SPECS.items():
        if spec.kind != "static":
            continue
        mask = make_mask(name, S_, seed=1, **({"block": 64} if name == "block_causal_document" else {}))
        for kind in cp.PLAN_KINDS:
            plan = cp.make_plan(mask, world, kind)
            ag = cp.model_snapshot(cp.comm_model("ring_allgather", world, seqlen=S_, heads=(8, 2), head_dim=16, mask=mask, plan=plan))
            for rank in range(world):
                gc = cp.model_snapshot(cp.comm_model("group_cast", world, seqlen=S_, heads=(8, 2), head_dim=16, mask=mask,
                                                     plan=plan, rank=rank))
                for phase, ag_key in (("fwd", ("fwd", "all_gather", "kv")), ("bwd", ("bwd", "reduce_scatter", "dkv"))):
                    key = (phase, "all_to_all_v", "kv" if phase == "fwd" else "dkv")
                    _, s, r = gc.get(key, (0, 0, 0))
                    assert s <= ag[ag_key][1] and r <= ag[ag_key][2], (name, kind, rank, phase, gc, ag)
                    if name == "full":
                        assert (s, r) == ag[ag_key][1:], (kind, rank, phase)


def test_group_cast_bytes_at_scale():
    """S = 65536, 8 ranks, closed form (no kernels): documents of 500-6000 tokens move <= 30% of
    ring_allgather's bytes on the busiest device; causal moves less than allgather (the causal
    half never needs the future)."""
    S_, N = 65536, 8
    kw = {"seqlen": S_, "heads": (64, 8), "head_dim": 128, "dtype_bytes": 2}
    ag = _bytes(cp.comm_model("ring_allgather", N, mask=make_mask("causal", S_), plan="balanced", **kw))
    for name in ("causal_document", "share_question"):
        m = make_mask(name, S_, doc_lens=training_doc_lens(S_, 1))
        gc = _bytes(cp.comm_model("group_cast", N, mask=m, plan="balanced", **kw))  # busiest rank
        assert gc <= 0.30 * ag, (name, gc / ag)
    m = doc_prefix_mask(S_, training_doc_lens(S_ - 128, 2), 128)
    assert _bytes(cp.comm_model("group_cast", N, mask=m, plan="balanced", **kw)) <= 0.30 * ag
    gc = _bytes(cp.comm_model("group_cast", N, mask=make_mask("causal", S_), plan="zigzag", **kw))
    assert gc < ag


def test_balanced_plan_keeps_documents_whole():
    # six documents with a whole-document split of equal area exists: locality finds it, area-only need not
    m = make_mask("full_document", 4096, doc_lens=[1024, 512, 512, 1024, 512, 512])
    plan = cp.make_plan(m, 2, "balanced")
    assert plan.locality and plan.imbalance == 1.0
    assert not need_layout(plan).any_traffic, plan.chunks
    # documents: fewer remote keys than the area-only plan, area within the stated tolerance
    for name in ("causal_document", "full_document", "share_question", "block_causal_document"):
        for S_, N in ((16384, 2), (32768, 4)):
            m = make_mask(name, S_, seed=0) if name == "block_causal_document" else make_mask(name, S_, doc_lens=training_doc_lens(S_, 3))
            loc = cp.make_plan(m, N, "balanced")
            area = cp.make_plan(m, N, "balanced", locality=False)
            got, base = need_layout(loc).counts.sum(), need_layout(area).counts.sum()
            assert got <= base, (name, N, got, base)
            assert loc.rank_areas().max() <= max(area.rank_areas().max(), loc.rank_areas().mean() * (1 + cp.plan.BALANCE_TOL))
    m = make_mask("causal_document", 32768, doc_lens=training_doc_lens(32768, 3))
    assert need_layout(cp.make_plan(m, 4, "balanced")).counts.sum() < 0.7 * need_layout(
        cp.make_plan(m, 4, "balanced", locality=False)).counts.sum()
    with pytest.raises(ValueError, match="balance_tol"):
        cp.make_plan(m, 4, "balanced", balance_tol=-1)


@pytest.mark.parametrize("name", ["causal_document", "share_question", "full_document"])
def test_two_rank_balanced_plan_is_the_exact_optimum(name):
    """On two ranks the balanced plan tries every split of its chunks: of all splits within the area
    budget, none moves fewer keys in its busier direction (then in all), checked by brute force
    against the exact need layout."""
    from longca_triton.cp import plan as P

    S_ = 4096
    m = make_mask(name, S_, doc_lens=training_doc_lens(S_, 5) if name != "full_document" else [300, 2500, 700, 596])
    plan = cp.make_plan(m, 2, "balanced")
    C, per = plan.num_chunks, len(plan.chunks[0])
    areas = P._chunk_areas(m, plan.chunk_size, C)
    base = P._balance(areas, 2, per)
    budget = max(max(int(areas[b].sum()) for b in base), int(np.floor(areas.sum() / 2 * (1 + P.BALANCE_TOL))))

    def key(chunks0):
        p = P.CPPlan(m, 2, "balanced", plan.chunk_size, (tuple(chunks0), tuple(c for c in range(C) if c not in chunks0)))
        counts = need_layout(p).counts
        return int(counts.sum(1).max()), int(counts.sum())
    best = min(key(c) for c in itertools.combinations(range(C), per)
               if 0 in c and max(areas[list(c)].sum(), areas.sum() - areas[list(c)].sum()) <= budget)
    assert key(plan.chunks[0] if 0 in plan.chunks[0] else plan.chunks[1]) == best


def test_joint_applies_to_group_cast_only():
    plan = cp.make_plan(make_mask("causal", 64), 1)
    q = torch.zeros(1, 64, 2, 16)
    with pytest.raises(ValueError, match="joint applies to the group_cast scheme only"):
        cp.attention(q, q[:, :, :1], q[:, :, :1], plan, "ring_p2p", joint=False)


def test_after_dkdv_runs_before_dq(monkeypatch):
    """The backward's hook (where group_cast posts the dK/dV transfer) fires after the dK/dV launch
    and before the dQ launch, with the finished dK/dV, in the dtype asked for."""
    from longca_triton.kernels.dense import op as dense

    calls = []
    real_dkdv, real_dq = dense.launch_bwd_dkdv, dense.launch_bwd_dq
    monkeypatch.setattr(dense, "launch_bwd_dkdv", lambda *a, **k: (calls.append("dkdv"), real_dkdv(*a, **k))[1])
    monkeypatch.setattr(dense, "launch_bwd_dq", lambda *a, **k: (calls.append("dq"), real_dq(*a, **k))[1])
    mask = make_mask("causal_document", 96, seed=1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 96, h, 16, generator=g) for h in (4, 2, 2))
    step = cp.TritonStep(config={"BLOCK_M": 32, "BLOCK_N": 32, "DKDV_BLOCK_M": 32, "DKDV_BLOCK_N": 32,
                                 "DQ_BLOCK_M": 32, "DQ_BLOCK_N": 32})
    out, lse = step.forward(q, k, v, mask, 0.25, partial=False)
    assert out.dtype == q.dtype
    seen = {}

    def hook(dk, dv):
        calls.append("hook")
        seen["dk"], seen["dv"] = dk.clone(), dv.clone()
    dq, dk, dv = step.backward(torch.ones_like(out), q, k, v, out, lse, mask, 0.25, partial=False, after_dkdv=hook)
    assert calls == ["dkdv", "hook", "dq"]
    assert torch.equal(seen["dk"], dk) and torch.equal(seen["dv"], dv) and dq.dtype == q.dtype


def test_group_cast_errors_and_cli():
    from click.testing import CliRunner

    from longca_triton.cp.cli import comm_command

    with pytest.raises(ValueError, match="mask"):
        cp.comm_model("group_cast", 4, seqlen=4096)
    plan = cp.make_plan(make_mask("causal", 64), 2)
    with pytest.raises(ValueError, match="rank"):
        cp.comm_model("group_cast", 2, mask=plan.mask, plan=plan, rank=2)
    with pytest.raises(ValueError, match="plan is for"):
        cp.comm_model("group_cast", 4, mask=plan.mask, plan=plan)
    r = CliRunner().invoke(comm_command, ["--scheme", "group_cast", "--world", "4", "--seqlen", "16384", "--heads", "8:2",
                                          "--mask", "causal_document", "--plan", "balanced"])
    assert r.exit_code == 0, r.output
    assert "all_to_all_v" in r.output and "ring_allgather" in r.output
    r = CliRunner().invoke(comm_command, ["--scheme", "group_cast", "--world", "4", "--seqlen", "4096"])
    assert r.exit_code != 0 and "mask" in r.output


# ------------------------------------------------------------------------------ distributed
HEADS = {2: (4, 2), 3: (6, 2), 4: (4, 2)}


def _worker(rank, world, outdir):
    from longca_triton.cp.check import Case, make_problem, run_case

    results = []
    masks = {**test_masks(), "doc_prefix": doc_prefix_mask(S, [40, 23, 60, 28], 7), "sparse_need": sparse_need_mask(S, world),
             "random2": random_range_mask(S, seed=world + 10, n=4)}
    for mname, mask in masks.items():
        prob = make_problem(mask, 2, HEADS[world], 16, torch.float64, "cpu", seed=world)
        for kind in cp.PLAN_KINDS:
            plan = cp.make_plan(mask, world, kind)
            for joint in (True, False):  # one call over own + received keys / local call + remote call + merge
                results.append(run_case(Case("group_cast", plan, "reference", count_bytes=True, joint=joint,
                                             label=f"{mname}/{kind}/{'joint' if joint else 'split'}"), prob))
        if mname == "random":  # the generic recompute-under-autograd step kernel, and the area-only balanced plan
            plan = cp.make_plan(mask, world, "balanced", locality=False)
            results.append(run_case(Case("group_cast", plan, cp.AutogradStep("reference"), count_bytes=True,
                                         label=f"{mname}/balanced-area/autograd"), prob))
    if world == 4:  # over subgroups: ranks {0, 1} and {2, 3} run independent 2-rank problems
        import torch.distributed as dist

        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mask = masks["doc_prefix"]
        prob = make_problem(mask, 1, (4, 2), 16, torch.float64, "cpu", seed=11)
        for kind in ("zigzag", "balanced"):
            results.append(run_case(Case("group_cast", cp.make_plan(mask, 2, kind), "reference", count_bytes=True,
                                         label=f"subgroup/{kind}"), prob, group=groups[rank // 2]))
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_group_cast_matches_reference(world, spawn_ranks):
    res = spawn_ranks(_worker, world)
    assert len(res) == world * (2 * 9 * len(cp.PLAN_KINDS) + 1 + (2 if world == 4 else 0))
    bad = [r for r in res if not r["ok"]]
    assert not bad, f"{len(bad)} of {len(res)} rank-cases failed, first: {bad[:2]}"
    assert all(r.get("bytes_ok") for r in res)


def _triton_worker(rank, world, outdir):
    from longca_triton.cp import merge
    from longca_triton.cp.check import Case, make_problem, run_case

    merge.FUSED_MERGE = True  # the CUDA path's fused merge, interpreted
    mask = doc_prefix_mask(128, [40, 30, 58], 6)
    prob = make_problem(mask, 1, (4, 2), 16, torch.float32, "cpu", seed=1)
    res = [run_case(Case("group_cast", cp.make_plan(mask, world, kind), "triton", count_bytes=True, joint=joint,
                         label=f"{kind}/{'joint' if joint else 'split'}"), prob, tol=1e-4)
           for kind in ("zigzag", "balanced") for joint in (True, False)]
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def test_group_cast_with_triton_kernel(triton_runs, spawn_ranks):
    res = spawn_ranks(_triton_worker, 2)
    assert len(res) == 8 and all(r["ok"] for r in res), [r for r in res if not r["ok"]][:2]


def test_bench_report_group_cast_checks(tmp_path):
    """The report's group_cast checks read the rows: efficiency on the document masks, against the
    best other scheme on full / causal, and the counted bytes against ring_allgather's."""
    from longca_triton.cp.bench_report import write_report

    def row(mask, scheme, plan, eff, total=None):
        return {"kind": "cp", "backend": "triton", "mask": mask, "seqlen": 16384, "mode": "fwd_bwd", "world_size": 2,
                "scheme": scheme, "plan": plan, "ulysses_degree": None, "efficiency": eff, "median_ms": 1.0,
                "tflops_per_gpu": 1.0, "status": "ok", "comm_bytes_total": total, "comm_bytes_max": total}

    rows = [row("causal_document", "group_cast", "balanced", 0.9, 250), row("causal_document", "ring_allgather", "balanced", 0.8, 1000),
            row("full_document", "group_cast", "balanced", 0.8), row("full", "group_cast", "zigzag", 0.92),
            row("full", "ring_allgather", "zigzag", 0.93), row("causal", "group_cast", "zigzag", 0.97),
            row("causal", "ring_p2p", "zigzag", 0.95)]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    text = write_report(tmp_path)
    lines = {ln.split(" | ")[0].lstrip("| "): ln for ln in text.splitlines() if ln.startswith(("| group_cast", "| causal_document bytes"))}
    assert lines["group_cast efficiency >= 0.85 on causal_document (balanced)"].endswith("| yes |")
    assert lines["group_cast efficiency >= 0.85 on full_document (balanced)"].endswith("| NO |")
    assert "ring_allgather/zigzag 0.930" in lines["group_cast >= best other scheme on full"] and lines[
        "group_cast >= best other scheme on full"].endswith("| NO |")
    assert lines["group_cast >= best other scheme on causal"].endswith("| yes |")
    assert "25.0%" in lines["causal_document bytes moved (all ranks, counted) <= 30% of ring_allgather's (balanced)"]

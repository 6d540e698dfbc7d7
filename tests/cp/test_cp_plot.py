"""CP plots from a results file: efficiency bars per world size, scaling against N with the comm model."""

from longca_triton.bench.plot import make_plots, register_plotter
from longca_triton.cp.plot import latest_cp_rows, make_cp_plots

register_plotter("cp", make_cp_plots)  # as longca_triton.cli does


def _row(mask, scheme, plan, N, ms, mode="fwd", status="ok", backend="triton"):
    return {"kind": "cp", "backend": backend, "mask": mask, "seqlen": 1024 * N, "tokens_per_gpu": 1024,
            "mode": mode, "world_size": N, "scheme": scheme, "plan": plan, "ulysses_degree": None,
            "heads_q": 8, "heads_kv": 2, "head_dim": 64, "dtype": "bfloat16", "status": status,
            "median_ms": ms, "tflops_per_gpu": 100.0 / ms if status == "ok" else None,
            "efficiency": 1.0 / ms if status == "ok" else None, "gpu": "test"}


def test_cp_plots_bars_and_scaling(tmp_path):
    rows = [_row("causal", "single", "none", 1, 1.0)]
    for N in (2, 4):
        for scheme in ("ulysses", "ring_p2p", "usp", "loongtrain", "group_cast"):
            for plan in ("contiguous", "zigzag", "balanced"):
                rows.append(_row("causal", scheme, plan, N, 1.1 + 0.1 * N))
        rows.append(_row("causal", "usp", "contiguous", N, 0, backend="yunchang-usp[sdpa-flash,U=1]",
                         status="unsupported: no backward"))
    # a rerun supersedes the earlier row of the same point
    rows.append(_row("causal", "ring_p2p", "zigzag", 2, 1.05))
    latest = latest_cp_rows(rows + [{"kind": "dense", "mask": "causal"}])
    assert len(latest) == len(rows) - 1
    assert [r["median_ms"] for r in latest if r["scheme"] == "ring_p2p" and r["plan"] == "zigzag" and r["world_size"] == 2] == [1.05]
    files = make_plots(rows, tmp_path)
    names = sorted(f.name for f in files)
    assert names == ["cp_efficiency_fwd_N2.png", "cp_efficiency_fwd_N4.png", "cp_scaling_fwd.png"]
    assert all(f.stat().st_size > 10_000 for f in files)


def test_group_cast_scaling_uses_the_rows_mask(tmp_path, monkeypatch):
    """The scaling plot's comm panel models group_cast from the row's own mask (rebuilt from its
    recorded parameters), so the document bounds the benchmark drew are the ones counted."""
    from longca_triton.bench.store import jsonable
    from longca_triton.cp import plot
    from longca_triton.masks import make_mask

    seen = []
    real = plot._row_mask

    def spy(r):
        m = real(r)
        seen.append((r["seqlen"], m))
        return m

    monkeypatch.setattr(plot, "_row_mask", spy)
    rows = []
    for N in (2, 4):
        want = make_mask("causal_document", 1024 * N, seed=3)
        for scheme in ("ring_allgather", "group_cast"):
            r = _row("causal_document", scheme, "balanced", N, 1.0)
            r["mask_params"] = jsonable(want.params)
            rows.append(r)
    files = make_cp_plots(rows, tmp_path)
    assert any(f.name == "cp_scaling_fwd.png" for f in files)
    assert sorted(S for S, _ in seen) == [2048, 4096]
    for S, m in seen:
        assert m.slices == make_mask("causal_document", S, seed=3).slices


def test_scaling_models_a_scheme_where_it_was_not_run(tmp_path):
    """group_cast measured at N = 2 only, ring_allgather at 2 and 4: the comm panel still shows
    group_cast's modelled bytes at N = 4 (hollow), from ring_allgather's row of that mask and N, and
    they are at most an all-gather's."""
    from longca_triton.bench.store import jsonable
    from longca_triton.cp import plot
    from longca_triton.masks import make_mask

    rows = []
    for N in (2, 4):
        for scheme in ("ring_allgather", "group_cast") if N == 2 else ("ring_allgather",):
            r = _row("causal_document", scheme, "balanced", N, 1.0, mode="fwd_bwd")
            r["mask_params"] = jsonable(make_mask("causal_document", 1024 * N, seed=3).params)
            rows.append(r)
    gaps = plot._unmeasured(rows, "group_cast", [2, 4])
    assert [(N, ref["scheme"]) for N, ref in gaps] == [(4, "ring_allgather")]
    assert plot._unmeasured(rows, "ulysses", [2, 4]) == []  # never measured: no line to extend
    gc = plot._model_mib("group_cast", 4, gaps[0][1], "fwd_bwd", "balanced", None)
    ag = plot._model_mib("ring_allgather", 4, gaps[0][1], "fwd_bwd", "balanced", None)
    assert gc is not None and 0 < gc <= ag
    files = make_cp_plots(rows, tmp_path)
    assert any(f.name == "cp_scaling_fwd_bwd.png" for f in files)

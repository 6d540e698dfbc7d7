"""The full-breadth study's grids: per-backend length limits in the experiment schema
(`[backend_max_seqlen]`), and dense.toml planning >= 7 lengths for every backend and 128K for ours,
flex, flex-fa4, cudnn and fa4."""

from __future__ import annotations

from pathlib import Path

import pytest

from longca_triton.adapters import list_backends
from longca_triton.bench.config import ConfigError, Experiment, load_experiment
from longca_triton.bench.runner import plan_points
from longca_triton.masks import STATIC_MASK_NAMES

REPO = Path(__file__).resolve().parents[2]
KNOWN = {b.name for b in list_backends()}


def _planned(exp) -> dict:
    """backend -> set of lengths it has points at."""
    out: dict = {}
    for _, pts in plan_points(exp):
        for p in pts:
            out.setdefault(p.backend, set()).add(p.seqlen)
    return out


def test_backend_max_seqlen_leaves_points_out(tmp_path):
    cfg = tmp_path / "e.toml"
    cfg.write_text('[grid]\nmasks = ["causal"]\nseqlens = ["1K", "4K", "16K"]\nmodes = ["fwd"]\n'
                   'backends = ["triton", "reference", "flashmask-triton"]\n'
                   '[backend_max_seqlen]\nreference = "4K"\nflashmask-triton = 1024\n')
    e = load_experiment(cfg).validate(known_backends=KNOWN)
    assert e.backend_max_seqlen == {"reference": 4096, "triton-flashmask": 1024}  # old name made canonical
    planned = _planned(e)
    assert planned == {"triton": {1024, 4096, 16384}, "reference": {1024, 4096}, "triton-flashmask": {1024}}
    assert e.num_points() == sum(len(p) for _, p in plan_points(e)) == 3 + 2 + 1
    assert "3 (S, backend) pairs above the backend's max_seqlen left out" in e.grid_summary()
    # a problem no backend runs at is not planned at all
    e2 = Experiment(masks=["causal"], seqlens=[1024, 4096], modes=["fwd"], backends=["reference"],
                    backend_max_seqlen={"reference": 1024}).validate(known_backends=KNOWN)
    assert [k[1] for k, _ in plan_points(e2)] == [1024]


@pytest.mark.parametrize("table, needle", [
    ('[backend_max_seqlen]\nnope = "4K"\n', "unknown backend 'nope'"),
    ('[backend_max_seqlen]\nreference = "four"\n', "[backend_max_seqlen] reference"),
    ('[backend_max_seqlen]\nreference = 0\n', "must be positive"),
])
def test_backend_max_seqlen_errors(tmp_path, table, needle):
    cfg = tmp_path / "e.toml"
    cfg.write_text('[grid]\nmasks = ["causal"]\nbackends = ["reference"]\n' + table)
    with pytest.raises(ConfigError) as e:
        load_experiment(cfg).validate(known_backends=KNOWN)
    assert needle in str(e.value)


def test_dense_toml_is_the_full_breadth_study():
    e = load_experiment(REPO / "experiments" / "dense.toml").validate(known_backends=KNOWN)
    assert sorted(e.masks) == sorted(STATIC_MASK_NAMES)
    assert (64, 64) in e.heads and (64, 8) in e.heads and 64 in e.head_dims and 128 in e.head_dims
    planned = _planned(e)
    assert set(planned) == set(e.backends)
    for b, lengths in planned.items():
        assert len(lengths) >= 7, (b, sorted(lengths))
    for b in ("triton", "triton-flashmask", "flex", "flex-fa4", "cudnn", "fa4"):
        assert {65536, 131072} <= planned[b], b
    for b in ("sdpa-cudnn", "sdpa-math", "reference"):
        assert 65536 not in planned[b], b

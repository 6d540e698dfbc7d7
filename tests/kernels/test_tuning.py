"""The shipped tuning tables: parsing, matching and the errors a malformed table gets."""

import pytest

from longca_triton.kernels.tuning import Problem, parse_table

KEYS = ("BLOCK_M", "num_warps")


def _table(rows, defaults=None):
    return parse_table({"defaults": defaults or {"BLOCK_M": 32, "num_warps": 4}, "row": rows}, "test", "t.toml", KEYS)


def test_rows_overlay_in_file_order_and_match_ranges():
    t = _table([
        {"match": {"arch": "sm90"}, "mode": "fwd", "config": {"BLOCK_M": 64}, "results": "r1"},
        {"match": {"arch": "sm90", "head_dim": [64, 128], "group": [2]}, "mode": "fwd", "config": {"num_warps": 8},
         "results": "r2"},
        {"match": {"density": [0.0, 0.5]}, "mode": "fwd", "config": {"BLOCK_M": 128}, "results": "r3"},
    ])
    p = Problem(arch="sm90", head_dim=128, group=8, density=0.7)
    assert [r.results for r in t.matching(p)] == ["r1", "r2"]
    assert [r.results for r in t.matching(Problem(arch="sm90", head_dim=128, group=1, density=0.3))] == ["r1", "r3"]
    # an unknown field of the problem is matched only by rows that leave it out
    assert [r.results for r in t.matching(Problem(arch="cpu"))] == []


@pytest.mark.parametrize("bad, msg", [
    ({"match": {"gpu": "x"}, "mode": "fwd", "config": {"BLOCK_M": 64}, "results": "r"}, "match fields"),
    ({"mode": "fwd", "config": {"BLOCK_Q": 64}, "results": "r"}, "unknown test config keys"),
    ({"mode": "fwd", "config": {"BLOCK_M": 64}}, "needs results"),
    ({"mode": "both", "config": {"BLOCK_M": 64}, "results": "r"}, "mode must be"),
    ({"match": {"group": 2}, "mode": "fwd", "config": {"BLOCK_M": 64}, "results": "r"}, "match.group"),
    ({"mode": "fwd", "config": {}, "results": "r"}, "non-empty config"),
])
def test_malformed_rows_name_the_problem(bad, msg):
    with pytest.raises(ValueError, match=msg):
        _table([bad])


def test_defaults_must_name_every_key():
    with pytest.raises(ValueError, match="missing"):
        _table([], defaults={"BLOCK_M": 32})

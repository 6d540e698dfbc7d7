"""The block-sparse defaults as data: the shipped table resolves, for every mask class, head dim and GQA
layout, to the launch configs the kernels ran before the table existed (``data/block_sparse_defaults.json``:
each distinct earlier config with its full key set and the cases that resolved to it; the keys retired since
then are compared through what the passes derive, ``config.pass_plans``)."""

import json
from pathlib import Path

import pytest

from longca_triton.kernels.block_sparse import config as BSC
from longca_triton.kernels.tuning import load_table
from longca_triton.masks import make_mask

GROUPS = json.loads((Path(__file__).parent / "data" / "block_sparse_defaults.json").read_text())
CASES = {case: group["config"] for group in GROUPS for case in group["cases"]}


def _mask(name: str):
    kind, patterns = name.split("_P")
    if kind.startswith("uniform"):
        return make_mask("block_sparse", 2048, seed=0, block=int(kind[7:]), density=0.5, patterns=int(patterns))
    mean = int(kind[3:])
    return make_mask("varblock_sparse", 4096, seed=0, block=mean, min_block=mean // 2, density=0.5,
                     patterns=int(patterns))


def _as_before(cfg: dict) -> dict:
    """``cfg`` in the earlier keys: the kept ones, and what each retired one is now derived as (or fixed to)."""
    p = BSC.pass_plans(cfg)
    ragged = cfg["ragged_bwd"]
    out = {k: v for k, v in cfg.items() if k != "ragged_bwd"}
    out.update(
        HEADS=1, DKDV_HEADS=1, warp_specialize=False, one_launch=False, bwd_order=0, dkdv_sweep=0,
        dkdv_head_outer=True, dkdv_qmajor=False, dq_skew=False, dq_full_first=False, dkdv_tail_warps=4,
        bwd_num_warps=max(cfg["dkdv_num_warps"], cfg["dq_num_warps"]),
        bwd_num_stages=min(cfg["dkdv_num_stages"], cfg["dq_num_stages"]),
        list_chunk=p["fwd"].chunk, dq_list_chunk=p["dq"].chunk, dkdv_list_chunk=p["dkdv"].chunk,
        pack_list=p["fwd"].pack, dq_pack_list=p["dq"].pack, dkdv_pack_list=p["dkdv"].pack,
        tail_rows=p["fwd"].tail_rows, dq_tail_rows=p["dq"].tail_rows, dkdv_tail_rows=p["dkdv"].tail_rows,
        dq_short_keys=p["dq"].short_cols, order_by_steps=p["dq"].by_steps and p["dkdv"].by_steps,
        dkdv_full_first=p["dkdv"].full_first, dkdv_tail_cols=p["dkdv"].tail_cols if ragged else 0,
        dkdv_tail_order=2 if ragged else 0)
    return out


@pytest.mark.parametrize("group", range(len(GROUPS)), ids=lambda i: f"config{i}")
def test_table_resolves_to_the_earlier_defaults(group, monkeypatch):
    monkeypatch.setattr(BSC, "interpreting", lambda: False)
    want = GROUPS[group]["config"]
    for case in GROUPS[group]["cases"]:
        name, head_dim, heads = case.split("|")
        heads = None if heads == "None" else tuple(int(x) for x in heads.strip("()").split(","))
        got = _as_before(BSC.resolve_config(_mask(name), int(head_dim[1:]), None, heads=heads))
        assert got == want, case


def test_every_key_is_set_by_a_row_and_the_table_parses():
    table = load_table("block_sparse", BSC.CONFIG_KEYS)
    assert set(table.defaults) == set(BSC.CONFIG_KEYS) and len(BSC.CONFIG_KEYS) <= 17
    set_by_rows = {k for row in table.rows for k in row.config}
    assert set_by_rows == set(BSC.CONFIG_KEYS)
    assert all(row.results and row.note for row in table.rows)


def test_interpreter_runs_the_defaults():
    mask = make_mask("varblock_sparse", 512, block=64, min_block=32, density=0.5, patterns=2, seed=0)
    cfg = BSC.resolve_config(mask, 128, heads=(4, 2))
    assert cfg == load_table("block_sparse", BSC.CONFIG_KEYS).defaults
    assert BSC.pass_plans(cfg)["dq"].chunk == 16 and not cfg["ragged_bwd"]

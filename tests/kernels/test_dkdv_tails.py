"""Variable blocks' dK/dV tails (a key block's remainder of <= ``dkdv_tail_rows`` keys): query rows a step and
query-major scores (``dkdv_tail_cols``), and the tails in the main dK/dV launch (``dkdv_tail_order`` 3,
``block_sparse_tables.merge_tails``). CPU: the Triton interpreter, and one sm_90a compile (slow)."""

import pytest
import torch
from utils import compare_to_reference

import longca_triton.kernels.block_sparse.op as BS
from longca_triton.kernels.block_sparse.op import block_sparse_attention
from longca_triton.kernels.block_sparse.plan import build_side_tables, merge_tails
from longca_triton.masks import make_mask


def _mask(S=173, seed=3, min_block=20):
    """Variable blocks (mean 48) whose key blocks end in remainders of <= 16 keys (the interpreter's dK/dV key
    tile is 32): a dK/dV tail launch exists with ``dkdv_tail_rows`` 16."""
    return make_mask("varblock_sparse", S, block=48, min_block=min_block, density=0.4, patterns=2, seed=seed)


def _kv_parts(mask, tail_cols=32):
    bm = mask.block_map.transpose(1, 2).contiguous()
    rb, cb = mask.k_block_bounds, mask.q_block_bounds
    main = build_side_tables(rb, cb, bm, 32, 32, "cpu", True, "big", 16, by_steps=True)
    tail = build_side_tables(rb, cb, bm, 32, tail_cols, "cpu", True, "tail", 16, by_steps=True)
    return main, tail


@pytest.mark.parametrize("seed", [3, 7])
def test_merge_tails_puts_each_tail_after_its_blocks_last_main_tile(seed):
    """In each of the 1 + P orders: every main and tail tile once, the main tiles in their own order, each tail
    right after the last main tile of its block (or, with none, after all main tiles)."""
    main, tail = _kv_parts(_mask(seed=seed))
    tm, tt = main.num_tiles, tail.num_tiles
    assert tm > 0 and tt > 0
    merged = merge_tails(main, tail)
    assert merged.num_tiles == tt and torch.equal(merged.row_start, tail.row_start)
    n = tm + tt
    assert merged.order.numel() == (1 + main.num_patterns) * n
    for s in range(1 + main.num_patterns):
        seq = merged.order[s * n:(s + 1) * n].tolist()
        assert sorted(seq) == list(range(n))
        assert [i for i in seq if i < tm] == main.order[s * tm:(s + 1) * tm].tolist()
        for at, i in enumerate(seq):
            if i < tm:
                continue
            blk = int(tail.row_block[i - tm])
            siblings = [j for j in range(tm) if int(main.row_block[j]) == blk]
            if siblings:
                assert seq[at - 1] in siblings and all(seq.index(j) < at for j in siblings)
            else:
                assert all(j >= tm for j in seq[at:])


def test_merge_tails_rejects_tables_of_two_masks():
    main, _ = _kv_parts(_mask(seed=3))
    _, other = _kv_parts(_mask(S=211, seed=4))
    with pytest.raises(ValueError, match="two parts"):
        merge_tails(main, other)


CASES = [  # (tail cols, tail order, dtype, dlse)
    (16, 0, torch.float32, True),
    (64, 2, torch.float32, False),
    (64, 3, torch.float32, True),
    (32, 3, torch.float16, False),
    (0, 3, torch.float32, True),
]


@pytest.mark.parametrize("cols,order,dtype,dlse", CASES,
                         ids=[f"S=173-Hq=4-Hkv=2-tail_cols={c}-tail_order={o}-{str(d)[6:]}" + ("-dlse" if g else "")
                              for c, o, d, g in CASES])
def test_dkdv_tail_variants_match_the_reference(cols, order, dtype, dlse):
    """The dK/dV tails stepping ``cols`` query rows with query-major scores (0: the main pass's step, key-major),
    in a launch of their own or in the main launch (order 3), against float64 (GQA 4:2, two patterns)."""
    mask = _mask()
    cfg = {"dkdv_tail_rows": 16, "dkdv_tail_cols": cols, "dkdv_tail_order": order}
    tables = BS.tables_for(mask, BS.resolve_config(mask, 32, cfg), "cpu")
    assert tables["dkdv_tail"].num_tiles > 0 and tables["dkdv_tail"].tile_cols == (cols or 32)
    compare_to_reference(lambda q, k, v: block_sparse_attention(q, k, v, mask, return_lse=True, config=cfg), mask,
                         173, 173, 1, 4, 2, 32, dtype, dlse=dlse)


def _grads(mask, cfg, S, op=False):
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, S, h, 32) for h in (4, 2, 2, 4))
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    fn = BS.block_sparse_attention_op if op else BS.block_sparse_attention
    fn(qq, kk, vv, mask, config=cfg).backward(do)
    return [x.grad for x in (qq, kk, vv)]


@pytest.mark.parametrize("cols", [0, 64])
def test_tails_in_the_main_launch_give_the_same_bits(cols):
    """Order 3 runs the same tiles as a launch of their own (order 0): the same gradients bit for bit."""
    mask = _mask()
    apart = _grads(mask, {"dkdv_tail_rows": 16, "dkdv_tail_cols": cols, "dkdv_tail_order": 0}, 173)
    merged = _grads(mask, {"dkdv_tail_rows": 16, "dkdv_tail_cols": cols, "dkdv_tail_order": 3}, 173)
    for a, b in zip(apart, merged):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_tail_tables_with_their_own_flags_travel_through_the_ops():
    """Tails stepping 64 query rows over blocks of >= 40 are not packed while the main 32-row steps are: the ops
    carry each table's own flags (``op_meta``), and the op path gives the autograd path's bits."""
    mask = make_mask("varblock_sparse", 192, block=48, min_block=40, density=0.5, patterns=2, seed=1)
    cfg = {"dkdv_tail_rows": 16, "dkdv_tail_cols": 64, "dkdv_tail_order": 3}
    tables = BS.tables_for(mask, BS.resolve_config(mask, 32, cfg), "cpu")
    assert tables["dkdv_tail"].num_tiles > 0
    assert tables["dkdv"].packed and not tables["dkdv_tail"].packed
    for a, b in zip(_grads(mask, cfg, 192), _grads(mask, cfg, 192, op=True)):
        assert torch.isfinite(a).all() and torch.equal(a, b)


class _Record:
    def __init__(self, name, events):
        self.name, self.events = name, events

    def __getitem__(self, grid):
        return lambda *a, **kw: self.events.append((self.name, grid[0], kw))


@pytest.mark.parametrize("passes", [("dkdv", "dq"), ("dkdv",)], ids=["both-passes", "dkdv-only"])
def test_order_3_launches_one_dkdv_kernel_over_main_and_tail_tiles(passes, monkeypatch):
    events: list = []
    for name in ("dkdv", "dkdv_merged", "dq"):
        monkeypatch.setattr(BS, f"block_sparse_bwd_{name}_kernel", _Record(name, events))
    mask = _mask()
    cfg = BS.resolve_config(mask, 32, {"dkdv_tail_rows": 16, "dkdv_tail_cols": 64, "dkdv_tail_order": 3})
    tables = BS.tables_for(mask, cfg, "cpu")
    q, k, v, out, do = (torch.randn(1, 173, h, 32) for h in (4, 2, 2, 4, 4))
    BS.block_sparse_bwd(do, q, k, v, out, torch.zeros(1, 4, 173), mask, tables, 32 ** -0.5, cfg, passes=passes)
    dkdv = [e for e in events if e[0].startswith("dkdv")]
    assert [e[0] for e in dkdv] == ["dkdv_merged"]
    _, grid, kw = dkdv[0]
    tm, tt = tables["dkdv"].num_tiles, tables["dkdv_tail"].num_tiles
    assert grid == (tm + tt) * 2 and kw["TAIL_QMAJOR"] and (kw["TAIL_M"], kw["TAIL_N"]) == (64, 16)
    assert [e[0] for e in events if e[0] == "dq"] == (["dq"] if "dq" in passes else [])


@pytest.mark.parametrize("cols,qmajor", [(0, False), (64, True)])
def test_tail_cols_reach_only_the_tail_launch(cols, qmajor, monkeypatch):
    events: list = []
    monkeypatch.setattr(BS, "block_sparse_bwd_dkdv_kernel", _Record("dkdv", events))
    monkeypatch.setattr(BS, "block_sparse_bwd_dq_kernel", _Record("dq", events))
    mask = _mask()
    cfg = BS.resolve_config(mask, 32, {"dkdv_tail_rows": 16, "dkdv_tail_cols": cols})
    q, k, v, out, do = (torch.randn(1, 173, h, 32) for h in (4, 2, 2, 4, 4))
    BS.block_sparse_bwd(do, q, k, v, out, torch.zeros(1, 4, 173), mask, BS.tables_for(mask, cfg, "cpu"), 32 ** -0.5,
                        cfg)
    main, tail = [kw for name, _, kw in events if name == "dkdv"]
    assert (main["BLOCK_M"], main["QMAJOR"]) == (32, False)
    assert (tail["BLOCK_M"], tail["QMAJOR"]) == (cols or 32, qmajor)


@pytest.mark.parametrize("over,match", [
    ({"dkdv_tail_cols": 48}, "dkdv_tail_cols"),
    ({"dkdv_tail_cols": True}, "dkdv_tail_cols"),
    ({"dkdv_tail_cols": "64"}, "dkdv_tail_cols"),
    ({"dkdv_tail_order": 3, "one_launch": True}, "head-major dK/dV loop"),
    ({"dkdv_tail_order": 3, "dkdv_sweep": 2}, "head-major dK/dV loop")],
    ids=["not-a-step", "bool", "str", "order-3-one-launch", "order-3-sweep"])
def test_dkdv_tail_bad_configs(over, match):
    with pytest.raises(ValueError, match=match):
        BS.resolve_config(_mask(), 32, {"dkdv_tail_rows": 16, **over})


@pytest.mark.slow
def test_merged_tails_compile_for_sm90a_with_one_exponential_a_score():
    """``experiments/cpu_aot_varblock.py`` (the launcher's real launches, compiled for sm_90a on the CPU; S = 4K,
    GQA 8:1, D = 128, mean-256 blocks): the tails in the main launch with 128 query rows a step compile in one
    CTA's shared memory, the main loop as in its own launch, the tail loop at one MUFU.EX2 a score
    (128 x 64 scores on 256 threads: 32 a thread); the key-major 64 x 64 tail on 8 warps runs each twice."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the lists walked in one part (dkdv_full_first off: the merged kernel's walk), so the main loops compare
    one = {"dkdv_full_first": False}
    cfgs = {"apart": one, "merged": {**one, "dkdv_tail_cols": 128, "dkdv_tail_order": 3},
            "w8": {**one, "dkdv_tail_warps": 8}}
    res = subprocess.run([sys.executable, "experiments/cpu_aot_varblock.py", "--S", "4096", "--heads", "8:1",
                          "--configs", json.dumps(cfgs)], capture_output=True, text=True, timeout=900, cwd=root,
                         env={**env, "PYTHONPATH": str(root)})
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in res.stdout.strip().splitlines()]
    by = {(r["config"], r["kernel"], r["BLOCK_N"]): r for r in rows}
    main = by[("apart", "block_sparse_bwd_dkdv_kernel", 128)]
    merged = by[("merged", "block_sparse_bwd_dkdv_merged_kernel", 128)]
    w8 = by[("w8", "block_sparse_bwd_dkdv_kernel", 64)]
    assert merged["warps"] == 8 and merged["shared"] <= 227 * 1024
    assert len(merged["loop_instr"]) == 2 and merged["loop_instr"][0] == main["loop_instr"][0]
    assert merged["loop_mufu"][1] * 256 == 128 * 64
    assert w8["loop_mufu"][0] * 256 == 2 * 64 * 64
    assert merged["spills"] <= main["spills"] + 64

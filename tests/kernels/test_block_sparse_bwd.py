"""The block-sparse backward on the CPU (Triton interpreter): its switches (``bwd_streams``,
``dkdv_pattern_order``, ``dkdv_stats_tma``, ``ragged_bwd``) against the float64 reference and at the
launches they change, the tables the ragged backward walks (short entries last, whole entries first,
programs by their steps), lists read in register chunks, and ``deterministic=True``. Coverage of the
kept area, packed lists and tail row tiles is in ``test_block_sparse.py``."""

import dataclasses

import pytest
import torch
from utils import DEVICE, compare_to_reference, fake_side_stream, needs_triton, spy_launches

import longca_triton.kernels.block_sparse.plan as PLAN
import longca_triton.kernels.dense.op as D
from longca_triton.kernels.block_sparse import config as BSC
from longca_triton.kernels.block_sparse import op as BSO
from longca_triton.kernels.block_sparse.config import PassPlan
from longca_triton.kernels.block_sparse.plan import build_side_tables
from longca_triton.masks import make_mask

pytestmark = needs_triton

#: the variable-block backward with one query head a dQ tile (so the dQ pass has tail row tiles too)
RAGGED1 = {"ragged_bwd": True, "DQ_HEADS": 1}


def var96():
    """Variable blocks of 20..40 rows: remainders of at most 16 rows / keys on both sides of 32-wide tiles."""
    return make_mask("varblock_sparse", 96, block=40, min_block=20, density=0.6, patterns=2, seed=5)


def short_mask(S=211, seed=3):
    """Variable blocks whose key runs end in remainders of at most 16 keys (the interpreter's dQ tile is 32)."""
    return make_mask("varblock_sparse", S, block=44, min_block=18, density=0.5, patterns=2, seed=seed)


def whole_mask(S=211, seed=3):
    """Variable blocks of 40..48 rows: with 32-row (key) entries every list holds whole entries, entries that cross
    from one run into the next (packed) and short ones."""
    return make_mask("varblock_sparse", S, block=48, min_block=40, density=0.5, patterns=2, seed=seed)


def against_reference(mask, cfg, hq=4, hkv=2, d=32, dtype=torch.float32, dlse=True):
    """out, lse, dq, dk, dv of ``block_sparse_attention`` with ``cfg`` against float64."""
    return compare_to_reference(lambda q, k, v: BSO.block_sparse_attention(q, k, v, mask, return_lse=True, config=cfg),
                                mask, mask.seqlen_q, mask.seqlen_k, 1, hq, hkv, d, dtype, dlse=dlse)


def backward(mask, overlay=None, passes=("dkdv", "dq"), tables=None, hq=4, hkv=2, d=32):
    """``block_sparse_bwd`` on seeded random tensors (``out`` and ``lse`` need not match them: the tests compare
    launches or bits). Returns ``cfg, tables, (dq, dk, dv)``."""
    cfg = BSO.resolve_config(mask, d, overlay)
    tables = tables or BSO.tables_for(mask, cfg, DEVICE)
    g = torch.Generator().manual_seed(0)
    sq, sk = mask.seqlen_q, mask.seqlen_k
    q, k, v, out, do = (torch.randn(1, s, h, d, generator=g).to(DEVICE)
                        for s, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq), (sq, hq)))
    lse = (torch.rand(1, hq, sq, generator=g) + 5.0).to(DEVICE)
    return cfg, tables, BSO.block_sparse_bwd(do, q, k, v, out, lse, mask, tables, d ** -0.5, cfg, passes=passes)


def record(monkeypatch) -> list:
    """Stand-ins for the side stream (``utils.fake_side_stream``) and the two backward kernels: the first event is
    ``("side_stream", on)``, then each launch appends ``(kernel, launched beside, its keyword arguments and grid)``
    instead of running."""
    events: list = []
    fake, state = fake_side_stream(events)
    monkeypatch.setattr(BSO, "side_stream", fake)

    class Record:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: events.append((self.name, state["beside"], {"grid": grid[0], **kw}))

    for name in ("dkdv", "dq"):
        monkeypatch.setattr(BSO, f"block_sparse_bwd_{name}_kernel", Record(name))
    return events


def launches(events, key):
    """Launch keyword ``key`` of every recorded launch that has it, in order (side-stream events skipped)."""
    return [e[2][key] for e in events if len(e) == 3 and key in e[2]]


def bits_equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------ bwd_streams: dQ beside dK/dV
@pytest.mark.parametrize("ragged", [False, True], ids=["S=96-Hq=4-Hkv=2-varblock", "S=96-Hq=4-Hkv=2-varblock-ragged"])
@pytest.mark.parametrize("on", [False, True], ids=["one-stream", "bwd_streams"])
def test_bwd_streams_places_the_launches(on, ragged, monkeypatch):
    """``bwd_streams`` switches the side stream on; the dQ launches (main, then tail tiles) go inside ``beside()``
    after the main dK/dV launch, which stays outside it; with ``ragged_bwd`` the dK/dV tail launch (16-key tiles,
    query-major on 4 warps) goes first, beside. (The stand-in marks ``beside()`` launches whether or not the stream
    is on: off, the real one is a no-op.)"""
    events = record(monkeypatch)
    cfg, _, _ = backward(var96(), {"bwd_streams": on, **(RAGGED1 if ragged else {})})
    assert events[0] == ("side_stream", on)
    got = [(name, beside, kw["num_warps"], kw["BLOCK_N"] if name == "dkdv" else kw["BLOCK_M"],
            kw["QMAJOR"] if name == "dkdv" else kw["HEADS"]) for name, beside, kw in events[1:]]
    main = ("dkdv", False, cfg["dkdv_num_warps"], 32, False)
    dq = ("dq", True, cfg["dq_num_warps"], 32, 1 if ragged else 2)  # two heads stacked: the interpreter's default
    want = [("dkdv", True, 4, 16, True), main, dq, ("dq", True, 4, 16, 1)] if ragged else [main, dq]
    assert got == want
    assert all(kw["grid"] > 0 for _, _, kw in events[1:])  # the small mask has remainders on both sides


@pytest.mark.parametrize("ragged", [False, True], ids=["S=96-Hq=4-Hkv=2-varblock", "S=96-Hq=4-Hkv=2-varblock-ragged"])
def test_streams_and_passes_apart_keep_the_bits(ragged, monkeypatch):
    """The backward gives the same bits on one stream or two, and each pass run alone (``passes``; the dK/dV tails
    with dK/dV) writes the whole backward's outputs; a pass alone takes no side stream."""
    overlay = RAGGED1 if ragged else {}
    _, tables, both = backward(var96(), overlay)
    assert ragged == ("dkdv_tail" in tables and "dq_tail" in tables)
    assert bits_equal(backward(var96(), {**overlay, "bwd_streams": True})[2], both)
    dkdv = backward(var96(), {**overlay, "bwd_streams": True}, passes=("dkdv",))[2]
    dq = backward(var96(), {**overlay, "bwd_streams": True}, passes=("dq",))[2]
    assert bits_equal(dkdv[1:], both[1:]) and torch.equal(dq[0], both[0])
    events = record(monkeypatch)
    backward(var96(), {**overlay, "bwd_streams": True}, passes=("dkdv",))
    assert events[0] == ("side_stream", False) and {e[0] for e in events[1:]} == {"dkdv"}


def test_bwd_streams_defaults_off_and_is_a_bool():
    mask = make_mask("block_sparse", 64, block=32, density=0.5, patterns=1, seed=1)
    assert BSO.resolve_config(mask, 32)["bwd_streams"] is False
    assert BSO.resolve_config(mask, 32, {"bwd_streams": 1})["bwd_streams"] is True


def test_side_stream_off_cuda_keeps_launches_in_order():
    """Off CUDA (the interpreter) the side stream is a no-op context, whatever the switch says."""
    from longca_triton.kernels.core.runtime import side_stream

    order = []
    with side_stream(torch.device("cpu"), True) as beside:
        order.append("dkdv")
        with beside():
            order.append("dq")
    assert order == ["dkdv", "dq"]


@pytest.mark.parametrize("kind", ["uniform32", "varblock-ragged"],
                         ids=["S=150-Hq=4-Hkv=2-uniform32", "S=150-Hq=4-Hkv=2-varblock-ragged"])
def test_bwd_streams_gradients_match_the_reference(kind):
    """The whole backward with ``bwd_streams`` on (in order on the CPU) against float64."""
    if kind == "uniform32":
        mask, cfg = make_mask("block_sparse", 150, block=32, density=0.5, patterns=2, seed=2), {"bwd_streams": True}
    else:
        mask = make_mask("varblock_sparse", 150, block=48, min_block=20, density=0.4, patterns=2, seed=2)
        cfg = {"bwd_streams": True, **RAGGED1}
    against_reference(mask, cfg)


# ------------------------------------------------------------------ dK/dV programs in their own pattern's order
PATTERN_ORDER_CASES = {
    "S=150-Hq=4-Hkv=2-P=2-uniform32": ("block_sparse", 2, {}),
    "S=150-Hq=4-Hkv=2-P=1-uniform32": ("block_sparse", 1, {}),
    "S=150-Hq=4-Hkv=2-P=2-varblock-ragged": ("varblock_sparse", 2, RAGGED1),
    "S=150-Hq=4-Hkv=2-P=4-uniform32-not-applied": ("block_sparse", 4, {}),
}


@pytest.mark.parametrize("case", PATTERN_ORDER_CASES)
def test_dkdv_pattern_order_gradients(case):
    """``dkdv_pattern_order``: each KV head's key tiles in its own pattern's order (the programs' work and sums
    are unchanged, so the gradients too) against float64; with the ragged backward's tail launch too."""
    kind, patterns, extra = PATTERN_ORDER_CASES[case]
    blocks = {"block": 48, "min_block": 20} if kind == "varblock_sparse" else {"block": 32}
    mask = make_mask(kind, 150, density=0.5, patterns=patterns, seed=3, **blocks)
    against_reference(mask, {"dkdv_pattern_order": True, **extra})


@pytest.mark.parametrize("patterns,want", [(2, True), (1, True), (4, False)],
                         ids=["S=64-Hq=4-Hkv=2-P=2", "S=64-Hq=4-Hkv=2-P=1", "S=64-Hq=4-Hkv=2-P=4"])
def test_dkdv_pattern_order_reaches_the_kernel_only_where_the_group_shares_a_pattern(patterns, want, monkeypatch):
    events = record(monkeypatch)
    mask = make_mask("block_sparse", 64, block=32, density=0.5, patterns=patterns, seed=1)
    for value in (False, True):
        backward(mask, {"dkdv_pattern_order": value})
    assert launches(events, "PATTERN_ORDER") == [False, want]


# ------------------------------------------------------------------ dK/dV stats by TMA boxes (dkdv_stats_tma)
STATS_CASES = {
    # name: (mask, config overlay, STATS_TMA of each dK/dV launch)
    "S=160-Hq=4-Hkv=2-uniform32": (lambda: make_mask("block_sparse", 160, block=32, density=0.5, patterns=2,
                                                     seed=3), {}, [True]),
    "S=150-Hq=4-Hkv=2-uniform32-ragged-end": (lambda: make_mask("block_sparse", 150, block=32, density=0.5,
                                                                patterns=2, seed=3), {}, [False]),
    "S=150-Hq=4-Hkv=2-uniform48-partial-entries": (lambda: make_mask("block_sparse", 150, block=48, density=0.5,
                                                                     patterns=2, seed=3), {}, [False]),
    "S=192-Hq=4-Hkv=2-varblock-packed": (lambda: whole_mask(192, seed=1), {}, [False]),
    # whole entries first: the main launch's first part by boxes, the query-major tails by pointers
    "S=211-Hq=4-Hkv=2-varblock-ragged": (whole_mask, RAGGED1, [False, True]),
}


@pytest.mark.parametrize("case", STATS_CASES)
def test_dkdv_stats_tma_gradients_and_where_it_applies(case, monkeypatch):
    """``dkdv_stats_tma``: the dK/dV steps read (lse, delta) from the preprocess's 16-byte rows by TMA boxes where
    a table's steps are full, unpacked entries (the others keep the pointer loads; the preprocess writes the rows
    only when some launch reads them), against float64 with an lse gradient."""
    make, extra, want = STATS_CASES[case]
    mask = make()
    tma = spy_launches(monkeypatch, BSO, "block_sparse_bwd_dkdv_kernel", "STATS_TMA")
    stats = spy_launches(monkeypatch, D, "bwd_preprocess_kernel", "STATS")
    against_reference(mask, {"dkdv_stats_tma": True, **extra})
    assert tma == want and stats == [any(want)]


# ------------------------------------------------------------------ ragged_bwd: the variable-block backward
def test_ragged_bwd_derives_each_pass_plan():
    """``ragged_bwd`` (``config.pass_plans``): the backward's lists entry by entry, dQ over plain lists with short
    entries last in half-width tiles (and, one head a tile, half-size tail row tiles), dK/dV over packed lists with
    whole entries first and half-size key tail tiles, both ordered by steps; the forward unchanged. Without it the
    backward reads packed lists, in chunks at three stages (16 entries in the interpreter); tiles of 16 have no
    halves."""
    mask = var96()

    def plans(**over):
        return BSC.pass_plans(BSC.resolve_config(mask, 32, over))

    fwd = PassPlan(32, 32, 16, False, 0, 32, 0, False, False)
    assert plans() == {"fwd": fwd, "dq": PassPlan(32, 32, 16, True, 0, 32, 0, False, False),
                       "dkdv": PassPlan(32, 32, 16, True, 0, 32, 0, False, False)}
    ragged_dkdv = PassPlan(32, 32, 0, True, 16, 32, 0, True, True)
    assert plans(ragged_bwd=True) == {"fwd": fwd, "dq": PassPlan(32, 32, 0, False, 0, 32, 16, True, False),
                                      "dkdv": ragged_dkdv}
    assert plans(**RAGGED1)["dq"] == PassPlan(32, 32, 0, False, 16, 32, 16, True, False)
    assert plans(dq_num_stages=2, dkdv_num_stages=2)["dq"].chunk == 0
    small = plans(ragged_bwd=True, DQ_HEADS=1, DQ_BLOCK_M=16, DQ_BLOCK_N=16, DKDV_BLOCK_N=16)
    assert (small["dq"].tail_rows, small["dq"].short_cols, small["dkdv"].tail_rows) == (0, 0, 0)


def test_short_tables_move_short_entries_last():
    """``short_cols``: every list keeps its entries, the long ones first (in order), then those of at most
    ``short_cols`` columns; ``col_split`` points at the first short one; a packed table ignores it."""
    m = short_mask()
    args = (m.q_block_bounds, m.k_block_bounds, m.block_map)
    plain = build_side_tables(*args, 32, 32, "cpu")
    split = build_side_tables(*args, 32, 32, "cpu", short_cols=16)
    assert plain.col_split is None and split.short_cols == 16 and torch.equal(plain.ptr, split.ptr)
    n_short = 0
    for lst in range(plain.ptr.numel() - 1):
        lo, hi, mid = int(plain.ptr[lst]), int(plain.ptr[lst + 1]), int(split.col_split[lst])
        before = list(zip(plain.col_start[lo:hi].tolist(), plain.col_end[lo:hi].tolist()))
        after = list(zip(split.col_start[lo:hi].tolist(), split.col_end[lo:hi].tolist()))
        assert after == [e for e in before if e[1] - e[0] > 16] + [e for e in before if e[1] - e[0] <= 16]
        assert lo <= mid <= hi and all(e - s0 <= 16 for s0, e in after[mid - lo:])
        n_short += hi - mid
    assert n_short > 0  # the mask has short remainders: the split is exercised
    packed = build_side_tables(*args, 32, 16, "cpu", pack_cols=True, short_cols=8)
    assert packed.packed and packed.col_split is None and packed.short_cols == 0
    with pytest.raises(ValueError, match="short_cols"):
        build_side_tables(*args, 32, 32, "cpu", short_cols=32)


def _entries(t, lo, hi):
    return list(zip(t.col_start[lo:hi].tolist(), t.col_end[lo:hi].tolist(), t.col_next[lo:hi].tolist(),
                    t.col_count[lo:hi].tolist()))


@pytest.mark.parametrize("pack,short", [(True, 0), (False, 0), (False, 8)], ids=["packed", "plain", "plain-short8"])
def test_full_first_tables_put_whole_entries_first(pack, short):
    """``full_first``: every list keeps its entries; its whole contiguous ones (``end - start == tile``, all valid)
    first in their order, ``col_full`` at the first other one; the rest in order (a packed list's short last entry
    stays last, so only it is short); with ``short_cols`` the short ones still last, behind ``col_split``."""
    m = whole_mask()
    args = (m.k_block_bounds, m.q_block_bounds, m.block_map.transpose(1, 2).contiguous(), 32, 16, "cpu")
    plain = build_side_tables(*args, pack_cols=pack, short_cols=short)
    full = build_side_tables(*args, pack_cols=pack, short_cols=short, full_first=True)
    assert plain.col_full is None and full.full_first and full.packed is pack and torch.equal(plain.ptr, full.ptr)
    whole_n = rest_n = 0
    for lst in range(plain.ptr.numel() - 1):
        lo, hi, mid = int(plain.ptr[lst]), int(plain.ptr[lst + 1]), int(full.col_full[lst])
        before, after = _entries(plain, lo, hi), _entries(full, lo, hi)
        whole = [e for e in before if e[1] - e[0] == 16]
        assert lo <= mid <= hi and after[:mid - lo] == whole and all(e[3] == 16 for e in whole)
        rest = after[mid - lo:]
        if short:
            split = int(full.col_split[lst])
            assert mid <= split <= hi and all(e[1] - e[0] <= short for e in after[split - lo:])
            long_rest = [e for e in before if short < e[1] - e[0] != 16]
            assert rest == long_rest + [e for e in before if e[1] - e[0] <= short]
        else:
            assert rest == [e for e in before if e[1] - e[0] != 16]
        if pack and rest:
            assert all(e[3] == 16 for e in rest[:-1]) and rest[-1] == before[-1]
        whole_n, rest_n = whole_n + len(whole), rest_n + len(rest)
    assert whole_n > 0 and rest_n > 0  # both loops have work on this mask
    even = build_side_tables([0, 64, 128], [0, 64, 128], torch.ones(1, 2, 2, dtype=torch.bool), 32, 32, "cpu",
                             full_first=True)
    assert even.even_cols and not even.full_first  # every entry is whole already: nothing to split


@pytest.mark.parametrize("major", ["q", "k"])
def test_order_by_steps_sorts_by_entries_and_keeps_a_blocks_tiles_together(major):
    """``by_steps``: the order is a permutation sorted by each tile's list entries (heaviest first, over all patterns
    and per pattern), ties in tile order, so one block's tiles (one list) sit next to each other; the lists
    themselves are unchanged. Without it a block's short last tile sorts after its full ones."""
    m = make_mask("varblock_sparse", 300, block=60, min_block=30, density=0.5, patterns=2, seed=7)
    rows, cols, bm = ((m.q_block_bounds, m.k_block_bounds, m.block_map) if major == "q"
                      else (m.k_block_bounds, m.q_block_bounds, m.block_map.transpose(1, 2).contiguous()))
    old = build_side_tables(rows, cols, bm, 16, 16, "cpu")
    new = build_side_tables(rows, cols, bm, 16, 16, "cpu", by_steps=True)
    for f in ("row_start", "row_end", "row_block", "ptr", "col_start", "col_end"):
        assert torch.equal(getattr(old, f), getattr(new, f))
    T, P, R = new.num_tiles, new.num_patterns, new.num_row_blocks
    steps = (new.ptr[1:] - new.ptr[:-1]).view(P, R)[:, new.row_block.long()]  # [P, T]
    for p, w in [(None, steps.sum(0))] + [(p, steps[p]) for p in range(P)]:
        seg = new.order[:T] if p is None else new.order[T * (1 + p):T * (2 + p)]
        assert sorted(seg.tolist()) == list(range(T))
        ws = w[seg.long()].tolist()
        assert ws == sorted(ws, reverse=True)
        for a, b in zip(seg.tolist(), seg.tolist()[1:]):  # equal steps keep the tiles' own order
            if w[a] == w[b]:
                assert a < b
    assert bool(((old.row_end - old.row_start) < 16).any()) and not torch.equal(old.order, new.order)


RAGGED_CASES = {
    # name: (mask, config overlay, dtype)
    "S=211-Hq=4-Hkv=2-varblock-short-keys-heads2-fp32": (short_mask, {"ragged_bwd": True}, torch.float32),
    "S=211-Hq=4-Hkv=2-varblock-short-keys-tails-fp16": (short_mask, RAGGED1, torch.float16),
    "S=211-Hq=4-Hkv=2-varblock-whole-first-stats-boxes-fp32": (whole_mask, {**RAGGED1, "dkdv_stats_tma": True},
                                                               torch.float32),
    "S=173-Hq=4-Hkv=2-varblock-whole-first-heads2-fp16": (lambda: whole_mask(173), {"ragged_bwd": True},
                                                          torch.float16),
}


@pytest.mark.parametrize("case", RAGGED_CASES)
def test_ragged_bwd_gradients(case):
    """The variable-block backward on masks whose every table has both parts to walk: dQ lists with short entries
    (main and tail row tiles), dK/dV lists with whole entries and others (packed on 40..48-row blocks, plain on
    18..44-row ones), against float64 with an lse gradient."""
    make, cfg, dtype = RAGGED_CASES[case]
    mask = make()
    tables = BSO.tables_for(mask, BSO.resolve_config(mask, 32, cfg), DEVICE)
    assert ("dq_tail" in tables) == (cfg.get("DQ_HEADS") == 1) and tables["dkdv_tail"].num_tiles > 0
    for name, t in tables.items():
        if name.startswith("dq"):
            assert bool((t.col_split < t.ptr[1:]).any()), f"{name}: no short entries"
        if t.col_full is not None:
            assert bool((t.col_full > t.ptr[:-1]).any()) and bool((t.col_full < t.ptr[1:]).any()), name
    assert tables["dkdv"].full_first and tables["dkdv"].packed is (make is not short_mask)
    against_reference(mask, cfg, dtype=dtype)


def test_ragged_bwd_op_path_and_kernel_switches(monkeypatch):
    """Through the torch.library ops the reordered and split tables travel with the others (the autograd path's
    gradients bit for bit); the launcher hands the dQ launches ``SHORT_N``, the dK/dV ones ``FULL_FIRST`` with
    their tables' ``col_full``, and the stats boxes to the main dK/dV launch (its whole entries), which a packed
    table without the ragged backward does not get."""
    mask = whole_mask()
    cfg = {**RAGGED1, "dkdv_stats_tma": True}
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 211, h, 32, device=DEVICE) for h in (4, 2, 2, 4))
    grads = []
    for fn in (BSO.block_sparse_attention, BSO.block_sparse_attention_op):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        fn(*leaves, mask, config=cfg).backward(do)
        grads.append([x.grad for x in leaves])
    assert all(torch.isfinite(a).all() for a in grads[0]) and bits_equal(*grads)
    for ragged in (True, False):
        events = record(monkeypatch)
        backward(mask, {**cfg, "ragged_bwd": ragged})
        assert launches(events, "SHORT_N") == ([16, 16] if ragged else [0])
        assert launches(events, "FULL_FIRST") == ([True, True] if ragged else [False])
        assert [c is not None for c in launches(events, "COL_FULL")] == ([True, True] if ragged else [False])
        assert launches(events, "STATS_TMA") == ([False, True] if ragged else [False])


def test_programs_ordered_by_steps_keep_the_bits():
    """The ragged backward orders its programs by their lists' steps; the same tables ordered by work instead give
    the same gradients bit for bit (only the programs' launch order changes)."""
    mask = make_mask("varblock_sparse", 173, block=48, min_block=20, density=0.4, patterns=2, seed=3)
    plans = BSC.pass_plans(BSC.resolve_config(mask, 32, RAGGED1))
    assert plans["dq"].by_steps and plans["dkdv"].by_steps and not plans["fwd"].by_steps
    steps = PLAN.tables_for(mask, plans, DEVICE)
    work = PLAN.tables_for(mask, {n: dataclasses.replace(p, by_steps=False) for n, p in plans.items()}, DEVICE)
    assert set(steps) == {"fwd", "dq", "dkdv", "dq_tail", "dkdv_tail"}
    assert any(not torch.equal(steps[n].order, work[n].order) for n in ("dq", "dkdv", "dq_tail", "dkdv_tail"))
    assert bits_equal(backward(mask, RAGGED1, tables=steps)[2], backward(mask, RAGGED1, tables=work)[2])


# ------------------------------------------------------------------ lists in register chunks, dQ 128 x 128
CHUNK_CASES = {
    # lists longer than the chunk (several chunks and a partial last one), GQA, one pattern per KV head
    "S=400-Hq=2-Hkv=1-uniform32": (lambda: make_mask("block_sparse", 400, block=32, density=0.7, patterns=1,
                                                     seed=4), 2, 1),
    # ragged blocks (masked tails, packed backward lists), a pattern per query head
    "S=340-Hq=2-Hkv=1-varblock": (lambda: make_mask("varblock_sparse", 340, block=40, min_block=20, density=0.6,
                                                    patterns=2, seed=4), 2, 1),
}
#: 16-wide steps (longer lists) at three stages (lists in chunks) or two (entry by entry)
STEPS16 = dict(BLOCK_N=16, DQ_BLOCK_N=16, DKDV_BLOCK_M=16)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's chunks of 16 entries need only short lists")
@pytest.mark.parametrize("case", CHUNK_CASES)
def test_list_chunks_give_the_same_bits(case):
    """Lists read in register chunks (three stages) walk the same entries in the same order as entry by entry
    (two): equal bits (the other tests check the interpreter's three stages against the reference)."""
    make, hq, hkv = CHUNK_CASES[case]
    mask = make()
    chunked, plain = ({**STEPS16, "num_stages": s, "dq_num_stages": s, "dkdv_num_stages": s} for s in (3, 2))
    assert [p.chunk for p in BSC.pass_plans(BSO.resolve_config(mask, 16, chunked)).values()] == [16, 16, 16]
    assert [p.chunk for p in BSC.pass_plans(BSO.resolve_config(mask, 16, plain)).values()] == [0, 0, 0]
    tables = BSO.tables_for(mask, BSO.resolve_config(mask, 16, chunked), DEVICE)
    longest = {n: int((t.ptr[1:] - t.ptr[:-1]).max()) for n, t in tables.items()}
    assert min(longest.values()) > 16, f"every pass must need several chunks: longest lists {longest}"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s, h, 16, generator=g).requires_grad_()
               for s, h in ((mask.seqlen_q, hq), (mask.seqlen_k, hkv), (mask.seqlen_k, hkv)))
    dout = torch.randn(1, mask.seqlen_q, hq, 16, generator=g)
    got = []
    for cfg in (plain, chunked):
        out = BSO.block_sparse_attention(q, k, v, mask, config=cfg)
        got.append((out.detach(), *torch.autograd.grad(out, (q, k, v), dout)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *got):
        assert torch.equal(a, b), f"{name} differs between chunked and entry-by-entry lists"


def test_dq_128x128_step_is_right():
    """The 128 x 128 dQ step on block-128 tables, a ragged last block, GQA, in the interpreter."""
    mask = make_mask("block_sparse", 300, block=128, density=0.5, patterns=2, seed=2)
    against_reference(mask, dict(DQ_BLOCK_M=128, DQ_BLOCK_N=128, dq_num_warps=8, dq_num_stages=2), dlse=False)


# ------------------------------------------------------------------ deterministic
def _grads(q, k, v, mask, **kw):
    """dq, dk, dv of one fresh forward + backward (new leaves, same values)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = BSO.block_sparse_attention(q, k, v, mask, **kw)
    g = torch.Generator(device=out.device).manual_seed(7)
    out.backward(torch.randn(out.shape, generator=g, device=out.device, dtype=out.dtype))
    return q.grad, k.grad, v.grad


DETERMINISTIC = {
    "S=128-Hq=4-Hkv=2-uniform32": (lambda: make_mask("block_sparse", 128, block=32, density=0.5, patterns=2, seed=1),
                                   None),
    "S=150-Hq=4-Hkv=2-varblock": (lambda: make_mask("varblock_sparse", 150, block=48, min_block=20, density=0.5,
                                                    patterns=2, seed=2), None),
    "S=150-Hq=4-Hkv=2-varblock-ragged-streams-stats": (lambda: whole_mask(150, seed=2),
                                                       {**RAGGED1, "bwd_streams": True, "dkdv_stats_tma": True,
                                                        "dkdv_pattern_order": True}),
}


@pytest.mark.parametrize("case", DETERMINISTIC)
def test_deterministic_gives_equal_bits_twice(case):
    make, config = DETERMINISTIC[case]
    mask = make()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, s, h, 32, device=DEVICE) for s, h in
               ((mask.seqlen_q, 4), (mask.seqlen_k, 2), (mask.seqlen_k, 2)))
    first = _grads(q, k, v, mask, config=config, deterministic=True)
    second = _grads(q, k, v, mask, config=config, deterministic=True)
    for name, a, b in zip("qkv", first, second):
        assert a.abs().sum() > 0, f"d{name} is all zero: nothing was checked"
        assert torch.equal(a, b), f"d{name} differs between two deterministic runs"

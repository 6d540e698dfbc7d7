"""The Gluon family's plans on the CPU (``kernels/gluon/plan.py``, ``op.fwd_plan`` / ``op.dq_plan``): the merged
run lists every partition walks (against the mask's own block tables), the split and mask_head plans, the
kernel's cursor mirrored on the host, the plans each backward design walks, their cache by mask content, and
the tile plans read off a mask's tile segments against a classification of its dense form."""

import dataclasses

import numpy as np
import pytest
import torch
from utils import random_range_mask, small_mask

import longca_triton as lt
from longca_triton.kernels.dense.op import resolve_config as dense_resolve_config
from longca_triton.kernels.dense.plan import get_tile_plan
from longca_triton.kernels.gluon import config as GC
from longca_triton.kernels.gluon import op as G
from longca_triton.kernels.gluon.plan import build_ws_plan, get_ws_plan, merge_runs, pad_single, split_head, walk
from longca_triton.masks import STATIC_MASK_NAMES


def _expected(mask, bm, bn):
    """Per query tile: the (tile, partial) list the plain-Triton forward visits (full runs, then
    partial runs), from the dense plan's own CSR run lists."""
    plan = get_tile_plan(mask, bm, bn, "cpu")
    out = []
    for m in range(plan.num_m):
        seq = []
        for (ptr, start, end), partial in ((plan.q_full, False), (plan.q_part, True)):
            for r in range(int(ptr[m]), int(ptr[m + 1])):
                seq += [(n, partial) for n in range(int(start[r]), int(end[r]))]
        out.append(seq)
    return plan, out


MASKS = [pytest.param(name, 300, 300, id=f"S=300-{name}") for name in STATIC_MASK_NAMES]
MASKS += [pytest.param("random", sq, sk, id=f"Sq={sq}-Sk={sk}-random") for sq, sk in ((257, 129), (64, 500))]


@pytest.mark.parametrize("bn", [64, 128], ids=lambda b: f"BLOCK_N={b}")
@pytest.mark.parametrize("name,sq,sk", MASKS)
def test_merged_runs_visit_the_plans_tiles(name, sq, sk, bn):
    mask = random_range_mask(sq, sk, seed=sq) if name == "random" else small_mask(name, sq, seed=1)
    plan, expected = _expected(mask, GC.BLOCK_M, bn)
    ws = build_ws_plan(plan)
    arrays = [t.numpy() for t in ws.tensors()[3:]]
    ptr, nfull, count, start, end = arrays
    assert len(start) == len(end) == int(ptr[-1]) + 1, "one sentinel run after the last"
    for m, seq in enumerate(expected):
        assert int(count[m]) == len(seq)
        assert walk(*arrays, m) == seq, f"query tile {m}"
    # what the tiles cover is the block tables' touched set (nothing skipped, nothing extra)
    bt = mask.block_tables(GC.BLOCK_M, bn)
    for m, seq in enumerate(expected):
        touched = set(bt.q_full_idx[bt.q_full_ptr[m]:bt.q_full_ptr[m + 1]].tolist())
        touched |= set(bt.q_part_idx[bt.q_part_ptr[m]:bt.q_part_ptr[m + 1]].tolist())
        assert {n for n, _ in seq} == touched
    assert ws.has_partial == any(p for seq in expected for _, p in seq)
    # the key-major merge (dK/dV) visits each key tile's query tiles, full runs first
    wk = build_ws_plan(plan, "k")
    karr = [t.numpy() for t in wk.tensors()[3:]]
    for n in range(plan.num_n):
        seq = []
        for (ptr, start, end), partial in ((plan.k_full, False), (plan.k_part, True)):
            for r in range(int(ptr[n]), int(ptr[n + 1])):
                seq += [(m, partial) for m in range(int(start[r]), int(end[r]))]
        assert walk(*karr, n) == seq, f"key tile {n}"


@pytest.mark.parametrize("name", ["causal", "prefix_lm_causal", "sliding_window_causal", "random"])
def test_split_plans_cover_the_tiles_once(name):
    """The split launch's plans (``part="full"`` / ``"partial"``) visit together exactly the tiles
    of the whole plan, each once, the first only full ones and the second only partial ones;
    ``fwd_plan`` gives the pair only with ``split_partial`` and only where partial tiles exist."""
    mask = random_range_mask(700, 900, seed=3) if name == "random" else small_mask(name, 1000, seed=1)
    plan, _ = _expected(mask, 192, 128)
    arrays = {part: [t.numpy() for t in build_ws_plan(plan, part=part).tensors()[3:]]
              for part in ("all", "full", "partial")}
    for m in range(plan.num_m):
        whole = walk(*arrays["all"], m)
        full, partial = walk(*arrays["full"], m), walk(*arrays["partial"], m)
        assert all(not p for _, p in full) and all(p for _, p in partial)
        assert sorted(full + partial) == sorted(whole)
    assert build_ws_plan(plan, part="full").has_partial is False
    # the first launch walks every query tile (it writes the base the second merges into), the
    # second only those with partial tiles, heaviest first as the whole plan orders them
    whole_order = build_ws_plan(plan).order.tolist()
    assert build_ws_plan(plan, part="full").order.tolist() == whole_order
    with_partial = {m for m in range(plan.num_m) if any(p for _, p in walk(*arrays["all"], m))}
    assert build_ws_plan(plan, part="partial").order.tolist() == [m for m in whole_order if m in with_partial]
    cfg = GC.resolve_config(128, torch.bfloat16, {"split_partial": True, "mask_head": 0}, mask=mask)
    pair = G.fwd_plan(mask, cfg, "cpu")
    assert isinstance(pair, tuple) and [p.has_partial for p in pair] == [False, True]
    one = GC.resolve_config(128, torch.bfloat16, {"split_partial": False, "mask_head": 0}, mask=mask)
    assert not isinstance(G.fwd_plan(mask, one, "cpu"), tuple)
    full = lt.make_mask("full", 1024)
    assert not isinstance(G.fwd_plan(full, GC.resolve_config(128, torch.bfloat16, {"split_partial": True}, mask=full),
                                     "cpu"), tuple)
    with pytest.raises(ValueError, match="part must be one of"):
        build_ws_plan(plan, part="half")


@pytest.mark.parametrize("head_tiles", [1, 2], ids=lambda k: f"head={k}")
@pytest.mark.parametrize("name", ["causal", "prefix_lm_causal", "sliding_window_causal", "full_document", "random",
                                  "tiny_documents"])
@pytest.mark.parametrize("block_m", [128, 192])
def test_mask_head_plans_cover_the_tiles_once(name, block_m, head_tiles):
    """``part="head"`` puts each query tile's first ``head`` partial key tiles in front of its full tiles
    (no partial runs left: the loop never masks) and ``part="rest"`` holds its other partial tiles:
    together exactly the whole plan's tiles, each once; the rest's order lists only the query tiles
    that have any, heaviest first. With ``head=2`` a query tile that walks one key tile walks a second
    that none of its rows may see (the forward's step 1 has no branch), and no other gets one."""
    if name == "random":
        mask = random_range_mask(700, 900, seed=3)
    elif name == "tiny_documents":
        # documents of 1..60 tokens: many query tiles walk one key tile (and the last pads backwards)
        mask = lt.make_mask("causal_document", 1000, doc_lens=[37, 5, 60, 1] * 5 + [381, 104])
    else:
        mask = small_mask(name, 1000, seed=1)
    plan, _ = _expected(mask, block_m, 128)
    head, rest = (build_ws_plan(plan, part=part, head=head_tiles) for part in ("head", "rest"))
    assert head.has_partial is False and head.mask_head == head_tiles and rest.mask_head == 0
    arrays = {k: [t.numpy() for t in p.tensors()[3:]] for k, p in (("all", build_ws_plan(plan)), ("head", head),
                                                                  ("rest", rest))}
    padded = 0
    for m in range(plan.num_m):
        whole = walk(*arrays["all"], m)
        h, r = [n for n, _ in walk(*arrays["head"], m)], [n for n, _ in walk(*arrays["rest"], m)]
        partial = [n for n, p in whole if p]
        assert h[:len(partial[:head_tiles])] == partial[:head_tiles]  # the head tiles first, in key order
        assert sorted(r) == partial[head_tiles:]
        if head_tiles == 2 and len(whole) == 1:
            # the pad: a tile this query tile does not visit (its neighbour, or past the keys)
            padded += 1
            assert len(h) == 2 and h[1] not in (n for n, _ in whole) and abs(h[1] - h[0]) == 1, (m, h, whole)
            h = h[:1]
        assert sorted(h + r) == sorted(n for n, _ in whole)
    assert padded == (0 if head_tiles == 1 else sum(len(walk(*arrays["all"], m)) == 1 for m in range(plan.num_m)))
    if name == "tiny_documents" and head_tiles == 2:
        assert padded > 0
    with_rest = {m for m in range(plan.num_m) if walk(*arrays["rest"], m)}
    assert rest.order.tolist() == [m for m in build_ws_plan(plan).order.tolist() if m in with_rest]
    # fwd_plan: the head plan alone where no tile has partial tiles beyond the head, else with the rest
    cfg = GC.resolve_config(128, torch.bfloat16, {"mask_head": head_tiles, "consumers": block_m // 64}, mask=mask)
    assert GC.fwd_block_m(cfg) == block_m
    pieces = G.fwd_plan(mask, cfg, "cpu")
    assert isinstance(pieces, tuple) and pieces[0].mask_head == head_tiles and len(pieces) == 1 + bool(with_rest)
    with pytest.raises(ValueError, match="forward's"):
        build_ws_plan(plan, major="k", part="head")
    with pytest.raises(ValueError, match="head must be one of"):
        build_ws_plan(plan, part="head", head=3)


def test_split_head_and_pad_single_by_hand():
    """``split_head`` takes a tile's first k partial tiles across its runs; ``pad_single`` gives a
    one-tile walk its next neighbour, its previous one at the last key tile, the tile past the keys
    where there is only one."""
    # tile 0: runs [0, 1) and [3, 5); tile 1: [2, 6); tile 2: none
    part = (np.array([0, 2, 3, 3]), np.array([0, 3, 2]), np.array([1, 5, 6]))
    head, rest = split_head(part, 3, 2)
    assert [a.tolist() for a in head] == [[0, 2, 3, 3], [0, 3, 2], [1, 4, 4]]
    assert [a.tolist() for a in rest] == [[0, 1, 2, 2], [4, 4], [5, 6]]
    head1, rest1 = split_head(part, 3, 1)
    assert [a.tolist() for a in head1] == [[0, 1, 2, 2], [0, 2], [1, 3]]
    assert [a.tolist() for a in rest1] == [[0, 1, 2, 2], [3, 3], [5, 6]]
    # tiles walking [4, 5) (middle), [7, 8) (the last of 8), [2, 4) (two: no pad), nothing
    runs = (np.array([0, 1, 2, 3, 3]), np.array([4, 7, 2]), np.array([5, 8, 4]))
    pad = pad_single(runs, 4, 8)
    assert [a.tolist() for a in pad] == [[0, 1, 2, 2, 2], [5, 6], [6, 7]]
    one_key = pad_single((np.array([0, 1]), np.array([0]), np.array([1])), 1, 1)
    assert [a.tolist() for a in one_key] == [[0, 1], [1], [2]]


def test_merge_runs_empty_tiles_and_no_runs():
    # tile 0: nothing; tile 1: a full run and a partial run; tile 2: nothing
    full = (np.array([0, 0, 1, 1]), np.array([2]), np.array([5]))
    part = (np.array([0, 0, 1, 1]), np.array([7]), np.array([8]))
    ptr, nfull, count, start, end = merge_runs(full, part, 3)
    assert ptr.tolist() == [0, 0, 2, 2] and nfull.tolist() == [0, 1, 0] and count.tolist() == [0, 4, 0]
    assert walk(ptr, nfull, count, start, end, 1) == [(2, False), (3, False), (4, False), (7, True)]
    assert walk(ptr, nfull, count, start, end, 0) == [] == walk(ptr, nfull, count, start, end, 2)
    z = np.zeros(1, np.int64)
    ptr, nfull, count, start, end = merge_runs((np.zeros(3, np.int64), z[:0], z[:0]),
                                               (np.zeros(3, np.int64), z[:0], z[:0]), 2)
    assert count.tolist() == [0, 0] and start.tolist() == [0] == end.tolist()


@pytest.mark.parametrize("name,want", [("causal", 2), ("prefix_lm_causal", 2), ("sliding_window_causal", 0),
                                       ("full", 0), ("causal_document", 0)])
def test_dq_mask_head_plan(name, want):
    """At D = 128 the dQ kernel walks the head plan (its first ``head`` steps masked without a branch)
    where every query tile has at most two partial 64-key tiles (16K causal: exactly two each), else the
    merged plan (no second launch for dQ); at D = 64 always the merged plan; the head plan covers every
    tile once."""
    mask = lt.make_mask(name, 16384)
    tiles = GC.bwd_tiles(128)
    plan = G.dq_plan(mask, 128, "cpu")
    assert tiles["dq_mask_head"] and not GC.bwd_tiles(64)["dq_mask_head"]
    assert plan.mask_head == want and (plan.has_partial is False if want else True)
    assert G.dq_plan(mask, 64, "cpu").mask_head == 0
    cfg = GC.resolve_config(128, torch.bfloat16, mask=mask)
    assert cfg["bwd_design"] == "mixed"
    _, dq, _ = G.plans_for_gluon(mask, 128, cfg, dense_resolve_config(128, torch.bfloat16, None), "cpu")
    assert dq is plan
    if want:
        whole = get_ws_plan(mask, GC.BLOCK_M, tiles["dq_block_n"], "cpu")
        arrays = [t.numpy() for t in plan.tensors()[3:]]
        all_arrays = [t.numpy() for t in whole.tensors()[3:]]
        for m in range(whole.tiles.num_m):
            h, w = [n for n, _ in walk(*arrays, m)], walk(*all_arrays, m)
            partial = [n for n, p in w if p]
            assert h[:len(partial)] == partial  # the partial tiles first (at most two: no second launch)
            if want == 2 and len(w) == 1:
                h = h[:1]  # the pad: a neighbour none of the rows may see
            assert sorted(h) == sorted(n for n, _ in w)


RAGGED_MASKS = [
    ("full", 3001, 3001, False, (-1, -1)), ("full", 1023, 1024, False, (-1, -1)), ("full", 113, 211, False, (-1, -1)),
    ("full", 127, 513, False, (-1, -1)),
    # a window whose last key tile is cut by the sequence's end and seen whole by every row
    ("window", 1, 239, False, (150, 91)), ("window", 1, 239, False, (157, 145)), ("window", 3, 799, False, (640, 370)),
    ("window", 127, 513, False, (387, 445)), ("window", 1, 239, True, (163, 176)),
]


@pytest.mark.parametrize("name,sq,sk,causal,window", RAGGED_MASKS, ids=lambda x: str(x))
def test_dq_plan_walks_every_tile_with_ragged_ends(name, sq, sk, causal, window):
    """Where the sequence's ragged end cuts a key tile, the tile plan lists it as partial even where the
    mask's block tables call it full: the dQ plan walks it (masked) beside every other tile, whichever
    plan it picks; a head plan never leaves one behind."""
    mask = lt.masks.window_mask(sq, sk, causal, window)
    plan = G.dq_plan(mask, 128, "cpu")
    whole = get_ws_plan(mask, GC.BLOCK_M, GC.bwd_tiles(128)["dq_block_n"], "cpu")
    arrays, all_arrays = [t.numpy() for t in plan.tensors()[3:]], [t.numpy() for t in whole.tensors()[3:]]
    for m in range(whole.tiles.num_m):
        h, w = [n for n, _ in walk(*arrays, m)], walk(*all_arrays, m)
        partial = [n for n, p in w if p]
        if plan.mask_head:
            assert sorted(h[:len(partial)]) == sorted(partial)  # every partial tile among the masked head steps
            if plan.mask_head == 2 and len(w) == 1:
                h = h[:1]  # the pad: a neighbour none of the rows may see
        assert sorted(h) == sorted(n for n, _ in w)


@pytest.mark.parametrize("design", ["mixed", "split", "plain"])
def test_backward_plans_per_design(design):
    """Each backward design gets the plans its kernels walk: the mixed one the Gluon dQ kernel's merged
    runs (128-row query tiles, 64-row key tiles) and the dense dK/dV kernel's :class:`TilePlan` at the
    dense config's dK/dV tiles (a dK/dV plan of other tiles is refused before any kernel runs); the
    split one the Gluon key-major plan of ``dkdv_block_mq`` rows; the plain one the dense plans."""
    from longca_triton.kernels.dense import op as D
    from longca_triton.kernels.dense.plan import TilePlan
    from longca_triton.kernels.gluon.plan import WsPlan

    mask = lt.make_mask("causal_document", 700, seed=1)
    cfg = GC.resolve_config(128, torch.bfloat16, dict(bwd_design=design))
    bwd_cfg = D.resolve_config(128, torch.bfloat16, dict(DKDV_BLOCK_M=32, DKDV_BLOCK_N=64))
    fwd, a, b = G.plans_for_gluon(mask, 128, cfg, bwd_cfg, "cpu")
    assert isinstance(fwd, WsPlan)
    if design == "mixed":
        assert isinstance(a, WsPlan) and (a.tiles.block_m, a.tiles.block_n) == (GC.BLOCK_M, 64)
        assert isinstance(b, TilePlan) and (b.block_m, b.block_n) == (32, 64)
        other = D.get_tile_plan(mask, 64, 64, "cpu")
        q = torch.zeros(1, 700, 2, 128)
        with pytest.raises(ValueError, match="dK/dV"):
            G.gluon_bwd(q, q, q, q, q, torch.zeros(1, 2, 700), a, other, 0.1, cfg, bwd_cfg=bwd_cfg)
    elif design == "split":
        assert isinstance(a, WsPlan) and isinstance(b, WsPlan)
        assert (b.tiles.block_m, b.tiles.block_n) == (cfg["dkdv_block_mq"], GC.BLOCK_M)
    else:
        assert isinstance(a, TilePlan) and isinstance(b, TilePlan)


def test_equal_masks_share_cached_plans():
    """A mask built again with the same content (a new object, as a training step builds its batch's)
    gets the configs and plans built for the first: the same objects, no host work; another content
    gets its own."""
    from longca_triton.kernels.core.plan_cache import content_key

    cu = torch.tensor([0, 300, 301, 1000, 1500], dtype=torch.int32)
    first, again = (lt.masks.from_cu_seqlens(cu, causal=True) for _ in range(2))
    assert first is not again and content_key(first) is content_key(again)
    q, k = torch.empty(1, 1500, 4, 64, dtype=torch.bfloat16), torch.empty(1, 1500, 2, 64, dtype=torch.bfloat16)
    cfg, bwd_cfg = G._configs_for(q, k, k, first, None, None)
    assert G._configs_for(q, k, k, again, None, None) == (cfg, bwd_cfg)
    flat = lambda plans: [p for x in plans for p in (x if isinstance(x, tuple) else (x,))]  # noqa: E731
    for design in ("mixed", "split", "plain"):
        c = dict(cfg, bwd_design=design)
        plans = flat(G.plans_for_gluon(first, 64, c, bwd_cfg, "cpu"))
        assert all(a is b for a, b in zip(plans, flat(G.plans_for_gluon(again, 64, c, bwd_cfg, "cpu"))))
    assert get_tile_plan(first, 48, 80, "cpu") is get_tile_plan(again, 48, 80, "cpu")
    assert not again.__dict__.get("_lowering_cache")  # nothing was lowered for the second mask
    other = lt.masks.from_cu_seqlens(cu, causal=False)
    assert content_key(other) is not content_key(first)
    assert get_tile_plan(other, 64, 64, "cpu") is not get_tile_plan(first, 64, 64, "cpu")


def _reference_lists(mask, bm, bn):
    """The tile plan's runs and launch orders from the dense mask (each tile full when all of its pairs
    in range are allowed, touched when any is): per major tile ``(ptr, start, end)`` of its full and
    partial minor tiles, the query-major lists with a ragged last key tile moved to the partial ones."""
    dense = mask.to_dense().numpy()
    sq, sk = dense.shape
    num_m, num_n = -(-sq // bm), -(-sk // bn)
    full = np.zeros((num_m, num_n), dtype=bool)
    touched = np.zeros((num_m, num_n), dtype=bool)
    for m in range(num_m):
        for n in range(num_n):
            tile = dense[m * bm:(m + 1) * bm, n * bn:(n + 1) * bn]
            full[m, n], touched[m, n] = tile.all(), tile.any()
    q_full, q_part = full.copy(), touched & ~full
    if sk % bn:
        q_part[:, -1] |= q_full[:, -1]
        q_full[:, -1] = False

    def runs(tiles):
        ptr, start, end = [0], [], []
        for row in tiles:
            edges = np.flatnonzero(np.diff(np.concatenate([[0], row.astype(np.int8), [0]])))
            start += edges[0::2].tolist()
            end += edges[1::2].tolist()
            ptr.append(len(start))
        return ptr, start, end

    def order(f, p):
        return np.argsort(-(f.sum(1) * 4 + p.sum(1) * 5), kind="stable").tolist()

    return dict(q_full=runs(q_full), q_part=runs(q_part), q_order=order(q_full, q_part),
                k_full=runs(full.T), k_part=runs((touched & ~full).T), k_order=order(full.T, (touched & ~full).T),
                area_tiles=int(touched.sum()))


AWKWARD = {
    "one-row": lambda: lt.masks.RangeMask(1, 239, [(0, 1, 3, 200, "FULL")]),
    "ragged-both": lambda: lt.masks.window_mask(127, 513, False, (387, 445)),
    "sq>sk-causal": lambda: lt.masks.window_mask(300, 100, True),
    "sq<sk-causal": lambda: lt.masks.window_mask(100, 300, True),
    "tiny-docs": lambda: lt.masks.from_cu_seqlens(torch.tensor([0, 1, 2, 2, 40, 41, 130, 131, 260]), causal=True),
    "varlen-window": lambda: lt.masks.from_cu_seqlens(torch.tensor([0, 50, 51, 170, 300]),
                                                      torch.tensor([0, 20, 90, 91, 250]), window_size=(30, 5)),
    "bicausal-empty": lambda: lt.masks.RangeMask(200, 200, [(0, 100, 0, 50, "BICAUSAL"),
                                                            (100, 200, 50, 200, "INVCAUSAL")]),
    "overlapping": lambda: random_range_mask(257, 129, seed=5, n_slices=6),
    "question-docs": lambda: small_mask("share_question", 300, seed=3),
}


@pytest.mark.parametrize("bm,bn", [(64, 64), (16, 32), (7, 5), (128, 16)], ids=lambda x: str(x))
@pytest.mark.parametrize("name", list(AWKWARD))
def test_tile_plan_from_segments_matches_a_dense_reference(name, bm, bn):
    """The tile plan read off the mask's tile segments (query- and key-major, from its linear pieces where
    it has them) lists the runs, orders and tile count of a tile-by-tile classification of the dense
    mask, and so does the plan read off its block tables' per-tile lists."""
    from longca_triton.kernels.dense.plan import build_tile_plan, mask_arrays

    mask = AWKWARD[name]()
    want = _reference_lists(mask, bm, bn)
    arrays = mask_arrays(mask)
    lists_only = dataclasses.replace(arrays, tile_segments=None, key_tile_segments=None)
    for plan in (build_tile_plan(arrays, bm, bn, "cpu"), build_tile_plan(lists_only, bm, bn, "cpu")):
        for key, value in want.items():
            got = getattr(plan, key)
            got = [t.tolist() for t in got] if isinstance(got, tuple) else got if isinstance(got, int) else got.tolist()
            assert got == (list(value) if isinstance(value, tuple) else value), key
        assert all(t.dtype == torch.int32 for t in plan.q_tensors() + plan.k_tensors())

"""Block-sparse Triton kernels (longca_triton/kernels/block_sparse/op.py) against the float64 reference on to_dense().

On a CPU machine the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported). There bf16 ``tl.dot`` is unreliable and autotuning is off, so the checks use float32
(and one float16 case) with pinned small tiles. Each case compares out, lse, dq, dk, dv, with a
gradient flowing into lse too (the ``dlse`` path).
"""


import torch

import numpy as np
import pytest

from longca_triton.kernels import block_sparse as BS
from longca_triton.kernels.block_sparse import config as BSC
from longca_triton.kernels.block_sparse import op as BSO
from longca_triton.kernels.block_sparse.plan import build_side_tables, get_side_tables
from longca_triton.masks import BlockSparseMask, make_mask
from longca_triton.reference import naive_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def tiles(m=32, n=32, heads=1, dq=None, dkdv=None, stages=2):
    """A pinned config: forward tiles m x n, dQ ``dq`` and dK/dV ``dkdv`` (rows, cols) pairs, ``heads``
    query heads a dQ tile; ``stages`` 3 reads every pass's lists in register chunks (``config.list_chunk``)."""
    dq = dq or (m, n)
    dkdv = dkdv or (m, n)
    return dict(BLOCK_M=m, BLOCK_N=n, num_warps=4, num_stages=stages,
                DQ_BLOCK_M=dq[0], DQ_BLOCK_N=dq[1], DQ_HEADS=heads, dq_num_warps=4, dq_num_stages=stages,
                DKDV_BLOCK_M=dkdv[0], DKDV_BLOCK_N=dkdv[1], dkdv_num_warps=4, dkdv_num_stages=stages)


def check(mask, hq, hkv, d=32, cfg=None, dtype=torch.float32, batch=1, seed=0, tol=None, op=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, mask.seqlen_q, hq, d, generator=g).to(DEV, dtype).requires_grad_()
    k = torch.randn(batch, mask.seqlen_k, hkv, d, generator=g).to(DEV, dtype).requires_grad_()
    v = torch.randn(batch, mask.seqlen_k, hkv, d, generator=g).to(DEV, dtype).requires_grad_()
    fn = BS.block_sparse_attention_op if op else BS.block_sparse_attention
    out, lse = fn(q, k, v, mask, return_lse=True, config=cfg)
    dout = torch.randn(out.shape, generator=g).to(DEV, dtype)
    dlse = torch.randn(lse.shape, generator=g).to(DEV)
    loss = (out.float() * dout.float()).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * dlse).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ro, rl = naive_attention(q64, k64, v64, mask, return_lse=True)
    loss = (ro * dout.double()).sum() + (torch.where(torch.isinf(rl), 0.0, rl) * dlse.double()).sum()
    rq, rk, rv = torch.autograd.grad(loss, (q64, k64, v64))

    tol = tol or (1e-4 if dtype == torch.float32 else 5e-3)
    assert torch.equal(torch.isinf(lse), torch.isinf(rl)), "rows attending nothing must have lse = -inf"
    fin = torch.isfinite(rl)
    assert (lse.double()[fin] - rl[fin]).abs().max().item() < tol * 10
    for name, got, ref in (("out", out, ro), ("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert not torch.isnan(got).any(), f"{name} has NaN"
        err = ((got.double() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"
    return out, lse, dq, dk, dv


# ------------------------------------------------------------------------------ uniform blocks
@pytest.mark.parametrize("block,S", [(16, 200), (32, 250), (64, 300), (128, 300)],
                         ids=lambda x: str(x))
def test_uniform_tile_equals_block(block, S):
    """Tile = block (the GPU setting) for every power-of-two block; S is ragged in every case."""
    mask = make_mask("block_sparse", S, block=block, density=0.5, patterns=2, seed=block)
    check(mask, hq=4, hkv=2, cfg=tiles(block, block, dq=(block, min(block, 64)), dkdv=(block, min(block, 64))))


@pytest.mark.parametrize("density", [0.1, 0.5, 1.0], ids=lambda d: f"density{d}")
def test_uniform_densities(density):
    mask = make_mask("block_sparse", 192, block=32, density=density, patterns=1, seed=3)
    check(mask, hq=4, hkv=2, cfg=tiles(32, 32))


@pytest.mark.parametrize("layout", ["mha-P=H", "gqa-P=Hkv", "gqa-P=Hq", "gqa-P=1", "mqa-P=1"])
def test_head_layouts(layout):
    hq, hkv, P = {"mha-P=H": (3, 3, 3), "gqa-P=Hkv": (6, 2, 2), "gqa-P=Hq": (4, 2, 4),
                  "gqa-P=1": (4, 2, 1), "mqa-P=1": (4, 1, 1)}[layout]
    mask = make_mask("block_sparse", 160, block=32, density=0.4, patterns=P, seed=7)
    check(mask, hq=hq, hkv=hkv, cfg=tiles(32, 32))


@pytest.mark.parametrize("layout", ["gqa-P=Hkv", "gqa-P=1", "gqa-P=Hq"])
def test_stacked_dq_heads(layout):
    """DQ_HEADS=2: two query heads of a group in one 2 x 32-row dQ tile (lowered to 1 where the
    patterns differ, e.g. P = Hq)."""
    hq, hkv, P = {"gqa-P=Hkv": (8, 2, 2), "gqa-P=1": (4, 2, 1), "gqa-P=Hq": (4, 2, 4)}[layout]
    mask = make_mask("block_sparse", 150, block=32, density=0.5, patterns=P, seed=11)
    check(mask, hq=hq, hkv=hkv, cfg=tiles(32, 32, heads=2))


def test_sub_tiles_of_a_block():
    """Block 64 processed in 32 x 16 tiles (runs of kept blocks cut into sub-tiles)."""
    mask = make_mask("block_sparse", 256, block=64, density=0.5, patterns=2, seed=5)
    check(mask, hq=2, hkv=2, cfg=tiles(32, 16, dq=(16, 32), dkdv=(32, 16)))


def test_batch_and_head_dim_64_fp16():
    mask = make_mask("block_sparse", 128, block=32, density=0.5, patterns=2, seed=2)
    check(mask, hq=4, hkv=2, d=64, dtype=torch.float16, batch=2, cfg=tiles(32, 32, heads=2))


# ------------------------------------------------------------------------------ variable blocks
def random_bounds(S, rng, lo=1, hi=90):
    cuts = [0]
    while cuts[-1] < S:
        cuts.append(min(S, cuts[-1] + int(rng.integers(lo, hi))))
    return cuts


@pytest.mark.parametrize("density", [0.15, 0.5, 1.0], ids=lambda d: f"density{d}")
def test_varblock_random_bounds(density):
    """Random bounds from 1 to ~90 tokens (blocks smaller and larger than a tile, last one short)."""
    rng = np.random.default_rng(int(density * 100))
    b = random_bounds(277, rng)
    n = len(b) - 1
    keep = max(1, round(density * n))
    scores = rng.random((2, n, n))
    bm = np.zeros((2, n, n), dtype=bool)
    np.put_along_axis(bm, np.argsort(-scores, axis=2)[:, :, :keep], True, axis=2)
    mask = BlockSparseMask(b, b, torch.from_numpy(bm), name="varblock_sparse")
    check(mask, hq=4, hkv=2, cfg=tiles(32, 32, heads=2))


@pytest.mark.parametrize("rows,heads", [(16, 4), (32, 4), (16, 2)], ids=lambda x: str(x))
def test_varblock_dq_stacked_heads(rows, heads):
    """The dQ pass of variable blocks with ``heads`` query heads stacked in a tile of ``rows`` positions
    each, no tail tiles (the Hopper default's shape: 32 x 4 there): blocks of 20..70
    rows leave remainders in most tiles, a GQA group of 4 shares each KV head's pattern, and some rows
    keep no block."""
    rng = np.random.default_rng(rows * heads)
    b = random_bounds(233, rng, 20, 70)
    n = len(b) - 1
    bm = torch.from_numpy(rng.random((2, n, n)) < 0.4)
    bm[:, 1, :] = False  # a query block attending nothing: lse -inf, zero dq
    mask = BlockSparseMask(b, b, bm, name="varblock_sparse")
    cfg = dict(tiles(32, 32), DQ_BLOCK_M=rows, DQ_HEADS=heads, ragged_bwd=True)
    assert BSC.pass_plans(BS.resolve_config(mask, 32, cfg))["dq"].tail_rows == 0  # stacked: no tail launch
    check(mask, hq=8, hkv=2, cfg=cfg)


def test_varblock_dq_stack_follows_the_gqa_group(monkeypatch):
    """Variable blocks' Hopper default stacks as many query heads in a 128-row dQ tile as the call's GQA
    group and heads per pattern allow; a config that sets the dQ row tile alone gets one head."""
    monkeypatch.setattr(BSC, "interpreting", lambda: False)
    for (hq, hkv, P), want in {(64, 8, 8): (32, 4, 0), (16, 8, 8): (64, 2, 0), (8, 8, 8): (128, 1, 64),
                               (64, 8, 1): (32, 4, 0), (12, 4, 4): (128, 1, 64)}.items():
        mask = make_mask("varblock_sparse", 1024, block=256, min_block=128, density=0.5, patterns=P, seed=1)
        q, k = torch.empty(1, 1024, hq, 128), torch.empty(1, 1024, hkv, 128)
        cfg = BS.resolve_config(mask, 128, q=q, k=k)
        assert (cfg["DQ_BLOCK_M"], cfg["DQ_HEADS"], BSC.pass_plans(cfg)["dq"].tail_rows) == want, (hq, hkv, P)
        assert cfg["DQ_BLOCK_M"] * BSC.stack(cfg["DQ_HEADS"], hq // hkv, hq // P) == 128
        assert BS.resolve_config(mask, 128, heads=(hq, hkv)) == cfg  # the harness's planning, without tensors
    mask = make_mask("varblock_sparse", 1024, block=256, min_block=128, density=0.5, patterns=8, seed=1)
    assert (BS.default_config(mask, 128)["DQ_BLOCK_M"], BS.default_config(mask, 128)["DQ_HEADS"]) == (32, 4)
    one = BS.resolve_config(mask, 128, {"DQ_BLOCK_M": 128})
    assert (one["DQ_HEADS"], BSC.pass_plans(one)["dq"].tail_rows) == (1, 64)
    assert BSC.pass_plans(BS.resolve_config(mask, 128, {"DQ_BLOCK_M": 16}))["dq"].tail_rows == 0
    assert BS.resolve_config(mask, 128, {"DQ_BLOCK_M": 64, "DQ_HEADS": 2})["DQ_HEADS"] == 2
    # uniform blocks keep one head a dQ tile
    uni = make_mask("block_sparse", 1024, block=128, density=0.5, patterns=8, seed=1)
    assert BS.resolve_config(uni, 128, q=torch.empty(1, 1024, 64, 128), k=torch.empty(1, 1024, 8, 128))["DQ_HEADS"] == 1


def test_varblock_generator():
    mask = make_mask("varblock_sparse", 300, block=48, min_block=20, density=0.4, patterns=4, seed=2)
    assert mask.uniform_block is None
    check(mask, hq=4, hkv=2, cfg=tiles(32, 32))


def test_varblock_rectangular():
    """Sq != Sk with different bounds on each axis."""
    rng = np.random.default_rng(9)
    qb, kb = random_bounds(150, rng, 10, 60), random_bounds(260, rng, 10, 60)
    bm = torch.from_numpy(rng.random((1, len(qb) - 1, len(kb) - 1)) < 0.5)
    bm[:, :, 0] |= ~bm.any(-1)  # nobody empty here: covered by the next test
    mask = BlockSparseMask(qb, kb, bm)
    check(mask, hq=2, hkv=1, cfg=tiles(32, 32))


def test_empty_rows_and_columns():
    """A query block keeping nothing: zeros and lse = -inf; a key block nobody keeps: dK = dV = 0."""
    b = [0, 40, 100, 130, 200, 211]
    bm = torch.rand(3, 5, 5, generator=torch.Generator().manual_seed(0)) < 0.6
    bm[:, 2] = False  # query block 2 keeps nothing (every pattern)
    bm[0, 0] = False  # and query block 0 in pattern 0 only
    bm[:, :, 1] = False  # key block 1 is kept by nobody
    mask = BlockSparseMask(b, b, bm)
    out, lse, dq, dk, dv = check(mask, hq=6, hkv=3, d=16, cfg=tiles(32, 32, heads=2))
    assert torch.all(out[:, 100:130] == 0) and torch.all(torch.isinf(lse[:, :, 100:130]))
    assert torch.all(dq[:, 100:130] == 0)
    assert torch.all(dk[:, 40:100] == 0) and torch.all(dv[:, 40:100] == 0)


# ------------------------------------------------------------------------------ packed lists
def walked_pairs(t, mask, major):
    """The (pattern, row, column) pairs tables ``t`` make the kernels walk, each asserted to be walked
    once, and the mask's own pairs in the same orientation (``major`` "k": transposed)."""
    dense = mask.to_dense()
    if major == "k":
        dense = dense.transpose(1, 2)
    got = torch.zeros_like(dense)
    for p in range(t.num_patterns):
        for tile in range(t.num_tiles):
            r0, r1, blk = int(t.row_start[tile]), int(t.row_end[tile]), int(t.row_block[tile])
            assert 0 < r1 - r0 <= t.tile_rows
            lo, hi = int(t.ptr[p * t.num_row_blocks + blk]), int(t.ptr[p * t.num_row_blocks + blk + 1])
            for e in range(lo, hi):
                c = t.columns(e)
                assert 0 < len(c) <= t.tile_cols
                assert not got[p, r0:r1, c].any(), "a pair is covered twice"
                got[p, r0:r1, c] = True
    return got, dense


def packed_mask(S=333, Sk=None, min_block=32, seed=0, patterns=2, density=0.4):
    """Variable blocks of at least ``min_block`` (so lists pack at tiles up to that size)."""
    if Sk is None:
        return make_mask("varblock_sparse", S, block=min_block + 19, min_block=min_block, density=density,
                         patterns=patterns, seed=seed)
    rng = np.random.default_rng(seed)
    qb, kb = random_bounds(S, rng, min_block, 2 * min_block), random_bounds(Sk, rng, min_block, 2 * min_block)
    for b in (qb, kb):  # the last block may come out short: fold it into its neighbour
        if b[-1] - b[-2] < min_block:
            del b[-2]
    bm = torch.from_numpy(rng.random((patterns, len(qb) - 1, len(kb) - 1)) < density)
    return BlockSparseMask(qb, kb, bm, name="varblock_sparse")


#: the variable-block backward: dQ plain lists with short entries last, dK/dV whole entries first, tails
RAGGED = {"ragged_bwd": True}


def packed_flags(mask, cfg):
    """Which main passes' lists are packed; the ragged backward's tail launches (``dq_tail``, ``dkdv_tail``)
    are checked on their own: dK/dV tails walk packed lists as the main dK/dV pass does, dQ tails plain ones."""
    t = BS.tables_for(mask, BS.resolve_config(mask, 32, cfg), DEV)
    if "dkdv_tail" in t:
        assert t["dkdv_tail"].packed == t["dkdv"].packed
    if "dq_tail" in t:
        assert not t["dq_tail"].packed
    return {name: t[name].packed for name in ("fwd", "dq", "dkdv")}


PACKED_CASES = {
    # name: (mask kwargs, hq, hkv, config overlay); 64-row tiles make the ragged treatment's tails of 32
    "S=333-Hq=6-Hkv=2-32x32": (dict(), 6, 2, tiles(32, 32)),
    "S=333-Hq=4-Hkv=2-dq-heads2-chunk16": (dict(seed=1), 4, 2, tiles(32, 32, heads=2, stages=3)),
    "S=333-Hq=4-Hkv=2-32x16-dq16x32-dkdv32x16": (dict(seed=2), 4, 2, tiles(32, 16, dq=(16, 32), dkdv=(32, 16))),
    "Sq=190-Sk=301-Hq=2-Hkv=1": (dict(S=190, Sk=301, seed=4, patterns=1), 2, 1, tiles(32, 32)),
    "S=333-Hq=6-Hkv=2-ragged-tails32": (dict(seed=7), 6, 2, {**tiles(32, 32, dq=(64, 32), dkdv=(32, 64)), **RAGGED}),
    "S=333-Hq=4-Hkv=2-ragged-dq-heads2": (dict(seed=8), 4, 2, {**tiles(32, 32, heads=2, dkdv=(32, 64)), **RAGGED}),
    "Sq=190-Sk=301-Hq=2-Hkv=1-ragged-tails32": (dict(S=190, Sk=301, seed=7, patterns=1), 2, 1,
                                                {**tiles(32, 32, dq=(64, 32), dkdv=(32, 64)), **RAGGED}),
}


@pytest.mark.parametrize("case", list(PACKED_CASES), ids=list(PACKED_CASES))
def test_packed_lists_match_reference(case):
    """Packed lists (a key / query tile crossing from one run of kept blocks into the next) in the backward
    passes, against float64: GQA, stacked dQ heads, chunked lists, Sq != Sk; with ``ragged_bwd`` the dK/dV
    lists' whole entries first, the dQ lists plain with their short entries last, and the tail launches."""
    kw, hq, hkv, cfg = PACKED_CASES[case]
    mask = packed_mask(**kw)
    ragged = "ragged" in case
    assert packed_flags(mask, cfg) == {"fwd": False, "dq": not ragged, "dkdv": True}
    if "tails32" in case:
        t = BS.tables_for(mask, BS.resolve_config(mask, 32, cfg), DEV)
        assert all(t[name + "_tail"].num_tiles for name in ("dq", "dkdv")), "this case has tail tiles"
        assert t["dkdv"].full_first and t["dq"].short_cols == 16
    check(mask, hq=hq, hkv=hkv, cfg=cfg)
    if ragged:
        check(mask, hq=hq, hkv=hkv, cfg=cfg, op=True)


def test_packed_lists_fp16_batch_empty_rows_and_columns():
    """fp16, two batch entries, D = 64, a query block keeping nothing and a key block kept by nobody."""
    mask = packed_mask(S=300, seed=5, patterns=2, density=0.5)
    bm = mask.block_map.clone()
    bm[:, 1] = False
    bm[:, :, 2] = False
    mask = BlockSparseMask(mask.q_block_bounds, mask.k_block_bounds, bm, name="varblock_sparse")
    cfg = tiles(32, 32)
    assert packed_flags(mask, cfg) == {"fwd": False, "dq": True, "dkdv": True}
    out, lse, dq, dk, dv = check(mask, hq=4, hkv=2, d=64, dtype=torch.float16, batch=2, cfg=cfg)
    r0, r1 = mask.q_block_bounds[1], mask.q_block_bounds[2]
    c0, c1 = mask.k_block_bounds[2], mask.k_block_bounds[3]
    assert torch.all(out[:, r0:r1] == 0) and torch.all(torch.isinf(lse[:, :, r0:r1]))
    assert torch.all(dk[:, c0:c1] == 0) and torch.all(dv[:, c0:c1] == 0)


@pytest.mark.parametrize("major", ["q", "k"])
@pytest.mark.parametrize("tile", [(32, 32), (16, 32), (64, 16)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_packed_tables_cover_exactly_the_kept_area(major, tile):
    """Every kept pair once; every tile of a list full but its last; a tile crosses one run boundary
    at most; fewer tiles than the unpacked lists wherever runs are ragged."""
    mask = packed_mask(S=517, seed=6, patterns=3)
    bm = mask.block_map if major == "q" else mask.block_map.transpose(1, 2).contiguous()
    rows, cols = ((mask.q_block_bounds, mask.k_block_bounds) if major == "q"
                  else (mask.k_block_bounds, mask.q_block_bounds))
    t = build_side_tables(rows, cols, bm, *tile, "cpu", pack_cols=True)
    plain = build_side_tables(rows, cols, bm, *tile, "cpu")
    assert t.packed and not plain.packed and t.num_entries < plain.num_entries
    got, dense = walked_pairs(t, mask, major)
    assert torch.equal(got, dense)
    for lo, hi in zip(t.ptr[:-1].tolist(), t.ptr[1:].tolist()):  # every list
        for e in range(lo, hi):
            c = t.columns(e)
            assert len(c) == tile[1] or (e == hi - 1 and 0 < len(c) < tile[1])
            assert sum(1 for a, b in zip(c, c[1:]) if b != a + 1) <= 1


@pytest.mark.parametrize("rows,tail", [(64, 32), (32, 16), (128, 64)], ids=lambda x: str(x))
def test_tail_row_tiles_split_the_rows(rows, tail):
    """The big and tail tables cover every row of every block once; tail pieces are block remainders
    of at most ``tail`` rows, and big pieces are full tiles but for a remainder above ``tail``."""
    mask = packed_mask(S=3001, min_block=40, seed=0, patterns=3)
    b = mask.q_block_bounds
    big = build_side_tables(b, b, mask.block_map, rows, 32, "cpu", True, "big", tail)
    small = build_side_tables(b, b, mask.block_map, rows, 32, "cpu", True, "tail", tail)
    assert big.tile_rows == rows and small.tile_rows == tail and small.num_tiles > 0
    cover = np.zeros(3001, dtype=int)
    for t in (big, small):
        for i in range(t.num_tiles):
            r0, r1, blk = int(t.row_start[i]), int(t.row_end[i]), int(t.row_block[i])
            assert b[blk] <= r0 < r1 <= b[blk + 1] and r1 - r0 <= t.tile_rows
            if t is big and r1 - r0 < rows:
                assert r1 == b[blk + 1] and r1 - r0 > tail
            if t is small:
                assert r1 == b[blk + 1] and (b[blk + 1] - b[blk]) % rows == r1 - r0
            cover[r0:r1] += 1
    assert (cover == 1).all()
    T = small.num_tiles
    assert all(sorted(small.order[i * T:(i + 1) * T].tolist()) == list(range(T)) for i in range(1 + small.num_patterns))
    with pytest.raises(ValueError, match="tail_rows"):
        build_side_tables(b, b, mask.block_map, rows, 32, "cpu", part="tail", tail_rows=rows)


def test_packing_only_where_it_applies():
    """Blocks shorter than the tile, or all multiples of it, keep the plain lists (and their boxes)."""
    short = make_mask("varblock_sparse", 300, block=48, min_block=20, density=0.4, patterns=2, seed=2)
    uni = make_mask("block_sparse", 256, block=64, density=0.5, patterns=2, seed=0)
    for mask in (short, uni):
        t = build_side_tables(mask.q_block_bounds, mask.k_block_bounds, mask.block_map, 32, 32, "cpu", True)
        assert not t.packed
        assert torch.equal(t.col_next, t.col_start) and torch.equal(t.col_count, t.col_end - t.col_start)
    # 16-column tiles fit the 20-token blocks (dK/dV's columns are its DKDV_BLOCK_M query rows)
    assert packed_flags(short, tiles(32, 16, dkdv=(16, 32))) == {"fwd": False, "dq": True, "dkdv": True}
    assert packed_flags(short, tiles(32, 16)) == {"fwd": False, "dq": True, "dkdv": False}
    assert packed_flags(short, {**tiles(32, 16, dkdv=(16, 32)), **RAGGED}) == {"fwd": False, "dq": False,
                                                                              "dkdv": True}


# ------------------------------------------------------------------------------ tables
@pytest.mark.parametrize("major", ["q", "k"])
def test_tables_cover_exactly_the_kept_area(major):
    rng = np.random.default_rng(4)
    b = random_bounds(230, rng, 5, 70)
    bm = torch.from_numpy(rng.random((3, len(b) - 1, len(b) - 1)) < 0.4)
    mask = BlockSparseMask(b, b, bm)
    t = get_side_tables(mask, major, 32, 16, "cpu")
    got, dense = walked_pairs(t, mask, major)
    assert torch.equal(got, dense)
    # unpacked: every entry one contiguous piece of one run
    assert all(t.columns(e) == list(range(int(t.col_start[e]), int(t.col_end[e]))) for e in range(t.num_entries))
    # the order over all patterns, then each pattern's own (heaviest first by that pattern's work alone)
    T, P = t.num_tiles, t.num_patterns
    assert t.order.numel() == (1 + P) * T
    orders = t.order.view(1 + P, T)
    assert all(sorted(o.tolist()) == list(range(T)) for o in orders)
    work = torch.stack([(t.ptr[1:] - t.ptr[:-1]).view(P, -1)[p][t.row_block.long()] * (t.row_end - t.row_start)
                        for p in range(P)])  # [P, T]
    for w, o in zip((work.sum(0), *work), orders):
        assert (w[o.long()].diff() <= 0).all()
    assert get_side_tables(mask, major, 32, 16, "cpu") is t  # cached


def test_tables_even_flags_and_build_time():
    mask = make_mask("block_sparse", 512, block=64, density=0.5, patterns=2, seed=0)
    t = build_side_tables(mask.q_block_bounds, mask.k_block_bounds, mask.block_map, 64, 64, "cpu")
    assert t.even_rows and t.even_cols and t.build_ms >= 0
    t = build_side_tables(mask.q_block_bounds, mask.k_block_bounds, mask.block_map, 64, 128, "cpu")
    assert not t.even_cols
    ms = BS.table_build_time(mask, 64, "cpu", repeats=1)
    assert set(ms) == {"fwd", "dq", "dkdv"}


# ------------------------------------------------------------------------------ config and API
def test_config_validation():
    mask = make_mask("block_sparse", 128, block=64, density=0.5)
    with pytest.raises(ValueError, match="unknown block-sparse config"):
        BS.resolve_config(mask, 64, {"BLOCK_Q": 64})
    with pytest.raises(ValueError, match="power of two"):
        BS.resolve_config(mask, 64, {"BLOCK_N": 48})
    with pytest.raises(ValueError, match="power of two"):
        BS.resolve_config(mask, 64, {"DQ_HEADS": 3})
    with pytest.raises(ValueError, match="unknown block-sparse config"):
        BS.resolve_config(mask, 64, {"one_launch": True})
    assert BSC.stack(2, 8, 8) == 2 and BSC.stack(2, 8, 1) == 1 and BSC.stack(4, 4, 2) == 2


def test_input_validation():
    mask = make_mask("block_sparse", 64, block=32, density=0.5, patterns=2)
    q = torch.randn(1, 64, 3, 32)
    k = torch.randn(1, 64, 1, 32)
    with pytest.raises(ValueError, match="patterns do not divide"):
        BS.block_sparse_attention(q, k, k, mask)
    with pytest.raises(ValueError, match="mask is 64 x 64"):
        BS.block_sparse_attention(torch.randn(1, 32, 2, 32), torch.randn(1, 32, 2, 32), torch.randn(1, 32, 2, 32), mask)


def test_backends_registered_and_reasons():
    from longca_triton.adapters import Problem, get_backend

    uni = make_mask("block_sparse", 128, block=32, density=0.5, patterns=2)
    var = make_mask("varblock_sparse", 300, block=48, min_block=20, density=0.5)
    odd = BlockSparseMask([0, 48, 96], [0, 48, 96], torch.ones(1, 2, 2, dtype=torch.bool))
    sparse, varb = get_backend("triton-sparse"), get_backend("triton-varblock")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.float16
    assert sparse.supports(Problem(uni, heads_q=4, heads_kv=2, head_dim=32, dtype=dt, device=dev)) == (True, "")
    ok, why = sparse.supports(Problem(var, heads_q=4, heads_kv=2, head_dim=32, dtype=dt, device=dev))
    assert not ok and "not uniform" in why
    ok, why = sparse.supports(Problem(odd, heads_q=4, heads_kv=2, head_dim=32, dtype=dt, device=dev))
    assert not ok and "power of two" in why
    assert varb.supports(Problem(var, heads_q=4, heads_kv=2, head_dim=32, dtype=dt, device=dev)) == (True, "")
    ok, why = varb.supports(Problem(make_mask("causal", 64), head_dim=32, dtype=dt, device=dev))
    assert not ok and "block-sparse" in why


def test_backend_attention_matches_kernel():
    from longca_triton.adapters import get_backend

    mask = make_mask("varblock_sparse", 200, block=40, min_block=16, density=0.5, patterns=2, seed=1)
    q = torch.randn(1, 200, 4, 16, device=DEV, dtype=torch.float16)
    k = torch.randn(1, 200, 2, 16, device=DEV, dtype=torch.float16)
    out, lse = get_backend("triton-varblock").attention(q, k, k, mask, return_lse=True)
    ref, rl = naive_attention(q.double(), k.double(), k.double(), mask, return_lse=True)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-3


# ------------------------------------------------------------------ torch.library ops, torch.compile
def test_custom_op_path_matches():
    """The torch.library path (fwd/bwd ops, tables as int32 tensor lists), gradient through lse too."""
    check(make_mask("block_sparse", 200, block=32, density=0.5, patterns=2, seed=4), hq=4, hkv=2, op=True)
    check(make_mask("varblock_sparse", 230, block=40, min_block=16, density=0.5, patterns=2, seed=5), hq=4, hkv=2,
          cfg=tiles(32, 16, dq=(16, 32), dkdv=(32, 16)), op=True)


def test_custom_op_opcheck():
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch of the forward op."""
    mask = make_mask("block_sparse", 64, block=32, density=0.5, patterns=2, seed=3)
    q, k, v = (torch.randn(1, 64, 2, 16, device=DEV, requires_grad=True) for _ in range(3))
    cfg = BS.resolve_config(mask, 16)
    t = BS.tables_for(mask, cfg, q.device)
    meta = BSO.op_meta(t, 2)
    args = (q, k, v, BSO._op_lists(t, "fwd"), BSO._op_lists(t, "dq"), BSO._op_lists(t, "dkdv"), meta, 0.25,
            BSO._cfg_to_list(cfg))
    res = torch.library.opcheck(torch.ops.longca_triton.block_sparse_attention_fwd.default, args)
    assert set(res.values()) == {"SUCCESS"}, res


def _ref_loss_and_grads(q, k, v, mask):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = naive_attention(q64, k64, v64, mask).sum()
    ref.backward()
    return ref.item(), (q64.grad, k64.grad, v64.grad)


def test_custom_op_under_torch_compile_fullgraph():
    """Tables built outside, the op path traced in one graph (fullgraph=True), fwd and bwd."""
    mask = make_mask("block_sparse", 96, block=32, density=0.5, patterns=2, seed=6)
    torch.manual_seed(0)
    q = torch.randn(1, 96, 4, 32, device=DEV, requires_grad=True)
    k = torch.randn(1, 96, 2, 32, device=DEV, requires_grad=True)
    v = torch.randn(1, 96, 2, 32, device=DEV, requires_grad=True)
    cfg = BS.resolve_config(mask, 32)
    tables = BS.tables_for(mask, cfg, q.device)

    def f(q, k, v):
        return BS.block_sparse_attention_from_tables(q, k, v, tables, mask.num_patterns, 32 ** -0.5, cfg).sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    loss = compiled(q, k, v)
    loss.backward()
    ref, grads = _ref_loss_and_grads(q, k, v, mask)
    assert abs(loss.item() - ref) < 1e-3
    for a, b in zip((q, k, v), grads):
        assert (a.grad.double() - b).abs().max().item() < 1e-3


@pytest.mark.parametrize("backend", ["triton-sparse", "triton-varblock"])
def test_backends_under_torch_compile(backend):
    """``longca_triton.attention(..., backend=...)`` inside a compiled function (graph breaks
    allowed around the table lookup): the kernels run as custom-op nodes, fwd and bwd."""
    import longca_triton as lt

    mask = (make_mask("block_sparse", 96, block=32, density=0.5, patterns=2, seed=7) if backend == "triton-sparse"
            else make_mask("varblock_sparse", 120, block=40, min_block=16, density=0.5, patterns=2, seed=1))
    S = mask.seqlen_q
    torch.manual_seed(1)
    q = torch.randn(1, S, 4, 32, device=DEV, requires_grad=True)
    k = torch.randn(1, S, 2, 32, device=DEV, requires_grad=True)
    v = torch.randn(1, S, 2, 32, device=DEV, requires_grad=True)

    def f(q, k, v):
        return lt.attention(q, k, v, mask, backend=backend).sum()

    loss = torch.compile(f, backend="aot_eager")(q, k, v)
    loss.backward()
    ref, grads = _ref_loss_and_grads(q, k, v, mask)
    assert abs(loss.item() - ref) < 1e-3
    for a, b in zip((q, k, v), grads):
        assert (a.grad.double() - b).abs().max().item() < 1e-3


def test_backend_reads_the_autotune_cache(monkeypatch):
    """The backends take their launch config from ``kernels.tuned.lookup`` (an explicit one wins)."""
    from longca_triton.kernels.core import tuned
    from longca_triton.adapters import Problem, get_backend

    seen = []

    def fake_lookup(kernel, q, k, mask, v=None):
        seen.append(kernel)
        return {"NOT_A_KEY": 1}

    monkeypatch.setattr(tuned, "lookup", fake_lookup)
    mask = make_mask("block_sparse", 64, block=32, density=0.5)
    q = torch.randn(1, 64, 2, 16, device=DEV)
    b = get_backend("triton-sparse")
    with pytest.raises(ValueError, match="unknown block-sparse config keys"):
        b.attention(q, q, q, mask)
    with pytest.raises(ValueError, match="unknown block-sparse config keys"):
        b.prepare(Problem(mask, heads_q=2, heads_kv=2, head_dim=16, dtype=torch.float32, device=q.device.type), q, q, q)()
    assert seen == ["triton-sparse", "triton-sparse"]
    pinned = tiles(16, 16)
    fn = b.prepare(Problem(mask, heads_q=2, heads_kv=2, head_dim=16, dtype=torch.float32, device=q.device.type,
                           extra={"config": pinned}), q, q, q)
    out, lse = fn()
    ref = naive_attention(q.double(), q.double(), q.double(), mask)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-4 and len(seen) == 2

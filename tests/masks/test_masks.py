"""The mask IR against docs/masks.md: every mask, every lowering, random RangeMasks, bad input."""

import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longca_triton.masks import (
    MASK_NAMES,
    STATIC_MASK_NAMES,
    BlockSparseMask,
    NotExpressible,
    RangeMask,
    SliceKind,
    flashmask_columns,
    flex_block_mask,
    make_mask,
    varlen_form,
)
from mask_definitions import SMALL_PARAMS, definition

SEQLENS = [1, 7, 64, 239, 1000, 4096]
SEEDS = [0, 1, 2]
SMALL = SMALL_PARAMS
VARLEN_NAMES = {"full", "causal", "full_document", "causal_document", "sliding_window", "sliding_window_causal"}


def cases():
    for name in MASK_NAMES:
        for S in SEQLENS:
            for seed in SEEDS:
                yield pytest.param(name, S, seed, {}, id=f"{name}-S={S}-seed={seed}")
                if name in SMALL and seed == 0:
                    yield pytest.param(name, S, seed, SMALL[name], id=f"{name}-S={S}-seed={seed}-small")


def tile_any_all(dense: torch.Tensor, bm: int, bn: int):
    """(any, all) of each tile of a bool [.., Sq, Sk] mask, out-of-range treated as neutral."""
    Sq, Sk = dense.shape[-2:]
    nm, nn = -(-Sq // bm), -(-Sk // bn)
    pad_any = torch.zeros(*dense.shape[:-2], nm * bm, nn * bn, dtype=torch.bool)
    pad_all = torch.ones_like(pad_any)
    pad_any[..., :Sq, :Sk] = dense
    pad_all[..., :Sq, :Sk] = dense
    shp = (*dense.shape[:-2], nm, bm, nn, bn)
    return pad_any.view(shp).any(-1).any(-2), pad_all.view(shp).all(-1).all(-2)


def check_block_tables(mask, dense):
    for bs in (16, 64, 128):
        t = mask.block_tables(bs, bs)
        full, part = t.to_dense_tiles()
        anyt, allt = tile_any_all(dense, bs, bs)
        assert np.array_equal(full, allt.numpy()), f"full tiles wrong at {bs}"
        assert np.array_equal(part, (anyt & ~allt).numpy()), f"partial tiles wrong at {bs}"
        # the key-major lists are the transpose of the query-major ones
        kf_ptr = np.atleast_2d(t.k_full_ptr)
        for p in range(kf_ptr.shape[0]):
            for n in range(0, t.num_n, max(1, t.num_n // 7)):
                got = t.k_full_idx[kf_ptr[p, n] : kf_ptr[p, n + 1]]
                want = np.nonzero((full[p] if full.ndim == 3 else full)[:, n])[0]
                assert np.array_equal(got, want)


def flex_to_dense(bm, S, heads=1):
    """Evaluate a FlexAttention BlockMask element-wise: full blocks True, partial ones via mask_mod."""
    out = torch.zeros(heads, S, S, dtype=torch.bool)
    B = bm.BLOCK_SIZE[0]
    for h in range(heads):
        hh = min(h, bm.kv_num_blocks.shape[1] - 1)
        for m in range(bm.kv_num_blocks.shape[2]):
            q = torch.arange(m * B, min(S, (m + 1) * B))
            for idx, num, partial in ((bm.full_kv_indices, bm.full_kv_num_blocks, False), (bm.kv_indices, bm.kv_num_blocks, True)):
                for n in idx[0, hh, m, : num[0, hh, m]].tolist():
                    kv = torch.arange(n * B, min(S, (n + 1) * B))
                    if partial:
                        out[h, q[:, None], kv[None, :]] = bm.mask_mod(0, torch.tensor(h), q[:, None], kv[None, :])
                    else:
                        out[h, q[:, None], kv[None, :]] = True
    return out


@pytest.mark.parametrize("name,S,seed,params", list(cases()))
def test_mask_matches_definition_and_lowerings(name, S, seed, params):
    mask = make_mask(name, S, seed=seed, **params)
    assert mask.name == name and mask.seqlen_q == S == mask.seqlen_k
    assert mask.params["seed"] == seed
    dense = mask.to_dense()
    if isinstance(mask, BlockSparseMask):
        p = mask.params
        bounds = np.asarray(p["q_block_bounds"])
        assert bounds[0] == 0 and bounds[-1] == S
        if name == "block_sparse":
            assert np.all(np.diff(bounds)[:-1] == p["block"])
        elif S >= p["min_block"]:
            assert np.diff(bounds).min() >= p["min_block"]
        keep = max(1, round(p["density"] * (len(bounds) - 1)))
        assert (mask.block_map.sum(-1) == keep).all()
        assert dense.shape == (p["patterns"], S, S)
        assert mask.area == [int(x) for x in dense.sum((1, 2))]
    else:
        assert torch.equal(dense, definition(name, S, mask.params)), "to_dense() differs from docs/masks.md"
        assert mask.area == int(dense.sum())
        lo, hi = mask.row_intervals()
        j = torch.arange(S)
        rebuilt = ((j[None, None] >= torch.from_numpy(lo)[..., None]) & (j[None, None] < torch.from_numpy(hi)[..., None])).any(1)
        assert torch.equal(rebuilt, dense)
        cols = flashmask_columns(mask)  # all 12 static masks fit FlashMask's column form
        assert torch.equal(cols.to_dense(S), dense)
        if name in VARLEN_NAMES:
            assert torch.equal(varlen_form(mask).to_dense(), dense)
        else:
            try:
                vf = varlen_form(mask)
            except NotExpressible:
                pass
            else:  # degenerate draws (one document) may still be a plain document mask
                assert torch.equal(vf.to_dense(), dense)
    check_block_tables(mask, dense)
    if S <= 1000 and seed == 0:
        heads = mask.num_patterns
        bm = flex_block_mask(mask, 128, "cpu", num_heads=heads if isinstance(mask, BlockSparseMask) else None)
        ref = dense if dense.dim() == 3 else dense[None]
        assert torch.equal(flex_to_dense(bm, S, heads), ref)


def test_flops_follow_masks_md():
    m = make_mask("causal", 1000)
    area = 1000 * 1001 // 2
    assert m.area == area
    assert m.flops(8, 128, "fwd") == 4 * 128 * 8 * area
    assert m.flops(8, 128, "bwd") == 2.5 * m.flops(8, 128, "fwd")
    assert m.flops(8, 128, "fwd_bwd") == 3.5 * m.flops(8, 128, "fwd")
    b = make_mask("block_sparse", 256, block=64, patterns=2, density=0.5)
    assert b.flops(4, 64) == 4 * 64 * 2 * sum(b.area)  # two query heads per pattern
    with pytest.raises(ValueError, match="unknown mode"):
        m.flops(8, 128, "both")


def test_docs_long_and_histograms():
    m = make_mask("causal_document", 200_000, docs="long", seed=3)
    lens = np.diff(m.params["doc_bounds"])
    assert lens.sum() == 200_000
    long_tokens = lens[lens >= 8192].sum()
    assert long_tokens >= 0.5 * 200_000  # 60% of S comes in documents of 8K-30K tokens
    m2 = make_mask("causal_document", 8192, seed=3)
    assert m2.params["distribution"] == "pile"
    assert make_mask("causal_document", 65536).params["distribution"] == "prolong64k"
    assert make_mask("causal_document", 65537).params["distribution"] == "prolong512k"


def test_reproducible_from_params():
    for name in STATIC_MASK_NAMES:
        a = make_mask(name, 3000, seed=7)
        b = make_mask(name, 3000, seed=7)
        assert a.slices == b.slices
        p = {k: v for k, v in a.params.items() if k not in ("seed", "distribution", "docs")}
        c = make_mask(name, 3000, seed=99, **p)  # every drawn value is in .params
        assert torch.equal(c.to_dense(), a.to_dense()), name


def test_unknown_names_and_params():
    with pytest.raises(ValueError, match="valid masks: full, causal"):
        make_mask("casual", 100)
    with pytest.raises(ValueError, match="valid parameters: window"):
        make_mask("sliding_window", 100, windw=3)
    with pytest.raises(ValueError, match="positive integer"):
        make_mask("causal", 0)
    with pytest.raises(ValueError, match="density"):
        make_mask("block_sparse", 256, density=0.0)


@pytest.mark.parametrize(
    "slices,match",
    [
        ([(0, 0, 0, 4, "full")], "slice 0 .*empty or reversed q range"),
        ([(0, 4, 0, 4, "full"), (2, 1, 0, 4, "causal")], "slice 1 .*empty or reversed q range"),
        ([(0, 9, 0, 4, "full")], r"slice 0 .*q range \[0, 9\) lies outside \[0, 8\)"),
        ([(0, 4, -1, 4, "full")], "slice 0 .*k range"),
        ([(0, 4, 0, 4, "diagonal")], "slice 0 .*unknown slice kind 'diagonal'; valid kinds: full, causal, invcausal, bicausal"),
        ([(0, 4, 0, 4)], "slice 0 .*expected"),
        ([(0, 4.5, 0, 4, "full")], "slice 0 .*q_end must be an integer"),
    ],
)
def test_bad_slices_raise(slices, match):
    with pytest.raises(ValueError, match=match):
        RangeMask(8, 8, slices)


def test_bad_block_sparse_raises():
    with pytest.raises(ValueError, match="strictly increasing"):
        BlockSparseMask([0, 4, 4, 8], [0, 8], torch.ones(1, 3, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="must start at 0"):
        BlockSparseMask([1, 8], [0, 8], torch.ones(1, 1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"shape \[P, 2, 1\]"):
        BlockSparseMask([0, 4, 8], [0, 8], torch.ones(1, 1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool tensor"):
        BlockSparseMask([0, 8], [0, 8], torch.ones(1, 1, 1))


def brute_force(Sq, Sk, slices):
    """The union of slices, one pair at a time (independent of RangeMask's vectorised code)."""
    out = torch.zeros(Sq, Sk, dtype=torch.bool)
    for qs, qe, ks, ke, kind in slices:
        sq, sk = qe - qs, ke - ks
        for r in range(sq):
            for c in range(sk):
                kind = SliceKind.parse(kind)
                ok = {
                    SliceKind.FULL: True,
                    SliceKind.CAUSAL: c <= r + (sk - sq),
                    SliceKind.INVCAUSAL: c >= r,
                    SliceKind.BICAUSAL: r <= c <= r + (sk - sq),
                }[kind]
                out[qs + r, ks + c] |= ok
    return out


@st.composite
def range_masks(draw):
    Sq = draw(st.integers(1, 40))
    Sk = draw(st.integers(1, 40))
    slices = []
    for _ in range(draw(st.integers(0, 5))):
        qs = draw(st.integers(0, Sq - 1))
        qe = draw(st.integers(qs + 1, Sq))
        ks = draw(st.integers(0, Sk - 1))
        ke = draw(st.integers(ks + 1, Sk))
        kind = draw(st.sampled_from(["full", "causal", "invcausal", "bicausal", SliceKind.CAUSAL, 3]))
        slices.append((qs, qe, ks, ke, kind))
    return Sq, Sk, slices


@st.composite
def disjoint_row_masks(draw):
    """Slices on disjoint query ranges (documents, per-document windows): the row intervals are a few
    linear pieces and the tile lists are read off the pieces."""
    Sq, Sk = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, Sq - 1)), max_size=5)))) if Sq > 1 else []
    slices = []
    for qs, qe in zip([0, *cuts], [*cuts, Sq]):
        if draw(st.booleans()) or not slices:  # some query ranges attend nothing
            ks = draw(st.integers(0, Sk - 1))
            ke = draw(st.integers(ks + 1, Sk))
            slices.append((qs, qe, ks, ke, draw(st.sampled_from(list(SliceKind)))))
    return Sq, Sk, slices


@settings(max_examples=120, deadline=None)
@given(disjoint_row_masks())
def test_tiles_of_masks_on_disjoint_rows_read_off_linear_pieces(case):
    from longca_triton.masks.ir import _tile_lists

    Sq, Sk, slices = case
    mask = RangeMask(Sq, Sk, slices)
    pieces = mask.row_segments()  # read straight off the slices: at most one piece per slice
    assert pieces is not None and len(pieces) <= len(slices) and (len(pieces) > 0) == (mask.area > 0)
    check_block_tables(mask, mask.to_dense())
    for bm, bn in ((16, 32), (7, 5), (64, 16)):
        by_pieces = _tile_lists(*mask.merged_row_intervals(), Sq, Sk, bm, bn, mask.row_segments())
        by_rows = _tile_lists(*mask.merged_row_intervals(), Sq, Sk, bm, bn)
        assert all(np.array_equal(a, b) for a, b in zip(by_pieces, by_rows))


@settings(max_examples=150, deadline=None)
@given(range_masks())
def test_random_range_masks(case):
    Sq, Sk, slices = case
    mask = RangeMask(Sq, Sk, slices)
    dense = mask.to_dense()
    assert torch.equal(dense, brute_force(Sq, Sk, slices))
    assert mask.area == int(dense.sum())
    lo, hi = mask.row_intervals()
    j = torch.arange(Sk)
    rebuilt = ((j[None, None] >= torch.from_numpy(lo)[..., None]) & (j[None, None] < torch.from_numpy(hi)[..., None])).any(1)
    assert torch.equal(rebuilt, dense)
    clo, chi = mask.col_intervals()
    i = torch.arange(Sq)
    cols = ((i[None, None] >= torch.from_numpy(clo)[..., None]) & (i[None, None] < torch.from_numpy(chi)[..., None])).any(1)
    assert torch.equal(cols.T, dense)
    check_block_tables(mask, dense)
    try:
        fm = flashmask_columns(mask)
    except NotExpressible as e:
        assert "column" in str(e)
        # truly not expressible: some column's allowed rows are not a complement of <= 2 intervals
        counts = (chi > clo).sum(1)
        assert (counts >= 2).any()
    else:
        assert torch.equal(fm.to_dense(Sq), dense)
    try:
        vf = varlen_form(mask)
    except NotExpressible:
        pass
    else:
        assert torch.equal(vf.to_dense(), dense)


def test_area_of_a_million_tokens_is_cheap(capsys):
    for name in ("causal_document", "block_causal_document"):
        t0 = time.perf_counter()
        m = make_mask(name, 1 << 20, seed=0)
        area = m.area
        dt = time.perf_counter() - t0
        with capsys.disabled():
            print(f"\n[timing] make_mask({name!r}, 2**20) + area: {dt:.3f} s (area {area:,})")
        docs = np.diff(m.params["doc_bounds"])
        if name == "causal_document":
            assert area == int((docs * (docs + 1) // 2).sum())
        assert area > 0

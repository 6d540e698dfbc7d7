"""The mask constructors (``from_row_intervals``, ``window_mask``, ``from_cu_seqlens``,
``from_mask_mod``, ``from_dense``, ``block_diagonal``) against brute-force definitions."""

import re

import numpy as np
import pytest
import torch

from longca_triton.masks import (RangeMask, SliceKind, block_diagonal, from_cu_seqlens, from_dense,
                                 from_mask_mod, from_row_intervals, make_mask, window_mask)
from mask_definitions import documents_reference, window_reference
from utils import random_range_mask


SHAPES = [(1, 239), (3, 799), (127, 512), (113, 203), (384, 256), (640, 128), (1, 1), (7, 3)]
WINDOWS = [(-1, -1), (0, 0), (3, -1), (-1, 4), (157, 145), (1000, 1000), (10, 0)]


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"window={w[0]},{w[1]}")
@pytest.mark.parametrize("sq,sk", SHAPES, ids=lambda s: str(s))
def test_window_mask_matches_flash_attention_rule(sq, sk, causal, window):
    m = window_mask(sq, sk, causal, window)
    assert (m.seqlen_q, m.seqlen_k) == (sq, sk)
    assert torch.equal(m.to_dense(), window_reference(sq, sk, causal, window))


def test_window_mask_is_a_few_slices():
    # causal with a left window at 128K: one INVCAUSAL-free band, two slices (the clipped start, the band)
    m = window_mask(131072, 131072, causal=True, window_size=(4096, -1))
    assert len(m.slices) == 2
    assert {s[4] for s in m.slices} == {SliceKind.CAUSAL, SliceKind.BICAUSAL}
    assert window_mask(300, 200, causal=True).area == sum(max(0, min(200, i - 100 + 1)) for i in range(300))


def test_window_mask_rejects_bad_window():
    with pytest.raises(ValueError, match="window_size"):
        window_mask(8, 8, window_size=(-2, 0))


@pytest.mark.parametrize("seed", range(40), ids=lambda s: f"seed={s}")
def test_from_row_intervals_random(seed):
    rng = np.random.default_rng(seed)
    n, sk = int(rng.integers(1, 60)), int(rng.integers(1, 60))
    lo = rng.integers(-3, sk + 2, n)
    hi = lo + rng.integers(-3, 12, n)  # some rows empty (hi < lo), some clipped
    if seed % 2:  # monotone ends: long runs of each slice kind
        lo, hi = np.sort(lo), np.maximum.accumulate(hi)
    m = from_row_intervals(lo, hi, sk)
    j = torch.arange(sk)[None, :]
    expected = (j >= torch.as_tensor(lo)[:, None]) & (j <= torch.as_tensor(hi)[:, None])
    assert torch.equal(m.to_dense(), expected)


def test_from_row_intervals_shape_error():
    with pytest.raises(ValueError, match="one entry per query row"):
        from_row_intervals([0, 1], [3], 4)


@pytest.mark.parametrize("seed", range(20), ids=lambda s: f"seed={s}")
def test_from_row_intervals_several_intervals_a_row(seed):
    rng = np.random.default_rng(seed)
    n, sk, K = int(rng.integers(1, 50)), int(rng.integers(1, 70)), int(rng.integers(1, 5))
    lo = rng.integers(-2, sk + 2, (n, K))
    hi = lo + rng.integers(-3, 9, (n, K))  # overlapping, touching, empty and clipped intervals
    m = from_row_intervals(lo, hi, sk)
    j = torch.arange(sk)[None, None, :]
    expected = ((j >= torch.as_tensor(lo)[:, :, None]) & (j <= torch.as_tensor(hi)[:, :, None])).any(dim=1)
    assert torch.equal(m.to_dense(), expected)


DOCS = {  # (query document lengths, key document lengths): empty, length-1, Sq > Sk and Sq < Sk documents
    "self": ([5, 1, 0, 17, 2, 30], None),
    "cross": ([0, 1, 17, 5, 4, 30], [3, 1, 9, 5, 0, 41]),
    "one-doc": ([37], [23]),
    "ones": ([1] * 9, [1] * 9),
}


@pytest.mark.parametrize("window", [(-1, -1), (3, -1), (2, 5), (0, 0)], ids=lambda w: f"window={w[0]},{w[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("docs", list(DOCS))
def test_from_cu_seqlens_matches_per_document_rule(docs, causal, window):
    len_q, len_k = DOCS[docs]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(len_q)]), dtype=torch.int32)
    cu_k = None if len_k is None else torch.tensor(np.concatenate([[0], np.cumsum(len_k)]), dtype=torch.int64)
    m = RangeMask.from_cu_seqlens(cu_q, cu_k, causal=causal, window_size=window)
    expected = documents_reference(len_q, len_k or len_q, causal, window)
    assert torch.equal(m.to_dense(), expected)
    assert m.params["doc_bounds"] == cu_q.tolist()


def test_from_cu_seqlens_is_one_slice_per_causal_document():
    lens = np.random.default_rng(0).integers(2, 300, 1000)
    m = from_cu_seqlens(np.concatenate([[0], np.cumsum(lens)]), causal=True)
    assert len(m.slices) == 1000 and all(s[4] == SliceKind.CAUSAL for s in m.slices)
    assert m.area == int((lens * (lens + 1) // 2).sum())


@pytest.mark.parametrize("cu_q,cu_k,needle", [
    (torch.tensor([0.0, 3.0]), None, "int32 or int64"),
    ([1, 3, 5], None, "must start at 0"),
    ([0, 4, 3], None, "must not decrease: entry 1 = 4 > entry 2 = 3"),
    ([[0, 3]], None, "1-D"),
    ([0], None, "at least one document"),
    ([0, 3, 5], [0, 5], "as many documents"),
    ([0, 0], [0, 0], "both must be positive"),
], ids=["float", "start", "decreasing", "2-D", "no-docs", "counts", "no-tokens"])
def test_from_cu_seqlens_rejects(cu_q, cu_k, needle):
    with pytest.raises(ValueError, match=needle):
        from_cu_seqlens(cu_q, cu_k)


def dense_of(mask_mod, sq, sk):
    """The predicate evaluated on the full grid at b = h = 0 (what the constructor must not build)."""
    z = torch.zeros((), dtype=torch.int64)
    return torch.broadcast_to(mask_mod(z, z, torch.arange(sq)[:, None], torch.arange(sk)[None, :]), (sq, sk))


DOC_IDS = torch.as_tensor(np.repeat(np.arange(6), [40, 1, 77, 3, 90, 100]))  # 311 tokens
MASK_MODS = {
    "causal": lambda b, h, q, k: q >= k,
    "window-global": lambda b, h, q, k: ((q - k).abs() <= 7) | (k < 3) | (q < 2),
    "document-prefix": lambda b, h, q, k: (DOC_IDS[q] == DOC_IDS[k]) & ((q >= k) | (k % 50 < 4)),
    "stripes": lambda b, h, q, k: ((q * 7 + k * 13) % 11) < 4,
    "keys-only": lambda b, h, q, k: (k % 9) < 5,
    "nothing": lambda b, h, q, k: q < 0,
}


@pytest.mark.parametrize("chunk", [1, 1000, 1 << 22], ids=lambda c: f"chunk={c}")
@pytest.mark.parametrize("sq,sk", [(311, 311), (1, 97), (200, 311)], ids=lambda s: str(s))
@pytest.mark.parametrize("name", list(MASK_MODS))
def test_from_mask_mod_matches_predicate(name, sq, sk, chunk):
    mask_mod = MASK_MODS[name]
    m = RangeMask.from_mask_mod(mask_mod, sq, sk, chunk_elements=chunk, max_intervals=None)
    assert (m.seqlen_q, m.seqlen_k) == (sq, sk)
    assert torch.equal(m.to_dense(), dense_of(mask_mod, sq, sk))


def test_from_mask_mod_evaluates_in_bounded_chunks():
    shapes = []

    def mask_mod(b, h, q, k):
        shapes.append(torch.broadcast_shapes(q.shape, k.shape))
        return (q - k).abs() < 5

    m = from_mask_mod(mask_mod, 300, 200, chunk_elements=1000)
    assert max(a * b for a, b in shapes) <= 1000 and {b for _, b in shapes} == {200}
    assert torch.equal(m.to_dense(), dense_of(lambda b, h, q, k: (q - k).abs() < 5, 300, 200))


def test_from_mask_mod_skips_probes_of_one_element_tables():
    ids = DOC_IDS[None]  # a [1, S] table: b = 1 is out of range, which says nothing about the mask

    def mask_mod(b, h, q, k):
        return ids[b, q] == ids[b, k]

    m = from_mask_mod(mask_mod, 311, 311)
    assert torch.equal(m.to_dense(), DOC_IDS[:, None] == DOC_IDS[None, :])


@pytest.mark.parametrize("mask_mod,kwargs,needle", [
    ("not callable", {}, "must be callable"),
    (lambda b, h, q, k: (q - k).float(), {}, "must return a bool tensor, got torch.float32"),
    (lambda b, h, q, k: torch.ones(3, 3, dtype=torch.bool), {}, "does not broadcast"),
    (lambda b, h, q, k: ((q + k) % 2) == 0, {}, "more than max_intervals=64"),
    (lambda b, h, q, k: (q >= k) | (b > 0), {}, "depends on the batch or head index"),
    (lambda b, h, q, k: (q >= k) & (k > h), {}, "depends on the batch or head index"),
    (lambda b, h, q, k: q.nonexistent(), {}, "mask_mod failed on query rows 0..129"),
    (lambda b, h, q, k: q >= k, {"max_intervals": 0}, "max_intervals must be a positive integer"),
], ids=["not-callable", "float", "shape", "intervals", "batch", "head", "raises", "bad-bound"])
def test_from_mask_mod_rejects(mask_mod, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        from_mask_mod(mask_mod, 130, 130, **kwargs)


@pytest.mark.parametrize("seed", range(8), ids=lambda s: f"seed={s}")
def test_from_dense_random(seed):
    rng = np.random.default_rng(seed)
    sq, sk = int(rng.integers(1, 90)), int(rng.integers(1, 90))
    dense = torch.as_tensor(rng.random((sq, sk)) < rng.random())
    m = from_dense(dense)
    assert torch.equal(m.to_dense(), dense)


@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"seed={s}")
def test_from_dense_of_structured_masks_keeps_them(seed):
    mask = random_range_mask(203 + seed, 139, seed) if seed % 2 else make_mask("share_question", 257, seed=seed,
                                                                               doc_lens=[60, 1, 96, 100])
    m = RangeMask.from_dense(mask.to_dense().numpy())
    assert torch.equal(m.to_dense(), mask.to_dense())
    assert len(m.slices) <= 2 * len(mask.slices) + 4  # runs of rows, not one slice per row


@pytest.mark.parametrize("dense,needle", [
    (torch.ones(4, 4), "bool [Sq, Sk] tensor, got a torch.float32"),
    (torch.ones(2, 4, 4, dtype=torch.bool), "shape (2, 4, 4)"),
    (torch.ones(0, 4, dtype=torch.bool), "Sq must be a positive integer"),
    ([[True]], "got a list"),
], ids=["float", "3-D", "empty", "list"])
def test_from_dense_rejects(dense, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        from_dense(dense)


def test_from_dense_bounds_intervals_when_asked():
    with pytest.raises(ValueError, match="query row 0 allows 3 separate key intervals"):
        from_dense(torch.tensor([[True, False, True, False, True]]), max_intervals=2)


def test_block_diagonal_matches_torch_block_diag():
    parts = [window_mask(5, 9, True), random_range_mask(31, 17, 3), window_mask(1, 1), window_mask(12, 4, False, (1, 2))]
    m = block_diagonal(parts)
    assert torch.equal(m.to_dense(), torch.block_diag(*[p.to_dense() for p in parts]))


def test_block_diagonal_rejects():
    with pytest.raises(ValueError, match="at least one mask"):
        block_diagonal([])
    with pytest.raises(ValueError, match="mask 1 is a BlockSparseMask"):
        block_diagonal([window_mask(64, 64), make_mask("block_sparse", 64, block=16)])


@pytest.mark.gpu
def test_from_mask_mod_on_gpu_matches_the_rule():
    ids = DOC_IDS.cuda()
    on_gpu = from_mask_mod(lambda b, h, q, k: (ids[q] == ids[k]) & (q >= k), 311, 311, device="cuda", chunk_elements=5000)
    pos = torch.arange(311)
    assert torch.equal(on_gpu.to_dense(), (DOC_IDS[:, None] == DOC_IDS[None, :]) & (pos[:, None] >= pos[None, :]))


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (5, -1), (-1, 3), (7, 2)], ids=lambda w: f"window={w[0]},{w[1]}")
@pytest.mark.parametrize("seed", range(6), ids=lambda s: f"seed={s}")
def test_from_cu_seqlens_breakpoints_match_token_intervals(seed, window, causal, monkeypatch):
    """Each document's slices from its breakpoints (few documents) allow exactly what the per-token
    intervals do (many documents): empty documents, key documents longer and shorter than their queries."""
    from longca_triton.masks import construct

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    len_q, len_k = rng.integers(0, 12, n), rng.integers(0, 12, n)
    len_q[0], len_k[0] = max(1, len_q[0]), max(1, len_k[0])
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]) for x in (len_q, len_k))
    fast = from_cu_seqlens(cu_q, cu_k, causal=causal, window_size=window)
    monkeypatch.setattr(construct, "ANALYTIC_DOCS", 0)
    slow = from_cu_seqlens(cu_q, cu_k, causal=causal, window_size=window)
    assert torch.equal(fast.to_dense(), slow.to_dense())
    assert len(fast.slices) <= 3 * n

"""``from_row_intervals`` and ``window_mask`` against the brute-force definitions."""

import numpy as np
import pytest
import torch

from longca_triton.masks import SliceKind, from_row_intervals, window_mask


def window_reference(sq, sk, causal, window):
    """FlashAttention's rule, one (i, j) pair at a time: bottom-right aligned, -1 unbounded."""
    left, right = window
    right = 0 if causal else right
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


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

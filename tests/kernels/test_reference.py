"""The two references agree (fp64, with gradients), and the public entry point validates its input."""

import pytest
import torch

import longca_triton as lt
from longca_triton.masks import MASK_NAMES, RangeMask, make_mask
from longca_triton.reference import chunked_attention, naive_attention
from mask_definitions import SMALL_PARAMS

PARAMS = {
    **SMALL_PARAMS,
    "varblock_sparse": {"block": 40, "min_block": 24},  # one pattern: the heads here are 2 and 4
    "causal_document": {"doc_lens": [50, 3, 100, 86]},
    "share_question": {"doc_lens": [30, 70, 1, 60, 78]},
    "causal_blockwise": {"doc_lens": [60, 60, 60, 59]},
    "prefix_lm_document": {"doc_lens": [120, 40, 79], "prefix": 25},
    "full_document": {"doc_lens": [100, 139]},
}


def inputs(B, S, Hq, Hkv, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, D, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(B, S, Hkv, D, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(B, S, Hkv, D, dtype=dtype, generator=g).requires_grad_()
    return q, k, v


def run(fn, q, k, v, mask, **kw):
    out, lse = fn(q, k, v, mask, return_lse=True, **kw)
    g = torch.Generator().manual_seed(1)
    do = torch.randn(out.shape, dtype=out.dtype, generator=g)
    dl = torch.randn(lse.shape, dtype=lse.dtype, generator=g)
    loss = (out * do).sum() + torch.where(torch.isinf(lse), 0, lse * dl).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    return out, lse, grads


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=lambda h: f"Hq={h[0]}-Hkv={h[1]}")
@pytest.mark.parametrize("name", MASK_NAMES)
def test_naive_and_chunked_agree(name, heads):
    S = 239
    mask = make_mask(name, S, seed=1, **PARAMS.get(name, {}))
    q, k, v = inputs(2, S, heads[0], heads[1], 16)
    o1, l1, g1 = run(naive_attention, q, k, v, mask)
    o2, l2, g2 = run(chunked_attention, q, k, v, mask, chunk=64)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(l1, l2)
    for a, b in zip(g1, g2):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b)


def test_fully_masked_rows_give_zeros_and_minus_inf():
    # rows 10..19 attend nothing; rows 0..9 attend keys 0..4 only
    mask = RangeMask(30, 30, [(0, 10, 0, 5, "full"), (20, 30, 0, 30, "causal")])
    q, k, v = inputs(1, 30, 2, 1, 8)
    for fn in (naive_attention, chunked_attention):
        out, lse, grads = run(fn, q, k, v, mask)
        assert torch.all(out[:, 10:20] == 0)
        assert torch.all(torch.isneginf(lse[:, :, 10:20]))
        assert torch.isfinite(lse[:, :, :10]).all()
        assert all(torch.isfinite(g).all() for g in grads)
        assert torch.all(grads[0][:, 10:20] == 0)


def test_reference_matches_softmax_definition():
    mask = make_mask("causal", 17)
    q, k, v = inputs(1, 17, 1, 1, 4)
    s = (q[0, :, 0] @ k[0, :, 0].T) / 2.0
    s = s.masked_fill(~mask.to_dense(), float("-inf"))
    want = torch.softmax(s, -1) @ v[0, :, 0]
    torch.testing.assert_close(naive_attention(q, k, v, mask)[0, :, 0], want)


def test_attention_reference_backend_is_differentiable():
    mask = make_mask("share_question", 100, doc_lens=[20, 30, 50])
    q, k, v = inputs(1, 100, 4, 2, 8)
    out = lt.attention(q, k, v, mask, backend="reference")
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and torch.isfinite(v.grad).all()
    out2, lse = lt.attention(q, k, v, mask, backend="reference-chunked", return_lse=True)
    torch.testing.assert_close(out, out2)
    assert lse.shape == (1, 4, 100)


@pytest.mark.parametrize(
    "shapes,match",
    [
        (((1, 16, 4, 8), (1, 16, 3, 8), (1, 16, 3, 8)), r"query heads \(4\) must be a multiple of key/value heads \(3\)"),
        (((1, 16, 4, 8), (1, 16, 2, 8), (1, 16, 1, 8)), r"k and v must agree on \[batch, seqlen, heads\]"),
        (((1, 16, 4, 8), (1, 16, 2, 4), (1, 16, 2, 4)), "head dims of q and k differ"),
        (((1, 16, 4), (1, 16, 2, 8), (1, 16, 2, 8)), "q must be 4-D"),
        (((1, 20, 4, 8), (1, 20, 2, 8), (1, 20, 2, 8)), r"mask is 16x16 .* q has 20 positions"),
        (((2, 16, 4, 8), (1, 16, 2, 8), (1, 16, 2, 8)), "batch sizes differ"),
    ],
)
def test_attention_validates_shapes(shapes, match):
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        lt.attention(q, k, v, make_mask("causal", 16), backend="reference")


def test_attention_validates_dtypes_masks_and_backends():
    q = torch.randn(1, 16, 4, 8)
    k = torch.randn(1, 16, 2, 8)
    with pytest.raises(ValueError, match="share one dtype"):
        lt.attention(q, k.double(), k.double(), make_mask("causal", 16), backend="reference")
    with pytest.raises(ValueError, match="floating-point"):
        lt.attention(q.long(), k.long(), k.long(), make_mask("causal", 16), backend="reference")
    with pytest.raises(ValueError, match="mask must be a RangeMask"):
        lt.attention(q, k, k, "causal", backend="reference")
    with pytest.raises(ValueError, match="unknown backend 'nope'; valid backends:"):
        lt.attention(q, k, k, make_mask("causal", 16), backend="nope")
    with pytest.raises(ValueError, match="3 patterns do not divide 4 query heads"):
        lt.attention(q, k, k, make_mask("block_sparse", 16, block=4, patterns=3), backend="reference")

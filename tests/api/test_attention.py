"""``lt.attention`` with one RangeMask per batch element: the packed call against each element run
alone through the float64 reference, forward, lse and gradients."""

import re

import pytest
import torch

import longca_triton as lt
from longca_triton.masks import from_cu_seqlens, make_mask, window_mask
from longca_triton.reference.naive import naive_attention
from utils import compare_to_reference, needs_triton, random_range_mask


def element_masks(sq, sk, seed):
    """Different structures per element: documents, a window, random slices, nothing at all."""
    return [from_cu_seqlens([0, 3, 3, sq], [0, 7, 7, sk], causal=True), window_mask(sq, sk, False, (4, 2)),
            random_range_mask(sq, sk, seed), lt.RangeMask(sq, sk, [])]


def per_element_reference(masks):
    """Each batch element through the naive reference under its own mask."""
    def ref(q, k, v):
        outs = [naive_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], m, return_lse=True) for b, m in enumerate(masks)]
        return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])
    return ref


CASES = [  # (Sq, Sk, Hq, Hkv, D, batch)
    (37, 37, 4, 2, 32, 4),
    (29, 53, 2, 1, 16, 3),
    (53, 29, 3, 3, 24, 2),
]


def case_id(c):
    return f"Sq={c[0]}-Sk={c[1]}-Hq={c[2]}-Hkv={c[3]}-D={c[4]}-B={c[5]}"


BACKEND_CASES = [pytest.param("reference", torch.float32, c, id=f"reference-float32-{case_id(c)}") for c in CASES]
BACKEND_CASES += [pytest.param("triton", dt, c, id=f"triton-{str(dt)[6:]}-{case_id(c)}", marks=needs_triton)
                  for c, dt in zip(CASES, [torch.float16, torch.float32, torch.float16])]


@pytest.mark.parametrize("backend,dtype,case", BACKEND_CASES)
def test_list_of_masks_matches_each_element_alone(backend, dtype, case):
    sq, sk, hq, hkv, d, batch = case
    masks = element_masks(sq, sk, seed=sq)[:batch]

    def attn(q, k, v):
        out, lse = lt.attention(q, k, v, masks, backend=backend, return_lse=True)
        assert lse.is_contiguous()
        return out, lse

    compare_to_reference(attn, None, sq, sk, batch, hq, hkv, d, dtype, dlse=True,
                         reference=per_element_reference(masks))


def test_list_of_masks_without_lse_returns_the_output():
    q, k, v = torch.randn(2, 9, 2, 16), torch.randn(2, 9, 2, 16), torch.randn(2, 9, 2, 8)
    masks = [window_mask(9, 9, True), window_mask(9, 9, False, (1, 1))]
    out = lt.attention(q, k, v, masks, backend="reference")
    assert out.shape == (2, 9, 2, 8)
    torch.testing.assert_close(out[1:], lt.attention(q[1:], k[1:], v[1:], masks[1], backend="reference"))


@pytest.mark.parametrize("masks,needle", [
    ([window_mask(9, 9)], "one mask per batch element: got 1 masks for batch 2"),
    ([window_mask(9, 9), make_mask("block_sparse", 9, block=3)], "masks[1] is a BlockSparseMask"),
    ([window_mask(9, 9), "causal"], "masks[1] is a str"),
    ([window_mask(9, 9), window_mask(9, 8)], "masks[1] is 9x8 (Sq x Sk) but q has 9 positions and k/v have 9"),
], ids=["count", "block-sparse", "not-a-mask", "size"])
def test_list_of_masks_rejects(masks, needle):
    q = k = v = torch.randn(2, 9, 2, 16)
    with pytest.raises(ValueError, match=re.escape(needle)):
        lt.attention(q, k, v, masks, backend="reference")


@pytest.mark.gpu
def test_list_of_masks_matches_each_element_alone_on_gpu():
    torch.manual_seed(0)
    S, B = 3000, 3
    masks = [from_cu_seqlens([0, 1000, 1001, S], causal=True), window_mask(S, S, True, (256, 0)),
             make_mask("share_question", S, doc_lens=[500, 1500, 1000])]
    q = torch.randn(B, S, 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = lt.attention(q, k, v, masks, return_lse=True)
    for b, m in enumerate(masks):
        ref_out, ref_lse = lt.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], m, return_lse=True)
        assert (out[b:b + 1].float() - ref_out.float()).abs().max().item() <= 2e-2 * ref_out.float().abs().max().item()
        torch.testing.assert_close(lse[b:b + 1], ref_lse, atol=1e-3, rtol=1e-3)

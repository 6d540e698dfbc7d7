"""``flash_attn_func`` and ``flash_attn_varlen_func`` against FlashAttention's rule written out densely:
out, lse and the gradients, through the PyTorch reference and our Triton kernel."""

import numpy as np
import pytest
import torch

import longca_triton as lt
from longca_triton import flash_api
from longca_triton.masks import RangeMask, window_mask
from mask_definitions import documents_reference, window_reference
from utils import DEVICE, assert_grads_near_float64, compare_to_reference, needs_triton

# (Sq, Sk, Hq, Hkv, D, causal, window): decode (Sq = 1), Sq > Sk with rows that attend nothing, MQA,
# windows on both sides, odd lengths
FLASH_CASES = [
    (1, 37, 4, 2, 32, True, (-1, -1)),
    (37, 1, 4, 1, 32, True, (-1, -1)),
    (45, 29, 3, 3, 16, False, (-1, -1)),
    (29, 45, 4, 2, 64, True, (5, -1)),
    (61, 61, 4, 1, 40, False, (3, 7)),
    (50, 70, 2, 2, 24, False, (0, 0)),
    (70, 50, 4, 2, 8, True, (10, 0)),
]


def flash_id(case):
    sq, sk, hq, hkv, d, causal, (left, right) = case
    return f"Sq={sq}-Sk={sk}-Hq={hq}-Hkv={hkv}-D={d}-{'causal' if causal else 'noncausal'}-window={left},{right}"


# every case through the reference; through our Triton kernel in float32 and float16 by turns
BACKEND_CASES = [pytest.param("reference", torch.float32, c, id=f"reference-float32-{flash_id(c)}") for c in FLASH_CASES]
BACKEND_CASES += [pytest.param("triton", dt, c, id=f"triton-{str(dt)[6:]}-{flash_id(c)}", marks=needs_triton)
                  for c, dt in zip(FLASH_CASES, [torch.float32, torch.float16] * 4)]


@pytest.mark.parametrize("backend,dtype,case", BACKEND_CASES)
def test_flash_attn_func_matches_rule(backend, dtype, case):
    sq, sk, hq, hkv, d, causal, window = case
    expected = RangeMask.from_dense(window_reference(sq, sk, causal, window))

    def attn(q, k, v):
        return lt.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True, backend=backend)

    compare_to_reference(attn, expected, sq, sk, 2, hq, hkv, d, dtype, dlse=True)


def test_flash_attn_func_scale_and_plain_output():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 9, 2, 16), torch.randn(1, 13, 1, 16), torch.randn(1, 13, 1, 24)
    out = lt.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, backend="reference")
    ref = lt.attention(q, k, v, window_mask(9, 13, True), softmax_scale=0.3, backend="reference")
    assert isinstance(out, torch.Tensor) and out.shape == (1, 9, 2, 24)
    torch.testing.assert_close(out, ref)


def lens_to_cu(lens, dtype):
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=dtype, device=DEVICE)


# (query document lengths, key document lengths or None for self-attention, Hq, Hkv, D, causal, window)
VARLEN_CASES = [
    ([5, 1, 0, 17, 2, 30], None, 4, 2, 32, True, (-1, -1)),
    ([0, 1, 17, 5, 4, 30], [3, 1, 9, 5, 0, 41], 4, 1, 16, True, (-1, -1)),
    ([23, 1, 40], [23, 1, 40], 2, 2, 24, False, (4, 2)),
    ([1, 1, 1, 1], [7, 0, 2, 1], 4, 2, 32, False, (-1, -1)),
]


def varlen_id(case):
    lq, lk, hq, hkv, d, causal, (left, right) = case
    docs = "-".join(map(str, lq)) + ("" if lk is None else "/" + "-".join(map(str, lk)))
    return f"docs={docs}-Hq={hq}-Hkv={hkv}-D={d}-{'causal' if causal else 'noncausal'}-window={left},{right}"


VARLEN_BACKEND_CASES = [pytest.param("reference", torch.float32, c, id=f"reference-float32-{varlen_id(c)}")
                        for c in VARLEN_CASES]
VARLEN_BACKEND_CASES += [pytest.param("triton", dt, c, id=f"triton-{str(dt)[6:]}-{varlen_id(c)}", marks=needs_triton)
                         for c, dt in zip(VARLEN_CASES, [torch.float16, torch.float32] * 2)]


@pytest.mark.parametrize("backend,dtype,case", VARLEN_BACKEND_CASES)
def test_flash_attn_varlen_func_matches_per_document_rule(backend, dtype, case):
    len_q, len_k, hq, hkv, d, causal, window = case
    cu_q = lens_to_cu(len_q, torch.int32)
    cu_k = cu_q if len_k is None else lens_to_cu(len_k, torch.int64)
    len_k = len_k or len_q
    expected = RangeMask.from_dense(documents_reference(len_q, len_k, causal, window))

    def attn(q, k, v):  # the packed layout is the [1, total, H, D] batch without its batch axis
        out, lse = lt.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, max(len_q), max(len_k), causal=causal,
                                             window_size=window, return_lse=True, backend=backend)
        assert out.shape == (sum(len_q), hq, d) and lse.shape == (hq, sum(len_q))
        return out[None], lse[None]

    compare_to_reference(attn, expected, sum(len_q), sum(len_k), 1, hq, hkv, d, dtype, dlse=True)


def test_masks_are_shared_between_calls():
    q = k = v = torch.randn(1, 12, 2, 16)
    before = flash_api._window_mask.cache_info().hits
    lt.flash_attn_func(q, k, v, causal=True, backend="reference")
    lt.flash_attn_func(q, k, v, causal=True, window_size=[-1, -1], backend="reference")
    assert flash_api._window_mask.cache_info().hits == before + 1
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    before = flash_api._varlen_mask.cache_info().hits
    for cu_k in (cu, cu.clone().long()):  # equal offsets, another tensor and dtype: the same mask
        lt.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu_k, 7, 7, backend="reference")
    assert flash_api._varlen_mask.cache_info().hits == before + 1


def flash_bad(**kw):
    args = dict(q=torch.randn(1, 8, 4, 16), k=torch.randn(1, 6, 2, 16), v=torch.randn(1, 6, 2, 16))
    args.update(kw)
    return lambda: lt.flash_attn_func(**args, backend="reference")


@pytest.mark.parametrize("call,needle", [
    (flash_bad(dropout_p=0.1), "dropout_p=0.1: attention dropout is not supported"),
    (flash_bad(window_size=(3,)), "window_size must be a pair"),
    (flash_bad(window_size=(-2, 0)), "window_size entries must be -1"),
    (flash_bad(window_size=(1.5, 2)), "window_size entries must be -1"),
    (flash_bad(q=torch.randn(8, 4, 16)), "q must be 4-D"),
    (flash_bad(k=torch.randn(1, 6, 3, 16), v=torch.randn(1, 6, 3, 16)), r"multiple of key/value heads \(3\)"),
    (flash_bad(k=torch.randn(1, 6, 2, 32), v=torch.randn(1, 6, 2, 16)), "k and v must agree|head dims of q and k"),
], ids=["dropout", "window-length", "window-negative", "window-float", "3-D", "gqa", "head-dim"])
def test_flash_attn_func_rejects(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


def varlen_bad(**kw):
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    args = dict(q=torch.randn(8, 4, 16), k=torch.randn(8, 2, 16), v=torch.randn(8, 2, 16), cu_seqlens_q=cu,
                cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5)
    args.update(kw)
    return lambda: lt.flash_attn_varlen_func(**args, backend="reference")


@pytest.mark.parametrize("call,needle", [
    (varlen_bad(dropout_p=0.5), "dropout_p=0.5"),
    (varlen_bad(q=torch.randn(1, 8, 4, 16)), "q must be 3-D"),
    (varlen_bad(cu_seqlens_q=torch.tensor([0.0, 8.0])), "cu_seqlens_q must be a 1-D int32 or int64 tensor"),
    (varlen_bad(cu_seqlens_k=[0, 3, 8]), "cu_seqlens_k must be a 1-D int32 or int64 tensor"),
    (varlen_bad(cu_seqlens_q=torch.tensor([2, 3, 8])), "cu_seqlens_q must start at 0"),
    (varlen_bad(cu_seqlens_q=torch.tensor([0, 6, 3, 8])), "must not decrease"),
    (varlen_bad(cu_seqlens_q=torch.tensor([0, 3, 7])), "cu_seqlens_q ends at 7 but q holds 8 tokens"),
    (varlen_bad(cu_seqlens_k=torch.tensor([0, 8])), "as many documents"),
    (varlen_bad(max_seqlen_k=4), "max_seqlen_k=4 is shorter than the longest document"),
    (varlen_bad(max_seqlen_q=5.0), "max_seqlen_q must be an integer"),
    (varlen_bad(window_size=(2, -3)), "window_size entries"),
], ids=["dropout", "4-D", "float-cu", "list-cu", "cu-start", "cu-decreasing", "cu-end", "cu-counts", "max-seqlen",
        "max-seqlen-float", "window"])
def test_flash_attn_varlen_func_rejects(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (1024, 1024)), (True, (512, -1))],
                         ids=["causal", "window=1024,1024", "causal-window=512"])
def test_flash_attn_func_bf16_on_gpu(causal, window):
    torch.manual_seed(0)
    sq, sk = 2000, 4096
    q = torch.randn(2, sq, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, sk, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = lt.flash_attn_func(q, k, v, causal=causal, window_size=window)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert_grads_near_float64((q.grad, k.grad, v.grad), q, k, v, dout, window_mask(sq, sk, causal, window))


@pytest.mark.gpu
def test_flash_attn_varlen_func_agrees_with_flash_attn_on_gpu():
    fa = pytest.importorskip("flash_attn")
    torch.manual_seed(0)
    lens = [1, 700, 0, 2049, 333, 1]
    cu = lens_to_cu(lens, torch.int32).cuda()
    q = torch.randn(sum(lens), 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens), 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ours = lt.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, window_size=(256, -1))
    theirs = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, window_size=(256, -1))
    err = ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()
    assert err < 1e-2, f"normalised max difference to flash_attn {err:.2e}"

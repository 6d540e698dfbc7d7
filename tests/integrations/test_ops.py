"""The ``longca_triton::attention`` op: values and gradients against the reference, masks as tensors,
``torch.compile(fullgraph=True)`` with one graph however the documents change, and bad input."""

import numpy as np
import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager
from utils import DEVICE, TOL, needs_triton, random_range_mask

import longca_triton as lt
from longca_triton.integrations import compiled_attention, mask_from_tensor, mask_tensor
from longca_triton.integrations.ops import MASKS
from longca_triton.masks import from_row_intervals, window_mask

BACKENDS = [pytest.param("reference", id="reference"),
            pytest.param("triton", id="triton", marks=needs_triton)]


def qkv(b, sq, sk, hq, hkv, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
            for s, h in ((sq, hq), (sk, hkv), (sk, hkv))]


def grads_of(out, lse, inputs):
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g).to(out)
    dlse = torch.randn(lse.shape, generator=g).to(lse).masked_fill(torch.isinf(lse), 0)
    return torch.autograd.grad((out, lse), inputs, (dout, dlse))


def close(a, b, dtype=torch.float32):
    return (a.float() - b.float()).abs().max().item() / max(1.0, b.float().abs().max().item()) < TOL[dtype]


MASK_CASES = {
    "causal-documents-gqa": (lambda: lt.make_mask("causal_document", 77, doc_lens=[30, 9, 38]), 2, 4, 2),
    "random-slices-empty-rows": (lambda: random_range_mask(70, 90, seed=3), 1, 2, 1),
    "window-sq-lt-sk": (lambda: window_mask(45, 83, causal=True, window_size=(20, -1)), 2, 3, 3),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(MASK_CASES))
def test_matches_the_reference(backend, case):
    build, b, hq, hkv = MASK_CASES[case]
    mask = build()
    q, k, v = qkv(b, mask.seqlen_q, mask.seqlen_k, hq, hkv, 32)
    out, lse = compiled_attention(q, k, v, mask_tensor(mask, device=DEVICE), backend=backend, return_lse=True)
    ref_out, ref_lse = lt.attention(q, k, v, mask, backend="reference", return_lse=True)
    assert close(out, ref_out)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert close(lse[finite], ref_lse[finite])
    for got, want in zip(grads_of(out, lse, (q, k, v)), grads_of(ref_out, ref_lse, (q, k, v))):
        assert close(got, want)


@pytest.mark.parametrize("backend", [pytest.param("default", id="default", marks=needs_triton), *BACKENDS])
@pytest.mark.parametrize("d, dv", [(59, 59), (20, 37)], ids=["D=59", "D=20-Dv=37"])
def test_head_dims_off_the_multiples_of_8_are_padded(backend, d, dv):
    """Any head dim runs (zero-padded around the op), with the scale of the true D_qk."""
    mask = lt.make_mask("causal_document", 48, doc_lens=[20, 28])
    q, k, _ = qkv(1, 48, 48, 2, 1, d)
    (v,) = qkv(1, 48, 48, 1, 1, dv, seed=5)[1:2]
    out, lse = compiled_attention(q, k, v, mask_tensor(mask, device=DEVICE), backend=backend, return_lse=True)
    ref_out, ref_lse = lt.attention(q, k, v, mask, backend="reference", return_lse=True)
    assert out.shape == (1, 48, 2, dv) and close(out, ref_out) and close(lse, ref_lse)
    for got, want in zip(grads_of(out, lse, (q, k, v)), grads_of(ref_out, ref_lse, (q, k, v))):
        assert got.shape == want.shape and close(got, want)
    with pytest.raises(ValueError, match="head dim 300 not supported"):
        compiled_attention(*qkv(1, 48, 48, 2, 1, 300), mask, backend=backend)


def test_row_intervals_and_slices_give_one_mask():
    S = 64
    lo = np.maximum(np.arange(S) - 9, 0)
    hi = np.arange(S)
    hi[5:8] = -1  # three rows that attend nothing
    rows = torch.as_tensor(np.stack([lo, hi], 1), dtype=torch.int64)
    expected = from_row_intervals(lo, hi, S)
    assert torch.equal(mask_from_tensor(rows, S, S).to_dense(), expected.to_dense())
    assert torch.equal(mask_from_tensor(mask_tensor(expected), S, S).to_dense(), expected.to_dense())


def test_mask_tensor_pads_to_a_power_of_two():
    mask = lt.make_mask("causal_document", 64, doc_lens=[10] * 6 + [4])  # 7 slices
    t = mask_tensor(mask)
    assert t.shape == (8, 5) and t.dtype == torch.int64
    assert (t[7] == 0).all()
    assert mask_tensor(lt.make_mask("causal_document", 64, doc_lens=[4] * 16)).shape == (16, 5)
    assert mask_tensor(mask, capacity=12).shape == (12, 5)
    with pytest.raises(ValueError, match="capacity 4 is smaller than the mask's 7 slices"):
        mask_tensor(mask, capacity=4)


def test_one_mask_object_per_content():
    mask = lt.make_mask("causal_document", 64, doc_lens=[20, 44])
    first = MASKS.get(mask_tensor(mask), 64, 64)
    again = MASKS.get(mask_tensor(mask), 64, 64)
    assert first is again
    assert MASKS.get(mask_tensor(mask, capacity=32), 64, 64) is first  # padding rows are no part of it
    other = MASKS.get(mask_tensor(lt.make_mask("causal_document", 64, doc_lens=[21, 43])), 64, 64)
    assert other is not first


class TinyAttentionModel(torch.nn.Module):
    """One projection to GQA q, k, v (4 query heads, 2 kv heads, head dim 16) and our attention."""

    def __init__(self, backend):
        super().__init__()
        self.backend = backend
        self.proj = torch.nn.Linear(32, 4 * 16 + 2 * 2 * 16)

    def forward(self, x, mask_meta):
        b, s, _ = x.shape
        h = self.proj(x)
        q = h[..., :64].reshape(b, s, 4, 16)
        k = h[..., 64:96].reshape(b, s, 2, 16)
        v = h[..., 96:].reshape(b, s, 2, 16)
        return compiled_attention(q, k, v, mask_meta, backend=self.backend).square().mean()


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiles_once_however_the_documents_change(backend):
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    torch.manual_seed(0)
    model = TinyAttentionModel(backend).to(DEVICE)
    compiled = torch.compile(model, backend=counting, fullgraph=True)
    x = torch.randn(1, 64, 32, device=DEVICE)
    # two, three, then sixteen documents (8 then 16 slice rows), then two again
    for lens in ([30, 34], [10, 20, 34], [4] * 16, [5, 59]):
        meta = mask_tensor(lt.make_mask("causal_document", 64, doc_lens=lens), device=DEVICE)
        loss = compiled(x, meta)
        (grad,) = torch.autograd.grad(loss, model.proj.weight)
        ref = model(x, meta)
        (ref_grad,) = torch.autograd.grad(ref, model.proj.weight)
        assert close(loss, ref) and close(grad, ref_grad)
    assert len(graphs) == 1


@pytest.mark.parametrize("meta, message", [
    (torch.zeros(4, 5, dtype=torch.int32), "int64 metadata, slices"),
    (torch.zeros(4, 3, dtype=torch.int64), "int64 metadata, slices"),
    (torch.zeros(50, 2, dtype=torch.int64), "row-interval metadata has 50 rows but q has 64"),
    (torch.tensor([[0, 64, 0, 80, 1]]), r"k range \[0, 80\) lies outside \[0, 64\)"),
    (torch.tensor([[0, 64, 0, 64, 7]]), "unknown slice kind 7"),
], ids=["int32", "three-columns", "row-count", "slice-outside", "bad-kind"])
def test_bad_metadata_is_one_value_error(meta, message):
    q, k, v = qkv(1, 64, 64, 2, 1, 16)
    with pytest.raises(ValueError, match=message):
        compiled_attention(q, k, v, meta, backend="reference")


def test_bad_calls_are_value_errors():
    q, k, v = qkv(1, 64, 64, 2, 1, 16)
    causal = lt.make_mask("causal", 64)
    with pytest.raises(ValueError, match="compiled_attention runs backends default, triton, triton-gluon, reference; got 'flex'"):
        compiled_attention(q, k, v, causal, backend="flex")
    with pytest.raises(ValueError, match="mask must be a RangeMask"):
        compiled_attention(q, k, v, lt.make_mask("block_sparse", 64, block=16, seed=0))
    with pytest.raises(ValueError, match="mask is 32x32"):
        compiled_attention(q, k, v, lt.make_mask("causal", 32), backend="reference")
    with pytest.raises(ValueError, match="q must be a 4-D tensor"):
        compiled_attention(q[0], k, v, causal)
    # the default backend's kernels are checked too, before any kernel runs
    with pytest.raises(ValueError, match="backend 'triton' cannot run this case: dtype torch.float64"):
        compiled_attention(*(t.double() for t in (q, k, v)), causal)


@pytest.mark.gpu
@pytest.mark.parametrize("train", [False, True], ids=["forward", "training"])
def test_the_default_runs_the_default_backends_kernels_on_the_gpu(train, monkeypatch):
    """On the GPU the op's default is ``longca_triton.attention``'s choice for the call's mode (the Gluon
    kernels on Hopper where the shipped table says so), and its numbers match ``lt.attention``'s."""
    from longca_triton.integrations import ops

    S = 4096
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, S, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=train) for h in (16, 2, 2))
    mask = lt.make_mask("causal", S)
    ran = []
    kernels = ops._kernels
    monkeypatch.setattr(ops, "_kernels", lambda *a: ran.append(kernels(*a)) or ran[-1])
    out = compiled_attention(q, k, v, mask)
    expected = lt.api.default_backend(mask, q, k, v, mode="fwd_bwd" if train else "fwd")
    assert ran == [expected if expected in ops._FWD else "triton"]
    ref = lt.attention(q, k, v, mask, backend=expected)
    assert torch.equal(out, ref)
    if train:
        do = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), do)
        want = torch.autograd.grad(ref, (q, k, v), do)
        assert ran[-1] == ran[0] and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
def test_compiled_bf16_model_at_2k_on_the_gpu():
    torch.manual_seed(0)
    S = 2048
    q, k, v = (torch.randn(2, S, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (8, 2, 2))

    def f(q, k, v, meta):
        return compiled_attention(q, k, v, meta).float().square().mean()

    compiled = torch.compile(f, fullgraph=True)
    for lens in ([700, 1000, 348], [100] * 20 + [48]):
        meta = mask_tensor(lt.make_mask("causal_document", S, doc_lens=lens), device="cuda")
        loss = compiled(q, k, v, meta)
        grads = torch.autograd.grad(loss, (q, k, v))
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        ref = lt.attention(q32, k32, v32, mask_from_tensor(meta, S, S), backend="reference-chunked").square().mean()
        ref_grads = torch.autograd.grad(ref, (q32, k32, v32))
        assert abs(loss.item() - ref.item()) < 2e-2 * max(1.0, abs(ref.item()))
        for a, b in zip(grads, ref_grads):
            assert (a.float() - b).abs().max().item() < 2e-2 * max(1.0, b.abs().max().item())

"""Every vendor adapter's lowering, checked on the CPU against ``mask.to_dense()``.

For each adapter the arguments it builds (cu_seqlens, windows, causal flags, startend row
indices, dense masks, BlockMasks) are turned back into a dense mask with an *independent*
interpreter of the vendor's documented convention, and compared with the IR. Then each adapter's
call plumbing (packing, argument names, lse layout) runs end to end against a fake vendor module
that implements the documented semantics with plain PyTorch, so the adapters are exercised even
where the vendor package is absent.
"""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch

import longca_triton as lt
from longca_triton.adapters import Problem, get_backend
from longca_triton.adapters._common import dense_mask, dense_mask_rows, flash_args, packed_cu_seqlens
from longca_triton.adapters.cudnn import cudnn_call_args
from longca_triton.adapters.flash import fa_window
from longca_triton.adapters.flashmask import flashmask_startend
from longca_triton.adapters.sdpa import sdpa_lowering
from longca_triton.adapters.te import te_call_args
from longca_triton.adapters.varlen import varlen_call_args
from longca_triton.masks import STATIC_MASK_NAMES, NotExpressible
from longca_triton.reference import naive_attention

S = 300
DOCS = [50, 70, 80, 100]


def build(name: str, S: int = S, seed: int = 3):
    kw = {}
    spec = lt.masks.MASK_SPECS[name].defaults
    if "window" in spec:
        kw["window"] = 20
    if name == "global_sliding_window":
        kw["global_tokens"] = 10
    if name == "block_causal_document":
        kw.update(block=32, doc_bounds=[0, 64, 160, 256, S])
    elif "doc_lens" in spec and S == sum(DOCS):
        kw["doc_lens"] = DOCS
    if "prefix" in spec:
        kw["prefix"] = 30 if name == "prefix_lm_causal" else 12
    if name == "block_sparse":
        kw.update(block=32, density=0.4, patterns=2)
    return lt.make_mask(name, S, seed=seed, **kw)


#: masks FlashAttention-style kernels express (documents with a window), with these parameters
FLASH_EXPRESSIBLE = {"full", "causal", "full_document", "causal_document", "sliding_window", "sliding_window_causal"}
#: masks FlashMask's column form expresses (all static ones)
FLASHMASK_EXPRESSIBLE = set(STATIC_MASK_NAMES)


# ---------------------------------------------------------------------------- interpreters
def fa_dense(cu, S, causal, left, right) -> torch.Tensor:
    """FlashAttention's documented semantics: row i sees keys of its document in
    [i - left, i + right] (-1 or None = unbounded); causal forces right = 0."""
    cu = np.asarray(cu if cu is not None else [0, S])
    doc = np.searchsorted(cu, np.arange(S), side="right") - 1
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    ok = doc[:, None] == doc[None, :]
    if causal:
        right = 0
    if left is not None and left >= 0:
        ok &= j >= i - left
    if right is not None and right >= 0:
        ok &= j <= i + right
    return torch.from_numpy(ok)


def cudnn_dense(cu, S, is_causal, lb, rb) -> torch.Tensor:
    """cuDNN: diagonal_band_left_bound lb masks j <= i - lb (lb visible keys incl. self);
    right bound rb masks j > i + rb; is_causal masks j > i."""
    cu = np.asarray(cu if cu is not None else [0, S])
    doc = np.searchsorted(cu, np.arange(S), side="right") - 1
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    ok = doc[:, None] == doc[None, :]
    if is_causal:
        ok &= j <= i
    if lb >= 0:
        ok &= j > i - lb
    if rb >= 0:
        ok &= j <= i + rb
    return torch.from_numpy(ok)


def flashmask_dense(se: np.ndarray, causal: bool, Sq: int) -> torch.Tensor:
    """FlashMask's documented conversion (flashmask_to_densemask), written independently."""
    Sk, n = se.shape
    allowed = torch.ones(Sq, Sk, dtype=torch.bool)
    has_end = (causal and n == 2) or ((not causal) and n == 4)
    for j in range(Sk):
        down = int(se[j, 0])
        if has_end:
            allowed[down : int(se[j, 1]), j] = False
        else:
            allowed[down:, j] = False
        if causal:
            allowed[:j, j] = False
        elif has_end:
            allowed[int(se[j, 2]) : int(se[j, 3]), j] = False
        else:
            allowed[: int(se[j, 1]), j] = False
    return allowed


def block_diag(dense: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.block_diag(*([dense] * batch))


def lower_or_refuse(lower, name: str, expressible):
    """``(mask, lower(mask))`` for the mask ``name``; for a name outside ``expressible``, check that
    ``lower`` refuses it with ``NotExpressible`` and return ``(mask, None)``."""
    m = build(name)
    if name in expressible:
        return m, lower(m)
    with pytest.raises(NotExpressible):
        lower(m)
    return m, None


# ---------------------------------------------------------------------------- lowering -> dense
@pytest.mark.parametrize("name", STATIC_MASK_NAMES)
def test_flash_args_matches_dense(name):
    m, fa = lower_or_refuse(flash_args, name, FLASH_EXPRESSIBLE)
    if fa is None:
        return
    assert torch.equal(fa_dense(fa.cu_seqlens, S, fa.causal, *fa.window), m.to_dense())
    # FA4 spells unbounded None: same set
    l4, r4 = fa_window(fa, none_for_unbounded=True)
    assert torch.equal(fa_dense(fa.cu_seqlens, S, fa.causal, l4, r4), m.to_dense())
    # packed batch of 3: block diagonal
    cu3 = packed_cu_seqlens(fa, 3)
    assert cu3.dtype == np.int32 and cu3[-1] == 3 * S
    assert torch.equal(fa_dense(cu3, 3 * S, fa.causal, *fa_window(fa)), block_diag(m.to_dense(), 3))


def test_flash_args_kinds():
    assert flash_args(build("full")).kind == "full"
    assert flash_args(build("causal")).kind == "causal"
    assert flash_args(build("causal_document")).kind == "varlen-causal"
    assert flash_args(build("sliding_window_causal")).kind == "window"
    assert flash_args(build("sliding_window_causal")).window == (20, 0)
    assert flash_args(build("sliding_window")).window == (20, 20)
    fa = flash_args(build("causal_document"))
    assert list(fa.cu_seqlens) == [0, 50, 120, 200, 300] and fa.max_seqlen == 100


@pytest.mark.parametrize("name", sorted(FLASH_EXPRESSIBLE))
@pytest.mark.parametrize("new_api", [True, False])
def test_varlen_args_matches_dense(name, new_api):
    m = build(name)
    fa = flash_args(m)
    params = {"window_size", "return_aux", "enable_gqa"} if new_api else {"is_causal"}
    if not new_api and fa.has_window:
        with pytest.raises(Exception, match="window"):
            varlen_call_args(fa, 2, params)
        return
    a = varlen_call_args(fa, 2, params)
    if new_api:
        left, right = a["window_size"]
        dense = fa_dense(a["cu_seqlens"], 2 * S, False, left, right)
    else:
        dense = fa_dense(a["cu_seqlens"], 2 * S, a["is_causal"], -1, -1)
    assert torch.equal(dense, block_diag(m.to_dense(), 2))
    assert a["max_seqlen"] == (fa.max_seqlen if fa.varlen else S)


@pytest.mark.parametrize("name", sorted(FLASH_EXPRESSIBLE))
def test_cudnn_args_matches_dense(name):
    m = build(name)
    a = cudnn_call_args(flash_args(m), 2)
    if "cu_seqlens" in a:
        dense = cudnn_dense(a["cu_seqlens"], 2 * S, a["is_causal"], a["window_left"], a["window_right"])
        assert torch.equal(dense, block_diag(m.to_dense(), 2))
    else:
        assert torch.equal(cudnn_dense(None, S, a["is_causal"], a["window_left"], a["window_right"]), m.to_dense())
    assert not (a["is_causal"] and a["window_right"] > 0)  # the op rejects that pairing


def test_cudnn_left_bound_is_fa_plus_one():
    a = cudnn_call_args(flash_args(build("sliding_window_causal")), 1)
    assert a == {"is_causal": True, "window_left": 21, "window_right": -1}


@pytest.mark.parametrize("name", sorted(FLASH_EXPRESSIBLE))
def test_te_args_matches_dense(name):
    m = build(name)
    a = te_call_args(flash_args(m), 2)
    causal = a["attn_mask_type"] in ("causal", "padding_causal")
    left, right = a["window_size"]
    if a["qkv_format"] == "thd":
        assert a["attn_mask_type"].startswith("padding")
        assert torch.equal(fa_dense(a["cu_seqlens"], 2 * S, causal, left, right), block_diag(m.to_dense(), 2))
    else:
        assert a["qkv_format"] == "bshd" and a["attn_mask_type"] in ("causal", "no_mask")
        assert torch.equal(fa_dense(None, S, causal, left, right), m.to_dense())


@pytest.mark.parametrize("name", STATIC_MASK_NAMES + ("block_sparse",))
def test_flashmask_startend_matches_dense(name):
    m, lowered = lower_or_refuse(flashmask_startend, name, FLASHMASK_EXPRESSIBLE)
    if lowered is None:
        return
    se, causal = lowered
    assert se.dtype == np.int32 and se.shape[0] == S and se.shape[1] in (1, 2, 4)
    assert torch.equal(flashmask_dense(se, causal, S), m.to_dense())


def test_flashmask_picks_compact_forms():
    se, causal = flashmask_startend(build("causal"))
    assert causal and se.shape[1] == 1
    se, causal = flashmask_startend(build("causal_document"))
    assert causal and se.shape[1] == 1
    se, causal = flashmask_startend(build("sliding_window"))
    assert not causal


@pytest.mark.parametrize("name", STATIC_MASK_NAMES + ("block_sparse",))
def test_sdpa_lowering(name):
    m = build(name)
    form = sdpa_lowering(m, takes_attn_mask=True, label="x")
    expected = {"full": "full", "causal": "causal"}.get(name, "dense")
    if name in ("share_question", "causal_blockwise") and form == "causal":
        expected = "causal"  # with few documents these can coincide with causal
    assert form == expected
    if form == "dense":
        dm = dense_mask(m, "cpu", 4 if m.num_patterns > 1 else None)
        ref = m.to_dense()
        ref = ref[torch.as_tensor(m.pattern_of_head(4))] if m.num_patterns > 1 else ref[None]
        assert torch.equal(dm, ref)
    if expected == "dense":
        with pytest.raises(NotExpressible, match="attn_mask"):
            sdpa_lowering(m, takes_attn_mask=False, label="flash")


@pytest.mark.parametrize("name", ["prefix_lm_document", "global_sliding_window", "block_sparse"])
def test_dense_mask_rows(name):
    m = build(name)
    full = m.to_dense()
    pats = [0, 1, 1] if m.num_patterns > 1 else None
    got = dense_mask_rows(m, slice(37, 151), "cpu", patterns=pats)
    ref = full[torch.as_tensor(pats)][:, 37:151] if pats else full[None, 37:151]
    assert torch.equal(got, ref)


# ---------------------------------------------------------------------------- supports() reasons
def _problem(name, mode="fwd", device="cuda", dtype=torch.bfloat16, hq=8, hkv=2, D=128):
    return Problem(mask=build(name), heads_q=hq, heads_kv=hkv, head_dim=D, dtype=dtype, mode=mode, device=device)


def test_supports_reasons():
    ok, why = get_backend("sdpa-flash").supports(_problem("causal_document"))
    assert not ok and "attn_mask" in why
    assert get_backend("sdpa-flash").supports(_problem("causal"))[0]
    assert get_backend("sdpa-cudnn").supports(_problem("share_question"))[0]
    ok, why = get_backend("fa3-fwd").supports(_problem("sliding_window_causal"))
    assert not ok and "window" in why
    ok, why = get_backend("fa3-fwd").supports(_problem("causal", dtype=torch.float16))
    assert not ok and "float16" in why
    assert "fwd" in get_backend("fa3-fwd").modes and "bwd" not in get_backend("fa3-fwd").modes
    ok, why = get_backend("cudnn").supports(_problem("prefix_lm_document"))
    assert not ok and "row" in why
    ok, why = get_backend("varlen-fa2").supports(_problem("causal", device="cpu"))
    assert not ok and "CUDA" in why
    ok, why = get_backend("flex").supports(_problem("causal", mode="bwd", device="cpu", dtype=torch.float32))
    assert not ok and "backward" in why
    ok, why = get_backend("fa4").supports(_problem("causal", D=80))
    assert not ok and "head_dim" in why


def test_check_reports_missing_vendor():
    # check() = available() first: absent packages are named in the reason
    for name, word in (("fa2", "flash"), ("te", "TransformerEngine"), ("flashmask", "FlashMask")):
        b = get_backend(name)
        ok, why = b.available()
        if not ok:
            assert word.lower() in why.lower()


# ---------------------------------------------------------------------------- end-to-end plumbing on the CPU
def _attn(q, k, v, allowed, scale):
    """[T, H, D] or [B, S, H, D] attention with a dense [S, S] mask; returns out, lse [H, T] / [B, H, S]."""
    squeeze = q.dim() == 3
    if squeeze:
        q, k, v = q[None], k[None], v[None]
    g = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(g, dim=2)
    v = v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.float()).to(q.dtype)
    if squeeze:
        return out[0], lse[0]
    return out, lse


def _inputs(B=2, hq=4, hkv=2, D=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, hq, D, generator=g, dtype=dtype)
    k = torch.randn(B, S, hkv, D, generator=g, dtype=dtype)
    v = torch.randn(B, S, hkv, D, generator=g, dtype=dtype)
    return q, k, v


def _ref(q, k, v, m):
    return naive_attention(q.double(), k.double(), v.double(), m, return_lse=True)


def _assert_close(out, lse, q, k, v, m, check_lse=True):
    ref, rlse = _ref(q, k, v, m)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    if check_lse:
        assert lse is not None and lse.shape == rlse.shape
        torch.testing.assert_close(lse.double(), rlse, atol=2e-5, rtol=2e-5)


def _problem_cpu(m, q, k, mode="fwd"):
    return Problem(mask=m, batch=q.shape[0], heads_q=q.shape[2], heads_kv=k.shape[2], head_dim=q.shape[3], dtype=q.dtype, mode=mode, device="cpu")


def _run_adapter(backend, m, q, k, v):
    p = _problem_cpu(m, q, k)
    plan = backend.materialize(p, backend.lower(p), "cpu")
    return backend.run(plan, q, k, v, p.scale)


def _install_fake(monkeypatch, name: str, module) -> None:
    """Put a fake vendor module in ``sys.modules`` (for this test) and forget cached imports."""
    from longca_triton.adapters import _common

    monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(_common, "_IMPORTS", {})


def _check_plumbing(backend, names, check_lse: bool = True) -> None:
    """The adapter's lowering + call against the fake vendor matches the reference on these masks."""
    for name in names:
        m = build(name)
        q, k, v = _inputs()
        out, lse = _run_adapter(backend, m, q, k, v)
        if not check_lse:
            assert lse is None
        _assert_close(out, lse, q, k, v, m, check_lse=check_lse)


@pytest.fixture
def fake_fa(monkeypatch):
    """A fake FlashAttention-2 module following the documented API and semantics."""
    mod = types.ModuleType("flash_attn")
    calls = []

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), return_attn_probs=False):
        calls.append(("dense", causal, window_size))
        allowed = fa_dense(None, q.shape[1], causal, *window_size)
        out, lse = _attn(q, k, v, allowed, softmax_scale)
        return (out, lse, None) if return_attn_probs else out

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), return_attn_probs=False):
        calls.append(("varlen", causal, window_size, max_q))
        assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
        allowed = fa_dense(cu_q.numpy(), q.shape[0], causal, *window_size)
        out, lse = _attn(q, k, v, allowed, softmax_scale)
        return (out, lse, None) if return_attn_probs else out  # lse [H, T]

    mod.flash_attn_func, mod.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    _install_fake(monkeypatch, "flash_attn", mod)
    return calls


@pytest.mark.parametrize("name", ["causal", "causal_document", "sliding_window", "full_document"])
def test_fa2_plumbing_against_fake_vendor(fake_fa, name):
    m = build(name)
    q, k, v = _inputs()
    out, lse = _run_adapter(get_backend("fa2"), m, q, k, v)
    _assert_close(out, lse, q, k, v, m)
    assert fake_fa[-1][0] == ("varlen" if flash_args(m).varlen else "dense")


def test_fa4_plumbing_against_fake_vendor(monkeypatch):
    mod = types.ModuleType("flash_attn.cute.interface")

    def norm(w):
        return tuple(-1 if x is None else x for x in w)

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), return_lse=False):
        out, lse = _attn(q, k, v, fa_dense(None, q.shape[1], causal, *norm(window_size)), softmax_scale)
        return out, (lse if return_lse else None)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                               softmax_scale=None, causal=False, window_size=(None, None), return_lse=False):
        out, lse = _attn(q, k, v, fa_dense(cu_seqlens_q.numpy(), q.shape[0], causal, *norm(window_size)), softmax_scale)
        return out, (lse if return_lse else None)

    mod.flash_attn_func, mod.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    _install_fake(monkeypatch, "flash_attn.cute.interface", mod)
    _check_plumbing(get_backend("fa4"), ("sliding_window_causal", "causal_document"))


def test_cudnn_plumbing_against_fake_vendor(monkeypatch):
    mod = types.ModuleType("cudnn")

    def sdpa_torch(q, k, v, *, scale=None, is_causal=False, window_left=-1, window_right=-1, cu_seqlens_q=None,
                   cu_seqlens_kv=None, max_seqlen_q=0, max_seqlen_kv=0, return_lse=False):
        if cu_seqlens_q is None:  # dense BHSD
            allowed = cudnn_dense(None, q.shape[2], is_causal, window_left, window_right)
            out, lse = _attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), allowed, scale)
            return out.transpose(1, 2), lse[..., None]  # (B, H, S, 1)
        allowed = cudnn_dense(cu_seqlens_q.numpy(), q.shape[0], is_causal, window_left, window_right)
        out, lse = _attn(q, k, v, allowed, scale)
        return out, lse.t()[..., None]  # (T, H, 1)

    mod.sdpa_torch = sdpa_torch
    _install_fake(monkeypatch, "cudnn", mod)
    b = get_backend("cudnn")
    monkeypatch.setattr(b, "_fn", None, raising=False)  # restored after the test
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert b.available() == (True, "") and b._fn is sdpa_torch  # binds the fake sdpa_torch
    _check_plumbing(b, ("sliding_window_causal", "causal_document", "sliding_window", "full"))


def test_varlen_plumbing_against_fake_torch_varlen(monkeypatch):
    mod = types.ModuleType("torch.nn.attention.varlen")

    class AuxRequest(tuple):
        def __new__(cls, lse=False):
            return tuple.__new__(cls, (lse,))

        @property
        def lse(self):
            return self[0]

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False):
        assert enable_gqa or query.shape[1] == key.shape[1]
        allowed = fa_dense(cu_seq_q.numpy(), query.shape[0], False, *window_size)
        out, lse = _attn(query, key, value, allowed, scale)
        return (out, lse.t()) if return_aux is not None and return_aux.lse else out  # lse [T, H]

    mod.varlen_attn, mod.AuxRequest = varlen_attn, AuxRequest
    _install_fake(monkeypatch, "torch.nn.attention.varlen", mod)
    _check_plumbing(get_backend("varlen-fa2"), ("sliding_window_causal", "causal_document"))


def test_te_plumbing_against_fake_vendor(monkeypatch):
    te = types.ModuleType("transformer_engine.pytorch")

    class DotProductAttention(torch.nn.Module):
        def __init__(self, num_attention_heads, kv_channels, num_gqa_groups, attention_dropout, qkv_format, attn_mask_type,
                     window_size, softmax_scale):
            super().__init__()
            self.fmt, self.type, self.window, self.scale = qkv_format, attn_mask_type, window_size, softmax_scale

        def forward(self, q, k, v, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None):
            causal = "causal" in self.type
            if self.fmt == "thd":
                out, _ = _attn(q, k, v, fa_dense(cu_seqlens_q.numpy(), q.shape[0], causal, *self.window), self.scale)
                return out.reshape(q.shape[0], -1)  # TE returns [T, H*D]
            out, _ = _attn(q, k, v, fa_dense(None, q.shape[1], causal, *self.window), self.scale)
            return out.reshape(q.shape[0], q.shape[1], -1)

    te.DotProductAttention = DotProductAttention
    _install_fake(monkeypatch, "transformer_engine.pytorch", te)
    _check_plumbing(get_backend("te"), ("sliding_window", "causal_document", "causal"), check_lse=False)


def test_flashmask_plumbing_against_fake_vendor(monkeypatch):
    mod = types.ModuleType("flashmask_interface")

    def flashmask_attention(query, key, value, startend_row_indices=None, *, causal=False, softmax_scale=None, return_softmax_lse=False):
        assert startend_row_indices.dtype == torch.int32 and startend_row_indices.shape[:3] == (query.shape[0], 1, key.shape[1])
        allowed = flashmask_dense(startend_row_indices[0, 0].numpy(), causal, query.shape[1])
        out, lse = _attn(query, key, value, allowed, softmax_scale)
        return (out, lse) if return_softmax_lse else out

    mod.flashmask_attention = flashmask_attention
    _install_fake(monkeypatch, "flashmask_interface", mod)
    _check_plumbing(get_backend("flashmask"), ("share_question", "prefix_lm_document", "global_sliding_window", "causal"))


# ---------------------------------------------------------------------------- real backends that run on the CPU
def _prepared_on_cpu(backend: str, mask_name: str):
    """``backend``'s prepared call on the CPU for a small mask, checked against the reference."""
    m = build(mask_name)
    q, k, v = _inputs(B=1)
    b = get_backend(backend)
    p = _problem_cpu(m, q, k)
    assert b.check(p) == (True, "")
    out, lse = b.prepare(p, q, k, v)()
    assert (lse is not None) == b.returns_lse
    _assert_close(out, lse, q, k, v, m, check_lse=b.returns_lse)
    return b, p


@pytest.mark.parametrize("name", ["causal", "share_question", "block_sparse"])
def test_sdpa_math_on_cpu(name):
    b, p = _prepared_on_cpu("sdpa-math", name)
    assert b.plan_for(p, "cpu").gqa == "native"


@pytest.mark.parametrize("name", ["causal_document", "global_sliding_window", "block_sparse"])
def test_flex_eager_on_cpu(name):
    _prepared_on_cpu("flex", name)


def test_public_api_uses_adapters():
    m = build("sliding_window_causal")
    q, k, v = _inputs(B=1)
    out, lse = lt.attention(q, k, v, m, backend="flex", return_lse=True)
    _assert_close(out, lse, q, k, v, m)
    with pytest.raises(ValueError, match="log-sum-exp"):
        lt.attention(q, k, v, m, backend="sdpa-math", return_lse=True)
    assert math.isfinite(lt.attention(q, k, v, m, backend="sdpa-math").sum().item())



def test_varlen_plumbing_torch_2_10_signature(monkeypatch):
    """Older varlen_attn: is_causal, no window, no enable_gqa, no lse -> K/V repeated, lse None,
    windows unsupported; in fwd mode the repeat happens in prepare (outside the timed call)."""
    mod = types.ModuleType("torch.nn.attention.varlen")
    seen = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, *, scale=None):
        seen.append(key.shape[1])
        out, _ = _attn(query, key, value, fa_dense(cu_seq_q.numpy(), query.shape[0], is_causal, -1, -1), scale)
        return out

    mod.varlen_attn = varlen_attn
    _install_fake(monkeypatch, "torch.nn.attention.varlen", mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    b = get_backend("varlen-fa2")
    m = build("causal_document")
    q, k, v = _inputs()
    p = _problem_cpu(m, q, k)
    p.device, p.dtype = "cuda", torch.bfloat16  # supports() wants CUDA + bf16; the fake runs on CPU fp32
    out, lse = b.prepare(p, q, k, v)()
    assert lse is None and seen[-1] == q.shape[2]  # K/V arrive repeated to Hq heads
    _assert_close(out, None, q, k, v, m, check_lse=False)
    ok, why = b.supports(Problem(mask=build("sliding_window_causal"), heads_q=4, heads_kv=2, head_dim=16, dtype=torch.bfloat16))
    assert not ok and "window" in why


# ---------------------------------------------------------------------------- registry contract
def test_backend_names_and_aliases():
    from longca_triton.adapters import ALIASES, canonical_name, list_backends

    names = {b.name for b in list_backends()}
    ours = {"triton", "triton-flashmask", "triton-sparse", "triton-varblock", "triton-gluon"}
    assert ours <= names and not set(ALIASES) & names
    assert {n for n in names if n.startswith("triton")} == ours  # vendors start with the vendor
    assert get_backend("flashmask-triton") is get_backend("triton-flashmask")
    assert canonical_name("flashmask-triton") == "triton-flashmask" and canonical_name("triton") == "triton"
    for b in list_backends():
        assert b.description, b.name
    with pytest.raises(ValueError, match="unknown backend"):
        get_backend("no-such-backend")


def test_public_api_builds_the_problem_once(monkeypatch):
    """``longca_triton.attention`` validates and resolves the scale, then hands the backend the Problem."""
    from longca_triton.adapters import BACKENDS, Backend

    seen = []

    class Spy(Backend):
        name, description = "spy", "records the problem it is called with"

        def call(self, problem, q, k, v, return_lse=False):
            seen.append(problem)
            return q

    monkeypatch.setitem(BACKENDS, "spy", Spy())
    m = build("causal")
    q, k, v = _inputs(B=1)
    lt.attention(q, k, v, m, backend="spy")
    lt.attention(q, k, v, m, backend="spy", softmax_scale=0.3)
    assert [p.scale for p in seen] == [pytest.approx(q.shape[-1] ** -0.5), 0.3]
    assert seen[0].scale_is_default and not seen[1].scale_is_default
    assert (seen[0].heads_q, seen[0].heads_kv, seen[0].head_dim, seen[0].mode) == (q.shape[2], k.shape[2], q.shape[3], "fwd")

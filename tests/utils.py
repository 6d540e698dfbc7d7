"""Helpers the kernel tests share: device, tolerances, small masks, the float64 comparison.

``conftest.py`` sets ``TRITON_INTERPRET=1`` on a machine without CUDA before anything imports
triton, so the kernels here run in the interpreter on CPU and compiled on a GPU.
"""

import os

import numpy as np
import pytest
import torch

from longca_triton.masks import RangeMask, make_mask
from longca_triton.reference.naive import naive_attention

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"

#: skip a module of kernel tests where neither the interpreter nor a GPU can run them
needs_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                  reason="needs TRITON_INTERPRET=1 or a CUDA GPU")

# normalised max error |x - ref|_max / max(1, |ref|_max), per dtype
TOL = {torch.float32: 2e-4, torch.float16: 6e-3}

DOC_MASKS = {"full_document", "causal_document", "share_question", "causal_blockwise",
             "prefix_lm_document"}


def doc_lens(S: int, seed: int) -> list:
    """A few documents of uneven length summing to S (the histograms' documents exceed tiny S)."""
    rng = np.random.default_rng(seed)
    n = int(min(S, rng.integers(2, 6)))
    cuts = np.sort(rng.choice(np.arange(1, S), size=n - 1, replace=False)) if n > 1 else []
    return [int(x) for x in np.diff(np.concatenate([[0], cuts, [S]]))]


def small_mask(name: str, S: int, seed: int = 0):
    params = {}
    if name in DOC_MASKS:
        params["doc_lens"] = doc_lens(S, seed)
    if name in ("sliding_window", "sliding_window_causal", "global_sliding_window"):
        params["window"] = 16
    if name == "global_sliding_window":
        params["global_tokens"] = min(S, 8)
    if name == "block_causal_document":
        params["block"] = 16
    return make_mask(name, S, seed=seed, **params)


def random_range_mask(sq: int, sk: int, seed: int, n_slices: int = 4) -> RangeMask:
    """Union of random slices of random kinds; rows outside every slice stay fully masked."""
    rng = np.random.default_rng(seed)
    slices = []
    for _ in range(n_slices):
        q0, q1 = sorted(rng.choice(sq + 1, size=2, replace=False))
        k0, k1 = sorted(rng.choice(sk + 1, size=2, replace=False))
        slices.append((int(q0), int(q1), int(k0), int(k1), ["FULL", "CAUSAL", "INVCAUSAL", "BICAUSAL"][rng.integers(4)]))
    # leave the first rows empty on purpose (fully masked rows)
    slices = [s for s in slices if s[0] >= 3] or [(3, sq, 0, sk, "FULL")]
    return RangeMask(sq, sk, slices, name="random")


def compare_to_reference(attn, ref_mask, sq, sk, B, Hq, Hkv, D, dtype, *, seed=0, layout="bshd", dlse=False,
                         dv=None, reference=None):
    """``attn(q, k, v) -> (out, lse)`` against the float64 naive reference on ``ref_mask``: out,
    lse (and its -inf pattern), dq, dk, dv, optionally with an lse gradient. Shared by every
    kernel test (dense, FlashMask). ``D`` is the head dim of q and k, ``dv`` v's (default ``D``).
    ``reference(q, k, v) -> (out, lse)`` on float64 leaves replaces the naive reference on ``ref_mask``."""
    torch.manual_seed(seed)

    def make(S, H, d=D):
        if layout == "bhsd":  # non-contiguous [B, S, H, D] view of a [B, H, S, D] tensor
            return torch.randn(B, H, S, d, dtype=dtype, device=DEVICE).transpose(1, 2)
        return torch.randn(B, S, H, d, dtype=dtype, device=DEVICE)

    q, k, v = (t.requires_grad_() for t in (make(sq, Hq), make(sk, Hkv), make(sk, Hkv, dv or D)))
    out, lse = attn(q, k, v)
    dout = torch.randn_like(out)
    g_lse = torch.randn_like(lse) if dlse else None
    loss = (out.float() * dout.float()).sum()
    if dlse:
        loss = loss + (torch.where(torch.isinf(lse), 0.0, lse) * g_lse).sum()
    loss.backward()

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    if reference is None:
        ref_out, ref_lse = naive_attention(q64, k64, v64, ref_mask, return_lse=True)
    else:
        ref_out, ref_lse = reference(q64, k64, v64)
    ref_loss = (ref_out * dout.double()).sum()
    if dlse:
        ref_loss = ref_loss + (torch.where(torch.isinf(ref_lse), 0.0, ref_lse) * g_lse.double()).sum()
    ref_loss.backward()

    tol = TOL[dtype]

    def check(name, x, ref):
        assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)} vs {tuple(ref.shape)}"
        assert not torch.isnan(x).any(), f"{name}: NaN"
        err = ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item() if x.numel() else 0.0
        assert err <= tol, f"{name}: normalised max error {err:.3e} > {tol:.1e}"

    check("out", out, ref_out)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "lse: -inf pattern differs"
    fin = ~torch.isinf(ref_lse)
    check("lse", lse[fin], ref_lse[fin])
    check("dq", q.grad, q64.grad)
    check("dk", k.grad, k64.grad)
    check("dv", v.grad, v64.grad)
    return out, lse


def assert_grads_near_float64(grads, q, k, v, dout, mask, factor: float = 2.0):
    """``grads`` (dq, dk, dv of a low-precision kernel for ``q, k, v, dout``) against float64 (the naive
    reference): each finite and its relative error within ``factor`` x the error of the same computation done
    by PyTorch in the inputs' dtype (+ 1e-3). For the ``-m gpu`` tests at real sizes."""
    def ref(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        naive_attention(*leaves, mask).backward(dout.to(dtype))
        return [t.grad for t in leaves]

    exact, low = ref(torch.float64), ref(q.dtype)
    for name, g, e, lo in zip(("dq", "dk", "dv"), grads, exact, low):
        assert torch.isfinite(g).all(), f"{name} not finite"
        err = ((g.double() - e).norm() / e.norm()).item()
        base = ((lo.double() - e).norm() / e.norm()).item()
        assert err <= factor * base + 1e-3, f"{name}: error {err:.2e} against {q.dtype} PyTorch's {base:.2e}"


# tiles that are neither square nor equal across the passes
ODD_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, DKDV_BLOCK_M=16, DKDV_BLOCK_N=64, DQ_BLOCK_M=64,
                  DQ_BLOCK_N=16)


def spy_launches(monkeypatch, module, kernel: str, key: str) -> list:
    """Wrap ``module.<kernel>`` (monkeypatched) so every launch still runs and appends its keyword argument
    ``key`` to the returned list: a test can then say which value reached the kernel."""
    real, seen = getattr(module, kernel), []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs[key])
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, kernel, Spy())
    return seen


def fake_side_stream(events: list):
    """A stand-in for ``kernels._runtime.side_stream`` (monkeypatched into a launcher's module): it
    appends ``("side_stream", on)`` to ``events`` when entered; ``state["beside"]`` (the second value
    returned) is True inside its ``beside()`` block, so a recorded launch can say where it ran."""
    import contextlib

    state = {"beside": False}

    @contextlib.contextmanager
    def side_stream(device, enabled):
        events.append(("side_stream", bool(enabled)))

        @contextlib.contextmanager
        def beside():
            state["beside"] = True
            try:
                yield
            finally:
                state["beside"] = False

        yield beside

    return side_stream, state

"""FlashAttention's own test matrix in this project's terms: the axes, the case draw and its pass bar.

The axes are those of FlashAttention's ``test_flash_attn_output``: head dims, (Sq, Sk) pairs, no
mask / causal / a local window (left, right) aligned to the bottom-right corner, with and without
causal; MHA, GQA and MQA over 6 query heads, fp16 and bf16, batch 2. Each case draws its head layout,
dtype and window from its own seed, so every (head dim, lengths, mask kind) runs once with a fixed draw.

The bar is FlashAttention's: every error of out, lse, dq, dk, dv against a float32 reference is at
most twice the error of the same math run by PyTorch in the low precision, plus a rounding slack
(FlashAttention-3's: twice the float32 rounding of the reference values). NaN never passes.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from longca_triton.masks import window_mask
from longca_triton.reference.naive import naive_attention

HEAD_DIMS = (32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)
SEQLENS = ((1, 239), (3, 799), (127, 512), (127, 513), (113, 203), (128, 217), (113, 211), (108, 256),
           (256, 512), (384, 256), (640, 128), (512, 256), (1024, 1024), (1023, 1024), (1024, 1023),
           (2048, 2048), (4224, 4224))
MASK_KINDS = ("full", "causal", "local", "local_causal")
#: query heads : KV heads
HEAD_LAYOUTS = {"mha": (6, 6), "gqa": (6, 2), "mqa": (6, 1)}
#: the same layouts over 4 query heads, for the interpreter's smaller runs
SMALL_HEAD_LAYOUTS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
BATCH = 2
#: the tensors compared, in order
NAMES = ("out", "lse", "dq", "dk", "dv")


@dataclass(frozen=True)
class Case:
    d: int
    sq: int
    sk: int
    kind: str
    layout: str
    dtype: torch.dtype
    window: tuple[int, int]
    batch: int = BATCH
    small_heads: bool = False

    @property
    def heads(self) -> tuple[int, int]:
        return (SMALL_HEAD_LAYOUTS if self.small_heads else HEAD_LAYOUTS)[self.layout]

    @property
    def id(self) -> str:
        hq, hkv = self.heads
        w = f"-window={self.window[0]},{self.window[1]}" if self.kind.startswith("local") else ""
        dt = str(self.dtype).replace("torch.", "")
        return f"Sq={self.sq}-Sk={self.sk}-Hq={hq}-Hkv={hkv}-D={self.d}-{self.kind}{w}-{dt}"

    def mask(self):
        causal = self.kind in ("causal", "local_causal")
        window = self.window if self.kind.startswith("local") else (-1, -1)
        return window_mask(self.sq, self.sk, causal, window)


def draw_case(d: int, sq: int, sk: int, kind: str, dtypes=(torch.float16, torch.bfloat16), batch: int = BATCH,
              small_heads: bool = False) -> Case:
    """The case of one (head dim, lengths, mask kind) with its head layout, dtype and window drawn from a
    seed of those four, so that a rerun draws the same."""
    seed = (d * 1_000_003 + sq * 10_007 + sk * 101 + MASK_KINDS.index(kind)) % (2**32)
    rng = np.random.default_rng(seed)
    layout = ("mha", "gqa", "mqa")[int(rng.integers(3))]
    dtype = dtypes[int(rng.integers(len(dtypes)))]
    window = (int(rng.integers(sk)), int(rng.integers(sk)))  # as FlashAttention draws it: each in [0, Sk)
    return Case(d, sq, sk, kind, layout, dtype, window, batch, small_heads)


def inputs(case: Case, device) -> tuple[torch.Tensor, ...]:
    """q, k, v in the case's dtype and the output gradient, from the case's seed."""
    g = torch.Generator(device="cpu").manual_seed(zlib.crc32(case.id.encode()))
    hq, hkv = case.heads
    shapes = ((case.batch, case.sq, hq, case.d), (case.batch, case.sk, hkv, case.d), (case.batch, case.sk, hkv, case.d),
              (case.batch, case.sq, hq, case.d))
    return tuple(torch.randn(s, generator=g).to(device=device, dtype=case.dtype) for s in shapes)


def grads(attn, q, k, v, dout):
    """out, lse and the gradients of ``sum(out * dout)`` through ``attn(q, k, v) -> (out, lse)``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = attn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.to(out.dtype))
    return {"out": out.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}


def references(case: Case, q, k, v, dout) -> tuple[dict, dict]:
    """The float32 reference and the same math in PyTorch at the case's precision (naive attention)."""
    mask = case.mask()
    ref = grads(lambda q, k, v: naive_attention(q, k, v, mask, return_lse=True),
                *(t.float() for t in (q, k, v)), dout.float())
    low = grads(lambda q, k, v: naive_attention(q, k, v, mask, return_lse=True), q, k, v, dout)
    return ref, low


def _max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| over the finite reference entries; inf where x is not finite there or where
    x and ref disagree on which entries are -inf (the lse of a row that attends nothing)."""
    x, ref = x.float(), ref.float()
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(x), fin) or torch.isnan(x).any():
        return math.inf
    if not fin.any():
        return 0.0
    return float((x[fin] - ref[fin]).abs().max())


def compare(ours: dict, ref: dict, low: dict) -> dict:
    """Per tensor: our error, PyTorch's low-precision error, the bound, and whether it passed."""
    result = {}
    for name in NAMES:
        r = ref[name].float()
        fin = torch.isfinite(r)
        slack = 2 * float((r[fin] + 0.3 - 0.3 - r[fin]).abs().max()) if fin.any() else 0.0
        err, err_pt = _max_err(ours[name], r), _max_err(low[name], r)
        bound = 2 * err_pt + slack if math.isfinite(err_pt) else math.inf
        result[name] = {"err": err, "err_pt": err_pt, "bound": bound, "ok": err <= bound}
    return result


def failures(result: dict) -> list[str]:
    """One line per tensor over its bound."""
    return [f"{n}: {r['err']:.3g} > {r['bound']:.3g} (PyTorch {r['err_pt']:.3g})" for n, r in result.items()
            if not r["ok"]]

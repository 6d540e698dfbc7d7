"""Correctness check of a backend before it is timed.

The check runs the backend's prepared call on the *real* problem (same mask, sequence length,
inputs and compiled function as the timing) and compares one KV-head group, the last one (so a
wrong GQA head mapping cannot hide behind head 0), with a float32 reference: the output and the
log-sum-exp (when the backend returns one), and in ``bwd`` / ``fwd_bwd`` modes dQ, dK and dV.

The reference is exact attention in float32 on the group's heads, processed in chunks of query
rows (rows are independent, so per-chunk backward passes accumulate the exact dK, dV), with the
dense mask built per chunk from the IR's row intervals: memory stays ``O(rows · S)``, never
``O(S²)``. It is computed once per problem and shared by every backend and mode.

Tolerances are relative L2 errors ``‖x − ref‖ / ‖ref‖`` (bf16 operands land near 1e-2 at worst,
MASKS/METHOD notes) and an absolute bound on the lse; NaN or Inf where the reference is finite
always fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longca_triton.adapters._common import dense_mask_rows
from longca_triton.masks import BlockSparseMask, Mask

__all__ = ["TOLERANCES", "CheckResult", "Reference", "compare", "reference_group"]

#: dtype -> (output rel-L2, gradient rel-L2, lse abs)
TOLERANCES = {
    torch.bfloat16: (2e-2, 5e-2, 3e-2),
    torch.float16: (1e-2, 3e-2, 2e-2),
    torch.float32: (5e-3, 1e-2, 5e-3),
    torch.float64: (1e-6, 1e-6, 1e-6),
}


@dataclass
class Reference:
    heads_q: list[int]
    head_kv: int
    out: torch.Tensor  # [B, S, G, D] float32
    lse: torch.Tensor  # [B, G, S] float32
    dq: torch.Tensor | None = None  # [B, S, G, D]
    dk: torch.Tensor | None = None  # [B, S, 1, D]
    dv: torch.Tensor | None = None

    def to(self, device) -> "Reference":
        mv = lambda t: t.to(device) if t is not None else None  # noqa: E731
        return Reference(self.heads_q, self.head_kv, mv(self.out), mv(self.lse), mv(self.dq), mv(self.dk), mv(self.dv))


@dataclass
class CheckResult:
    ok: bool
    errors: dict = field(default_factory=dict)
    message: str = ""

    def as_row(self) -> dict:
        return {"ok": self.ok, **self.errors}


def checked_heads(heads_q: int, heads_kv: int) -> tuple[list[int], int]:
    """The query heads of the last KV group, and that KV head."""
    g = heads_kv - 1
    group = heads_q // heads_kv
    return list(range(g * group, (g + 1) * group)), g


def _chunk_rows(batch: int, heads: int, seqlen_k: int, budget: int) -> int:
    return max(1, min(4096, budget // max(1, batch * heads * seqlen_k)))


def reference_group(mask: Mask, q, k, v, dout, scale: float, need_grads: bool, *, budget_elems: int = 1 << 27) -> Reference:
    """Exact float32 attention (and its gradients) on the last KV-head group (see module doc)."""
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    hsel, g = checked_heads(Hq, Hkv)
    G = len(hsel)
    dev = q.device
    patterns = None
    if isinstance(mask, BlockSparseMask):
        patterns = [mask.pattern_of_head(Hq)[h] for h in hsel]
    hidx = torch.as_tensor(hsel, device=dev)
    qs = q.detach().index_select(2, hidx).float()
    ks = k.detach()[:, :, g].float()
    vs = v.detach()[:, :, g].float()
    if need_grads:
        qs.requires_grad_(True)
        ks.requires_grad_(True)
        vs.requires_grad_(True)
    dos = dout.detach().index_select(2, hidx).float() if need_grads else None
    Sk = mask.seqlen_k
    R = _chunk_rows(B, G, Sk, budget_elems)
    outs, lses = [], []
    with torch.enable_grad() if need_grads else torch.no_grad():
        for r0 in range(0, S, R):
            r1 = min(S, r0 + R)
            allowed = dense_mask_rows(mask, slice(r0, r1), dev, patterns=patterns)  # [G or 1, R, Sk]
            qc = qs[:, r0:r1]  # [B, R, G, D]
            s = torch.einsum("brgd,bsd->bgrs", qc, ks) * scale
            s = s.masked_fill(~allowed[None], float("-inf"))
            m = s.detach().amax(dim=-1, keepdim=True)
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            e = torch.exp(s - m)
            denom = e.sum(dim=-1, keepdim=True)
            p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
            o = torch.einsum("bgrs,bsd->brgd", p, vs)
            lse = (m + torch.log(denom)).squeeze(-1)  # log(0) = -inf for empty rows
            if need_grads:
                torch.autograd.backward(o, dos[:, r0:r1])
            outs.append(o.detach())
            lses.append(lse.detach())
            del s, e, p, o, allowed
    ref = Reference(heads_q=hsel, head_kv=g, out=torch.cat(outs, dim=1), lse=torch.cat(lses, dim=2))
    if need_grads:
        ref.dq = qs.grad.detach()
        ref.dk = ks.grad.detach()[:, :, None]
        ref.dv = vs.grad.detach()[:, :, None]
    return ref


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x = x.float()
    if not torch.isfinite(x).all():
        return float("inf")
    den = ref.norm().item()
    num = (x - ref).norm().item()
    return num / den if den > 0 else num


def compare(ref: Reference, out, lse, grads, dtype: torch.dtype) -> CheckResult:
    """Compare a backend's outputs (full tensors) with the reference on the checked heads."""
    tol_o, tol_g, tol_l = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    ref = ref.to(out.device)
    hidx = torch.as_tensor(ref.heads_q, device=out.device)
    errs: dict = {}
    problems = []
    e = _rel(out.index_select(2, hidx), ref.out)
    errs["out_rel"] = e
    if not e <= tol_o:
        problems.append(f"out rel err {e:.2e} > {tol_o:.0e}")
    if lse is not None:
        l = lse.index_select(1, hidx).float()
        finite = torch.isfinite(ref.lse)
        if finite.any():
            le = (l[finite] - ref.lse[finite]).abs().max().item() if torch.isfinite(l[finite]).all() else float("inf")
        else:
            le = 0.0
        errs["lse_abs"] = le
        if not le <= tol_l:
            problems.append(f"lse abs err {le:.2e} > {tol_l:.0e}")
    if grads is not None and ref.dq is not None:
        dq, dk, dv = grads
        for name, x, r in (("dq", dq.index_select(2, hidx), ref.dq), ("dk", dk[:, :, ref.head_kv : ref.head_kv + 1], ref.dk),
                           ("dv", dv[:, :, ref.head_kv : ref.head_kv + 1], ref.dv)):
            if x is None:
                problems.append(f"{name} is None")
                continue
            e = _rel(x, r)
            errs[f"{name}_rel"] = e
            if not e <= tol_g:
                problems.append(f"{name} rel err {e:.2e} > {tol_g:.0e}")
    errs = {k: (float(f"{v:.3g}") if v != float("inf") else "inf") for k, v in errs.items()}
    errs["heads"] = f"q{ref.heads_q[0]}-{ref.heads_q[-1]}/kv{ref.head_kv}"
    return CheckResult(ok=not problems, errors=errs, message="; ".join(problems))

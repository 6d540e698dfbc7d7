"""``varlen-fa2``: PyTorch's ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 varlen).

The IR is lowered with ``flash_args`` (documents -> ``cu_seqlens``; window ``(left, right)`` in
FlashAttention's convention; causal = ``(-1, 0)``); the ``batch`` sequences are packed end to end
into ``[B*S, H, D]``. The adapter reads ``varlen_attn``'s real signature at run time: torch 2.10
takes ``is_causal`` and no window, torch 2.11+ takes ``window_size`` (causal is ``(-1, 0)``) and
``return_aux``; ``enable_gqa`` is used where present, else K/V are repeated to ``Hq`` heads
(torch 2.11 has no ``enable_gqa``: measured there with the repeat, outside the timer in ``fwd``
mode and inside the graph, as a small reduction in its backward, in ``bwd`` mode).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ._common import HEAD_DIMS_MULT8, FlashArgs, PlannedBackend, device_cu_seqlens, flash_args, pack_tokens, packed_cu_seqlens, try_import
from .base import Problem, Unsupported, register

__all__ = ["VarlenFA2", "varlen_call_args"]


def varlen_call_args(fa: FlashArgs, batch: int, params: set[str]) -> dict:
    """Keyword arguments for ``varlen_attn`` (minus tensors), given its parameter names.

    Returns ``cu_seqlens`` (numpy int32 over ``batch`` packed sequences), ``max_seqlen`` and the
    mask keywords. Raises ``Unsupported`` when this torch cannot express the window."""
    out: dict = {"cu_seqlens": packed_cu_seqlens(fa, batch), "max_seqlen": fa.max_seqlen if fa.varlen else fa.seqlen}
    left, right = fa.window
    if "window_size" in params:
        out["window_size"] = (left, 0 if fa.causal else right)
    else:
        if fa.has_window:
            raise Unsupported("this torch's varlen_attn has no window_size (needs torch >= 2.11)")
        out["is_causal"] = fa.causal
    return out


@dataclass
class _VarlenPlan:
    fn: object
    cu: torch.Tensor
    max_seqlen: int
    kwargs: dict
    native_gqa: bool
    group: int
    want_lse: bool
    aux: object
    takes_scale: bool


class VarlenFA2(PlannedBackend):
    name = "varlen-fa2"
    description = "torch.nn.attention.varlen.varlen_attn (FlashAttention-2 varlen inside PyTorch): documents and windows"
    lowering = "flash_args -> cu_seqlens + window_size"
    head_dims = HEAD_DIMS_MULT8

    def _module(self):
        return try_import("torch.nn.attention.varlen")

    def available(self):
        mod, why = self._module()
        if mod is None:
            return False, f"torch {torch.__version__}: {why}"
        if not hasattr(mod, "varlen_attn"):
            return False, f"torch {torch.__version__} has no varlen_attn"
        return super().available()

    def _params(self) -> set[str]:
        mod, _ = self._module()
        if mod is None:
            return {"window_size", "return_aux", "enable_gqa"}
        return set(inspect.signature(mod.varlen_attn).parameters)

    def lower(self, problem: Problem):
        if "scale" not in self._params() and not problem.scale_is_default:
            raise Unsupported("this torch's varlen_attn takes no scale (only the default 1/sqrt(D))")
        fa = flash_args(problem.mask)
        return fa, varlen_call_args(fa, problem.batch, self._params())

    def materialize(self, problem: Problem, lowered, device):
        fa, args = lowered
        mod, _ = self._module()
        params = self._params()
        kwargs = {k: v for k, v in args.items() if k not in ("cu_seqlens", "max_seqlen")}
        aux = None
        if "return_aux" in params and hasattr(mod, "AuxRequest"):
            aux = mod.AuxRequest(lse=True)
        return _VarlenPlan(
            fn=mod.varlen_attn,
            cu=device_cu_seqlens(args["cu_seqlens"], device),
            max_seqlen=int(args["max_seqlen"]),
            kwargs=kwargs,
            native_gqa="enable_gqa" in params,
            group=problem.heads_q // problem.heads_kv,
            want_lse=aux is not None,
            aux=aux,
            takes_scale="scale" in params,
        )

    def prepare(self, problem: Problem, q, k, v):
        fn = super().prepare(problem, q, k, v)
        plan = self.plan_for(problem, q.device)
        if plan.group == 1 or plan.native_gqa or problem.mode != "fwd":
            return fn
        # forward-only timing on a torch without enable_gqa: repeat K/V once, outside the timer
        k2, v2 = k.repeat_interleave(plan.group, dim=2), v.repeat_interleave(plan.group, dim=2)
        scale = problem.scale
        return lambda: self.run(plan, q, k2, v2, scale)

    def run(self, plan: _VarlenPlan, q, k, v, scale: float):
        B, S, Hq, D = q.shape[0], q.shape[1], q.shape[2], v.shape[3]  # out is [B, S, Hq, D_v]
        qp, kp, vp = pack_tokens(q, k, v)
        kw = dict(plan.kwargs)
        if kp.shape[1] != Hq:
            if plan.native_gqa:
                kw["enable_gqa"] = True
            else:
                kp = kp.repeat_interleave(plan.group, dim=1)
                vp = vp.repeat_interleave(plan.group, dim=1)
        if plan.aux is not None:
            kw["return_aux"] = plan.aux
        if plan.takes_scale:
            kw["scale"] = scale
        res = plan.fn(qp, kp, vp, plan.cu, plan.cu, plan.max_seqlen, plan.max_seqlen, **kw)
        out, lse = (res if isinstance(res, tuple) else (res, None))
        out = out.reshape(B, S, Hq, D)
        if lse is not None:
            # documented as [T, Hq]; some builds hand back FlashAttention's [Hq, T]
            lse = lse.reshape(B, S, Hq).permute(0, 2, 1) if lse.shape[0] == B * S else lse.reshape(Hq, B, S).permute(1, 0, 2)
            lse = lse.float()
        return out, lse


register(VarlenFA2())

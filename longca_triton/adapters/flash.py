"""FlashAttention packages called directly: ``fa2`` (``flash-attn`` 2.x), ``fa3`` (the official
FlashAttention-3 Hopper build, ``flash_attn_interface``), ``fa3-fwd`` (the third-party forward-only
FlashAttention-3 build ``fa3-fwd``, module ``fa3_fwd_interface``) and ``fa4`` (``flash-attn-4``,
``flash_attn.cute.interface``, CuTe DSL kernels).

All four take the same lowering, ``flash_args``: one document -> ``flash_attn_func`` on
``[B, S, H, D]``; several documents -> ``flash_attn_varlen_func`` on the batch packed into
``[B*S, H, D]`` with ``cu_seqlens``; ``causal`` and ``window_size = (left, right)`` in
FlashAttention's convention (``-1`` unbounded; FA4 spells unbounded ``None``). GQA is native.
Head dims: ``fa2`` takes one head dim for q, k and v (multiples of 8 up to 256); the Hopper builds
take 64, 96, 128, 192, 256 and the (D_qk, D_v) = (192, 128) pair of multi-head latent attention
(FlashAttention-3's README), with ``v`` passed as is. What each build cannot do is said in ``supports``: ``fa3-fwd`` is forward-only, bf16-only (its
build disables FP16) and has no local/sliding-window kernels (``FLASHATTENTION_DISABLE_LOCAL``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import torch

from longca_triton.masks import NotExpressible

from ._common import (HEAD_DIMS_MULT8, HOPPER_HEAD_DIM_PAIRS, HOPPER_HEAD_DIMS, FlashArgs, PlannedBackend, device_cu_seqlens, dist_version, flash_args,
                      lse_from_heads_tokens, pack_tokens, packed_cu_seqlens, try_import)
from .base import Problem, register

__all__ = ["FA2", "FA3", "FA3Fwd", "FA4", "fa_window"]


def fa_window(fa: FlashArgs, none_for_unbounded: bool = False) -> tuple:
    """``window_size`` argument: ``(left, right)``, right forced to 0 for causal masks."""
    left, right = fa.window
    if fa.causal:
        right = 0
    if none_for_unbounded:
        return (left if left >= 0 else None, None if fa.causal else (right if right >= 0 else None))
    return (left, right)


@dataclass
class _FlashPlan:
    fa: FlashArgs
    cu: torch.Tensor | None
    max_seqlen: int
    dense_fn: object
    varlen_fn: object
    dense_kw: dict
    varlen_kw: dict


class FlashFamily(PlannedBackend):
    """One FlashAttention build: ``module`` with ``flash_attn_func`` / ``flash_attn_varlen_func``."""

    module = ""
    dists: tuple[str, ...] = ()
    min_capability = (8, 0)
    max_capability: tuple[int, int] | None = None
    windows = True
    #: extra keyword asking for the lse, by parameter name (checked against the real signature)
    lse_flags: tuple[tuple[str, object], ...] = (("return_attn_probs", True),)
    none_for_unbounded = False
    #: constant keywords of every call
    extra_kw: dict = {}
    lowering = "flash_args -> flash_attn_(varlen_)func(causal, window_size)"

    def available(self):
        mod, why = try_import(self.module)
        if mod is None:
            pkg = " / ".join(self.dists) or self.module
            return False, f"{pkg} is not installed ({why})"
        for fn in ("flash_attn_func", "flash_attn_varlen_func"):
            if not hasattr(mod, fn):
                # seen on the H100: flash-attn-4 installs a ``flash_attn`` package (``flash_attn.cute``)
                # that has none of FA2's functions
                pkg = " / ".join(self.dists) or self.module
                return False, (f"{pkg} is not installed: the importable {self.module!r} has no {fn} "
                               f"(another distribution, e.g. flash-attn-4's flash_attn.cute, provides that name)")
        ok, why = super().available()
        if not ok:
            return False, why
        cap = torch.cuda.get_device_capability()
        if cap < self.min_capability:
            return False, f"needs compute capability >= {self.min_capability[0]}.{self.min_capability[1]}, GPU has {cap[0]}.{cap[1]}"
        if self.max_capability is not None and cap > self.max_capability:
            return False, f"built for compute capability <= {self.max_capability[0]}.{self.max_capability[1]}, GPU has {cap[0]}.{cap[1]}"
        return True, ""

    def version(self) -> str | None:
        return dist_version(*self.dists)

    def lower(self, problem: Problem) -> FlashArgs:
        fa = flash_args(problem.mask)
        if fa.has_window and not self.windows:
            raise NotExpressible(f"{self.name} was built without local (sliding-window) attention; {problem.mask.name} needs window {fa.window}")
        packed_cu_seqlens(fa, problem.batch)  # validates int32 range
        return fa

    #: FlashAttention's backward takes ``deterministic=True`` (dQ accumulated in a fixed order, at
    #: some speed); ``deterministic_plan`` checks the installed build's signature
    honours_deterministic = True

    def deterministic_plan(self, plan: _FlashPlan) -> _FlashPlan:
        missing = [fn.__name__ for fn in (plan.dense_fn, plan.varlen_fn)
                   if "deterministic" not in inspect.signature(fn).parameters]
        if missing:
            raise ValueError(f"backend {self.name!r} cannot promise deterministic=True: {self.module}."
                             f"{' / '.join(missing)} takes no 'deterministic' argument")
        return replace(plan, dense_kw={**plan.dense_kw, "deterministic": True},
                       varlen_kw={**plan.varlen_kw, "deterministic": True})

    def _flags(self, fn) -> dict:
        params = inspect.signature(fn).parameters
        return {name: value for name, value in self.lse_flags if name in params}

    def materialize(self, problem: Problem, fa: FlashArgs, device) -> _FlashPlan:
        mod, _ = try_import(self.module)
        window = fa_window(fa, self.none_for_unbounded)
        common = {"causal": fa.causal, "window_size": window, **self.extra_kw}
        cu = device_cu_seqlens(packed_cu_seqlens(fa, problem.batch) if fa.varlen else None, device)
        return _FlashPlan(
            fa=fa, cu=cu, max_seqlen=fa.max_seqlen,
            dense_fn=mod.flash_attn_func, varlen_fn=mod.flash_attn_varlen_func,
            dense_kw={**common, **self._flags(mod.flash_attn_func)},
            varlen_kw={**common, **self._flags(mod.flash_attn_varlen_func)},
        )

    @staticmethod
    def _split(res):
        if isinstance(res, tuple):
            return res[0], (res[1] if len(res) > 1 else None)
        return res, None

    def run(self, plan: _FlashPlan, q, k, v, scale: float):
        B, S, Hq, D = q.shape[0], q.shape[1], q.shape[2], v.shape[3]  # out is [B, S, Hq, D_v]
        if plan.cu is None:
            out, lse = self._split(plan.dense_fn(q, k, v, softmax_scale=scale, **plan.dense_kw))
            return out, (lse.float() if lse is not None else None)  # [B, H, S]
        qp, kp, vp = pack_tokens(q, k, v)
        res = self._varlen(plan, qp, kp, vp, scale)
        out, lse = self._split(res)
        lse = lse_from_heads_tokens(lse, B, S).float() if lse is not None else None  # [H, T] -> [B, H, S]
        return out.reshape(B, S, Hq, D), lse

    def _varlen(self, plan, qp, kp, vp, scale):
        return plan.varlen_fn(qp, kp, vp, plan.cu, plan.cu, plan.max_seqlen, plan.max_seqlen, softmax_scale=scale, **plan.varlen_kw)


class FA2(FlashFamily):
    name = "fa2"
    description = "FlashAttention-2 (flash-attn 2.x package): documents via varlen, causal, sliding window"
    module = "flash_attn"
    dists = ("flash-attn", "flash_attn")
    head_dims = HEAD_DIMS_MULT8
    extra_kw = {"dropout_p": 0.0}


class _HopperBuild(FlashFamily):
    """FlashAttention-3 and -4 builds: compute capability 9.0 and up, Hopper head dims and the
    (192, 128) pair."""

    min_capability = (9, 0)
    head_dims = HOPPER_HEAD_DIMS
    head_dim_pairs = HOPPER_HEAD_DIM_PAIRS


class FA3(_HopperBuild):
    name = "fa3"
    description = "FlashAttention-3, official Hopper build (flash_attn_interface): fwd+bwd"
    module = "flash_attn_interface"
    dists = ("flash-attn-3", "flash_attn_3", "flashattn-hopper")
    max_capability = (9, 0)


class FA3Fwd(FA3):
    """Same Hopper kernels and limits as ``fa3``, a different (forward-only) build."""


    name = "fa3-fwd"
    description = "FlashAttention-3 forward-only third-party build (fa3-fwd package, fa3_fwd_interface): no backward, no window, no fp16"
    module = "fa3_fwd_interface"
    dists = ("fa3-fwd", "fa3_fwd")
    modes = ("fwd",)
    windows = False
    dtypes = (torch.bfloat16,)
    lowering = "flash_args -> flash_attn_(varlen_)func(causal); windows refused"


class FA4(_HopperBuild):
    name = "fa4"
    description = "FlashAttention-4 (flash-attn-4, CuTe DSL, flash_attn.cute.interface): fwd+bwd"
    module = "flash_attn.cute.interface"
    dists = ("flash-attn-4", "flash_attn_4", "fa4")
    lse_flags = (("return_lse", True),)
    none_for_unbounded = True
    lowering = "flash_args -> flash_attn_(varlen_)func(causal, window_size with None)"

    def _varlen(self, plan, qp, kp, vp, scale):
        return plan.varlen_fn(qp, kp, vp, cu_seqlens_q=plan.cu, cu_seqlens_k=plan.cu, max_seqlen_q=plan.max_seqlen,
                              max_seqlen_k=plan.max_seqlen, softmax_scale=scale, **plan.varlen_kw)


for _cls in (FA2, FA3, FA3Fwd, FA4):
    register(_cls())


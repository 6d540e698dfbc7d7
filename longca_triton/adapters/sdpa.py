"""PyTorch ``scaled_dot_product_attention``, one adapter per SDPA backend.

``sdpa-math``, ``sdpa-flash`` (FlashAttention-2 inside PyTorch), ``sdpa-efficient`` (xFormers'
memory-efficient kernel) and ``sdpa-cudnn`` (cuDNN), each forced with
``torch.nn.attention.sdpa_kernel`` so a row never silently measures another kernel.

Lowering (shared IR -> SDPA arguments), never per mask name:

* one document, no window, causal  -> ``is_causal=True`` (every backend);
* one document, no window, full    -> no mask (every backend);
* anything else                     -> a dense boolean ``attn_mask`` built on the device from the IR,
  only for the backends that take one (math, efficient, cuDNN: PyTorch's ``sdp_utils`` checks
  ``check_attn_mask_shape`` there, while the flash backend rejects any mask with
  ``check_for_attn_mask``); ``sdpa-flash`` reports those cases unsupported.

Head dims: multiples of 8 up to 256 for flash and cuDNN; ``v`` may have its own head dim everywhere
but in ``sdpa-flash`` (PyTorch's FlashAttention-2 needs one head dim; its cuDNN path takes two since
torch 2.5, pytorch/pytorch#128350; where a build has no kernel for a case, the harness reports
SDPA's "No available kernel" as unsupported).

GQA: ``enable_gqa=True`` where the selected backend accepts it (probed once per backend, dtype and
head dim on a tiny problem); otherwise K/V are repeated to ``Hq`` heads (outside the timer in
``fwd`` mode; in ``bwd``/``fwd_bwd`` the repeat's backward, a small reduction, is inside). SDPA
does not return the log-sum-exp, so these backends have ``returns_lse = False``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longca_triton.masks import NotExpressible

from ._common import HEAD_DIMS_MULT8, PlannedBackend, dense_mask, flash_args
from .base import Problem, register

__all__ = ["SDPABackend", "sdpa_lowering"]


def sdpa_lowering(mask, takes_attn_mask: bool, label: str) -> str:
    """``"full"``, ``"causal"`` or ``"dense"`` (needs an ``attn_mask``); raises ``NotExpressible``."""
    try:
        fa = flash_args(mask)
    except NotExpressible as e:
        if takes_attn_mask:
            return "dense"
        raise NotExpressible(f"{label} takes no attn_mask and {mask.name} is not plain full or causal attention ({e})") from None
    if fa.num_docs == 1 and not fa.has_window:
        return "causal" if fa.causal else "full"
    if takes_attn_mask:
        return "dense"
    raise NotExpressible(f"{label} takes no attn_mask and {mask.name} is {fa.kind} attention, not plain full or causal")


@dataclass
class _SDPAPlan:
    form: str  # full | causal | dense
    attn_mask: torch.Tensor | None
    gqa: str  # "native" | "repeat" | "none"
    group: int
    backend: object


_GQA_PROBES: dict[tuple, bool] = {}


class SDPABackend(PlannedBackend):
    returns_lse = False
    #: name of the ``torch.nn.attention.SDPBackend`` member
    sdp_backend: str = ""
    #: whether the SDPA backend takes a dense ``attn_mask`` (all but flash)
    takes_attn_mask: bool = True

    @property
    def lowering(self) -> str:
        return "is_causal / none / dense bool attn_mask" if self.takes_attn_mask else "is_causal / none; no attn_mask"

    def available(self):
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except ImportError as e:
            return False, f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel ({e})"
        if not hasattr(SDPBackend, self.sdp_backend):
            return False, f"torch {torch.__version__} has no SDPBackend.{self.sdp_backend}"
        if self.sdp_backend == "CUDNN_ATTENTION" and not torch.backends.cudnn.is_available():
            return False, "PyTorch was built without cuDNN"
        return super().available()

    def _backend_enum(self):
        from torch.nn.attention import SDPBackend

        return getattr(SDPBackend, self.sdp_backend)

    def lower(self, problem: Problem) -> str:
        return sdpa_lowering(problem.mask, self.takes_attn_mask, f"SDPA's {self.sdp_backend.lower()} backend")

    def _native_gqa(self, problem: Problem, device, form: str) -> bool:
        """Probe once whether this SDPA backend runs ``enable_gqa=True`` for these dtype / head dim."""
        key = (self.name, str(device), problem.dtype, problem.head_dim, problem.d_v, form)
        if key not in _GQA_PROBES:
            from torch.nn.attention import sdpa_kernel

            S, hkv, g = 128, 2, 2
            q = torch.randn(1, hkv * g, S, problem.head_dim, device=device, dtype=problem.dtype)
            k = torch.randn(1, hkv, S, problem.head_dim, device=device, dtype=problem.dtype)
            v = torch.randn(1, hkv, S, problem.d_v, device=device, dtype=problem.dtype)
            m = torch.ones(S, S, dtype=torch.bool, device=device).tril() if form == "dense" else None
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with sdpa_kernel(self._backend_enum()):
                        F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=form == "causal", enable_gqa=True)
                _GQA_PROBES[key] = True
            except (RuntimeError, TypeError):
                _GQA_PROBES[key] = False
        return _GQA_PROBES[key]

    def materialize(self, problem: Problem, form: str, device) -> _SDPAPlan:
        mask = problem.mask
        attn_mask = None
        if form == "dense":
            per_head = problem.is_block_sparse and mask.num_patterns > 1
            m = dense_mask(mask, device, problem.heads_q if per_head else None)  # [Hq or 1, S, S]
            attn_mask = m[None]  # [1, Hq or 1, S, S]
        group = problem.heads_q // problem.heads_kv
        gqa = "none" if group == 1 else ("native" if self._native_gqa(problem, device, form) else "repeat")
        return _SDPAPlan(form=form, attn_mask=attn_mask, gqa=gqa, group=group, backend=self._backend_enum())

    def run(self, plan: _SDPAPlan, q, k, v, scale: float, repeated: bool = False):
        from torch.nn.attention import sdpa_kernel

        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if plan.gqa == "repeat" and not repeated:
            kt = kt.repeat_interleave(plan.group, dim=1)
            vt = vt.repeat_interleave(plan.group, dim=1)
        extra = {"enable_gqa": True} if plan.gqa == "native" else {}
        with sdpa_kernel(plan.backend):
            out = F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=plan.attn_mask, is_causal=plan.form == "causal", scale=scale, **extra
            )
        return out.transpose(1, 2), None

    def prepare(self, problem: Problem, q, k, v):
        fn = super().prepare(problem, q, k, v)
        plan = self.plan_for(problem, q.device)
        if plan.gqa != "repeat" or problem.mode != "fwd":
            return fn
        # forward-only timing: repeat K/V once here, outside the timed call
        k2, v2 = k.repeat_interleave(plan.group, dim=2), v.repeat_interleave(plan.group, dim=2)
        scale = problem.scale
        return lambda: self.run(plan, q, k2, v2, scale, repeated=True)


class SDPAMath(SDPABackend):
    name = "sdpa-math"
    description = "PyTorch SDPA, math backend (materialises the scores; any mask through a dense attn_mask)"
    sdp_backend = "MATH"
    needs_cuda = False
    dtypes = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    head_dim_pairs = None


class SDPAFlash(SDPABackend):
    name = "sdpa-flash"
    description = "PyTorch SDPA, flash backend (FlashAttention-2 inside PyTorch): full and causal only"
    sdp_backend = "FLASH_ATTENTION"
    takes_attn_mask = False
    head_dims = HEAD_DIMS_MULT8


class SDPAEfficient(SDPABackend):
    name = "sdpa-efficient"
    description = "PyTorch SDPA, memory-efficient backend (xFormers kernel); any mask through a dense attn_mask"
    sdp_backend = "EFFICIENT_ATTENTION"
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    head_dim_pairs = None


class SDPACudnn(SDPABackend):
    name = "sdpa-cudnn"
    description = "PyTorch SDPA, cuDNN backend; any mask through a dense attn_mask"
    sdp_backend = "CUDNN_ATTENTION"
    head_dims = HEAD_DIMS_MULT8
    head_dim_pairs = None


for _cls in (SDPAMath, SDPAFlash, SDPAEfficient, SDPACudnn):
    register(_cls())

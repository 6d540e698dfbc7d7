"""FlexAttention: ``flex`` (its Triton backend) and ``flex-fa4`` (its FLASH backend, FlashAttention-4
CuTe kernels through ``kernel_options={"BACKEND": "FLASH"}``).

Lowering: ``flex_block_mask`` builds the ``BlockMask`` straight from the IR's block tables (full
tiles skip the ``mask_mod``, partial tiles evaluate it), for range and block-sparse masks alike;
block-sparse masks with ``P > 1`` patterns get one mask head per query head.

Compilation: on CUDA every (backend, grad mode) pair has its *own* compiled function, i.e. its own
code object and dynamo cache, so forward-only runs (grad off) and training runs (grad on) never
evict each other's graphs, and ``torch._dynamo.config.recompile_limit`` is raised so a sweep over
many masks and sequence lengths does not fall back to the eager path (which materialises the
scores: docs/anchors.md saw it ask for 256 GiB at 32K). On the CPU flex runs eagerly (for tests).
The log-sum-exp comes from ``return_aux=AuxRequest(lse=True)`` (or ``return_lse=True`` on older torch).
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import types
from dataclasses import dataclass

import torch

from longca_triton.masks import BlockSparseMask, flex_block_mask

from ._common import PlannedBackend, try_import
from .base import Problem, Unsupported, register

__all__ = ["Flex", "FlexFA4", "raise_recompile_limits"]

BLOCK_SIZE = 128


def raise_recompile_limits(limit: int = 512) -> None:
    """Let dynamo keep one graph per (mask structure, shape, grad mode) of a whole sweep."""
    cfg = torch._dynamo.config
    for name, value in (("recompile_limit", limit), ("cache_size_limit", limit),
                        ("accumulated_recompile_limit", 16 * limit), ("accumulated_cache_size_limit", 16 * limit)):
        if hasattr(cfg, name):
            try:
                if getattr(cfg, name) < value:
                    setattr(cfg, name, value)
            except Exception:  # aliases may refuse assignment on some versions
                pass


try:  # part of torch (no vendor package); absent only on very old torch
    from torch.nn.attention.flex_attention import flex_attention as _flex_attention
except ImportError:  # pragma: no cover
    _flex_attention = None


def _lse_kwargs() -> dict:
    if _flex_attention is None:  # pragma: no cover
        return {}
    mod = sys.modules[_flex_attention.__module__]
    params = inspect.signature(_flex_attention).parameters
    if "return_aux" in params and hasattr(mod, "AuxRequest"):
        return {"return_aux": mod.AuxRequest(lse=True)}
    return {"return_lse": True}


_LSE_KW = _lse_kwargs()


# One compiled function per (backend, grad mode), each with its *own* code object, hence its own
# dynamo cache: forward-only and training graphs never evict each other. The functions are clones
# of ``flex_attention`` itself (a code object copied under a new name): dynamo skips every file
# whose path matches ``triton/backends`` (a rule meant for Triton's own package, which also matches
# this file, ``longca_triton/adapters/flex.py``), so wrappers defined here would not be traced.
_KERNEL_OPTIONS = {"triton": None, "flash": {"BACKEND": "FLASH"}}
_COMPILED: dict[tuple[str, bool], object] = {}


def _clone(fn, name: str):
    code = fn.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=name)
    new = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__doc__ = fn.__doc__
    return new


def flex_function(variant: str, grad: bool, device_type: str):
    """The flex callable for ``variant`` ("triton" | "flash") and grad mode: compiled once on CUDA,
    eager elsewhere (FlexAttention's eager path materialises the scores: tests only)."""
    if device_type != "cuda":
        return _flex_attention
    key = (variant, grad)
    if key not in _COMPILED:
        raise_recompile_limits()
        _COMPILED[key] = torch.compile(_clone(_flex_attention, f"flex_attention_{variant}_{'train' if grad else 'fwd'}"),
                                       dynamic=False, fullgraph=True)
    return _COMPILED[key]


@dataclass
class _FlexPlan:
    block_mask: object
    fn: object
    grad: bool
    enable_gqa: bool
    head_dim: int
    kernel_options: dict | None


class Flex(PlannedBackend):
    name = "flex"
    description = "FlexAttention, Triton backend (torch.compile'd once per grad mode), BlockMask from the IR's block tables"
    lowering = "flex_block_mask (full/partial tiles + interval mask_mod)"
    variant = "triton"
    needs_cuda = False  # eager on the CPU, compiled on CUDA
    #: flex_attention takes a value head dim of its own (its FLASH lowering sizes out by v too)
    head_dim_pairs = None
    dtypes = (torch.bfloat16, torch.float16, torch.float32)

    def available(self):
        mod, why = try_import("torch.nn.attention.flex_attention")
        if mod is None:
            return False, f"torch {torch.__version__}: {why}"
        return True, ""

    def static_checks(self, problem: Problem) -> str:
        if problem.device != "cuda" and problem.mode != "fwd":
            return "FlexAttention has no backward pass on the CPU (eager); bwd runs on CUDA"
        for which, d in (("head_dim", problem.head_dim), ("head_dim of v", problem.d_v)):
            if problem.device == "cuda" and d not in (16, 32, 64, 128, 256) and d % 16:
                return f"{which} {d} is not a multiple of 16"
        return ""

    def lower(self, problem: Problem):
        mask = problem.mask
        per_head = isinstance(mask, BlockSparseMask) and mask.num_patterns > 1
        if per_head and problem.heads_q % mask.num_patterns:
            raise Unsupported(f"{mask.num_patterns} mask patterns do not divide {problem.heads_q} query heads")
        return {"block_size": BLOCK_SIZE, "num_heads": problem.heads_q if per_head else None}

    def materialize(self, problem: Problem, args, device):
        bm = flex_block_mask(problem.mask, block_size=args["block_size"], device=device, num_heads=args["num_heads"])
        grad = problem.mode != "fwd"
        return _FlexPlan(
            block_mask=bm,
            fn=flex_function(self.variant, grad, torch.device(device).type),
            grad=grad,
            enable_gqa=problem.heads_q != problem.heads_kv,
            head_dim=problem.head_dim,
            kernel_options=_KERNEL_OPTIONS[self.variant],
        )

    def run(self, plan: _FlexPlan, q, k, v, scale: float):
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        s = None if math.isclose(scale, 1.0 / math.sqrt(plan.head_dim), rel_tol=1e-12) else scale
        # why no lse when training on FLASH: its backward cannot differentiate through the lse
        # ("FLASH backend backward does not support differentiating through logsumexp (dLSE)")
        want_lse = not (plan.grad and self.variant == "flash")
        kw = dict(block_mask=plan.block_mask, scale=s, enable_gqa=plan.enable_gqa, **(_LSE_KW if want_lse else {}))
        if plan.kernel_options is not None:
            kw["kernel_options"] = plan.kernel_options
        if plan.grad:
            res = plan.fn(qt, kt, vt, **kw)
        else:
            with torch.no_grad():
                res = plan.fn(qt, kt, vt, **kw)
        if not want_lse:
            return res.transpose(1, 2), None
        out, aux = res
        lse = getattr(aux, "lse", aux)
        if lse is not None and self.variant == "flash":
            lse = lse * _flash_lse_correction()
        return out.transpose(1, 2), (lse.float() if lse is not None else None)


class FlexFA4(Flex):
    name = "flex-fa4"
    description = "FlexAttention, FLASH backend (FlashAttention-4 CuTe kernels generated from the mask_mod)"
    lowering = "flex_block_mask, kernel_options BACKEND=FLASH"
    variant = "flash"
    needs_cuda = True
    dtypes = (torch.bfloat16, torch.float16)

    def available(self):
        ok, why = super().available()
        if not ok:
            return ok, why
        mod = try_import("torch.nn.attention.flex_attention")[0]
        backends = getattr(mod, "_Backend", None)
        if backends is None or "FLASH" not in str(backends):
            return False, f"torch {torch.__version__}'s flex_attention has no BACKEND='FLASH' kernel option"
        if not torch.cuda.is_available():
            return False, "needs a CUDA GPU (none visible)"
        if torch.cuda.get_device_capability()[0] < 9:
            return False, "the FLASH backend (FlashAttention-4) needs Hopper or newer"
        cute, why = try_import("flash_attn.cute")
        if cute is None:
            return False, f"FlashAttention-4 (flash-attn-4) is not installed: {why}"
        return True, ""


@functools.lru_cache(maxsize=None)
def _flash_lse_correction() -> float:
    """Factor that turns the FLASH backend's returned lse into the natural log.

    The FLASH (FlashAttention-4) kernel already returns a natural-log lse, but torch releases whose
    ``flex_attention`` front end scales every backend's lse by ``ln 2`` (it assumes the Triton
    kernel's log2 statistics; newer releases skip FLASH via ``stats_are_log2``) hand back
    ``ln 2 × lse``. Measured on torch 2.11: lse off by 0.31 × lse. The harness's correctness check
    verifies the corrected value on every run. Cached: it reads torch's source once, never per call."""
    mod = try_import("torch.nn.attention.flex_attention")[0]
    try:
        src = inspect.getsource(mod.flex_attention)
    except (OSError, TypeError):
        return 1.0
    return 1.0 if ("stats_are_log2" in src and '"FLASH"' in src) else 1.0 / math.log(2.0)


register(Flex())
register(FlexFA4())

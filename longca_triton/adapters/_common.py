"""Shared pieces of the vendor adapters.

* import probing with honest reasons (``try_import``, ``dist_version``);
* the FlashAttention-style lowering every "documents + window" kernel shares
  (``flash_args``: one sequence or packed documents, causal flag, window ``(left, right)``);
* dense boolean masks built on the device from the IR's row intervals (``dense_mask``), never
  through an ``S × S`` CPU tensor;
* ``PlannedBackend``: a backend written as ``lower`` (pure, device-free: decides support) →
  ``materialize`` (device tensors, once, outside any timer) → ``run`` (the timed vendor call).
  ``prepare`` and the differentiable ``attention`` both come from these three.

Nothing here imports a vendor package at module import time.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from longca_triton.masks import BlockSparseMask, Mask, NotExpressible, RangeMask, varlen_form

from .base import Backend, Problem, Unsupported

__all__ = [
    "FlashArgs",
    "FlashLowered",
    "PlannedBackend",
    "dense_mask",
    "dist_version",
    "flash_args",
    "gqa_group",
    "lse_from_heads_tokens",
    "packed_cu_seqlens",
    "pack_tokens",
    "device_cu_seqlens",
    "try_import",
    "VendorPlan",
    "vendor_plan",
    "HEAD_DIMS_MULT8",
    "HOPPER_HEAD_DIMS",
    "HOPPER_HEAD_DIM_PAIRS",
]

#: head dims of FlashAttention-2-family kernels (also cuDNN's SDPA): multiples of 8 up to 256
HEAD_DIMS_MULT8 = tuple(range(8, 257, 8))
#: head dims of the Hopper FlashAttention-3 / FlashAttention-4 builds (FlashAttention-3's README:
#: 64, 96, 128, 192, 256 forward and backward)
HOPPER_HEAD_DIMS = (64, 96, 128, 192, 256)
#: ``(D_qk, D_v)`` pairs with ``D_v != D_qk`` of the Hopper builds: DeepSeek's multi-head latent
#: attention shape, (192, 128) (FlashAttention-3's README; cuDNN runs it too)
HOPPER_HEAD_DIM_PAIRS = ((192, 128),)

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

# ---------------------------------------------------------------------------- imports
_IMPORTS: dict[str, tuple[Any, str]] = {}


def try_import(module: str) -> tuple[Any, str]:
    """``(module, "")`` or ``(None, reason)``; the outcome is cached (imports can be slow)."""
    if module not in _IMPORTS:
        try:
            _IMPORTS[module] = (importlib.import_module(module), "")
        except Exception as e:  # ImportError, but also OSError / RuntimeError from native libs
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            _IMPORTS[module] = (None, f"cannot import {module} ({type(e).__name__}: {first[:200]})")
    return _IMPORTS[module]


def dist_version(*names: str) -> str | None:
    """Version of the first installed distribution among ``names`` (``importlib.metadata``)."""
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
    return None


def cuda_reason() -> str:
    """Empty when a CUDA device is usable, else why not."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none visible)"
    return ""


def gqa_group(problem: Problem) -> int:
    return problem.heads_q // problem.heads_kv


# ---------------------------------------------------------------------------- FlashAttention-style lowering
@dataclass(frozen=True)
class FlashArgs:
    """The arguments FlashAttention-style kernels take for one mask over one sequence of ``seqlen``.

    ``cu_seqlens`` is ``None`` when the sequence is one document (a plain dense call), else the int32
    document offsets ``[0, ..., seqlen]`` of one sequence (``packed_cu_seqlens`` repeats them per batch).
    ``window = (left, right)`` in FlashAttention's convention: row ``i`` sees keys
    ``[i - left, i + right]`` of its document, ``-1`` = unbounded; ``causal`` means ``right == 0``.
    """

    seqlen: int
    cu_seqlens: np.ndarray | None
    max_seqlen: int
    causal: bool
    window: tuple[int, int]

    @property
    def num_docs(self) -> int:
        return 1 if self.cu_seqlens is None else len(self.cu_seqlens) - 1

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def has_window(self) -> bool:
        """A left bound, or a right bound other than the causal one."""
        left, right = self.window
        return left >= 0 or (right >= 0 and not self.causal)

    @property
    def kind(self) -> str:
        """``full`` / ``causal`` / ``window``, prefixed ``varlen-`` for several documents."""
        base = "window" if self.has_window else ("causal" if self.causal else "full")
        return ("varlen-" if self.varlen else "") + base


def flash_args(mask: Mask) -> FlashArgs:
    """Lower the IR to FlashAttention's (documents, causal, window) form, via ``varlen_form``.

    Raises ``NotExpressible`` (with the IR's own reason) for masks that are not documents with a
    window, e.g. ``share_question`` or any block-sparse mask."""
    vf = varlen_form(mask)
    left, right = (int(x) for x in vf.window)
    causal = bool(vf.causal)
    if causal:
        right = 0
    cu = None if vf.num_docs == 1 else np.asarray(vf.cu_seqlens, dtype=np.int32)
    return FlashArgs(seqlen=mask.seqlen_q, cu_seqlens=cu, max_seqlen=int(vf.max_seqlen), causal=causal, window=(left, right))


def packed_cu_seqlens(fa: FlashArgs, batch: int) -> np.ndarray:
    """Document offsets over ``batch`` sequences packed end to end (``batch * seqlen`` tokens)."""
    one = fa.cu_seqlens if fa.cu_seqlens is not None else np.asarray([0, fa.seqlen], dtype=np.int64)
    one = np.asarray(one, dtype=np.int64)
    parts = [np.zeros(1, dtype=np.int64)] + [b * fa.seqlen + one[1:] for b in range(batch)]
    out = np.concatenate(parts)
    if out[-1] >= 2**31:
        raise NotExpressible(f"{out[-1]} packed tokens overflow int32 cu_seqlens")
    return out.astype(np.int32)


def device_cu_seqlens(cu, device) -> torch.Tensor | None:
    """int32 document offsets on ``device`` (``None`` stays ``None``: one document, no varlen call)."""
    return None if cu is None else torch.as_tensor(cu, dtype=torch.int32, device=device)


@dataclass
class VendorPlan:
    """A vendor call prepared outside the timer: the callable (a function or a module), its keywords,
    the document offsets on the device (None: one document) and the longest document."""

    call: Any
    kwargs: dict
    cu: torch.Tensor | None
    max_seqlen: int


def vendor_plan(call, kwargs: dict, args: dict, device) -> VendorPlan:
    """``VendorPlan`` from a lowering's ``args`` (``cu_seqlens`` as numpy and ``max_seqlen`` where varlen)."""
    return VendorPlan(call=call, kwargs=kwargs, cu=device_cu_seqlens(args.get("cu_seqlens"), device),
                      max_seqlen=int(args.get("max_seqlen", 0)))


def pack_tokens(q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, S, H, D]`` -> ``[B*S, H, D]`` views of q, k, v: the batch packed end to end (varlen layout)."""
    return tuple(t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3]) for t in (q, k, v))


def lse_from_heads_tokens(lse: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """FlashAttention's packed lse ``[H, B*S]`` -> ``[B, H, S]``."""
    H = lse.shape[0]
    return lse.reshape(H, batch, seqlen).permute(1, 0, 2)


# ---------------------------------------------------------------------------- dense masks on the device
def dense_mask(mask: Mask, device, num_heads_q: int | None = None) -> torch.Tensor:
    """bool ``[P or 1, Sq, Sk]`` built on ``device`` from the IR (row intervals or the block map).

    For a block-sparse mask with ``num_heads_q`` the result is ``[Hq, Sq, Sk]`` (one slice per query
    head, heads grouped ``Hq / P`` per pattern). Cost: ``O(Sq · Sk · K)`` device work, no host ``S²``.
    """
    if isinstance(mask, RangeMask):
        lo_np, hi_np = mask.row_intervals()
        lo = torch.as_tensor(lo_np, device=device)
        hi = torch.as_tensor(hi_np, device=device)
        j = torch.arange(mask.seqlen_k, device=device, dtype=lo.dtype)[None, :]
        out = torch.zeros(mask.seqlen_q, mask.seqlen_k, dtype=torch.bool, device=device)
        for t in range(lo.shape[1]):
            out |= (j >= lo[:, t : t + 1]) & (j < hi[:, t : t + 1])
        return out[None]
    assert isinstance(mask, BlockSparseMask)
    qb = torch.as_tensor(np.diff(mask.q_block_bounds), device=device)
    kb = torch.as_tensor(np.diff(mask.k_block_bounds), device=device)
    bm = mask.block_map.to(device)
    if num_heads_q is not None:
        bm = bm[torch.as_tensor(mask.pattern_of_head(num_heads_q), device=device)]
    return bm.repeat_interleave(qb, dim=1).repeat_interleave(kb, dim=2)


def dense_mask_rows(mask: Mask, rows: slice, device, patterns: list[int] | None = None) -> torch.Tensor:
    """bool ``[len(patterns) or P or 1, len(rows), Sk]``: the dense mask on a range of query rows.

    ``patterns`` (block-sparse only) picks block-map patterns, e.g. one per selected query head."""
    r0, r1 = rows.start or 0, rows.stop if rows.stop is not None else mask.seqlen_q
    if isinstance(mask, RangeMask):
        lo_np, hi_np = mask.row_intervals()
        lo = torch.as_tensor(lo_np[r0:r1], device=device)
        hi = torch.as_tensor(hi_np[r0:r1], device=device)
        j = torch.arange(mask.seqlen_k, device=device, dtype=lo.dtype)[None, :]
        out = torch.zeros(r1 - r0, mask.seqlen_k, dtype=torch.bool, device=device)
        for t in range(lo.shape[1]):
            out |= (j >= lo[:, t : t + 1]) & (j < hi[:, t : t + 1])
        return out[None]
    assert isinstance(mask, BlockSparseMask)
    q_blk = np.repeat(np.arange(len(mask.q_block_bounds) - 1), np.diff(mask.q_block_bounds))[r0:r1]
    k_blk = np.repeat(np.arange(len(mask.k_block_bounds) - 1), np.diff(mask.k_block_bounds))
    bm = mask.block_map if patterns is None else mask.block_map[torch.as_tensor(patterns)]
    out = bm[:, torch.as_tensor(q_blk)][:, :, torch.as_tensor(k_blk)]
    return out.to(device)


# ---------------------------------------------------------------------------- planned backends
class PlannedBackend(Backend):
    """A backend in three steps.

    * ``lower(problem) -> args``: pure and device-free; raises ``NotExpressible`` / ``Unsupported``
      with the reason the case cannot run. ``supports`` is exactly "static checks + lower succeeds".
    * ``materialize(problem, args, device) -> plan``: device tensors and vendor objects, built once
      per (mask, shapes) and cached on the mask, outside any timed region.
    * ``run(plan, q, k, v, scale) -> (out [B, S, Hq, D_v], lse [B, Hq, S] float32 or None)``: only the
      vendor call (and free views); this is what the harness times.
    """

    #: dtypes the vendor kernel takes
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
    #: head dims the vendor kernel takes, for q/k and for v (None = any)
    head_dims: tuple[int, ...] | None = None
    #: ``(D_qk, D_v)`` pairs with ``D_v != D_qk`` it takes: ``()`` none (one head dim for q, k and
    #: v), None any (each dim in ``head_dims``)
    head_dim_pairs: tuple[tuple[int, int], ...] | None = ()
    #: needs ``Hq == Hkv``? (False: GQA handled by the kernel or by the adapter)
    needs_cuda: bool = True
    #: short description of how the adapter lowers the IR (shown by ``doctor``)
    lowering: str = ""
    #: the module ``available`` imports (empty: none), and how to name it when it is missing
    requires: str = ""
    requires_label: str = ""

    def available(self) -> tuple[bool, str]:
        """The vendor module imports (``requires``) and, with ``needs_cuda``, a GPU is visible."""
        if self.requires:
            mod, why = try_import(self.requires)
            if mod is None:
                return False, (f"{self.requires_label} is not installed ({why})" if self.requires_label else why)
        if self.needs_cuda:
            why = cuda_reason()
            if why:
                return False, why
        return True, ""

    # -- to override
    def static_checks(self, problem: Problem) -> str:
        """Extra device-free checks; return a reason string, empty when fine."""
        return ""

    def lower(self, problem: Problem) -> Any:
        return None

    def materialize(self, problem: Problem, args: Any, device) -> Any:
        return args

    def run(self, plan: Any, q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def deterministic_plan(self, plan: Any) -> Any:
        """``plan`` asking the vendor kernel for deterministic gradients (only called where
        ``honours_deterministic``); raise ``ValueError`` if this build cannot."""
        raise ValueError(f"backend {self.name!r} cannot promise deterministic=True")

    # -- shared
    def supports(self, problem: Problem) -> tuple[bool, str]:
        if self.needs_cuda and problem.device != "cuda":
            return False, f"{self.name} runs on CUDA only (problem device: {problem.device})"
        if problem.dtype not in self.dtypes:
            names = ", ".join(DTYPE_NAMES.get(d, str(d)) for d in self.dtypes)
            return False, f"dtype {DTYPE_NAMES.get(problem.dtype, problem.dtype)} not supported (takes {names})"
        why = self.head_dim_reason(problem)
        if why:
            return False, why
        if problem.heads_q % problem.heads_kv:
            return False, f"heads_q {problem.heads_q} is not a multiple of heads_kv {problem.heads_kv}"
        why = self.static_checks(problem)
        if why:
            return False, why
        try:
            self._lowered(problem)
        except (NotExpressible, Unsupported) as e:
            return False, str(e)
        return True, ""

    def head_dim_reason(self, problem: Problem) -> str:
        """Why the vendor kernel cannot take these head dims (``head_dims``, ``head_dim_pairs``)."""
        dims = ", ".join(map(str, self.head_dims)) if self.head_dims is not None else ""
        for which, d in (("head_dim", problem.head_dim), ("head_dim of v", problem.d_v)):
            if self.head_dims is not None and d not in self.head_dims:
                return f"{which} {d} not supported (takes {dims})"
        if problem.split_head_dims and self.head_dim_pairs is not None \
                and (problem.head_dim, problem.d_v) not in self.head_dim_pairs:
            if not self.head_dim_pairs:
                return (f"D_v {problem.d_v} != D_qk {problem.head_dim} not supported ({self.name} takes one head dim "
                        f"for q, k and v)")
            pairs = ", ".join(f"{a}/{b}" for a, b in self.head_dim_pairs)
            return f"head dims {problem.head_dim_label} (D_qk/D_v) not supported (takes D_v == D_qk, or {pairs})"
        return ""

    def _lowered(self, problem: Problem):
        cache = problem.mask.__dict__.setdefault("_adapter_cache", {})
        key = (self.name, "lower", problem.batch, problem.heads_q, problem.heads_kv, problem.head_dim, problem.d_v,
               problem.dtype, problem.mode)
        if key not in cache:
            try:
                cache[key] = self.lower(problem)
            except (NotExpressible, Unsupported) as e:
                cache[key] = e
        if isinstance(cache[key], Exception):
            raise cache[key]
        return cache[key]

    def plan_for(self, problem: Problem, device) -> Any:
        cache = problem.mask.__dict__.setdefault("_adapter_cache", {})
        key = (self.name, "plan", str(device), problem.batch, problem.heads_q, problem.heads_kv, problem.head_dim, problem.d_v,
               problem.dtype, problem.mode)
        if key not in cache:
            cache[key] = self.materialize(problem, self._lowered(problem), device)
        return cache[key]

    def prepare(self, problem: Problem, q, k, v) -> Callable[[], tuple]:
        self.require(problem)
        plan = self.plan_for(problem, q.device)
        scale = problem.scale

        def fn():
            return self.run(plan, q, k, v, scale)

        return fn

    def attention(self, q, k, v, mask: Mask, softmax_scale: float | None = None, return_lse: bool = False):
        problem = Problem.from_tensors(q, k, v, mask, softmax_scale)
        self.require(problem)
        return self.call(problem, q, k, v, return_lse)

    def call(self, problem: Problem, q, k, v, return_lse: bool = False, deterministic: bool = False):
        self.check_deterministic(deterministic)
        plan = self.plan_for(problem, q.device)
        if deterministic:
            plan = self.deterministic_plan(plan)
        out, lse = self.run(plan, q, k, v, problem.scale)
        if return_lse:
            if lse is None:
                raise Unsupported(f"{self.name} does not return the log-sum-exp")
            return out, lse
        return out


class FlashLowered(PlannedBackend):
    """A backend of documents + window masks: ``lower`` is ``call_args(flash_args(mask), batch)``
    (``flash_args`` raises ``NotExpressible`` for any other mask)."""

    def call_args(self, fa: FlashArgs, batch: int) -> Any:
        return fa

    def lower(self, problem: Problem) -> Any:
        return self.call_args(flash_args(problem.mask), problem.batch)

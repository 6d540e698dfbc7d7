"""What our Triton backends share (``triton``, ``triton-flashmask``, ``triton-sparse``,
``triton-varblock``): where they run (a CUDA device, or a CPU under ``TRITON_INTERPRET=1``, where
float32 is allowed too), the dtype / head-dim / GQA checks (head dims: 1 to 256, v may have its
own; dims that are no multiple of 8 run zero-padded: ``kernels.core.runtime.padded_call``), the launch config (an explicit
``self.config``, else the autotune cache's entry for the problem class via
``longca_triton.kernels.core.tuned.lookup``, else the kernel's defaults; which of them ran is a timed row's
``notes.launch_config``), ``deterministic=True``
(passed to the kernels; ``problem.extra["deterministic"]`` in ``prepare``), and a ``prepare`` that
does the mask lowering / planning before returning the timed call.

A subclass overrides ``mask_reason`` (which masks it takes), ``launch`` (the kernel call; or names it
in ``attention_op``, with ``config_module`` for ``check_config``) and ``plan`` (the device metadata
built outside the timer).
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Callable

import torch

from longca_triton.kernels.core.runtime import compile_disabled

from .base import Backend, Problem

__all__ = ["TritonBackend", "interpreting", "runs_here"]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_here(device_type: str) -> tuple[bool, str]:
    if device_type == "cuda" or interpreting():
        return True, ""
    return False, f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on a CPU, for testing); problem device: {device_type}"


class TritonBackend(Backend):
    """One of our Triton kernels behind the registry (see the module docstring)."""

    #: dtypes the kernels take on a GPU (the interpreter also takes float32)
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    #: an explicit launch config (None: autotune cache, else the kernel's defaults)
    config: dict | None = None
    #: our kernels' backward has no atomics (each gradient tile has one owner summing in a fixed order)
    honours_deterministic = True

    def available(self):
        try:
            importlib.import_module("triton")
        except Exception as e:  # noqa: BLE001 - triton is a core dependency; say why if it breaks
            return False, f"cannot import triton ({type(e).__name__}: {e})"
        if not torch.cuda.is_available() and not interpreting():
            return False, "needs a CUDA GPU (or TRITON_INTERPRET=1 for the CPU interpreter)"
        return True, ""

    #: ``(module, name)`` of the kernel family's attention call, ``name(q, k, v, mask, softmax_scale=,
    #: return_lse=, config=, deterministic=)``: the default ``launch`` (None: the subclass overrides it)
    attention_op: tuple[str, str] | None = None
    #: the module whose ``resolve_config`` checks a config at D = 128 in ``check_config`` (None: the
    #: ``attention_op`` module's; neither: no check)
    config_module: str | None = None

    # -- to override
    def mask_reason(self, problem: Problem) -> str:
        """Why this backend cannot take ``problem.mask`` (empty when it can)."""
        return ""

    def launch(self, q, k, v, mask, scale, return_lse: bool, config: dict | None, deterministic: bool = False):
        """The kernel call (differentiable); returns ``out`` or ``(out, lse)``. ``deterministic``:
        bitwise-identical gradients run to run (the kernel raises ValueError if ``config`` forbids it)."""
        if self.attention_op is None:
            raise NotImplementedError
        module, name = self.attention_op
        fn = getattr(importlib.import_module(module), name)
        return fn(q, k, v, mask, softmax_scale=scale, return_lse=return_lse, config=config, deterministic=deterministic)

    def plan(self, problem: Problem, q, config: dict | None) -> None:
        """Build (and cache) the device metadata for ``problem`` now, outside any timer."""

    # -- shared
    def supports(self, problem: Problem):
        why = self.mask_reason(problem)
        if why:
            return False, why
        ok, why = runs_here(problem.device)
        if not ok:
            return False, why
        allowed = self.dtypes + ((torch.float32,) if interpreting() else ())
        if problem.dtype not in allowed:
            return False, f"dtype {problem.dtype} not supported (kernels take float16 and bfloat16)"
        from longca_triton.kernels.core.runtime import public_head_dim_reason

        for which, d in (("head_dim", problem.head_dim), ("head_dim of v", problem.d_v)):
            why = public_head_dim_reason(d, which)
            if why:
                return False, why
        if problem.heads_kv < 1 or problem.heads_q % problem.heads_kv:
            return False, f"heads_q {problem.heads_q} is not a multiple of heads_kv {problem.heads_kv}"
        return True, ""

    def check_config(self, config: dict) -> None:
        """Raise ``ValueError`` naming the problem where ``config`` is no valid overlay for this kernel (unknown
        keys, bad tiles): the kernel's own ``resolve_config`` on a representative case, so before any launch."""
        module = self.config_module or (self.attention_op[0] if self.attention_op else None)
        if module is not None:
            importlib.import_module(module).resolve_config(128, torch.bfloat16, config)

    def with_config(self, config: dict) -> "TritonBackend":
        """This backend run with launch config ``config`` (checked here), named ``config_name(self.name, config)``."""
        import copy

        from .base import config_name

        try:
            self.check_config(config)
        except ValueError as e:
            raise ValueError(f"{config_name(self.name, config)}: {e}") from None
        other = copy.copy(self)
        other.name = config_name(self.name, config)
        other.config = dict(config)
        other.description = f"{self.description}; launch config {json.dumps(config, sort_keys=True)} over the defaults"
        return other

    @compile_disabled
    def launch_config(self, q, k, mask, v=None) -> dict | None:
        """``self.config``, else the autotune cache's entry for this problem class (keyed by the
        backend's name: ``longca-triton autotune``), else None (the kernel's defaults)."""
        return self._launch_config(q, k, mask, v)[0]

    def _launch_config(self, q, k, mask, v=None) -> tuple[dict | None, str]:
        """``launch_config`` and where it came from: ``"config in the backend name"`` (``with_config``),
        ``"autotune cache"`` or ``"kernel defaults"``."""
        if self.config is not None:
            return self.config, "config in the backend name"
        from longca_triton.kernels.core.tuned import lookup

        tuned = lookup(self.name, q, k, mask, v=v)
        return tuned, "autotune cache" if tuned is not None else "kernel defaults"

    def attention(self, q, k, v, mask, softmax_scale=None, return_lse=False, deterministic=False):
        """The differentiable call; head dims that are no multiple of 8 run padded (``padded_call``)."""
        from longca_triton.kernels.core.runtime import padded_call, resolve_scale

        self.check_deterministic(deterministic)
        scale = resolve_scale(softmax_scale, q.shape[-1])  # from the true D_qk, before any padding
        return padded_call(lambda q, k, v: self.run_kernels(q, k, v, mask, scale, return_lse, deterministic), q, k, v)

    def run_kernels(self, q, k, v, mask, scale, return_lse, deterministic):
        """``launch`` with the launch config of this problem class, on head dims the kernels take."""
        return self.launch(q, k, v, mask, scale, return_lse, self.launch_config(q, k, mask, v), deterministic)

    def prepare(self, problem: Problem, q, k, v) -> Callable[[], tuple]:
        """Check, pick the launch config and plan now; the returned call runs the kernels only (and
        the zero padding of head dims that are no multiple of 8, as a user's call does)."""
        from longca_triton.kernels.core.runtime import padded_call

        self.require(problem)
        config, source = problem.extra.get("config"), "problem config"
        if config is None:
            config, source = self._launch_config(q, k, problem.mask, v)
        # what ran, for the row (``run_notes``): the defaults are the commit's, a config is spelled out
        problem.extra["launch_config"] = {"source": source, **({"config": dict(config)} if config is not None else {})}
        self.plan(problem, q, config)
        mask, scale = problem.mask, problem.scale
        deterministic = bool(problem.extra.get("deterministic", False))
        self.check_deterministic(deterministic)

        def fn():
            return padded_call(lambda q, k, v: self.launch(q, k, v, mask, scale, True, config, deterministic), q, k, v)

        return fn

    def run_notes(self, problem: Problem) -> dict:
        """``launch_config``: ``{"source": ..., "config": {...}}`` as ``prepare`` resolved it (no config: the
        kernel's defaults at the row's commit)."""
        ran = problem.extra.get("launch_config")
        return {"launch_config": ran} if ran else {}

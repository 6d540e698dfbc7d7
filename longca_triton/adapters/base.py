"""The backend registry: every attention implementation behind one interface.

A backend answers four questions, in this order, and never crashes the caller on a case it
cannot run:

* ``available() -> (ok, reason)``: is its package / hardware here at all;
* ``supports(problem) -> (ok, reason)``: can it run this mask, dtype, head layout, mode;
* ``prepare(problem, q, k, v) -> fn``: do all mask lowering and planning now (outside any timed
  region) and return a callable ``fn() -> (out, lse or None)`` running only the kernel;
* ``attention(q, k, v, mask, softmax_scale, return_lse)``: the differentiable call behind
  ``longca_triton.attention(..., backend=name)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from longca_triton.masks import BlockSparseMask, Mask

__all__ = ["Problem", "Backend", "register", "get_backend", "list_backends", "BACKENDS", "Unsupported"]

MODES = ("fwd", "bwd", "fwd_bwd")


class Unsupported(RuntimeError):
    """Raised by a backend asked to run a case its ``supports`` rejects."""


@dataclass
class Problem:
    """One point of a benchmark grid (and what a backend needs to decide whether it can run it)."""

    mask: Mask
    batch: int = 1
    heads_q: int = 8
    heads_kv: int = 8
    head_dim: int = 64
    dtype: torch.dtype = torch.bfloat16
    mode: str = "fwd"
    device: str = "cuda"
    softmax_scale: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def seqlen_q(self) -> int:
        return self.mask.seqlen_q

    @property
    def seqlen_k(self) -> int:
        return self.mask.seqlen_k

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def is_block_sparse(self) -> bool:
        return isinstance(self.mask, BlockSparseMask)

    def flops(self) -> float:
        return self.batch * self.mask.flops(self.heads_q, self.head_dim, self.mode)


class Backend:
    """Base class. Subclasses set ``name`` and ``description`` and override what they need."""

    name: str = ""
    description: str = ""
    #: modes the backend can run (a forward-only kernel sets ("fwd",))
    modes: tuple[str, ...] = MODES
    #: whether ``attention`` can return the log-sum-exp (needed by context parallelism)
    returns_lse: bool = True

    def available(self) -> tuple[bool, str]:
        return True, ""

    def supports(self, problem: Problem) -> tuple[bool, str]:
        return True, ""

    def check(self, problem: Problem) -> tuple[bool, str]:
        """``available`` and ``supports`` and the mode, as one answer."""
        ok, why = self.available()
        if not ok:
            return False, why
        if problem.mode not in self.modes:
            return False, f"{self.name} has no {problem.mode} pass (modes: {', '.join(self.modes)})"
        return self.supports(problem)

    def attention(self, q, k, v, mask: Mask, softmax_scale: float | None = None, return_lse: bool = False):
        raise NotImplementedError

    def prepare(self, problem: Problem, q, k, v) -> Callable[[], tuple]:
        """Default: plan by running once (lowerings are cached on the mask), then time the call."""
        mask, scale = problem.mask, problem.softmax_scale

        def fn():
            out = self.attention(q, k, v, mask, softmax_scale=scale, return_lse=self.returns_lse)
            return out if isinstance(out, tuple) else (out, None)

        return fn


BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    if not backend.name:
        raise ValueError("a backend needs a name")
    BACKENDS[backend.name] = backend
    return backend


def get_backend(name: str) -> Backend:
    from . import _load_all  # noqa: F401 - registration happens on import of the adapters

    _load_all()
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; valid backends: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name]


def list_backends() -> list[Backend]:
    from . import _load_all

    _load_all()
    return [BACKENDS[n] for n in sorted(BACKENDS)]

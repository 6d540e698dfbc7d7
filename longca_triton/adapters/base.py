"""The backend registry: every attention implementation behind one interface.

A backend answers four questions, in this order, and never crashes the caller on a case it
cannot run:

* ``available() -> (ok, reason)``: is its package / hardware here at all;
* ``supports(problem) -> (ok, reason)``: can it run this mask, dtype, head layout, mode;
* ``prepare(problem, q, k, v) -> fn``: do all mask lowering and planning now (outside any timed
  region) and return a callable ``fn() -> (out, lse or None)`` running only the kernel;
* ``attention(q, k, v, mask, softmax_scale, return_lse)``: the differentiable call;
* ``call(problem, q, k, v, return_lse, deterministic)``: the same call for a ``Problem`` already
  built and checked (``longca_triton.attention`` validates the inputs and defaults the scale once,
  then calls this; ``problem.scale`` is the resolved softmax scale). ``deterministic=True`` asks for
  bitwise-identical gradients run to run: a backend that cannot promise them
  (``honours_deterministic`` False) raises ``ValueError`` naming itself.

Names follow one pattern: our own kernels start with ``triton`` (``triton``, ``triton-flashmask``,
``triton-sparse``, ``triton-varblock``); vendor kernels start with the vendor (``sdpa-cudnn``,
``flex-fa4``, ``vsa-triton``...). Old names stay valid through ``ALIASES`` (``canonical_name``). One of ours
named with a launch config, ``triton-varblock{"ragged_bwd":false}`` (``config_name``), runs that config (an
overlay on the kernel's defaults) and is recorded under that name: configs compare through the harness as
backends do.
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from longca_triton.masks import BlockSparseMask, Mask

__all__ = ["ADAPTER_MODULES", "ALIASES", "BACKENDS", "Backend", "Problem", "Unsupported", "canonical_name", "config_name", "get_backend",
           "list_backends", "register", "split_backend_list", "split_config_name"]

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
    #: the head dim of q and k (``D_qk``); ``head_dim_v`` is v's (``D_v``), None when it is the same
    head_dim: int = 64
    dtype: torch.dtype = torch.bfloat16
    mode: str = "fwd"
    device: str = "cuda"
    softmax_scale: float | None = None
    extra: dict = field(default_factory=dict)
    head_dim_v: int | None = None

    @property
    def d_qk(self) -> int:
        return self.head_dim

    @property
    def d_v(self) -> int:
        """v's head dim (the output's): ``head_dim_v``, or ``head_dim`` when that is None."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def split_head_dims(self) -> bool:
        """Whether v has its own head dim (``D_v != D_qk``, e.g. 192/128 in multi-head latent attention)."""
        return self.d_v != self.head_dim

    @property
    def head_dim_label(self) -> str:
        """``"128"``, or ``"192/128"`` (``D_qk/D_v``) when they differ."""
        return str(self.head_dim) if not self.split_head_dims else f"{self.head_dim}/{self.d_v}"

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
        """docs/masks.md §5 with separate head dims: ``2 (D_qk + D_v)`` per allowed pair and query head."""
        return self.batch * self.mask.flops(self.heads_q, self.head_dim, self.mode, head_dim_v=self.d_v)

    @classmethod
    def from_tensors(cls, q, k, v, mask: Mask, softmax_scale: float | None = None) -> "Problem":
        """The problem of one call on ``q [B, Sq, Hq, D_qk]``, ``k [B, Sk, Hkv, D_qk]``, ``v [B, Sk, Hkv, D_v]``;
        the mode is ``fwd_bwd`` when autograd will record the call. ``scale`` is the resolved softmax scale."""
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        d_v = v.shape[3] if v.shape[3] != q.shape[3] else None
        return cls(mask=mask, batch=q.shape[0], heads_q=q.shape[2], heads_kv=k.shape[2], head_dim=q.shape[3],
                   dtype=q.dtype, mode="fwd_bwd" if grad else "fwd", device=q.device.type, softmax_scale=softmax_scale,
                   head_dim_v=d_v)

    @property
    def scale_is_default(self) -> bool:
        """Whether the softmax scale is ``1/sqrt(D)`` (some vendor kernels fix it there)."""
        return self.softmax_scale is None or math.isclose(self.softmax_scale, 1.0 / math.sqrt(self.head_dim))


class Backend:
    """Base class. Subclasses set ``name`` and ``description`` and override what they need."""

    name: str = ""
    description: str = ""
    #: modes the backend can run (a forward-only kernel sets ("fwd",))
    modes: tuple[str, ...] = MODES
    #: whether ``attention`` can return the log-sum-exp (needed by context parallelism)
    returns_lse: bool = True
    #: whether it can promise ``deterministic=True`` (gradients bitwise identical run to run); one
    #: that does takes a ``deterministic`` keyword in ``attention``
    honours_deterministic: bool = False

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

    def call(self, problem: Problem, q, k, v, return_lse: bool = False, deterministic: bool = False):
        """``attention`` for a problem already built from these tensors and checked (see
        ``longca_triton.attention``): no second validation, the scale is ``problem.scale``."""
        self.check_deterministic(deterministic)
        kw = {"deterministic": True} if deterministic else {}  # only backends that honour it take the keyword
        return self.attention(q, k, v, problem.mask, softmax_scale=problem.scale, return_lse=return_lse, **kw)

    def check_deterministic(self, deterministic: bool) -> None:
        """Raise ``ValueError`` naming the backend when ``deterministic`` is asked and not honoured."""
        if deterministic and not self.honours_deterministic:
            raise ValueError(f"backend {self.name!r} cannot promise deterministic=True (bitwise-identical gradients "
                             "run to run); triton, triton-flashmask, triton-sparse and triton-varblock can")

    def require(self, problem: Problem) -> None:
        """``check`` or raise ``Unsupported`` naming the backend and the reason."""
        ok, why = self.check(problem)
        if not ok:
            raise Unsupported(f"{self.name}: {why}")

    def prepare(self, problem: Problem, q, k, v) -> Callable[[], tuple]:
        """Default: plan by running once (lowerings are cached on the mask), then time the call."""
        mask, scale = problem.mask, problem.scale

        def fn():
            out = self.attention(q, k, v, mask, softmax_scale=scale, return_lse=self.returns_lse)
            return out if isinstance(out, tuple) else (out, None)

        return fn

    def run_notes(self, problem: Problem) -> dict:
        """What this backend chose for ``problem`` in ``prepare`` that its name does not say (a timed row's
        ``notes``); none by default."""
        return {}


BACKENDS: dict[str, Backend] = {}

#: old backend names -> current ones (committed result files and user scripts use the old ones)
ALIASES: dict[str, str] = {"flashmask-triton": "triton-flashmask"}


def canonical_name(name: str) -> str:
    """The current name of a backend given by its current or an old name (``ALIASES``); a name with a launch
    config (``config_name``) in its canonical spelling."""
    base, config = split_config_name(name)
    base = ALIASES.get(base, base)
    return base if config is None else config_name(base, config)


def config_name(base: str, config: dict) -> str:
    """The name of ``base`` run with launch config ``config`` (one of our kernels' overlays):
    ``triton-varblock{"ragged_bwd":false}``, the config as compact JSON with sorted keys, so one config has one
    name (rows, resume and reports key on it)."""
    return base + json.dumps(config, sort_keys=True, separators=(",", ":"))


def split_config_name(name: str) -> tuple[str, dict | None]:
    """``(base, config)`` of a ``config_name``, ``(name, None)`` for a plain one; ``ValueError`` when the part
    after ``{`` is not a JSON object of scalars."""
    base, brace, rest = name.partition("{")
    if not brace:
        return name, None
    try:
        config = json.loads(brace + rest)
    except json.JSONDecodeError as e:
        raise ValueError(f"backend {name!r}: the launch config after {base!r} must be a JSON object, e.g. "
                         f"{base}{{\"BLOCK_M\":64}} ({e.msg})") from None
    if not isinstance(config, dict) or not config:
        raise ValueError(f"backend {name!r}: the launch config must be a non-empty JSON object")
    bad = [k for k, v in config.items() if not isinstance(v, (bool, int, float, str))]
    if bad:
        raise ValueError(f"backend {name!r}: config values must be numbers, booleans or strings ({bad})")
    return base.strip(), config


def split_backend_list(text: str) -> list[str]:
    """A comma-separated backend list whose names may carry launch configs (commas inside ``{...}`` stay)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return [x for x in out if x]


def register(backend: Backend) -> Backend:
    if not backend.name:
        raise ValueError("a backend needs a name")
    BACKENDS[backend.name] = backend
    return backend


#: adapter modules, imported on first use of the registry (each registers its backends on import)
ADAPTER_MODULES = ("reference", "triton_dense", "sdpa", "varlen", "flex", "cudnn", "flash", "te", "flashmask",
                   "triton_flashmask", "triton_sparse", "triton_gluon", "vsa", "flashinfer")
_loaded = False


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in ADAPTER_MODULES:
        importlib.import_module(f"longca_triton.adapters.{mod}")


#: backends with a launch config (``config_name`` -> the backend), made on first use
CONFIGURED: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    """The registered backend ``name`` (current or old name), or one of ours run with the launch config its
    name carries (``config_name``: the config checked here, before anything runs)."""
    _load_all()
    key = canonical_name(name)
    base, config = split_config_name(key)
    if base not in BACKENDS:
        raise ValueError(f"unknown backend {base!r}; valid backends: {', '.join(sorted(BACKENDS))}")
    if config is None:
        return BACKENDS[key]
    if key not in CONFIGURED:
        with_config = getattr(BACKENDS[base], "with_config", None)
        if with_config is None:
            ours = sorted(n for n, b in BACKENDS.items() if hasattr(b, "with_config"))
            raise ValueError(f"backend {base!r} takes no launch config ({name!r}); ours do: {', '.join(ours)}")
        CONFIGURED[key] = with_config(config)
    return CONFIGURED[key]


def list_backends() -> list[Backend]:
    _load_all()
    return [BACKENDS[n] for n in sorted(BACKENDS)]

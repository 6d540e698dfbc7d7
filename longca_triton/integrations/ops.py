"""``torch.compile``-safe attention: the ``longca_triton::attention`` custom op, whose mask travels as a tensor.

A compiled graph must not hold a mask object: dynamo would guard on its contents and recompile for
every new set of document boundaries. So the mask enters the op as int64 metadata, in one of two
forms told apart by the last dim:

* **slices** ``[N, 5]``: the ``(q_start, q_end, k_start, k_end, kind)`` slices of a ``RangeMask``
  (``kind`` a ``SliceKind`` value); rows with ``q_end <= q_start`` are padding. ``mask_tensor``
  pads ``N`` to a power of two (at least 8) and marks it dynamic, so masks with a different number
  of slices reuse the graph too;
* **rows** ``[Sq, 2]``: per query row the inclusive key interval ``(lo, hi)`` (``hi < lo``: no keys),
  what ``masks.from_row_intervals`` takes: causal, padded, packed and sliding-window masks built
  from tensors inside a graph (the transformers integration).

The op reads the metadata on the host and rebuilds the ``RangeMask``, one object per distinct
content (``MASKS``), so the kernels' plan caches, keyed by the mask object, hit on every later
call with the same mask. Its backward is a second op, ``longca_triton::attention_backward``.
Backends: ``default`` (what ``longca_triton.attention`` runs when no backend is named:
``api.default_backend`` for the call's mode, which the op is told since it runs outside autograd),
``triton`` (our dense kernels), ``triton-gluon`` (our Gluon kernels, sm_90; head dims that have not
passed their GPU tests run ``triton``, as the backend of that name does) and ``reference`` (plain
PyTorch). Head dims that are no multiple of 8 are padded with zeros around the op.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Optional

import numpy as np
import torch

from longca_triton.api import validate_inputs
from longca_triton.kernels.core.autograd import fake_bwd, fake_fwd
from longca_triton.kernels.core.runtime import config_head_dim, padded_call, public_head_dim_reason, resolve_scale
from longca_triton.masks import Mask, RangeMask, from_row_intervals

__all__ = ["BACKENDS", "MASKS", "MaskCache", "compiled_attention", "mask_from_tensor", "mask_tensor"]

#: the backends the op runs: the default choice, ours, and the plain-PyTorch reference (for checking)
BACKENDS = ("default", "triton", "triton-gluon", "reference")
#: the smallest padded slice count of ``mask_tensor``
MIN_CAPACITY = 8


def mask_tensor(mask: RangeMask, *, capacity: Optional[int] = None, device=None) -> torch.Tensor:
    """The slices of ``mask`` as int64 ``[capacity, 5]`` rows ``(q_start, q_end, k_start, k_end, kind)``,
    zero rows after the mask's own; ``capacity`` defaults to the next power of two of the slice count (at
    least 8). The first dim is marked dynamic for ``torch.compile``: build this tensor outside the
    compiled region (in the data pipeline) and pass it to the model."""
    if not isinstance(mask, RangeMask):
        raise ValueError(f"mask must be a RangeMask (block-sparse masks have no slice form), got {type(mask).__name__}")
    n = len(mask.slices)
    cap = max(MIN_CAPACITY, 1 << max(0, n - 1).bit_length()) if capacity is None else int(capacity)
    if cap < n:
        raise ValueError(f"capacity {cap} is smaller than the mask's {n} slices")
    rows = np.zeros((cap, 5), dtype=np.int64)
    if n:
        rows[:n] = [(qs, qe, ks, ke, int(kind)) for qs, qe, ks, ke, kind in mask.slices]
    out = torch.from_numpy(rows).to(device or "cpu")
    torch._dynamo.maybe_mark_dynamic(out, 0)
    return out


def _check_meta(meta: torch.Tensor, sq: int) -> None:
    """Raise ValueError unless ``meta`` is int64 slices ``[N, 5]`` or rows ``[Sq, 2]``."""
    if not isinstance(meta, torch.Tensor) or meta.dtype != torch.int64 or meta.dim() != 2 or meta.shape[1] not in (2, 5):
        what = f"{meta.dtype} tensor of shape {tuple(meta.shape)}" if isinstance(meta, torch.Tensor) else type(meta).__name__
        raise ValueError(f"mask must be a RangeMask or int64 metadata, slices [N, 5] (mask_tensor) or rows [Sq, 2]; "
                         f"got a {what}")
    if meta.shape[1] == 2 and meta.shape[0] != sq:
        raise ValueError(f"row-interval metadata has {meta.shape[0]} rows but q has {sq} positions")


def mask_from_tensor(meta: torch.Tensor, seqlen_q: int, seqlen_k: int) -> RangeMask:
    """The ``RangeMask`` that metadata ``meta`` (slices ``[N, 5]`` or rows ``[Sq, 2]``) describes."""
    _check_meta(meta, seqlen_q)
    host = meta.detach().cpu().numpy()
    if host.shape[1] == 2:
        return from_row_intervals(host[:, 0], host[:, 1], seqlen_k, name="rows")
    live = host[host[:, 1] > host[:, 0]]
    return RangeMask(seqlen_q, seqlen_k, [tuple(int(x) for x in r) for r in live], name="slices")


def _version(t: torch.Tensor):
    """The tensor's in-place version counter (None for inference tensors, which have none)."""
    try:
        return t._version
    except RuntimeError:
        return None


class MaskCache:
    """Metadata tensor -> ``RangeMask``, one mask object per distinct content (an LRU of ``size``).

    A tensor seen before (same object, unchanged since) skips the host copy; any other is read to the
    host and looked up by its bytes."""

    def __init__(self, size: int = 64):
        self.size = size
        self._by_content: "collections.OrderedDict[tuple, RangeMask]" = collections.OrderedDict()
        self._by_tensor: dict = {}
        self._lock = threading.Lock()

    def get(self, meta: torch.Tensor, seqlen_q: int, seqlen_k: int) -> RangeMask:
        """The mask ``meta`` describes for ``seqlen_q`` queries and ``seqlen_k`` keys (``mask_from_tensor``)."""
        stamp = (_version(meta), seqlen_q, seqlen_k)
        seen = self._by_tensor.get(id(meta))
        if seen is not None and stamp[0] is not None and seen[0]() is meta and seen[1] == stamp:
            return seen[2]
        _check_meta(meta, seqlen_q)
        host = meta.detach().cpu().contiguous().numpy()
        if host.shape[1] == 5:  # the padding rows are no part of the mask: any capacity, one entry
            host = np.ascontiguousarray(host[host[:, 1] > host[:, 0]])
        key = (seqlen_q, seqlen_k, host.shape[1], host.tobytes())
        with self._lock:
            mask = self._by_content.get(key)
            if mask is not None:
                self._by_content.move_to_end(key)
        if mask is None:
            mask = mask_from_tensor(torch.from_numpy(host), seqlen_q, seqlen_k)
            with self._lock:
                self._by_content[key] = mask
                while len(self._by_content) > self.size:
                    self._by_content.popitem(last=False)
        with self._lock:
            live = [(i, e) for i, e in self._by_tensor.items() if e[0]() is not None]
            self._by_tensor = dict(live[-self.size:])
            self._by_tensor[id(meta)] = (weakref.ref(meta), stamp, mask)
        return mask

    def clear(self) -> None:
        """Forget every mask."""
        with self._lock:
            self._by_content.clear()
            self._by_tensor.clear()

    def __len__(self) -> int:
        return len(self._by_content)


#: the op's masks, shared by forward and backward
MASKS = MaskCache()


def _backend_name(backend: str | None) -> str:
    name = backend or "default"
    if name not in BACKENDS:
        raise ValueError(f"compiled_attention runs backends {', '.join(BACKENDS)}; got {backend!r}")
    return name


def _kernels(backend: str, mask, q, k, v, train: bool) -> str:
    """The kernels the op runs for ``backend``: ``default`` resolved for the call's mode (``train``:
    a backward follows), ``triton-gluon`` on head dims without Gluon GPU tests as ``triton``."""
    from longca_triton.api import default_backend

    name = default_backend(mask, q, k, v, mode="fwd_bwd" if train else "fwd") if backend == "default" else backend
    if name == "triton-gluon":
        from longca_triton.adapters.triton_gluon import TritonGluon

        if TritonGluon.fallback_reason(q.shape[-1], v.shape[-1]):
            return "triton"
    return name if name in _FWD else "triton"


def _checked_call(q, k, v, meta, scale: float, backend: str, train: bool) -> tuple[RangeMask, str]:
    """The call's mask and the kernels it runs (``_kernels``), with the inputs and those kernels'
    backend checked (one ValueError naming the problem)."""
    from longca_triton.adapters import Problem, get_backend

    mask = MASKS.get(meta, q.shape[1], k.shape[1])
    validate_inputs(q, k, v, mask)
    name = _kernels(backend, mask, q, k, v, train)
    ok, why = get_backend(name).check(Problem.from_tensors(q, k, v, mask, scale))
    if not ok:
        raise ValueError(f"backend {name!r} cannot run this case: {why}")
    return mask, name


def _dense_config(q, k, v, mask) -> dict:
    """The dense kernels' config of this call, resolved once per mask and shape (forward and backward share it)."""
    from longca_triton.kernels.core.plan_cache import mask_memo
    from longca_triton.kernels.core.tuned import generation
    from longca_triton.kernels.dense import resolve_config

    key = ("op-dense", q.shape[-1], v.shape[-1], q.dtype, q.shape[2] // k.shape[2], str(q.device), generation())
    return mask_memo(mask, key, lambda: resolve_config(config_head_dim(q.shape[-1], v.shape[-1]), q.dtype, None,
                                                       q=q, k=k, v=v, mask=mask))


def _triton_fwd(q, k, v, mask, scale):
    from longca_triton.kernels.dense import dense_fwd, plans_for

    cfg = _dense_config(q, k, v, mask)
    return dense_fwd(q, k, v, plans_for(mask, cfg, q.device)[0], scale, cfg)


def _triton_bwd(dout, dlse, q, k, v, out, lse, mask, scale):
    from longca_triton.kernels.dense import dense_bwd, plans_for

    cfg = _dense_config(q, k, v, mask)
    _, dkdv_plan, dq_plan = plans_for(mask, cfg, q.device)
    return dense_bwd(dout, q, k, v, out, lse, dkdv_plan, dq_plan, scale, cfg, dlse=dlse)


def _reference(mask, scale):
    from longca_triton.reference import naive_attention

    def run(q, k, v):
        out, lse = naive_attention(q, k, v, mask, scale, return_lse=True)
        return out.contiguous(), lse.float()

    return run


def _reference_fwd(q, k, v, mask, scale):
    return _reference(mask, scale)(q, k, v)


def _reference_bwd(dout, dlse, q, k, v, out, lse, mask, scale):
    # autograd is off inside an op; torch.func's own transform differentiates the plain-PyTorch forward
    _, vjp = torch.func.vjp(_reference(mask, scale), q, k, v)
    return tuple(g.contiguous() for g in vjp((dout, dlse.to(torch.float32))))


def _gluon_fwd(q, k, v, mask, scale):
    from longca_triton.kernels.gluon.op import gluon_forward

    return gluon_forward(q, k, v, mask, scale)


def _gluon_bwd(dout, dlse, q, k, v, out, lse, mask, scale):
    from longca_triton.kernels.gluon.op import gluon_backward

    return gluon_backward(dout, dlse, q, k, v, out, lse, mask, scale)


_FWD = {"triton": _triton_fwd, "triton-gluon": _gluon_fwd, "reference": _reference_fwd}
_BWD = {"triton": _triton_bwd, "triton-gluon": _gluon_bwd, "reference": _reference_bwd}


@torch.library.custom_op("longca_triton::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_meta: torch.Tensor,
                  softmax_scale: float, backend: str, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    mask, name = _checked_call(q, k, v, mask_meta, softmax_scale, backend, train)
    return _FWD[name](q, k, v, mask, softmax_scale)


@_attention_op.register_fake
def _(q, k, v, mask_meta, softmax_scale, backend, train):
    return fake_fwd(q, v)


@torch.library.custom_op("longca_triton::attention_backward", mutates_args=())
def _attention_bwd_op(dout: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, mask_meta: torch.Tensor,
                      softmax_scale: float, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = MASKS.get(mask_meta, q.shape[1], k.shape[1])
    # the forward that saved out and lse ran with a backward to follow: the same kernels' backward
    return _BWD[_kernels(backend, mask, q, k, v, True)](dout, dlse, q, k, v, out, lse, mask, softmax_scale)


@_attention_bwd_op.register_fake
def _(dout, dlse, q, k, v, out, lse, mask_meta, softmax_scale, backend):
    return fake_bwd(q, k, v)


def _setup_context(ctx, inputs, output):
    q, k, v, mask_meta, softmax_scale, backend, train = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask_meta)
    ctx.softmax_scale, ctx.backend = softmax_scale, backend


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, mask_meta = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    dlse = torch.zeros_like(lse) if dlse is None else dlse.contiguous()
    dq, dk, dv = _attention_bwd_op(dout, dlse, q, k, v, out, lse, mask_meta, ctx.softmax_scale, ctx.backend)
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd("longca_triton::attention", _backward, setup_context=_setup_context)


def compiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, *,
                       softmax_scale: Optional[float] = None, backend: Optional[str] = None,
                       return_lse: bool = False):
    """``longca_triton.attention`` through the ``longca_triton::attention`` op: no graph break under
    ``torch.compile(fullgraph=True)``, and no recompile when only the mask changes.

    ``q [B, Sq, Hq, D_qk]``, ``k [B, Sk, Hkv, D_qk]``, ``v [B, Sk, Hkv, D_v]`` (GQA when ``Hkv < Hq``).
    ``mask``: int64 metadata, slices ``[N, 5]`` from :func:`mask_tensor` or rows ``[Sq, 2]`` (built
    outside the compiled region and passed in as a tensor), or a ``RangeMask`` (converted here: fine
    eagerly, but inside a compiled region a mask object is guarded on, so a new mask recompiles).
    ``backend``: ``"default"`` (``None``: what ``longca_triton.attention`` would run), ``"triton"``,
    ``"triton-gluon"`` or ``"reference"``. Any head dim from 1 to 256 (zero-padded to a multiple of 8
    around the op). Returns ``out [B, Sq, Hq, D_v]`` and, with ``return_lse``, ``lse [B, Hq, Sq]``
    (float32, ``-inf`` on rows that attend nothing); differentiable.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [batch, seqlen, heads, head_dim], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if isinstance(mask, Mask):
        validate_inputs(q, k, v, mask)  # the slice form drops the mask's own lengths: check them here
    meta = mask_tensor(mask, device=q.device) if isinstance(mask, Mask) else mask
    _check_meta(meta, q.shape[1])
    name = _backend_name(backend)
    for which, d in (("head dim", q.shape[-1]), ("head dim of v", v.shape[-1])):
        why = public_head_dim_reason(d, which)
        if why:
            raise ValueError(why)
    scale = resolve_scale(softmax_scale, q.shape[-1])  # from the true D_qk, before any padding
    train = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    out, lse = padded_call(lambda q, k, v: _attention_op(q, k, v, meta, scale, name, train), q, k, v)
    return (out, lse) if return_lse else out

"""Step kernels: the per-(query shard, key shard) attention the CP schemes call.

A step kernel has two methods, FlashAttention style:

* ``forward(q, k, v, mask, scale) -> (out, lse)`` without autograd; ``lse [B, Hq, Sq]`` in float32
  (float64 for float64 inputs), ``-inf`` on rows that attend nothing;
* ``backward(dout, q, k, v, out, lse, mask, scale, dlse=None) -> (dq, dk, dv)`` given the *final*
  (merged) ``out`` and ``lse``: with ``P = exp(S - lse)`` and ``delta = rowsum(dout * out) - dlse``
  the kernel's usual equations give exactly this block's share of the gradients, so a ring
  backward needs no recomputation of the forward and no correction terms.

Both take keyword-only options: ``partial=False`` says the call is the only one for its queries (no
merge and no dQ sum follow), so ``out`` / ``dq`` may come back in the inputs' dtype instead of a
float32 partial; ``after_dkdv(dk, dv)`` (backward) is called as soon as dK/dV are ready and before
dQ is computed, so that a scheme can post their transfer while dQ runs (kernels that compute both
together call it at the end).

Resolution of a backend name (:func:`get_step_kernel`):

1. a registered backend with ``cp_forward`` / ``cp_backward`` methods: those;
2. ``triton``: our dense kernel's launchers (``longca_triton.kernels.dense.op``: ``dense_fwd`` /
   ``dense_bwd`` with ``dlse``), even before the backend is registered;
3. ``reference`` / ``reference-chunked``: :class:`TorchStep`, plain PyTorch with the same equations;
4. anything else: :class:`AutogradStep`, which recomputes the block under the backend's own autograd
   in the backward and feeds it the gradients of its partial ``out_i`` and ``lse_i``
   (``w_i dout`` and ``w_i (dlse + rowsum(dout * (out_i - out)))`` with ``w_i = exp(lse_i - lse)``);
   correct for any backend differentiable through its lse, at the cost of one extra forward.
"""

from __future__ import annotations

import math

import torch

__all__ = ["StepKernel", "TorchStep", "TritonStep", "AutogradStep", "get_step_kernel", "acc_dtype", "then_dkdv"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for merges and gradient sums: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def then_dkdv(after_dkdv, dq, dk, dv):
    """``(dq, dk, dv)``, after handing ``dk, dv`` to ``after_dkdv`` (when given): the hook of a step
    kernel that finishes dQ and dK/dV together, so has no earlier moment to call it."""
    if after_dkdv is not None:
        after_dkdv(dk, dv)
    return dq, dk, dv


def _safe(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


class StepKernel:
    name = "step"

    def forward(self, q, k, v, mask, scale, *, partial=True):
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, mask, scale, dlse=None, *, partial=True, after_dkdv=None):
        raise NotImplementedError

    def single_device(self) -> "StepKernel":
        """The same kernel as one device would run it (the CP benchmark's baseline)."""
        return self


class TorchStep(StepKernel):
    """Materialised scores, any mask: for tests and small problems."""

    name = "torch"

    def forward(self, q, k, v, mask, scale, *, partial=True):
        from longca_triton.reference import naive_attention

        with torch.no_grad():
            out, lse = naive_attention(q, k, v, mask, scale, return_lse=True)
        return out, lse.to(acc_dtype(q.dtype))

    def backward(self, dout, q, k, v, out, lse, mask, scale, dlse=None, *, partial=True, after_dkdv=None):
        acc = acc_dtype(q.dtype)
        B, Sq, Hq, D = q.shape
        Hkv = k.shape[2]
        g = Hq // Hkv
        qh = q.transpose(1, 2).to(acc)
        kh = k.transpose(1, 2).to(acc).repeat_interleave(g, dim=1)
        vh = v.transpose(1, 2).to(acc).repeat_interleave(g, dim=1)
        doh = dout.transpose(1, 2).to(acc)
        allowed = mask.to_dense().to(q.device)
        s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
        p = torch.where(allowed, torch.exp(s - _safe(lse.to(acc))[..., None]), torch.zeros_like(s))
        delta = (doh * out.transpose(1, 2).to(acc)).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(acc)
        dv = torch.matmul(p.transpose(-1, -2), doh)
        ds = p * (torch.matmul(doh, vh.transpose(-1, -2)) - delta[..., None])
        dq = torch.matmul(ds, kh) * scale
        dk = torch.matmul(ds.transpose(-1, -2), qh) * scale
        Sk = k.shape[1]
        dk = dk.view(B, Hkv, g, Sk, D).sum(2)
        dv = dv.view(B, Hkv, g, Sk, v.shape[3]).sum(2)  # v may have its own head dim
        return then_dkdv(after_dkdv, dq.transpose(1, 2).to(q.dtype), dk.transpose(1, 2).to(k.dtype),
                         dv.transpose(1, 2).to(v.dtype))


class TritonStep(StepKernel):
    """Our Triton dense kernel (``longca_triton.kernels.dense.op``), plans cached on each local mask."""

    name = "triton"

    def __init__(self, config: dict | None = None, float32_partials: bool = True):
        from longca_triton.kernels.dense import op as dense

        self.dense = dense
        self.config = config
        self.float32_partials = float32_partials

    def single_device(self) -> "TritonStep":
        # a single-GPU user gets outputs and gradients in the inputs' dtype: no float32 partials
        return TritonStep(self.config, float32_partials=False)

    def _setup(self, q, k, v, mask):
        """Launch config (the autotune cache's for this problem class, else the defaults) and the
        three tile plans, cached on the (local) mask."""
        from longca_triton.kernels.core.runtime import config_head_dim

        key = ("cp-triton", str(q.dtype), q.shape[-1], v.shape[-1], q.shape[2] // k.shape[2], str(q.device))
        cache = mask.__dict__.setdefault("_lowering_cache", {})
        if key not in cache:
            cfg = self.config
            if cfg is None:
                try:
                    from longca_triton.kernels.core.tuned import lookup

                    cfg = lookup("triton", q, k, mask, v=v)
                except Exception:  # noqa: BLE001 - no tuning cache: defaults
                    cfg = None
            cfg = self.dense.resolve_config(config_head_dim(q.shape[-1], v.shape[-1]), q.dtype, cfg)
            cache[key] = (cfg, self.dense.plans_for(mask, cfg, q.device))
        return cache[key]

    # why float32 partials: a rank merges one partial output (and adds one partial dQ, dK, dV) per
    # step; rounding each to bf16 first made the error grow with the ring (2x the single-GPU error
    # at N = 4 on an H200). The kernels store float32 directly, and the merge rounds once.
    def forward(self, q, k, v, mask, scale, *, partial=True):
        cfg, (fwd, _, _) = self._setup(q, k, v, mask)
        return self.dense.dense_fwd(q, k, v, fwd, float(scale), cfg,
                                    out_dtype=acc_dtype(q.dtype) if self.float32_partials and partial else None)

    def backward(self, dout, q, k, v, out, lse, mask, scale, dlse=None, *, partial=True, after_dkdv=None):
        cfg, (_, dkdv, dq) = self._setup(q, k, v, mask)
        grad = acc_dtype(q.dtype) if self.float32_partials else None
        return self.dense.dense_bwd(dout, q, k, v, out.to(q.dtype), lse.float(), dkdv, dq, float(scale), cfg,
                                    dlse=None if dlse is None else dlse.float(), grad_dtype=grad,
                                    dq_dtype=grad if partial else q.dtype, after_dkdv=after_dkdv)


class AutogradStep(StepKernel):
    """Any registered backend that returns lse and is differentiable through it (see module doc)."""

    def __init__(self, backend):
        from longca_triton.adapters import get_backend

        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        if not self.backend.returns_lse:
            raise ValueError(f"backend {self.backend.name!r} does not return the log-sum-exp, which context parallelism needs")
        self.name = f"{self.backend.name}:autograd"

    def forward(self, q, k, v, mask, scale, *, partial=True):
        with torch.no_grad():
            out, lse = self.backend.attention(q, k, v, mask, softmax_scale=scale, return_lse=True)
        return out, lse.to(acc_dtype(q.dtype))

    def backward(self, dout, q, k, v, out, lse, mask, scale, dlse=None, *, partial=True, after_dkdv=None):
        return then_dkdv(after_dkdv, *self._grads(dout, q, k, v, out, lse, mask, scale, dlse))

    def _grads(self, dout, q, k, v, out, lse, mask, scale, dlse):
        acc = acc_dtype(q.dtype)
        with torch.enable_grad():
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
            o_i, l_i = self.backend.attention(qq, kk, vv, mask, softmax_scale=scale, return_lse=True)
            lse_a = lse.to(acc)
            w = torch.where(torch.isneginf(l_i.to(acc)), torch.zeros_like(lse_a), torch.exp(l_i.to(acc) - _safe(lse_a)))
            do = dout.to(acc)
            g_o = (do * w.transpose(1, 2)[..., None]).to(o_i.dtype)
            g_l = (do * (o_i.detach().to(acc) - out.to(acc))).sum(-1).transpose(1, 2)
            if dlse is not None:
                g_l = g_l + dlse.to(acc)
            g_l = (w * g_l).to(l_i.dtype)
            return torch.autograd.grad((o_i, l_i), (qq, kk, vv), (g_o, g_l))


_TORCH_NAMES = ("reference", "reference-chunked", "torch")


def get_step_kernel(backend) -> StepKernel:
    """A :class:`StepKernel` for a backend name (or a ready kernel / backend object)."""
    if isinstance(backend, StepKernel):
        return backend
    if not isinstance(backend, str):
        if hasattr(backend, "cp_forward"):
            return _MethodStep(backend)
        return AutogradStep(backend)
    from longca_triton.adapters import BACKENDS, get_backend

    if backend.endswith(":autograd"):
        return AutogradStep(backend[: -len(":autograd")])
    try:
        impl = get_backend(backend)
    except ValueError:
        if "{" in backend:  # one of ours with a launch config: say what is wrong with the config
            raise
        impl = None
    if impl is not None and hasattr(impl, "cp_forward") and hasattr(impl, "cp_backward"):
        return _MethodStep(impl)
    if backend == "triton":
        try:
            return TritonStep()
        except ImportError as e:
            if impl is None:
                raise ValueError(f"backend 'triton' is not available: {e}") from None
    if backend in _TORCH_NAMES:
        return TorchStep()
    if impl is None:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(sorted(BACKENDS))}")
    return AutogradStep(impl)


class _MethodStep(StepKernel):
    def __init__(self, impl):
        self.impl = impl
        self.name = getattr(impl, "name", "backend")

    def forward(self, q, k, v, mask, scale, *, partial=True):
        return self.impl.cp_forward(q, k, v, mask, scale)

    def backward(self, dout, q, k, v, out, lse, mask, scale, dlse=None, *, partial=True, after_dkdv=None):
        return then_dkdv(after_dkdv, *self.impl.cp_backward(dout, q, k, v, out, lse, mask, scale, dlse))


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

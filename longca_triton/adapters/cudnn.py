"""``cudnn``: cuDNN SDPA graphs through the ``nvidia-cudnn-frontend`` package (``import cudnn``).

Uses the frontend's own PyTorch ops (``cudnn.sdpa_torch`` -> ``torch.ops.cudnn.sdpa_fwd`` /
``sdpa_bwd``, which build and cache ``pygraph`` SDPA forward and backward graphs): causal masks,
diagonal bands (sliding windows) and packed variable-length documents (THD layout with ragged
offsets from ``cu_seqlens``), forward and backward, GQA natively, log-sum-exp returned.

Lowering (``cudnn_call_args``) from FlashAttention's form (``flash_args``): cuDNN's left band bound
counts the visible keys *including* the diagonal (``diagonal_band_left_bound = lb`` masks
``j <= i - lb``), so FlashAttention's left window ``w`` becomes ``w + 1``; the right bound is the
same in both. Masks that are not documents with a window are reported unsupported here
(``sdpa-cudnn`` runs them through a dense mask). Head dims: multiples of 8 up to 256, one for q, k
and v: cuDNN itself runs D_v != D_qk (e.g. 192/128), but this adapter's call through
``cudnn.sdpa_torch`` has not been verified with two head dims, so it says unsupported and
``sdpa-cudnn`` (PyTorch's cuDNN path, which takes them since torch 2.5) measures that case.
"""

from __future__ import annotations

from ._common import (HEAD_DIMS_MULT8, FlashArgs, FlashLowered, VendorPlan, dist_version, pack_tokens,
                      packed_cu_seqlens, try_import, vendor_plan)
from .base import Problem, register

__all__ = ["CudnnFrontend", "cudnn_call_args"]


def cudnn_call_args(fa: FlashArgs, batch: int) -> dict:
    """Keywords of ``cudnn.sdpa_torch`` for a mask in FlashAttention form (``cu_seqlens`` numpy)."""
    left, right = fa.window
    out = {
        "is_causal": fa.causal,
        "window_left": left + 1 if left >= 0 else -1,
        "window_right": -1 if fa.causal else right,
    }
    if fa.varlen:
        out["cu_seqlens"] = packed_cu_seqlens(fa, batch)
        out["max_seqlen"] = fa.max_seqlen
    return out


class CudnnFrontend(FlashLowered):
    name = "cudnn"
    description = "cuDNN SDPA graphs (nvidia-cudnn-frontend): causal, sliding window, packed varlen; fwd+bwd"
    lowering = "flash_args -> is_causal / diagonal band (left+1) / THD ragged offsets"
    head_dims = HEAD_DIMS_MULT8
    requires, requires_label = "cudnn", "nvidia-cudnn-frontend"

    def available(self):
        ok, why = super().available()
        if not ok:
            return False, why
        try:
            fn = try_import("cudnn")[0].sdpa_torch  # lazy export: imports the op module, registers the torch ops
        except Exception as e:
            ver = dist_version("nvidia-cudnn-frontend") or "?"
            return False, f"nvidia-cudnn-frontend {ver} has no usable cudnn.sdpa_torch ({type(e).__name__}: {e})"
        self._fn = fn
        return True, ""

    call_args = staticmethod(cudnn_call_args)

    def materialize(self, problem: Problem, args: dict, device):
        kwargs = {k: args[k] for k in ("is_causal", "window_left", "window_right")}
        return vendor_plan(self._fn, kwargs, args, device)

    def run(self, plan: VendorPlan, q, k, v, scale: float):
        B, S, Hq, D = q.shape[0], q.shape[1], q.shape[2], v.shape[3]  # out is [B, S, Hq, D_v]
        if plan.cu is None:
            out, lse = plan.call(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale,
                               return_lse=True, **plan.kwargs)
            return out.transpose(1, 2), lse.reshape(B, Hq, S)
        out, lse = plan.call(
            *pack_tokens(q, k, v), scale=scale,
            cu_seqlens_q=plan.cu, cu_seqlens_kv=plan.cu, max_seqlen_q=plan.max_seqlen, max_seqlen_kv=plan.max_seqlen,
            return_lse=True, **plan.kwargs,
        )
        return out.reshape(B, S, Hq, D), lse.reshape(B, S, Hq).permute(0, 2, 1)


register(CudnnFrontend())

"""``te``: TransformerEngine's fused attention (``transformer_engine.pytorch.DotProductAttention``).

Lowering (``te_call_args``) from FlashAttention's form (``flash_args``): one document -> ``bshd``
layout with ``attn_mask_type`` ``no_mask`` / ``causal``; several documents -> ``thd`` layout (the
batch packed into ``[B*S, H, D]``) with ``padding`` / ``padding_causal`` and ``cu_seqlens``;
sliding windows through ``window_size = (left, right)`` (FlashAttention's convention, which TE
uses; ``(-1, 0)`` for causal). TE picks its own kernel (cuDNN fused attention or flash) and does
not hand back the log-sum-exp, so ``returns_lse = False``. TransformerEngine's PyTorch extension
is a source build, absent on our GPU host: this adapter is "not measured here" (docs/backends.md).
Head dims: D_v != D_qk is passed as ``kv_channels=(D_qk, D_v)``, the tuple form TransformerEngine
documents for multi-head latent attention (not run here).
"""

from __future__ import annotations

from ._common import FlashArgs, FlashLowered, VendorPlan, pack_tokens, packed_cu_seqlens, try_import, vendor_plan
from .base import Problem, register

__all__ = ["TransformerEngine", "te_call_args"]


def te_call_args(fa: FlashArgs, batch: int) -> dict:
    """Constructor/forward keywords for ``DotProductAttention`` (``cu_seqlens`` as numpy)."""
    left, right = fa.window
    window = (left, 0 if fa.causal else right)
    if fa.varlen:
        return {
            "qkv_format": "thd",
            "attn_mask_type": "padding_causal" if fa.causal else "padding",
            "window_size": window,
            "cu_seqlens": packed_cu_seqlens(fa, batch),
            "max_seqlen": fa.max_seqlen,
        }
    return {"qkv_format": "bshd", "attn_mask_type": "causal" if fa.causal else "no_mask", "window_size": window}


class TransformerEngine(FlashLowered):
    name = "te"
    requires, requires_label = "transformer_engine.pytorch", "TransformerEngine (PyTorch)"
    description = "TransformerEngine DotProductAttention (THD layout for documents); no lse"
    lowering = "flash_args -> qkv_format bshd|thd, attn_mask_type, window_size, cu_seqlens"
    #: TransformerEngine picks its own kernel and hands back no log-sum-exp
    returns_lse = False
    head_dim_pairs = None

    call_args = staticmethod(te_call_args)

    def materialize(self, problem: Problem, args: dict, device) -> VendorPlan:
        te, _ = try_import("transformer_engine.pytorch")
        module = te.DotProductAttention(
            num_attention_heads=problem.heads_q,
            kv_channels=problem.head_dim if not problem.split_head_dims else (problem.head_dim, problem.d_v),
            num_gqa_groups=problem.heads_kv,
            attention_dropout=0.0, qkv_format=args["qkv_format"], attn_mask_type=args["attn_mask_type"],
            window_size=args["window_size"], softmax_scale=problem.scale,
        ).to(device)
        return vendor_plan(module, args, args, device)

    def run(self, plan: VendorPlan, q, k, v, scale: float):
        B, S, Hq, D = q.shape[0], q.shape[1], q.shape[2], v.shape[3]  # out is [B, S, Hq, D_v]
        if plan.cu is None:
            out = plan.call(q, k, v)
        else:
            out = plan.call(*pack_tokens(q, k, v), cu_seqlens_q=plan.cu, cu_seqlens_kv=plan.cu,
                            max_seqlen_q=plan.max_seqlen, max_seqlen_kv=plan.max_seqlen)
        return out.reshape(B, S, Hq, D), None


register(TransformerEngine())

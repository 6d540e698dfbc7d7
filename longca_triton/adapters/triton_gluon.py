"""Our warp-specialized Gluon kernels (``longca_triton/kernels/gluon/``) as the ``triton-gluon`` backend.

Forward and backward are Gluon (FlashAttention-3's design on sm_90: TMA producer warp,
consumer warpgroups with async wgmma; the backward as separate dQ and dK/dV kernels). By default the
backward is the Gluon dQ kernel with our plain-Triton dK/dV kernel at D = 128 (``bwd_design="mixed"``,
the two on two CUDA streams) and our plain-Triton backward elsewhere (``"plain"``), each measured
fastest there (``kernels/tuning/gluon.toml``). It runs on sm_90 only: elsewhere (other GPUs, the CPU
interpreter) every case is ``unsupported`` with the reason, never a crash.
Head dims: any from 1 to 256 (D_v may differ from D_qk), padded to multiples of 8 as our other
kernels are. The Gluon kernels run the padded pairs that passed the GPU tests
(``GPU_CHECKED_HEAD_DIMS``; the Gluon backward only at 64 and 128 with D_v == D_qk, the plain-Triton
backward elsewhere); any other pair runs our plain-Triton kernels, and a timed row says so in its
``fallback`` note.
"""

from __future__ import annotations

import torch

from longca_triton.masks import BlockSparseMask

from .base import Problem, register
from .triton_base import TritonBackend


class TritonGluon(TritonBackend):
    name = "triton-gluon"
    description = ("longca-triton's Gluon kernels, sm_90 only: FA3-design forward (warp-specialized TMA "
                   "producer, two consumer warpgroups over async wgmma, three where the head-dim tiles are 64 "
                   "wide and, with P V read from shared memory, at D = 128 on masks of density >= 0.6; on the "
                   "sparser masks a persistent launch, one CTA per SM walking the query tiles; partial key tiles "
                   "masked in each walk's first steps without a branch, the rest in a merging second launch; at "
                   "D = 64 on the sparser masks the row sums by a wgmma); backward: at D = 128 our plain-Triton dK/dV "
                   "kernel with the Gluon dQ kernel beside it on a second stream (bwd_design='mixed'; dQ's first "
                   "partial key tiles masked without a branch), elsewhere our plain-Triton backward "
                   "(each measured fastest there); bwd_design='split' asks for warp-specialized Gluon dQ + dK/dV "
                   "kernels)")
    attention_op = ("longca_triton.kernels.gluon.op", "gluon_attention")
    config_module = "longca_triton.kernels.gluon.config"

    def available(self):
        try:
            import triton.experimental.gluon  # noqa: F401
        except Exception as e:  # noqa: BLE001 - say why the Gluon module cannot load
            return False, f"cannot import triton.experimental.gluon ({type(e).__name__}: {e})"
        if not torch.cuda.is_available():
            return False, "needs an sm_90 (Hopper) GPU; the CPU interpreter cannot run Gluon"
        from longca_triton.kernels.gluon.config import device_reason

        why = device_reason(torch.device("cuda"))
        return (not why), why

    def mask_reason(self, problem: Problem) -> str:
        if isinstance(problem.mask, BlockSparseMask):
            return "block-sparse masks run on triton-sparse / triton-varblock"
        return ""

    def supports(self, problem: Problem):
        if problem.device != "cuda":
            return False, f"needs an sm_90 (Hopper) GPU; problem device: {problem.device} (no Gluon in the interpreter)"
        ok, why = super().supports(problem)
        if not ok:
            return ok, why
        from longca_triton.kernels.gluon.config import device_reason

        why = device_reason(torch.device("cuda"))
        return (not why), why

    @staticmethod
    def fallback_reason(d_qk: int, d_v: int) -> str:
        """Why head dims ``d_qk/d_v`` (as the kernels see them, padded to multiples of 8) run our
        plain-Triton kernels instead of Gluon's: only pairs that passed the GPU tests run Gluon."""
        from longca_triton.kernels.gluon.config import GPU_CHECKED_HEAD_DIMS

        if (d_qk, d_v) in GPU_CHECKED_HEAD_DIMS:
            return ""
        return f"head dims {d_qk}/{d_v} have not passed the Gluon GPU tests: our plain-Triton kernels ran"

    def launch(self, q, k, v, mask, scale, return_lse, config, deterministic=False):
        if self.fallback_reason(q.shape[-1], v.shape[-1]):
            from longca_triton.kernels.dense.op import dense_attention

            return dense_attention(q, k, v, mask, softmax_scale=scale, return_lse=return_lse,
                                   deterministic=deterministic)
        return super().launch(q, k, v, mask, scale, return_lse, config, deterministic)

    def run_notes(self, problem: Problem) -> dict:
        """The launch config, and ``fallback`` where these head dims ran the plain-Triton kernels."""
        from longca_triton.kernels.core.runtime import padded_head_dim

        notes = super().run_notes(problem)
        why = self.fallback_reason(padded_head_dim(problem.head_dim), padded_head_dim(problem.d_v))
        return {**notes, "fallback": why} if why else notes

    #: every backward design writes each gradient tile once (no atomics; ``gluon_attention``'s docstring)
    honours_deterministic = True

    def plan(self, problem: Problem, q, config):
        from longca_triton.kernels.core.runtime import config_head_dim, padded_head_dim
        from longca_triton.kernels.dense.op import plans_for
        from longca_triton.kernels.dense.op import resolve_config as dense_cfg
        from longca_triton.kernels.gluon.config import resolve_config
        from longca_triton.kernels.gluon.op import plans_for_gluon

        d, dv = padded_head_dim(problem.head_dim), padded_head_dim(problem.d_v)
        if self.fallback_reason(d, dv):
            plans_for(problem.mask, dense_cfg(config_head_dim(d, dv), problem.dtype, mask=problem.mask), q.device)
            return
        # with the mask: its mask-dependent defaults (consumers, mask_head / split plans, the dense
        # dK/dV tile) are the ones the call will use
        plans_for_gluon(problem.mask, d, resolve_config(d, problem.dtype, config, head_dim_v=dv, mask=problem.mask),
                        dense_cfg(config_head_dim(d, dv), problem.dtype, mask=problem.mask), q.device)


register(TritonGluon())

"""Our warp-specialized Gluon kernels (``longca_triton/kernels/gluon/``) as the ``triton-gluon`` backend.

Forward and backward are Gluon (FlashAttention-3's design on sm_90: TMA producer warp,
consumer warpgroups with async wgmma; the backward as separate dQ and dK/dV kernels). By default the
backward is the Gluon dQ kernel with our plain-Triton dK/dV kernel at D = 128 (``bwd_design="mixed"``,
the two on two CUDA streams) and our plain-Triton backward elsewhere (``"plain"``), each measured
fastest there (``kernels/tuning/gluon.toml``). It runs on sm_90 only: elsewhere (other GPUs, the CPU
interpreter) every case is ``unsupported`` with the reason, never a crash.
Head dims: the kernels take every one our plain-Triton kernels take (multiples of 8 up to 256, D_v
may differ from D_qk; the Gluon backward only at 64 and 128 with D_v == D_qk, other dims run the
plain-Triton one), but this backend offers only the pairs checked on a GPU
(``GPU_CHECKED_HEAD_DIMS``); the others answer ``unsupported`` with that reason.
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
        # head dims: the base class's check (multiples of 8 up to 256, D_v may differ), then only
        # the pairs a GPU has checked (the kernels compile for all of them)
        from longca_triton.kernels.gluon.config import GPU_CHECKED_HEAD_DIMS, device_reason

        dims = (problem.head_dim, problem.d_v)
        if dims not in GPU_CHECKED_HEAD_DIMS:
            return False, (f"head dims {dims[0]}/{dims[1]}: the Gluon forward compiles for them but has not "
                           f"yet passed its GPU tests (checked: {', '.join(f'{a}/{b}' for a, b in GPU_CHECKED_HEAD_DIMS)}); "
                           "use triton")
        why = device_reason(torch.device("cuda"))
        return (not why), why

    #: every backward design writes each gradient tile once (no atomics; ``gluon_attention``'s docstring)
    honours_deterministic = True

    def plan(self, problem: Problem, q, config):
        from longca_triton.kernels.core.runtime import config_head_dim
        from longca_triton.kernels.dense.op import resolve_config as dense_cfg
        from longca_triton.kernels.gluon.config import resolve_config
        from longca_triton.kernels.gluon.op import plans_for_gluon

        d, dv = problem.head_dim, problem.d_v
        # with the mask: its mask-dependent defaults (consumers, mask_head / split plans, the dense
        # dK/dV tile) are the ones the call will use
        plans_for_gluon(problem.mask, d, resolve_config(d, problem.dtype, config, head_dim_v=dv, mask=problem.mask),
                        dense_cfg(config_head_dim(d, dv), problem.dtype, mask=problem.mask), q.device)


register(TritonGluon())

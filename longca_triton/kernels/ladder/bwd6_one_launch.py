r"""Backward step 6 — one launch: the dK/dV and dQ program sets of step 5 in one grid.

The one idea
------------
FlexAttention's Triton backward is one kernel: a dK/dV program set and a dQ program set over the
same block tables, launched together. Step 5 launches them as two kernels, so the dQ kernel
starts only when the last dK/dV program has finished: the tail of the first launch (a few
heavy key tiles still running while most SMs idle) is paid in full, plus a launch. Here the
two sets are programs ``[0, n_dkdv)`` and ``[n_dkdv, n_dkdv + n_dq)`` of one grid
(``one_launch_kernel``): dQ programs fill SMs as soon as dK/dV programs leave them. The bodies
(``kernels/dense/bwd.py``'s two kernels, inlined with a ``PID``), tiles, plans and order of sums are
step 5's, so the gradients are bitwise the same, still without atomics.

What it costs: one ``num_warps`` / ``num_stages`` for both sets where step 5 tunes each kernel on
its own (dK/dV 4 warps, dQ 8 at D = 128), and one register / shared-memory budget, the larger of
the two bodies'. Here the sets share the dQ kernel's 8 warps and the smaller of the two stage
counts. The ``delta`` preprocess stays a launch of its own: both sets read delta from their first
tile, and a grid has no barrier to wait for a part of itself.

Measured (H100, causal, S=16K)
------------------------------
Slower, by 8-11 % at best (``experiments/results/h100/bwd-variants/``; GQA 64:8, D=128, bf16,
S=16K): causal 30.5 ms vs step 5's 27.6 (361 vs 399 TFLOP/s), full 59.5 vs 56.9,
causal_document 8.97 vs 8.31, share_question 10.6 vs 10.2, and that only with the dQ set kept on
step 5's 64x64 tiles. What it removes (one launch, the tail between the kernels) is smaller than
what the shared budget costs, which is why the production backward keeps two kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longca_triton.kernels.core.jit import LOG2E
from longca_triton.kernels.core.runtime import bsh_strides, config_head_dim, descriptor_ready, ensure_allocator
from longca_triton.kernels.core.runtime import head_dim_meta, resolve_scale
from longca_triton.kernels.dense.bwd import dense_bwd_dkdv_kernel, dense_bwd_dq_kernel
from longca_triton.kernels.dense.op import DQ_NUM_WARPS, dense_attention, launch_bwd_preprocess, plans_for
from longca_triton.kernels.dense.op import resolve_config

from .step7_production import production_config


@triton.jit
def one_launch_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, DQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dqb, stride_dqs, stride_dqh,
    K_LO, K_HI, K_ORDER, K_FULL_PTR, K_FULL_START, K_FULL_END, K_PART_PTR, K_PART_START, K_PART_END,
    Q_LO, Q_HI, Q_ORDER, Q_FULL_PTR, Q_FULL_START, Q_FULL_END, Q_PART_PTR, Q_PART_START, Q_PART_END,
    softmax_scale, qk_scale,
    Sq, Sk, num_bkv, num_bh, num_heads_q, num_heads_kv, group_size, n_dkdv,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    DKDV_BLOCK_M: tl.constexpr, DKDV_BLOCK_N: tl.constexpr, DQ_BLOCK_M: tl.constexpr, DQ_BLOCK_N: tl.constexpr,
    K_NUM_IV: tl.constexpr, Q_NUM_IV: tl.constexpr, K_HAS_PARTIAL: tl.constexpr, Q_HAS_PARTIAL: tl.constexpr,
    SWEEP: tl.constexpr, SKEW: tl.constexpr,
):
    """Programs ``[0, n_dkdv)`` run step 5's dK/dV body (key-major plan ``K_*``), the rest its dQ body
    (query-major plan ``Q_*``)."""
    pid = tl.program_id(0)
    if pid < n_dkdv:
        dense_bwd_dkdv_kernel(
            Q, K, V, DOut, Lse, Delta, DK, DV, DQ,  # DQ and the three 0s: the never-read Unused, unused_*
            stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_db, stride_ds, stride_dh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
            0, 0, 0,
            K_LO, K_HI, K_ORDER, K_FULL_PTR, K_FULL_START, K_FULL_END, K_PART_PTR, K_PART_START, K_PART_END,
            softmax_scale, qk_scale, Sq, Sk, num_bkv, num_heads_q, num_heads_kv, group_size,
            HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, DKDV_BLOCK_M, DKDV_BLOCK_N, K_NUM_IV, K_HAS_PARTIAL, SWEEP,
            PID=pid)
    else:
        dense_bwd_dq_kernel(
            Q, K, V, DOut, Lse, Delta, DQ,
            stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_db, stride_ds, stride_dh, stride_dqb, stride_dqs, stride_dqh,
            Q_LO, Q_HI, Q_ORDER, Q_FULL_PTR, Q_FULL_START, Q_FULL_END, Q_PART_PTR, Q_PART_START, Q_PART_END,
            softmax_scale, qk_scale, Sq, Sk, num_bh, num_heads_q, group_size,
            HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, DQ_BLOCK_M, DQ_BLOCK_N, Q_NUM_IV, Q_HAS_PARTIAL, SKEW,
            PID=pid - n_dkdv)


def one_launch_bwd(dout, q, k, v, out, lse, mask, softmax_scale, cfg):
    """Preprocess, then both program sets in one launch. Returns ``dq, dk, dv`` in the inputs' dtype."""
    q, k, v, out, dout = (descriptor_ready(t) for t in (q, k, v, out, dout))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    _, kp, qp = plans_for(mask, cfg, q.device)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ensure_allocator(q.device)
    delta = launch_bwd_preprocess(out, dout)  # [B, Hq, Sq] float32
    n_dkdv, n_dq = kp.num_n * b * hkv, qp.num_m * b * hq
    one_launch_kernel[(n_dkdv + n_dq,)](
        q, k, v, dout, lse.contiguous(), delta, dk, dv, dq,
        *bsh_strides(q, k, v, dout, dk, dv, dq),
        *kp.k_tensors(), *qp.q_tensors(),
        softmax_scale, softmax_scale * LOG2E,
        sq, sk, b * hkv, b * hq, hq, hkv, hq // hkv, n_dkdv,
        **head_dim_meta(d, v.shape[3]),
        DKDV_BLOCK_M=cfg["DKDV_BLOCK_M"], DKDV_BLOCK_N=cfg["DKDV_BLOCK_N"],
        DQ_BLOCK_M=cfg["DQ_BLOCK_M"], DQ_BLOCK_N=cfg["DQ_BLOCK_N"],
        K_NUM_IV=kp.num_iv, Q_NUM_IV=qp.num_iv,
        K_HAS_PARTIAL=kp.k_part[1].numel() > 0, Q_HAS_PARTIAL=qp.q_part[1].numel() > 0,
        SWEEP=cfg["dkdv_sweep"], SKEW=cfg["dq_skew"],
        num_warps=DQ_NUM_WARPS, num_stages=min(cfg["dkdv_num_stages"], cfg["dq_num_stages"]),
    )
    return dq, dk, dv


def prepare_backward(q, k, v, mask, out=None, lse=None, softmax_scale=None):
    """As step 5: the forward runs here (untimed); returns ``fn(dout) -> (dq, dk, dv)``."""
    scale = resolve_scale(softmax_scale, q.shape[-1])
    cfg = resolve_config(config_head_dim(q.shape[-1], v.shape[-1]), q.dtype, production_config(q, k, mask),
                         q=q, k=k, v=v, mask=mask)
    out, lse = dense_attention(q, k, v, mask, softmax_scale=scale, return_lse=True, config=cfg)

    def run(dout):
        return one_launch_bwd(dout, q, k, v, out, lse, mask, scale, cfg)

    return run


def backward(q, k, v, mask, out, lse, dout, softmax_scale=None):
    """-> ``dq [B, Sq, Hq, D], dk, dv [B, Sk, Hkv, D]`` through the one-launch backward."""
    return prepare_backward(q, k, v, mask, out, lse, softmax_scale)(dout)

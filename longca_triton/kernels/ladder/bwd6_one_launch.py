r"""Backward step 6 — one launch: the dK/dV and dQ program sets of step 5 in one grid.

The one idea
------------
FlexAttention's Triton backward is one kernel: a dK/dV program set and a dQ program set over the
same block tables, launched together. Step 5 launches them as two kernels, so the dQ kernel
starts only when the last dK/dV program has finished: the tail of the first launch (a few
heavy key tiles still running while most SMs idle) is paid in full, plus a launch. Here the
two sets are programs ``[0, n_dkdv)`` and ``[n_dkdv, n_dkdv + n_dq)`` of one grid
(``dense_bwd_one_launch_kernel``, config ``one_launch=True``): dQ programs fill SMs as soon as
dK/dV programs leave them. The bodies, tiles, plans and order of sums are step 5's, so the
gradients are bitwise the same (``tests/test_backward_variants.py``), still without atomics.

What it costs: one ``num_warps`` / ``num_stages`` for both sets (``bwd_num_warps`` /
``bwd_num_stages``) where step 5 tunes each kernel on its own (dK/dV 4 warps, dQ 8 at D=128),
and one register/shared-memory budget, the larger of the two bodies'. ``bwd_order`` puts the
dK/dV set first (0, the heavier programs first), dQ first (1) or interleaves them (2).

The ``delta`` preprocess stays a launch of its own: both sets read delta from their first tile,
and a grid has no barrier to wait for a part of itself.

Measured (H100, causal, S=16K)
------------------------------
Slower, by 8-11 % at best (experiments/results/h100/bwd_variants/, 2026-11-23; GQA 64:8, D=128,
bf16, S=16K): causal 30.5 ms vs step 5's 27.6 (361 vs 399 TFLOP/s), full 59.5 vs 56.9,
causal_document 8.97 vs 8.31, share_question 10.6 vs 10.2 -- and that only with the dQ set kept
on step 5's 64x64 tiles; sharing one warps/stages setting between the sets costs 1.6-2.2x. What
it removes (one launch, the tail between the kernels) is smaller than what the shared budget
costs: step 5's dK/dV kernel runs 4 warps and its dQ kernel 8, and the merged kernel carries the
larger body's registers into every program. Block-sparse (S=32K, density 0.3): 78.0 vs 79.7 ms,
a 2 % gain within the spread. ``one_launch`` stays off by default.
Session 11 (``experiments/results/h100/ladder/bwd_session11/``): 269.3 TFLOP/s against step 5's
426.6, because step 5's causal config now carries the 64x64 row-major dK/dV sweep, and one launch
runs that body with the dQ set's 8 warps.
"""

from __future__ import annotations

import torch

from longca_triton.kernels.dense.op import dense_attention

from .step7_production import production_config


def one_launch_config(q, k, mask) -> dict:
    """Step 5's config (the autotune cache's or the defaults) with the backward in one launch."""
    return {**(production_config(q, k, mask) or {}), "one_launch": True, "fused_dq": False}


def prepare_backward(q, k, v, mask, out=None, lse=None, softmax_scale=None):
    """As step 5: the forward runs here (untimed); returns ``fn(dout) -> (dq, dk, dv)``."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        o = dense_attention(*leaves, mask, softmax_scale=softmax_scale, config=one_launch_config(q, k, mask))

    def run(dout):
        return torch.autograd.grad(o, leaves, dout, retain_graph=True)

    return run


def backward(q, k, v, mask, out, lse, dout, softmax_scale=None):
    """-> ``dq [B, Sq, Hq, D], dk, dv [B, Sk, Hkv, D]`` through the one-launch backward."""
    return prepare_backward(q, k, v, mask, out, lse, softmax_scale)(dout)

r"""Step 1 — one Triton program per query row: the scores never leave the chip.

What changed (from step 0)
--------------------------
Instead of four library kernels passing an ``Sq x Sk`` tensor through global memory, one Triton
program owns one query row ``i`` of one head and walks the keys in chunks of ``BLOCK_N``. A row's
scores only ever exist ``BLOCK_N`` at a time, in registers. Softmax needs the row's maximum and
sum before any probability is known, so the program walks the keys twice::

    pass 1, for each key chunk c:        (the "online normaliser": rescale the running sum
        s_c   = scale · q_i · K_cᵀ          whenever the running max grows)
        m_new = max(m, max(s_c));  l = l · 2^(m - m_new) + Σ 2^(s_c - m_new);  m = m_new
    pass 2, for each key chunk c:
        p_c = 2^(s_c - m) / l;     o_i += p_c V_c

All exponentials are ``exp2`` with ``log2(e)`` folded into the scale (one multiply saved per
score; the GPU's ``ex2`` instruction is what ``exp`` calls anyway). The mask is evaluated element
by element from the IR's per-row intervals (``lo[i, t] <= j < hi[i, t]``) over the *whole* row:
masked-out keys are still loaded and multiplied, then dropped.

Why it should help
------------------
Memory traffic for the scores disappears (no ``S x S`` tensor at all, ``O(S)`` memory), and the
whole computation is one launch.

Why it is still slow
--------------------
A program holds one query row, so the dot products are vector-times-matrix (``[D] x [D, BLOCK_N]``):
no tensor cores, and every K and V chunk is fetched from L2 once *per query row* — ``Sq`` times per
head, twice for K. The next step fixes exactly that.

Measured (H100, causal, S=16K)
------------------------------
1.9 TFLOP/s (2,297 ms, median of 3): 0.08× step 0, i.e. twelve times *slower* than the PyTorch
formula; 0.3% of sdpa-cudnn; peak 256 MiB above the inputs (just the output) against step 0's
4,368 MiB.
(B=1, Hq:Hkv=64:8, D=128, bf16; H100 80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0;
``experiments/results/h100/ladder/ladder.md``, chart ``ladder_fwd.png`` next to it.)

Why it is slower than step 0. Step 0 spends its FLOPs in cuBLAS matmuls on tensor cores and loses
time only to the ``S x S`` traffic between them. This kernel does every multiply on CUDA cores in
fp32 (``tl.sum(q[None, :] * k, 1)``), and every K/V element it loads feeds exactly one multiply-add
of one row: a (row, head) program loads all of K in pass 1 and all of K and V in pass 2 (12 MiB at
``Sk = 16K, D = 128``), and there are 16,384 x 64 = 1,048,576 programs. That is about 13 TB moved
into the SMs (mostly from L2: the programs in flight share one KV head's 8 MiB of K and V), about
5.7 TB/s over the 2.3 s, for 1.3e13 executed FLOPs (6·Sq·Sk·D·Hq, about 5.7 TFLOP/s of fp32 work):
one FLOP per byte, so the kernel waits on loads, far below the tensor-core and even the CUDA-core
peak. On top of that it visits every key of every row (the causal upper half is computed, then
dropped) and computes ``q·Kᵀ`` twice.

Why it is still worth learning. It is the smallest fused attention kernel: the scores never touch
HBM (``O(S)`` memory, 17x less peak than step 0 here), and it introduces what every later step
keeps unchanged: the online normaliser (running max, running sum rescaled by ``2^(m_old - m_new)``),
``exp2`` with ``log2(e)`` folded into the scale, the element mask from per-row intervals, and the
guards for rows that allow nothing. And it isolates the lesson of step 2: fusion alone does not make
attention fast, reuse of every loaded tile on tensor cores does (52.7x with the same two passes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LOG2E, check_shapes, row_interval_arrays, softmax_scale_or_default


@triton.jit
def _row_allowed(offs_n, LO, HI, row, NUM_IV: tl.constexpr):
    """``allowed[j]`` for one row over the keys ``offs_n`` (the intervals, unrolled)."""
    allowed = offs_n < 0  # all False, [BLOCK_N]
    for t in tl.static_range(NUM_IV):
        lo = tl.load(LO + row * NUM_IV + t)
        hi = tl.load(HI + row * NUM_IV + t)
        allowed = allowed | ((offs_n >= lo) & (offs_n < hi))
    return allowed


@triton.jit
def row_program_fwd_kernel(
    Q, K, V, Out, LO, HI,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_ob, stride_os, stride_oh,
    qk_scale,  # softmax_scale * log2(e)
    Sk, num_heads_q, group_size,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, NUM_IV: tl.constexpr,
):
    row = tl.program_id(0)  # query row i
    bh = tl.program_id(1)  # batch * Hq + head
    b = (bh // num_heads_q).to(tl.int64)
    h = bh % num_heads_q
    h_kv = h // group_size  # GQA: query head h reads KV head h // G
    offs_d = tl.arange(0, HEAD_DIM)

    q = tl.load(Q + b * stride_qb + row * stride_qs + h * stride_qh + offs_d).to(tl.float32)  # [D]
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_kb + h_kv * stride_kh  # v has k's strides (checked by the launcher)

    # ---- pass 1: row max m and row sum l (log2 domain), rescaling l when m grows
    m = float("-inf")
    l = 0.0
    for start_n in range(0, Sk, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :],
                    mask=offs_n[:, None] < Sk, other=0.0).to(tl.float32)  # [BLOCK_N, D]
        s = tl.sum(q[None, :] * k, 1) * qk_scale  # [BLOCK_N]: D multiplies per key, no tensor core
        s = tl.where(_row_allowed(offs_n, LO, HI, row, NUM_IV), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        # why: while nothing is allowed yet m_new = -inf, and -inf - -inf = NaN; use 0 instead
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.math.exp2(m - m_safe) + tl.sum(tl.math.exp2(s - m_safe), 0)
        m = m_new

    # ---- pass 2: normalised probabilities times V
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    inv_l = tl.where(l == 0.0, 0.0, 1.0 / tl.where(l == 0.0, 1.0, l))  # empty row: zeros
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for start_n in range(0, Sk, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_range = offs_n[:, None] < Sk
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=in_range, other=0.0).to(tl.float32)
        s = tl.sum(q[None, :] * k, 1) * qk_scale  # [BLOCK_N], computed a second time
        s = tl.where(_row_allowed(offs_n, LO, HI, row, NUM_IV), s, float("-inf"))
        p = tl.math.exp2(s - m_safe) * inv_l  # [BLOCK_N]
        v = tl.load(v_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=in_range, other=0.0).to(tl.float32)
        acc += tl.sum(p[:, None] * v, 0)  # [D]
    tl.store(Out + b * stride_ob + row * stride_os + h * stride_oh + offs_d, acc.to(Out.dtype.element_ty))


def limit(batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int, head_dim: int) -> str | None:
    """Why this step is not timed at this size (``None`` when it is)."""
    pairs = batch * heads_q * seqlen_q * seqlen_k
    if pairs > 2**35:
        return (f"one program per row would take minutes here (B·Hq·Sq·Sk = 2^{pairs.bit_length() - 1}"
                " > 2^35 score pairs on CUDA cores)")
    return None


def forward(q, k, v, mask, softmax_scale=None):
    """``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``, a ``RangeMask`` -> ``out [B, Sq, Hq, D]``."""
    check_shapes(q, k, v, mask)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    scale = softmax_scale_or_default(softmax_scale, D)
    lo, hi, num_iv = row_interval_arrays(mask, q.device)
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    block_n = 64  # keys per chunk: [64, D] fits in registers next to q
    row_program_fwd_kernel[(Sq, B * Hq)](
        q, k, v, out, lo, hi,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        scale * LOG2E, Sk, Hq, Hq // Hkv,
        HEAD_DIM=D, BLOCK_N=block_n, NUM_IV=num_iv,
        num_warps=4, num_stages=1,
    )
    return out

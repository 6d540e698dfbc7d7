r"""Step 6 — Hopper's asynchronous machinery: TMA tensor descriptors, software pipelining,
warp specialization.

What changed (from step 5)
--------------------------
The math and the tiling are step 5's. What changes is *how* K and V tiles reach shared memory:

* **Tensor descriptors (TMA).** ``tl.make_tensor_descriptor(base, shape=[Sk, D], strides=[...],
  block_shape=[BLOCK_N, D])`` describes a 2-D view once; ``k_desc.load([start_n, 0])`` then becomes
  one bulk copy issued by a single thread to the Tensor Memory Accelerator, which computes the
  addresses, zero-fills rows past ``Sk`` and writes the tile to shared memory in the swizzled
  layout wgmma reads. No per-thread address arithmetic, no bounds masks (the partial loop drops
  keys past ``Sk`` through the interval mask, which never allows them).
* **Software pipelining** (``num_stages`` > 1). With step 5's ``num_stages=1`` a program waits for
  each K tile before its matmul. With ``NUM_STAGES`` buffers the compiler issues the loads of
  tile ``t + 1`` (``t + 2``, ...) before computing tile ``t``, so memory latency hides behind math.
  The price is shared memory: ``NUM_STAGES x (K + V tile)``.
* **Warp specialization** (``tl.range(..., warp_specialize=True)``). The compiler may split the
  full-tile loop into a producer warp that only issues TMA loads and consumer warp groups that
  only compute, handing tiles over through shared-memory barriers. What Triton 3.6 does with the
  request on sm_90 (seen by compiling these kernels for sm_90 ahead of time, no GPU involved):
  it specializes a kernel with *one* loop at ``num_warps=4``; at ``num_warps=8`` it ignores the
  request silently; with two loops (ours: full tiles, then partial tiles) at ``num_warps=4`` the
  pass fails. So this step asks for it on the full-tile loop, then looks for a
  ``ttg.warp_specialize`` region in the compiled IR and reports in ``STATUS`` (the ladder's notes
  column) whether it was applied — never claiming a feature that did not run.

Q and O still move with ordinary loads/stores: they are touched once per program, outside the
loop, and the packed GQA rows of step 5 are not one rectangular box.

Why it should help
------------------
Up to step 5 the tensor cores idle while each tile is loaded; overlapping loads with the two
matmuls of the previous tile is what takes a Hopper attention kernel from "fast" to "near peak".

Measured (H100, causal, S=16K)
------------------------------
459.4 TFLOP/s (9.57 ms, p20–p80 9.36–9.58): 1.28× step 5, 78% of sdpa-cudnn; peak 258 MiB above
the inputs. The notes column says "warp_specialize requested, not applied by Triton 3.6.0 at
num_warps=8": the whole gain is TMA loads plus a 3-stage pipeline (``NUM_STAGES = max(2,
num_stages)`` with the production default of 3).
(B=1, Hq:Hkv=64:8, D=128, bf16; H100 80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0;
``experiments/results/h100/ladder/ladder.md``, chart ``ladder_fwd.png`` next to it.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    LOG2E,
    check_shapes,
    interpreting,
    interval_mask,
    row_interval_arrays,
    softmax_scale_or_default,
    tile_config,
    tile_tables,
)
from .step5_gqa import packed_tile
from longca_triton.kernels.core.runtime import descriptor_ready as _descriptor_ready
from longca_triton.kernels.core.runtime import ensure_allocator as _ensure_allocator

#: what happened to warp specialization on this process's first GPU call (shown by the ladder)
STATUS = {"warp_specialize": None}


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, k_desc, v_desc, seq,
                  TILE_IDX, t_lo, t_hi, LO, HI, Sq, qk_scale,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, NUM_IV: tl.constexpr,
                  NUM_STAGES: tl.constexpr, WARP_SPEC: tl.constexpr):
    """Step 5's loop with TMA loads, pipelined over ``NUM_STAGES`` buffers."""
    for t in tl.range(t_lo, t_hi, num_stages=NUM_STAGES, warp_specialize=WARP_SPEC):
        start_n = tl.load(TILE_IDX + t) * BLOCK_N
        k = k_desc.load([start_n, 0])  # [BLOCK_N, D], one TMA bulk copy; rows >= Sk are zeros
        s = tl.dot(q, k.T) * qk_scale  # [BLOCK_M, BLOCK_N]
        if MASKED:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            s = tl.where(interval_mask(seq, offs_n, LO, HI, Sq, NUM_IV), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([start_n, 0])  # [BLOCK_N, D]
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def hopper_fwd_kernel(
    Q, K, V, Out, LO, HI,
    FULL_PTR, FULL_IDX, PART_PTR, PART_IDX,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_ob, stride_os, stride_oh,
    qk_scale,  # softmax_scale * log2(e)
    Sq, Sk, num_heads_kv,
    GROUP: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_IV: tl.constexpr,
    NUM_STAGES: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bkv = tl.program_id(1)
    b = (bkv // num_heads_kv).to(tl.int64)
    h_kv = bkv % num_heads_kv
    offs_r = tl.arange(0, BLOCK_M)
    seq = pid_m * ROWS + offs_r // GROUP  # [BLOCK_M] position of each packed row
    head = h_kv * GROUP + offs_r % GROUP  # [BLOCK_M] query head of each packed row
    row_ok = (offs_r < ROWS * GROUP) & (seq < Sq)
    offs_d = tl.arange(0, HEAD_DIM)

    # one descriptor per operand: the [Sk, D] matrix of this (batch, KV head)
    k_desc = tl.make_tensor_descriptor(K + b * stride_kb + h_kv * stride_kh, shape=[Sk, HEAD_DIM],
                                       strides=[stride_ks, 1], block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + b * stride_kb + h_kv * stride_kh, shape=[Sk, HEAD_DIM],
                                       strides=[stride_ks, 1], block_shape=[BLOCK_N, HEAD_DIM])

    q_rows = b * stride_qb + seq * stride_qs + head * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_desc, v_desc, seq,
                                  FULL_IDX, tl.load(FULL_PTR + pid_m), tl.load(FULL_PTR + pid_m + 1),
                                  LO, HI, Sq, qk_scale, BLOCK_N, False, NUM_IV, NUM_STAGES, WARP_SPEC)
    # why no warp specialization here: the partial list is a handful of tiles per program
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_desc, v_desc, seq,
                                  PART_IDX, tl.load(PART_PTR + pid_m), tl.load(PART_PTR + pid_m + 1),
                                  LO, HI, Sq, qk_scale, BLOCK_N, True, NUM_IV, NUM_STAGES, False)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = b * stride_ob + seq * stride_os + head * stride_oh
    tl.store(Out + o_rows[:, None] + offs_d[None, :], out.to(Out.dtype.element_ty), mask=row_ok[:, None])


def _want_warp_specialize(device: torch.device) -> bool:
    if interpreting() or device.type != "cuda":
        return False
    if STATUS["warp_specialize"] is not None:
        return STATUS["warp_specialize"] is True
    # checked at call time, never at import: Hopper (9.x) and Blackwell (10.x) only
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def forward(q, k, v, mask, softmax_scale=None):
    """``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``, a ``RangeMask`` -> ``out [B, Sq, Hq, D]``."""
    check_shapes(q, k, v, mask)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    q, k, v = (_descriptor_ready(t) for t in (q, k, v))
    if k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    scale = softmax_scale_or_default(softmax_scale, D)
    cfg = tile_config(D, q.dtype)
    block_m, rows = packed_tile(cfg["BLOCK_M"], G)
    bn = cfg["BLOCK_N"]
    lo, hi, num_iv = row_interval_arrays(mask, q.device)
    tables = tile_tables(mask, rows, bn, q.device)
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    _ensure_allocator(q.device)

    def launch(warp_spec: bool):
        return hopper_fwd_kernel[(tables.num_m, B * Hkv)](
            q, k, v, out, lo, hi,
            tables.q_full_ptr, tables.q_full_idx, tables.q_part_ptr, tables.q_part_idx,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            scale * LOG2E, Sq, Sk, Hkv,
            GROUP=G, ROWS=rows, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=bn, NUM_IV=num_iv,
            NUM_STAGES=1 if interpreting() else max(2, cfg["num_stages"]), WARP_SPEC=warp_spec,
            num_warps=cfg["num_warps"],
        )

    if not _want_warp_specialize(q.device):
        launch(False)
        return out
    if STATUS["warp_specialize"] is True:
        launch(True)
        return out
    # first GPU call: ask for warp specialization and look at what the compiler made of it
    try:
        compiled = launch(True)
    except Exception as e:  # a compiler that cannot specialize this kernel: say so, run without
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        STATUS["warp_specialize"] = f"off (compile failed: {type(e).__name__}: {first[:120]})"
        launch(False)
        return out
    ttgir = getattr(compiled, "asm", {}).get("ttgir", "")
    if "ttg.warp_specialize(" in ttgir:
        STATUS["warp_specialize"] = True
    else:
        # the request compiled but was ignored (see the docstring); run the plain kernel from now on
        STATUS["warp_specialize"] = f"requested, not applied by Triton {triton.__version__} at num_warps={cfg['num_warps']}"
    return out


def notes() -> str:
    """One line for the ladder table: whether warp specialization ran."""
    ws = STATUS["warp_specialize"]
    if ws is None:
        return ""
    return "warp_specialize on" if ws is True else f"warp_specialize {ws}"

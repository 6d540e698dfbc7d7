r"""Backward in one key-major kernel (FlashAttention-3's design): dK, dV in registers, dQ by atomics.

Math as in ``attention_bwd.py`` (log2 domain, ``delta = rowsum(dO * O) - dlse``)::

    p_ij  = exp2(s_ij * qk_scale - lse2_i)     ds_ij = p_ij * (dO_i . v_j - delta_i)
    dV_j  = sum_i p_ij dO_i                      dK_j = softmax_scale * sum_i ds_ij q_i
    dQ_i  = softmax_scale * sum_j ds_ij k_j      (sum_j ds_ij k_j added into an fp32 ``dq_accum``
                                                  by atomics; the cast kernel scales and converts)

Why: the split design (``attention_bwd.py``) issues 7 GEMMs per (query tile, key tile) pair,
this one 5 (``S^T``, ``dP^T``, ``dV += P^T dO``, ``dK += dS^T Q``, ``dQ^T = K^T dS^T``), at the
price of ``BLOCK_MQ x D`` fp32 atomic adds per pair (Gluon 3.6 has no TMA reduce on Hopper, so
they are ``gl.atomic_add(sem="relaxed")`` from the wgmma accumulator's registers: scalar
``atom.global.gpu.relaxed.add.f32`` in the PTX, result unused; Triton emits no ``.v2`` / ``.v4``
form) and a final ``dq_accum -> dQ`` cast. Not measured on a GPU yet: whether these atomics
(and the CTAs of one KV head adding into the same query tiles at once) cost more than the two
GEMMs saved is what the next H100 run answers (``experiments/gpu/gluon_diag.py --bwd-configs``).

Tiling: one CTA = a 128-row key tile of one KV head, like ``gluon_bwd_dkdv_kernel``: two consumer
warpgroups of 64 keys each hold their ``dK, dV [64, D]`` fp32 in registers across every query
tile (``BLOCK_MQ`` rows) of every query head of the group (one ``[Sq, G*D]`` view of Q and dO);
a producer warp TMA-loads ``Q_i, dO_i`` into a ring of ``NUM_STAGES`` (ready / empty mbarriers).

Per query tile, warpgroup ``w`` (keys ``64w .. 64w+63`` of the tile)::

    S^T, dP^T = K_w Q_i^T, V_w dO_i^T              # [64, BLOCK_MQ], async wgmma, waited
    P^T, dS^T  (masked by _interval_mask_t on partial tiles)
    dS^T -> ds_smem[j % 2][w]  (bf16), fence, arrive ds_ready[j % 2]
    dV += P^T dO_i   (P^T from registers)    dK += dS^T Q_i   (dS^T from shared)
    dQ^T = K^T dS^T                                 # the dQ contribution, see DQ_SPLIT_D
    wait; release Q_i, dO_i; atomically add dQ^T into dq_accum

``dq_accum`` is ``[B * Hq, ceil(Sq / BLOCK_MQ), D, BLOCK_MQ]`` fp32: each query tile's dQ^T is one
contiguous block, so a thread's atomics are its base address plus constants (no per-element
64-bit pointers in registers, no row mask; ``dq_accum_cast_kernel`` drops the padding rows).

``DQ_SPLIT_D`` (D = 128): the warpgroups split dQ^T's *head-dim rows*: warpgroup ``w`` computes
``dQ^T[64w : 64w+64, :] = sum_{w'} K_{w'}[:, 64w : 64w+64]^T dS^T_{w'}`` over all 128 keys, which
needs the other warpgroup's dS^T: ``ds_ready`` (count 2) completes when both are in shared
memory. Two dS buffers suffice: a warpgroup writes buffer ``b`` again at step ``j + 2`` only after
passing ``ds_ready`` of step ``j + 1``, i.e. after the other one finished step ``j`` (and its
reads of ``b``). Each dQ element gets one atomic per key tile. Otherwise (D = 64, where a 32-row
split is below wgmma's 64-row minimum) each warpgroup adds its own 64 keys' partial ``K_w^T dS^T_w``
(``[D, BLOCK_MQ]``): no cross-warpgroup wait, two atomics per element.

Registers (ptxas, sm_90a, 240 per consumer thread, masked variant): 0 B of spills at D = 128 with
BLOCK_MQ = 32 (also with 232 registers) and at D = 64 with BLOCK_MQ = 32 or 64; D = 128 with
BLOCK_MQ = 64 spills ~330 B (dK, dV alone are 128 registers per thread), with a 3-stage ring 44 B. The schedule is the simple one (no skew: a tile's
S^T, dP^T wait for nothing of the previous tile's); the two warpgroups overlap each other.

Masking walks the key-major merged run lists of ``plan.py`` exactly as the dK/dV kernel does
(``_advance_wrap``: next query head of the group after the last run). Query rows >= Sq are
zero-filled by TMA (zero dO, zero delta: nothing contributes; their atomics add 0 into the
padding); dK / dV stores are clipped at Sk by the descriptors.
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .attention_bwd import (
    _advance_wrap,
    _dkdv_producer,
    _ds,
    _interval_mask_t,
    _key_major_buffers,
    _key_major_descs,
    _key_major_program,
    _row_stats,
)
from .attention_fwd import M_WG

__all__ = ["gluon_bwd_fused_kernel", "dq_accum_cast_kernel"]


@gluon.jit
def _dq_atomic_add(dq_t, tile, d0, dq_layout: gl.constexpr, ROWS: gl.constexpr,
                   BLOCK_MQ: gl.constexpr):
    """``tile[d0 + r, c] += dq_t[r, c]``: ``tile`` is one query tile's ``[D, BLOCK_MQ]`` fp32 block
    of ``dq_accum`` (dQ^T, tile-contiguous), so every element's address is the thread's base plus a
    constant: no 64-bit pointer per element in registers, no mask (``dq_accum`` is padded to whole
    tiles; the cast kernel drops rows >= Sq)."""
    offs_d = d0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, dq_layout))  # [ROWS]
    offs_q = gl.arange(0, BLOCK_MQ, layout=gl.SliceLayout(0, dq_layout))  # [BLOCK_MQ]
    ptrs = tile + gl.expand_dims(offs_d, 1) * BLOCK_MQ + gl.expand_dims(offs_q, 0)  # [ROWS, BLOCK_MQ]
    # relaxed: only the sum matters, no ordering against other memory operations
    gl.atomic_add(ptrs, dq_t, sem="relaxed")


@gluon.jit
def _step_math(s_t, dp_t, g, m, offs_k, partial, Lse, Delta, LO, HI, lse_base, qk_scale, Sq,
               t_layout: gl.constexpr, BLOCK_MQ: gl.constexpr, NUM_IV: gl.constexpr,
               HAS_PARTIAL_TILES: gl.constexpr):
    """``(P^T, dS^T)`` of query tile ``m`` of group head ``g``: ``_dkdv_step_math`` with the mask
    applied before the row statistics are loaded (fewer live registers; ptxas, masked variant,
    spills at D = 128, BLOCK_MQ = 32: 68 -> 0 B)."""
    offs_q = m * BLOCK_MQ + gl.arange(0, BLOCK_MQ, layout=gl.SliceLayout(0, t_layout))
    if HAS_PARTIAL_TILES:
        if partial:
            s_t = _interval_mask_t(s_t, offs_k, offs_q, LO, HI, Sq, NUM_IV)
    base = (lse_base + g).to(gl.int64) * Sq
    lse2, delta = _row_stats(Lse + base, Delta + base, offs_q, Sq)
    return _ds(s_t * qk_scale, dp_t, gl.expand_dims(lse2, 0), gl.expand_dims(delta, 0))


@gluon.jit
def _fused_consumer(WG: gl.constexpr, k_smem, v_smem, q_smem, do_smem, ds_smem, bars, dk_desc,
                    dv_desc, DQA, num_tiles_q, Lse, Delta, LO, HI, RUN_START, RUN_END, plan,
                    qk_scale, softmax_scale, Sq, HEAD_DIM: gl.constexpr, BLOCK_MQ: gl.constexpr,
                    NUM_IV: gl.constexpr, NUM_STAGES: gl.constexpr,
                    HAS_PARTIAL_TILES: gl.constexpr, DQ_SPLIT_D: gl.constexpr):
    kv_bar, in_ready, in_empty, ds_ready = bars
    start_n, lse_base, r0, r_end, num_full, num_steps = plan
    dtype: gl.constexpr = k_smem.dtype
    # S^T, dP^T: [64 keys, BLOCK_MQ queries]; dK, dV: [64 keys, D]
    t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_MQ, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    # dQ^T of this warpgroup: [DQ_ROWS head-dim rows, BLOCK_MQ queries]
    DQ_ROWS: gl.constexpr = HEAD_DIM // 2 if DQ_SPLIT_D else HEAD_DIM
    dq_layout: gl.constexpr = t_layout

    key0 = start_n + WG * M_WG
    offs_k = key0 + gl.arange(0, M_WG, layout=gl.SliceLayout(1, t_layout))
    t_zero = gl.zeros([M_WG, BLOCK_MQ], gl.float32, t_layout)
    dq_zero = gl.zeros([DQ_ROWS, BLOCK_MQ], gl.float32, dq_layout)
    dk = gl.zeros([M_WG, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([M_WG, HEAD_DIM], gl.float32, acc_layout)
    k = k_smem.index(WG)
    v = v_smem.index(WG)
    mbarrier.wait(kv_bar, 0)

    r = r0
    m = gl.load(RUN_START + r)
    e = gl.load(RUN_END + r)
    g = 0
    for j in range(num_steps):
        st = j % NUM_STAGES
        mbarrier.wait(in_ready.index(st), (j // NUM_STAGES) & 1)
        q_t = q_smem.index(st)
        do_t = do_smem.index(st)
        s_t = warpgroup_mma(k, q_t.permute((1, 0)), t_zero, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v, do_t.permute((1, 0)), t_zero, use_acc=False, is_async=True)
        s_t, dp_t = warpgroup_mma_wait(0, deps=(s_t, dp_t))
        p_t, ds_t = _step_math(s_t, dp_t, g, m, offs_k, r >= r0 + num_full, Lse, Delta, LO, HI,
                               lse_base, qk_scale, Sq, t_layout, BLOCK_MQ, NUM_IV, HAS_PARTIAL_TILES)
        # dS^T goes through shared memory: the A operand of dK and the B operand of dQ^T
        buf = j % 2
        ds_own = ds_smem.index(2 * buf + WG)  # [64 keys, BLOCK_MQ]
        ds_own.store(ds_t.to(dtype))
        fence_async_shared()
        # every thread's dS^T is in shared memory (and visible to wgmma) before this warpgroup's
        # GEMMs read it and before its one arrival on ds_ready
        gl.thread_barrier()
        if DQ_SPLIT_D:
            mbarrier.arrive(ds_ready.index(buf))
        dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), op_layout), do_t, dv, is_async=True)
        dk = warpgroup_mma(ds_own, q_t, dk, is_async=True)
        if DQ_SPLIT_D:
            mbarrier.wait(ds_ready.index(buf), (j // 2) & 1)
            # head-dim rows 64*WG.. of dQ^T over all 128 keys: K_w'^T slice [64 d, 64 keys] (A,
            # MN-major from shared) times dS^T_w' [64 keys, BLOCK_MQ] (B), for both key halves
            dq_t = warpgroup_mma(k_smem.index(0).slice(WG * DQ_ROWS, DQ_ROWS, dim=1).permute((1, 0)),
                                 ds_smem.index(2 * buf), dq_zero, use_acc=False, is_async=True)
            dq_t = warpgroup_mma(k_smem.index(1).slice(WG * DQ_ROWS, DQ_ROWS, dim=1).permute((1, 0)),
                                 ds_smem.index(2 * buf + 1), dq_t, is_async=True)
        else:
            # this warpgroup's 64 keys only: K_w^T [D, 64 keys] times dS^T_w
            dq_t = warpgroup_mma(k.permute((1, 0)), ds_own, dq_zero, use_acc=False, is_async=True)
        dv, dk, dq_t = warpgroup_mma_wait(0, deps=(dv, dk, dq_t))
        mbarrier.arrive(in_empty.index(st))
        # dq_accum [B * Hq, num_tiles_q, D, BLOCK_MQ]: (b, query head) is lse_base + g
        tile = DQA + ((lse_base + g).to(gl.int64) * num_tiles_q + m) * (HEAD_DIM * BLOCK_MQ)
        _dq_atomic_add(dq_t, tile, WG * DQ_ROWS if DQ_SPLIT_D else 0, dq_layout, DQ_ROWS, BLOCK_MQ)
        r, m, e, g = _advance_wrap(r, m, e, g, r0, r_end, RUN_START, RUN_END)

    # K and V are no longer read: their buffers stage dK and dV for TMA stores (clipped at Sk).
    # Why the barrier: with DQ_SPLIT_D the other warpgroup's last dQ^T GEMM reads this K half
    if DQ_SPLIT_D:
        mbarrier.arrive(ds_ready.index(num_steps % 2))
        mbarrier.wait(ds_ready.index(num_steps % 2), (num_steps // 2) & 1)
    k.store((dk * softmax_scale).to(dtype))
    v.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [key0, 0], k)
    tma.async_copy_shared_to_global(dv_desc, [key0, 0], v)
    tma.store_wait(0)


@gluon.jit
def gluon_bwd_fused_kernel(
    Q, K, V, DO, DK, DV, DQA, Lse, Delta,
    stride_qb, stride_qs, stride_dob, stride_dos,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    LO, HI, ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT, RUN_START, RUN_END,
    qk_scale, softmax_scale,
    Sq, Sk, num_bkv, num_heads_q, num_heads_kv, group_size,
    HEAD_DIM: gl.constexpr, BLOCK_MQ: gl.constexpr, NUM_IV: gl.constexpr,
    NUM_STAGES: gl.constexpr, HAS_PARTIAL_TILES: gl.constexpr, DQ_SPLIT_D: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    b, h_kv, plan = _key_major_program(ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT, num_bkv, num_heads_q,
                                       num_heads_kv, group_size)
    q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc = _key_major_descs(
        Q, K, V, DO, DK, DV, stride_qb, stride_qs, stride_dob, stride_dos, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
        b, h_kv, group_size, Sq, Sk, HEAD_DIM, BLOCK_MQ)
    # the dK/dV kernel's buffers, plus dS^T of (step parity, warpgroup) for the dQ GEMM:
    # [2 * 2, 64 keys, BLOCK_MQ], and one ds_ready barrier per step parity (both consumers arrive)
    dtype: gl.constexpr = Q.dtype.element_ty
    k_smem, v_smem, q_smem, do_smem, kv_bar, in_ready, in_empty = _key_major_buffers(
        dtype, HEAD_DIM, BLOCK_MQ, NUM_STAGES)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M_WG, BLOCK_MQ], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [4, M_WG, BLOCK_MQ], ds_layout)
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
    bars = (kv_bar, in_ready, in_empty, ds_ready)
    num_tiles_q = (Sq + BLOCK_MQ - 1) // BLOCK_MQ

    gl.warp_specialize([
        (_fused_consumer, (0, k_smem, v_smem, q_smem, do_smem, ds_smem, bars, dk_desc, dv_desc, DQA,
                           num_tiles_q, Lse, Delta, LO, HI, RUN_START, RUN_END, plan, qk_scale,
                           softmax_scale, Sq, HEAD_DIM, BLOCK_MQ, NUM_IV, NUM_STAGES,
                           HAS_PARTIAL_TILES, DQ_SPLIT_D)),
        (_fused_consumer, (1, k_smem, v_smem, q_smem, do_smem, ds_smem, bars, dk_desc, dv_desc, DQA,
                           num_tiles_q, Lse, Delta, LO, HI, RUN_START, RUN_END, plan, qk_scale,
                           softmax_scale, Sq, HEAD_DIM, BLOCK_MQ, NUM_IV, NUM_STAGES,
                           HAS_PARTIAL_TILES, DQ_SPLIT_D)),
        (_dkdv_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem,
                          (kv_bar, in_ready, in_empty), RUN_START, RUN_END, plan, HEAD_DIM,
                          BLOCK_MQ, NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@triton.jit
def dq_accum_cast_kernel(DQA, DQ, stride_dqb, stride_dqs, stride_dqh, softmax_scale, Sq, num_heads_q,
                         num_tiles_q, HEAD_DIM: tl.constexpr, BLOCK_MQ: tl.constexpr):
    """``dQ[b, i, h, :] = softmax_scale * dq_accum`` in dQ's dtype: one program per (query tile,
    b * Hq + h), reading the tile's ``[D, BLOCK_MQ]`` fp32 block (plain Triton: it runs in the
    interpreter too). Rows >= Sq of the padded last tile are dropped."""
    m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // num_heads_q
    h = bh % num_heads_q
    offs_q = tl.arange(0, BLOCK_MQ)
    offs_d = tl.arange(0, HEAD_DIM)
    tile = DQA + (bh.to(tl.int64) * num_tiles_q + m) * (HEAD_DIM * BLOCK_MQ)
    acc = tl.load(tile + offs_d[None, :] * BLOCK_MQ + offs_q[:, None])  # [BLOCK_MQ, D]
    rows = m * BLOCK_MQ + offs_q
    ptrs = DQ + b.to(tl.int64) * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqs + offs_d[None, :]
    tl.store(ptrs, (acc * softmax_scale).to(DQ.dtype.element_ty), mask=rows[:, None] < Sq)

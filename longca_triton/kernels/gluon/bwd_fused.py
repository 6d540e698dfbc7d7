r"""Backward in one key-major kernel (FlashAttention-3's design): dK, dV in registers, dQ by atomics.

Math as in ``attention_bwd.py`` (log2 domain, ``delta = rowsum(dO * O) - dlse``)::

    p_ij  = exp2(s_ij * qk_scale - lse2_i)     ds_ij = p_ij * (dO_i . v_j - delta_i)
    dV_j  = sum_i p_ij dO_i                      dK_j = softmax_scale * sum_i ds_ij q_i
    dQ_i  = softmax_scale * sum_j ds_ij k_j      (sum_j ds_ij k_j added into an fp32 ``dq_accum``
                                                  by atomics; the cast kernel scales and converts)

Why: the split design (``attention_bwd.py``) issues 7 GEMMs per (query tile, key tile) pair,
this one 5 (``S^T``, ``dP^T``, ``dV += P^T dO``, ``dK += dS^T Q``, ``dQ^T = K^T dS^T``), at the
price of ``BLOCK_MQ x D`` fp32 atomic adds per pair (Gluon 3.6 has no TMA reduce on Hopper) and a
final ``dq_accum -> dQ`` cast. Measured on the H100 (experiments/results/h100/gluon/run2, 16K,
GQA 64:8, D = 128) it is 1.34x (full) and 1.65x (causal) *slower* than split; why, from the
sm_90a SASS of one loop iteration: ``experiments/results/cpu-aot/gluon_fused_bwd.md``.

Three dQ paths (config ``fused_dq``; two kernels, one prologue ``_fused_setup``):

* ``"atomic"`` (default): ``gl.atomic_add(sem="relaxed")`` straight from the dQ^T accumulator's
  registers after the step's last wgmma wait, by the MMA warpgroups themselves. In a real launch
  (``dq_accum`` specialised 16-byte aligned) that is ``atom.global.gpu.relaxed.add.v2.f32``, 8 per
  thread per tile at D = 128 (SASS ``ATOMG.E.ADD.F32x2``; one warp instruction covers 8 rows of 32 B:
  8 cache lines), and the next tile's GEMMs wait for them to leave the registers.
* ``"writer"``: the MMA warpgroups store their dQ^T partial (fp32) into a double-buffered shared
  staging buffer while their dK GEMM still runs, and a 2-warp writer partition adds it into
  ``dq_accum`` with coalesced ``v4`` atomics (``ATOMG.E.ADD.F32x4``, 4 cache lines per warp
  instruction: a quarter of the L2 requests); at D = 64 it also sums the two warpgroups' partials
  first (half the atomics). ``gluon_bwd_fused_writer_kernel``: ``_fused_consumer_staged``,
  ``_dq_writer``.
* ``"writer_keys"``: the writer kernel with ``DQ_SPLIT_D`` off at D = 128 too: each warpgroup
  stages its own keys' ``[128, BLOCK_MQ]`` partial (twice the staging traffic, 16 more registers)
  and the writer sums the two, so the warpgroups never wait for each other's dS^T (no ``ds_ready``
  in the loop) and can drift apart as the split dK/dV kernel's do.

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
    wait; release Q_i, dO_i; add dQ^T into dq_accum (atomics here, or the writer partition's)

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
(``[D, BLOCK_MQ]``): no cross-warpgroup wait, two atomics per element (one with the writer).

Registers (ptxas, sm_90a, 240 per consumer thread, masked variant): 0 B of spills at D = 128 with
BLOCK_MQ = 32 (also with 232 registers) and at D = 64 with BLOCK_MQ = 32 or 64; D = 128 with
BLOCK_MQ = 64 spills 250-380 B (dK, dV alone are 128 registers per thread); with the writer (232
consumer / 40 writer registers) at most 40 B, none in the consumers' loops (one 4-B reload in the
writer's loop at D = 64 and with ``writer_keys``; ``gluon_fused_bwd.md``), and BLOCK_MQ = 64 at
D = 128 still spills. The schedule is the simple one (no skew: a tile's S^T, dP^T wait for nothing of the
previous tile's; carrying an in-flight dK wgmma across the loop's back edge makes ptxas serialise
every wgmma, C7515, as tried for the writer's consumers). At D = 128 (but with ``writer_keys``) the
two warpgroups meet at ``ds_ready`` once per tile (each needs the other's dS^T for its dQ^T rows),
so they run in step rather than overlapping each other's softmax (the split dK/dV kernel's do).

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
    warpgroup_mma,
    warpgroup_mma_wait,
)

from longca_triton.kernels.gluon.bwd import (
    _advance_wrap,
    _dkdv_producer,
    _ds,
    _interval_mask_t,
    _key_major_buffers,
    _key_major_consumer_start,
    _key_major_descs,
    _key_major_layouts,
    _key_major_program,
    _row_stats,
    _run_cursor,
    _store_dkdv,
)
from longca_triton.kernels.gluon.fwd import M_WG

__all__ = ["DQ_WRITER_WARPS", "dq_accum_cast_kernel", "gluon_bwd_fused_kernel",
           "gluon_bwd_fused_writer_kernel"]

#: warps of the dQ-writer partition (``fused_dq="writer"``): it shares the third warpgroup with the
#: one-warp TMA producer (4 + 4 + 1 + 2 = 11 of 12 warps) and gets the producer's registers
DQ_WRITER_WARPS = gl.constexpr(2)


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
def _fused_consumer_start(WG: gl.constexpr, k_smem, v_smem, kv_bar, plan, RUN_START, RUN_END,
                          t_layout: gl.constexpr, acc_layout: gl.constexpr, HEAD_DIM: gl.constexpr,
                          BLOCK_MQ: gl.constexpr, DQ_ROWS: gl.constexpr):
    """Both fused consumers' prologue: ``_key_major_consumer_start``, the zero dQ^T accumulator
    ``[DQ_ROWS head-dim rows, BLOCK_MQ queries]`` (S^T's layout) and the run cursor ``(r, m, e, g)``."""
    key0, offs_k, t_zero, dk, dv, k, v = _key_major_consumer_start(WG, k_smem, v_smem, kv_bar, plan[0], t_layout,
                                                                   acc_layout, HEAD_DIM, BLOCK_MQ)
    dq_zero = gl.zeros([DQ_ROWS, BLOCK_MQ], gl.float32, t_layout)
    r, m, e, g = _run_cursor(plan[2], RUN_START, RUN_END)
    return key0, offs_k, t_zero, dq_zero, dk, dv, k, v, r, m, e, g


@gluon.jit
def _fused_consumer_end(dk, dv, k, v, dk_desc, dv_desc, key0, softmax_scale, ds_ready, num_steps,
                        DQ_SPLIT_D: gl.constexpr):
    """Both fused consumers' epilogue: K and V are no longer read, so their buffers stage dK and dV
    (``_store_dkdv``). Why the barrier: with DQ_SPLIT_D the other warpgroup's last dQ^T GEMM reads
    this K half."""
    if DQ_SPLIT_D:
        mbarrier.arrive(ds_ready.index(num_steps % 2))
        mbarrier.wait(ds_ready.index(num_steps % 2), (num_steps // 2) & 1)
    _store_dkdv(dk, dv, k, v, dk_desc, dv_desc, key0, softmax_scale)


@gluon.jit
def _fused_consumer(WG: gl.constexpr, k_smem, v_smem, q_smem, do_smem, ds_smem, bars, dk_desc,
                    dv_desc, DQA, num_tiles_q, Lse, Delta, LO, HI, RUN_START, RUN_END, plan,
                    qk_scale, softmax_scale, Sq, HEAD_DIM: gl.constexpr, BLOCK_MQ: gl.constexpr,
                    NUM_IV: gl.constexpr, NUM_STAGES: gl.constexpr,
                    HAS_PARTIAL_TILES: gl.constexpr, DQ_SPLIT_D: gl.constexpr):
    kv_bar, in_ready, in_empty, ds_ready = bars
    start_n, lse_base, r0, r_end, num_full, num_steps = plan
    dtype: gl.constexpr = k_smem.dtype
    t_layout: gl.constexpr = _key_major_layouts(BLOCK_MQ, HEAD_DIM)[0]
    acc_layout: gl.constexpr = _key_major_layouts(BLOCK_MQ, HEAD_DIM)[1]
    op_layout: gl.constexpr = _key_major_layouts(BLOCK_MQ, HEAD_DIM)[2]
    # dQ^T of this warpgroup: [DQ_ROWS head-dim rows, BLOCK_MQ queries]
    DQ_ROWS: gl.constexpr = HEAD_DIM // 2 if DQ_SPLIT_D else HEAD_DIM
    dq_layout: gl.constexpr = t_layout
    key0, offs_k, t_zero, dq_zero, dk, dv, k, v, r, m, e, g = _fused_consumer_start(
        WG, k_smem, v_smem, kv_bar, plan, RUN_START, RUN_END, t_layout, acc_layout, HEAD_DIM, BLOCK_MQ, DQ_ROWS)
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

    _fused_consumer_end(dk, dv, k, v, dk_desc, dv_desc, key0, softmax_scale, ds_ready, num_steps, DQ_SPLIT_D)


# ----------------------------------------------------------------------------------------------
# fused_dq="writer": dQ^T staged in shared memory, added into dq_accum by a writer partition
# ----------------------------------------------------------------------------------------------

@gluon.jit
def _fused_consumer_staged(WG: gl.constexpr, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_tiles, tile_smem,
                           bars, dk_desc, dv_desc, num_tiles_q, Lse, Delta, LO, HI, RUN_START, RUN_END,
                           plan, qk_scale, softmax_scale, Sq, HEAD_DIM: gl.constexpr, BLOCK_MQ: gl.constexpr,
                           NUM_IV: gl.constexpr, NUM_STAGES: gl.constexpr,
                           HAS_PARTIAL_TILES: gl.constexpr, DQ_SPLIT_D: gl.constexpr):
    """``_fused_consumer`` with the dQ^T partial handed to the writer partition through shared
    memory instead of added by atomics from registers, and more of the warpgroup's non-GEMM work
    done while one of its GEMMs runs. Per query tile ``j`` (buffers ``b = j % 2``)::

        load lse_j, delta_j;  issue S^T_j, dP^T_j            # the loads' latency behind the GEMMs
        wait(1): S^T_j -> P^T_j  (dP^T_j running);  wait(0): dP^T_j -> dS^T_j
        dS^T_j -> ds_smem[b][w], arrive ds_ready[b]
        issue dV += P^T_j dO_j;  (wait ds_ready[b];)  issue dQ^T_j;  issue dK += dS^T_j Q_j
        wait(1): dV, dQ^T_j done  (dK running);  wait dq_empty[b]
        dQ^T_j -> dq_smem[b][w] (fp32), arrive dq_full[b];  wait(0): dK;  release Q_j, dO_j

    versus ``_fused_consumer``: one wait for S^T and dP^T together, dQ^T issued last and waited
    with everything, then the atomics with no GEMM in flight. Every wgmma is waited within its
    step (see the module docstring for why not across steps), so the dS^T double-buffer argument
    of the module docstring holds unchanged."""
    kv_bar, in_ready, in_empty, ds_ready, dq_full, dq_empty = bars
    start_n, lse_base, r0, r_end, num_full, num_steps = plan
    dtype: gl.constexpr = k_smem.dtype
    t_layout: gl.constexpr = _key_major_layouts(BLOCK_MQ, HEAD_DIM)[0]
    acc_layout: gl.constexpr = _key_major_layouts(BLOCK_MQ, HEAD_DIM)[1]
    op_layout: gl.constexpr = _key_major_layouts(BLOCK_MQ, HEAD_DIM)[2]
    DQ_ROWS: gl.constexpr = HEAD_DIM // 2 if DQ_SPLIT_D else HEAD_DIM
    idx_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [4, 1], [1, 0])
    key0, offs_k, t_zero, dq_zero, dk, dv, k, v, r, m, e, g = _fused_consumer_start(
        WG, k_smem, v_smem, kv_bar, plan, RUN_START, RUN_END, t_layout, acc_layout, HEAD_DIM, BLOCK_MQ, DQ_ROWS)
    for j in range(num_steps):
        st = j % NUM_STAGES
        buf = j % 2
        offs_q = m * BLOCK_MQ + gl.arange(0, BLOCK_MQ, layout=gl.SliceLayout(0, t_layout))
        base = (lse_base + g).to(gl.int64) * Sq
        lse2, delta = _row_stats(Lse + base, Delta + base, offs_q, Sq)  # [BLOCK_MQ] each
        mbarrier.wait(in_ready.index(st), (j // NUM_STAGES) & 1)
        q_t = q_smem.index(st)
        do_t = do_smem.index(st)
        s_t = warpgroup_mma(k, q_t.permute((1, 0)), t_zero, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v, do_t.permute((1, 0)), t_zero, use_acc=False, is_async=True)
        s_t = warpgroup_mma_wait(1, deps=(s_t,))
        if HAS_PARTIAL_TILES:
            if r >= r0 + num_full:
                s_t = _interval_mask_t(s_t, offs_k, offs_q, LO, HI, Sq, NUM_IV)
        p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))  # _ds, in two halves
        dp_t = warpgroup_mma_wait(0, deps=(dp_t,))
        ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
        ds_own = ds_smem.index(2 * buf + WG)  # [64 keys, BLOCK_MQ]
        ds_own.store(ds_t.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        if DQ_SPLIT_D:
            mbarrier.arrive(ds_ready.index(buf))
        dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), op_layout), do_t, dv, is_async=True)
        if DQ_SPLIT_D:
            mbarrier.wait(ds_ready.index(buf), (j // 2) & 1)
            dq_t = warpgroup_mma(k_smem.index(0).slice(WG * DQ_ROWS, DQ_ROWS, dim=1).permute((1, 0)),
                                 ds_smem.index(2 * buf), dq_zero, use_acc=False, is_async=True)
            dq_t = warpgroup_mma(k_smem.index(1).slice(WG * DQ_ROWS, DQ_ROWS, dim=1).permute((1, 0)),
                                 ds_smem.index(2 * buf + 1), dq_t, is_async=True)
        else:
            dq_t = warpgroup_mma(k.permute((1, 0)), ds_own, dq_zero, use_acc=False, is_async=True)
        dk = warpgroup_mma(ds_own, q_t, dk, is_async=True)
        # dV and dQ^T done, dK still running while dQ^T goes to shared memory
        dv, dq_t = warpgroup_mma_wait(1, deps=(dv, dq_t))
        mbarrier.wait(dq_empty.index(buf), ((j // 2) & 1) ^ 1)
        dq_tiles.index(2 * buf + WG).store(dq_t)
        if WG == 0:  # the dq_accum tile, (b * Hq + query head) * num_tiles_q + m, for the writer
            tile_smem.index(buf).store(gl.full([1, 1], (lse_base + g) * num_tiles_q + m, gl.int32, idx_layout))
        gl.thread_barrier()
        mbarrier.arrive(dq_full.index(buf))
        dk = warpgroup_mma_wait(0, deps=(dk,))
        mbarrier.arrive(in_empty.index(st))
        r, m, e, g = _advance_wrap(r, m, e, g, r0, r_end, RUN_START, RUN_END)

    _fused_consumer_end(dk, dv, k, v, dk_desc, dv_desc, key0, softmax_scale, ds_ready, num_steps, DQ_SPLIT_D)


@gluon.jit
def _dq_writer(dq_smem, tile_smem, dq_full, dq_empty, DQA, plan, HEAD_DIM: gl.constexpr,
               BLOCK_MQ: gl.constexpr, DQ_SPLIT_D: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr):
    """The dQ-writer partition: per query tile, wait for both consumers' dQ^T partials, add them
    into the tile's ``[D, BLOCK_MQ]`` block of ``dq_accum`` with coalesced 4-wide fp32 atomics
    (``atom.global.gpu.relaxed.add.v4.f32``, result unused: ``ATOMG.E.ADD.F32x4``, where the launch
    specialises ``dq_accum`` as 16-byte aligned, as torch allocations are), release the buffer.
    With ``DQ_SPLIT_D`` the two partials are the tile's two halves of head-dim rows; otherwise
    (D = 64) both span every row and are summed here first: one atomic per element and key tile.

    ``dq_smem`` is the staging buffer seen as ``[4 * CHUNKS, ROWS, BLOCK_MQ]`` chunks (partial
    ``2 * (j % 2) + w`` is chunks ``(2 * (j % 2) + w) * CHUNKS ..``) of one 16-byte vector per
    thread. The partition shares the producer's warpgroup and registers (40 at
    ``bwd_consumer_regs=232``; at 24 this loop spills), so it keeps no run-list cursor of its own:
    consumer 0 leaves the tile's index in ``tile_smem``."""
    num_steps = plan[5]  # (start_n, lse_base, r0, r_end, n_full, steps)
    DQ_ROWS: gl.constexpr = HEAD_DIM // 2 if DQ_SPLIT_D else HEAD_DIM
    CHUNKS: gl.constexpr = DQ_ROWS // ROWS
    TPR: gl.constexpr = BLOCK_MQ // 4  # threads per row
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TPR, TPR], [WARPS, 1], [1, 0])
    offs = (gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout)), 1) * BLOCK_MQ
            + gl.expand_dims(gl.arange(0, BLOCK_MQ, layout=gl.SliceLayout(0, layout)), 0))  # [ROWS, BLOCK_MQ]
    for j in range(num_steps):
        buf = j % 2
        mbarrier.wait(dq_full.index(buf), (j // 2) & 1)
        # dq_accum [B * Hq, num_tiles_q, D, BLOCK_MQ]: the tile's [D, BLOCK_MQ] block
        tile = DQA + tile_smem.index(buf).load(layout).to(gl.int64) * (HEAD_DIM * BLOCK_MQ) + offs
        if DQ_SPLIT_D:
            for h in gl.static_range(2):  # head-dim rows h * DQ_ROWS ..
                for c in range(CHUNKS):
                    vals = dq_smem.index((2 * buf + h) * CHUNKS + c).load(layout)
                    gl.atomic_add(tile + (h * DQ_ROWS + c * ROWS) * BLOCK_MQ, vals, sem="relaxed")
        else:
            for c in range(CHUNKS):
                vals = (dq_smem.index(2 * buf * CHUNKS + c).load(layout)
                        + dq_smem.index((2 * buf + 1) * CHUNKS + c).load(layout))
                gl.atomic_add(tile + c * ROWS * BLOCK_MQ, vals, sem="relaxed")
        # every writer thread has read the buffer before it is handed back
        gl.thread_barrier()
        mbarrier.arrive(dq_empty.index(buf))


@gluon.jit
def _fused_setup(Q, K, V, DO, DK, DV, stride_qb, stride_qs, stride_dob, stride_dos,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                 ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT, Sq, Sk, num_bkv, num_heads_q, num_heads_kv, group_size,
                 HEAD_DIM: gl.constexpr, BLOCK_MQ: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Both fused kernels' prologue: the key-major program, its descriptors, the dK/dV kernel's
    buffers, plus dS^T of (step parity, warpgroup) for the dQ GEMM, ``[2 * 2, 64 keys, BLOCK_MQ]``,
    and one ``ds_ready`` barrier per step parity (both consumers arrive)."""
    b, h_kv, plan = _key_major_program(ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT, num_bkv, num_heads_q,
                                       num_heads_kv, group_size)
    descs = _key_major_descs(
        Q, K, V, DO, DK, DV, stride_qb, stride_qs, stride_dob, stride_dos, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
        b, h_kv, group_size, Sq, Sk, HEAD_DIM, BLOCK_MQ)
    dtype: gl.constexpr = Q.dtype.element_ty
    bufs = _key_major_buffers(dtype, HEAD_DIM, BLOCK_MQ, NUM_STAGES)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M_WG, BLOCK_MQ], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [4, M_WG, BLOCK_MQ], ds_layout)
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
    return plan, descs, bufs, ds_smem, ds_ready


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
    """``fused_dq="atomic"``: two consumer warpgroups that add their dQ^T by atomics, a TMA producer."""
    plan, descs, bufs, ds_smem, ds_ready = _fused_setup(
        Q, K, V, DO, DK, DV, stride_qb, stride_qs, stride_dob, stride_dos, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
        ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT, Sq, Sk, num_bkv, num_heads_q, num_heads_kv, group_size,
        HEAD_DIM, BLOCK_MQ, NUM_STAGES)
    q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc = descs
    k_smem, v_smem, q_smem, do_smem, kv_bar, in_ready, in_empty = bufs
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


@gluon.jit
def gluon_bwd_fused_writer_kernel(
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
    """``fused_dq="writer"`` (same arguments as ``gluon_bwd_fused_kernel``): two consumer
    warpgroups that stage their dQ^T in shared memory, a TMA producer warp and a dQ-writer
    partition of ``DQ_WRITER_WARPS`` warps, both on ``PRODUCER_REGS``."""
    plan, descs, bufs, ds_smem, ds_ready = _fused_setup(
        Q, K, V, DO, DK, DV, stride_qb, stride_qs, stride_dob, stride_dos, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
        ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT, Sq, Sk, num_bkv, num_heads_q, num_heads_kv, group_size,
        HEAD_DIM, BLOCK_MQ, NUM_STAGES)
    q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc = descs
    k_smem, v_smem, q_smem, do_smem, kv_bar, in_ready, in_empty = bufs
    num_tiles_q = (Sq + BLOCK_MQ - 1) // BLOCK_MQ
    # dQ^T partials of (step parity, warpgroup): the consumers see [2 * 2, DQ_ROWS, BLOCK_MQ] fp32,
    # the writer [4 * CHUNKS, ROWS, BLOCK_MQ] chunks of the same bytes (the swizzle repeats every
    # ROWS rows, so both views agree). Swizzled: the consumers' accumulator-layout stores and the
    # writer's row-vector loads are free of bank conflicts. tile_smem: the dq_accum tile of each
    # parity. dq_full: both consumers arrive; dq_empty: the writer.
    DQ_ROWS: gl.constexpr = HEAD_DIM // 2 if DQ_SPLIT_D else HEAD_DIM
    ROWS: gl.constexpr = 32 // (BLOCK_MQ // 4) * DQ_WRITER_WARPS
    dq_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=min(8, ROWS), order=[1, 0])
    dq_smem = gl.allocate_shared_memory(gl.float32, [4 * (DQ_ROWS // ROWS), ROWS, BLOCK_MQ], dq_layout)
    dq_tiles = dq_smem._reinterpret(gl.float32, [4, DQ_ROWS, BLOCK_MQ], dq_layout)
    tile_smem = gl.allocate_shared_memory(gl.int32, [2, 1, 1],
                                          gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(dq_full.index(i), count=2)
        mbarrier.init(dq_empty.index(i), count=1)
    bars = (kv_bar, in_ready, in_empty, ds_ready, dq_full, dq_empty)

    gl.warp_specialize([
        (_fused_consumer_staged, (0, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_tiles, tile_smem, bars,
                                  dk_desc, dv_desc, num_tiles_q, Lse, Delta, LO, HI, RUN_START, RUN_END,
                                  plan, qk_scale, softmax_scale, Sq, HEAD_DIM, BLOCK_MQ, NUM_IV,
                                  NUM_STAGES, HAS_PARTIAL_TILES, DQ_SPLIT_D)),
        (_fused_consumer_staged, (1, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_tiles, tile_smem, bars,
                                  dk_desc, dv_desc, num_tiles_q, Lse, Delta, LO, HI, RUN_START, RUN_END,
                                  plan, qk_scale, softmax_scale, Sq, HEAD_DIM, BLOCK_MQ, NUM_IV,
                                  NUM_STAGES, HAS_PARTIAL_TILES, DQ_SPLIT_D)),
        (_dkdv_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem,
                          (kv_bar, in_ready, in_empty), RUN_START, RUN_END, plan, HEAD_DIM,
                          BLOCK_MQ, NUM_STAGES)),
        (_dq_writer, (dq_smem, tile_smem, dq_full, dq_empty, DQA, plan, HEAD_DIM, BLOCK_MQ, DQ_SPLIT_D,
                      ROWS, DQ_WRITER_WARPS)),
    ], [4, 1, DQ_WRITER_WARPS], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])


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

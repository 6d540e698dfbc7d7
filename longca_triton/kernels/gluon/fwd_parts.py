"""The Gluon forward's data movement: head-dim pieces, TMA descriptors and boxes, shared buffers,
the K/V ring and its barriers, the work list of the persistent launch and the ping-pong token.

``fwd.py``'s docstring has the design; the backward kernels reuse the ring and the cursor.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
)

from longca_triton.kernels.core import jit as _core


#: rows of the query tile one consumer warpgroup owns (the wgmma M of 4 warps)
M_WG = gl.constexpr(64)
#: columns of the block of ones the row sums are taken against (``ROWSUM_MMA``): wgmma's narrowest N
ROWSUM_N = gl.constexpr(8)
LN2 = gl.constexpr(_core.LN2)
LOG2E = gl.constexpr(_core.LOG2E)


def qk_used(head_dim_qk: int, block_dqk: int) -> int:
    """Head-dim columns the ``Q K^T`` GEMMs cover: 192 for D_qk in 136..192 (a 256-wide tile whose
    last quarter is zero padding; 128 + 64, both slices on 64-column swizzle boundaries), else the
    whole tile (narrower tiles would need slices inside a 128-byte swizzle atom)."""
    return 192 if block_dqk == 256 and head_dim_qk <= 192 else block_dqk


_qk_used = gluon.constexpr_function(qk_used)

@gluon.constexpr_function
def _acc_layout(n):
    """The accumulator layout of one warpgroup's ``[M_WG, n]`` wgmma (4 warps, instruction N = ``n``)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def _a_layout(acc):
    """The register A operand of a wgmma accumulating in ``acc``: an accumulator of the same rows
    feeds it without moving (k_width = 2 bf16 per 32-bit register)."""
    return gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)


#: the narrowest head-dim piece: wgmma's K step (``Q K^T`` runs over the head dim as its K)
MIN_PIECE = 16


@gluon.constexpr_function
def split_pieces(head_dim: int):
    """``(D0, D1)``: ``head_dim`` as two powers of two ``D0 > D1 >= MIN_PIECE`` (80 -> (64, 16),
    96 -> (64, 32)); None when it is a power of two (nothing to split) or no such sum (112 needs
    three pieces, 72 = 64 + 8 a piece below wgmma's k16). A ``constexpr_function``: the kernel
    calls it at compile time, the host like any function."""
    d = int(head_dim)
    d0 = 1 << (d.bit_length() - 1) if d > 0 else 0
    d1 = d - d0
    if d1 < MIN_PIECE or d1 & (d1 - 1):
        return None
    return d0, d1


@gluon.constexpr_function
def head_pieces(head_dim: int, block_d: int, split_d: bool) -> tuple:
    """The head-dim tiles the forward works on: ``(block_d, 0)`` (one tile, the padded power of
    two), or with ``split_d`` where ``split_pieces`` splits ``head_dim``, its two exact pieces."""
    pieces = split_pieces(head_dim) if split_d else None
    return pieces if pieces else (int(block_d), 0)


def o_fits_q(head_dim_qk: int, head_dim_v: int, block_dqk: int, block_dv: int, split_d: bool) -> bool:
    """Whether O's tiles fit Q's buffers piece by piece (then O is staged there for a TMA store):
    ``DV0 <= DQK0`` and ``DV1 <= DQK1``. Without a split: ``BLOCK_DV <= BLOCK_DQK``."""
    q0, q1 = head_pieces(head_dim_qk, block_dqk, split_d)
    v0, v1 = head_pieces(head_dim_v, block_dv, split_d)
    return v0 <= q0 and v1 <= q1


@gluon.constexpr_function
def _piece(head_dim, block_d, split_d, i):
    """Width of head-dim piece ``i`` (``head_pieces``; 0: no second piece)."""
    return head_pieces(head_dim, block_d, split_d)[i]


@gluon.jit
def _advance(r, n, e, RUN_START, RUN_END):
    """The key tile after ``n`` on the CTA's run list: ``(run r, tile n, run end e)``.

    The run arrays carry one sentinel run at the end, so the load after the last tile is in
    bounds (its value is never used)."""
    n = n + 1
    if n == e:
        r = r + 1
        n = gl.load(RUN_START + r)
        e = gl.load(RUN_END + r)
    return r, n, e


@gluon.jit
def _tile_desc(base, rows, stride_s, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    """TMA descriptor over the ``[rows, HEAD_DIM]`` matrix of one head at ``base`` (row stride
    ``stride_s``), in ``[BLOCK, HEAD_DIM]`` tiles: rows >= ``rows`` load as zeros, stores clip."""
    return tma.make_tensor_descriptor(base, [rows, HEAD_DIM], [stride_s, 1], [BLOCK, HEAD_DIM], layout)


@gluon.jit
def _piece_descs(base, batch, rows, heads, stride_b, stride_s, stride_h, b, h, BLOCK: gl.constexpr,
                 HEAD_DIM: gl.constexpr, D0: gl.constexpr, D1: gl.constexpr, dtype: gl.constexpr,
                 WHOLE: gl.constexpr):
    """The TMA descriptors of a ``[batch, rows, heads, HEAD_DIM]`` tensor (unit last stride) by
    head-dim piece: ``(d0,)``, ``D0``-wide tiles (``D0 >= HEAD_DIM``: padded, zero-filled), or with a
    second piece (``D1 > 0``) ``(d0, d1)``: ``D0``-wide tiles read at column 0 and ``D1``-wide ones at
    column ``D0``, each with the swizzle its width gets. Rows >= ``rows`` and columns >= ``HEAD_DIM``
    load as zeros and clip on store, per head.

    ``WHOLE`` (persistent launches): over the whole tensor, in ``[1, BLOCK, 1, D*]`` boxes addressed
    ``[b, row, h, column]`` (``_load_box``, ``_store_box``). why: a kernel makes its descriptors once
    (each is written to global memory and fenced before its first copy), and a CTA that walks
    query tiles of several heads addresses them all by coordinates. Else over head ``h`` of batch
    ``b`` only, ``[rows, HEAD_DIM]`` in ``[BLOCK, D*]`` tiles addressed ``[row, column]``: one CTA,
    one head, and its consumers need no batch or head index in registers (at three consumers of 160
    registers the two more that the whole-tensor store needs made the main loop spill, ptxas)."""
    if WHOLE:
        l0: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK, 1, D0], dtype)
        d0 = tma.make_tensor_descriptor(base, [batch, rows, heads, HEAD_DIM], [stride_b, stride_s, stride_h, 1],
                                        [1, BLOCK, 1, D0], l0)
        descs = (d0,)
        if D1 > 0:
            l1: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK, 1, D1], dtype)
            descs = (d0, tma.make_tensor_descriptor(base, [batch, rows, heads, HEAD_DIM],
                                                    [stride_b, stride_s, stride_h, 1], [1, BLOCK, 1, D1], l1))
    else:
        head = base + b.to(gl.int64) * stride_b + h * stride_h
        l0: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, D0], dtype)
        d0 = tma.make_tensor_descriptor(head, [rows, HEAD_DIM], [stride_s, 1], [BLOCK, D0], l0)
        descs = (d0,)
        if D1 > 0:
            l1: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, D1], dtype)
            descs = (d0, tma.make_tensor_descriptor(head, [rows, HEAD_DIM], [stride_s, 1], [BLOCK, D1], l1))
    return descs


@gluon.jit
def _piece_buffers(NUM: gl.constexpr, BLOCK: gl.constexpr, D0: gl.constexpr, D1: gl.constexpr,
                   dtype: gl.constexpr):
    """Shared buffers ``[NUM, BLOCK, D*]`` per head-dim piece, each in the wgmma layout of its width
    (the TMA boxes land in them through ``_box``)."""
    l0: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, D0], dtype)
    b0 = gl.allocate_shared_memory(dtype, [NUM, BLOCK, D0], l0)
    bufs = (b0,)
    if D1 > 0:
        l1: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, D1], dtype)
        bufs = (b0, gl.allocate_shared_memory(dtype, [NUM, BLOCK, D1], l1))
    return bufs


@gluon.jit
def _box(buf, desc, WHOLE: gl.constexpr):
    """A ``[BLOCK, D]`` shared buffer as ``desc``'s tile: itself, or for a whole-tensor descriptor
    its ``[1, BLOCK, 1, D]`` box (the same bytes in the same swizzle: the unit dims add no stride)."""
    if WHOLE:
        buf = buf._reinterpret(buf.dtype, desc.block_shape, desc.layout)
    return buf


@gluon.jit
def _store_box(desc, b, row, h, col, buf, WHOLE: gl.constexpr):
    """TMA store of ``buf`` to rows ``[row, row + BLOCK)``, columns from ``col``, of head ``h`` of batch
    ``b`` (``_piece_descs``: a whole-tensor descriptor, else the head's own, which ignores ``b``, ``h``)."""
    if WHOLE:
        tma.async_copy_shared_to_global(desc, [b, row, h, col], _box(buf, desc, WHOLE))
    else:
        tma.async_copy_shared_to_global(desc, [row, col], buf)


@gluon.jit
def _index(bufs, i, D1: gl.constexpr):
    """Buffer ``i`` of every piece: ``(b0[i],)`` or ``(b0[i], b1[i])``."""
    b = (bufs[0].index(i),)
    if D1 > 0:
        b = (bufs[0].index(i), bufs[1].index(i))
    return b


@gluon.constexpr_function
def _nbytes(descs):
    """Bytes one tile of every piece brings (what a TMA ``expect`` waits for), at compile time."""
    return sum(d.block_type.nbytes for d in descs)


@gluon.jit
def _load_pieces(descs, row, bar, bufs, i, D0: gl.constexpr, D1: gl.constexpr):
    """TMA copies of rows ``[row, row + BLOCK)`` of every piece into buffer ``i`` (piece 1 starts
    at column ``D0``), all completing ``bar``."""
    tma.async_copy_global_to_shared(descs[0], [row, 0], bar, bufs[0].index(i))
    if D1 > 0:
        tma.async_copy_global_to_shared(descs[1], [row, D0], bar, bufs[1].index(i))


@gluon.jit
def _load_box(descs, b, row, h, bar, bufs, i, D0: gl.constexpr, D1: gl.constexpr, WHOLE: gl.constexpr):
    """TMA copies of rows ``[row, row + BLOCK)`` of head ``h`` of batch ``b`` (``_piece_descs``), every
    piece into buffer ``i`` (piece 1 from column ``D0``), all completing ``bar``."""
    if WHOLE:
        tma.async_copy_global_to_shared(descs[0], [b, row, h, 0], bar, _box(bufs[0].index(i), descs[0], WHOLE))
        if D1 > 0:
            tma.async_copy_global_to_shared(descs[1], [b, row, h, D0], bar, _box(bufs[1].index(i), descs[1], WHOLE))
    else:
        _load_pieces(descs, row, bar, bufs, i, D0, D1)


@gluon.jit
def _program(num_bh, num_heads_q, group_size):
    """``(rank, bh, b, h, h_kv)`` of a query-major CTA: batch*head is the fastest-varying index, so
    the query heads of one GQA group run side by side and share K/V tiles in L2."""
    pid = gl.program_id(0)
    rank = pid // num_bh
    bh = pid % num_bh
    b = bh // num_heads_q
    h = bh % num_heads_q
    return rank, bh, b, h, h // group_size


@gluon.jit
def _ring(NUM_STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """``(ready, empty)`` mbarriers of a NUM_STAGES ring: *ready* completes when the TMA bytes land,
    *empty* when all CONSUMERS warpgroups have released the buffer."""
    layout: gl.constexpr = mbarrier.MBarrierLayout()
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], layout)
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], layout)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return ready, empty


@gluon.jit
def _load_kv_ring(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, RUN_START,
                  RUN_END, r0, num_tiles, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  DQK0: gl.constexpr, DQK1: gl.constexpr, DV0: gl.constexpr, DV1: gl.constexpr):
    """The backward dQ kernel's producer loop (the forward's is ``_produce_tile``): K_j and V_j of
    every key tile on the run list into the ring (every head-dim piece of each into its stage; one
    ``expect`` for all of them). ``k_desc``, ``k_smem``, ``v_desc``, ``v_smem`` are piece tuples;
    ``DQK0`` / ``DV0`` are the columns the second pieces start at (unused when ``D*1 == 0``)."""
    r = r0
    n = gl.load(RUN_START + r)
    e = gl.load(RUN_END + r)
    for j in range(num_tiles):
        st = j % NUM_STAGES
        # the first round passes at once: a fresh barrier has "completed" the phase before 0
        ph = ((j // NUM_STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(st), ph)
        mbarrier.expect(k_ready.index(st), _nbytes(k_desc))
        _load_pieces(k_desc, n * BLOCK_N, k_ready.index(st), k_smem, st, DQK0, DQK1)
        mbarrier.wait(v_empty.index(st), ph)
        mbarrier.expect(v_ready.index(st), _nbytes(v_desc))
        _load_pieces(v_desc, n * BLOCK_N, v_ready.index(st), v_smem, st, DV0, DV1)
        r, n, e = _advance(r, n, e, RUN_START, RUN_END)


@gluon.jit
def _work_index(k, SNAKE: gl.constexpr):
    """The work item a persistent CTA takes in its ``k``-th round: ``k * grid + program_id``, or with
    ``SNAKE`` in odd rounds ``k * grid + grid - 1 - program_id`` (a boustrophedon over the
    heaviest-first list, so the CTA that took the heaviest item of one round takes the lightest of
    the next: the static schedule's per-CTA sums stay within one item of each other instead of
    drifting apart by a round's spread every round). May be >= the work count in the last round."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    if SNAKE:
        lane = gl.where(k % 2 == 1, nprog - 1 - pid, pid)
    else:
        lane = pid
    return k * nprog + lane


@gluon.jit
def _sched_wait(sched, WG: gl.constexpr, k, PINGPONG: gl.constexpr):
    """Ping-pong: wait for the token before issuing this warpgroup's GEMMs (its ``k``-th time)."""
    if PINGPONG:
        mbarrier.wait(sched.index(WG), k & 1)


@gluon.jit
def _sched_pass(sched, WG: gl.constexpr, PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr):
    """Ping-pong: hand the token to the next warpgroup (round robin) once this one's GEMMs are issued."""
    if PINGPONG:
        mbarrier.arrive(sched.index((WG + 1) % CONSUMERS))


@gluon.jit
def _tile_plan(w, num_bh, ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT, CONSUMERS: gl.constexpr):
    """Work item ``w = rank * num_bh + bh`` (query tile rank, batch*head): its first row and its run
    list (``plan.py``), ``(start_m, r0, num_full, num_tiles)``. Tiles come heaviest first (``ORDER``)
    and batch*head is the fastest-varying index, so the query heads of one GQA group run side by
    side and share K/V tiles in L2."""
    tile_m = gl.load(ORDER + w // num_bh)
    return (tile_m * (CONSUMERS * M_WG), gl.load(RUN_PTR + tile_m), gl.load(RUN_NFULL + tile_m),
            gl.load(RUN_COUNT + tile_m))


@gluon.jit
def _tile_head(bh, num_heads_q, group_size):
    """``(b, h, h_kv)`` of batch*head ``bh``: batch, query head, KV head."""
    h = bh % num_heads_q
    return bh // num_heads_q, h, h // group_size

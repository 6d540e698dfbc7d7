r"""Forward of the dense structured-mask attention in Gluon, FlashAttention-3's design on sm_90.

Math: the same as ``longca_triton/kernels/dense/op.py`` (online softmax in the log2 domain, fp32
accumulators, natural-log lse, a fully masked row gives out 0 and lse -inf).

Tiling
------
One CTA owns a query tile of ``CONSUMERS * M_WG`` rows (or walks several: persistent, below) (``M_WG = 64``, one wgmma row block) of
one query head and walks that tile's key tiles (``BLOCK_N`` rows of K and V) from the tile plan:
the *full* runs first (no mask math), then the *partial* runs (element mask from the per-row
intervals). The plan's two run lists are merged per query tile on the host (``plan.py``), so
every partition walks one list with the same three-scalar cursor.

Warp specialization (``gl.warp_specialize``), three partitions (``CONSUMERS = 2``)::

    producer   1 warp, 24 registers     TMA: Q of the tile, then K_j, V_j into a NUM_STAGES ring
    consumer 0 4 warps (default)        rows [0, 64) of the tile:  S = Q K^T, softmax, O += P V
    consumer 1 4 warps, 240 registers   rows [64, 128)

or four (``CONSUMERS = 3``, config ``consumers``: the default where both head-dim tiles are 64
wide, whose GEMMs are short next to the softmax): consumers 1 and 2 at 160 registers, rows
[64, 128) and [128, 192), the producer at 24 (four warpgroups share the register file).

Shared-memory ring: stage ``s = j % NUM_STAGES`` holds K_j and V_j, each guarded by a *ready*
mbarrier (the TMA's transaction count completes it) and an *empty* mbarrier (count
``CONSUMERS``: every consumer arrives when done with the buffer). A barrier's phase flips each time it completes, so
the j-th use of a stage waits for parity ``(j // NUM_STAGES) & 1``; the producer waits on *empty*
with the opposite parity, which passes at once the first time round (a fresh barrier counts as
having completed phase "-1").

Inside a consumer (FA3's intra-warpgroup overlap): at step ``j`` it issues ``S_j = Q K_j^T`` and
``O += P_{j-1} V_{j-1}`` back to back as asynchronous wgmma, waits for the first only
(``warpgroup_mma_wait(1)``), runs the softmax of ``S_j`` while the tensor cores still compute
``P_{j-1} V_{j-1}``, then waits for that and rescales ``O`` by ``alpha_j``. Step 0 (no ``P``
yet) and the last ``P V`` are peeled out of the loop.

Without that overlap (``PV_SYNC``, config ``pv_sync``): step ``j`` issues ``P_{j-1} V_{j-1}`` first and waits
for it, then ``S_j``; ``P_{j-1}``'s registers are then free before ``S_j``'s accumulator is live, which lets
three consumers hold P in registers within 160 registers (D = 96, split), and the other two warpgroups'
GEMMs run while one computes its softmax (D = 96's default on dense masks, persistent: +7 to +13 %).

P through shared memory (``P_SMEM``, config ``p_smem``; FA3's ``MmaPV_is_RS = false``): instead of
converting P to the wgmma A layout in registers, each consumer stores it (stmatrix) into a
``[M_WG, BLOCK_N]`` shared buffer of its own and ``P V`` reads A from there. The store waits for the
previous ``P V`` (it read the same buffer) and is fenced for the async proxy; the compiler's barrier
analysis adds the warpgroup's named ``bar.sync`` before the wgmma. What it buys: P's registers are
free while the next tile's softmax runs, which lets three consumers fit 160 registers at D = 128
(the default there on dense masks, ``attention.default_config``).

Between consumers (FA3's ping-pong, ``PINGPONG``): one mbarrier per consumer hands a token round
robin, so a consumer issues its GEMMs only after the previous one has issued its own: the GEMMs
of one warpgroup then run while the others compute their softmax.

Persistent launch (``PERSISTENT``, config ``persistent``; FA3's persistent tile scheduler, static)
--------------------------------------------------------------------------------------------------
One CTA per SM walks the work list ``w = program_id, program_id + num_programs, ...`` (``w = rank *
batch*heads + bh``: query tiles heaviest first by ``ORDER``, heads fastest, ``_tile_plan``). What
it removes is a CTA's fixed cost, which weighs where rows walk few key tiles: a non-persistent CTA
makes its four descriptors (each written to global memory and fenced), waits for its Q and first K
tiles, and ends with the O store, all exposed (session 15, ``call1_window``: at 16K sliding
windows of 256..8192 keys the forward's time fits ~8 us a CTA plus ~1.3 us a key tile). Persistent:

* descriptors over the whole ``[B, S, H, D]`` tensors, made once (``_piece_descs(WHOLE=True)``),
  ``[1, BLOCK, 1, D*]`` boxes addressed ``[b, row, h, column]`` (``_load_box``, ``_store_box``): the
  box stays inside one head, so the zero fill past ``S`` and past the true head dim, and the
  clipped store, work per batch and head as before;
* the ring position carries over from tile to tile (``g``: stage ``g % NUM_STAGES``, its phase), so
  the producer fills the ring with the next tile's K/V while the consumers finish the current one;
* Q gets a ready / empty barrier pair per consumer (``q_ready``, ``q_empty``); the producer loads
  the next tile's Q after its first K/V (``_produce_tile``) once the consumer has released its Q
  buffer: right after the tile's last ``S`` when O has buffers of its own (``O_OWN``, config
  ``o_own``), else after the O store that staged in Q's buffer (``tma.store_wait`` first);
* with ``O_OWN`` the O store is left in flight; the next tile's epilogue waits for it before it
  writes the buffer again (and the CTA before it ends).

One tile a CTA (the default on the dense masks, where the persistent launch measured 4-6 % slower)
runs the same code with the ring position and phases the constants 0, per-head descriptors (the
CTA needs no batch or head index in its consumers, whose 160 registers at three consumers have
none to spare) and Q loaded first.

Out-of-range rows: Q rows >= Sq and K/V rows >= Sk are zero-filled by the TMA loads; the plan
puts a ragged last key tile in the partial list, whose mask (``hi <= Sk``) removes those keys;
the O store is clipped by the descriptor and the lse store is masked.

Head dims (as ``dense.py``): ``HEAD_DIM_QK`` / ``HEAD_DIM_V`` are the true dims (multiples of 8 up
to 256, D_v may differ), ``BLOCK_DQK`` / ``BLOCK_DV`` their power-of-two tiles. The descriptors
take the true dim as the tensor's shape and the padded one as the block (``_padded_desc``): the
TMA fills the padded columns of Q, K, V with zeros (``padding_option="zero"``), which add nothing
to ``Q K^T`` and give O columns that the clipped store drops; the fp32 pointer store masks them.
The tensor cores do the padded work (96 runs 128-wide GEMMs; D_qk in 136..192 skips the zero
last quarter of its 256-wide tile in ``Q K^T``, ``_qk``), results and the FLOP count are those of
the true dims. O is staged in Q's buffer for its TMA store where its tile
fits there (``BLOCK_DV <= BLOCK_DQK``: a ``_reinterpret`` view when smaller), else it leaves by the
masked pointer store. With ``BLOCK_D* == HEAD_DIM_*`` the kernel is the one written for 64 / 128
(the same PTX).

Split launch (``MERGE``, config ``split_partial``)
--------------------------------------------------
With the mask path compiled in (``HAS_PARTIAL_TILES``), ptxas moves the key loop's shared-memory
descriptors and ring arithmetic from the uniform datapath to per-thread registers (any change to
``S`` under a branch does it, wherever the branch sits; three consumers then spill them): a mask that
is full but for one key per row tile ran 10 % slower than full (session 17). Where partial tiles are
few, the launcher runs the full tiles in the kernel compiled without the mask path, then the partial
tiles in a second, persistent launch with ``MERGE``: it reads the first launch's ``O`` and ``lse`` of
its rows while the tile's last ``P V`` runs (``_merge_load``: the loads' latency hides behind it) and
its epilogue stores ``O = O_a exp(lse_a - lse) + O_b exp(lse_b - lse)`` with ``lse =
logaddexp(lse_a, lse_b)`` (``_merge_rows``; ``O_a`` is read back in q's dtype: one more rounding).
That second launch rereads Q and reads and rewrites O for every query tile it visits (session 18: its
time is mostly that traffic). ``MASK_HEAD`` (config ``mask_head``, 1 or 2) avoids it where a query
tile has one or two partial key tiles: masking *without a branch* leaves ptxas' datapath alone, so
the plan (``plan.build_ws_plan(part="head", head=MASK_HEAD)``) moves each query tile's first
``MASK_HEAD`` partial tiles to the front of its walk and those steps always apply the interval mask (a
full tile there passes it whole), while the loop is compiled without the mask path; the tile's other
partial tiles, if any, go to the merging launch. With 2, step 1 is peeled out of the loop
(``_kv_step``, the loop's body, inlined twice: the loop's SASS is the unmasked kernel's, 466
instructions against 778 with the branch; sm_90a, two persistent consumers, no spills), so every item
that walks any key tile must walk two: the plan gives a query tile that walks one a neighbour none of
its rows may see (``plan.pad_single``; past the keys, zero-filled by the TMA, where there is none).
Most query tiles of the window and document masks have exactly two partial tiles (a window's or a
document's two edges): session 19 measured +3 to +9 % there against the best of the other launches.

Row sums on the tensor cores (``ROWSUM_MMA``, config ``rowsum_mma``)
--------------------------------------------------------------------
The softmax spends about one issue slot per score on each of the row max (FMNMX), the exponent's
FFMA, the exponential (MUFU), the row sum (FADD) and half a one on the bf16 pack, and at small head
dims that issue rate, not the tensor cores, sets the pace. ``ROWSUM_MMA`` drops the FADDs: each
``P V`` step issues one more async wgmma, ``P`` against a ``[BLOCK_N, 8]`` block of ones written to
shared memory once per CTA (``ROWSUM_N``, held K-major as ``[8, BLOCK_N]``: an MN-major 16-byte-wide
B tile read garbage and faulted), into an ``[M_WG, 8]`` accumulator ``acc_l`` that is rescaled by
``alpha`` with O; the epilogue takes ``l`` from it. The sums are of the bf16 P that ``P V`` uses (the
FADDs summed the fp32 p). sm_90a: the consumer loop loses 66 FADDs for 8 HGMMAs (D = 96 split: 478
-> 427 instructions; D = 64 423 -> 368). Measured (session 19): +1 to +8 % on every mask of D = 64's
persistent launch, the default there; slower at D = 96 (-1 to -4 %) and D = 128 (-6 to -10 %, -31 %
with three consumers, whose 160 registers spill the accumulator): the narrow GEMM's cost on the
tensor pipe outweighs the issue slots where the GEMMs are longer.

Split head dims (``SPLIT_D``, config ``split_d``; issue 17)
-----------------------------------------------------------
Padding 96 to 128 wastes a quarter of every wgmma. wgmma takes K in steps of 16 and N in
multiples of 8, so a dim that is the sum of two powers of two, the smaller >= 16
(``split_pieces``: 48 = 32 + 16, 80 = 64 + 16, 96 = 64 + 32, 144, 160, 192 = 128 + 64), runs
exactly as two *pieces* ``D0 + D1``. Each of Q, K, V, O then has two TMA descriptors over the same
``[rows, HEAD_DIM]`` matrix: ``[BLOCK, D0]`` tiles loaded at column 0 and ``[BLOCK, D1]`` tiles
loaded at column ``D0``, both inside the matrix (no zero fill), each into its own shared buffer
with the swizzle its width gets (``NVMMASharedLayout.get_default_for``: 128 B for a 64-wide bf16
piece, 64 B for 32, 32 B for 16). With ``q = [q0 | q1]`` and ``k = [k0 | k1]`` split along the
head dim::

    S  = Q0 K0^T + Q1 K1^T     two chained async wgmma into one accumulator   # [M_WG, BLOCK_N]
    O0 = P V0,  O1 = P V1      two accumulators, the same P registers as A     # [M_WG, D0], [M_WG, D1]

(96: 6 k16 steps for ``Q K^T`` instead of 8, n64 + n32 for ``P V`` instead of n128), the softmax
rescale and the final ``1 / l`` apply to both accumulators, and the epilogue stores two tiles
(staged in the two Q buffers, or two pointer stores). Per operand: D_qk and D_v split each on
their own (96/128 splits ``Q K^T`` only); a power-of-two dim keeps one tile. Pieces are tuples
(``(q0,)`` or ``(q0, q1)``), so a kernel without a split sees one-element tuples and compiles to
the same PTX as before the split existed; ``SPLIT_D`` is turned into the widths ``D*0, D*1``
(``head_pieces``, ``D*1 == 0``: no second piece) once, in ``gluon_fwd_kernel``.

Why not one ``[BLOCK_N, 96]`` V tile and one n96 ``P V`` (fewer, larger wgmma; a 192-byte row
would take the 64-byte swizzle): Gluon 3.6 refuses it at the first step, every shape must be a
power of two (``allocate_shared_memory``: "shape must have power-of-2 and non-zero dimensions";
``make_tensor_descriptor``: "Shape element 1 must be a power of 2"), and the accumulator would be
a ``[64, 96]`` register tensor, which it refuses likewise. Two pieces are the legal exact form.
The wait after ``S_j`` leaves every ``P V`` group in flight (``warpgroup_mma_wait(NUM_PV)``: one
commit group per async wgmma call, so 2 with a split V).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from longca_triton.kernels.core import jit as _core

__all__ = ["gluon_fwd_kernel", "M_WG", "qk_used", "split_pieces", "head_pieces", "o_fits_q", "MIN_PIECE"]

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
def _key_cols(n, s_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """The key indices of tile ``n`` as a ``[1, BLOCK_N]`` row in ``s``'s column layout."""
    return gl.expand_dims(n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)


@gluon.jit
def _in_interval(cols, lo, hi):
    """``[M_WG, BLOCK_N]``: whether key ``cols[j]`` lies in row ``i``'s ``[lo[i], hi[i])``."""
    return (cols >= gl.expand_dims(lo, 1)) & (cols < gl.expand_dims(hi, 1))


@gluon.jit
def _interval_mask(s, offs_m, n, LO, HI, Sq, s_layout: gl.constexpr,
                   BLOCK_N: gl.constexpr, NUM_IV: gl.constexpr):
    """``s`` with ``-inf`` where key ``j`` is outside every interval ``[lo[i,t], hi[i,t])`` of
    row ``i``. Rows >= Sq read empty intervals."""
    cols = _key_cols(n, s_layout, BLOCK_N)  # [1, BLOCK_N]
    row_ok = offs_m < Sq
    lo = gl.load(LO + offs_m * NUM_IV, mask=row_ok, other=0)
    hi = gl.load(HI + offs_m * NUM_IV, mask=row_ok, other=0)
    allowed = _in_interval(cols, lo, hi)  # [M_WG, BLOCK_N]
    for t in gl.static_range(1, NUM_IV):
        lo = gl.load(LO + offs_m * NUM_IV + t, mask=row_ok, other=0)
        hi = gl.load(HI + offs_m * NUM_IV + t, mask=row_ok, other=0)
        allowed = allowed | _in_interval(cols, lo, hi)
    return gl.where(allowed, s, float("-inf"))


@gluon.jit
def _row_interval(offs_m, LO, HI, Sq):
    """The one key interval ``[lo, hi)`` of rows ``offs_m`` (``NUM_IV == 1``), ``[M_WG]`` each,
    loaded once before the key loop (``_mask_tile``). Rows >= Sq read an empty interval."""
    row_ok = offs_m < Sq
    return gl.load(LO + offs_m, mask=row_ok, other=0), gl.load(HI + offs_m, mask=row_ok, other=0)


@gluon.jit
def _mask_tile(s, offs_m, n, LO, HI, Sq, iv, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_IV: gl.constexpr, HOLD_IV: gl.constexpr):
    """``s`` of key tile ``n`` with ``-inf`` outside its rows' intervals: with ``HOLD_IV`` (one
    interval a row, two consumers) from its bounds held in registers (``iv``, ``_row_interval``),
    else ``_interval_mask`` (loads per partial tile).

    why hold them: a row's interval is the same for every key tile, and loading it per partial tile
    put global loads between the wait for ``S_j`` and its softmax (ptxas, sm_90a: 6 -> 2 loads a
    step). Measured (experiments/results/h100/session14, call 11, 16K, D = 128, two rounds):
    causal_document 493 -> 504 TFLOP/s, the other two-consumer masks within the runs' spread; with
    three consumers (160 registers) the two registers spill (causal 607 -> 591), and a second
    interval's made the loops spill more (19 -> 48 spill stores a step), so only there."""
    if HOLD_IV:
        s = gl.where(_in_interval(_key_cols(n, s_layout, BLOCK_N), iv[0], iv[1]), s, float("-inf"))
    else:
        s = _interval_mask(s, offs_m, n, LO, HI, Sq, s_layout, BLOCK_N, NUM_IV)
    return s


#: 2^f on f in [-1/2, 1/2] as ``1 + f (C1 + f (C2 + f C3))`` (``POLY_EXP``): a minimax fit with the
#: constant term exactly 1 (so that a clamped -127 gives exactly 0 below), max relative error 1.0e-4
#: (bf16 rounds P at 2^-9 = 2.0e-3); fp32 bit patterns for the PTX
EXP2_POLY = (0.6932829, 0.24221097, 0.05500893)
_EXP2_POLY_HEX = ("0f3F317AFD", "0f3E780627", "0f3D61510B")


@gluon.constexpr_function
def _exp2_mix_asm(n: int) -> str:
    """PTX for ``n`` consecutive scores of a thread (``inline_asm_elementwise``, ``pack=n``): the
    first ``n - 1`` through the MUFU's ``ex2.approx``, the last by a polynomial on the FMA pipe
    (FlashAttention-4's split of the softmax's exponentials between the two units).

    The polynomial form: ``x = max(x, -127)``; ``t = x + 1.5 * 2^23`` rounds ``x`` to the integer
    ``j`` (in ``t``'s low mantissa bits), ``f = x - j`` in [-1/2, 1/2]; ``2^x = 2^f * 2^j`` adds ``j``
    to the exponent field of ``2^f``: ``bits(p) + (bits(t) << 23)`` (``1.5 * 2^23``'s own bits vanish
    in the shift). -inf (a masked score) clamps to -127, whose ``f = 0`` gives ``p = 1`` exactly and
    the sum 0x3F800000 - 127 * 2^23 = +0.0: exactly 0, as ``ex2`` gives."""
    c1, c2, c3 = _EXP2_POLY_HEX
    k = n - 1
    lines = [f"ex2.approx.ftz.f32 ${i}, ${n + i};" for i in range(k)]
    lines += [
        "{", ".reg .f32 x, t, j, f, p;", ".reg .b32 tb, pb;",
        f"max.ftz.f32 x, ${n + k}, 0fC2FE0000;",
        "add.rn.ftz.f32 t, x, 0f4B400000;",
        "sub.rn.ftz.f32 j, t, 0f4B400000;",
        "sub.rn.ftz.f32 f, x, j;",
        f"fma.rn.ftz.f32 p, f, {c3}, {c2};",
        f"fma.rn.ftz.f32 p, p, f, {c1};",
        "fma.rn.ftz.f32 p, p, f, 0f3F800000;",
        "mov.b32 tb, t;", "mov.b32 pb, p;",
        "shl.b32 tb, tb, 23;",
        f"add.s32 ${k}, pb, tb;",
        "}",
    ]
    return "\n".join(lines)


@gluon.constexpr_function
def _exp2_mix_constraints(n: int) -> str:
    return ",".join(["=r"] * n + ["r"] * n)


@gluon.jit
def _exp2(x, POLY_EXP: gl.constexpr):
    """``2^x`` elementwise: the MUFU's ``ex2`` for every element (``POLY_EXP == 0``), or for all but
    one of every ``POLY_EXP`` consecutive elements of a thread, that one by the polynomial of
    ``_exp2_mix_asm`` on the FMA pipe (the MUFU gives 16 exponentials a clock per SM against 128
    FMAs). Measured on an H100 (experiments/results/h100/session17, call 2): every split loses at
    D = 64, 96, 128 (2-25 %, more the more move): the softmax is bound by instruction issue, and a
    polynomial exponential costs ~10 issue slots against the MUFU's one. Kept as a config for GPUs
    and head dims where the MUFU does bind (FA4's Blackwell case). Nor do packed 16-bit exponentials
    help on sm_90 (session 20, compiled on a CPU): ptxas lowers ``ex2.approx.ftz.bf16x2`` to two
    ``MUFU.EX2`` with unpacking around them (the loop 463 -> 557 instructions at D = 96) and
    ``ex2.approx.f16x2`` to two ``MUFU.EX2.F16``: one MUFU instruction per score either way."""
    if POLY_EXP == 0:
        y = gl.exp2(x)
    else:
        y = gl.inline_asm_elementwise(_exp2_mix_asm(POLY_EXP), _exp2_mix_constraints(POLY_EXP), [x],
                                      dtype=gl.float32, is_pure=True, pack=POLY_EXP)
    return y


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, POLY_EXP: gl.constexpr, ROWSUM_MMA: gl.constexpr):
    """Fold raw scores ``s [M_WG, BLOCK_N]`` (masked entries -inf) into the row max ``m_i`` and
    row sum ``l_i`` (log2 domain; with ``ROWSUM_MMA`` the tensor cores sum the rows, ``l_i`` passes
    through). Returns ``(m_new, l_new, p, alpha)``."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)  # [M_WG]
    # why: a row with nothing allowed so far has m_new = -inf, and -inf - -inf is NaN;
    # subtracting 0 instead keeps p = exp2(-inf) = 0 and alpha = 0.
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    # one FFMA + EX2 per score: the scale is folded into the exponent
    p = _exp2(s * qk_scale - gl.expand_dims(m_sub, 1), POLY_EXP)  # [M_WG, BLOCK_N]
    alpha = gl.exp2(m_i - m_sub)  # [M_WG]
    l_new = l_i
    if not ROWSUM_MMA:
        # one FADD per score (ROWSUM_MMA: none, the P V step's extra GEMM against ones sums P)
        l_new = l_i * alpha + gl.sum(p, axis=1)
    return m_new, l_new, p, alpha


@gluon.jit
def _qk(q, k, s_zero, DQK0: gl.constexpr, DQK1: gl.constexpr, QK_USED: gl.constexpr):
    """``S = Q K^T`` issued as async wgmma; ``q``, ``k``: the head-dim pieces' buffers.

    One piece: over the first ``QK_USED`` columns of the padded tile: all ``DQK0`` of them, or
    (``QK_USED < DQK0``, D_qk in 136..192 on a 256-wide tile) the first half and a quarter, two
    chained GEMMs that skip the zero-filled last quarter. Two pieces (``DQK1 > 0``):
    ``Q0 K0^T + Q1 K1^T``, two chained GEMMs over the exact dim. Returns ``[M_WG, BLOCK_N]``."""
    if DQK1 > 0:
        s = warpgroup_mma(q[0], k[0].permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q[1], k[1].permute((1, 0)), s, is_async=True)
    elif QK_USED == DQK0:
        s = warpgroup_mma(q[0], k[0].permute((1, 0)), s_zero, use_acc=False, is_async=True)
    else:
        HALF: gl.constexpr = DQK0 // 2
        REST: gl.constexpr = QK_USED - HALF
        s = warpgroup_mma(q[0].slice(0, HALF, dim=1), k[0].slice(0, HALF, dim=1).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        s = warpgroup_mma(q[0].slice(HALF, REST, dim=1), k[0].slice(HALF, REST, dim=1).permute((1, 0)), s,
                          is_async=True)
    return s


@gluon.jit
def _pv(p_op, v, acc, DV1: gl.constexpr, p1_layout: gl.constexpr, P_SMEM: gl.constexpr):
    """``O += P V`` issued as async wgmma per head-dim piece of V: ``acc`` is ``(O0,)`` or
    ``(O0, O1)``; both GEMMs take the same P as A operand: registers (``p1_layout`` is the A
    layout of piece 1's accumulator: the same registers, a layout with that parent), or with
    ``P_SMEM`` the warpgroup's shared P buffer (``p_op``), read by both as it is."""
    a0 = warpgroup_mma(p_op, v[0], acc[0], is_async=True)
    out = (a0,)
    if DV1 > 0:
        if P_SMEM:
            out = (a0, warpgroup_mma(p_op, v[1], acc[1], is_async=True))
        else:
            out = (a0, warpgroup_mma(gl.convert_layout(p_op, p1_layout), v[1], acc[1], is_async=True))
    return out


@gluon.jit
def _p_operand(p, p_buf, dtype: gl.constexpr, p_layout: gl.constexpr, P_SMEM: gl.constexpr):
    """The A operand of the next ``P V`` from the softmax's ``p [M_WG, BLOCK_N]`` (fp32): the
    registers in the wgmma A layout, or with ``P_SMEM`` the warpgroup's shared buffer ``p_buf``
    after storing ``p`` there (the caller has waited for the ``P V`` that last read it).

    why the fence: the store goes through the generic proxy and wgmma reads through the async
    proxy; ``fence_async_shared`` orders the two (the compiler's barrier analysis adds the
    warpgroup's ``bar.sync`` before the wgmma, which reads every thread's part)."""
    if P_SMEM:
        p_buf.store(p.to(dtype))
        fence_async_shared()
        p_op = p_buf
    else:
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    return p_op


@gluon.jit
def _rowsum_mma(p_op, ones_smem, acc_l, pl_layout: gl.constexpr, P_SMEM: gl.constexpr):
    """``L += P 1`` (``ROWSUM_MMA``): the row sums of P as one more async wgmma, ``acc_l [M_WG,
    ROWSUM_N]`` (every column the row's sum), issued after the ``P V`` ones; P from registers in the
    A layout of that accumulator (``pl_layout``: the same registers) or from its shared buffer."""
    if P_SMEM:
        a = p_op
    else:
        a = gl.convert_layout(p_op, pl_layout)
    return warpgroup_mma(a, ones_smem.permute((1, 0)), acc_l, is_async=True)


@gluon.jit
def _wait_pv(acc, acc_l, DV1: gl.constexpr, ROWSUM_MMA: gl.constexpr):
    """Wait for every ``P V`` GEMM (and with ``ROWSUM_MMA`` the row sums'): ``(acc, acc_l)``, ``acc``
    a tuple of finished accumulators."""
    if ROWSUM_MMA:
        if DV1 > 0:
            a0, a1, lsum = warpgroup_mma_wait(0, deps=(acc[0], acc[1], acc_l))
            out = ((a0, a1), lsum)
        else:
            a0, lsum = warpgroup_mma_wait(0, deps=(acc[0], acc_l))
            out = ((a0,), lsum)
    elif DV1 > 0:
        out = (warpgroup_mma_wait(0, deps=(acc[0], acc[1])), acc_l)
    else:
        out = ((warpgroup_mma_wait(0, deps=(acc[0],)),), acc_l)
    return out


@gluon.jit
def _scale_rows(acc, x, row_o: gl.constexpr, row_o1: gl.constexpr, DV1: gl.constexpr):
    """Every accumulator piece times the per-row factor ``x [M_WG]``."""
    a0 = acc[0] * gl.expand_dims(gl.convert_layout(x, row_o), 1)
    out = (a0,)
    if DV1 > 0:
        out = (a0, acc[1] * gl.expand_dims(gl.convert_layout(x, row_o1), 1))
    return out


@gluon.jit
def _o_stage(q, WG: gl.constexpr, q_smem, DQK: gl.constexpr, DV: gl.constexpr, CONSUMERS: gl.constexpr):
    """The shared buffer that stages one O piece ``[M_WG, DV]`` for its TMA store: this warpgroup's
    Q buffer ``q`` of the same piece (no longer read), or where O's piece is narrower, its first
    ``[M_WG, DV]`` tile (a view of the ``[CONSUMERS, M_WG, DQK]`` buffers as ``CONSUMERS * DQK / DV``
    tiles). With ``O_IN_P`` the same for its P buffer (``DQK``: ``BLOCK_N``)."""
    if DV == DQK:
        o_smem = q
    else:
        # the launcher asks for STORE_TMA only when DV <= DQK (``o_fits_q``), O_IN_P only when
        # DV <= BLOCK_N
        RATIO: gl.constexpr = DQK // DV
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M_WG, DV], q_smem.dtype)
        o_smem = q_smem._reinterpret(q_smem.dtype, [CONSUMERS * RATIO, M_WG, DV], layout).index(WG * RATIO)
    return o_smem


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
def _store_piece(out, Out, row0, Sq, stride_os, C0: gl.constexpr, DV: gl.constexpr,
                 HEAD_DIM_V: gl.constexpr, o_layout: gl.constexpr):
    """Masked pointer store of one O piece ``out [M_WG, DV]`` to columns ``[C0, C0 + DV)`` (those
    >= ``HEAD_DIM_V``, the padding, are not stored)."""
    rows = row0 + gl.arange(0, M_WG, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    if C0 > 0:
        cols = C0 + cols
    ptrs = Out + gl.expand_dims(rows.to(gl.int64) * stride_os, 1) + gl.expand_dims(cols, 0)
    if C0 + DV <= HEAD_DIM_V:
        gl.store(ptrs, out.to(Out.dtype.element_ty), mask=gl.expand_dims(rows < Sq, 1))
    else:  # the padded columns >= HEAD_DIM_V are not stored
        ok = gl.expand_dims(rows < Sq, 1) & gl.expand_dims(cols < HEAD_DIM_V, 0)
        gl.store(ptrs, out.to(Out.dtype.element_ty), mask=ok)


@gluon.jit
def _merge_load(Out, Lse, bh, num_heads_q, row0, offs_m, Sq, stride_ob, stride_os, stride_oh, DV: gl.constexpr,
                HEAD_DIM_V: gl.constexpr, o_layout: gl.constexpr):
    """The ``(O_a, lse_a)`` an earlier launch stored for rows ``offs_m`` of batch*head ``bh`` (``MERGE``,
    the split launch): ``O_a [M_WG, DV]`` in its stored dtype (``o_layout``; rows >= Sq and columns >=
    HEAD_DIM_V 0), ``lse_a [M_WG]`` (-inf beyond Sq)."""
    b, h, _ = _tile_head(bh, num_heads_q, 1)
    o_base = Out + b.to(gl.int64) * stride_ob + h * stride_oh
    ok = offs_m < Sq
    lse_a = gl.load(Lse + bh.to(gl.int64) * Sq + offs_m, mask=ok, other=float("-inf"))
    rows = row0 + gl.arange(0, M_WG, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    ptrs = o_base + gl.expand_dims(rows.to(gl.int64) * stride_os, 1) + gl.expand_dims(cols, 0)
    ld_ok = gl.expand_dims(rows < Sq, 1) & gl.expand_dims(cols < HEAD_DIM_V, 0)
    return gl.load(ptrs, mask=ld_ok, other=0.0), lse_a


@gluon.jit
def _merge_rows(out, lse, o_a, lse_a, row_o: gl.constexpr):
    """``(out, lse)`` of some rows merged with the ``(O_a, lse_a)`` an earlier launch stored for them
    (``_merge_load``): with ``lse = logaddexp(lse_a, lse_b)`` the softmax over both key sets is ``O =
    O_a exp(lse_a - lse) + O_b exp(lse_b - lse)``. A row neither launch allowed anything keeps 0 and
    -inf; a row only one of them did gets that one's values (weight 1, the other 0).
    ``out [M_WG, DV]`` fp32 (one head-dim piece), ``lse [M_WG]``."""
    mx = gl.maximum(lse_a, lse)
    mx_s = gl.where(mx == float("-inf"), 0.0, mx)
    w_a = gl.exp2((lse_a - mx_s) * LOG2E)  # [M_WG]: 0 where lse_a = -inf
    w_b = gl.exp2((lse - mx_s) * LOG2E)
    tot = w_a + w_b
    tot_s = gl.where(tot == 0.0, 1.0, tot)
    lse_new = gl.where(mx == float("-inf"), float("-inf"), mx_s + gl.log2(tot_s) * LN2)
    wa = gl.expand_dims(gl.convert_layout(w_a / tot_s, row_o), 1)
    wb = gl.expand_dims(gl.convert_layout(w_b / tot_s, row_o), 1)
    return o_a.to(gl.float32) * wa + out * wb, lse_new


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


@gluon.jit
def _fwd_consumer(WG: gl.constexpr, q_smem, k_smem, v_smem, p_smem, o_smem, ones_smem, bars, o_desc, Out, Lse,
                  LO, HI, RUN_START, RUN_END, work, qk_scale, Sq, stride_ob, stride_os, stride_oh,
                  HEAD_DIM_V: gl.constexpr, DQK0: gl.constexpr, DQK1: gl.constexpr, QK_USED: gl.constexpr,
                  DV0: gl.constexpr, DV1: gl.constexpr, BLOCK_N: gl.constexpr, NUM_IV: gl.constexpr,
                  NUM_STAGES: gl.constexpr, HAS_PARTIAL_TILES: gl.constexpr,
                  PINGPONG: gl.constexpr, STORE_TMA: gl.constexpr, CONSUMERS: gl.constexpr,
                  P_SMEM: gl.constexpr, O_OWN: gl.constexpr, PERSISTENT: gl.constexpr, O_IN_P: gl.constexpr,
                  SNAKE: gl.constexpr, POLY_EXP: gl.constexpr, MERGE: gl.constexpr,
                  MASK_HEAD: gl.constexpr, ROWSUM_MMA: gl.constexpr, PV_SYNC: gl.constexpr):
    """One consumer warpgroup: rows ``[WG * 64, WG * 64 + 64)`` of its CTA's query tile, or with
    ``PERSISTENT`` of each query tile its CTA takes from the work list (``_tile_plan``: tiles
    ``program_id, program_id + num_programs, ...``).

    ``q_smem``, ``k_smem``, ``v_smem``, ``o_desc``: tuples over the head-dim pieces (one, or two
    with ``DQK1`` / ``DV1 > 0``); ``p_smem``: the ``[CONSUMERS, M_WG, BLOCK_N]`` P buffers (read only
    with ``P_SMEM``); ``o_smem``: O's own staging buffers (``O_OWN``, else unused).

    The ring position continues across a CTA's tiles: ``g`` counts the key tiles consumed so far
    (stage ``g % NUM_STAGES``, phase ``(g // NUM_STAGES) & 1``), ``it`` the query tiles (Q's phase),
    ``sk`` the ping-pong token's turns. With one tile a CTA they are the constants 0 (the compiler
    folds them: no loop-carried registers in the consumers, whose 160 registers at three consumers
    leave none to spare)."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched = bars
    if WG == CONSUMERS - 1:
        if PINGPONG:
            # the token starts with consumer 0
            mbarrier.arrive(sched.index(0))
    if PERSISTENT:
        num_work, num_bh, num_heads_q, group_size, ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT = work
        g = 0
        sk = 0
        it = 0
        for k in range(0, gl.cdiv(num_work, gl.num_programs(0))):
            w = _work_index(k, SNAKE)
            if w < num_work:
                item = _tile_plan(w, num_bh, ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT, CONSUMERS)
                g, sk = _consume_tile(WG, item, w % num_bh, num_heads_q, g, sk, it, q_smem, k_smem, v_smem, p_smem,
                                      o_smem, ones_smem, bars, o_desc, Out, Lse, LO, HI, RUN_START, RUN_END, qk_scale,
                                      Sq, stride_ob, stride_os, stride_oh, HEAD_DIM_V, DQK0, DQK1, QK_USED, DV0, DV1,
                                      BLOCK_N, NUM_IV, NUM_STAGES, HAS_PARTIAL_TILES, PINGPONG, STORE_TMA, CONSUMERS,
                                      P_SMEM, O_OWN, PERSISTENT, O_IN_P, POLY_EXP, MERGE, MASK_HEAD, ROWSUM_MMA,
                                      PV_SYNC)
                it += 1
        # the last tile's O store must have read its buffer before the CTA ends
        tma.store_wait(0)
    else:
        # one tile a CTA, planned before the partitions split (``gluon_fwd_kernel``)
        start_m, r0, num_full, num_tiles, bh, num_heads_q, group_size = work
        _consume_tile(WG, (start_m, r0, num_full, num_tiles), bh, num_heads_q, 0, 0, 0, q_smem, k_smem, v_smem,
                      p_smem, o_smem, ones_smem, bars, o_desc, Out, Lse, LO, HI, RUN_START, RUN_END, qk_scale, Sq,
                      stride_ob, stride_os, stride_oh, HEAD_DIM_V, DQK0, DQK1, QK_USED, DV0, DV1,
                      BLOCK_N, NUM_IV, NUM_STAGES, HAS_PARTIAL_TILES, PINGPONG, STORE_TMA, CONSUMERS,
                      P_SMEM, O_OWN, PERSISTENT, O_IN_P, POLY_EXP, MERGE, MASK_HEAD, ROWSUM_MMA,
                                      PV_SYNC)
        if O_OWN:
            # O's own buffers: the tile's store is still in flight (staged in Q's buffers, the
            # epilogue has waited for it already)
            tma.store_wait(0)


@gluon.jit
def _kv_step(j, g, sk, WG: gl.constexpr, q, k_smem, v_smem, p_buf, ones_smem, p_op, acc, acc_l, m_i, l_i, r, n, e,
             r0, num_full, bars, offs_m, iv, s_zero, LO, HI, RUN_START, RUN_END, qk_scale, Sq, MASK: gl.constexpr,
             s_layout: gl.constexpr, p_layout: gl.constexpr, p1_layout: gl.constexpr, pl_layout: gl.constexpr,
             row_o: gl.constexpr, row_o1: gl.constexpr, row_l: gl.constexpr, DQK0: gl.constexpr,
             DQK1: gl.constexpr, QK_USED: gl.constexpr, DV1: gl.constexpr, BLOCK_N: gl.constexpr,
             NUM_IV: gl.constexpr, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr,
             P_SMEM: gl.constexpr, POLY_EXP: gl.constexpr, HOLD_IV: gl.constexpr, ROWSUM_MMA: gl.constexpr,
             PV_SYNC: gl.constexpr):
    """Step ``j >= 1`` of a query tile's key walk (``_consume_tile``): ``S_j = Q K_j^T`` issued, then
    ``P_{j-1} V_{j-1}`` beside it, ``S_j``'s softmax while that runs, O rescaled. ``MASK``: 0 no mask,
    1 the interval mask on partial runs only (a branch: ``HAS_PARTIAL_TILES``), 2 the interval mask
    always (``MASK_HEAD``'s peeled step 1). With ``ROWSUM_MMA`` the row sums ride with ``P V`` as one
    more GEMM (``acc_l``). Returns ``(acc, acc_l, m_i, l_i, p_op, r, n, e)``."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched = bars
    dtype: gl.constexpr = k_smem[0].dtype
    # async wgmma groups one P V step issues (one per V piece, one for the row sums): the wait for
    # S_j leaves them in flight
    NUM_PV: gl.constexpr = (2 if DV1 > 0 else 1) + (1 if ROWSUM_MMA else 0)
    st = (g + j) % NUM_STAGES
    pst = (g + j - 1) % NUM_STAGES
    _sched_wait(sched, WG, sk + j, PINGPONG)
    if PV_SYNC:
        # (config pv_sync) no overlap inside the warpgroup: P_{j-1} V_{j-1} first and finished, then S_j, so
        # P_{j-1}'s registers are free before S_j's accumulator is live (three consumers with register P within
        # their registers); the other warpgroups' GEMMs keep the tensor cores busy meanwhile
        mbarrier.wait(v_ready.index(pst), ((g + j - 1) // NUM_STAGES) & 1)
        acc = _pv(p_op, _index(v_smem, pst, DV1), acc, DV1, p1_layout, P_SMEM)
        if ROWSUM_MMA:
            acc_l = _rowsum_mma(p_op, ones_smem, acc_l, pl_layout, P_SMEM)
        acc, acc_l = _wait_pv(acc, acc_l, DV1, ROWSUM_MMA)
        mbarrier.arrive(v_empty.index(pst))
        mbarrier.wait(k_ready.index(st), ((g + j) // NUM_STAGES) & 1)
        s = _qk(q, _index(k_smem, st, DQK1), s_zero, DQK0, DQK1, QK_USED)
        _sched_pass(sched, WG, PINGPONG, CONSUMERS)
        s = warpgroup_mma_wait(0, deps=(s,))
    else:
        mbarrier.wait(k_ready.index(st), ((g + j) // NUM_STAGES) & 1)
        s = _qk(q, _index(k_smem, st, DQK1), s_zero, DQK0, DQK1, QK_USED)
        mbarrier.wait(v_ready.index(pst), ((g + j - 1) // NUM_STAGES) & 1)
        acc = _pv(p_op, _index(v_smem, pst, DV1), acc, DV1, p1_layout, P_SMEM)
        if ROWSUM_MMA:
            acc_l = _rowsum_mma(p_op, ones_smem, acc_l, pl_layout, P_SMEM)
        _sched_pass(sched, WG, PINGPONG, CONSUMERS)
        # S_j is done when at most the P V groups are still in flight
        s = warpgroup_mma_wait(NUM_PV, deps=(s,))
    mbarrier.arrive(k_empty.index(st))
    if MASK == 1:
        if r >= r0 + num_full:
            s = _mask_tile(s, offs_m, n, LO, HI, Sq, iv, s_layout, BLOCK_N, NUM_IV, HOLD_IV)
    elif MASK == 2:
        s = _interval_mask(s, offs_m, n, LO, HI, Sq, s_layout, BLOCK_N, NUM_IV)
    m_i, l_i, p, alpha = _softmax(s, m_i, l_i, qk_scale, POLY_EXP, ROWSUM_MMA)
    if not PV_SYNC:
        acc, acc_l = _wait_pv(acc, acc_l, DV1, ROWSUM_MMA)
        mbarrier.arrive(v_empty.index(pst))
    acc = _scale_rows(acc, alpha, row_o, row_o1, DV1)
    if ROWSUM_MMA:
        acc_l = acc_l * gl.expand_dims(gl.convert_layout(alpha, row_l), 1)
    # P_j into P_{j-1}'s place: the wait above has retired the P V that read it
    p_op = _p_operand(p, p_buf, dtype, p_layout, P_SMEM)
    r, n, e = _advance(r, n, e, RUN_START, RUN_END)
    return acc, acc_l, m_i, l_i, p_op, r, n, e


@gluon.jit
def _consume_tile(WG: gl.constexpr, item, bh, num_heads_q, g, sk, it, q_smem, k_smem, v_smem, p_smem, o_smem,
                  ones_smem, bars, o_desc, Out, Lse, LO, HI, RUN_START, RUN_END, qk_scale, Sq, stride_ob, stride_os,
                  stride_oh, HEAD_DIM_V: gl.constexpr, DQK0: gl.constexpr, DQK1: gl.constexpr,
                  QK_USED: gl.constexpr, DV0: gl.constexpr, DV1: gl.constexpr, BLOCK_N: gl.constexpr,
                  NUM_IV: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_PARTIAL_TILES: gl.constexpr,
                  PINGPONG: gl.constexpr, STORE_TMA: gl.constexpr, CONSUMERS: gl.constexpr,
                  P_SMEM: gl.constexpr, O_OWN: gl.constexpr, PERSISTENT: gl.constexpr, O_IN_P: gl.constexpr,
                  POLY_EXP: gl.constexpr, MERGE: gl.constexpr, MASK_HEAD: gl.constexpr,
                  ROWSUM_MMA: gl.constexpr, PV_SYNC: gl.constexpr):
    """One query tile of consumer ``WG`` (``_fwd_consumer``): ``item = (start_m, r0, num_full,
    num_tiles)`` (``_tile_plan``) of batch*head ``bh``; ring position ``g``, token turn ``sk`` and Q
    phase ``it`` at entry. Returns ``(g, sk)`` after it."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched = bars
    dtype: gl.constexpr = q_smem[0].dtype
    # Q's buffer is free once the tile's last S is computed, unless it stages O for the TMA store
    Q_EARLY: gl.constexpr = O_OWN or O_IN_P or not STORE_TMA
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DV0, 16])
    # P goes to the second GEMM from registers: the accumulator of S and the A operand of P V
    # hold the same elements in the same threads (k_width = 2 bf16 per 32-bit register)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    # the second V piece's accumulator (unused without one: DV1 == 0 never reads these)
    o1_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, max(DV1, 8), 16])
    p1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o1_layout, k_width=2)
    row_o1: gl.constexpr = gl.SliceLayout(1, o1_layout)
    # the row sums' accumulator (ROWSUM_MMA; unused without)
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWSUM_N, 16])
    pl_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, l_layout)

    start_m, r0, num_full, num_tiles = item
    row0 = start_m + WG * M_WG
    offs_m = row0 + gl.arange(0, M_WG, layout=row_s)  # [M_WG]
    m_i = gl.full([M_WG], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([M_WG], gl.float32, row_s)
    acc = (gl.zeros([M_WG, DV0], gl.float32, o_layout),)  # [M_WG, DV0]
    if DV1 > 0:
        acc = (acc[0], gl.zeros([M_WG, DV1], gl.float32, o1_layout))  # and [M_WG, DV1]
    acc_l = gl.zeros([M_WG, ROWSUM_N], gl.float32, l_layout)  # ROWSUM_MMA's row sums
    s_zero = gl.zeros([M_WG, BLOCK_N], gl.float32, s_layout)
    q = _index(q_smem, WG, DQK1)  # [M_WG, DQK0] (and [M_WG, DQK1])
    p_buf = p_smem.index(WG)  # [M_WG, BLOCK_N] (P_SMEM only)
    mbarrier.wait(q_ready.index(WG), it & 1)
    # the rows' key interval, held for the whole loop where a row has one and two consumers share
    # the registers (``_mask_tile``)
    HOLD_IV: gl.constexpr = HAS_PARTIAL_TILES and NUM_IV == 1 and CONSUMERS == 2
    iv = (offs_m, offs_m)  # never read unless HOLD_IV
    if HOLD_IV:
        iv = _row_interval(offs_m, LO, HI, Sq)

    if num_tiles > 0:
        r = r0
        n = gl.load(RUN_START + r)
        e = gl.load(RUN_END + r)
        # ---- step 0: S_0 and its softmax; there is no P V yet
        st = g % NUM_STAGES
        _sched_wait(sched, WG, sk, PINGPONG)
        mbarrier.wait(k_ready.index(st), (g // NUM_STAGES) & 1)
        s = _qk(q, _index(k_smem, st, DQK1), s_zero, DQK0, DQK1, QK_USED)
        _sched_pass(sched, WG, PINGPONG, CONSUMERS)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(st))
        if HAS_PARTIAL_TILES:
            if r >= r0 + num_full:
                s = _mask_tile(s, offs_m, n, LO, HI, Sq, iv, s_layout, BLOCK_N, NUM_IV, HOLD_IV)
        elif MASK_HEAD > 0:
            # the item's first key tile (of its first MASK_HEAD, the only partial ones; full ones pass
            # the rows' intervals whole): masked without a branch, which keeps the loop on the uniform
            # datapath (a branch on S anywhere does not: session 17)
            s = _interval_mask(s, offs_m, n, LO, HI, Sq, s_layout, BLOCK_N, NUM_IV)
        m_i, l_i, p, alpha = _softmax(s, m_i, l_i, qk_scale, POLY_EXP, ROWSUM_MMA)
        if O_IN_P:
            # the previous tile's O left through this P buffer: its TMA store must have read it
            tma.store_wait(0)
        p_op = _p_operand(p, p_buf, dtype, p_layout, P_SMEM)  # [M_WG, BLOCK_N]
        r, n, e = _advance(r, n, e, RUN_START, RUN_END)

        if MASK_HEAD == 2:
            # ---- step 1, out of the loop: the item's second key tile is masked without a branch too
            # (the plan gives every item that walks any key tile at least two: a fully masked
            # neighbour where it has one)
            acc, acc_l, m_i, l_i, p_op, r, n, e = _kv_step(
                1, g, sk, WG, q, k_smem, v_smem, p_buf, ones_smem, p_op, acc, acc_l, m_i, l_i, r, n, e, r0,
                num_full, bars, offs_m, iv, s_zero, LO, HI, RUN_START, RUN_END, qk_scale, Sq, 2, s_layout, p_layout,
                p1_layout, pl_layout, row_o, row_o1, row_l, DQK0, DQK1, QK_USED, DV1, BLOCK_N, NUM_IV, NUM_STAGES,
                PINGPONG, CONSUMERS, P_SMEM, POLY_EXP, HOLD_IV, ROWSUM_MMA, PV_SYNC)
        # ---- steps J0 .. T-1: S_j and P_{j-1} V_{j-1} in flight together
        J0: gl.constexpr = 2 if MASK_HEAD == 2 else 1
        for j in range(J0, num_tiles):
            acc, acc_l, m_i, l_i, p_op, r, n, e = _kv_step(
                j, g, sk, WG, q, k_smem, v_smem, p_buf, ones_smem, p_op, acc, acc_l, m_i, l_i, r, n, e, r0,
                num_full, bars, offs_m, iv, s_zero, LO, HI, RUN_START, RUN_END, qk_scale, Sq,
                1 if HAS_PARTIAL_TILES else 0, s_layout, p_layout, p1_layout, pl_layout, row_o, row_o1, row_l, DQK0,
                DQK1, QK_USED, DV1, BLOCK_N, NUM_IV, NUM_STAGES, PINGPONG, CONSUMERS, P_SMEM, POLY_EXP, HOLD_IV,
                ROWSUM_MMA, PV_SYNC)

        if Q_EARLY and PERSISTENT:
            # every S of the tile is done: the producer may load the next tile's Q while this
            # one's last P V and epilogue run
            mbarrier.arrive(q_empty.index(WG))
        # ---- the last P V
        lst = (g + num_tiles - 1) % NUM_STAGES
        _sched_wait(sched, WG, sk + num_tiles, PINGPONG)
        mbarrier.wait(v_ready.index(lst), ((g + num_tiles - 1) // NUM_STAGES) & 1)
        acc = _pv(p_op, _index(v_smem, lst, DV1), acc, DV1, p1_layout, P_SMEM)
        if ROWSUM_MMA:
            acc_l = _rowsum_mma(p_op, ones_smem, acc_l, pl_layout, P_SMEM)
        _sched_pass(sched, WG, PINGPONG, CONSUMERS)
        if MERGE:
            # the split launch's second half: these rows' (O, lse) over their full tiles, written by
            # the first launch, read while the last P V runs (earlier, held through the loop, they
            # cost two persistent consumers 56 B of spills: the loop's registers are full)
            o_a, lse_a = _merge_load(Out, Lse, bh, num_heads_q, row0, offs_m, Sq, stride_ob, stride_os, stride_oh,
                                     DV0, HEAD_DIM_V, o_layout)
        acc, acc_l = _wait_pv(acc, acc_l, DV1, ROWSUM_MMA)
        mbarrier.arrive(v_empty.index(lst))
    else:
        if Q_EARLY and PERSISTENT:
            mbarrier.arrive(q_empty.index(WG))
        if MERGE:
            o_a, lse_a = _merge_load(Out, Lse, bh, num_heads_q, row0, offs_m, Sq, stride_ob, stride_os, stride_oh,
                                     DV0, HEAD_DIM_V, o_layout)
    g += num_tiles
    # the token's turns: one per GEMM issue of the tile, num_tiles + 1 where it has any
    sk += num_tiles + (num_tiles > 0).to(gl.int32)

    # ---- epilogue: fully masked rows (l_i == 0) give out = 0, lse = -inf
    # the tile's batch and head only now, for the stores: computed before the loop they would hold
    # registers through it (three consumers at 160 have none to spare: ptxas, spills in the loop)
    b, h, _ = _tile_head(bh, num_heads_q, 1)
    if ROWSUM_MMA:
        # every column of the row-sum accumulator holds the row's sum
        l_i = gl.convert_layout(gl.max(acc_l, axis=1), row_s)
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
    out = _scale_rows(acc, 1.0 / l_safe, row_o, row_o1, DV1)  # [M_WG, DV0] (and [M_WG, DV1])
    if MERGE:
        # merged with this launch's (O, lse) over the partial tiles
        out, lse = _merge_rows(out[0], lse, o_a, lse_a, row_o)
        out = (out,)
    gl.store(Lse + bh.to(gl.int64) * Sq + offs_m, lse, mask=offs_m < Sq)
    if STORE_TMA:
        # O staged in shared memory for a TMA store (clipped at Sq and at HEAD_DIM_V), piece by
        # piece: its own buffers (O_OWN: the previous tile's store must have read them), or Q's,
        # no longer read (the launcher asks for STORE_TMA only where O's pieces fit Q's)
        if O_OWN:
            tma.store_wait(0)
            o0_smem = o_smem[0].index(WG)
        elif O_IN_P:
            # this warpgroup's P buffer (its last P V has retired: _wait_pv above); a tile without
            # key tiles wrote no P, so the previous tile's store may still be reading it
            tma.store_wait(0)
            o0_smem = _o_stage(p_buf, WG, p_smem, BLOCK_N, DV0, CONSUMERS)
        else:
            o0_smem = _o_stage(q[0], WG, q_smem[0], DQK0, DV0, CONSUMERS)
        o0_smem.store(out[0].to(dtype))
        if DV1 > 0:
            if O_OWN:
                o1_smem = o_smem[1].index(WG)
            else:
                o1_smem = _o_stage(q[1], WG, q_smem[1], DQK1, DV1, CONSUMERS)
            o1_smem.store(out[1].to(dtype))
        fence_async_shared()
        _store_box(o_desc[0], b, row0, h, 0, o0_smem, PERSISTENT)
        if DV1 > 0:
            _store_box(o_desc[1], b, row0, h, DV0, o1_smem, PERSISTENT)
        if not (O_OWN or O_IN_P):
            tma.store_wait(0)
            if PERSISTENT:
                # Q's buffer has staged O: only now may the next tile's Q land there
                mbarrier.arrive(q_empty.index(WG))
    else:
        # another output dtype (float32 partial outputs for context parallelism)
        o_base = Out + b.to(gl.int64) * stride_ob + h * stride_oh
        _store_piece(out[0], o_base, row0, Sq, stride_os, 0, DV0, HEAD_DIM_V, o_layout)
        if DV1 > 0:
            _store_piece(out[1], o_base, row0, Sq, stride_os, DV0, DV1, HEAD_DIM_V, o1_layout)
    return g, sk


@gluon.jit
def _load_q(q_desc, q_smem, q_ready, q_empty, b, start_m, h, it, DQK0: gl.constexpr, DQK1: gl.constexpr,
            CONSUMERS: gl.constexpr, PERSISTENT: gl.constexpr):
    """Q of one query tile, a 64-row piece per consumer, each into its buffer once that consumer
    has released it (``q_empty``: the first time round passes at once)."""
    for c in gl.static_range(CONSUMERS):
        mbarrier.wait(q_empty.index(c), (it & 1) ^ 1)
        mbarrier.expect(q_ready.index(c), _nbytes(q_desc))
        _load_box(q_desc, b, start_m + c * M_WG, h, q_ready.index(c), q_smem, c, DQK0, DQK1, PERSISTENT)


@gluon.jit
def _fwd_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, RUN_START, RUN_END, work,
                  BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, DQK0: gl.constexpr, DQK1: gl.constexpr,
                  DV0: gl.constexpr, DV1: gl.constexpr, CONSUMERS: gl.constexpr, PERSISTENT: gl.constexpr,
                  SNAKE: gl.constexpr):
    """The producer warp: its CTA's query tile, or with ``PERSISTENT`` each tile it takes from the
    work list (``_fwd_consumer``), through ``_produce_tile``."""
    if PERSISTENT:
        num_work, num_bh, num_heads_q, group_size, ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT = work
        g = 0
        it = 0
        for k in range(0, gl.cdiv(num_work, gl.num_programs(0))):
            w = _work_index(k, SNAKE)
            if w < num_work:
                item = _tile_plan(w, num_bh, ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT, CONSUMERS)
                b, h, h_kv = _tile_head(w % num_bh, num_heads_q, group_size)
                g = _produce_tile(item, b, h, h_kv, g, it, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars,
                                  RUN_START, RUN_END, BLOCK_N, NUM_STAGES, DQK0, DQK1, DV0, DV1, CONSUMERS,
                                  PERSISTENT)
                it += 1
    else:
        start_m, r0, num_full, num_tiles, bh, num_heads_q, group_size = work
        b, h, h_kv = _tile_head(bh, num_heads_q, group_size)
        _produce_tile((start_m, r0, num_full, num_tiles), b, h, h_kv, 0, 0, q_desc, k_desc, v_desc, q_smem,
                      k_smem, v_smem, bars, RUN_START, RUN_END, BLOCK_N, NUM_STAGES, DQK0, DQK1, DV0, DV1,
                      CONSUMERS, PERSISTENT)


@gluon.jit
def _produce_tile(item, b, h, h_kv, g, it, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, RUN_START,
                  RUN_END, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, DQK0: gl.constexpr,
                  DQK1: gl.constexpr, DV0: gl.constexpr, DV1: gl.constexpr, CONSUMERS: gl.constexpr,
                  PERSISTENT: gl.constexpr):
    """Loads of one query tile (``item``, ``_tile_plan``, of batch ``b``, head ``h``, KV head ``h_kv``;
    ring position ``g`` and Q phase ``it`` at entry): its Q (a 64-row piece per consumer) and K_j, V_j
    of its key tiles into the ring (descriptors and buffers are tuples over the head-dim pieces).
    Persistent: K_0 and V_0 first, then Q once the consumers have released the previous tile's,
    so that the ring keeps filling while they finish that tile. Returns the ring position after it."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched = bars
    start_m, r0, num_full, num_tiles = item
    if not PERSISTENT:
        # the CTA's one tile: nothing to overlap, Q first
        _load_q(q_desc, q_smem, q_ready, q_empty, b, start_m, h, it, DQK0, DQK1, CONSUMERS, PERSISTENT)
    r = r0
    n = gl.load(RUN_START + r)
    e = gl.load(RUN_END + r)
    for j in range(num_tiles):
        st = (g + j) % NUM_STAGES
        # the first round passes at once: a fresh barrier has "completed" the phase before 0
        ph = (((g + j) // NUM_STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(st), ph)
        mbarrier.expect(k_ready.index(st), _nbytes(k_desc))
        _load_box(k_desc, b, n * BLOCK_N, h_kv, k_ready.index(st), k_smem, st, DQK0, DQK1, PERSISTENT)
        mbarrier.wait(v_empty.index(st), ph)
        mbarrier.expect(v_ready.index(st), _nbytes(v_desc))
        _load_box(v_desc, b, n * BLOCK_N, h_kv, v_ready.index(st), v_smem, st, DV0, DV1, PERSISTENT)
        if PERSISTENT:
            if j == 0:
                _load_q(q_desc, q_smem, q_ready, q_empty, b, start_m, h, it, DQK0, DQK1, CONSUMERS, PERSISTENT)
        r, n, e = _advance(r, n, e, RUN_START, RUN_END)
    if PERSISTENT:
        if num_tiles == 0:
            # the consumers wait for Q on every tile, so an empty one gets it too
            _load_q(q_desc, q_smem, q_ready, q_empty, b, start_m, h, it, DQK0, DQK1, CONSUMERS, PERSISTENT)
    return g + num_tiles


@gluon.jit
def gluon_fwd_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    LO, HI, ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT, RUN_START, RUN_END,
    qk_scale,  # softmax_scale * log2(e)
    Sq, Sk, num_bh, num_heads_q, group_size, num_work,
    HEAD_DIM_QK: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_DQK: gl.constexpr,
    BLOCK_DV: gl.constexpr, BLOCK_N: gl.constexpr, NUM_IV: gl.constexpr,
    NUM_STAGES: gl.constexpr, HAS_PARTIAL_TILES: gl.constexpr, PINGPONG: gl.constexpr,
    STORE_TMA: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    SPLIT_D: gl.constexpr, CONSUMERS: gl.constexpr, P_SMEM: gl.constexpr, O_OWN: gl.constexpr,
    PERSISTENT: gl.constexpr, O_IN_P: gl.constexpr, SNAKE: gl.constexpr, POLY_EXP: gl.constexpr,
    MERGE: gl.constexpr, MASK_HEAD: gl.constexpr, ROWSUM_MMA: gl.constexpr, PV_SYNC: gl.constexpr = False,
):
    # the work list: num_work = query tiles * batch * heads, walked by every CTA from its program id
    # in steps of the grid (one step: a tile a CTA; a grid of one CTA per SM: persistent)
    # the batch*head of a non-persistent CTA's one tile (persistent: unused, whole-tensor
    # descriptors and per-tile heads)
    bh = 0
    if PERSISTENT:
        work = (num_work, num_bh, num_heads_q, group_size, ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT)
    else:
        # one tile a CTA: its plan computed once, before the partitions split (what they hold in
        # registers is then just these scalars)
        w = gl.program_id(0)
        bh = w % num_bh
        start_m, r0, num_full, num_tiles = _tile_plan(w, num_bh, ORDER, RUN_PTR, RUN_NFULL, RUN_COUNT, CONSUMERS)
        work = (start_m, r0, num_full, num_tiles, bh, num_heads_q, group_size)
    batch = num_bh // num_heads_q
    heads_kv = num_heads_q // group_size

    dtype: gl.constexpr = Q.dtype.element_ty
    # the head-dim pieces, decided once here (``head_pieces``): (BLOCK_D*, 0), one padded tile, or
    # with SPLIT_D where the dim splits, its two exact power-of-two pieces (96: 64 + 32)
    DQK0: gl.constexpr = _piece(HEAD_DIM_QK, BLOCK_DQK, SPLIT_D, 0)
    DQK1: gl.constexpr = _piece(HEAD_DIM_QK, BLOCK_DQK, SPLIT_D, 1)
    DV0: gl.constexpr = _piece(HEAD_DIM_V, BLOCK_DV, SPLIT_D, 0)
    DV1: gl.constexpr = _piece(HEAD_DIM_V, BLOCK_DV, SPLIT_D, 1)
    # the head-dim columns Q K^T covers on one padded tile: D_qk in 136..192 skips the last
    # (all-zero) quarter of its 256-wide tile (``_qk``); else the whole tile
    QK_USED: gl.constexpr = _qk_used(HEAD_DIM_QK, BLOCK_DQK)
    # the descriptors (``_piece_descs``): the true head dims as the tensors' shapes, the pieces
    # (padded ones: zero-filled, clipped on store) as the tiles; over the whole tensors when
    # persistent (made once for all the CTA's tiles), else over the CTA's head
    b, h, h_kv = _tile_head(bh, num_heads_q, group_size)
    q_desc = _piece_descs(Q, batch, Sq, num_heads_q, stride_qb, stride_qs, stride_qh, b, h, M_WG, HEAD_DIM_QK,
                          DQK0, DQK1, dtype, PERSISTENT)
    k_desc = _piece_descs(K, batch, Sk, heads_kv, stride_kb, stride_ks, stride_kh, b, h_kv, BLOCK_N, HEAD_DIM_QK,
                          DQK0, DQK1, dtype, PERSISTENT)
    v_desc = _piece_descs(V, batch, Sk, heads_kv, stride_vb, stride_vs, stride_vh, b, h_kv, BLOCK_N, HEAD_DIM_V,
                          DV0, DV1, dtype, PERSISTENT)
    o_desc = _piece_descs(Out, batch, Sq, num_heads_q, stride_ob, stride_os, stride_oh, b, h, M_WG, HEAD_DIM_V,
                          DV0, DV1, dtype, PERSISTENT)

    q_smem = _piece_buffers(CONSUMERS, M_WG, DQK0, DQK1, dtype)  # [CONSUMERS, M_WG, DQK*]
    k_smem = _piece_buffers(NUM_STAGES, BLOCK_N, DQK0, DQK1, dtype)  # [NUM_STAGES, BLOCK_N, DQK*]
    v_smem = _piece_buffers(NUM_STAGES, BLOCK_N, DV0, DV1, dtype)  # [NUM_STAGES, BLOCK_N, DV*]
    if P_SMEM:
        # P V from shared memory: one P buffer per consumer, in the layout wgmma reads an A from
        p_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M_WG, BLOCK_N], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, M_WG, BLOCK_N], p_shared)
    else:
        # P stays in registers: the consumers' argument lists are the same either way, so Q's
        # buffers stand in (never read as P; no shared memory allocated for it)
        p_smem = q_smem[0]
    if O_OWN:
        # O's own staging buffers: Q's are released for the next tile before the epilogue
        o_smem = _piece_buffers(CONSUMERS, M_WG, DV0, DV1, dtype)  # [CONSUMERS, M_WG, DV*]
    else:
        o_smem = q_smem  # stand-in, never read: O is staged in Q's buffers
    if ROWSUM_MMA:
        # the row sums on the tensor cores: P [M_WG, BLOCK_N] times a [BLOCK_N, ROWSUM_N] block of
        # ones, held K-major as [ROWSUM_N, BLOCK_N] (wgmma's own B layout, as K's tiles for Q K^T),
        # written once (the partitions start after it: the fence orders it for wgmma's reads)
        ones_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWSUM_N, BLOCK_N], dtype)
        ones_reg: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        ones_smem = gl.allocate_shared_memory(dtype, [ROWSUM_N, BLOCK_N], ones_shared,
                                              gl.full([ROWSUM_N, BLOCK_N], 1.0, dtype, ones_reg))
        fence_async_shared()
    else:
        ones_smem = q_smem[0]  # stand-in, never read
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    # Q's buffer per consumer: ready when its TMA bytes land, empty when the consumer is done with it
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], bar_layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], bar_layout)
    for w in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(w), count=1)
        mbarrier.init(q_empty.index(w), count=1)
    # every consumer releases a buffer before the producer refills it
    k_ready, k_empty = _ring(NUM_STAGES, CONSUMERS)
    v_ready, v_empty = _ring(NUM_STAGES, CONSUMERS)
    sched = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], bar_layout)
    for w in gl.static_range(CONSUMERS):
        mbarrier.init(sched.index(w), count=1)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched)

    # the consumers' arguments after their warpgroup index, and the producer's, spelled out per
    # partition: the list is built at compile time, one entry per warpgroup (Gluon 3.6 neither
    # concatenates argument tuples here nor keeps constexprs constexpr inside a passed tuple)
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_fwd_consumer, (0, q_smem, k_smem, v_smem, p_smem, o_smem, ones_smem, bars, o_desc, Out, Lse, LO, HI,
                             RUN_START, RUN_END, work, qk_scale, Sq, stride_ob, stride_os, stride_oh, HEAD_DIM_V, DQK0,
                             DQK1, QK_USED, DV0, DV1, BLOCK_N, NUM_IV, NUM_STAGES, HAS_PARTIAL_TILES, PINGPONG,
                             STORE_TMA, CONSUMERS, P_SMEM, O_OWN, PERSISTENT, O_IN_P, SNAKE, POLY_EXP, MERGE, MASK_HEAD,
                             ROWSUM_MMA, PV_SYNC)),
            (_fwd_consumer, (1, q_smem, k_smem, v_smem, p_smem, o_smem, ones_smem, bars, o_desc, Out, Lse, LO, HI,
                             RUN_START, RUN_END, work, qk_scale, Sq, stride_ob, stride_os, stride_oh, HEAD_DIM_V, DQK0,
                             DQK1, QK_USED, DV0, DV1, BLOCK_N, NUM_IV, NUM_STAGES, HAS_PARTIAL_TILES, PINGPONG,
                             STORE_TMA, CONSUMERS, P_SMEM, O_OWN, PERSISTENT, O_IN_P, SNAKE, POLY_EXP, MERGE, MASK_HEAD,
                             ROWSUM_MMA, PV_SYNC)),
            (_fwd_consumer, (2, q_smem, k_smem, v_smem, p_smem, o_smem, ones_smem, bars, o_desc, Out, Lse, LO, HI,
                             RUN_START, RUN_END, work, qk_scale, Sq, stride_ob, stride_os, stride_oh, HEAD_DIM_V, DQK0,
                             DQK1, QK_USED, DV0, DV1, BLOCK_N, NUM_IV, NUM_STAGES, HAS_PARTIAL_TILES, PINGPONG,
                             STORE_TMA, CONSUMERS, P_SMEM, O_OWN, PERSISTENT, O_IN_P, SNAKE, POLY_EXP, MERGE, MASK_HEAD,
                             ROWSUM_MMA, PV_SYNC)),
            (_fwd_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, RUN_START, RUN_END, work,
                             BLOCK_N, NUM_STAGES, DQK0, DQK1, DV0, DV1, CONSUMERS, PERSISTENT, SNAKE)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_fwd_consumer, (0, q_smem, k_smem, v_smem, p_smem, o_smem, ones_smem, bars, o_desc, Out, Lse, LO, HI,
                             RUN_START, RUN_END, work, qk_scale, Sq, stride_ob, stride_os, stride_oh, HEAD_DIM_V, DQK0,
                             DQK1, QK_USED, DV0, DV1, BLOCK_N, NUM_IV, NUM_STAGES, HAS_PARTIAL_TILES, PINGPONG,
                             STORE_TMA, CONSUMERS, P_SMEM, O_OWN, PERSISTENT, O_IN_P, SNAKE, POLY_EXP, MERGE, MASK_HEAD,
                             ROWSUM_MMA, PV_SYNC)),
            (_fwd_consumer, (1, q_smem, k_smem, v_smem, p_smem, o_smem, ones_smem, bars, o_desc, Out, Lse, LO, HI,
                             RUN_START, RUN_END, work, qk_scale, Sq, stride_ob, stride_os, stride_oh, HEAD_DIM_V, DQK0,
                             DQK1, QK_USED, DV0, DV1, BLOCK_N, NUM_IV, NUM_STAGES, HAS_PARTIAL_TILES, PINGPONG,
                             STORE_TMA, CONSUMERS, P_SMEM, O_OWN, PERSISTENT, O_IN_P, SNAKE, POLY_EXP, MERGE, MASK_HEAD,
                             ROWSUM_MMA, PV_SYNC)),
            (_fwd_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, RUN_START, RUN_END, work,
                             BLOCK_N, NUM_STAGES, DQK0, DQK1, DV0, DV1, CONSUMERS, PERSISTENT, SNAKE)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

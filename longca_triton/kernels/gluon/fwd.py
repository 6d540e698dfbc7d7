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
GEMMs run while one computes its softmax (D = 96's default on dense masks, persistent).

P through shared memory (``P_SMEM``, config ``p_smem``; FA3's ``MmaPV_is_RS = false``): instead of
converting P to the wgmma A layout in registers, each consumer stores it (stmatrix) into a
``[M_WG, BLOCK_N]`` shared buffer of its own and ``P V`` reads A from there. The store waits for the
previous ``P V`` (it read the same buffer) and is fenced for the async proxy; the compiler's barrier
analysis adds the warpgroup's named ``bar.sync`` before the wgmma. What it buys: P's registers are
free while the next tile's softmax runs, which lets three consumers fit 160 registers at D = 128
(the default there on dense masks, ``kernels/tuning/gluon.toml``).

Between consumers (FA3's ping-pong, ``PINGPONG``): one mbarrier per consumer hands a token round
robin, so a consumer issues its GEMMs only after the previous one has issued its own: the GEMMs
of one warpgroup then run while the others compute their softmax.

Persistent launch (``PERSISTENT``, config ``persistent``; FA3's persistent tile scheduler, static)
--------------------------------------------------------------------------------------------------
One CTA per SM walks the work list ``w = program_id, program_id + num_programs, ...`` (``w = rank *
batch*heads + bh``: query tiles heaviest first by ``ORDER``, heads fastest, ``_tile_plan``). What
it removes is a CTA's fixed cost, which weighs where rows walk few key tiles: a non-persistent CTA
makes its four descriptors (each written to global memory and fenced), waits for its Q and first K
tiles, and ends with the O store, all exposed. Persistent:

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

One tile a CTA (the default on most dense masks)
runs the same code with the ring position and phases the constants 0, per-head descriptors (the
CTA needs no batch or head index in its consumers, whose 160 registers at three consumers have
none to spare) and Q loaded first.

Out-of-range rows: Q rows >= Sq and K/V rows >= Sk are zero-filled by the TMA loads; the plan
puts a ragged last key tile in the partial list, whose mask (``hi <= Sk``) removes those keys;
the O store is clipped by the descriptor and the lse store is masked.

Head dims (as the dense kernels): ``HEAD_DIM_QK`` / ``HEAD_DIM_V`` are the true dims (multiples of 8 up
to 256, D_v may differ), ``BLOCK_DQK`` / ``BLOCK_DV`` their power-of-two tiles. The descriptors
take the true dim as the tensor's shape and the padded one as the block (``_piece_descs``): the
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
is full but for one key per row tile runs slower than full. Where partial tiles are
few, the launcher runs the full tiles in the kernel compiled without the mask path, then the partial
tiles in a second, persistent launch with ``MERGE``: it reads the first launch's ``O`` and ``lse`` of
its rows while the tile's last ``P V`` runs (``_merge_load``: the loads' latency hides behind it) and
its epilogue stores ``O = O_a exp(lse_a - lse) + O_b exp(lse_b - lse)`` with ``lse =
logaddexp(lse_a, lse_b)`` (``_merge_rows``; ``O_a`` is read back in q's dtype: one more rounding).
That second launch rereads Q and reads and rewrites O for every query tile it visits (its time is
mostly that traffic). ``MASK_HEAD`` (config ``mask_head``, 1 or 2) avoids it where a query
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
document's two edges).

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
-> 427 instructions; D = 64 423 -> 368). The default on D = 64's persistent launch; where the GEMMs
are longer (D = 96, 128) the narrow GEMM's cost on the tensor pipe outweighs the issue slots.

Split head dims (``SPLIT_D``, config ``split_d``)
-------------------------------------------------
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
)

from longca_triton.kernels.gluon.fwd_parts import (
    M_WG,
    ROWSUM_N,
    _advance,
    _load_box,
    _nbytes,
    _piece,
    _piece_buffers,
    _piece_descs,
    _qk_used,
    _ring,
    _tile_head,
    _tile_plan,
    _work_index,
)
from longca_triton.kernels.gluon.fwd_consumer import (
    _fwd_consumer,
)


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
    PERSISTENT: gl.constexpr, SNAKE: gl.constexpr,
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

    # one partition per consumer warpgroup (its index first), then the producer's: one comprehension,
    # so that every constexpr stays one (a list assigned to a name, or a list added to another,
    # would have its constants turned into tensors or ints)
    gl.warp_specialize([
        (_fwd_consumer, (wg, q_smem, k_smem, v_smem, p_smem, o_smem, ones_smem, bars, o_desc, Out, Lse, LO, HI,
                         RUN_START, RUN_END, work, qk_scale, Sq, stride_ob, stride_os, stride_oh, HEAD_DIM_V, DQK0,
                         DQK1, QK_USED, DV0, DV1, BLOCK_N, NUM_IV, NUM_STAGES, HAS_PARTIAL_TILES, PINGPONG,
                         STORE_TMA, CONSUMERS, P_SMEM, O_OWN, PERSISTENT, SNAKE, MERGE, MASK_HEAD, ROWSUM_MMA,
                         PV_SYNC)) if wg < CONSUMERS else
        (_fwd_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, RUN_START, RUN_END, work,
                         BLOCK_N, NUM_STAGES, DQK0, DQK1, DV0, DV1, CONSUMERS, PERSISTENT, SNAKE))
        for wg in (0, 1, 2, 3)[:CONSUMERS + 1]
    ], [4] * (CONSUMERS - 1) + [1], [CONSUMER_REGS] * (CONSUMERS - 1) + [PRODUCER_REGS])

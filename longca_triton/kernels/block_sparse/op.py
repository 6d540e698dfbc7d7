r"""Block-sparse attention in Triton (uniform and variable blocks): forward, backward, GQA, lse.

Math
----
A ``BlockSparseMask`` cuts queries at ``q_bounds`` and keys at ``k_bounds`` and keeps, per pattern
``p``, the block pairs where ``block_map[p, I, J]`` is set. Query head ``h`` uses pattern
``p(h) = h // (Hq / P)`` and KV head ``h // (Hq / Hkv)``. For query row ``i`` (in block ``I``)::

    s_ij  = softmax_scale * q_i . k_j          for j in a kept block J of row I
    lse_i = log sum_j exp(s_ij)                (-inf when row I keeps no block)
    o_i   = sum_j exp(s_ij - lse_i) v_j        (0 when row I keeps no block)

Backward, with ``dO`` (and ``dlse`` when the caller differentiates through lse)::

    delta_i = rowsum(dO_i * o_i) - dlse_i
    dv_j   += sum_i p_ij dO_i
    ds_ij   = p_ij (dO_i . v_j - delta_i)
    dq_i    = softmax_scale * sum_j ds_ij k_j
    dk_j   += softmax_scale * sum_i ds_ij q_i  (summed over the query heads of a KV head)

Everything runs in the log2 domain (``exp2``, scores times ``softmax_scale * log2 e``), fp32
accumulators, natural-log lse stored as float32 ``[B, Hq, Sq]``.

Tiling
------
One tile grid serves uniform and variable blocks (``block_sparse_tables.py`` builds it on the
GPU): every block is processed in sub-tiles of a fixed size, each carrying its valid length.

* A *row tile* is ``BLOCK_M`` consecutive query rows inside one query block (the block's last
  sub-tile may be short: its missing rows load as zeros and are never stored). With GQA and a
  pattern shared by several query heads, ``HEADS`` heads are stacked into one tile of
  ``HEADS * BLOCK_M`` rows (their rows share both the key list and the K/V head), which turns
  64-row blocks into 128-row matrix products. (An option, ``HEADS``: on an H100 it measured
  slower than one head per 64-row tile with 4 warps, so the defaults leave it at 1.)
* Its key list is the runs of kept key blocks cut into ``BLOCK_N`` tiles ``[start, end)``. Only a
  tile shorter than ``BLOCK_N`` (a run's ragged tail, or the last block of a ragged ``Sk``) needs
  masking; when every block is a multiple of ``BLOCK_N`` (uniform blocks) the mask is compiled
  out (``EVEN_N``) and the loop is a plain flash-attention loop over an index list.

Variable blocks cut into fixed tiles leave ragged pieces that cost whole tiles (mean-256 blocks at
64 x 64: the tiles' area is 1.23x the kept area). Two options cut that (``block_sparse_tables``):

* packed lists (``pack_list`` / ``dq_pack_list`` / ``dkdv_pack_list``): a list's runs laid end to
  end and cut into full tiles, so only its last tile is short; a tile may cross from one run into
  the next, its rows then gathered by pointer loads (``PACKED``). Only the list's last entry may be
  short, so an entry's valid count comes from the loop index, not from a load (a load mask read
  from the table inside the loop held the pipeliner back: dK/dV 64.8 -> 57.1 ms at 32K / 0.3).
* tail row tiles (``tail_rows`` / ...): a block's remainder of at most that many rows runs in a
  second launch of smaller tiles, so the main launch keeps large tiles.

Measured on an H100 (mean 256 / min 128, GQA 64:8, D = 128, bf16, a pattern per KV head;
``experiments/results/h100/session16/``): the dK/dV pass with packed query lists and the row-major
sweep, the dQ pass in uniform block 128's 128 x 64 tiles with 64-row tails over plain key lists
(TMA boxes; gathered packed keys were no faster), the forward unchanged (its gathers lost to TMA
boxes: 289 vs 331 TFLOP/s). Backward 0.72-0.74x uniform block 128's at 32K / 64K, densities 0.3 /
0.5 (session 12: 0.67-0.72x). Variable blocks whose sizes are multiples of 128 run at 0.95-0.97x uniform:
what is left is the ragged tiles (their area 1.13x, and a gathered, masked step costing more than
a boxed one), not the variable structure. Session 21 (``experiments/results/h100/session21/``): the dQ
pass's 128-row tile holds four query heads of a GQA group x 32 positions where the group allows
(``VARBLOCK_DQ``: a block's remainder then wastes < 32 rows and needs no tail launch): +3-4 % back to
back, +5-10 % interleaved; through the harness 0.69-0.73x uniform (its sequential timer, within the spread
of session 20's). The dK/dV pass (1.4-1.6x uniform's time for 1.13x its area) is not issue-bound: 16 %
fewer instructions a step (its full entries unmasked) changed nothing. Session 22 (``experiments/results/h100/
session22/``): the dK/dV pass in uniform block 128's 128-key tile, head-major, with 64-key tails
(``VARBLOCK_DKDV``: +1 to +6 %), and uniform blocks' dK/dV steps read their stats by TMA boxes
(``dkdv_stats_tma``: +3 to +8 %); through the harness 0.70-0.73x uniform (both sides gained), block 128 1.11-1.15x
Flex in all eight cases. Session 25 (an H200, ``experiments/results/h200/session25/``): each dQ list's key-run
remainders of <= 32 keys last, in 32-key tiles (``dq_short_keys``, ``block_sparse_tables`` ``short_cols``): +0.9 /
+1.1 % interleaved; through the harness 0.748-0.769x uniform (0.745-0.756 before it on the same GPU). Session 26
(H200, ``experiments/results/h200/session26/``): the launches timed apart (``experiments/gpu/varblock_parts.py``) add
up to the backward (32K / 0.3: dK/dV main 45.5 ms, its 64-key tails 9.0, dQ 29.9, backward 84.7), and without the
dK/dV tails the backward takes 70.4 ms (uniform block 128: 63.1): the key blocks' remainders are the largest part
left (the tail launch is memory-bound: L2 hit rate 27 %). The backward's programs are ordered by their lists' steps
(``order_by_steps``: a block's short last tile beside its full ones, +2.6 to +3.2 % back to back, +1.9 to +4.8 %
under every timer) and the dK/dV tails run first on the side stream (``dkdv_tail_order`` 2); through the harness
0.774-0.801x uniform. Session 27 (CPU only, not timed): the tails can step 128 query rows on 8 warps with query-major
scores (``dkdv_tail_cols``: sm_90a 515 instructions a step for 128 x 64 scores, one exponential each; the key-major
64 x 64 tile on 8 warps computes each twice) and run in the main dK/dV launch, each after its block's last main
tile (``dkdv_tail_order`` 3, ``block_sparse_bwd_dkdv_merged_kernel``): one CTA an SM either way (181 KB), the main
loop unchanged; ``dkdv_qmajor`` does the same for the main tiles where a step has >= 64 rows a warpgroup.
Session 28 (H200, ``experiments/results/h200/session28/``, through the harness, each config a backend named with its
launch config, timed back to back): the tails query-major at 64 query rows on their own 4 warps (``dkdv_tail_cols``
64) +0.3 to +1.4 % (7 of 8, both orders), the default since; 128 rows on 8 warps even; the tails in the main launch
3-4 % behind. Variable blocks, both sides in one harness call: 0.803 / 0.801x uniform at 32K, 0.790 / 0.786x at
64K (densities 0.3 / 0.5). Session 29 (H200, ``experiments/results/h200/session29/``): the dK/dV lists' whole
contiguous entries first, walked as uniform blocks' even, unpacked steps with the stats by TMA boxes
(``dkdv_full_first``, ``block_sparse_tables`` ``full_first``: 440 instructions a main step against 661; session 21's
unmasked full entries, on the 64 x 64 tile and with the stats by pointers, had changed nothing): +2.9 to +4.8 %
through the harness in both orders, **0.836 / 0.832x uniform at 32K, 0.814 / 0.816x at 64K**; the same split of the
dQ lists (``dq_full_first``) lost 3-6 % and is not a default.

Kernels
-------
* ``block_sparse_fwd_kernel``: one program per (row tile, head pack): online softmax over the list.
* ``delta``: the shared preprocess (``core.bwd_preprocess_kernel`` via ``dense.launch_bwd_preprocess``).
* ``block_sparse_bwd_dkdv_kernel``: key-major. One program per (key tile, KV head) walks, for
  every query head of its group, the transposed list (kept query-block runs cut into ``BLOCK_M``
  sub-tiles); dK/dV accumulate in registers and are written once: no atomics.
* ``block_sparse_bwd_dq_kernel``: query-major, like the forward.
* opt-in ``one_launch``: both program sets in one launch (``block_sparse_bwd_one_launch_kernel``),
  as in ``dense.py``; off by default (dense: 0.89-0.96x of two kernels at best).

Backward measured (H100, block 128, GQA 64:8, D = 128, ``experiments/results/h100/bwd_order/``):
330-336 TFLOP/s at S = 32K, density 0.3, one pattern per KV head (0.84-0.86x Flex's block-sparse
backward), 321 at 64K / 0.5 (0.86x), 338 at 64K / 0.3 with one pattern for all heads (0.98x). Five
other dK/dV / dQ tiles measured slower, and Q / dO through tensor descriptors (one head per tile)
instead of pointer loads measured the same (330 vs 333): the gap to Flex is not in those loads.
It was in *when* they are issued (session 13, ``experiments/results/h100/bwd_session13/``): a step's
tile address came from a table load in the same loop, so the pipeliner issued each tile one step
ahead at most, after the step's GEMMs, and the dQ pass spent 24 % of its stall samples waiting for
its K / V tiles. The lists are now read in register chunks (``dq_list_chunk`` / ``dkdv_list_chunk``,
``core.list_chunk``), the loads are prefetched two steps ahead at three stages, and the backward is
2-5 % faster: 32K density 0.3 per KV head 69.8 ms (Flex 66.3), one pattern 64.7 (66.6), 0.5 113.9
(111.9), 64K 0.5 485.6 (469.4). The forward reads its list the same way with a third stage:
10-13 % faster at block 128 (32K / 0.3: 20.6 ms, Flex 26.3), 8 % at block 64, 4 % on variable blocks.
Session 20 (``experiments/results/h100/session20/``): the dQ launches on a second stream beside dK/dV's
(``bwd_streams``, +0.2-2.4 %) and a KV head's dK/dV programs in its own pattern's order
(``dkdv_pattern_order``, +0.2-4 %, at block 64 +4.6-7.2 %: the per-KV-head case's dK/dV pass had been
8 % slower than one pattern's); through the harness the backward is then 1.06-1.11x Flex's in all eight block-128 cases
(32K / 64K, densities 0.3 / 0.5, a pattern per KV head or one for all).

K/V tiles are read through tensor descriptors (TMA on Hopper; arbitrary start rows, zero fill past
``Sk``); Q / dO tiles (possibly stacked from several heads, possibly short) through pointer
loads with row masks. Launch order: row tiles heaviest first, head packs fastest-varying.

Head dims: ``q, k`` share ``D_qk`` and ``v`` may have its own ``D_v`` (multiples of 8 up to 256),
in tiles padded to powers of two: K/V by their descriptors, Q / dO / the outputs by pointer
accesses masked on the head dim only when it is padded.

Entry points: ``block_sparse_attention(q, k, v, mask, softmax_scale=None, return_lse=False,
config=None)`` (alias ``varblock_attention``; autograd), the ``torch.library`` ops
``longca_triton::block_sparse_attention_fwd`` / ``_bwd`` behind ``block_sparse_attention_op`` and
``block_sparse_attention_from_tables`` (``torch.compile``), the launchers ``block_sparse_fwd`` /
``block_sparse_bwd`` and ``tables_for`` / ``table_build_time`` for the GPU-built tables.
Shapes: ``q [B, Sq, Hq, D_qk]``, ``k [B, Sk, Hkv, D_qk]``, ``v [B, Sk, Hkv, D_v]``, unit last
stride; ``out [B, Sq, Hq, D_v]``.

Files: ``block_sparse_fwd.py`` / ``block_sparse_bwd.py`` (kernels), ``block_sparse_tables.py``
(the GPU-built tables and their cache); shared pieces in ``core.py``; this file: configs,
launchers, autograd, ``torch.library`` ops and the public functions.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from longca_triton.kernels.core.autograd import attention_function, fake_bwd, fake_fwd, register_op_autograd
from longca_triton.kernels.core.runtime import bsh_strides as _bsh_strides
from longca_triton.kernels.core.runtime import check_qkv as _check_qkv
from longca_triton.kernels.core.runtime import config_head_dim, head_dim_meta
from longca_triton.kernels.core.runtime import descriptor_ready as _descriptor_ready
from longca_triton.kernels.core.runtime import ensure_allocator as _ensure_allocator
from longca_triton.kernels.core.runtime import interpreting as _interpreting
from longca_triton.kernels.core.runtime import resolve_scale as _resolve_scale
from longca_triton.kernels.core.runtime import side_stream
from longca_triton.kernels.block_sparse.bwd import (
    block_sparse_bwd_dkdv_kernel,
    block_sparse_bwd_dkdv_merged_kernel,
    block_sparse_bwd_dq_kernel,
    block_sparse_bwd_one_launch_kernel,
)
from longca_triton.kernels.block_sparse.fwd import block_sparse_fwd_kernel
from longca_triton.kernels.block_sparse.plan import SideTables, get_merged_tail, get_side_tables, table_build_ms
from longca_triton.kernels.core import config as _config_mod
from longca_triton.kernels.core.config import ConfigSpec, check_bwd_layout, check_dkdv_sweep, with_one_launch_defaults
from longca_triton.kernels.core.config import resolve as _resolve
from longca_triton.kernels.dense.op import launch_bwd_preprocess

__all__ = [
    "block_sparse_attention", "varblock_attention", "block_sparse_attention_op",
    "block_sparse_attention_from_tables", "default_config", "resolve_config",
    "tables_for", "table_build_time", "tile_sizes", "block_sparse_fwd",
    "block_sparse_bwd", "BlockSparseAttentionFunction", "CONFIG_KEYS",
]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# ----------------------------------------------------------------------------------------------
# Launch configs
# ----------------------------------------------------------------------------------------------

#: keys of a config dict. ``BLOCK_M`` rows per head and ``HEADS`` stacked heads make a row tile of
#: ``HEADS * BLOCK_M`` rows; ``BLOCK_N`` keys per key tile. ``DQ_*`` for the dQ pass (query-major),
#: ``DKDV_*`` for dK/dV (a program owns ``DKDV_BLOCK_N`` keys and steps over ``DKDV_HEADS *
#: DKDV_BLOCK_M`` query rows). ``HEADS`` values are upper bounds: the launcher lowers them to what
#: the head layout allows (heads stacked in a tile must share the pattern and the KV head).
#: ``one_launch``: the dK/dV and dQ program sets in one launch (``bwd_order``, ``bwd_num_warps``,
#: ``bwd_num_stages``: as in ``dense.py``), off until measured. ``dkdv_sweep`` (0 head-major, 1
#: row-major, 2 row-major descending: ``dense.py``'s key) applies where the whole GQA group shares one
#: block pattern (a pattern per KV head or one for all heads); elsewhere the kernel stays head-major.
#: ``dkdv_head_outer``: the dK/dV grid with the KV head slowest (``block_sparse_bwd._dkdv_program``).
#: The sweep measured slower here (H100, block 128, dK/dV 58.1 vs 51.1 ms at 32K / 0.3 per KV head, 218 vs
#: 192 at 64K one pattern: ``experiments/results/h100/bwd_sweep/``), so the default is 0.
#: ``pack_list`` (forward) / ``dq_pack_list`` / ``dkdv_pack_list``: pack the pass's lists (runs of kept
#: blocks laid end to end, cut into full tiles: ``block_sparse_tables``) where the column blocks allow it
#: (at least a tile long) and it changes anything (variable blocks). The forward and dQ passes then
#: gather K/V rows by pointer loads instead of TMA boxes; dK/dV reads q / dO by pointers either way.
#: ``bwd_streams``: the dQ pass's launches on a second CUDA stream beside dK/dV's (``dense.py``'s key).
#: ``dkdv_pattern_order``: a KV head's dK/dV programs heaviest first by its own pattern's lists rather than
#: by the work summed over all patterns (``block_sparse_bwd._dkdv_program``; where a group shares a pattern).
#: ``dq_skew``: the dQ steps issue the previous step's ``dS K`` GEMM after their own ``S`` and ``dP`` (``core.
#: dq_skewed_scores``; unpacked key lists only, packed ones keep the plain step; the two-kernel layout, not
#: the one-launch kernel); the same bits.
#: ``order_by_steps``: the backward passes' programs ordered by their lists' entries alone, not entries times valid
#: rows (``block_sparse_tables``: a short tile runs as many steps as a full one; one block's tiles stay together, so
#: they read the same q / dO rows at about the same time). Variable blocks' default (session 26, H200: +2.6 to +3.2 %
#: back to back, +1.9 to +4.8 % under every timer); off for uniform blocks, whose tiles are all full (but a ragged
#: last block's), so it would change next to nothing there; the forward keeps its order.
#: ``dq_short_keys``: 0, or a key count below ``DQ_BLOCK_N``: the dQ pass walks each list's entries of at most
#: that many keys (a key run's remainder) after the others, in tiles of that many keys (``block_sparse_tables``
#: ``short_cols``; unpacked lists read entry by entry, two-kernel layout); the same sums in another order.
#: ``dkdv_full_first``: the dK/dV tables (main and tail) put each list's whole contiguous query entries first
#: (``block_sparse_tables`` ``full_first``) and the kernel walks them as an even, unpacked list (no row masks or
#: per-row selects, the stats by TMA boxes with ``dkdv_stats_tma``), the rest through the packed path; the same sums
#: in another order. Only changes ragged (variable-block) lists; head-major loop, entry by entry, two-kernel layout.
#: ``dq_full_first``: the same for the dQ tables (and their tails): whole contiguous key entries first, walked
#: without the key mask; unpacked lists read entry by entry, no ``dq_skew``, two-kernel layout. Not a default: on
#: variable blocks (sm_90a 296 instructions a step against 374) the backward lost 3-6 % (H200, session 29 call 1:
#: 325.9 / 326.7 / 319.4 / 319.3 -> 315.0 / 318.0 / 299.3 / 303.1 TFLOP/s; with ``dkdv_full_first`` as well 326.1 /
#: 330.8 / 307.1 / 312.6 against its 337.3 / 342.0 / 328.8 / 329.0): the dQ pass was not bound by its issue slots.
CONFIG_KEYS = (
    "BLOCK_M", "BLOCK_N", "HEADS", "num_warps", "num_stages", "warp_specialize",
    "DQ_BLOCK_M", "DQ_BLOCK_N", "DQ_HEADS", "dq_num_warps", "dq_num_stages",
    "DKDV_BLOCK_M", "DKDV_BLOCK_N", "DKDV_HEADS", "dkdv_num_warps", "dkdv_num_stages",
    "one_launch", "bwd_order", "bwd_num_warps", "bwd_num_stages", "dkdv_sweep", "dkdv_head_outer",
    "list_chunk", "dkdv_list_chunk", "dq_list_chunk", "pack_list", "dq_pack_list", "dkdv_pack_list",
    "tail_rows", "dq_tail_rows", "dkdv_tail_rows", "bwd_streams", "dkdv_pattern_order", "dkdv_stats_tma",
    "dq_skew", "dq_short_keys", "dkdv_tail_warps", "dkdv_tail_order", "order_by_steps", "dkdv_tail_cols",
    "dkdv_qmajor", "dkdv_full_first", "dq_full_first",
)

#: each pass's packing key
PACK_KEYS = {"fwd": "pack_list", "dq": "dq_pack_list", "dkdv": "dkdv_pack_list"}

#: ``tail_rows`` (forward) / ``dq_tail_rows`` / ``dkdv_tail_rows``: 0, or a tail tile size below the pass's
#: own row tile (forward ``BLOCK_M``, dQ ``DQ_BLOCK_M``, dK/dV ``DKDV_BLOCK_N`` keys): a block's remainder
#: of at most that many rows runs in a second launch of tiles that size (``block_sparse_tables``), with 4
#: warps (the dK/dV tails: ``dkdv_tail_warps``, 4 or 8) and the pass's column tile, stages and list reading.
#: Variable blocks only change with it. ``dkdv_tail_order`` places the dK/dV tail launch: 0 after the main dK/dV
#: launch on its stream, 1 first in the dQ chain (the side stream with ``bwd_streams``), 2 on the side stream
#: issued before the main dK/dV launch, 3 no launch of its own: the tail tiles in the main dK/dV launch, each
#: right after its block's last main tile (``block_sparse_tables.merge_tails``; on the main launch's warps and
#: stages; two-kernel layout, head-major loop). Outputs disjoint: the same bits in any order.
TAIL_KEYS = {"fwd": "tail_rows", "dq": "dq_tail_rows", "dkdv": "dkdv_tail_rows"}
TAIL_SIZES = (0, 16, 32, 64, 128)
#: ``dkdv_tail_cols``: 0, or the query rows a dK/dV tail step takes; then the tail steps compute their scores
#: query-major (``S = Q K^T`` [rows, keys], keys the N of every GEMM: ``block_sparse_bwd._dkdv_step``), so a
#: 64-key tail on 8 warps runs one exponential a score (key-major, its [64, rows] scores on two warpgroups are
#: computed twice)
TAIL_COLS = (0, 16, 32, 64, 128)

#: ``list_chunk`` (forward) / ``dkdv_list_chunk`` / ``dq_list_chunk`` values: 0 reads the pass's list
#: entry by entry inside its loop; otherwise the loop reads it in chunks of that many entries held in
#: registers (``core.list_chunk``; why: ``block_sparse_bwd._dq_program``). The row-major dK/dV sweep
#: (``dkdv_sweep`` 1 / 2) always reads its list entry by entry.
LIST_CHUNKS = (0, 16, 32, 64, 128)
#: ``dq_short_keys``: 0 (off) or the short entries' key tile
SHORT_KEYS = (0, 16, 32, 64)


def _pow2_le(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def _mask_block(mask) -> Optional[int]:
    """The uniform block size when it is a power of two >= 16, else None (variable blocks)."""
    ub = mask.uniform_block
    return ub if ub is not None and ub >= 16 and ub & (ub - 1) == 0 else None


#: Variable blocks' dQ tile at D <= 128 by the query heads it can stack (a power of two dividing the GQA
#: group and the heads of a pattern: ``_stack``): always 128 rows, ``DQ_HEADS`` heads x ``DQ_BLOCK_M``
#: positions. A block of L rows wastes its last tile's ``-L mod DQ_BLOCK_M`` rows, so finer positions
#: waste less at the same 128-row wgmma tile (one head: 128-row tiles and the remainders of <= 64 rows in
#: a launch of 64-row, 4-warp tiles, session 16). H100, mean 256 / min 128, GQA 64:8, a pattern per KV
#: head, D = 128, bf16, backward TFLOP/s interleaved (``experiments/results/h100/session21/``): 32K density
#: 0.3 default 273.8 / 64 x 2 heads 297.5 / 32 x 4 301.6 / 16 x 8 296.7; 64K 0.5 277.7 / 287.7 / 292.3 /
#: 287.6; 32K 0.5 280.4 / 294.9 / 299.4; mean 128 228.9 / 246.0 / 252.5; mean 512 312.2 / 328.3 / 325.0.
#: One config after the other (the harness's ``time_fn``, both orders, call 6): 32 x 4 +3 to +4 %. Measured
#: at D = 128 only; the padded head dims that take D = 128's tiles (80, 96) run the same tile shapes.
#: Session 26 (an H200, with ``dq_short_keys``; ``experiments/results/h200/session26/``): eight heads x 16
#: positions read ahead of 4 x 32 interleaved at 32K (density 0.3 84.72 -> 79.78 ms, 0.5 142.71 -> 137.23,
#: ``varblock_parts.py``; 310.0 -> 327.1 TFLOP/s through ``bwd_configs_ab.py``, checked, equal bits) but behind at
#: 64K (0.3 354.0 vs 358.2 ms, 0.5 577.8 vs 590.0), and under the harness's back-to-back timer (``timer_bias.py``,
#: call 5) within 1 % at 32K and 1-1.5 % behind at 64K: 4 x 32 stays (the autotuner's candidates include 8 x 16).
VARBLOCK_DQ = {
    4: dict(DQ_BLOCK_M=32, DQ_HEADS=4, dq_tail_rows=0),
    2: dict(DQ_BLOCK_M=64, DQ_HEADS=2, dq_tail_rows=0),
    1: dict(DQ_BLOCK_M=128, DQ_HEADS=1, dq_tail_rows=64),
}
#: the stack ``default_config`` assumes where the call's heads are not known (GQA groups of >= 4)
VARBLOCK_DQ_STACK = max(VARBLOCK_DQ)

#: Variable blocks' dK/dV pass at D <= 128: uniform block 128's tile (128 keys a program on 8 warps, 64 query rows
#: a step, 3 stages), a key block's remainder of <= 64 keys in a launch of 64-key tail tiles, head-major, each KV
#: head's programs in its own pattern's order, its packed query list read entry by entry (in register chunks the
#: three picks a step cost more than the prefetch gains: 0.95 / 1.00x). H100, mean 256 / min 128, GQA 64:8, a
#: pattern per KV head, D = 128, bf16, backward TFLOP/s interleaved with the session-16 default (64 x 64 / 4 warps /
#: 2 stages, row-major sweep 2), experiments/results/h100/session22/: 32K density 0.3 283.4 -> 298.3 and 285.9 ->
#: 289.5 (two calls), 64K 0.5 277.0 -> 294.1 and 277.3 -> 294.1; 4 stages 293.0 / 292.2, 2 stages 276.0 / 277.4,
#: plain lists 284.0 / 284.4, without the pattern order 284.7 / 284.8. The pass alone (32K / 0.3): 56.4 -> 52.3 ms,
#: its main tiles 44.5 and its tails 9.3 (the tails' 13 % of the area at 1.6x the main tiles' time per area:
#: 64-key tiles read each q / dO row for half the keys). The stats by TMA boxes (``dkdv_stats_tma``) apply to full,
#: unpacked entries only: on these packed lists a second box and two selects a value lost (0.88x / 0.97x).
#: Session 26 (H200, ``experiments/results/h200/session26/``): the tail launch is the largest part left (32K / 0.3:
#: 9.0 ms of 84.7 alone, the backward 70.4 without it; Nsight Compute: L2 hit rate 27 % against the main launch's
#: 61 %, DRAM 38 %, compute 37 %: its programs stream q / dO for 64 keys), and it runs first, on the side stream
#: before the main launch (``dkdv_tail_order`` 2: the main launch's programs fill its last waves): 32K density
#: 0.3 83.15 -> 82.47 ms, 0.5 143.15 -> 138.65 (interleaved, three rounds; 1: 83.26 / 141.93).
#: Session 28 (H200, ``experiments/results/h200/session28/``): the tails step their query rows query-major on their
#: own 4 warps, 64 rows a step (``dkdv_tail_cols`` 64: sm_90a 527 instructions a step against 735 key-major, two CTAs
#: an SM). Through the harness, each config a backend named with it, timed back to back (``--sequential``), checked
#: against float32, TFLOP/s at 32K 0.3 / 32K 0.5 / 64K 0.3 / 64K 0.5, two calls in the two orders: default 320.2 /
#: 323.8 / 312.5 / 315.2 and 321.9 / 321.6 / 315.2 / 317.0, with it 322.5 / 323.0 / 314.3 / 316.5 and 324.8 / 326.0 /
#: 316.0 / 318.6 (ahead in 7 of 8, +0.3 to +1.4 %). Not kept: 128 rows a step on 8 warps (320.0 / 322.0 / 309.7 /
#: 313.1) and those tails in the main launch after their block's last main tile (``dkdv_tail_order`` 3: 312.4 /
#: 310.8 / 299.9 / 302.1, 3-4 % behind; its programs lengthen the one-CTA-an-SM main launch).
#: Session 29 (H200, ``experiments/results/h200/session29/``): each list's whole contiguous query entries first,
#: walked as uniform blocks' even, unpacked steps with their stats by TMA boxes (``dkdv_full_first``; sm_90a: 440
#: instructions a main step against 661, the 64-key tails' 412 against 527), the rest (entries crossing into the next
#: run, a list's short last one) through the packed path. Through the harness, checked, back to back, TFLOP/s at 32K
#: 0.3 / 32K 0.5 / 64K 0.3 / 64K 0.5, two calls in the two orders: 325.9 / 326.7 / 319.4 / 319.3 -> 337.3 / 342.0 /
#: 328.8 / 329.0, and 322.9 / 328.5 / 317.7 / 319.9 -> 338.3 / 344.2 / 330.4 / 331.8 (+2.9 to +4.8 %, every case):
#: 0.836 / 0.832 / 0.814 / 0.816x uniform block 128 in the same session.
VARBLOCK_DKDV = dict(DKDV_BLOCK_M=64, DKDV_BLOCK_N=128, dkdv_num_warps=8, dkdv_num_stages=3, dkdv_tail_rows=64,
                     dkdv_sweep=0, dkdv_list_chunk=0, dkdv_pattern_order=True, dkdv_stats_tma=True, dkdv_tail_order=2,
                     dkdv_tail_cols=64, dkdv_full_first=True)


def default_config(mask, head_dim: int, dq_stack: int = VARBLOCK_DQ_STACK) -> dict:
    """Launch parameters for Hopper by block structure (and a small pinned one for the interpreter).
    ``head_dim``: the padded tile configs are chosen by (``_runtime.config_head_dim``). The backward
    runs as two kernels (``one_launch`` off, ``config.with_one_launch_defaults``). ``dq_stack``: the
    query heads a dQ tile of variable blocks can stack (``_stack`` of the call's GQA group and heads per
    pattern; ``resolve_config`` passes it where it has q and k), which picks ``VARBLOCK_DQ``'s entry."""
    return {"dkdv_sweep": 0, "dkdv_head_outer": True, "dkdv_pattern_order": False, "dkdv_stats_tma": False,
            "dq_skew": False, "dq_short_keys": 0, "pack_list": False,
            "dq_pack_list": True, "dkdv_pack_list": True, "tail_rows": 0, "dq_tail_rows": 0, "dkdv_tail_rows": 0,
            "dkdv_tail_warps": 4, "dkdv_tail_order": 0, "order_by_steps": False, "dkdv_tail_cols": 0,
            "dkdv_qmajor": False, "dkdv_full_first": False, "dq_full_first": False,
            **with_one_launch_defaults(_tile_config(mask, head_dim, dq_stack))}


def _tile_config(mask, head_dim: int, dq_stack: int = VARBLOCK_DQ_STACK) -> dict:
    if _interpreting():
        return dict(BLOCK_M=32, BLOCK_N=32, HEADS=2, num_warps=4, num_stages=1, warp_specialize=False,
                    DQ_BLOCK_M=32, DQ_BLOCK_N=32, DQ_HEADS=2, dq_num_warps=4, dq_num_stages=1,
                    DKDV_BLOCK_M=32, DKDV_BLOCK_N=32, DKDV_HEADS=2, dkdv_num_warps=4, dkdv_num_stages=1,
                    list_chunk=16, dkdv_list_chunk=16, dq_list_chunk=16)
    big = head_dim > 128
    blk = _mask_block(mask)
    if blk is not None and blk >= 128:
        # tile = block: 128 x 128 forward, 64 x 128 dK/dV (D > 128: halves). Reading the lists entry
        # by entry, a 128 x 128 / 8 warps / 2 stages dQ step beat 128 x 64 in all five cases on an H100
        # (experiments/results/h100/bwd_session12, bf16, GQA 64:8, D = 128, through autograd: 32K
        # density 0.3 76.4 -> 72.5 ms, 0.5 120.7 -> 115.8, one pattern 69.7 -> 66.4; 64K 304.3 -> 291.8,
        # one pattern 285.1 -> 270.2); with chunked lists (below) 128 x 64 at three stages is ahead.
        if big:
            return dict(BLOCK_M=64, BLOCK_N=64, HEADS=1, num_warps=8, num_stages=2, warp_specialize=False,
                        DQ_BLOCK_M=64, DQ_BLOCK_N=64, DQ_HEADS=1, dq_num_warps=8, dq_num_stages=2,
                        DKDV_BLOCK_M=32, DKDV_BLOCK_N=64, DKDV_HEADS=1, dkdv_num_warps=8, dkdv_num_stages=2,
                        list_chunk=0, dkdv_list_chunk=0, dq_list_chunk=0)
        # the lists read in register chunks, so each pass's loads are prefetched num_stages - 1 steps
        # ahead (``block_sparse_bwd._dq_program``), with a third stage in both passes: on an H100
        # (experiments/results/h100/bwd_session13) 32K density 0.3 70.97 -> 69.75 ms, 0.5 117.6 -> 113.9,
        # one pattern 66.2 -> 64.7, 64K density 0.5 509.4 -> 485.6 (2-5 %). The dQ pass then steps over
        # 64 keys (three 128-key stages do not fit beside Q and dO); chunked at two stages, or the
        # 128 x 128 dQ step, gain nothing (the prefetch stays one step). The forward likewise, with a
        # third 128-key stage (229.5 KiB of shared memory: it fits): 32K density 0.3 23.70 -> 20.58 ms,
        # 64K density 0.5 152.2 -> 136.4 (Flex 26.3 / 168.3); at two stages chunks alone lose (24.4).
        # bwd_streams: the dQ launch on a second stream beside dK/dV's fills the SMs of the dK/dV
        # kernel's last wave (2048 programs in ~15.5 waves at 32K). H100, a pattern per KV head,
        # interleaved with one stream (experiments/results/h100/session20/): 32K density 0.3 374.1 ->
        # 379.6 TFLOP/s, 0.5 376.9 -> 380.4, 64K 0.5 370.1 -> 370.8. dkdv_pattern_order: a KV head's key
        # tiles heaviest first by its own pattern (the summed order leaves each head's tiles in a
        # random order of their own work): 32K 0.3 389.9 -> 390.6, 0.5 391.4 -> 396.6, 64K 0.3 379.4
        # -> 394.5, 0.5 383.3 -> 393.9 (every round at 64K; same call). dkdv_stats_tma: a step's lse / delta by one
        # TMA box (core.stats_desc) instead of 35 four-byte cp.async a thread; H100, a pattern per KV head,
        # interleaved, equal bits (experiments/results/h100/session22/): 32K density 0.3 378.9 -> 391.6 and
        # 386.1 -> 416.2 TFLOP/s (two calls), 64K 0.5 391.7 -> 406.1; 32K 0.3 at D = 64 286.1 -> 308.8, at D = 96
        # 294.1 -> 307.8
        return dict(BLOCK_M=128, BLOCK_N=128, HEADS=1, num_warps=8, num_stages=3, warp_specialize=False,
                    list_chunk=64, DQ_BLOCK_M=128, DQ_BLOCK_N=64, DQ_HEADS=1, dq_num_warps=8, dq_num_stages=3,
                    DKDV_BLOCK_M=64, DKDV_BLOCK_N=128, DKDV_HEADS=1, dkdv_num_warps=8, dkdv_num_stages=3,
                    dkdv_list_chunk=64, dq_list_chunk=64, bwd_streams=True, dkdv_pattern_order=True,
                    dkdv_stats_tma=True)
    # 64-row blocks (or smaller) and variable blocks: 64 x 64 tiles, one head per tile. (Stacking
    # two heads of a GQA group into 128-row tiles measured slower on H100: fwd 411 vs 423, bwd 212
    # vs 314 TFLOP/s at block 64, S=64K, 32:4; kept as the HEADS option.)
    # The forward at 64 x 64 reads its list in register chunks with a third stage (H100,
    # bwd_session13: block 64, 64K density 0.5 164.4 -> 151.6 ms; variable blocks of mean 256, 32K
    # density 0.3, 32.6 -> 31.1; four stages 190.8 / 42.0); the backward passes do not (block 64:
    # 528 -> 567-588 ms chunked at three stages, one pass or both; variable blocks: equal).
    m = min(blk or 64, 64)
    n = min(blk or 64, 64)
    w = 4 if m <= 64 else 8
    chunked = m == 64 and n == 64
    cfg = dict(BLOCK_M=m, BLOCK_N=n, HEADS=1, num_warps=w, num_stages=3 if chunked else 2, warp_specialize=False,
               DQ_BLOCK_M=m, DQ_BLOCK_N=n, DQ_HEADS=1, dq_num_warps=w, dq_num_stages=2,
               DKDV_BLOCK_M=m, DKDV_BLOCK_N=n, DKDV_HEADS=1, dkdv_num_warps=w, dkdv_num_stages=2,
               list_chunk=64 if chunked else 0, dkdv_list_chunk=0, dq_list_chunk=0)
    if blk == 64 and not big:
        # a KV head's dK/dV programs in its own pattern's longest-first order (dkdv_pattern_order); H100, a
        # pattern per KV head, interleaved, equal bits (experiments/results/h100/session20/, call 15): 32K
        # density 0.3 341.1 -> 365.6 TFLOP/s, 64K 0.5 332.5 -> 347.7 (both rounds). bwd_streams does not pay
        # here (341.1 -> 341.3, 332.5 -> 326.6) and stays off
        # dkdv_stats_tma (its lse / delta by one TMA box a step, core.stats_desc): 32K density 0.3 378.5 -> 392.7,
        # 0.5 382.9 -> 395.8 (interleaved, equal bits; session22 call 12)
        cfg.update(dkdv_pattern_order=True, dkdv_stats_tma=True)
    if blk is None and not big:
        # variable blocks (H100, mean 256 / min 128, 32K density 0.3, a pattern per KV head, bf16, D = 128:
        # experiments/results/h100/session16/): the dK/dV pass walks packed query lists (71.5 -> 64.9 ms,
        # the tiles' area over the kept area 1.23 -> 1.13) with the row-major sweep (one list entry for the
        # group's eight heads in turn); the dQ pass takes uniform block 128's 128 x 64 tiles, a block's
        # remainder of <= 64 rows in 64-row tail tiles, plain (unpacked) key lists boxed by TMA, read in
        # register chunks (38.0 -> 34.6 ms). Whole backward 97.1 -> 90.4 ms (call 6), then with a packed
        # entry's count from the loop index dK/dV 57.1 ms, backward 91.2 ms against uniform block 128's 67.9
        # (call 8; calls differ by a few %); through the harness 0.72-0.74x uniform at 32K / 64K (call 11).
        # and bwd_streams (the dQ chain, main and tail tiles, beside dK/dV's): 269.8 -> 276.4 TFLOP/s at 32K /
        # 0.3 (session20). Session 21: the 128-row dQ tile stacks query heads (VARBLOCK_DQ), +5-10 %. Session 22
        # (VARBLOCK_DKDV): the dK/dV pass in uniform block 128's tile, 64-key tails, head-major. Session 23: the dQ
        # pass reads its key list entry by entry again (chunks were chosen in session 16 for one head's 128-row
        # tile and not re-measured on the stacked tile): H100, 32K density 0.3, in one process under every timer
        # (experiments/results/h100/session23/ call 11, timer_bias.py): back to back 291.1 / 285.4 -> 296.8 / 297.4
        # TFLOP/s, interleaved 282.5-285.5 -> 295.2-300.7; bwd_configs_ab (calls 6 / 8, with a fourth stage, which
        # alone changes nothing: call 10) +3.5 to +5.7 % at 32K / 64K, densities 0.3 / 0.5.
        # Session 25 (dq_short_keys): each dQ list's key-run remainders of <= 32 keys walked last in 32-key tiles
        # (the dQ tiles' area over the kept area 1.162 -> ~1.125 at 32K / 0.3 by the CPU count); H200, a pattern
        # per KV head, interleaved, three rounds each (experiments/results/h200/session25/ call 9): 32K density 0.3
        # 305.7 -> 308.5 TFLOP/s, 64K 0.5 305.3 -> 308.7 (+0.9 / +1.1 %, every round); 16-key tiles +0.4 / +0.5 %.
        # Session 26 (order_by_steps: the backward's programs by their lists' steps, so a block's short last tile
        # runs beside its full ones instead of among the light tiles at the end): H200, timer_bias.py (every timer,
        # both orders, one process; call 6): 32K density 0.3 313.4 / 309.3 -> 321.7 / 318.7 TFLOP/s back to back,
        # 64K 0.5 304.9 / 305.9 -> 313.9 / 315.8; interleaved +1.9 to +4.8 %.
        cfg.update(DQ_BLOCK_N=64, dq_num_warps=8, dq_num_stages=3, dq_list_chunk=0, dq_pack_list=False,
                   bwd_streams=True, dq_short_keys=32, order_by_steps=True, **VARBLOCK_DKDV,
                   **VARBLOCK_DQ[max(n for n in VARBLOCK_DQ if n <= dq_stack)])
    return cfg


_SPEC = ConfigSpec("block-sparse", CONFIG_KEYS,
                   tile_keys=("BLOCK_M", "BLOCK_N", "DQ_BLOCK_M", "DQ_BLOCK_N", "DKDV_BLOCK_M", "DKDV_BLOCK_N"),
                   pack_keys=("HEADS", "DQ_HEADS", "DKDV_HEADS"),
                   bool_keys=("warp_specialize", "one_launch", "dkdv_head_outer", "bwd_streams",
                              "dkdv_pattern_order", "dkdv_stats_tma", "dq_skew", "order_by_steps", "dkdv_qmajor",
                              "dkdv_full_first", "dq_full_first",
                              *PACK_KEYS.values()),
                   tuned_name=lambda mask: "triton-sparse" if _mask_block(mask) else "triton-varblock")


#: each pass's list-reading key and the launch keys it was measured with: a config (explicit or
#: cached) that sets a pass's tile, warps or stages but not its list key reads that list entry by
#: entry, as such configs were chosen before the key existed (chunks at two stages measured slower)
_CHUNK_PASSES = {
    "list_chunk": ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
    "dq_list_chunk": ("DQ_BLOCK_M", "DQ_BLOCK_N", "dq_num_warps", "dq_num_stages"),
    "dkdv_list_chunk": ("DKDV_BLOCK_M", "DKDV_BLOCK_N", "dkdv_num_warps", "dkdv_num_stages"),
}


def resolve_config(mask, head_dim: int, config: Optional[dict] = None, *, q=None, k=None, v=None,
                   heads: Optional[tuple] = None) -> dict:
    """``config``, else (given ``q, k``; ``v`` when its head dim differs) the autotune cache's entry,
    overlaid on ``default_config``; unknown keys and bad tile sizes raise ValueError
    (``config.resolve``), as does a ``bwd_order`` outside ``config.BWD_ORDERS``. A pass whose tile,
    warps or stages the config sets, without its list key, reads its list entry by entry
    (``_CHUNK_PASSES``); one that sets the dQ row tile without ``DQ_HEADS`` gets one head a tile
    (``VARBLOCK_DQ[1]``'s tails). Variable blocks' dQ stack follows the GQA group of q / k, or of ``heads``
    = ``(query heads, KV heads)`` where the tensors are not at hand (``VARBLOCK_DQ``)."""
    overlay = config if config is not None else _config_mod.tuned_config(_SPEC, q, k, mask, v)
    stack = VARBLOCK_DQ_STACK
    if q is not None and k is not None:
        heads = (q.shape[2], k.shape[2])
    if heads is not None:
        hq, hkv = heads
        stack = _stack(VARBLOCK_DQ_STACK, hq // hkv, hq // mask.num_patterns)
    base = default_config(mask, head_dim, stack)
    for chunk_key, launch_keys in _CHUNK_PASSES.items():
        if overlay and chunk_key not in overlay and any(key in overlay for key in launch_keys):
            base[chunk_key] = 0
    if overlay and "DQ_BLOCK_M" in overlay and "DQ_HEADS" not in overlay and base["DQ_HEADS"] > 1 \
            and not _interpreting():
        # a dQ row tile chosen without a stack (configs written before VARBLOCK_DQ) is one head's, with
        # the one-head tail tiles where they fit below it
        tail = VARBLOCK_DQ[1]["dq_tail_rows"]
        base.update(DQ_HEADS=1, dq_tail_rows=tail if overlay["DQ_BLOCK_M"] > tail else 0)
    if overlay and "DKDV_BLOCK_N" in overlay and "dkdv_tail_rows" not in overlay \
            and base["dkdv_tail_rows"] >= overlay["DKDV_BLOCK_N"]:
        # a dK/dV key tile chosen without a tail size (configs written before VARBLOCK_DKDV's 64-key tails) at or
        # below the default tail keeps its remainders in its own tiles, as it was measured
        base["dkdv_tail_rows"] = 0
    if overlay and "dq_short_keys" not in overlay and base["dq_short_keys"] and (
            overlay.get("dq_list_chunk") or overlay.get("dq_pack_list") or overlay.get("dq_skew")
            or overlay.get("one_launch") or overlay.get("DQ_BLOCK_N", base["DQ_BLOCK_N"]) <= base["dq_short_keys"]):
        # a config that walks the dQ lists another way (or in tiles no larger) keeps every entry in its own tile,
        # as it was written
        base["dq_short_keys"] = 0
    if overlay and "dkdv_full_first" not in overlay and base["dkdv_full_first"] and (
            overlay.get("dkdv_sweep") or overlay.get("dkdv_list_chunk") or overlay.get("one_launch")
            or overlay.get("dkdv_tail_order") == 3):
        # a config that walks the dK/dV lists another way (the sweep, chunks, one launch, the tails in the main
        # launch) walks them in one part, as it was written
        base["dkdv_full_first"] = False
    cfg = check_bwd_layout(_resolve(_SPEC, base, overlay or {}), "block-sparse attention")
    cfg = check_dkdv_sweep(cfg, "block-sparse attention")
    for key in ("list_chunk", "dkdv_list_chunk", "dq_list_chunk"):
        chunk = cfg[key]
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk not in LIST_CHUNKS:
            raise ValueError(f"block-sparse attention: config[{key!r}] must be one of {LIST_CHUNKS} (0: the list "
                             f"read entry by entry), got {chunk!r}")
    short = cfg["dq_short_keys"]
    if isinstance(short, bool) or not isinstance(short, int) or short not in SHORT_KEYS \
            or (short and short >= cfg["DQ_BLOCK_N"]):
        raise ValueError(f"block-sparse attention: config['dq_short_keys'] must be 0 or one of {SHORT_KEYS[1:]} below "
                         f"DQ_BLOCK_N ({cfg['DQ_BLOCK_N']}), got {short!r}")
    if short and (cfg["dq_list_chunk"] or cfg["dq_skew"] or cfg["dq_pack_list"] or cfg["one_launch"]):
        raise ValueError("block-sparse attention: config['dq_short_keys'] walks unpacked dQ lists entry by entry in the "
                         "two-kernel layout: it needs dq_list_chunk=0, dq_pack_list=False, dq_skew=False and "
                         f"one_launch=False (got {cfg['dq_list_chunk']}, {cfg['dq_pack_list']}, {cfg['dq_skew']}, "
                         f"{cfg['one_launch']})")
    if cfg["dkdv_tail_warps"] not in (4, 8) or isinstance(cfg["dkdv_tail_warps"], bool):
        raise ValueError(f"block-sparse attention: config['dkdv_tail_warps'] must be 4 or 8, got "
                         f"{cfg['dkdv_tail_warps']!r}")
    if cfg["dkdv_tail_order"] not in (0, 1, 2, 3) or isinstance(cfg["dkdv_tail_order"], bool):
        raise ValueError(f"block-sparse attention: config['dkdv_tail_order'] must be 0 (after the main dK/dV launch), "
                         f"1 (first in the dQ chain), 2 (on the side stream before the main dK/dV launch) or 3 (in the "
                         f"main dK/dV launch, after their blocks' main tiles), got {cfg['dkdv_tail_order']!r}")
    if cfg["dkdv_tail_order"] == 3 and (cfg["one_launch"] or cfg["dkdv_sweep"]):
        raise ValueError("block-sparse attention: config['dkdv_tail_order'] 3 (the dK/dV tails in the main dK/dV "
                         "launch) needs the two-kernel layout's head-major dK/dV loop: one_launch=False and "
                         f"dkdv_sweep=0 (got {cfg['one_launch']}, {cfg['dkdv_sweep']})")
    if cfg["dkdv_full_first"] and (cfg["one_launch"] or cfg["dkdv_sweep"] or cfg["dkdv_list_chunk"]
                                   or cfg["dkdv_tail_order"] == 3):
        raise ValueError("block-sparse attention: config['dkdv_full_first'] walks the dK/dV lists in two parts in the "
                         "two-kernel layout's head-major loop, entry by entry: it needs one_launch=False, dkdv_sweep=0, "
                         f"dkdv_list_chunk=0 and dkdv_tail_order != 3 (got {cfg['one_launch']}, {cfg['dkdv_sweep']}, "
                         f"{cfg['dkdv_list_chunk']}, {cfg['dkdv_tail_order']})")
    if cfg["dq_full_first"] and (cfg["one_launch"] or cfg["dq_list_chunk"] or cfg["dq_pack_list"] or cfg["dq_skew"]):
        raise ValueError("block-sparse attention: config['dq_full_first'] walks unpacked dQ lists entry by entry in the "
                         "two-kernel layout: it needs one_launch=False, dq_list_chunk=0, dq_pack_list=False and "
                         f"dq_skew=False (got {cfg['one_launch']}, {cfg['dq_list_chunk']}, {cfg['dq_pack_list']}, "
                         f"{cfg['dq_skew']})")
    if cfg["dkdv_qmajor"] and cfg["one_launch"]:
        raise ValueError("block-sparse attention: config['dkdv_qmajor'] (query-major dK/dV scores) is a key of the "
                         "two-kernel layout's dK/dV kernel: it needs one_launch=False")
    tc = cfg["dkdv_tail_cols"]
    if isinstance(tc, bool) or tc not in TAIL_COLS:
        raise ValueError(f"block-sparse attention: config['dkdv_tail_cols'] must be 0 (the dK/dV tails step by "
                         f"DKDV_BLOCK_M query rows, key-major scores) or one of {TAIL_COLS[1:]} (query rows a step, "
                         f"query-major scores), got {tc!r}")
    rows = tile_sizes(cfg)
    for name, key in TAIL_KEYS.items():
        tail = cfg[key]
        if isinstance(tail, bool) or tail not in TAIL_SIZES or (tail and tail >= rows[name][0]):
            raise ValueError(f"block-sparse attention: config[{key!r}] must be 0 or one of {TAIL_SIZES[1:]} below the "
                             f"pass's row tile ({rows[name][0]}), got {tail!r}")
    return cfg


def tile_sizes(cfg: dict) -> dict:
    """(rows a program owns, columns it steps over) per pass: the tables' tile sizes."""
    return {"fwd": (cfg["BLOCK_M"], cfg["BLOCK_N"]), "dq": (cfg["DQ_BLOCK_M"], cfg["DQ_BLOCK_N"]),
            "dkdv": (cfg["DKDV_BLOCK_N"], cfg["DKDV_BLOCK_M"])}



# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

def _stack(requested: int, group_size: int, heads_per_pattern: int) -> int:
    """Heads stacked in one tile: a power of two dividing both the GQA group and the heads of a
    pattern (so stacked heads share K/V and the key list), at most ``requested``."""
    g = math.gcd(group_size, heads_per_pattern)
    s = 1
    while s * 2 <= requested and g % (s * 2) == 0:
        s *= 2
    return s


def _check_inputs(q, k, v, mask):
    _check_qkv(q, k, v, "block-sparse attention")
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    if hq % mask.num_patterns:
        raise ValueError(f"the mask's {mask.num_patterns} patterns do not divide {hq} query heads")
    if mask.seqlen_q != sq or mask.seqlen_k != sk:
        raise ValueError(f"mask is {mask.seqlen_q} x {mask.seqlen_k} but q/k have Sq={sq}, Sk={sk}")
    if sq * hq * d >= 2**31:
        # the dK/dV loop addresses query rows with 32-bit offsets inside one batch entry
        raise ValueError(f"Sq * Hq * D = {sq * hq * d} >= 2^31 elements per batch entry; split the heads")


def tables_for(mask, cfg: dict, device) -> dict:
    """The tables one fwd+bwd needs (cached per mask, tile sizes, packing, device): ``fwd``, ``dq``,
    ``dkdv``, and for a pass with tail tiles (``TAIL_KEYS``) ``fwd_tail`` / ``dq_tail`` / ``dkdv_tail``."""
    ts, pack = tile_sizes(cfg), pack_flags(cfg)
    out = {}
    for name in ("fwd", "dq", "dkdv"):
        major, tail = "k" if name == "dkdv" else "q", int(cfg[TAIL_KEYS[name]])
        short = int(cfg["dq_short_keys"]) if name == "dq" else 0
        steps = bool(cfg["order_by_steps"]) and name != "fwd"
        full = name != "fwd" and bool(cfg[name + "_full_first"])
        out[name] = get_side_tables(mask, major, *ts[name], device, pack[name], "big" if tail else "all", tail, short,
                                    steps, full)
        if tail and name == "dkdv" and int(cfg["dkdv_tail_order"]) == 3:
            # the tails in the main launch: the tail table carries both tables' order (merge_tails)
            out[name + "_tail"] = get_merged_tail(mask, major, *ts[name], tail_cols(cfg, name), device, pack[name],
                                                  tail, short, steps)
        elif tail:
            out[name + "_tail"] = get_side_tables(mask, major, ts[name][0], tail_cols(cfg, name), device, pack[name],
                                                  "tail", tail, short, steps, full)
    return out


def tail_cols(cfg: dict, name: str) -> int:
    """The column step of pass ``name``'s tail tiles: the pass's own, or (dK/dV) ``dkdv_tail_cols`` query rows."""
    own = tile_sizes(cfg)[name][1]
    return (int(cfg["dkdv_tail_cols"]) or own) if name == "dkdv" else own


def pack_flags(cfg: dict) -> dict:
    """Whether each pass asks for packed lists (``PACK_KEYS``)."""
    return {name: bool(cfg[key]) for name, key in PACK_KEYS.items()}


def table_build_time(mask, head_dim: int, device, config: Optional[dict] = None, repeats: int = 5,
                     heads: Optional[tuple] = None) -> dict:
    """Median ms to build each table from scratch on ``device`` (fwd, dq, dkdv), cache bypassed; ``heads``
    (query heads, KV heads) as ``resolve_config`` takes it."""
    cfg = resolve_config(mask, head_dim, config, heads=heads)
    return table_build_ms(mask, tile_sizes(cfg), device, repeats, pack_flags(cfg), {"dq": cfg["dq_short_keys"]},
                          {name: cfg[name + "_full_first"] for name in ("dq", "dkdv")})


def _heads(q, k, mask):
    hq, hkv = q.shape[2], k.shape[2]
    return hq, hkv, hq // hkv, hq // mask.num_patterns


def block_sparse_fwd(q, k, v, mask, t: SideTables, softmax_scale: float, cfg: dict, tail: Optional[SideTables] = None):
    """Forward launch (and a second one over ``tail``'s row tiles, when given and not empty).
    Returns ``out [B, Sq, Hq, D_v]`` (q's dtype) and ``lse [B, Hq, Sq]`` float32."""
    q, k, v = (_descriptor_ready(x) for x in (q, k, v))
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    _, _, group, hpp = _heads(q, k, mask)
    out = torch.empty((b, sq, hq, v.shape[3]), device=q.device, dtype=q.dtype)
    lse = torch.empty((b, hq, sq), device=q.device, dtype=torch.float32)
    if b * hq * sq == 0:
        return out, lse
    _ensure_allocator(q.device)
    # the tail tiles: their own row size, one head a tile, 4 warps (TAIL_KEYS)
    for table, heads, warps in ((t, _stack(cfg["HEADS"], group, hpp), cfg["num_warps"]), (tail, 1, 4)):
        if table is None or table.num_tiles == 0:
            continue
        num_packs = b * hq // heads
        block_sparse_fwd_kernel[(table.num_tiles * num_packs,)](
            q, k, v, out, lse,
            *_bsh_strides(q, k, v, out),
            *table.lists(),
            softmax_scale * LOG2E,
            sq, sk, table.num_row_blocks, num_packs, hq, group, hpp,
            **head_dim_meta(q.shape[3], v.shape[3]), BLOCK_M=table.tile_rows, BLOCK_N=cfg["BLOCK_N"], HEADS=heads,
            EVEN_N=table.even_cols, WARP_SPEC=cfg["warp_specialize"], LIST_CHUNK=cfg["list_chunk"],
            PACKED=table.packed, num_warps=warps, num_stages=cfg["num_stages"],
        )
    return out, lse


def block_sparse_bwd(dout, q, k, v, out, lse, mask, tables: dict, softmax_scale: float, cfg: dict,
                     dlse=None, passes=("dkdv", "dq")):
    """Backward launches (delta, dK/dV, dQ; each pass's tail tiles in a launch of their own when
    ``tables`` has them: ``tables_for``). Returns ``dq, dk, dv`` in the inputs' dtype.

    ``passes`` picks the kernels to launch after the delta preprocess (for timing them apart);
    a skipped pass leaves its outputs uninitialised. With ``cfg["one_launch"]`` and both passes,
    one launch runs both program sets (``block_sparse_bwd_one_launch_kernel``) of the main tiles.
    """
    q, k, v, out, dout = (_descriptor_ready(x) for x in (q, k, v, out, dout))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    _, _, group, hpp = _heads(q, k, mask)
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)  # [B, Sq, Hq, D_qk]
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)  # [B, Sk, Hkv, D_qk]
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)  # [B, Sk, Hkv, D_v]
    dims = head_dim_meta(d, v.shape[3])
    if b * hq * sq * sk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    _ensure_allocator(q.device)
    lse = lse.contiguous()
    # the dK/dV steps' stats by TMA boxes (core.stats_desc): with one head a tile, on a table of full, unpacked
    # entries (uniform blocks; on variable blocks' packed lists the per-row selects cost more than the boxes save:
    # H100, session 22), not in the one-launch kernel (its dQ programs read lse itself)
    def full_entries(t: SideTables) -> bool:
        return (t.even_cols and not t.packed) or t.full_first  # full_first: the boxes on its full part

    stats_tma = (bool(cfg.get("dkdv_stats_tma", False)) and "dkdv" in passes and full_entries(tables["dkdv"])
                 and _stack(cfg["DKDV_HEADS"], group, hpp) == 1
                 and not (cfg["one_launch"] and set(passes) == {"dkdv", "dq"}))
    # delta = rowsum(dO * O) - dlse: the dense kernels' preprocess (same layout, same math); with stats_tma also
    # the [B, Hq, Sq, 4] rows (lse, delta, 0, 0) the dK/dV steps read by TMA boxes
    if stats_tma:
        delta, stats = launch_bwd_preprocess(out, dout, dlse, lse=lse)
    else:
        delta = launch_bwd_preprocess(out, dout, dlse)
    qk_scale = softmax_scale * LOG2E
    # a row-major dK/dV sweep walks one key list for every head of the group: only where they share it
    sweep = cfg.get("dkdv_sweep", 0) if hpp % group == 0 else 0
    head_outer = bool(cfg["dkdv_head_outer"])  # an int where the config came through the op's list
    # a KV head's key tiles in its own pattern's order: only where the whole group walks one pattern
    pattern_order = bool(cfg.get("dkdv_pattern_order", False)) and hpp % group == 0

    def launch_dkdv(tk: SideTables, heads: int, warps: int, qmajor: bool = False):
        # per table: a tail table of its own may not be full; query-major steps hold their rows' stats as two values
        # a thread, which the pointers load for less than a box costs (sm_90a: 408 against 431 instructions a step,
        # uniform block 64; 412 / 455 on variable blocks' 64-key tails)
        tma = stats_tma and heads == 1 and full_entries(tk) and not qmajor
        block_sparse_bwd_dkdv_kernel[(tk.num_tiles * b * hkv,)](
            q, k, v, dout, lse, delta, dk, dv,
            *_bsh_strides(q, k, v, dout, dk, dv),
            *tk.lists(),
            softmax_scale, qk_scale,
            sq, sk, tk.num_row_blocks, b * hkv, hq, hkv, group, hpp,
            **dims, BLOCK_M=tk.tile_cols, BLOCK_N=tk.tile_rows, HEADS=heads,
            EVEN_M=tk.even_cols, SWEEP=sweep, HEAD_OUTER=head_outer, LIST_CHUNK=cfg["dkdv_list_chunk"],
            PACKED=tk.packed, PATTERN_ORDER=pattern_order, STATS_TMA=tma, QMAJOR=qmajor,
            Stats=stats if tma else None, COL_FULL=tk.col_full,
            FULL_FIRST=tk.full_first, num_warps=warps, num_stages=cfg["dkdv_num_stages"],
        )

    def launch_dkdv_merged(tk: SideTables, tt: SideTables):
        # main and tail tiles in one launch (dkdv_tail_order 3): tt.order is both tables' order (merge_tails)
        block_sparse_bwd_dkdv_merged_kernel[((tk.num_tiles + tt.num_tiles) * b * hkv,)](
            q, k, v, dout, lse, delta, dk, dv,
            *_bsh_strides(q, k, v, dout, dk, dv),
            *tk.lists(), *tt.lists(),
            softmax_scale, qk_scale,
            sq, sk, tk.num_row_blocks, b * hkv, hq, hkv, group, hpp, tk.num_tiles,
            **dims, BLOCK_M=tk.tile_cols, BLOCK_N=tk.tile_rows, HEADS=dkdv_heads, TAIL_M=tt.tile_cols,
            TAIL_N=tt.tile_rows,
            EVEN_M=tk.even_cols, TAIL_EVEN_M=tt.even_cols, HEAD_OUTER=head_outer, LIST_CHUNK=cfg["dkdv_list_chunk"],
            PACKED=tk.packed, TAIL_PACKED=tt.packed, PATTERN_ORDER=pattern_order,
            QMAJOR=bool(cfg["dkdv_qmajor"]), TAIL_QMAJOR=tail_qmajor, num_warps=cfg["dkdv_num_warps"],
            num_stages=cfg["dkdv_num_stages"],
        )

    def launch_dq(tq: SideTables, heads: int, warps: int):
        num_packs = b * hq // heads
        block_sparse_bwd_dq_kernel[(tq.num_tiles * num_packs,)](
            q, k, v, dout, lse, delta, dq,
            *_bsh_strides(q, k, v, dout, dq),
            *tq.lists(), tq.ptr if tq.col_split is None else tq.col_split,
            softmax_scale, qk_scale,
            sq, sk, tq.num_row_blocks, num_packs, hq, group, hpp,
            **dims, BLOCK_M=tq.tile_rows, BLOCK_N=cfg["DQ_BLOCK_N"], HEADS=heads,
            EVEN_N=tq.even_cols, LIST_CHUNK=cfg["dq_list_chunk"], PACKED=tq.packed,
            SKEW=bool(cfg["dq_skew"]) and not tq.packed, SHORT_N=tq.short_cols, COL_FULL=tq.col_full,
            FULL_FIRST=tq.full_first, num_warps=warps, num_stages=cfg["dq_num_stages"],
        )

    tk, tq = tables["dkdv"], tables["dq"]
    dkdv_heads = _stack(cfg["DKDV_HEADS"], group, hpp)
    dq_heads = _stack(cfg["DQ_HEADS"], group, hpp)
    one_launch = cfg["one_launch"] and set(passes) == {"dkdv", "dq"}
    if one_launch:
        num_packs = b * hq // dq_heads
        n_dkdv, n_dq = tk.num_tiles * b * hkv, tq.num_tiles * num_packs
        block_sparse_bwd_one_launch_kernel[(n_dkdv + n_dq,)](
            q, k, v, dout, lse, delta, dk, dv, dq,
            *_bsh_strides(q, k, v, dout, dk, dv, dq),
            *tk.lists(), *tq.lists(),
            softmax_scale, qk_scale,
            sq, sk, tk.num_row_blocks, tq.num_row_blocks, b * hkv, num_packs, hq, hkv, group, hpp, n_dkdv, n_dq,
            **dims, DKDV_BLOCK_M=cfg["DKDV_BLOCK_M"], DKDV_BLOCK_N=tk.tile_rows, DKDV_HEADS=dkdv_heads,
            EVEN_M=tk.even_cols, DQ_BLOCK_M=tq.tile_rows, DQ_BLOCK_N=cfg["DQ_BLOCK_N"], DQ_HEADS=dq_heads,
            EVEN_N=tq.even_cols, DKDV_LIST_CHUNK=cfg["dkdv_list_chunk"], DQ_LIST_CHUNK=cfg["dq_list_chunk"],
            ORDER=cfg["bwd_order"], SWEEP=sweep, HEAD_OUTER=head_outer, DKDV_PACKED=tk.packed, DQ_PACKED=tq.packed,
            DKDV_PATTERN_ORDER=pattern_order, num_warps=cfg["bwd_num_warps"], num_stages=cfg["bwd_num_stages"],
        )
    # each pass's launches in order (main tiles, then its tail tiles: their own row size, one head a
    # tile, 4 warps or dkdv_tail_warps, TAIL_KEYS); with bwd_streams the dQ chain runs on a second stream beside
    # dK/dV's. dkdv_tail_order moves the dK/dV tail launch: 1 to the head of the dQ chain (issued after the main
    # dK/dV launch), 2 to the side stream issued before the main dK/dV launch (one stream: the host order alone)
    def has(name):  # the pass runs and its table has row tiles
        return name.split("_")[0] in passes and tables.get(name) is not None and tables[name].num_tiles > 0

    main = not one_launch
    dkdv_chain = ([lambda: launch_dkdv(tk, dkdv_heads, cfg["dkdv_num_warps"], bool(cfg["dkdv_qmajor"]))]
                  if main and "dkdv" in passes else [])
    dq_chain = [lambda: launch_dq(tq, dq_heads, cfg["dq_num_warps"])] if main and "dq" in passes else []
    if has("dq_tail"):
        dq_chain.append(lambda: launch_dq(tables["dq_tail"], 1, 4))
    first = []  # launched on the side stream before everything else
    # the tails' scores query-major with a step of their own (dkdv_tail_cols) or with the main tiles' (dkdv_qmajor)
    tail_qmajor = bool(cfg["dkdv_tail_cols"]) or bool(cfg["dkdv_qmajor"])
    if has("dkdv_tail") and int(cfg["dkdv_tail_order"]) == 3:
        # (resolve_config allows order 3 only in the two-kernel layout, so the main dK/dV launch is in the chain)
        dkdv_chain = [lambda: launch_dkdv_merged(tk, tables["dkdv_tail"])]
    elif has("dkdv_tail"):
        tail_launch = lambda: launch_dkdv(tables["dkdv_tail"], 1, int(cfg["dkdv_tail_warps"]),  # noqa: E731
                                          tail_qmajor)
        order = int(cfg["dkdv_tail_order"])
        if order == 0:
            dkdv_chain.append(tail_launch)
        elif order == 1:
            dq_chain.insert(0, tail_launch)
        else:
            first.append(tail_launch)
    both = "dkdv" in passes and "dq" in passes
    with side_stream(q.device, cfg["bwd_streams"] and both) as beside:
        with beside():
            for launch in first:
                launch()
        for launch in dkdv_chain:
            launch()
        with beside():
            for launch in dq_chain:
                launch()
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------


def _bs_fwd(q, k, v, mask, tables, softmax_scale, cfg):
    return block_sparse_fwd(q, k, v, mask, tables["fwd"], softmax_scale, cfg, tables.get("fwd_tail"))


def _bs_bwd(dout, dlse, q, k, v, out, lse, mask, tables, softmax_scale, cfg):
    return block_sparse_bwd(dout, q, k, v, out, lse, mask, tables, softmax_scale, cfg, dlse=dlse)


#: ``apply(q, k, v, mask, tables, softmax_scale, cfg) -> (out, lse)``
BlockSparseAttentionFunction = attention_function(
    "BlockSparseAttentionFunction", _bs_fwd, _bs_bwd,
    """``(q, k, v) -> (out, lse)``; mask, tables and config ride along as non-tensor arguments.""")


# ----------------------------------------------------------------------------------------------
# torch.library custom ops (for torch.compile): the tables travel as lists of int32 tensors
# ----------------------------------------------------------------------------------------------

#: per pass, the main table's 9 lists (row_start, row_end, row_block, order, ptr, col_start, col_end,
#: col_next, col_count), its col_split and col_full (each empty without one), then its tail table's
#: (``_op_lists``: row lists empty when the pass has none)
_TABLE_LEN = 22


class _Patterns:
    """What the launchers read off a mask: its number of patterns."""

    def __init__(self, num_patterns: int):
        self.num_patterns = int(num_patterns)


def _tables_from_tensors(ts, tile_rows: int, tile_cols: int, num_patterns: int, even_cols, packed,
                         short_cols: int = 0) -> SideTables:
    row_start, row_end, row_block, order, ptr, col_start, col_end, col_next, col_count, col_split, col_full = ts
    split = col_split.numel() > 0  # an empty one: no short entries split off (_op_lists)
    return SideTables(tile_rows=int(tile_rows), tile_cols=int(tile_cols),
                      num_row_blocks=(ptr.shape[0] - 1) // num_patterns, num_patterns=num_patterns,
                      row_start=row_start, row_end=row_end, row_block=row_block, order=order, ptr=ptr,
                      col_start=col_start, col_end=col_end, col_next=col_next, col_count=col_count,
                      even_rows=False, even_cols=bool(even_cols), build_ms=0.0, packed=bool(packed),
                      short_cols=int(short_cols) if split else 0, col_split=col_split if split else None,
                      col_full=col_full if col_full.numel() > 0 else None)


def _cfg_to_list(cfg: dict) -> list[int]:
    return [int(cfg[k]) for k in CONFIG_KEYS]


def _cfg_from_list(cfg_list) -> dict:
    cfg = dict(zip(CONFIG_KEYS, (int(x) for x in cfg_list)))
    cfg["warp_specialize"] = bool(cfg["warp_specialize"])
    cfg["one_launch"] = bool(cfg["one_launch"])
    for key in PACK_KEYS.values():
        cfg[key] = bool(cfg[key])
    return cfg


def op_meta(tables: dict, num_patterns: int) -> list[int]:
    """What the ops need to know of ``tables`` besides their tensors: ``[num_patterns, then even_cols
    and packed of the fwd, dq and dkdv tables, then the same of their tail tables]`` (a tail table may step by
    other columns than its main one: ``dkdv_tail_cols``; the main table's flags where there is none)."""
    names = ("fwd", "dq", "dkdv")
    return [int(num_patterns)] + [int(flag) for t in [tables[n] for n in names]
                                  + [tables.get(n + "_tail", tables[n]) for n in names]
                                  for flag in (t.even_cols, t.packed)]


def _op_lists(tables: dict, name: str) -> list[torch.Tensor]:
    """Pass ``name``'s main and tail tables as the ops carry them: each table's ``lists()`` and its
    ``col_split`` and ``col_full`` (each empty where it has none), eleven tensors a table."""
    main = tables[name]
    tail = tables.get(name + "_tail")
    if tail is None:  # no tail tiles: empty row lists, the launch is skipped
        tail = main.without_rows()

    def splits(t: SideTables) -> list[torch.Tensor]:
        return [t.ptr[:0] if x is None else x for x in (t.col_split, t.col_full)]

    return main.lists() + splits(main) + tail.lists() + splits(tail)


def _op_tables(c: dict, meta, fwd=None, dq=None, dkdv=None) -> dict:
    """``meta`` from ``op_meta``; the lists from ``_op_lists``."""
    ts, P = tile_sizes(c), int(meta[0])
    out = {}
    for i, (name, lists) in enumerate((("fwd", fwd), ("dq", dq), ("dkdv", dkdv))):
        if lists is not None:
            even, packed = meta[1 + 2 * i], meta[2 + 2 * i]
            short = c["dq_short_keys"] if name == "dq" else 0
            out[name] = _tables_from_tensors(lists[:11], *ts[name], P, even, packed, short)
            tail = _tables_from_tensors(lists[11:], c[TAIL_KEYS[name]] or ts[name][0], tail_cols(c, name), P,
                                        meta[7 + 2 * i], meta[8 + 2 * i], short)
            if tail.num_tiles:
                out[name + "_tail"] = tail
    return out


@torch.library.custom_op("longca_triton::block_sparse_attention_fwd", mutates_args=())
def _block_sparse_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fwd_tables: list[torch.Tensor],
                         dq_tables: list[torch.Tensor], dkdv_tables: list[torch.Tensor], meta: list[int],
                         softmax_scale: float, cfg: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    # dq_tables / dkdv_tables are not read here: they ride along so that the backward has them
    c = _cfg_from_list(cfg)
    t = _op_tables(c, meta, fwd=fwd_tables)
    return block_sparse_fwd(q, k, v, _Patterns(meta[0]), t["fwd"], softmax_scale, c, t.get("fwd_tail"))


@_block_sparse_fwd_op.register_fake
def _(q, k, v, fwd_tables, dq_tables, dkdv_tables, meta, softmax_scale, cfg):
    return fake_fwd(q, v)


@torch.library.custom_op("longca_triton::block_sparse_attention_bwd", mutates_args=())
def _block_sparse_bwd_op(dout: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dq_tables: list[torch.Tensor],
                         dkdv_tables: list[torch.Tensor], meta: list[int], softmax_scale: float,
                         cfg: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = _cfg_from_list(cfg)
    tables = _op_tables(c, meta, dq=dq_tables, dkdv=dkdv_tables)
    return block_sparse_bwd(dout, q, k, v, out, lse, _Patterns(meta[0]), tables, softmax_scale, c, dlse=dlse)


@_block_sparse_bwd_op.register_fake
def _(dout, dlse, q, k, v, out, lse, dq_tables, dkdv_tables, meta, softmax_scale, cfg):
    return fake_bwd(q, k, v)


register_op_autograd("longca_triton::block_sparse_attention_fwd", _block_sparse_bwd_op, _TABLE_LEN)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, softmax_scale=None,
                           return_lse: bool = False, config: Optional[dict] = None, deterministic: bool = False):
    """Attention of ``q [B, Sq, Hq, D_qk]`` over ``k [B, Sk, Hkv, D_qk]``, ``v [B, Sk, Hkv, D_v]``
    under a ``BlockSparseMask`` (``out [B, Sq, Hq, D_v]``).

    Any block bounds (uniform or variable). Differentiable in q, k, v (and through ``lse``).
    ``config`` overrides launch parameters (``CONFIG_KEYS``). Returns ``out`` in q's dtype, or
    ``(out, lse)`` with ``lse [B, Hq, Sq]`` float32 (natural log; ``-inf`` and a zero output row
    where a query row keeps no block). The tables are built on q's device on first use and cached.

    ``deterministic``: accepted for the API's sake and always honoured, at no cost: the backward
    has no atomics (dK/dV summed over a GQA group in registers, dQ owned by one program per tile),
    so its gradients are bitwise identical run to run whatever the flag.
    """
    _check_inputs(q, k, v, mask)
    softmax_scale = _resolve_scale(softmax_scale, q.shape[-1])
    cfg = resolve_config(mask, config_head_dim(q.shape[-1], v.shape[-1]), config, q=q, k=k, v=v)
    tables = tables_for(mask, cfg, q.device)
    out, lse = BlockSparseAttentionFunction.apply(q, k, v, mask, tables, softmax_scale, cfg)
    return (out, lse) if return_lse else out


#: variable blocks go through the same kernels (sub-tiles carrying their valid length)
varblock_attention = block_sparse_attention


def block_sparse_attention_op(q, k, v, mask, softmax_scale=None, return_lse=False, config=None,
                              deterministic=False):
    """Same as :func:`block_sparse_attention`, through the ``torch.library`` ops
    (``longca_triton::block_sparse_attention_fwd`` / ``_bwd``), so ``torch.compile`` can trace it.

    The tables are looked up (built once, cached) outside the graph: under ``torch.compile`` that
    lookup is a graph break. Build them beforehand (``tables_for``) and call
    :func:`block_sparse_attention_from_tables` for a graph without breaks (``fullgraph=True``).
    ``deterministic``: always honoured (no atomics, see :func:`block_sparse_attention`).
    """
    _check_inputs(q, k, v, mask)
    softmax_scale = _resolve_scale(softmax_scale, q.shape[-1])
    cfg = resolve_config(mask, config_head_dim(q.shape[-1], v.shape[-1]), config, q=q, k=k, v=v)
    tables = _tables_no_compile(mask, cfg, q.device)
    return block_sparse_attention_from_tables(q, k, v, tables, mask.num_patterns, softmax_scale, cfg, return_lse)


@torch.compiler.disable
def _tables_no_compile(mask, cfg, device):
    return tables_for(mask, cfg, device)


def block_sparse_attention_from_tables(q, k, v, tables: dict, num_patterns: int, softmax_scale: float, cfg: dict,
                                       return_lse: bool = False):
    """The custom-op path given ready tables (``tables_for(mask, cfg, device)``, ``cfg`` from
    ``resolve_config``): traceable by ``torch.compile`` without graph breaks."""
    meta = op_meta(tables, num_patterns)
    out, lse = torch.ops.longca_triton.block_sparse_attention_fwd(
        q, k, v, _op_lists(tables, "fwd"), _op_lists(tables, "dq"), _op_lists(tables, "dkdv"), meta,
        float(softmax_scale), _cfg_to_list(cfg))
    return (out, lse) if return_lse else out

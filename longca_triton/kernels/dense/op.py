r"""Dense attention with structured masks in Triton: forward, backward, GQA, lse.

Math
----
For a query head ``h`` (KV head ``h // G`` with ``G = Hq / Hkv``), query row ``i`` and key ``j``::

    s_ij  = softmax_scale * q_i . k_j                      (only where allowed(i, j))
    lse_i = log sum_{j allowed} exp(s_ij)                  (-inf when row i allows nothing)
    p_ij  = exp(s_ij - lse_i)
    o_i   = sum_j p_ij v_j                                 (0 when row i allows nothing)

Backward, with ``dO`` (and optionally ``dlse``)::

    delta_i = sum_d dO_id * o_id - dlse_i
    dv_j   += sum_i p_ij dO_i
    ds_ij   = p_ij * (dO_i . v_j - delta_i)
    dq_i    = softmax_scale * sum_j ds_ij k_j
    dk_j   += softmax_scale * sum_i ds_ij q_i              (summed over the G heads of a group)

The kernels work in the log2 domain: scores are multiplied by ``softmax_scale * log2(e)`` and
exponentiated with ``exp2``; the stored lse is the natural log (float32, ``[B, Hq, Sq]``).

Tiling
------
The ``Sq x Sk`` plane is cut into ``BLOCK_M x BLOCK_N`` tiles. The mask IR gives, per tile size,
which tiles are *full* (no mask math), *partial* (element mask from the per-row intervals
``OR_t lo[i,t] <= j < hi[i,t]``) or empty (never touched); ``dense_tables.py`` turns those lists
into contiguous runs and orders tiles heaviest first. Metadata is ``O(S + tiles)``.

* forward (``dense_fwd.py``): one program per (query tile, query head): full runs, then partial
  runs, online softmax in fp32.
* backward (``dense_bwd.py``): ``delta`` preprocess; key-major dK/dV, one program per (key tile,
  KV head) looping over all ``G`` query heads of the group (no atomics); query-major dQ.
  Opt-in ``fused_dq``: dQ added from the dK/dV kernel into fp32 by TMA reduce-add (5 matmuls per
  tile pair instead of 7); on an H100 it measured 1.3-2.8x *slower* than the separate dQ kernel
  (the reduce traffic dominates), so it is off by default.
  Opt-in ``one_launch`` (issue 13): the dK/dV and dQ program sets in one launch
  (``dense_bwd_one_launch_kernel``, FlexAttention's layout), same tiles and plans, no atomics.
  Measured (H100, S=16K, GQA 64:8, D=128, experiments/results/h100/bwd_variants/): 0.89-0.96x
  of the two kernels at best (causal 30.5 vs 27.6 ms; full 59.5 vs 56.9), and only with the dQ
  set on 64x64 tiles: one warps/stages budget for both sets costs more than the launch and tail it
  saves. Off by default. The two kernels in the same run: full 0.94x Flex's backward (56.9 vs
  53.6 ms) and 0.70x cuDNN, causal 1.05x Flex / 0.77x cuDNN, causal_document 1.09x Flex,
  share_question 1.41x Flex.
* dK/dV sweep order (``dkdv_sweep``, ``HOPPER_UNEVEN_MASK``): on GQA calls whose mask gives the
  dK/dV programs unequal work (causal, document, prefix-LM masks) the program visits its group's
  query heads row-major with query tiles descending, on a 64x64 tile, in one pipelined loop per
  run instead of one per head: 5-10 % less dK/dV time there, a loss on even masks
  (experiments/results/h100/bwd_sweep/: not through L2, whose hit rate it lowers).
* ``delta = rowsum(dO * O) - dlse`` comes from its own preprocess pass. Computing it in the dQ kernel
  instead (dK/dV then after dQ: no pass over O and dO) was built and measured within +-2 % both ways
  on seven masks at 16K (experiments/results/h100/bwd_session12/call13_fused_delta), and removed.
* ``deterministic=True`` (``dense_attention``, ``longca_triton.attention``): gradients bitwise
  identical run to run. Free: the default and ``one_launch`` sum every tile in a fixed order
  already; it only forbids ``fused_dq`` (ValueError for an explicit config).

GQA: query heads are the fastest-varying program index, so the ``G`` programs of one group run
side by side and read the same K/V tiles from L2 (a "pack GQA" that stacks heads into the M tile
moves the same bytes per FLOP through shared memory and only pays off for short query lengths).

Measured (H100, Triton 3.6, bf16, S=16K, GQA 64:8, D=128; experiments/results/h100/):
forward 477-506 TFLOP/s full / causal (0.79-0.84x cuDNN SDPA), backward 441-448 full (0.80-0.81x,
1.105x Flex) and 416-421 causal (0.79-0.82x, 1.13x Flex; experiments/results/h100/bwd_sweep/, with
the sweep on causal).
On sm_90 Triton 3.6 places ``wgmma.wait_group 0`` before every softmax, so exp2 never overlaps
the tensor cores, and ``warp_specialize`` changes nothing; that is most of the gap to cuDNN.

All tile loads and stores go through tensor descriptors (TMA on Hopper), which zero-fill
out-of-range rows and clip out-of-range stores: ragged ``S`` needs no bounds masks in the full loop.

Head dims
---------
``q, k`` share ``D_qk`` and ``v`` (so ``out``) may have its own ``D_v``: every multiple of 8 from 8
to 256 for each (``_runtime.head_dim_reason``), e.g. 64, 80, 96, 128, 192, 256 and (192, 128).
Tiles are padded on the head-dim axis to powers of two (``BLOCK_DQK``, ``BLOCK_DV``); the tensor
descriptors zero-fill the padding on load and drop it on store, so results and the FLOP count are
those of the true dims, while the tensor cores do the padded work (96 runs 128-wide tiles).
Power-of-two dims compile to the same kernels as before.

Entry points
------------
``dense_attention(q, k, v, mask, softmax_scale=None, return_lse=False, config=None)`` (autograd),
the ``torch.library`` ops ``longca_triton::dense_attention_fwd`` / ``_bwd`` (``torch.compile``),
and the low-level launchers ``dense_fwd`` / ``dense_bwd`` that take a :class:`TilePlan`.
Shapes: ``q [B, Sq, Hq, D_qk]``, ``k [B, Sk, Hkv, D_qk]``, ``v [B, Sk, Hkv, D_v]``, any strides
with a unit last stride; ``out [B, Sq, Hq, D_v]``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from longca_triton.kernels.core.autograd import attention_function, fake_bwd, fake_fwd, register_op_autograd
from longca_triton.kernels.core.runtime import block_head_dim, config_head_dim, head_dim_meta
from longca_triton.kernels.core.runtime import bsh_strides as _bsh_strides
from longca_triton.kernels.core.runtime import check_qkv as _check_qkv
from longca_triton.kernels.core.runtime import descriptor_ready as _descriptor_ready
from longca_triton.kernels.core.runtime import ensure_allocator as _ensure_allocator
from longca_triton.kernels.core.runtime import interpreting as _interpreting
from longca_triton.kernels.core.runtime import resolve_scale as _resolve_scale
from longca_triton.kernels.core.runtime import side_stream
from longca_triton.kernels.core.config import BWD_ORDERS, ConfigSpec
from longca_triton.kernels.core.config import check_bwd_layout as _check_bwd_layout
from longca_triton.kernels.core.config import check_dkdv_sweep
from longca_triton.kernels.core.config import resolve as _resolve
from longca_triton.kernels.core import config as _config_mod
from longca_triton.kernels.dense.bwd import (
    dense_bwd_dkdv_kernel,
    dense_bwd_dq_kernel,
    dense_bwd_one_launch_kernel,
    dense_bwd_preprocess_kernel,
)
from longca_triton.kernels.dense.fwd import dense_fwd_kernel
from longca_triton.kernels.dense.plan import TilePlan, get_tile_plan

__all__ = [
    "dense_attention", "dense_attention_op", "dense_attention_from_plans", "plans_for",
    "default_config", "resolve_config", "dense_fwd", "dense_bwd", "launch_bwd_preprocess",
    "launch_bwd_dkdv", "launch_bwd_dq", "launch_bwd_one", "DenseAttentionFunction", "CONFIG_KEYS",
    "BWD_ORDERS", "check_deterministic", "HOPPER_CONFIGS", "HOPPER_FULL_MASK", "HOPPER_UNEVEN_MASK", "UNEVEN_SHARE",
    "hopper_config", "HEADDIM_CANDIDATES", "INTERPRETER_CONFIG",
    "headdim_candidates",
]

LOG2E = 1.4426950408889634

# ----------------------------------------------------------------------------------------------
# Launch configs
# ----------------------------------------------------------------------------------------------

#: every key a ``config`` dict may carry. ``BLOCK_*`` are tile sizes (powers of two >= 16);
#: the forward uses ``BLOCK_M x BLOCK_N``, dK/dV ``DKDV_BLOCK_M x DKDV_BLOCK_N`` (a program owns a
#: key tile of DKDV_BLOCK_N), dQ ``DQ_BLOCK_M x DQ_BLOCK_N`` (a program owns a query tile).
#: ``warp_specialize`` is passed to ``tl.range`` of the full-tile loop (no effect on sm_90 with
#: Triton 3.6); ``fused_dq`` selects the fused dQ variant (see the module docstring).
#: ``one_launch`` runs dK/dV and dQ as two program sets of one launch (``bwd_order``: 0 dK/dV set
#: first, 1 dQ set first, 2 interleaved) with ``bwd_num_warps`` / ``bwd_num_stages`` for both;
#: off until a GPU measures it faster (``experiments/gpu/bwd_variants.py``). ``dkdv_sweep`` orders
#: the dK/dV program's (query head, query tile) steps: 0 head-major (default), 1 row-major, 2
#: row-major descending (``config.DKDV_SWEEPS``; ``dense_bwd._dkdv_program`` says why; not with ``fused_dq``).
#: ``bwd_streams``: the dQ kernel on a second CUDA stream beside the dK/dV kernel (``_runtime.side_stream``),
#: so dQ's programs fill the SMs of dK/dV's last wave; same kernels, same bits (two-kernel layout only).
#: ``dkdv_stats_tma``: the dK/dV steps read lse / delta from the preprocess's ``[B, Hq, Sq, 4]`` rows by one TMA
#: box a step (``core.stats_desc``) instead of by pointers (two-kernel and fused-dQ layouts); same bits. Off by
#: default: on this kernel's 64 x 64 / 4-warp dK/dV tile (q / dO already by TMA) it lost on an H100 (16K, GQA 64:8,
#: D = 128, interleaved, experiments/results/h100/session22/ call 7: full 0.989x, causal 0.976x, causal_document
#: 0.979x, prefix_lm_causal 0.985x, sliding_window 1.021x), where the block-sparse kernel's 128-key tile gains 3-8 %.
#: ``dkdv_qmajor``: the dK/dV steps compute their scores query-major (``S = Q K^T``; ``core.dkdv_update_qmajor``:
#: P and dS transposed through shared memory as the A operands of the dV / dK GEMMs) instead of key-major; the
#: same products, summed in another layout. sm_90a on the CPU (``experiments/cpu_aot_dense_bwd.py``, S = 4K, GQA
#: 8:1, D = 128, 64 x 64 / 4 warps): full 467 -> 363 instructions a step (spills 196 -> 124 bytes), causal 488 /
#: 695 -> 406 / 566 (a thread holds 2 query rows' lse / delta instead of 16 columns'). Not timed on a GPU yet: off.
#: ``dq_skew``: the dQ kernel issues each step's ``dS K`` GEMM in the next step, after that step's ``S`` and ``dP``,
#: so it runs while the exponentials and ``dS`` are computed (``core.dq_skewed_scores``; one more K tile a step by
#: TMA, a third ring of it in shared memory); the same sums in the same order, so the same bits. Two-kernel layout.
CONFIG_KEYS = (
    "BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "warp_specialize",
    "DKDV_BLOCK_M", "DKDV_BLOCK_N", "dkdv_num_warps", "dkdv_num_stages",
    "DQ_BLOCK_M", "DQ_BLOCK_N", "dq_num_warps", "dq_num_stages", "fused_dq",
    "one_launch", "bwd_order", "bwd_num_warps", "bwd_num_stages", "dkdv_sweep", "dkdv_head_outer",
    "bwd_streams", "dkdv_stats_tma", "dq_skew", "dkdv_qmajor",
)


#: the interpreter's one pinned config: it cannot autotune, and small tiles keep it quick
INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1, warp_specialize=False,
                          DKDV_BLOCK_M=32, DKDV_BLOCK_N=32, dkdv_num_warps=4, dkdv_num_stages=1,
                          DQ_BLOCK_M=32, DQ_BLOCK_N=32, dq_num_warps=4, dq_num_stages=1, fused_dq=False,
                          one_launch=False, bwd_order=0, bwd_num_warps=4, bwd_num_stages=1, dkdv_sweep=0,
                          dkdv_head_outer=False, bwd_streams=False, dkdv_stats_tma=False, dq_skew=False,
                          dkdv_qmajor=False)

#: Hopper defaults by padded head dim (``_runtime.config_head_dim``): the first entry whose key is
#: >= the head dim (80 and 96 take 128; 192 and 192/128 take 256). Registers, spills and shared
#: memory per config: ``experiments/results/cpu-aot/headdim_configs.md`` (sm_90a, compiled on a CPU).
HOPPER_CONFIGS = {
    # H100 (experiments/results/h100/headdim/configs, 16K GQA 64:8): forward 64x128/4 warps/2 stages
    # (155 registers, 3 blocks per SM) 450 / 439 TFLOP/s full / causal = 0.95 / 0.90x cuDNN, 1.16 /
    # 1.22x the old 128x128/8 warps/3 stages; dK/dV 64x64/4 warps/3 stages (226 registers) backward
    # 371 / 370 = 0.82 / 0.84x cuDNN, 1.06 / 1.09x the old 64x128/8 warps; dQ 128x64/8 warps
    64: dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, warp_specialize=False,
             DKDV_BLOCK_M=64, DKDV_BLOCK_N=64, dkdv_num_warps=4, dkdv_num_stages=3,
             DQ_BLOCK_M=128, DQ_BLOCK_N=64, dq_num_warps=8, dq_num_stages=3, fused_dq=False,
             one_launch=False, bwd_order=0, bwd_num_warps=8, bwd_num_stages=3, dkdv_sweep=0, dkdv_head_outer=False,
             bwd_streams=False, dkdv_stats_tma=False, dq_skew=False, dkdv_qmajor=False),
    # measured on an H100 (experiments/results/h100/dense_check.md): forward 128x128/8 warps/
    # 3 stages; dK/dV 32x64/4 warps (64x128/8 warps spills: two fp32 [128, 128] accumulators
    # plus P^T and dP^T do not fit in 255 registers); dQ 128x64/8 warps
    128: dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, warp_specialize=False,
              DKDV_BLOCK_M=32, DKDV_BLOCK_N=64, dkdv_num_warps=4, dkdv_num_stages=3,
              DQ_BLOCK_M=128, DQ_BLOCK_N=64, dq_num_warps=8, dq_num_stages=3, fused_dq=False,
              one_launch=False, bwd_order=0, bwd_num_warps=8, bwd_num_stages=3, dkdv_sweep=0, dkdv_head_outer=False,
              bwd_streams=False, dkdv_stats_tma=False, dq_skew=False, dkdv_qmajor=False),
    # 256 and 192/128 (issue 17): the old forward (64x64, 4 warps) and dQ (64x32, 4 warps) left one
    # warpgroup per SM (232 / 252 registers, 161 / 128 KiB: a second block fits neither). Now two
    # warpgroups: forward 128x64/8 warps/2 stages (228 registers, 192 KiB at 256; 165, 160 KiB at
    # 192/128), dQ 64x64/8 warps (221 / 204 registers); dK/dV 32x64/8 warps/2 stages (spills 16/36
    # bytes at 256, none at 192/128, and still the fastest). H100 (experiments/results/h100/headdim/
    # configs, 16K GQA 64:8, full / causal): 256 forward 535 / 531 TFLOP/s = 0.79 / 0.82x cuDNN
    # (1.35x the old), backward 165 / 175 = 0.46x (1.36x the 16x64 dK/dV tile); 192/128 forward
    # 368 / 372 = 0.58 / 0.64x, backward 124 / 129 = 0.44 / 0.27x
    256: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, warp_specialize=False,
              DKDV_BLOCK_M=32, DKDV_BLOCK_N=64, dkdv_num_warps=8, dkdv_num_stages=2,
              DQ_BLOCK_M=64, DQ_BLOCK_N=64, dq_num_warps=8, dq_num_stages=2, fused_dq=False,
              one_launch=False, bwd_order=0, bwd_num_warps=8, bwd_num_stages=2, dkdv_sweep=0, dkdv_head_outer=False,
              bwd_streams=False, dkdv_stats_tma=False, dq_skew=False, dkdv_qmajor=False),
}

#: Alternatives to ``HOPPER_CONFIGS`` at the head dims issue 17 is about, by the same key: name ->
#: the keys that differ (forward keys, backward keys or both). ``experiments/gpu/headdim_check.py
#: --configs`` times each against the default and sdpa-cudnn; ``"old"`` is the default before the
#: sm_90a AOT sweep (``experiments/results/cpu-aot/headdim_configs.md`` has their registers).
HEADDIM_CANDIDATES = {
    64: {
        # the default before the H100 head-dim run (128x128 forward, 64x128/8 warps dK/dV)
        "old": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3,
                    DKDV_BLOCK_M=64, DKDV_BLOCK_N=128, dkdv_num_warps=8, dkdv_num_stages=3),
        # 114 registers: 2 blocks (16 warps) per SM; H100 0.96 / 1.00x the default
        "fwd128x64w8s3": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    },
    256: {
        "old": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2,
                    DKDV_BLOCK_M=16, DKDV_BLOCK_N=64,
                    DQ_BLOCK_M=64, DQ_BLOCK_N=32, dq_num_warps=4, dq_num_stages=2),
        # the same 64x64 tile on two warpgroups (165 registers, 161 KiB); H100 0.48x the default
        "fwd64x64w8s2": dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2),
        # 210 / 139 registers, 160 / 136 KiB: a deeper ring of narrower key tiles; H100 0.87-0.97x
        "fwd128x32w8s3": dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3),
        # dK/dV half the query rows per step: the only spill-free dK/dV tile at 256; H100 0.72-0.75x
        "dkdv16x64w8s2": dict(DKDV_BLOCK_M=16, DKDV_BLOCK_N=64, dkdv_num_warps=8, dkdv_num_stages=2),
        # dQ 193 / 173 registers, 128 / 97 KiB; H100 0.87-0.88x
        "dq64x32w8s2": dict(DQ_BLOCK_M=64, DQ_BLOCK_N=32, dq_num_warps=8, dq_num_stages=2),
    },
}


#: Overlays on ``HOPPER_CONFIGS`` for masks that allow every (query, key) pair (``tuned.mask_class``
#: ``"full"``), by the same key. D = 128: dK/dV on 64x64 tiles, 4 warps, 2 stages (255 registers,
#: 88 spill bytes, 99 KB: two blocks per SM) measured 438-448 TFLOP/s backward vs 410-418 for the
#: 32x64 default on full at 16K (H100, three samples, ``experiments/results/h100/bwd_order/``), but
#: 383-392 vs 388-402 on causal and below it on the document masks, so only full masks take it (the
#: autotune cache's ``full`` class found the same tile). 80 and 96 share the entry (the same padded
#: tiles; not measured there). ``dq_skew`` (the dQ GEMM one step late, ``core.dq_skewed_scores``): H100, 16K,
#: GQA 64:8, D = 128, bf16, interleaved, equal bits (experiments/results/h100/session23/, call 1): full 432.8 ->
#: 442.6, 429.6 -> 435.8, 424.5 -> 429.8 TFLOP/s (three rounds); causal 0.997x, causal_document 0.989x,
#: sliding_window 0.988x, block-sparse 0.97-0.99x (and block 64 0.74x: 131 KB of shared memory, one CTA an SM),
#: so full masks only, and only where the head dim fills the tile (``resolve_config``: D = 96 0.993x, call 2).
HOPPER_FULL_MASK = {
    128: dict(DKDV_BLOCK_M=64, DKDV_BLOCK_N=64, dkdv_num_warps=4, dkdv_num_stages=2, dq_skew=True),
}


#: Overlays for GQA (group >= 2) range masks whose dK/dV programs have unequal work
#: (``tuned.uneven_key_work`` >= ``UNEVEN_SHARE``: a quarter of the key tiles off the median by more
#: than a quarter), by the same key: the row-major descending sweep (``dkdv_sweep`` = 2) on the 64x64
#: / 4 warps / 2 stages dK/dV tile. H100, 16K, GQA 64:8, D = 128 (``experiments/results/h100/
#: bwd_sweep/``), backward TFLOP/s vs the 32x64/4/3 head-major default: causal 421 / 400, causal_document
#: 340 / 333, share_question 350 / 334, block_causal_document 400 / 397, causal_blockwise 405 / 391,
#: full_document 400 / 376, prefix_lm_causal 422 / 404, prefix_lm_document 348 / 334; it loses where
#: the programs are even (sliding_window 289 / 346, sliding_window_causal 247 / 292,
#: global_sliding_window 354 / 373: shares 0.06, 0.05, 0.09 vs 0.35-0.89 above), at MHA (64:64
#: causal_document 287 / 308, though causal 399 / 384), at D = 64 (sweep 2 on its 64x64/4/3 tile: causal
#: 356 / 374), and with the 32x64 tile (causal 370 / 392): the sweep pays only together with the
#: 64x64 tile, so a config that sets the dK/dV tile without ``dkdv_sweep`` gets head-major
#: (``resolve_config``). ``dkdv_head_outer`` (the dK/dV grid with the KV head slowest, the
#: block-sparse default) measured within +-3 % here both ways: off.
HOPPER_UNEVEN_MASK = {
    128: dict(dkdv_sweep=2, DKDV_BLOCK_M=64, DKDV_BLOCK_N=64, dkdv_num_warps=4, dkdv_num_stages=2),
}
#: ``tuned.uneven_key_work`` at or above which a range mask takes ``HOPPER_UNEVEN_MASK``
UNEVEN_SHARE = 0.25

#: Overlays for range masks whose dK/dV programs have (nearly) equal work (``tuned.uneven_key_work`` below
#: ``UNEVEN_SHARE``, full masks included), by the same key: ``bwd_streams``, the dQ kernel on a second
#: stream beside dK/dV (``_runtime.side_stream``), whose programs then fill the SMs the dK/dV kernel's
#: last wave leaves idle. H100, 16K, GQA 64:8, D = 128, bf16, backward interleaved with the one-stream
#: default (``experiments/results/h100/session20/``, ``experiments/gpu/bwd_configs_ab.py``), TFLOP/s:
#: sliding_window 354.8 -> 361.2 (+1.8 %), sliding_window_causal 283.6 -> 293.2 (+3.4 %), full 435.7 ->
#: 435.6; on the uneven masks (64x64 tile, sweep 2) it loses: causal 423.0 -> 417.6, causal_document
#: 356.6 -> 354.9, so they keep one stream.
HOPPER_EVEN_MASK = {
    128: dict(bwd_streams=True),
}
_DKDV_TILE_KEYS = ("DKDV_BLOCK_M", "DKDV_BLOCK_N", "dkdv_num_warps", "dkdv_num_stages")


def _table_key(head_dim: int) -> int:
    return next((d for d in sorted(HOPPER_CONFIGS) if head_dim <= d), max(HOPPER_CONFIGS))


def default_config(head_dim: int, dtype: torch.dtype = torch.bfloat16, mask=None, group: int = 1) -> dict:
    """Sane launch parameters for Hopper (``HOPPER_CONFIGS``, with ``HOPPER_FULL_MASK`` /
    ``HOPPER_UNEVEN_MASK`` over it as ``hopper_config`` says; ``INTERPRETER_CONFIG`` in the CPU
    interpreter), a fresh dict.

    ``head_dim`` is the padded tile the kernels work on (``_runtime.config_head_dim(D_qk, D_v)``:
    80 and 96 take the 128 configs, 192 and 192/128 the 256 ones); any int is accepted. ``group``:
    query heads per KV head."""
    if _interpreting():
        return dict(INTERPRETER_CONFIG)
    return hopper_config(head_dim, mask, group)


def hopper_config(head_dim: int, mask=None, group: int = 1) -> dict:
    """The ``HOPPER_CONFIGS`` entry for padded head dim ``head_dim`` (a fresh dict), interpreter or
    not (the FlashMask kernel reads its tiles from here, without a mask), with an overlay when
    ``mask`` is given: ``HOPPER_FULL_MASK`` when it allows every pair, ``HOPPER_UNEVEN_MASK`` when
    ``group`` >= 2 and its dK/dV programs have unequal work (``tuned.uneven_key_work``),
    ``HOPPER_EVEN_MASK`` when they have equal work (full masks too)."""
    key = _table_key(head_dim)
    cfg = dict(HOPPER_CONFIGS[key])
    if mask is not None and any(key in t for t in (HOPPER_FULL_MASK, HOPPER_UNEVEN_MASK, HOPPER_EVEN_MASK)):
        from longca_triton.kernels.core.tuned import mask_class, uneven_key_work

        full = mask_class(mask) == "full"
        even = full or uneven_key_work(mask) < UNEVEN_SHARE
        if full:
            cfg.update(HOPPER_FULL_MASK.get(key, {}))
        elif group >= 2 and not even:
            cfg.update(HOPPER_UNEVEN_MASK.get(key, {}))
        if even:
            cfg.update(HOPPER_EVEN_MASK.get(key, {}))
    return cfg


def headdim_candidates(d_qk: int, d_v: Optional[int] = None) -> dict:
    """``{name: full config}`` for head dims ``d_qk`` / ``d_v``: the Hopper default (``"default"``)
    and each of ``HEADDIM_CANDIDATES`` overlaid on it (none where a dim has no candidates)."""
    d = config_head_dim(d_qk, d_v if d_v is not None else d_qk)
    base = dict(HOPPER_CONFIGS[_table_key(d)])
    return {"default": base, **{n: {**base, **c} for n, c in HEADDIM_CANDIDATES.get(_table_key(d), {}).items()}}


_SPEC = ConfigSpec("dense-attention", CONFIG_KEYS,
                   tile_keys=("BLOCK_M", "BLOCK_N", "DKDV_BLOCK_M", "DKDV_BLOCK_N", "DQ_BLOCK_M", "DQ_BLOCK_N"),
                   bool_keys=("warp_specialize", "fused_dq", "one_launch", "dkdv_head_outer", "bwd_streams",
                              "dkdv_stats_tma", "dq_skew", "dkdv_qmajor"),
                   tuned_name="triton")


def resolve_config(head_dim: int, dtype: torch.dtype, config: Optional[dict] = None, *, q=None, k=None,
                   mask=None, v=None) -> dict:
    """``config``, else (given ``q, k, mask``; ``v`` when its head dim differs) the autotune cache's
    entry, overlaid on ``default_config`` (for the GQA group of ``q`` / ``k``: ``HOPPER_UNEVEN_MASK``
    needs one of 2 or more); unknown keys and bad tiles raise ValueError (``config.resolve``), as do
    a ``bwd_order`` outside ``BWD_ORDERS`` and ``one_launch`` with ``fused_dq`` (two different
    backward layouts). A config that names a dK/dV tile key (or ``fused_dq``) but not ``dkdv_sweep``
    gets head-major (``dkdv_sweep`` = 0), not the default's sweep, which was measured on its own tile
    only (and has no fused-dQ form).
    ``head_dim``: the padded dim configs are chosen by (``config_head_dim``)."""
    group = q.shape[2] // k.shape[2] if q is not None and k is not None else 1
    if config is None:
        config = _config_mod.tuned_config(_SPEC, q, k, mask, v)  # (looked up through the module: tests patch it)
    base = default_config(head_dim, dtype, mask, group)
    if (q is not None and q.shape[-1] != head_dim) or (v is not None and v.shape[-1] != head_dim):
        # dq_skew was measured a gain on exact 128-wide tiles only; D = 96 on the padded tile lost 0.7 % in each of
        # three rounds (experiments/results/h100/session23/, call 2)
        base["dq_skew"] = False
    if config and "dkdv_sweep" not in config and (any(key in config for key in _DKDV_TILE_KEYS)
                                                  or config.get("fused_dq")):
        # the sweep was measured with its own tile only: another dK/dV tile goes head-major, and
        # fused_dq has no row-major form
        base["dkdv_sweep"] = 0
    cfg = _check_bwd_layout(_resolve(_SPEC, base, config or {}), "dense attention")
    if cfg["dkdv_qmajor"] and (cfg["one_launch"] or cfg["dkdv_sweep"]):
        raise ValueError("dense attention: config['dkdv_qmajor'] (query-major dK/dV scores) is a key of the dK/dV "
                         "kernel's head-major loop: it needs one_launch=False and dkdv_sweep=0 (got "
                         f"{cfg['one_launch']}, {cfg['dkdv_sweep']})")
    return check_dkdv_sweep(cfg, "dense attention")


def check_deterministic(cfg: dict, deterministic: bool, what: str = "dense attention") -> None:
    """``deterministic=True`` forbids the one variant that is not: ``fused_dq`` (dQ summed by fp32
    atomics in whatever order the programs reach them). Raises ValueError naming both."""
    if deterministic and cfg["fused_dq"]:
        raise ValueError(f"{what}: deterministic=True cannot use config fused_dq=True (dQ by fp32 atomics, "
                         "not bitwise reproducible); drop fused_dq or deterministic")


def _config_for(q, k, v, mask, config, deterministic):
    """The resolved config of one call; with ``deterministic`` and no explicit config, an autotuned
    ``fused_dq`` falls back to the two-kernel backward (the user asked for no atomics, not for it)."""
    cfg = resolve_config(config_head_dim(q.shape[-1], v.shape[-1]), q.dtype, config, q=q, k=k, v=v, mask=mask)
    if deterministic and config is None and cfg["fused_dq"]:
        cfg["fused_dq"] = False
    check_deterministic(cfg, deterministic)
    return cfg


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

def _check_inputs(q, k, v, plan_sq=None, plan_sk=None):
    _check_qkv(q, k, v, "dense attention")
    sq, sk = q.shape[1], k.shape[1]
    if plan_sq is not None and (plan_sq != sq or plan_sk != sk):
        raise ValueError(f"mask is {plan_sq} x {plan_sk} but q/k have Sq={sq}, Sk={sk}")


def _check_plan(plan: TilePlan, block_m: int, block_n: int, what: str):
    if plan.block_m != block_m or plan.block_n != block_n:
        raise ValueError(f"{what} plan is for tiles {plan.block_m}x{plan.block_n}, "
                         f"config says {block_m}x{block_n}")


def dense_fwd(q, k, v, plan: TilePlan, softmax_scale: float, cfg: dict, out_dtype=None):
    """Launch the forward kernel. Returns ``out [B, Sq, Hq, D_v]`` (q's dtype, or ``out_dtype``:
    context parallelism asks for float32 partial outputs so that merging them rounds once),
    ``lse [B, Hq, Sq]``."""
    _check_plan(plan, cfg["BLOCK_M"], cfg["BLOCK_N"], "forward")
    q, k, v = (_descriptor_ready(t) for t in (q, k, v))
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = torch.empty((b, sq, hq, v.shape[3]), device=q.device, dtype=out_dtype or q.dtype)
    lse = torch.empty((b, hq, sq), device=q.device, dtype=torch.float32)
    if b * hq * sq == 0:
        return out, lse
    _ensure_allocator(q.device)
    grid = (plan.num_m * b * hq,)
    dense_fwd_kernel[grid](
        q, k, v, out, lse,
        *_bsh_strides(q, k, v, out),
        plan.lo, plan.hi, plan.q_order, *plan.q_full, *plan.q_part,
        softmax_scale * LOG2E,
        sq, sk, b * hq, hq, hq // hkv,
        **head_dim_meta(q.shape[3], v.shape[3]),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], NUM_IV=plan.num_iv,
        WARP_SPEC=cfg["warp_specialize"], HAS_PARTIAL_TILES=plan.q_part[1].numel() > 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, lse


def dense_bwd(dout, q, k, v, out, lse, dkdv_plan: TilePlan, dq_plan: TilePlan,
              softmax_scale: float, cfg: dict, dlse=None, grad_dtype=None, dq_dtype=None, after_dkdv=None):
    """Launch preprocess, dK/dV and dQ. Returns ``dq, dk, dv`` in the inputs' dtype (or
    ``grad_dtype``: float32 partial gradients for context parallelism's accumulation; ``dq_dtype``
    overrides it for dQ alone).

    ``after_dkdv(dk, dv)`` is called once dK/dV are enqueued and before dQ is: context parallelism
    posts the transfer of dK/dV there so that it overlaps the dQ kernel (with the one-launch and
    fused-dQ variants, which finish dK/dV and dQ together, it is called at the end)."""
    _check_plan(dkdv_plan, cfg["DKDV_BLOCK_M"], cfg["DKDV_BLOCK_N"], "dK/dV")
    _check_plan(dq_plan, cfg["DQ_BLOCK_M"], cfg["DQ_BLOCK_N"], "dQ")
    q, k, v, out, dout = (_descriptor_ready(t) for t in (q, k, v, out, dout))
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    dk = torch.empty(k.shape, device=k.device, dtype=grad_dtype or k.dtype)  # [B, Sk, Hkv, D_qk]
    dv = torch.empty(v.shape, device=v.device, dtype=grad_dtype or v.dtype)  # [B, Sk, Hkv, D_v]
    dq_dtype = dq_dtype or grad_dtype or q.dtype
    hook = after_dkdv or (lambda dk_, dv_: None)
    if b * hq * d == 0 or sq == 0 or sk == 0:
        dk.zero_(), dv.zero_()
        hook(dk, dv)
        return q.new_zeros((b, sq, hq, d), dtype=dq_dtype), dk, dv
    _ensure_allocator(q.device)
    lse = lse.contiguous()
    # dkdv_stats_tma: the dK/dV steps read (lse, delta) rows of the preprocess's stats by TMA boxes (not in the
    # one-launch kernel, whose dQ programs read lse itself)
    stats = None
    if cfg.get("dkdv_stats_tma", False) and not cfg["one_launch"]:
        delta, stats = launch_bwd_preprocess(out, dout, dlse, lse=lse)
    else:
        delta = launch_bwd_preprocess(out, dout, dlse)
    if cfg["fused_dq"]:
        dq_acc = torch.zeros((b, sq, hq, d), device=q.device, dtype=torch.float32)
        launch_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, dkdv_plan, softmax_scale, cfg,
                        dq_acc=dq_acc, stats=stats)
        hook(dk, dv)
        return dq_acc.to(dq_dtype), dk, dv
    dq = torch.empty((b, sq, hq, d), device=q.device, dtype=dq_dtype)
    if cfg["one_launch"]:
        launch_bwd_one(q, k, v, dout, lse, delta, dq, dk, dv, dkdv_plan, dq_plan, softmax_scale, cfg)
        hook(dk, dv)
        return dq, dk, dv
    with side_stream(q.device, cfg.get("bwd_streams", False)) as beside:
        launch_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, dkdv_plan, softmax_scale, cfg, stats=stats)
        hook(dk, dv)
        with beside():
            launch_bwd_dq(q, k, v, dout, lse, delta, dq, dq_plan, softmax_scale, cfg)
    return dq, dk, dv


def launch_bwd_preprocess(out, dout, dlse=None, block: int = 64, lse=None):
    """``delta [B, Hq, Sq] = rowsum(dO * O) - dlse`` (float32); ``out, dout [B, Sq, Hq, D_v]``. Given the
    forward's ``lse [B, Hq, Sq]``, returns ``(delta, stats)`` with ``stats [B, Hq, Sq, 4] = (lse, delta, 0,
    0)`` (float32; the dK/dV kernels' ``STATS_TMA``)."""
    b, sq, hq, d = out.shape
    delta = torch.empty((b, hq, sq), device=out.device, dtype=torch.float32)
    stats = torch.empty((b, hq, sq, 4), device=out.device, dtype=torch.float32) if lse is not None else None
    has_dlse = dlse is not None
    dense_bwd_preprocess_kernel[(triton.cdiv(sq, block), b * hq)](
        out, dout, dlse.contiguous() if has_dlse else delta, delta,
        lse.contiguous() if lse is not None else delta, stats if stats is not None else delta,
        *_bsh_strides(out, dout),
        sq, hq, HEAD_DIM=d, BLOCK_D=block_head_dim(d), BLOCK=block, HAS_DLSE=has_dlse, STATS=stats is not None,
    )
    return delta if stats is None else (delta, stats)


def launch_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, plan: TilePlan, softmax_scale, cfg,
                    dq_acc=None, stats=None):
    """Key-major dK/dV into ``dk [B, Sk, Hkv, D_qk]``, ``dv [B, Sk, Hkv, D_v]``; inputs already
    descriptor-ready.

    With ``dq_acc`` (fp32 ``[B, Sq, Hq, D_qk]``, zeroed) dQ is accumulated there too (fused). With
    ``stats`` (``launch_bwd_preprocess(..., lse=)``'s ``[B, Hq, Sq, 4]``) the steps read lse and delta from
    it by TMA boxes (``STATS_TMA``) instead of ``lse`` / ``delta`` by pointers.
    """
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    fused = dq_acc is not None
    dqa = dq_acc if fused else delta  # placeholder pointer when not fused (never read)
    dqa_strides = dq_acc.stride()[:3] if fused else (0, 0, 0)
    dense_bwd_dkdv_kernel[(plan.num_n * b * hkv,)](
        q, k, v, dout, stats if stats is not None else lse, delta, dk, dv, dqa,
        *_bsh_strides(q, k, v, dout, dk, dv),
        *dqa_strides,
        plan.lo, plan.hi, plan.k_order, *plan.k_full, *plan.k_part,
        softmax_scale, softmax_scale * LOG2E,
        sq, sk, b * hkv, hq, hkv, hq // hkv,
        **head_dim_meta(q.shape[3], v.shape[3]), BLOCK_M=cfg["DKDV_BLOCK_M"], BLOCK_N=cfg["DKDV_BLOCK_N"], NUM_IV=plan.num_iv,
        # the interpreter has no tensor-descriptor reduce: it takes the pointer atomics
        FUSED_DQ=fused, DQ_TMA=fused and not _interpreting(), HAS_PARTIAL_TILES=plan.k_part[1].numel() > 0,
        SWEEP=cfg.get("dkdv_sweep", 0), HEAD_OUTER=bool(cfg.get("dkdv_head_outer", False)),
        STATS_TMA=stats is not None, QMAJOR=bool(cfg.get("dkdv_qmajor", False)), num_warps=cfg["dkdv_num_warps"],
        num_stages=cfg["dkdv_num_stages"],
    )


def launch_bwd_dq(q, k, v, dout, lse, delta, dq, plan: TilePlan, softmax_scale, cfg):
    """Query-major dQ into ``dq`` ([B, Sq, Hq, D_qk]); inputs already descriptor-ready."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    dense_bwd_dq_kernel[(plan.num_m * b * hq,)](
        q, k, v, dout, lse, delta, dq,
        *_bsh_strides(q, k, v, dout, dq),
        plan.lo, plan.hi, plan.q_order, *plan.q_full, *plan.q_part,
        softmax_scale, softmax_scale * LOG2E,
        sq, sk, b * hq, hq, hq // hkv,
        **head_dim_meta(q.shape[3], v.shape[3]), BLOCK_M=cfg["DQ_BLOCK_M"], BLOCK_N=cfg["DQ_BLOCK_N"], NUM_IV=plan.num_iv,
        HAS_PARTIAL_TILES=plan.q_part[1].numel() > 0, SKEW=bool(cfg.get("dq_skew", False)),
        num_warps=cfg["dq_num_warps"], num_stages=cfg["dq_num_stages"],
    )


def launch_bwd_one(q, k, v, dout, lse, delta, dq, dk, dv, dkdv_plan: TilePlan, dq_plan: TilePlan,
                   softmax_scale, cfg):
    """dK/dV and dQ as two program sets of one launch (``dense_bwd_one_launch_kernel``): the
    ``num_n * B * Hkv`` dK/dV programs and the ``num_m * B * Hq`` dQ programs, ordered by
    ``cfg["bwd_order"]``; inputs already descriptor-ready."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    n_dkdv, n_dq = dkdv_plan.num_n * b * hkv, dq_plan.num_m * b * hq
    dense_bwd_one_launch_kernel[(n_dkdv + n_dq,)](
        q, k, v, dout, lse, delta, dk, dv, dq,
        *_bsh_strides(q, k, v, dout, dk, dv, dq),
        *dkdv_plan.k_tensors(), *dq_plan.q_tensors(),
        softmax_scale, softmax_scale * LOG2E,
        sq, sk, b * hkv, b * hq, hq, hkv, hq // hkv, n_dkdv, n_dq,
        **head_dim_meta(q.shape[3], v.shape[3]),
        DKDV_BLOCK_M=cfg["DKDV_BLOCK_M"], DKDV_BLOCK_N=cfg["DKDV_BLOCK_N"],
        DQ_BLOCK_M=cfg["DQ_BLOCK_M"], DQ_BLOCK_N=cfg["DQ_BLOCK_N"],
        K_NUM_IV=dkdv_plan.num_iv, Q_NUM_IV=dq_plan.num_iv,
        K_HAS_PARTIAL=dkdv_plan.k_part[1].numel() > 0, Q_HAS_PARTIAL=dq_plan.q_part[1].numel() > 0,
        ORDER=cfg["bwd_order"], SWEEP=cfg.get("dkdv_sweep", 0), HEAD_OUTER=bool(cfg.get("dkdv_head_outer", False)),
        num_warps=cfg["bwd_num_warps"], num_stages=cfg["bwd_num_stages"],
    )


def plans_for(mask, cfg: dict, device):
    """The three tile plans one fwd+bwd needs (cached per mask, tile size and device)."""
    fwd = get_tile_plan(mask, cfg["BLOCK_M"], cfg["BLOCK_N"], device)
    dkdv = get_tile_plan(mask, cfg["DKDV_BLOCK_M"], cfg["DKDV_BLOCK_N"], device)
    dq = get_tile_plan(mask, cfg["DQ_BLOCK_M"], cfg["DQ_BLOCK_N"], device)
    return fwd, dkdv, dq


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------


def _dense_fwd3(q, k, v, fwd_plan, dkdv_plan, dq_plan, softmax_scale, cfg):
    return dense_fwd(q, k, v, fwd_plan, softmax_scale, cfg)


def _dense_bwd3(dout, dlse, q, k, v, out, lse, fwd_plan, dkdv_plan, dq_plan, softmax_scale, cfg):
    return dense_bwd(dout, q, k, v, out, lse, dkdv_plan, dq_plan, softmax_scale, cfg, dlse=dlse)


#: ``apply(q, k, v, fwd_plan, dkdv_plan, dq_plan, softmax_scale, cfg) -> (out, lse)``
DenseAttentionFunction = attention_function(
    "DenseAttentionFunction", _dense_fwd3, _dense_bwd3,
    """``(q, k, v) -> (out, lse)`` with the plans and config carried as non-tensor arguments.""")


# ----------------------------------------------------------------------------------------------
# torch.library custom ops (for torch.compile): the plans travel as lists of int32 tensors
# ----------------------------------------------------------------------------------------------

_PLAN_LEN = 9  # lo, hi, order, full (ptr, start, end), part (ptr, start, end)


def _plan_from_tensors(ts, block_m, block_n, sq, sk, major):
    lo, hi, order, fp, fs, fe, pp, ps, pe = ts
    num = order.shape[0]
    kw = dict(q_order=order, q_full=(fp, fs, fe), q_part=(pp, ps, pe),
              k_order=order, k_full=(fp, fs, fe), k_part=(pp, ps, pe))
    return TilePlan(seqlen_q=sq, seqlen_k=sk, block_m=block_m, block_n=block_n,
                    num_m=num if major == "q" else triton.cdiv(sq, block_m),
                    num_n=num if major == "k" else triton.cdiv(sk, block_n),
                    num_iv=lo.shape[1], lo=lo, hi=hi, area_tiles=-1, **kw)


def _cfg_from_list(cfg_list):
    return resolve_config(0, torch.float16, dict(zip(CONFIG_KEYS, cfg_list)))


def _cfg_to_list(cfg):
    return [int(cfg[k]) for k in CONFIG_KEYS]


@torch.library.custom_op("longca_triton::dense_attention_fwd", mutates_args=())
def _dense_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_plan: list[torch.Tensor],
                  dkdv_plan: list[torch.Tensor], dq_plan: list[torch.Tensor],
                  softmax_scale: float, cfg: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    # dkdv_plan / dq_plan are not read here: they ride along so that the backward has them
    c = _cfg_from_list(cfg)
    plan = _plan_from_tensors(q_plan, c["BLOCK_M"], c["BLOCK_N"], q.shape[1], k.shape[1], "q")
    return dense_fwd(q, k, v, plan, softmax_scale, c)


@_dense_fwd_op.register_fake
def _(q, k, v, q_plan, dkdv_plan, dq_plan, softmax_scale, cfg):
    return fake_fwd(q, v)


@torch.library.custom_op("longca_triton::dense_attention_bwd", mutates_args=())
def _dense_bwd_op(dout: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  dkdv_plan: list[torch.Tensor], dq_plan: list[torch.Tensor],
                  softmax_scale: float, cfg: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = _cfg_from_list(cfg)
    sq, sk = q.shape[1], k.shape[1]
    kp = _plan_from_tensors(dkdv_plan, c["DKDV_BLOCK_M"], c["DKDV_BLOCK_N"], sq, sk, "k")
    qp = _plan_from_tensors(dq_plan, c["DQ_BLOCK_M"], c["DQ_BLOCK_N"], sq, sk, "q")
    return dense_bwd(dout, q, k, v, out, lse, kp, qp, softmax_scale, c, dlse=dlse)


@_dense_bwd_op.register_fake
def _(dout, dlse, q, k, v, out, lse, dkdv_plan, dq_plan, softmax_scale, cfg):
    return fake_bwd(q, k, v)


register_op_autograd("longca_triton::dense_attention_fwd", _dense_bwd_op, _PLAN_LEN)


# ----------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, softmax_scale=None,
                    return_lse: bool = False, config: Optional[dict] = None, deterministic: bool = False):
    """Attention of ``q [B, Sq, Hq, D_qk]`` over ``k [B, Sk, Hkv, D_qk]``, ``v [B, Sk, Hkv, D_v]``
    under a ``RangeMask``.

    Differentiable in q, k, v (and through ``lse`` when returned). ``config`` overrides launch
    parameters (keys: ``CONFIG_KEYS``); defaults come from :func:`default_config`. Returns ``out``
    ``[B, Sq, Hq, D_v]`` in q's dtype, or ``(out, lse)`` with ``lse [B, Hq, Sq]`` float32 (natural
    log; ``-inf`` and a zero output row where a query row attends nothing).

    ``deterministic=True``: bitwise-identical gradients run to run. The two-kernel default and
    ``one_launch`` have no atomics (every dq/dk/dv tile has one owner that sums in a fixed
    order), so they already are, at no cost; only ``fused_dq`` (fp32 atomics) is not, and an
    explicit config asking for it raises ValueError (an autotuned one falls back to two kernels).
    """
    _check_inputs(q, k, v, int(mask.seqlen_q), int(mask.seqlen_k))
    softmax_scale = _resolve_scale(softmax_scale, q.shape[-1])
    cfg = _config_for(q, k, v, mask, config, deterministic)
    fwd_plan, dkdv_plan, dq_plan = plans_for(mask, cfg, q.device)
    out, lse = DenseAttentionFunction.apply(q, k, v, fwd_plan, dkdv_plan, dq_plan, softmax_scale,
                                            cfg)
    return (out, lse) if return_lse else out


def dense_attention_op(q, k, v, mask, softmax_scale=None, return_lse=False, config=None, deterministic=False):
    """Same as :func:`dense_attention`, through the ``torch.library`` ops (``torch.compile``-able).

    Build the plans outside the compiled region if you can (``plans_for``); here they are
    looked up (cached) on each call, which ``torch.compile`` treats as a graph break.
    """
    _check_inputs(q, k, v, int(mask.seqlen_q), int(mask.seqlen_k))
    softmax_scale = _resolve_scale(softmax_scale, q.shape[-1])
    cfg = _config_for(q, k, v, mask, config, deterministic)
    fwd_plan, dkdv_plan, dq_plan = _plans_no_compile(mask, cfg, q.device)
    return dense_attention_from_plans(q, k, v, fwd_plan, dkdv_plan, dq_plan, softmax_scale, cfg,
                                      return_lse)


@torch.compiler.disable
def _plans_no_compile(mask, cfg, device):
    return plans_for(mask, cfg, device)


def dense_attention_from_plans(q, k, v, fwd_plan, dkdv_plan, dq_plan, softmax_scale, cfg,
                               return_lse=False):
    """The custom-op path given ready plans: traceable by ``torch.compile`` without breaks."""
    out, lse = torch.ops.longca_triton.dense_attention_fwd(
        q, k, v, fwd_plan.q_tensors(), dkdv_plan.k_tensors(), dq_plan.q_tensors(),
        float(softmax_scale), _cfg_to_list(cfg))
    return (out, lse) if return_lse else out


check_plan = _check_plan

r"""Dense structured-mask attention in Gluon, warp-specialized for sm_90 (Hopper) only.

The forward is ``attention_fwd.gluon_fwd_kernel`` (FlashAttention-3's design in Gluon: a TMA
producer warp, two (or three: ``consumers``) consumer warpgroups, async wgmma with the softmax of one key
tile overlapping the ``P V`` of the previous one). The backward (``gluon_bwd=True``) is
``attention_bwd.py``: a delta preprocess, then a warp-specialized dQ kernel and a warp-specialized
dK/dV kernel (why two and not FA3's one with dQ atomics: that module's docstring), or
(``bwd_design="mixed"``, the default at D = 128) the Gluon dQ kernel and our plain-Triton dK/dV
kernel; with ``gluon_bwd=False`` it is our plain-Triton dense backward on this forward's ``out`` and
``lse``.

Head dims: the forward takes every head dim our plain-Triton kernels take (multiples of 8 up to
256, D_v may differ from D_qk: 64, 80, 96, 128, 192/128, 256...) on power-of-two tiles
(``attention_fwd``'s docstring), or with ``split_d`` a dim that is two powers of two (80 = 64 + 16,
96 = 64 + 32) as two exact pieces; the Gluon backward only 64 and 128 with D_v == D_qk
(``BWD_HEAD_DIMS``), other dims run the plain-Triton backward (``gluon_bwd`` is turned off,
``bwd_reason`` says why).

Launch configuration (a ``config`` dict, keys ``CONFIG_KEYS``):

* ``BLOCK_N``: key-tile rows (64 or 128); the query tile is 64 rows per consumer warpgroup
  (``fwd_block_m``: 128 with two, 192 with three).
* ``consumers``: consumer warpgroups of the forward, 2 or 3 (``CONSUMERS``; three by default where
  both head-dim tiles are 64 wide, and at D = 128 on masks of density >= ``DENSE_THREE``).
* ``num_stages``: depth of the K/V shared-memory ring (each stage holds one K and one V tile).
* ``pingpong``: hand a token between the consumers so their GEMMs alternate (FA3's schedule).
* ``consumer_regs``: registers per thread of each consumer warpgroup (``setmaxnreg``). The SM's
  65536 registers over the warpgroups allow ``REG_BUDGET`` = 504 per thread summed over them; the
  producer gets ``504 - consumers * consumer_regs`` (240 / 240 / 24 is FA3's split with two
  consumers, 160 x 3 / 24 with three).
* ``split_d``: run a head dim that is not a power of two as two exact power-of-two pieces (96 =
  64 + 32: two TMA descriptors per operand, ``S = Q0 K0^T + Q1 K1^T``, two ``P V`` accumulators;
  ``attention_fwd``'s docstring) instead of one zero-padded tile (96 -> 128). On by default at
  D = 96 on masks of density >= 0.5 (``resolve_config``, measured); ``split_d_reason`` says which
  dims it takes.
* ``p_smem``: ``O += P V`` reads P from shared memory (each consumer stores its P tile there, a
  ``[64, BLOCK_N]`` buffer of its own) instead of from registers: FA3's choice at head dim 96 with
  three consumers (``MmaPV_is_RS = false``), which frees the P registers during the next tile's
  softmax at the cost of a shared-memory round trip and a smaller ring; ours is the default at
  D = 128 with three consumers on masks of density >= ``DENSE_THREE`` (``default_config``).

* ``persistent``: one CTA per SM walks the query tiles (a static tile scheduler) instead of one CTA
  a tile; ``o_own``: O is staged for its TMA store in buffers of its own (``64 x D_v`` a consumer)
  instead of Q's, so Q's buffer is free for the next tile right after the last ``S``. Both on by
  default at D = 64, 96, 128 (``PERSIST_HEAD_DIMS``) on masks of density below ``DENSE_THREE`` (with
  the deepest ring that fits beside O's buffers), off elsewhere (``default_config``'s docstring,
  session 15). ``o_in_p`` (persistent with ``p_smem``, one head-dim piece, ``D_v <= BLOCK_N``): O is
  staged in the consumer's P buffer instead, which needs no shared memory of its own (three
  consumers with P in shared memory leave none for O's buffers) and likewise frees Q right after
  the last ``S``. ``snake``: the persistent CTAs take the heaviest-first work list in a
  boustrophedon (``attention_fwd._work_index``) instead of plain round robin.
* ``split_partial``: on a mask with partial tiles, two launches: the full tiles in the kernel compiled
  without the mask path, then the partial tiles in one that merges its (O, lse) into the first's
  (``gluon_fwd``): with the mask path compiled in, ptxas moves the key loop's descriptor and ring
  arithmetic off the uniform datapath (session 17: a mask that is full but for one key per row tile
  ran 10 % slower than full).
* ``mask_head``: 0, 1 or 2 (``MASK_HEAD``; a bool means 0 / 1): on a mask with partial tiles, each
  query tile's first ``mask_head`` partial key tiles move to the front of its walk and those steps
  mask without a branch (``attention_fwd``: a full tile's rows allow every key, so masking it changes
  nothing), the loop compiled without the mask path; a tile's other partial tiles (none on causal at
  128-row tiles; few on the window and document masks with 2) run in the split launch's second half.
  2 is meant for two consumers (three spill 776 B at sm_90a); the default at D = 96 and 128 follows
  ``default_mask_head``.
* ``rowsum_mma``: the softmax's row sums by one more async wgmma per ``P V`` step, P against a block
  of ones (N = 8), instead of one FADD per score (``attention_fwd._rowsum_mma``): the default for
  D = 64's persistent launch (``ROWSUM_HEAD_DIMS``, +1 to +8 %); slower elsewhere (the narrow GEMM
  costs the tensor pipe more than the FADDs cost the issue slots at D = 96 / 128).
* ``pv_sync``: each consumer's ``P_{j-1} V_{j-1}`` issued before ``S_j`` and finished before it
  (``attention_fwd._kv_step``): no overlap inside a warpgroup, so ``P``'s registers are free while
  ``S_j`` is live and three consumers with register P fit 160 registers (D = 96 split: no spills on
  sm_90a, 256 B without it); the other warpgroups' GEMMs keep the tensor cores busy. The default at
  D = 96 on dense masks with three persistent consumers (session 29, H200, 16K, checked: full 521 ->
  589, causal 513 -> 551 TFLOP/s; 0.90 / 0.86 of D = 128 per FLOP, FA3 0.93 / 0.91).
* ``poly_exp``: 0, or n in ``POLY_EXP``: one of every n exponentials of the forward's softmax is
  computed by a degree-3 polynomial on the FMA pipe instead of the MUFU (FlashAttention-4's
  split; ``attention_fwd._exp2_mix_asm``). Measured slower at every n and head dim on an H100 (the
  softmax there is bound by instruction issue, not by the MUFU): off, kept for study.

* ``gluon_bwd``: the Gluon backward (else the plain-Triton one, whose keys are the dense kernel's,
  ``bwd_config``);
  ``dq_block_n`` (key-tile rows of the dQ kernel), ``dkdv_block_mq`` (query-tile
  rows of the dK/dV kernel), ``dq_stages`` / ``dkdv_stages`` (ring depths, >= 2),
  ``dkdv_skew`` (issue a tile's S^T, dP^T before the previous tile's dV, dK GEMMs finish: more
  overlap, more registers), ``bwd_consumer_regs``.
* ``dq_mask_head``: the dQ kernel's ``mask_head`` (``dq_plan``): where no query tile has more than two
  partial key tiles, those are its first steps, masked without a branch (the loop compiled without
  the mask path: sm_90a 256 instructions a step instead of 444). The default at D = 128
  (``DQ_MASK_HEAD_DIMS``: +1.6 % on causal and prefix_lm_causal's backward; ``-m gpu`` test
  ``test_dq_mask_head``).
* ``bwd_streams`` (``bwd_design="mixed"``): the plain-Triton dK/dV kernel first and the Gluon dQ kernel on a
  second CUDA stream beside it (``_runtime.side_stream``; the plain-Triton backward's key of the same name),
  instead of dQ then dK/dV on one stream. Same kernels, same bits. The default wherever ``"mixed"`` is
  (D = 128): H100, 16K, interleaved (``experiments/results/h100/session20/``), backward TFLOP/s
  sliding_window_causal 315.9 -> 325.5, sliding_window 355.1 -> 364.2, full 458.7 -> 470.1, causal 439.4
  -> 445.7, causal_document 368.4 -> 370.4, prefix_lm_causal 444.7 -> 450.2 (every round).
* ``bwd_design``: ``"split"`` (the dQ kernel and the dK/dV kernel above, 7 GEMMs per tile pair,
  no atomics), ``"mixed"`` (the Gluon dQ kernel, then the plain-Triton dK/dV kernel with the dense
  kernel's ``DKDV_*`` / ``dkdv_*`` keys from ``bwd_config``: each pass from the family that runs it
  faster; the default at D = 128, ``MIXED_BWD_HEAD_DIMS``; a config naming a key of the Gluon dK/dV
  kernel but no design gets ``"split"``) or ``"fused"`` (``attention_bwd_fused.py``: FA3's one
  key-major kernel, 5 GEMMs per pair, dQ added into fp32 by atomics, then cast; not deterministic;
  measured slower than ``"split"``, the default nowhere). ``fused_block_mq`` (query-tile rows, 32 or
  64) and ``fused_stages`` (Q/dO ring depth, >= 2) are the fused kernel's, and ``fused_dq`` its dQ
  path: ``"atomic"`` (default: the consumer warpgroups add their dQ^T partial by fp32 atomics
  from registers), ``"writer"`` (they stage it in shared memory and a 2-warp writer partition
  adds it by coalesced 4-wide atomics) or ``"writer_keys"`` (the same, but at D = 128 each
  warpgroup computes its own keys' dQ^T over all 128 head-dim rows and the writer sums the two,
  so the warpgroups no longer wait for each other's dS^T every tile; at D = 64 it is ``"writer"``).
  Neither writer is measured on a GPU yet. The writer runs on the producer warpgroup's
  registers, so both take ``bwd_consumer_regs`` <= 232 (their default).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from longca_triton.kernels.core.autograd import attention_function
from longca_triton.kernels.core.runtime import (
    block_head_dim,
    bsh_strides,
    check_qkv,
    config_head_dim,
    descriptor_ready,
    ensure_allocator,
    head_dim_label,
    head_dim_meta,
    resolve_scale,
    side_stream,
)
from longca_triton.kernels.core import config as _config_mod
from longca_triton.kernels.core.config import ConfigSpec
from longca_triton.kernels.core.config import resolve as _resolve
from longca_triton.kernels.core.jit import LOG2E
from longca_triton.kernels.dense.op import check_plan
from longca_triton.kernels.dense.op import check_deterministic as dense_check_deterministic
from longca_triton.kernels.dense.op import dense_bwd, launch_bwd_dkdv, launch_bwd_preprocess, plans_for
from longca_triton.kernels.dense.op import resolve_config as dense_resolve_config
from longca_triton.kernels.gluon.fwd import head_pieces, o_fits_q, split_pieces
from longca_triton.kernels.gluon.plan import HEAD_TILES, WsPlan, get_ws_plan

__all__ = [
    "gluon_attention", "gluon_fwd", "default_config", "resolve_config", "device_reason",
    "smem_bytes", "fwd_block_m", "CONSUMERS", "CONFIG_KEYS", "BWD_HEAD_DIMS", "MIXED_BWD_HEAD_DIMS",
    "PLAIN_BWD_HEAD_DIMS", "bwd_reason", "BLOCK_M", "SMEM_LIMIT", "split_d_reason", "o_in_p_reason",
    "split_partial_reason", "fwd_plan", "dq_plan", "default_mask_head",
]

#: query-tile rows per CTA of the backward kernels, and of the forward with its default two consumer
#: warpgroups of 64 rows (``fwd_block_m``: 64 per consumer)
BLOCK_M = 128
#: the Gluon backward's head dims (with D_v == D_qk); the forward takes every head dim our
#: plain-Triton kernels take (``_runtime.head_dim_reason``: multiples of 8 up to 256, D_v may
#: differ), and other dims run the plain-Triton backward (``bwd_reason``)
BWD_HEAD_DIMS = (64, 128)
#: head dims of ``BWD_HEAD_DIMS`` whose default backward is ``bwd_design="mixed"`` (the Gluon dQ
#: kernel, the plain-Triton dK/dV kernel): at D = 128 it measured 7-11 % faster than the plain-Triton
#: pair and 5-23 % faster than the Gluon pair on all 12 static masks (``default_config``)
MIXED_BWD_HEAD_DIMS = (128,)
#: head dims of ``BWD_HEAD_DIMS`` whose default backward is the plain-Triton one (``gluon_bwd=False``):
#: at D = 64 the Gluon pair measured 1.28-1.42x its time and the mixed one 1.22-1.34x (session 18,
#: ``default_config``); the Gluon designs stay configs and autotune candidates there
PLAIN_BWD_HEAD_DIMS = (64,)
#: (D_qk, D_v) pairs whose forward has passed tests/test_gluon_gpu.py on an H100
#: (experiments/results/h100/gluon/test_gluon_gpu.txt: 64, 128; gluon/run2/gluon_gpu_new.txt:
#: ``test_padded_head_dims`` at 80, 96, 192/128, 256 on four shapes each, and gluon/run2/
#: headdims_diag.jsonl). ``gluon_attention`` takes every head dim the plain-Triton kernels take;
#: the ``triton-gluon`` backend offers only these until a GPU run of the tests adds others here.
GPU_CHECKED_HEAD_DIMS = ((64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (256, 256))
#: dynamic shared memory one CTA may use on sm_90 (227 KB)
SMEM_LIMIT = 232448
#: registers per thread summed over the warpgroups (consumers + producer), a little under the
#: register file's 65536 / 128 = 512 per thread of a warpgroup: FA3's 240 + 240 + 24 with two
#: consumers, 160 x 3 + 24 with three
REG_BUDGET = 504
#: the register file of an SM, in 32-bit registers
REG_FILE = 65536
#: head dims (D_qk == D_v) whose forward runs persistent with O's own buffers on masks below
#: ``PERSIST_BELOW`` (D = 64, 96) or ``DENSE_THREE`` (D = 128) (``resolve_config``; measured at these
#: three, session 15)
PERSIST_HEAD_DIMS = (64, 96, 128)
#: mask density from which the D = 128 forward runs three consumers with P through shared memory, and
#: below which it runs persistent (``resolve_config``: full 1.0 and prefix_lm_causal 0.86 win with
#: three; causal 0.5 won with three against one tile a CTA of two (session 14) but loses 1.3 % to two
#: persistent ones walking a boustrophedon (session 17); the masks below 0.4 lose: default_config)
DENSE_THREE = 0.6
#: the largest share of partial tiles among the key tiles the D = 128 forward visits at which it
#: splits its launch (``split_partial``; session 17, call 12: on at prefix_lm_causal 1.0 % and
#: causal 1.6 %, +4-5 %; off at causal_blockwise 4.9 % and full_document 8.7 %, -1 and -4 %)
SPLIT_PARTIAL_SHARE = 0.025
#: at D = 128 the forward moves each query tile's first partial key tiles (one, or two with two
#: consumers: ``default_mask_head``) to the front of its walk (``mask_head``) where at most this share
#: of the query tiles have partial tiles beyond them. Session 18, calls 13 and 15, TFLOP/s default /
#: mask_head=1, interleaved: causal (no such tile) 607 / 642, prefix_lm_causal (13 of 86) 632 / 651,
#: causal_blockwise (65 of 128) 555 / 588, full_document (65 of 128) 541 / 542 and 567 / 573. Session
#: 19, call 1, mask_head 0 / 1 / 2: causal 642 / 676 / 666, causal_blockwise 568 / 602 / 606,
#: full_document 552 / 555 / 566, sliding_window_causal 456 / 389 / 488, global_sliding_window
#: 563 / 536 / 601, causal_document 514 / 472 / 530, sliding_window 529 / 507 / 576,
#: prefix_lm_document 515 / 478 / 529; share_question (112 of 128 query tiles with more than two)
#: 505 / 451 / 465
MASK_HEAD_REST_TILES = 0.6
#: head dims (D_qk == D_v) where ``mask_head``'s default rule applies (``default_mask_head``). D = 96
#: (session 19, call 11, two persistent consumers on the padded tile, mask_head 0 / 1 / 2):
#: causal_document 414 / 386 / 428, sliding_window_causal 374 / 324 / 400, full_document 449 / 460 /
#: 463, causal_blockwise 444 / 476 / 473, sliding_window 420 / 407 / 458 (its dense masks run split
#: tiles, which the merging launch cannot take). D = 64 is left out: its 192-row tiles (three
#: consumers) keep more partial tiles for the second launch and lose 2-18 % on the sparse masks
#: (causal, one tile a CTA, gains 4 % with 1: 467 / 488 / 481; not a rule yet)
MASK_HEAD_DIMS = (96, 128)
#: head dims whose persistent forward (the sparser masks) takes its row sums from the tensor cores
#: (``rowsum_mma``). Session 19, calls 8-9, 16K, GQA 64:8, TFLOP/s default / rowsum_mma, interleaved:
#: D = 64 persistent (three consumers) full_document 416-421 / 430, causal_document 339-341 / 363,
#: share_question 313-315 / 331, causal_blockwise 441-442 / 449, prefix_lm_document 344-346 / 373,
#: sliding_window 362-363 / 393, sliding_window_causal 273 / 289, global_sliding_window 356 / 375,
#: block_causal_document 443-445 / 450; one tile a CTA (dense) full 513-523 / 499-509, causal 467 / 465;
#: D = 96 (split, ping-pong) full 536 / 513, causal 505 / 499, causal_document 417 / 404; D = 128 full
#: (three consumers, P in shared memory: the extra accumulator spills 336 B) 675-689 / 462, causal 656
#: / 615, sliding_window_causal 505-509 / 464
ROWSUM_HEAD_DIMS = (64,)
#: head dims where the Gluon dQ kernel takes ``dq_mask_head`` by default (``dq_plan`` still keeps the
#: merged plan where some query tile has more than two partial key tiles): H100, 16K, GQA 64:8, bf16,
#: backward interleaved with it off (``experiments/results/h100/session20/``, ``bwd_configs_ab.py``),
#: TFLOP/s: causal 428.2 -> 435.2, prefix_lm_causal 427.2 -> 434.3 (+1.6 % each); its GPU test covers D = 128
DQ_MASK_HEAD_DIMS = (128,)
#: mask density below which the D = 64 and 96 forwards run persistent (session 15; causal, 0.5, was
#: not measured persistent at these dims and stays one tile a CTA)
PERSIST_BELOW = 0.5

#: the Gluon backward's own keys: a config naming one (and not ``gluon_bwd``) asks for that backward
GLUON_BWD_KEYS = ("dq_block_n", "dq_stages", "dkdv_block_mq", "dkdv_stages", "dkdv_skew", "bwd_consumer_regs",
                  "bwd_design", "fused_block_mq", "fused_stages", "fused_dq", "dq_mask_head", "bwd_streams")
CONFIG_KEYS = ("BLOCK_N", "num_stages", "pingpong", "consumer_regs", "split_d", "gluon_bwd",
               "consumers", "p_smem", "persistent", "o_own", "o_in_p", "snake", "poly_exp",
               "split_partial", "mask_head", "rowsum_mma", "pv_sync") + GLUON_BWD_KEYS
#: ``poly_exp``: 0 (every exponential of the forward's softmax on the MUFU) or n: one of every n
#: consecutive scores of a thread by a polynomial on the FMA pipe (``attention_fwd._exp2``)
POLY_EXP = (0, 2, 4, 8)
#: ``mask_head``: 0, or how many of each query tile's partial key tiles (its first) the forward masks in
#: its first steps without a branch (``plan.build_ws_plan(part="head", head=...)``)
MASK_HEAD = (0,) + HEAD_TILES
#: consumer warpgroups of the forward (``consumers``): two (FA3's default) or three (FA3's choice at
#: head dims <= 96, where the GEMMs are short next to the softmax); the query tile is 64 rows each
CONSUMERS = (2, 3)
BWD_DESIGNS = ("split", "fused", "mixed")
#: the Gluon dK/dV kernel's keys: a config naming one but no ``bwd_design`` asks for ``"split"``
#: (``"mixed"`` runs the plain-Triton dK/dV kernel, which has keys of its own)
GLUON_DKDV_KEYS = ("dkdv_block_mq", "dkdv_stages", "dkdv_skew")
#: the fused backward's dQ paths (``attention_bwd_fused.py``): atomics from the MMA warpgroups, or a
#: dQ-writer partition fed through shared memory
FUSED_DQ = ("atomic", "writer", "writer_keys")
#: the most ``bwd_consumer_regs`` the dQ-writer kernel takes (its default there)
FUSED_WRITER_REGS = 232
_SPEC = ConfigSpec("gluon-attention", CONFIG_KEYS,
                   tile_keys=("BLOCK_N", "dq_block_n", "dkdv_block_mq", "fused_block_mq"),
                   bool_keys=("pingpong", "split_d", "dkdv_skew", "gluon_bwd", "p_smem", "persistent", "o_own",
                              "o_in_p", "snake", "split_partial", "rowsum_mma", "dq_mask_head", "bwd_streams",
                              "pv_sync"),
                   tuned_name="triton-gluon")


def default_config(head_dim: int, dtype: torch.dtype = torch.bfloat16, head_dim_v: Optional[int] = None) -> dict:
    """128-row key tiles (FA3's choice at these head dims) and the rest as measured on an H100.

    ``head_dim`` is D_qk, ``head_dim_v`` D_v (default: D_qk); the kernel works on their padded
    power-of-two tiles (``_runtime.block_head_dim``), so 80 and 96 take the 128 defaults.

    Measured, D = 128 only. Forward, S = 16K, GQA 64:8 (experiments/results/h100/gluon/gluon_configs.md):
    ring depth 1 -> 2 is worth 25-35 %, 2 -> 3 within 2 %; ping-pong between the consumer
    warpgroups within +-3 % either way (full 659 off / 643 on, causal 585 / 576, causal_document
    484 / 490 TFLOP/s at 2 stages), so it is off by default: the overlap inside a warpgroup (S_j
    issued before the softmax of tile j-1 finishes) already hides most of the softmax. 64-row key
    tiles lose 10-20 %. Backward (gluon_bwd_configs.log): rings of 3 for dQ and 2 for dK/dV beat 2/3
    by 14-17 % (full 69.8 -> 59.7 ms, causal 32.2 -> 26.7 ms).

    Two rules by mask (``resolve_config``). D = 128: where every tile the mask touches is full (no
    partial tiles: ``full``, ``block_causal_document``) the dK/dV kernel walks 64-row query tiles
    (``dkdv_block_mq=64``); every static mask at 16K, GQA 64:8, H100 (gluon/run3/bwd_masks.log,
    ms, 32 / 64): full 60.0 / 51.2, block_causal_document 13.4 / 11.7; causal 28.1 / 31.5,
    full_document 14.1 / 16.8, causal_document 8.0 / 9.1, share_question 10.6 / 14.5,
    causal_blockwise 21.4 / 24.2, prefix_lm_causal 47.4 / 57.1 (0.9 % partial tiles and still
    -17 %), prefix_lm_document 8.2 / 9.3, sliding_window 7.5 / 8.7, sliding_window_causal 4.4 / 5.0,
    global_sliding_window 13.9 / 14.4. The same run timed the plain-Triton backward under the Gluon
    forward (``gluon_bwd=False``): ahead on share_question only (10.1 vs 10.5 ms), 1-9 % behind on
    the other eleven, so ``gluon_bwd`` stayed on then (no longer at D = 128: below). D = 96:
    ``split_d`` on where the mask's density is at least 0.5 (gluon/run3/split_d.log, TFLOP/s, padded /
    split: full 506 / 522, causal 456 / 494, causal_document 383 / 354, cuDNN 492 / 450); at D = 80
    split loses on full (434 / 415) and causal_document (325 / 278) and wins causal by 2 % (400 /
    407): off. The dQ-writer variants of the fused backward (``fused_dq``) are right on the GPU
    (gluon/run3) and 1.6x faster than its atomic dQ (full 83.1 -> 54.0 ms, causal 44.9 -> 31.4) but
    still behind split (51.4 / 27.3).

    Forward at the other head dims (gluon/run2/headdims.log, 16K): D = 64 449 / 445 TFLOP/s full /
    causal (0.94 / 0.95x cuDNN), 96 510 / 464 (1.03x), 192/128 615 / 575 (0.96 / 0.95x), 256 721 / 657
    (1.04 / 0.99x) with the defaults below, chosen on the CPU (tests/test_gluon.py: no spills at 240
    registers, shared memory within ``SMEM_LIMIT``): D = 64 (and any padded tile <= 128: 80, 96) keeps
    the 128-row key tiles and 3-stage ring. A 256-wide padded tile (D_qk or D_v in 136..256: 192/128, 256) takes
    64-row key tiles (FA3 uses 80 at D = 256; ours are powers of two) and the deepest ring up to 3
    that fits: 192/128 3 stages (Q 64 KB, K 32 KB and V 16 KB a stage), 256 2 stages (32 + 32 KB a
    stage). Why not 128-row key tiles there: they fit one stage only and spill at 240 registers
    (ptxas: 192/128 308 B, 256 748 B of spill stores; the defaults spill nothing). Dims outside
    ``BWD_HEAD_DIMS`` (or D_v != D_qk) default to ``gluon_bwd=False``.

    Which backward at D = 128: the mixed one (``bwd_design="mixed"``: the Gluon dQ kernel, then the
    plain-Triton dK/dV kernel) since session 18, whose interleaved timing (experiments/results/h100/
    session18, calls 4-5: whole backwards, repetitions interleaved, each pair checked against float32
    first; 16K, GQA 64:8, bf16, ms plain pair / mixed / Gluon pair) put it ahead on all 12 static
    masks: full 50.74 / 47.06 / 54.29 (sdpa-cudnn 39.26), causal 26.62 / 24.58 / 28.87 (21.52),
    causal_document 7.81 / 7.22 / 8.04, share_question 9.77 / 9.06 / 11.10, causal_blockwise 20.48 /
    18.89 / 21.84, prefix_lm_causal 29.32 / 27.10 / 32.40, prefix_lm_document 7.91 / 7.29 / 8.37,
    global_sliding_window 13.98 / 12.99 / 14.52, block_causal_document 11.82 / 10.63 / 11.92,
    full_document 13.75 / 12.72 / 14.85, sliding_window 7.66 / 7.09 / 7.62, sliding_window_causal
    4.52 / 4.17 / 4.39 (launching dK/dV first: within 1 %). Session 12 had measured the mixed pair
    "no faster" than the plain one, timing each pair after the other (below): the order effect
    session 15 found in the harness. Through the harness (``bench dense``, backends interleaved,
    three runs, call 6-7): ``triton-gluon`` full 481 / 476 / 476, causal 457 / 459 / 455 TFLOP/s
    against sdpa-cudnn 545 / 546 / 541 and 520 / 511 / 513 (0.87-0.88x / 0.88-0.90x). At D = 64 the
    opposite (call 12, same script, ms plain / mixed / Gluon pair): full 28.39 / 38.09 / 40.09 (cuDNN
    22.67), causal 13.66 / 18.11 / 19.39, causal_document 4.14 / 5.06 / 5.36, sliding_window_causal
    2.43 / 2.96 / 3.10: D = 64 runs the plain-Triton backward (``PLAIN_BWD_HEAD_DIMS``), so the Gluon
    split pair is the default at no head dim. Before session 18 D = 128 ran the plain-Triton one
    (``gluon_bwd=False``), from session 12. The dense
    kernel's backward gained the row-major dK/dV sweep and the 64x64 dK/dV tiles (issue 13) and now
    beats the Gluon split backward (``experiments/results/h100/bwd_session12``: each pass alone and
    the four pairs, 16K, GQA 64:8, bf16, H100, ms Gluon / plain): full 51.6 / 49.1, causal 27.3 /
    26.3, causal_document 7.93 / 7.79, prefix_lm_causal 30.1 / 28.7, share_question 10.6 / 9.6,
    prefix_lm_document 8.24 / 7.90, global_sliding_window 14.1 / 13.8, full_document 14.1 / 13.5,
    causal_blockwise 20.9 / 20.3; Gluon ahead on block_causal_document 11.4 / 11.8, sliding_window
    7.47 / 7.67, sliding_window_causal 4.32 / 4.45 (mean: plain 2.5 % faster). By pass, Gluon's dQ is
    the faster (full 17.3 vs 20.4 ms) and the plain dK/dV (28.3 vs 31.5), yet the mixed pair is no
    faster than the plain one (full 48.9, causal 26.5) except on share_question (9.28) (sequential
    timing: see session 18 above).

    Three consumer warpgroups (``consumers=3``, a 192-row query tile, 160 registers each: FA3's
    choice at small head dims) where both head-dim tiles are 64 wide: D = 64 at 16K, GQA 64:8, H100
    (experiments/results/h100/bwd_session13, calls 6-7, two machines, TFLOP/s, two / three): full
    448 / 529 and 448 / 510, causal 436 / 490 and 440 / 471, causal_document 301 / 341 and 313 / 350
    (sdpa-cudnn 480 / 465). ptxas counts some spill bytes (~400: the producer at 24 registers and the
    consumers at 160; 152 for the consumers spills less and measured 10-20 % slower). At D = 96
    (split) and 128 the 128-row key tiles spill far more at 160 registers (360 / 1190 B: 358 vs 547,
    467 vs 674 TFLOP/s full) and 64-row ones run 2-4 % behind two consumers (536 vs 547, 648 vs 674).

    P through shared memory (``p_smem``, FA3's ``MmaPV_is_RS = false``) frees the registers that
    held P while the next tile's softmax runs: with it three consumers fit 160 registers at D = 128
    (ptxas: no spill in the main loops of a mask without partial tiles, ~20 spill stores / 35 loads
    a step with them) and the ring has 2 stages (Q 48 KB, P 48 KB, 64 KB a stage). Measured
    (experiments/results/h100/session14, 16K, GQA 64:8, TFLOP/s, default / three consumers + P in
    shared memory, ping-pong on or off, three calls): full 639-643 / 650-670, causal 574-587 /
    586-612, prefix_lm_causal 592-600 / 556-627, causal_blockwise 544-554 / 553-581, full_document
    535-552 / 541-555, causal_document 470 / 472-480; losses where the 192-row query tile covers
    ragged structure: share_question 477-495 / 407-431, global_sliding_window 544 / 454-466,
    block_causal_document 570 / 544-553, sliding_window 493 / 470-483. So ``resolve_config`` turns
    it on at D = 128 for masks of density >= ``DENSE_THREE`` (0.5: full, causal, prefix_lm_causal),
    ping-pong off (on / off changed places between calls: within the machines' spread). Runs of the
    same config on one machine differ by up to 6 % on these masks (prefix_lm_causal), so the rule
    rests on full and causal, where all three calls agree. At D = 96 (split) it ties the default
    (523 vs 525, causal 482 vs 496) and at D = 64 it loses (443 vs 511): there P stays in registers.

    Persistent launch (``persistent``: one CTA per SM walks the query tiles, the next tile's Q and
    K/V load while a tile's last ``P V`` and epilogue run; ``o_own``: O staged in buffers of its
    own, so Q is released right after the tile's last ``S``; ``attention_fwd``'s docstring). A
    CTA's fixed cost is what it removes: at 16K the forward's time on sliding_window_causal with
    windows of 256..8192 fits ~8 us a CTA plus ~1.3 us a key tile (experiments/results/h100/session15,
    call 1). Measured (call 2, 16K, GQA 64:8, TFLOP/s, one tile a CTA / persistent, O in Q's
    buffers, 3 stages / persistent + ``o_own``, 2 stages): sliding_window_causal 400 / 488 / 498,
    prefix_lm_document 456 / 504 / 533, share_question 486 / 530 / 541, causal_document 496 / 536 /
    544, block_causal_document 615 / 666 / 691, global_sliding_window 531 / 557 / 581, full_document
    541 / 561 / 587, sliding_window 521 / 532 / 541, causal_blockwise 548 / 559 / 562; the dense
    masks (three consumers, P in shared memory, no room for O's buffers) lose: full 668 / 638,
    causal 589 / 565, prefix_lm_causal 629 / 589. So ``resolve_config`` turns on the persistent
    launch with ``o_own`` and a 2-stage ring (Q 32 + O 32 + 2 x 64 KB) at D = 128 on the masks below
    ``DENSE_THREE``, where two consumers run. At D = 128 two consumers persistent on the dense masks
    do not beat the default (call 8: full 682 / 647, causal 601 / 585, 602 with ping-pong,
    prefix_lm_causal 632 / 612), nor three consumers with 64-key tiles and O's own buffers (590 /
    508 / 514). D = 96 (padded, two consumers) and D = 64 (three consumers, a 3-stage ring beside O)
    on four sparse masks (call 8, default / persistent / persistent + ``o_own``):
    sliding_window_causal 304 / 386 / 393-413 and 251 / 261 / 283-286, causal_document 384 / 423 /
    410-422 and 341 / 344 / 341-349, share_question 373 / 426 / 412-445 and 323 / 305 / 315-320,
    full_document 442 / 441 / 441-446 and 417 / 424 / 415-428 (two runs of the same config differ by
    up to 8 % there: gluon_diag times one config after the other). So the rule holds at
    ``PERSIST_HEAD_DIMS`` (64, 96, 128, D_v = D_qk); other dims keep one tile a CTA. The one
    tile a CTA path is unchanged in speed by the rewrite (call 3, A/B with the previous kernel: full
    689.0 / 688.6, causal 607.1 / 610.9, D = 64 causal 485.8 / 479.9).

    Session 17 (experiments/results/h100/session17, 16K, GQA 64:8, TFLOP/s, each mask's configs timed
    interleaved): the boustrophedon work list (``snake``) with two persistent consumers and O's own
    buffers: causal_blockwise 570 -> 578, full_document 546 -> 557 (call 1), and on causal it beats
    three consumers one tile a CTA in both calls that timed it (606 / 598, 628 / 620), while full (654
    / 674) and prefix_lm_causal (574 / 594) keep three: so ``snake`` follows ``persistent`` and
    ``DENSE_THREE`` is 0.6 (causal, 0.5, runs two persistent consumers). Three consumers persistent
    (O in Q's buffers, or in P's: ``o_in_p``, which frees Q right after the last ``S``) against one
    tile a CTA, interleaved: full 650 / 653 / 640, causal 575 / 579 / 598, prefix_lm_causal 580 / 582
    / 594 (call 1): not a default. One exponential in n on the FMA pipe (``poly_exp``) loses at every
    n and dim (call 2, default / n = 2 / 4 / 8: D = 96 full 532 / 461 / 508 / 526, D = 128 full 674 /
    - / 597 / 646, D = 64 full 540 / 405 / 443 / 515): the softmax is bound by issue, not by the MUFU.
    The split launch (``split_partial``, call 12, one tile a CTA / split): prefix_lm_causal 605.9 /
    632.1, causal (two persistent consumers) 581.4 / 609.0, prefix_lm_causal at prefix S - 1 606.4 /
    636.2 (full 666.9); causal_blockwise 556.1 / 548.4 and full_document 540.0 / 517.1 lose (their
    partial tiles are 4.9 and 8.7 % of the work, the second launch's share grows): on at D = 128 where
    partial tiles are at most ``SPLIT_PARTIAL_SHARE`` of the visited tiles. With its second launch
    over the query tiles that have partial tiles only (call 19): prefix_lm_causal 616.1 / 645.5, causal
    603.4 / 622.2, prefix 12288 614.6 / 659.0.

    Session 18 (experiments/results/h100/session18, calls 13 and 15): ``mask_head`` (each query
    tile's first partial key tile at the front of its walk, masked at step 0 without a branch; the
    others in the split launch's second half) against the defaults then, interleaved: causal 607.4 /
    642.2 (split / mask_head), prefix_lm_causal 631.6 / 651.2, causal_blockwise 555.3 / 588.2 (one
    launch), full_document 540.9 / 542.2; losses where most query tiles keep partial tiles for the
    second launch: sliding_window_causal 448.9 / 384.1, global_sliding_window 579.9 / 546.2,
    causal_document 521.6 / 477.2, share_question 507.1 / 450.5. On at D = 128 where at most
    ``MASK_HEAD_REST_TILES`` of the query tiles have such tiles; it takes precedence over the split
    launch. Session 19 (call 1): ``mask_head=2`` (the first two partial tiles masked without a branch)
    wins where query tiles have two partial tiles, against the best other launch: sliding_window_causal
    488.0 (455.7 one launch), global_sliding_window 601.0 (563.3), sliding_window 575.9 (529.1),
    causal_document 529.5 (513.7), prefix_lm_document 528.9 (514.8), full_document 565.6 (554.5 with
    one), causal_blockwise 605.8 (602.0); causal keeps one (676.4 / 665.7), share_question none
    (505.4; 465.3 with two: 112 of its 128 query tiles have more). ``default_mask_head``.

    ``split_d`` (two exact head-dim pieces instead of a padded tile, 80 / 96 ...) is off here and
    turned on by ``resolve_config`` at D = 96 on dense masks (above; its GPU tests pass,
    gluon/run3/split_d_tests.txt), with a 4-stage ring (a split tile needs less shared memory; H100,
    16K, gluon/run4/d96, TFLOP/s, split 3 / 4 stages: full 518 / 525, causal 498 / 512; 5 stages at
    80 not timed, split stays off there), and ping-pong on (bwd_session12/call9, split 4 stages, off /
    on: full 520 / 543, causal 492 / 500, causal_document (padded there) 382 / 382; the same call's
    D = 128: full 666, causal 580 TFLOP/s, so D = 96 reaches 0.82 / 0.86 of it per counted FLOP).
    Session 28 (H200, experiments/results/h200/session28, 16K, TFLOP/s, D = 96 / 128): ours 516 / 662 full (0.78),
    FlashAttention-3's forward 629 / 676 (0.93; 192 x 144 tiles, three MMA warpgroups, persistent, its S and P V
    wgmma at the exact widths N = 144 and 96, which Gluon 3.6's power-of-two shapes do not allow); at D = 96
    ``persistent`` 525 / 515 (full / causal) against the default's 520 / 498, three consumers with P in shared memory
    equal persistent and 4 % behind one tile a CTA. Session 29 (H200, experiments/results/h200/session29, calls 5-6):
    three consumers with register P and ``pv_sync``, persistent (``resolve_config``'s D = 96 rule), through the
    harness, checked: full 521.0 -> 589.2, causal 512.6 -> 550.8 TFLOP/s (one tile a CTA 584.3 / 534.7); the closing
    run (call 6: ``bench dense --head-dim 96,128,64,192/128,256 --backends triton-gluon,sdpa-cudnn``) 593.8 / 560.9
    against D = 128's 661.1 / 655.5: **0.898 / 0.856 per FLOP** (cuDNN 0.78 / 0.79).
    """
    dv = head_dim if head_dim_v is None else head_dim_v
    d128 = head_dim > 64
    bn = 128 if config_head_dim(head_dim, dv) <= 128 else 64
    # three consumer warpgroups where both tiles are 64 wide (the GEMMs are short next to the softmax)
    consumers = 3 if block_head_dim(head_dim) == block_head_dim(dv) == 64 else 2
    stages = next((st for st in (3, 2, 1)
                   if smem_bytes(head_dim, bn, st, head_dim_v=dv, consumers=consumers) <= SMEM_LIMIT), 1)
    # backward: 64-row key tiles for dQ and 32-row query tiles for dK/dV at D=128 keep the
    # consumers within 240 registers (128-row / 64-row ones spill 300-700 B, tests/test_gluon.py);
    # the fused design likewise: 32-row query tiles at D=128 (64-row spill ~330 B), 64 at D=64
    return dict(BLOCK_N=bn, num_stages=stages, pingpong=False, consumer_regs=160 if consumers == 3 else 240,
                split_d=False, consumers=consumers, p_smem=False, persistent=False, o_own=False, o_in_p=False,
                snake=False, poly_exp=0, split_partial=False, mask_head=0, rowsum_mma=False, pv_sync=False,
                gluon_bwd=not bwd_reason(head_dim, dv) and head_dim not in PLAIN_BWD_HEAD_DIMS,
                dq_block_n=64, dq_stages=3 if d128 else 2, dkdv_block_mq=32 if d128 else 64,
                dkdv_stages=2 if d128 else 3, dkdv_skew=False, bwd_consumer_regs=240,
                bwd_design="mixed" if head_dim in MIXED_BWD_HEAD_DIMS else "split",
                fused_block_mq=32 if d128 else 64, fused_stages=2 if d128 else 3, fused_dq="atomic",
                dq_mask_head=head_dim in DQ_MASK_HEAD_DIMS and dv in DQ_MASK_HEAD_DIMS,
                bwd_streams=head_dim in MIXED_BWD_HEAD_DIMS)


def fused_split_d(head_dim: int, fused_dq: str = "atomic") -> bool:
    """Whether the fused backward's warpgroups split dQ^T by head-dim rows (D = 128: one atomic per
    element per key tile, each warpgroup waiting for the other's dS^T) rather than by keys (D = 64:
    32 rows would be below wgmma's 64; ``fused_dq="writer_keys"``: the writer sums the partials)."""
    return head_dim >= 2 * 64 and fused_dq != "writer_keys"


def smem_bytes(head_dim: int, block_n: int, num_stages: int, elem: int = 2, *,
               head_dim_v: Optional[int] = None, split_d: bool = False, consumers: int = 2,
               p_smem: bool = False, o_own: bool = False, rowsum_mma: bool = False) -> int:
    """Shared memory of one forward CTA, an upper bound: Q (a 64-row tile of the padded D_qk per
    consumer warpgroup, ``consumers``,
    reused to stage O), the ring of K (padded D_qk) and V (padded D_v, ``head_dim_v``, default
    D_qk) tiles, with ``p_smem`` a ``[64, block_n]`` P tile per consumer, and 1 KB for the mbarriers
    and the allocator's alignment. ``head_dim``: D_qk.
    With ``split_d`` a dim that splits takes its true width (its two pieces), not the padded one."""
    dv = head_dim if head_dim_v is None else head_dim_v
    dqk = sum(head_pieces(head_dim, block_head_dim(head_dim), split_d))
    dv = sum(head_pieces(dv, block_head_dim(dv), split_d))
    q = 64 * consumers * dqk * elem
    ring = num_stages * block_n * (dqk + dv) * elem
    p = 64 * consumers * block_n * elem if p_smem else 0
    o = 64 * consumers * dv * elem if o_own else 0
    ones = block_n * 8 * elem if rowsum_mma else 0  # the row sums' block of ones (ROWSUM_MMA)
    return q + ring + p + o + ones + 1024


def _mask_head_value(value) -> int:
    """``mask_head`` as an int in ``MASK_HEAD`` (``True`` / ``False`` from older configs: 1 / 0)."""
    if isinstance(value, bool):
        return int(value)
    if value not in MASK_HEAD:
        raise ValueError(f"config['mask_head'] must be one of {MASK_HEAD} (how many of each query tile's partial "
                         f"key tiles its first steps mask without a branch) or a bool, got {value!r}")
    return int(value)


def default_mask_head(partial_per_tile, consumers: int) -> int:
    """The forward's default ``mask_head`` (D = 96 and 128: ``MASK_HEAD_DIMS``) on a mask whose query
    tiles have ``partial_per_tile`` partial key tiles each: 1 where no query tile has more than one
    (causal: a second masked step costs 1.5 %), else 2 with two consumers (three spill there) and 1
    with three, where at most ``MASK_HEAD_REST_TILES`` of the query tiles keep partial tiles beyond
    those for the split launch's second half; 0 without partial tiles or where more do."""
    per_tile = np.asarray(partial_per_tile)
    if not per_tile.any():
        return 0
    k = 1 if per_tile.max() <= 1 or consumers != 2 else 2
    return k if int((per_tile > k).sum()) <= MASK_HEAD_REST_TILES * len(per_tile) else 0


def split_partial_reason(cfg: dict, head_dim: int, head_dim_v: Optional[int] = None) -> str:
    """Why the split launch (``split_partial``) cannot take ``cfg`` at these head dims (empty when it
    can): its second launch merges O as one head-dim piece (no ``split_d`` split of D_v)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    if head_pieces(dv, block_head_dim(dv), bool(cfg["split_d"]))[1]:
        return f"its merge takes O as one head-dim piece: D_v={dv} with split_d=True is two; use split_d=False"
    return ""


def o_in_p_reason(cfg: dict, head_dim: int, head_dim_v: Optional[int] = None) -> str:
    """Why ``o_in_p`` (O staged in the consumers' P buffers) cannot take ``cfg`` at these head dims
    (empty when it can): it needs the persistent launch (``persistent``), P in shared memory
    (``p_smem``), not ``o_own`` (O has buffers of its own then), and O as one head-dim piece no
    wider than the P buffer (``D_v``'s tile <= ``BLOCK_N``)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    if not (cfg["persistent"] and cfg["p_smem"]):
        return "O is staged in P's shared buffers: it needs persistent=True and p_smem=True"
    if cfg["o_own"]:
        return "o_own=True gives O buffers of its own: use one of o_own, o_in_p"
    pieces = head_pieces(dv, block_head_dim(dv), bool(cfg["split_d"]))
    if pieces[1] or pieces[0] > int(cfg["BLOCK_N"]):
        return (f"O's tile at D_v={dv} ({'+'.join(str(x) for x in pieces if x)} wide) does not fit a "
                f"[64, BLOCK_N={cfg['BLOCK_N']}] P buffer as one piece")
    return ""


def bwd_reason(head_dim: int, head_dim_v: Optional[int] = None) -> str:
    """Why the Gluon backward cannot take these head dims (empty when it can)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    if head_dim in BWD_HEAD_DIMS and dv == head_dim:
        return ""
    return (f"the Gluon backward takes head dims {BWD_HEAD_DIMS} with D_v == D_qk, not "
            f"{head_dim_label(head_dim, dv)}; the plain-Triton backward runs instead (gluon_bwd=False)")


def split_d_reason(head_dim: int, head_dim_v: Optional[int] = None) -> str:
    """Why ``split_d`` cannot take these head dims (empty when it can): at least one of D_qk, D_v
    must not be a power of two, and each one that is not must be two powers of two ``D0 > D1 >=
    16`` (``attention_fwd.split_pieces``: 48, 80, 96, 144, 160, 192). A power-of-two dim keeps its
    one tile (96/128 splits Q K^T only)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    odd = [d for d in dict.fromkeys((head_dim, dv)) if d & (d - 1)]
    label = head_dim_label(head_dim, dv)
    if not odd:
        return f"head dims {label} are powers of two: nothing to split (split_d is for 80, 96, ...)"
    bad = [d for d in odd if split_pieces(d) is None]
    if bad:
        return (f"head dim {bad[0]} (of {label}) is not two powers of two D0 > D1 >= 16 (wgmma's k16 step): "
                f"split_d takes 48, 80, 96, 144, 160, 192; use split_d=False (a zero-padded tile)")
    return ""


def bwd_smem_bytes(kind: str, head_dim: int, tile: int, num_stages: int, elem: int = 2) -> int:
    """Shared memory of a backward CTA (upper bound, 1 KB for barriers): ``"dq"`` holds Q and dO
    (128 rows each) and a ring of K, V tiles of ``tile`` rows; ``"dkdv"`` holds K and V (128 rows)
    and a ring of Q, dO tiles of ``tile`` rows; ``"fused"`` the dK/dV kernel's plus the dS^T buffers,
    ``"fused_writer"`` / ``"fused_writer_keys"`` (``fused_dq="writer"`` / ``"writer_keys"``) those
    plus the fp32 dQ^T staging buffers."""
    if kind in ("fused", "fused_writer", "fused_writer_keys"):  # plus two dS^T buffers of [128, tile] per parity
        base = (2 * BLOCK_M * head_dim + num_stages * 2 * tile * head_dim + 2 * BLOCK_M * tile) * elem + 1024
        if kind == "fused":
            return base
        # the writer's fp32 dQ^T partials of (step parity, warpgroup), [rows, tile] each
        rows = head_dim // 2 if fused_split_d(head_dim, kind[len("fused_"):]) else head_dim
        return base + 2 * 2 * rows * tile * 4
    return (2 * BLOCK_M * head_dim + num_stages * 2 * tile * head_dim) * elem + 1024


def _regs(consumer_regs: int, consumers: int = 2) -> tuple[int, int]:
    """``(producer_regs, maxnreg)``: the producer gets what the ``consumers`` warpgroups leave of the
    budget; ``maxnreg`` is the launch's even share of the register file over ``consumers + 1``
    warpgroups of 128 threads, a multiple of 8 (168 for two consumers, 128 for three)."""
    return REG_BUDGET - consumers * consumer_regs, REG_FILE // (128 * (consumers + 1)) // 8 * 8


def fwd_block_m(cfg: dict) -> int:
    """Query rows per CTA of the forward: 64 per consumer warpgroup."""
    return 64 * int(cfg["consumers"])


def resolve_config(head_dim: int, dtype: torch.dtype, config: Optional[dict] = None, *, q=None,
                   k=None, mask=None, v=None, head_dim_v: Optional[int] = None) -> dict:
    """``config`` (else the autotune cache's ``triton-gluon`` entry) over :func:`default_config`,
    validated: tiles, ring depth against shared memory, the register split. ``head_dim`` is D_qk,
    ``head_dim_v`` D_v (else ``v``'s, else D_qk). Where the Gluon backward cannot take the dims
    (``bwd_reason``) ``gluon_bwd`` is turned off, silently when it came from the defaults or the
    autotune cache, with ValueError when ``config`` asks for it; ``split_d`` likewise where the
    dims do not split (``split_d_reason``). A config (explicit or cached) that sets a key of the
    Gluon backward (``GLUON_BWD_KEYS``) but not ``gluon_bwd`` gets the Gluon backward where it can run,
    whatever the default (the mixed design at D = 128, the plain-Triton backward at D = 64)."""
    if head_dim_v is None:
        head_dim_v = head_dim if v is None else int(v.shape[-1])
    dv = head_dim_v
    base = default_config(head_dim, dtype, dv)
    if head_dim == dv == 128 and hasattr(mask, "block_tables") and mask.block_tables(64, 128).num_partial == 0:
        # mask-dependent default (default_config's docstring: 64-row dK/dV query tiles win on the
        # masks without partial tiles, full and block_causal_document, and lose on every other)
        base["dkdv_block_mq"] = 64
    d96_three = head_dim == dv == 96 and mask is not None and getattr(mask, "density", 0.0) >= 0.5
    if d96_three:
        # exact 64 + 32 pieces instead of a padded 128 tile win where rows walk many key tiles
        # (default_config's docstring: full +3 %, causal +8 %; causal_document -8 %), and the
        # smaller split stages leave room for a 4-deep ring (gluon/run4: causal 498 -> 512 TFLOP/s)
        base["split_d"] = True
        if smem_bytes(96, base["BLOCK_N"], 4, split_d=True) <= SMEM_LIMIT:
            base["num_stages"] = 4
        # and the consumers ping-pong: the split tile's GEMMs are 3/4 of D = 128's for the same
        # softmax, so handing the tensor cores back and forth pays here (bwd_session12 calls 9 and 17,
        # TFLOP/s, off / on: full 520 / 543 and 520 / 542, causal a tie; at D = 128 within +-3 %)
        base["pingpong"] = True
        # and (session 29, H200) three consumers with register P, each warpgroup's P V finished before its S
        # (pv_sync: no overlap inside a warpgroup, so register P fits 160 registers: no spills on sm_90a, where
        # the overlapped loop spills 256 B), persistent: the other two warpgroups' GEMMs hide a softmax. 16K,
        # through the harness, checked: full 521.0 -> 589.2, causal 512.6 -> 550.8, prefix_lm_causal (the third
        # static mask this dense) 506.9 -> 560.4 TFLOP/s (D = 128: 653.8 / 637.3). Their 160 registers, the ring
        # that fits beside a third Q tile (3 stages) and the boustrophedon follow from the rules below
        base.update(consumers=3, pv_sync=True, persistent=True)
    dense_three = head_dim == dv == 128 and mask is not None and getattr(mask, "density", 0.0) >= DENSE_THREE
    if dense_three:
        # three consumers with P through shared memory where rows walk many key tiles (default_config's
        # docstring, session 14: full +4-5 %, causal +2-7 %; the sparser masks lose to the 192-row tile)
        base.update(consumers=3, p_smem=True, consumer_regs=160)
    sparse_persist = (head_dim == dv and head_dim in PERSIST_HEAD_DIMS and mask is not None
                      and getattr(mask, "density", 1.0) < (DENSE_THREE if head_dim == 128 else PERSIST_BELOW))
    if sparse_persist:
        # persistent, O in its own buffers (the deepest ring that fits beside them: 2 stages at 96 and
        # 128, 3 at 64) where rows walk few key tiles and a CTA's start and end weigh (default_config's
        # docstring, session 15: sliding_window_causal +25 % at 128, +30 % at 96, +14 % at 64; the
        # dense masks lose, -4 to -6 %), the work list walked as a boustrophedon (session 17: +1-2 %)
        base.update(persistent=True, o_own=True, snake=True)
        if head_dim in ROWSUM_HEAD_DIMS:
            # the row sums by the tensor cores (ROWSUM_HEAD_DIMS: +1 to +8 % on all nine of these masks
            # at D = 64; the dense ones and D = 96 / 128 lose)
            base["rowsum_mma"] = True
    # the explicit config, else the autotune cache's entry (``config`` stays the explicit one: the
    # checks below raise for what a user asked for and quietly fix what the cache holds)
    overlay = config if config is not None else _config_mod.tuned_config(_SPEC, q, k, mask,
                                                                          v if dv != head_dim else None)
    if overlay and "gluon_bwd" not in overlay and any(key in overlay for key in GLUON_BWD_KEYS):
        # a config that sets the Gluon backward's keys asks for that backward
        base["gluon_bwd"] = not bwd_reason(head_dim, dv)
    if overlay and "bwd_design" not in overlay and any(key in overlay for key in GLUON_DKDV_KEYS):
        # ... and one that tunes the Gluon dK/dV kernel for the design that runs it (configs and
        # autotune entries from before the mixed default keep their meaning)
        base["bwd_design"] = "split"
    cfg = _resolve(_SPEC, base, overlay or {})
    no_bwd = bwd_reason(head_dim, dv)
    if no_bwd:
        if config is not None and config.get("gluon_bwd"):
            raise ValueError(f"config['gluon_bwd']=True: {no_bwd}")
        cfg["gluon_bwd"] = False
    if cfg["split_d"]:
        no_split = split_d_reason(head_dim, dv)
        if no_split:
            if config is not None and config.get("split_d"):
                raise ValueError(f"config['split_d']=True: {no_split}")
            cfg["split_d"] = False
    if not cfg["split_d"] and base["split_d"]:
        # the 4-deep ring and the ping-pong above were measured with the split tile only: where a
        # padded one runs instead (split_d=False from the config or the autotune cache), what the
        # config did not choose returns to the padded defaults
        padded = default_config(head_dim, dtype, dv)
        for key in ("num_stages", "pingpong", "consumers", "pv_sync", "persistent"):
            if key not in (overlay or {}):
                cfg[key] = padded[key]
    elif d96_three and (int(cfg["consumers"]), bool(cfg["p_smem"])) != (3, False):
        # three consumers with register P, pv_sync and the persistent launch were measured together: a split
        # tile that leaves the three consumers or register P gets the split tile's two-consumer defaults for
        # what the config did not choose (its 4-deep ring is the base's already)
        for key in ("pv_sync", "persistent"):
            if key not in (overlay or {}):
                cfg[key] = False
    if sparse_persist and (int(cfg["consumers"]), bool(cfg["p_smem"])) != (base["consumers"], base["p_smem"]):
        # the persistent launch with O's own buffers was measured with the default consumers and P in
        # registers: a config that leaves them gets one tile a CTA and the usual ring, unless it
        # names these
        plain = default_config(head_dim, dtype, dv)
        for key in ("persistent", "o_own", "num_stages"):
            if key not in (overlay or {}):
                cfg[key] = plain[key]
    named = overlay or {}
    if (sparse_persist and cfg["o_own"] and "o_own" not in named and "num_stages" in named
            and smem_bytes(head_dim, cfg["BLOCK_N"], int(cfg["num_stages"]), head_dim_v=dv, split_d=cfg["split_d"],
                           consumers=int(cfg["consumers"]), p_smem=cfg["p_smem"], o_own=True) > SMEM_LIMIT):
        # a ring the config asked for that leaves no room for O's buffers: O is staged in Q's
        cfg["o_own"] = False
    if dense_three and int(cfg["consumers"]) != 3:
        # P through shared memory was measured with three consumers only: a config that picks two
        # (and says nothing of p_smem) gets them with P in registers, their measured default (and two
        # consumers' registers: the rule below)
        if "p_smem" not in (overlay or {}):
            cfg["p_smem"] = False
    if "snake" not in named:
        # the boustrophedon is the persistent launch's order unless a config says otherwise (it orders
        # nothing without one)
        cfg["snake"] = bool(cfg["persistent"])
    if cfg["o_in_p"] and cfg["o_own"] and "o_own" not in named:
        # O staged in P's buffers replaces the default's own O buffers
        cfg["o_own"] = False
    if ("split_partial" not in named and head_dim == dv == 128 and mask is not None
            and hasattr(mask, "block_tables")):
        # the split launch where partial tiles are a small share of the work (SPLIT_PARTIAL_SHARE):
        # the full tiles then run in the kernel without the mask path, whose uniform datapath that
        # path costs (attention_fwd._consume_tile), and the second launch stays short
        bt = mask.block_tables(fwd_block_m(cfg), int(cfg["BLOCK_N"]))
        visited = bt.num_full + bt.num_partial
        cfg["split_partial"] = bool(bt.num_partial) and bt.num_partial <= SPLIT_PARTIAL_SHARE * visited
    if ("mask_head" not in named and "split_partial" not in named and head_dim == dv
            and head_dim in MASK_HEAD_DIMS and not split_partial_reason(cfg, head_dim, dv)
            and mask is not None and hasattr(mask, "block_tables")):
        # each query tile's first partial key tiles masked without a branch, the others (if any) in the
        # split launch's second half: where few query tiles have others (MASK_HEAD_REST_TILES; a config
        # that names the split launch gets the split launch; D = 96's split tiles cannot merge)
        bt = mask.block_tables(fwd_block_m(cfg), int(cfg["BLOCK_N"]))
        cfg["mask_head"] = default_mask_head(np.diff(np.asarray(bt.q_part_ptr)), int(cfg["consumers"]))
    cfg["mask_head"] = _mask_head_value(cfg["mask_head"])
    if (cfg["split_partial"] or cfg["mask_head"]) and split_partial_reason(cfg, head_dim, dv):
        key = "mask_head" if cfg["mask_head"] else "split_partial"
        raise ValueError(f"config[{key!r}]={cfg[key]!r}: {split_partial_reason(cfg, head_dim, dv)}")
    if cfg["o_in_p"] and o_in_p_reason(cfg, head_dim, dv):
        raise ValueError(f"config['o_in_p']=True: {o_in_p_reason(cfg, head_dim, dv)}")
    if cfg["snake"] and not cfg["persistent"]:
        raise ValueError("config['snake']=True orders a persistent launch's work list: it needs persistent=True")
    if isinstance(cfg["poly_exp"], bool) or cfg["poly_exp"] not in POLY_EXP:
        raise ValueError(f"config['poly_exp'] must be one of {POLY_EXP} (0: every exponential on the MUFU; n: one "
                         f"of every n by a polynomial on the FMA pipe), got {cfg['poly_exp']!r}")
    cfg["poly_exp"] = int(cfg["poly_exp"])
    if cfg["BLOCK_N"] not in (64, 128):
        raise ValueError(f"config['BLOCK_N'] must be 64 or 128 for the Gluon forward, got {cfg['BLOCK_N']}")
    consumers = cfg["consumers"]
    if isinstance(consumers, bool) or consumers not in CONSUMERS:
        raise ValueError(f"config['consumers'] must be one of {CONSUMERS} (consumer warpgroups of the forward), "
                         f"got {consumers!r}")
    cfg["consumers"] = consumers = int(consumers)
    if "consumer_regs" not in (overlay or {}):
        # the registers follow the consumer count unless the config names them: four warpgroups share
        # the register file with three (FA3 gives its three 160), three with two (240)
        cfg["consumer_regs"] = min(int(cfg["consumer_regs"]), 160) if consumers == 3 else 240
    p_smem, o_own = cfg["p_smem"], cfg["o_own"]
    if (consumers == 3 or p_smem or o_own) and "num_stages" not in (overlay or {}):
        # the deepest ring up to the default's that fits beside the Q tiles (and the P tiles)
        cfg["num_stages"] = next((st for st in range(int(cfg["num_stages"]), 0, -1)
                                  if smem_bytes(head_dim, cfg["BLOCK_N"], st, head_dim_v=dv, split_d=cfg["split_d"],
                                                consumers=consumers, p_smem=p_smem, o_own=o_own,
                                                rowsum_mma=cfg["rowsum_mma"]) <= SMEM_LIMIT), 1)
    stages = int(cfg["num_stages"])
    need = smem_bytes(head_dim, cfg["BLOCK_N"], max(stages, 1), head_dim_v=dv, split_d=cfg["split_d"],
                      consumers=consumers, p_smem=p_smem, o_own=o_own, rowsum_mma=cfg["rowsum_mma"])
    if stages < 1 or need > SMEM_LIMIT:
        raise ValueError(f"config['num_stages']={cfg['num_stages']} does not fit: the ring needs "
                         f"{need} B of shared memory at D={head_dim_label(head_dim, dv)}, "
                         f"BLOCK_N={cfg['BLOCK_N']} (limit {SMEM_LIMIT} B); use >= 1 stage and fewer than that")
    regs_fwd = regs = int(cfg["consumer_regs"])
    producer, _ = _regs(regs, consumers)
    if regs % 8 or not 24 <= producer <= regs <= 256:
        top = (REG_BUDGET - 24) // consumers // 8 * 8
        raise ValueError(f"config['consumer_regs'] must be a multiple of 8 up to {top} with {consumers} consumers "
                         f"(the producer gets {REG_BUDGET} - {consumers} * consumer_regs >= 24); "
                         f"got {cfg['consumer_regs']}")
    if cfg["dq_block_n"] not in (64, 128) or cfg["dkdv_block_mq"] not in (32, 64):
        raise ValueError(f"config['dq_block_n'] must be 64 or 128 and config['dkdv_block_mq'] 32 or 64; got "
                         f"{cfg['dq_block_n']}, {cfg['dkdv_block_mq']}")
    if cfg["bwd_design"] not in BWD_DESIGNS:
        raise ValueError(f"config['bwd_design'] must be one of {BWD_DESIGNS}, got {cfg['bwd_design']!r}")
    if cfg["fused_block_mq"] not in (32, 64):
        raise ValueError(f"config['fused_block_mq'] must be 32 or 64; got {cfg['fused_block_mq']}")
    if cfg["fused_dq"] not in FUSED_DQ:
        raise ValueError(f"config['fused_dq'] must be one of {FUSED_DQ}, got {cfg['fused_dq']!r}")
    fused_kind = "fused" if cfg["fused_dq"] == "atomic" else f"fused_{cfg['fused_dq']}"
    for key, need in (("dq_stages", lambda st: bwd_smem_bytes("dq", head_dim, cfg["dq_block_n"], st)),
                      ("dkdv_stages", lambda st: bwd_smem_bytes("dkdv", head_dim, cfg["dkdv_block_mq"], st)),
                      ("fused_stages", lambda st: bwd_smem_bytes(fused_kind, head_dim, cfg["fused_block_mq"], st))):
        st = int(cfg[key])
        # why >= 2: the dQ GEMM of tile j-1 reads K_{j-1} while K_j lands (and dK/dV likewise);
        # at dims the Gluon backward does not take, its rings are never built
        if st < 2 or (not no_bwd and need(st) > SMEM_LIMIT):
            raise ValueError(f"config[{key!r}]={cfg[key]} does not fit: needs >= 2 stages and "
                             f"{need(max(st, 2))} B <= {SMEM_LIMIT} B of shared memory")
        cfg[key] = st
    regs = int(cfg["bwd_consumer_regs"])
    if regs % 8 or not 24 <= _regs(regs)[0] <= regs <= 256:
        raise ValueError(f"config['bwd_consumer_regs'] must be a multiple of 8 in [168, 240]; got {regs}")
    # the dQ writer shares the producer's warpgroup and its 504 - 2 * bwd_consumer_regs registers:
    # at 24 (240) its loop spills (ptxas), at 40 (232) nothing in the kernel does
    if cfg["bwd_design"] == "fused" and cfg["fused_dq"] != "atomic" and regs > FUSED_WRITER_REGS:
        if config is not None and "bwd_consumer_regs" in config:
            raise ValueError(f"config['bwd_consumer_regs']={regs} leaves the fused_dq={cfg['fused_dq']!r} "
                             f"partition {_regs(regs)[0]} registers; use <= {FUSED_WRITER_REGS} (or leave it out)")
        regs = FUSED_WRITER_REGS
    cfg["num_stages"], cfg["consumer_regs"], cfg["bwd_consumer_regs"] = stages, regs_fwd, regs
    return cfg


def device_reason(device) -> str:
    """Why the Gluon kernel cannot run on ``device`` (empty when it can): sm_90 (Hopper) only."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return (f"the Gluon kernel needs an sm_90 (Hopper) GPU; device is {dev.type} "
                "(Triton's CPU interpreter cannot run Gluon)")
    cap = torch.cuda.get_device_capability(dev)
    if cap != (9, 0):
        return f"the Gluon kernel is written for sm_90 (Hopper: wgmma, setmaxnreg); this GPU is sm_{cap[0]}{cap[1]}"
    return ""


def check_inputs(q, k, v, mask=None) -> None:
    """Shapes, dtypes, head dims, device: clear errors before any kernel runs."""
    # head dims: multiples of 8 from 8 to 256 for D_qk and D_v each, as our plain-Triton kernels
    # (``_runtime.head_dim_reason``); the forward pads them to power-of-two tiles
    check_qkv(q, k, v, "the Gluon attention kernel")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the Gluon kernel takes float16 or bfloat16, got {q.dtype}")
    if mask is not None and (int(mask.seqlen_q) != q.shape[1] or int(mask.seqlen_k) != k.shape[1]):
        raise ValueError(f"mask is {mask.seqlen_q} x {mask.seqlen_k} but q/k have Sq={q.shape[1]}, "
                         f"Sk={k.shape[1]}")
    why = device_reason(q.device)
    if why:
        raise ValueError(why)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

def gluon_fwd(q, k, v, plan, softmax_scale: float, cfg: dict, out_dtype=None):
    """Launch the warp-specialized forward. Returns ``out [B, Sq, Hq, D]`` (q's dtype, or
    ``out_dtype``) and ``lse [B, Hq, Sq]`` float32.

    ``plan``: a :class:`WsPlan`, or the split launch's pair ``(full, partial)``
    (``fwd_plan``, config ``split_partial``): the full tiles first, in the kernel compiled without
    the mask path, then the partial tiles in one that merges its (O, lse) into the first's."""
    pieces = plan if isinstance(plan, tuple) else (plan,)
    for piece in pieces:
        check_plan(piece.tiles, fwd_block_m(cfg), cfg["BLOCK_N"], "Gluon forward")
    q, k, v = (descriptor_ready(t) for t in (q, k, v))
    b, sq, hq, d = q.shape
    dv = v.shape[3]
    out = torch.empty((b, sq, hq, dv), device=q.device, dtype=out_dtype or q.dtype)
    lse = torch.empty((b, hq, sq), device=q.device, dtype=torch.float32)
    if b * hq * sq == 0:
        return out, lse
    if len(pieces) > 1 and (out.dtype != q.dtype or split_partial_reason(cfg, d, dv)):
        raise ValueError(f"the split launch (split_partial) needs O in q's dtype and "
                         f"{split_partial_reason(cfg, d, dv) or 'no float32 partial output'}")
    for i, piece in enumerate(pieces):
        # the partial tiles are a few a query tile: their launch runs persistent (one CTA per SM
        # walking the query tiles), where one CTA a tile would pay a CTA's start and end for each
        _launch_fwd(q, k, v, out, lse, piece, softmax_scale, dict(cfg, persistent=True, snake=True) if i else cfg,
                    merge=i > 0)
    return out, lse


def _launch_fwd(q, k, v, out, lse, plan: WsPlan, softmax_scale: float, cfg: dict, merge: bool):
    """One launch of ``gluon_fwd_kernel`` over ``plan`` into ``out``, ``lse``; ``merge``: combine with
    what they hold (the split launch's second half)."""
    from longca_triton.kernels.gluon.fwd import gluon_fwd_kernel

    tiles = plan.tiles
    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    ensure_allocator(q.device)
    producer_regs, maxnreg = _regs(cfg["consumer_regs"], cfg["consumers"])
    dims = head_dim_meta(d, dv)
    split = cfg["split_d"]
    # the work list: the plan's ordered query tiles (all of them, or with the split launch's partial
    # plan those that have partial tiles) times batch * heads
    num_work = len(plan.order) * b * hq
    # persistent: one CTA per SM walks the work list (tiles heaviest first, heads fastest) in steps
    # of the grid; else one CTA per query tile
    grid = (min(num_work, torch.cuda.get_device_properties(q.device).multi_processor_count)
            if cfg["persistent"] else num_work,)
    store_tma = out.dtype == q.dtype
    gluon_fwd_kernel[grid](
        q, k, v, out, lse,
        *bsh_strides(q, k, v, out),
        *plan.tensors(),
        softmax_scale * LOG2E,
        sq, sk, b * hq, hq, hq // hkv, num_work,
        **dims, BLOCK_N=cfg["BLOCK_N"], NUM_IV=tiles.num_iv, NUM_STAGES=cfg["num_stages"],
        HAS_PARTIAL_TILES=plan.has_partial, PINGPONG=cfg["pingpong"],
        # O leaves by a TMA store where it has q's dtype, staged in buffers of its own (o_own) or in
        # Q's where its tiles fit there
        STORE_TMA=store_tma and (cfg["o_own"] or cfg["o_in_p"]
                                 or o_fits_q(d, dv, dims["BLOCK_DQK"], dims["BLOCK_DV"], split)),
        CONSUMER_REGS=cfg["consumer_regs"],
        PRODUCER_REGS=producer_regs,
        SPLIT_D=split, CONSUMERS=cfg["consumers"], P_SMEM=cfg["p_smem"], O_OWN=store_tma and cfg["o_own"],
        PERSISTENT=cfg["persistent"], O_IN_P=store_tma and cfg["o_in_p"], SNAKE=cfg["snake"],
        POLY_EXP=cfg["poly_exp"], MERGE=merge, MASK_HEAD=plan.mask_head, ROWSUM_MMA=cfg["rowsum_mma"],
        PV_SYNC=cfg["pv_sync"],
        num_warps=4, maxnreg=maxnreg,
    )


def _bwd_inputs(dout, q, k, v, out, lse, dlse):
    """What both Gluon backward designs start from: inputs ready for TMA (q and dO with each
    group's heads contiguous, as the key-major kernels read a group's Q and dO as one
    ``[Sq, G * D]`` matrix), empty ``dq, dk, dv``, contiguous ``lse`` and ``delta = rowsum(dO * O)``
    (minus ``dlse``). ``delta`` is None, and the grads zeros, when there is nothing to compute."""
    d = q.shape[-1]
    q, dout = (t if t.stride(3) == 1 and t.stride(2) == d else t.contiguous() for t in (q, dout))
    q, k, v, out, dout = (descriptor_ready(t) for t in (q, k, v, out, dout))
    grads = tuple(torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))
    if q.numel() == 0 or k.shape[1] == 0:
        return q, k, v, dout, lse, None, tuple(g.zero_() for g in grads)
    ensure_allocator(q.device)
    return q, k, v, dout, lse.contiguous(), launch_bwd_preprocess(out, dout, dlse), grads


def _bwd_regs(cfg: dict) -> dict:
    producer_regs, maxnreg = _regs(cfg["bwd_consumer_regs"])
    return dict(CONSUMER_REGS=cfg["bwd_consumer_regs"], PRODUCER_REGS=producer_regs, num_warps=4, maxnreg=maxnreg)


def launch_gluon_bwd_dq(q, k, v, dout, dq, lse, delta, plan: WsPlan, softmax_scale: float, cfg: dict):
    """The Gluon dQ kernel (query-major) into ``dq``; inputs as ``_bwd_inputs`` returns them."""
    from longca_triton.kernels.gluon.bwd import gluon_bwd_dq_kernel

    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    gluon_bwd_dq_kernel[(plan.tiles.num_m * b * hq,)](
        q, k, v, dout, dq, lse, delta,
        *bsh_strides(q, k, v, dout, dq),
        *plan.tensors(),
        softmax_scale * LOG2E, softmax_scale,
        sq, sk, b * hq, hq, hq // hkv,
        HEAD_DIM=d, BLOCK_N=cfg["dq_block_n"], NUM_IV=plan.tiles.num_iv, NUM_STAGES=cfg["dq_stages"],
        HAS_PARTIAL_TILES=plan.has_partial, MASK_HEAD=plan.mask_head, **_bwd_regs(cfg),
    )


def launch_gluon_bwd_dkdv(q, k, v, dout, dk, dv, lse, delta, plan: WsPlan, softmax_scale: float, cfg: dict):
    """The Gluon dK/dV kernel (key-major, a group's query heads walked in turn) into ``dk, dv``."""
    from longca_triton.kernels.gluon.bwd import gluon_bwd_dkdv_kernel

    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    gluon_bwd_dkdv_kernel[(plan.tiles.num_n * b * hkv,)](
        q, k, v, dout, dk, dv, lse, delta,
        q.stride(0), q.stride(1), dout.stride(0), dout.stride(1),
        *bsh_strides(k, v, dk, dv),
        *plan.tensors(),
        softmax_scale * LOG2E, softmax_scale,
        sq, sk, b * hkv, hq, hkv, hq // hkv,
        HEAD_DIM=d, BLOCK_MQ=cfg["dkdv_block_mq"], NUM_IV=plan.tiles.num_iv,
        NUM_STAGES=cfg["dkdv_stages"], HAS_PARTIAL_TILES=plan.has_partial, SKEW=cfg["dkdv_skew"],
        **_bwd_regs(cfg),
    )


def gluon_bwd(dout, q, k, v, out, lse, dq_plan: WsPlan, dkdv_plan, softmax_scale: float,
              cfg: dict, dlse=None, bwd_cfg: Optional[dict] = None):
    """Launch delta preprocess, the Gluon dQ kernel, then the dK/dV kernel of ``cfg["bwd_design"]``:
    the Gluon one (``"split"``, ``dkdv_plan`` a key-major :class:`WsPlan`) or the plain-Triton one
    (``"mixed"``: ``dense.launch_bwd_dkdv`` on the dense :class:`TilePlan` ``dkdv_plan`` with
    ``bwd_cfg``'s ``DKDV_*`` / ``dkdv_*`` keys). Each tile of dQ, dK, dV is written once by one
    program: no atomics, bitwise reproducible. Returns ``dq, dk, dv`` in the inputs' dtype."""
    mixed = cfg["bwd_design"] == "mixed"
    check_plan(dq_plan.tiles, BLOCK_M, cfg["dq_block_n"], "dQ")
    if mixed:
        check_plan(dkdv_plan, bwd_cfg["DKDV_BLOCK_M"], bwd_cfg["DKDV_BLOCK_N"], "dK/dV")
    else:
        check_plan(dkdv_plan.tiles, cfg["dkdv_block_mq"], BLOCK_M, "dK/dV")
    q, k, v, dout, lse, delta, (dq, dk, dv) = _bwd_inputs(dout, q, k, v, out, lse, dlse)
    if delta is None:
        return dq, dk, dv
    if mixed and cfg["bwd_streams"]:
        # the dK/dV programs (the longer ones) first; dQ's fill the SMs beside them and after
        with side_stream(q.device, True) as beside:
            launch_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, dkdv_plan, softmax_scale, bwd_cfg)
            with beside():
                launch_gluon_bwd_dq(q, k, v, dout, dq, lse, delta, dq_plan, softmax_scale, cfg)
        return dq, dk, dv
    launch_gluon_bwd_dq(q, k, v, dout, dq, lse, delta, dq_plan, softmax_scale, cfg)
    if mixed:
        launch_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, dkdv_plan, softmax_scale, bwd_cfg)
    else:
        launch_gluon_bwd_dkdv(q, k, v, dout, dk, dv, lse, delta, dkdv_plan, softmax_scale, cfg)
    return dq, dk, dv


def gluon_bwd_fused(dout, q, k, v, out, lse, plan: WsPlan, softmax_scale: float, cfg: dict, dlse=None):
    """Launch delta preprocess, the fused Gluon backward (``attention_bwd_fused.py``: dK, dV
    written once, dQ added into an fp32 ``dq_accum`` by atomics: from the MMA warpgroups, or with
    ``fused_dq="writer"`` / ``"writer_keys"`` by a writer partition) and the ``dq_accum -> dQ`` cast.
    Returns ``dq, dk, dv`` in the inputs' dtype."""
    from longca_triton.kernels.gluon.bwd_fused import (
        dq_accum_cast_kernel,
        gluon_bwd_fused_kernel,
        gluon_bwd_fused_writer_kernel,
    )

    mq = cfg["fused_block_mq"]
    check_plan(plan.tiles, mq, BLOCK_M, "fused backward")
    q, k, v, dout, lse, delta, (dq, dk, dv) = _bwd_inputs(dout, q, k, v, out, lse, dlse)
    if delta is None:
        return dq, dk, dv
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    num_tiles_q = -(-sq // mq)
    # dQ^T per (b * Hq + h, query tile) as a contiguous [D, mq] block, padded to whole tiles
    dq_accum = torch.zeros((b * hq, num_tiles_q, d, mq), device=q.device, dtype=torch.float32)
    kernel = gluon_bwd_fused_kernel if cfg["fused_dq"] == "atomic" else gluon_bwd_fused_writer_kernel
    kernel[(plan.tiles.num_n * b * hkv,)](
        q, k, v, dout, dk, dv, dq_accum, lse, delta,
        q.stride(0), q.stride(1), dout.stride(0), dout.stride(1),
        *bsh_strides(k, v, dk, dv),
        *plan.tensors(),
        softmax_scale * LOG2E, softmax_scale,
        sq, sk, b * hkv, hq, hkv, hq // hkv,
        HEAD_DIM=d, BLOCK_MQ=mq, NUM_IV=plan.tiles.num_iv, NUM_STAGES=cfg["fused_stages"],
        HAS_PARTIAL_TILES=plan.has_partial, DQ_SPLIT_D=fused_split_d(d, cfg["fused_dq"]), **_bwd_regs(cfg),
    )
    dq_accum_cast_kernel[(num_tiles_q, b * hq)](
        dq_accum, dq, dq.stride(0), dq.stride(1), dq.stride(2), softmax_scale, sq, hq, num_tiles_q,
        HEAD_DIM=d, BLOCK_MQ=mq, num_warps=4,
    )
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Autograd: Gluon forward; Gluon backward (``gluon_bwd``) or the plain-Triton dense backward
# ----------------------------------------------------------------------------------------------

def _fwd(q, k, v, plan, bwd_a, bwd_b, softmax_scale, cfg, bwd_cfg):
    return gluon_fwd(q, k, v, plan, softmax_scale, cfg)


def _bwd(dout, dlse, q, k, v, out, lse, plan, bwd_a, bwd_b, softmax_scale, cfg, bwd_cfg):
    if cfg["gluon_bwd"] and cfg["bwd_design"] == "fused":
        return gluon_bwd_fused(dout, q, k, v, out, lse, bwd_a, softmax_scale, cfg, dlse=dlse)
    if cfg["gluon_bwd"]:
        return gluon_bwd(dout, q, k, v, out, lse, bwd_a, bwd_b, softmax_scale, cfg, dlse=dlse, bwd_cfg=bwd_cfg)
    return dense_bwd(dout, q, k, v, out, lse, bwd_a, bwd_b, softmax_scale, bwd_cfg, dlse=dlse)


#: ``apply(q, k, v, ws_plan, bwd_a, bwd_b, softmax_scale, cfg, bwd_cfg) -> (out, lse)``; the
#: backward plans are the Gluon dQ and dK/dV plans, the fused kernel's key-major plan (and None),
#: or the dense dK/dV and dQ plans
GluonAttentionFunction = attention_function(
    "GluonAttentionFunction", _fwd, _bwd,
    """``(q, k, v) -> (out, lse)``: Gluon forward; Gluon or plain-Triton backward.""")


def fwd_plan(mask, cfg: dict, device):
    """The forward's plan: one :class:`WsPlan`, or on a mask that has partial tiles with
    ``mask_head`` the pair ``(each tile's first mask_head partial tiles in front of its full tiles, the
    other partial tiles)`` (the second left out where there are none), else with ``split_partial`` the
    pair ``(full tiles only, partial tiles only)`` (``gluon_fwd``)."""
    plan = get_ws_plan(mask, fwd_block_m(cfg), cfg["BLOCK_N"], device)
    if not plan.has_partial:
        return plan
    if cfg["mask_head"]:
        head, rest = (get_ws_plan(mask, fwd_block_m(cfg), cfg["BLOCK_N"], device, part=part, head=cfg["mask_head"])
                      for part in ("head", "rest"))
        return (head, rest) if len(rest.order) else (head,)
    if cfg["split_partial"]:
        plan = tuple(get_ws_plan(mask, fwd_block_m(cfg), cfg["BLOCK_N"], device, part=part)
                     for part in ("full", "partial"))
    return plan


def dq_plan(mask, cfg: dict, device):
    """The Gluon dQ kernel's plan: the merged runs, or with ``dq_mask_head`` on a mask whose query tiles
    each have at most two partial key tiles the head plan (``part="head"``, ``head`` = the most any
    tile has): the dQ kernel then masks its first steps without a branch and compiles its loop without
    the mask path (sm_90a: 256 instructions a step instead of 444). dQ has no cheap merge for a second
    launch, so a mask with more partial tiles in some query tile keeps the merged plan."""
    plan = get_ws_plan(mask, BLOCK_M, cfg["dq_block_n"], device, "q")
    if not (cfg["dq_mask_head"] and plan.has_partial):
        return plan
    bt = mask.block_tables(BLOCK_M, int(cfg["dq_block_n"]))
    most = int(np.diff(np.asarray(bt.q_part_ptr)).max())
    if most > max(HEAD_TILES):
        return plan
    return get_ws_plan(mask, BLOCK_M, cfg["dq_block_n"], device, "q", part="head", head=most)


def plans_for_gluon(mask, cfg: dict, bwd_cfg: dict, device):
    """The forward's merged-run plan and the backward's two plans (all cached; the fused Gluon
    backward has one, the second is None; the mixed one the Gluon dQ plan and the dense dK/dV
    :class:`TilePlan` of ``bwd_cfg``'s tiles)."""
    fwd = fwd_plan(mask, cfg, device)
    if cfg["gluon_bwd"] and cfg["bwd_design"] == "fused":
        return fwd, get_ws_plan(mask, cfg["fused_block_mq"], BLOCK_M, device, "k"), None
    if cfg["gluon_bwd"] and cfg["bwd_design"] == "mixed":
        return fwd, dq_plan(mask, cfg, device), plans_for(mask, bwd_cfg, device)[1]
    if cfg["gluon_bwd"]:
        return fwd, dq_plan(mask, cfg, device), get_ws_plan(mask, cfg["dkdv_block_mq"], BLOCK_M, device, "k")
    _, dkdv, dq = plans_for(mask, bwd_cfg, device)
    return fwd, dkdv, dq


def gluon_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, softmax_scale=None,
                    return_lse: bool = False, config: Optional[dict] = None,
                    bwd_config: Optional[dict] = None, deterministic: bool = False):
    """Attention of ``q [B, Sq, Hq, D_qk]`` over ``k [B, Sk, Hkv, D_qk]``, ``v [B, Sk, Hkv, D_v]``
    under a ``RangeMask`` on an sm_90 GPU: the warp-specialized Gluon forward, the Gluon backward
    (``gluon_bwd``, at D 64 / 128 with D_v == D_qk; at 128 by default ``bwd_design="mixed"``: the
    Gluon dQ kernel and the plain-Triton dK/dV kernel) or the plain-Triton one.

    ``config`` sets the launch (``CONFIG_KEYS``), ``bwd_config`` the plain-Triton backward's (the
    dense kernel's keys, with ``gluon_bwd=False``; with ``bwd_design="mixed"`` its dK/dV keys).
    ``deterministic=True``: bitwise-identical gradients run to run (no atomics in either backward).
    Returns ``out`` or ``(out, lse)`` like ``dense_attention``. The fused Gluon backward
    (``bwd_design="fused"``) adds dQ by fp32 atomics: with ``deterministic=True`` an explicit config
    asking for it is refused, one from the autotune cache falls back to ``"split"``.
    """
    check_inputs(q, k, v, mask)
    d, dv = q.shape[-1], v.shape[-1]
    softmax_scale = resolve_scale(softmax_scale, d)
    cfg = resolve_config(d, q.dtype, config, q=q, k=k, mask=mask, v=v)
    bwd_cfg = dense_resolve_config(config_head_dim(d, dv), q.dtype, bwd_config, q=q, k=k, mask=mask,
                                   v=v if dv != d else None)
    # deterministic=True: the split and mixed Gluon backwards have no atomics (each dQ, dK, dV tile
    # is written once by one program), so it holds at no cost; the fused one adds dQ by atomics, and so does
    # the plain-Triton one with fused_dq: refused when explicit, dropped when from the cache
    if deterministic and cfg["gluon_bwd"] and cfg["bwd_design"] == "fused":
        if config is None:
            cfg["bwd_design"] = "split"
        else:
            raise ValueError("gluon_attention: deterministic=True cannot use config bwd_design='fused' "
                             "(dQ by fp32 atomics, not bitwise reproducible); use bwd_design='split' "
                             "or drop deterministic")
    if deterministic and not cfg["gluon_bwd"]:
        dense_check_deterministic(bwd_cfg, True, "the Gluon attention's plain-Triton backward")
    plan, bwd_a, bwd_b = plans_for_gluon(mask, cfg, bwd_cfg, q.device)
    out, lse = GluonAttentionFunction.apply(q, k, v, plan, bwd_a, bwd_b, softmax_scale, cfg, bwd_cfg)
    return (out, lse) if return_lse else out


r"""FlashMask in Triton: attention under column-interval masks, forward and backward, GQA, lse.

A port of the algorithm of *FlashMask: Efficient and Rich Mask Extension of FlashAttention*
(Wang et al., 2024) onto our Triton tiling, so that FlashMask's way of masking can be measured on
the same GPU, with the same online softmax and tensor-descriptor loads, as our ``triton`` kernel
(``longca_triton/kernels/dense*.py``, which classifies tiles from block tables of per-*row* intervals instead).

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

Scores are multiplied by ``softmax_scale * log2(e)`` and exponentiated with ``exp2``; the stored
lse is the natural log (float32, ``[B, Hq, Sq]``).

The column form
---------------
FlashMask describes a mask by four int32 vectors over the *key* columns
(``longca_triton.masks.lowerings.flashmask_columns``)::

    row i is masked for column j  <=>  LTS[j] <= i < LTE[j]   (lower-triangle interval, "LT")
                                   or  UTS[j] <= i < UTE[j]   (upper-triangle interval, "UT")

e.g. causal is ``UT = [0, j)``, ``LT`` empty; causal documents add ``LT = [end(doc(j)), Sq)``.
All twelve static masks of MASKS.md fit; a column with more than one allowed gap does not.
Metadata is ``4 * Sk`` int32, whatever the mask.

Tile classification (FlashMask's Algorithm 1)
----------------------------------------------
Preprocessing (``tile_bounds``, torch ops on the device, ``O(Sk)``): for each key tile of
``BLOCK_N`` columns, the min and max of each vector: 8 int32 per tile
``[LTS_min, LTS_max, LTE_min, LTE_max, UTS_min, UTS_max, UTE_min, UTE_max]``.

At run time (``_classify``), a query tile with rows ``[m0, m1)`` (``m1`` clipped to ``Sq``)
against a key tile is

* **EMPTY** (skipped: no load, no matmul) when one interval covers the rows in every column:
  ``m0 >= LTS_max and m1 <= LTE_min``, or the same with ``UTS/UTE``;
* **PARTIAL** (element mask from the tile's column vectors) when some column's interval may
  touch the rows: ``m1 > LTS_min and m0 < LTE_max``, or the same with ``UTS/UTE``; also the last
  key tile when ``Sk`` is not a multiple of ``BLOCK_N`` (its padding keys are masked out);
* **FULL** otherwise: no mask math at all.

Both tests are conservative (a tile whose rows are covered by LT in some columns and UT in
others is PARTIAL, not EMPTY), never wrong. As in FlashMask, every program walks over *all* key
(or, in dK/dV, query) tiles in order and classifies each by this test; EMPTY tiles are skipped
without any load. The loop range is not narrowed from the mask (FlashMask narrows it only for its
built-in causal flag, which here is just ``UT = [0, j)``), so a skipped tile still costs its
8 scalar loads and compares. ``HAS_LT`` / ``HAS_UT`` (``tl.constexpr``, from the columns) drop
an interval that no column uses, from the test and from the element mask, like FlashMask's
specialisations on the number of bound vectors.

How the skip is written: the walk (``_next_run``) finds the next *run* of consecutive
non-EMPTY tiles, and a plain ``tl.range`` loop processes the run (FULL or PARTIAL per tile by
the same test; the column vectors are loaded only for PARTIAL tiles). Triton 3.6 software-
pipelines the TMA loads of a loop only when they are not under an ``if``: with the skip as an
``if`` around each tile's body, the sm_90 code issued and awaited every K/V load back to back;
with runs, K and V are triple-buffered within each run. Runs per program are few for the
static masks (one for causal, document and window masks; a handful for share_question or
global+window), and each pays one pipeline fill.

Before the min/max, the columns are normalised (clipped to ``[0, Sq]``, empty LT intervals
written ``[Sq, Sq)`` and empty UT ones ``[0, 0)``) so that empty intervals do not weaken the
tests; the ragged last key tile is padded by repeating its last real column, so the padding does
not change min or max.

Tiling
------
* forward (``flashmask_fwd_kernel``): one program per (query tile, query head), heaviest query
  tiles first (the last ones, for causal-like masks); online softmax in fp32.
* backward: ``delta`` preprocess (shared with the dense kernel); key-major dK/dV
  (``flashmask_bwd_dkdv_kernel``), one program per (key tile, KV head) looping over the ``G``
  query heads of the group and over all query tiles, so dK/dV accumulate in registers (no
  atomics); the program's column vectors are loaded once; query-major dQ
  (``flashmask_bwd_dq_kernel``), one program per (query tile, query head).

All tile loads and stores go through tensor descriptors (TMA on Hopper), which zero-fill
out-of-range rows and clip out-of-range stores. Query rows past ``Sq`` (zero ``q`` and ``dO``,
lse read as 0) contribute nothing to dK/dV; key columns past ``Sk`` are masked in every kernel.

Entry point: ``flashmask_attention(q, k, v, mask_or_columns, softmax_scale=None,
return_lse=False, config=None)`` with a ``RangeMask`` (lowered by ``flashmask_columns``) or a
``FlashMaskColumns``. Shapes: ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from longca_triton.masks.ir import BlockSparseMask, RangeMask
from longca_triton.masks.lowerings import FlashMaskColumns, NotExpressible, flashmask_columns

from ._runtime import check_qkv as _check_qkv
from ._runtime import descriptor_ready as _descriptor_ready
from ._runtime import ensure_allocator as _ensure_allocator
from ._runtime import interpreting as _interpreting
from .dense import SUPPORTED_HEAD_DIMS, launch_bwd_preprocess
from .dense_bwd import _load_row_stats

__all__ = [
    "flashmask_attention", "FlashMaskAttentionFunction", "FlashMaskPlan", "flashmask_plan",
    "default_config", "resolve_config", "tile_bounds", "classify_tiles", "flashmask_fwd",
    "flashmask_bwd", "CONFIG_KEYS", "SUPPORTED_HEAD_DIMS", "EMPTY", "PARTIAL", "FULL",
]

LOG2E = 1.4426950408889634

#: tile classes as ``classify_tiles`` reports them
EMPTY, PARTIAL, FULL = 0, 1, 2

# ----------------------------------------------------------------------------------------------
# Launch configs
# ----------------------------------------------------------------------------------------------

#: every key a ``config`` dict may carry: the forward tiles ``BLOCK_M x BLOCK_N``, dK/dV
#: ``DKDV_BLOCK_M x DKDV_BLOCK_N`` (a program owns a key tile of DKDV_BLOCK_N), dQ
#: ``DQ_BLOCK_M x DQ_BLOCK_N`` (a program owns a query tile), warps and pipeline stages.
CONFIG_KEYS = (
    "BLOCK_M", "BLOCK_N", "num_warps", "num_stages",
    "DKDV_BLOCK_M", "DKDV_BLOCK_N", "dkdv_num_warps", "dkdv_num_stages",
    "DQ_BLOCK_M", "DQ_BLOCK_N", "dq_num_warps", "dq_num_stages",
)


def default_config(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Launch parameters: the dense kernel's Hopper defaults (same tiles, warps, stages), so the
    two masking schemes are compared on equal tiling; a small pinned config in the interpreter.

    Compiled for sm_90a with Triton 3.6 on a CPU host (``triton.compile`` + ``ptxas -v``), not
    timed on a GPU yet: no register spills at D = 32, 64, 128, 256 except where noted.
    """
    if _interpreting():
        # the interpreter cannot autotune, and small tiles keep it quick
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1,
                    DKDV_BLOCK_M=32, DKDV_BLOCK_N=32, dkdv_num_warps=4, dkdv_num_stages=1,
                    DQ_BLOCK_M=32, DQ_BLOCK_N=32, dq_num_warps=4, dq_num_stages=1)
    if head_dim <= 64:
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3,
                    DKDV_BLOCK_M=64, DKDV_BLOCK_N=128, dkdv_num_warps=8, dkdv_num_stages=3,
                    DQ_BLOCK_M=128, DQ_BLOCK_N=64, dq_num_warps=8, dq_num_stages=3)
    if head_dim <= 128:
        # dK/dV 32x64/4 warps: two fp32 [BLOCK_N, D] accumulators plus P^T and dP^T (see dense.py);
        # kept at 3 stages like dense, though with UT-only masks (causal) ptxas spills 4 bytes
        # there (none at 2 stages)
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3,
                    DKDV_BLOCK_M=32, DKDV_BLOCK_N=64, dkdv_num_warps=4, dkdv_num_stages=3,
                    DQ_BLOCK_M=128, DQ_BLOCK_N=64, dq_num_warps=8, dq_num_stages=3)
    # D=256: as dense, except dQ on 8 warps (4 warps spill 20 bytes here, 8 do not)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2,
                DKDV_BLOCK_M=16, DKDV_BLOCK_N=64, dkdv_num_warps=8, dkdv_num_stages=2,
                DQ_BLOCK_M=64, DQ_BLOCK_N=32, dq_num_warps=8, dq_num_stages=2)


def resolve_config(head_dim: int, dtype: torch.dtype, config: Optional[dict] = None) -> dict:
    """``default_config`` overlaid with ``config``; unknown keys and bad tiles raise ValueError."""
    cfg = default_config(head_dim, dtype)
    if config:
        unknown = set(config) - set(CONFIG_KEYS)
        if unknown:
            raise ValueError(f"unknown flashmask config keys {sorted(unknown)}; "
                             f"known: {list(CONFIG_KEYS)}")
        cfg.update(config)
    for key in ("BLOCK_M", "BLOCK_N", "DKDV_BLOCK_M", "DKDV_BLOCK_N", "DQ_BLOCK_M", "DQ_BLOCK_N"):
        val = int(cfg[key])
        if val < 16 or val & (val - 1):
            raise ValueError(f"config[{key!r}] must be a power of two >= 16, got {cfg[key]}")
        cfg[key] = val
    return cfg


# ----------------------------------------------------------------------------------------------
# Kernels: shared pieces
# ----------------------------------------------------------------------------------------------


@triton.jit
def _classify(Bounds, tile_m, tile_n, Sq, Sk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HAS_LT: tl.constexpr, HAS_UT: tl.constexpr):
    """``(run, masked)`` for query tile ``tile_m`` against key tile ``tile_n``: FlashMask's test.

    ``run`` is False for an EMPTY tile (skip it); ``masked`` says a visited tile is PARTIAL.
    ``Bounds`` holds the 8 per-key-tile min/max of ``LTS, LTE, UTS, UTE`` (module docstring).
    """
    m0 = tile_m * BLOCK_M
    # rows past Sq do not exist: they must not stop a tile from being EMPTY
    m1 = tl.minimum(m0 + BLOCK_M, Sq)
    b = Bounds + tile_n * 8
    # start from "not empty" (a tile always has a row), as a scalar tensor of the right type
    empty = m1 <= m0
    # a key tile running past Sk is never FULL: its padding keys need the element mask
    masked = (tile_n + 1) * BLOCK_N > Sk
    if HAS_LT:
        lts_min = tl.load(b + 0)
        lts_max = tl.load(b + 1)
        lte_min = tl.load(b + 2)
        lte_max = tl.load(b + 3)
        empty = empty | ((m0 >= lts_max) & (m1 <= lte_min))
        masked = masked | ((m1 > lts_min) & (m0 < lte_max))
    if HAS_UT:
        uts_min = tl.load(b + 4)
        uts_max = tl.load(b + 5)
        ute_min = tl.load(b + 6)
        ute_max = tl.load(b + 7)
        empty = empty | ((m0 >= uts_max) & (m1 <= ute_min))
        masked = masked | ((m1 > uts_min) & (m0 < ute_max))
    return ~empty, masked


@triton.jit
def _next_run(Bounds, start, num_tiles, fixed_tile, Sq, Sk,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEY_MAJOR: tl.constexpr,
              HAS_LT: tl.constexpr, HAS_UT: tl.constexpr):
    """``[lo, hi)``: the next run of non-EMPTY tiles at or after tile ``start``.

    Walks the tiles one by one with ``_classify``: the EMPTY ones before the run are skipped
    (never loaded), the run stops at the next EMPTY tile or at ``num_tiles``; ``lo == hi ==
    num_tiles`` when nothing is left. The walk is over key tiles against query tile
    ``fixed_tile``, or, with ``KEY_MAJOR`` (dK/dV), over query tiles against key tile
    ``fixed_tile``.
    """
    lo = start
    scanning = lo < num_tiles
    while scanning:
        if KEY_MAJOR:
            run, _ = _classify(Bounds, lo, fixed_tile, Sq, Sk, BLOCK_M, BLOCK_N, HAS_LT, HAS_UT)
        else:
            run, _ = _classify(Bounds, fixed_tile, lo, Sq, Sk, BLOCK_M, BLOCK_N, HAS_LT, HAS_UT)
        lo = tl.where(run, lo, lo + 1)
        scanning = (~run) & (lo < num_tiles)
    hi = lo
    scanning = hi < num_tiles
    while scanning:
        if KEY_MAJOR:
            run, _ = _classify(Bounds, hi, fixed_tile, Sq, Sk, BLOCK_M, BLOCK_N, HAS_LT, HAS_UT)
        else:
            run, _ = _classify(Bounds, fixed_tile, hi, Sq, Sk, BLOCK_M, BLOCK_N, HAS_LT, HAS_UT)
        hi = tl.where(run, hi + 1, hi)
        scanning = run & (hi < num_tiles)
    return lo, hi


@triton.jit
def _load_columns(Cols, offs_n, Sk):
    """The column vectors ``LTS, LTE, UTS, UTE`` (``Cols`` is int32 ``[4, Sk]``) and ``col_ok``."""
    col_ok = offs_n < Sk
    lts = tl.load(Cols + offs_n, mask=col_ok, other=0)
    lte = tl.load(Cols + Sk + offs_n, mask=col_ok, other=0)
    uts = tl.load(Cols + 2 * Sk + offs_n, mask=col_ok, other=0)
    ute = tl.load(Cols + 3 * Sk + offs_n, mask=col_ok, other=0)
    return lts, lte, uts, ute, col_ok


@triton.jit
def _allowed(rows, col_ok, lts, lte, uts, ute, HAS_LT: tl.constexpr, HAS_UT: tl.constexpr):
    """FlashMask's element mask: row not in ``[LTS, LTE)`` nor in ``[UTS, UTE)`` of its column.

    The arguments come pre-broadcast: ``rows`` along one axis, the column vectors along the
    other (``[M, 1]`` and ``[1, N]`` in the forward and dQ, ``[1, M]`` and ``[N, 1]`` in the
    transposed dK/dV), so the result is ``[M, N]`` or ``[N, M]``.
    """
    # rows >= 0 always holds: it only broadcasts col_ok to the full tile shape
    allowed = col_ok & (rows >= 0)
    if HAS_LT:
        allowed = allowed & ((rows < lts) | (rows >= lte))
    if HAS_UT:
        allowed = allowed & ((rows < uts) | (rows >= ute))
    return allowed


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def flashmask_fwd_kernel(
    Q, K, V, Out, Lse, Cols, Bounds,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    qk_scale,  # softmax_scale * log2(e)
    Sq, Sk, num_bh, num_heads_q, group_size,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LT: tl.constexpr, HAS_UT: tl.constexpr,
):
    # why: batch*head is the fastest-varying index, so the query heads of one GQA group run side
    # by side and read the same K/V tiles from L2; query tiles go last-first, because under
    # causal-like masks the last query tiles have the most non-EMPTY key tiles.
    pid = tl.program_id(0)
    rank = pid // num_bh
    bh = pid % num_bh
    b = bh // num_heads_q
    h = bh % num_heads_q
    h_kv = h // group_size
    num_m = tl.cdiv(Sq, BLOCK_M)
    num_n = tl.cdiv(Sk, BLOCK_N)
    tile_m = num_m - 1 - rank
    start_m = tile_m * BLOCK_M

    b64 = b.to(tl.int64)
    q_desc = tl.make_tensor_descriptor(Q + b64 * stride_qb + h * stride_qh, shape=[Sq, HEAD_DIM],
                                       strides=[stride_qs, 1], block_shape=[BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K + b64 * stride_kb + h_kv * stride_kh, shape=[Sk, HEAD_DIM],
                                       strides=[stride_ks, 1], block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + b64 * stride_vb + h_kv * stride_vh, shape=[Sk, HEAD_DIM],
                                       strides=[stride_vs, 1], block_shape=[BLOCK_N, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(Out + b64 * stride_ob + h * stride_oh, shape=[Sq, HEAD_DIM],
                                       strides=[stride_os, 1], block_shape=[BLOCK_M, HEAD_DIM])

    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # rows >= Sq are zero-filled by the descriptor load: finite scores, never stored
    q = q_desc.load([start_m, 0])  # [BLOCK_M, D]

    # every key tile is classified; EMPTY ones are skipped, the others come in runs of
    # consecutive tiles
    # why runs: Triton pipelines the K/V loads of a loop only when they are not under an `if`,
    # so the skip happens between the runs and each run is a plain pipelined loop
    n_next = tl.full([], 0, tl.int32)
    while n_next < num_n:
        n_lo, n_hi = _next_run(Bounds, n_next, num_n, tile_m, Sq, Sk, BLOCK_M, BLOCK_N, False,
                               HAS_LT, HAS_UT)
        for n in tl.range(n_lo, n_hi):
            _, masked = _classify(Bounds, tile_m, n, Sq, Sk, BLOCK_M, BLOCK_N, HAS_LT, HAS_UT)
            start_n = n * BLOCK_N
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = k_desc.load([start_n, 0])  # [BLOCK_N, D]
            qk = tl.dot(q, k.T)  # [BLOCK_M, BLOCK_N]
            if masked:
                # why here and not with K: loaded for every tile, the column vectors were
                # pipelined into registers and spilled (sm_90, D >= 64); under the `if` only
                # PARTIAL tiles load them (4 * BLOCK_N int32, unpipelined, from L2)
                lts, lte, uts, ute, col_ok = _load_columns(Cols, offs_n, Sk)  # [BLOCK_N] each
                allowed = _allowed(offs_m[:, None], col_ok[None, :], lts[None, :], lte[None, :],
                                   uts[None, :], ute[None, :], HAS_LT, HAS_UT)  # [BLOCK_M, BLOCK_N]
                qk = tl.where(allowed, qk, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # [BLOCK_M]
            # why: a row with nothing allowed so far has m_ij = -inf, and -inf - -inf is NaN;
            # subtracting 0 instead keeps p = exp2(-inf) = 0 and alpha = 0.
            m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(qk * qk_scale - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
            alpha = tl.math.exp2(m_i - m_safe)  # [BLOCK_M]
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = v_desc.load([start_n, 0])  # [BLOCK_N, D]
            acc = tl.dot(p.to(v.dtype), v, acc)  # [BLOCK_M, D]
            m_i = m_ij
        n_next = n_hi

    # fully masked rows (l_i == 0): out = 0, lse = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    # back to the natural log: * ln(2) (a literal, since jit code reads no plain Python globals)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    o_desc.store([start_m, 0], out.to(Out.dtype.element_ty))
    tl.store(Lse + bh.to(tl.int64) * Sq + offs_m, lse, mask=offs_m < Sq)


# ----------------------------------------------------------------------------------------------
# Backward: dK/dV (key-major) and dQ (query-major); delta comes from the dense preprocess kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def flashmask_bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, Cols, Bounds,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    softmax_scale, qk_scale,
    Sq, Sk, num_bkv, num_heads_q, num_heads_kv, group_size,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LT: tl.constexpr, HAS_UT: tl.constexpr,
):
    pid = tl.program_id(0)
    tile_n = pid // num_bkv
    bkv = pid % num_bkv
    b = bkv // num_heads_kv
    h_kv = bkv % num_heads_kv
    start_n = tile_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    num_m = tl.cdiv(Sq, BLOCK_M)
    b64 = b.to(tl.int64)

    k_desc = tl.make_tensor_descriptor(K + b64 * stride_kb + h_kv * stride_kh, shape=[Sk, HEAD_DIM],
                                       strides=[stride_ks, 1], block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + b64 * stride_vb + h_kv * stride_vh, shape=[Sk, HEAD_DIM],
                                       strides=[stride_vs, 1], block_shape=[BLOCK_N, HEAD_DIM])
    k = k_desc.load([start_n, 0])  # [BLOCK_N, D]
    v = v_desc.load([start_n, 0])  # [BLOCK_N, D]
    # the program's key tile is fixed: its column vectors are loaded once, as [BLOCK_N, 1]
    # columns of the transposed [BLOCK_N, BLOCK_M] tiles below
    lts, lte, uts, ute, col_ok = _load_columns(Cols, offs_n, Sk)
    lts = lts[:, None]
    lte = lte[:, None]
    uts = uts[:, None]
    ute = ute[:, None]
    col_ok = col_ok[:, None]
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)

    # GQA: every query head of the group adds into the same dK/dV registers (no atomics)
    for g in range(0, group_size):
        h = h_kv * group_size + g
        q_desc = tl.make_tensor_descriptor(Q + b64 * stride_qb + h * stride_qh,
                                           shape=[Sq, HEAD_DIM], strides=[stride_qs, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        do_desc = tl.make_tensor_descriptor(DOut + b64 * stride_db + h * stride_dh,
                                            shape=[Sq, HEAD_DIM], strides=[stride_ds, 1],
                                            block_shape=[BLOCK_M, HEAD_DIM])
        row_base = (b64 * num_heads_q + h) * Sq
        # every query tile is classified against this key tile; EMPTY ones are skipped, the
        # others run in pipelined loops (see the forward)
        m_next = tl.full([], 0, tl.int32)
        while m_next < num_m:
            m_lo, m_hi = _next_run(Bounds, m_next, num_m, tile_n, Sq, Sk, BLOCK_M, BLOCK_N, True,
                                   HAS_LT, HAS_UT)
            for mt in tl.range(m_lo, m_hi):
                _, masked = _classify(Bounds, mt, tile_n, Sq, Sk, BLOCK_M, BLOCK_N,
                                      HAS_LT, HAS_UT)
                start_m = mt * BLOCK_M
                offs_m = start_m + tl.arange(0, BLOCK_M)
                q = q_desc.load([start_m, 0])  # [BLOCK_M, D]
                do = do_desc.load([start_m, 0])  # [BLOCK_M, D]
                lse2, delta = _load_row_stats(Lse, Delta, row_base, offs_m, Sq)  # [BLOCK_M] each
                qk_t = tl.dot(k, q.T)  # [BLOCK_N, BLOCK_M]
                p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])
                if masked:
                    allowed_t = _allowed(offs_m[None, :], col_ok, lts, lte, uts, ute,
                                         HAS_LT, HAS_UT)  # [BLOCK_N, BLOCK_M]
                    p_t = tl.where(allowed_t, p_t, 0.0)
                dv = tl.dot(p_t.to(do.dtype), do, dv)  # [BLOCK_N, D]
                dp_t = tl.dot(v, do.T)  # [BLOCK_N, BLOCK_M]
                ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)  # [BLOCK_N, BLOCK_M]
                dk = tl.dot(ds_t, q, dk)  # [BLOCK_N, D]
            m_next = m_hi

    dk_desc = tl.make_tensor_descriptor(DK + b64 * stride_dkb + h_kv * stride_dkh,
                                        shape=[Sk, HEAD_DIM], strides=[stride_dks, 1],
                                        block_shape=[BLOCK_N, HEAD_DIM])
    dv_desc = tl.make_tensor_descriptor(DV + b64 * stride_dvb + h_kv * stride_dvh,
                                        shape=[Sk, HEAD_DIM], strides=[stride_dvs, 1],
                                        block_shape=[BLOCK_N, HEAD_DIM])
    # s = softmax_scale * q.k, so dK picks up the scale once here
    dk_desc.store([start_n, 0], (dk * softmax_scale).to(DK.dtype.element_ty))
    dv_desc.store([start_n, 0], dv.to(DV.dtype.element_ty))


@triton.jit
def flashmask_bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, Cols, Bounds,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dqb, stride_dqs, stride_dqh,
    softmax_scale, qk_scale,
    Sq, Sk, num_bh, num_heads_q, group_size,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LT: tl.constexpr, HAS_UT: tl.constexpr,
):
    pid = tl.program_id(0)
    rank = pid // num_bh
    bh = pid % num_bh
    b = bh // num_heads_q
    h = bh % num_heads_q
    h_kv = h // group_size
    num_m = tl.cdiv(Sq, BLOCK_M)
    num_n = tl.cdiv(Sk, BLOCK_N)
    tile_m = num_m - 1 - rank  # heaviest (last) query tiles first, as in the forward
    start_m = tile_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    b64 = b.to(tl.int64)

    q_desc = tl.make_tensor_descriptor(Q + b64 * stride_qb + h * stride_qh, shape=[Sq, HEAD_DIM],
                                       strides=[stride_qs, 1], block_shape=[BLOCK_M, HEAD_DIM])
    do_desc = tl.make_tensor_descriptor(DOut + b64 * stride_db + h * stride_dh, shape=[Sq, HEAD_DIM],
                                        strides=[stride_ds, 1], block_shape=[BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K + b64 * stride_kb + h_kv * stride_kh, shape=[Sk, HEAD_DIM],
                                       strides=[stride_ks, 1], block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + b64 * stride_vb + h_kv * stride_vh, shape=[Sk, HEAD_DIM],
                                       strides=[stride_vs, 1], block_shape=[BLOCK_N, HEAD_DIM])
    q = q_desc.load([start_m, 0])  # [BLOCK_M, D]
    do = do_desc.load([start_m, 0])  # [BLOCK_M, D]
    lse2, delta = _load_row_stats(Lse, Delta, bh.to(tl.int64) * Sq, offs_m, Sq)  # [BLOCK_M] each
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # runs of non-EMPTY key tiles, as in the forward
    n_next = tl.full([], 0, tl.int32)
    while n_next < num_n:
        n_lo, n_hi = _next_run(Bounds, n_next, num_n, tile_m, Sq, Sk, BLOCK_M, BLOCK_N, False,
                               HAS_LT, HAS_UT)
        for n in tl.range(n_lo, n_hi):
            _, masked = _classify(Bounds, tile_m, n, Sq, Sk, BLOCK_M, BLOCK_N, HAS_LT, HAS_UT)
            start_n = n * BLOCK_N
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = k_desc.load([start_n, 0])  # [BLOCK_N, D]
            v = v_desc.load([start_n, 0])  # [BLOCK_N, D]
            qk = tl.dot(q, k.T)  # [BLOCK_M, BLOCK_N]
            p = tl.math.exp2(qk * qk_scale - lse2[:, None])
            if masked:
                lts, lte, uts, ute, col_ok = _load_columns(Cols, offs_n, Sk)  # [BLOCK_N] each
                allowed = _allowed(offs_m[:, None], col_ok[None, :], lts[None, :], lte[None, :],
                                   uts[None, :], ute[None, :], HAS_LT, HAS_UT)  # [BLOCK_M, BLOCK_N]
                p = tl.where(allowed, p, 0.0)
            dp = tl.dot(do, v.T)  # [BLOCK_M, BLOCK_N]
            ds = p * (dp - delta[:, None])  # [BLOCK_M, BLOCK_N]
            dq = tl.dot(ds.to(k.dtype), k, dq)  # [BLOCK_M, D]
        n_next = n_hi

    dq_desc = tl.make_tensor_descriptor(DQ + b64 * stride_dqb + h * stride_dqh, shape=[Sq, HEAD_DIM],
                                        strides=[stride_dqs, 1], block_shape=[BLOCK_M, HEAD_DIM])
    dq_desc.store([start_m, 0], (dq * softmax_scale).to(DQ.dtype.element_ty))


@triton.jit
def flashmask_classify_kernel(Bounds, Out, Sq, Sk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              HAS_LT: tl.constexpr, HAS_UT: tl.constexpr):
    """The classification alone (``classify_tiles``): one program per (query tile, key tile)."""
    tile_m = tl.program_id(0)
    tile_n = tl.program_id(1)
    run, masked = _classify(Bounds, tile_m, tile_n, Sq, Sk, BLOCK_M, BLOCK_N, HAS_LT, HAS_UT)
    cls = tl.where(run, tl.where(masked, 1, 2), 0)  # EMPTY 0, PARTIAL 1, FULL 2
    tl.store(Out + tile_m * tl.num_programs(1) + tile_n, cls.to(tl.int8))


# ----------------------------------------------------------------------------------------------
# Preprocessing: columns on the device and the per-tile min/max
# ----------------------------------------------------------------------------------------------


@dataclass
class FlashMaskPlan:
    """Device metadata of one mask: the normalised columns and, per ``BLOCK_N``, the tile bounds."""

    seqlen_q: int
    seqlen_k: int
    cols: torch.Tensor  # int32 [4, Sk]: LTS, LTE, UTS, UTE
    has_lt: bool
    has_ut: bool
    bounds: dict  # BLOCK_N -> int32 [cdiv(Sk, BLOCK_N), 8]

    def bounds_for(self, block_n: int) -> torch.Tensor:
        if block_n not in self.bounds:
            self.bounds[block_n] = tile_bounds(self.cols, block_n)
        return self.bounds[block_n]


def _normalised_columns(cols: FlashMaskColumns, seqlen_q: int, device) -> torch.Tensor:
    """int32 ``[4, Sk]`` on ``device``: clipped to ``[0, Sq]``; empty LT -> ``[Sq, Sq)``, empty UT
    -> ``[0, 0)`` (the same mask; the tile min/max are then as tight as the mask allows)."""
    t = torch.stack([torch.as_tensor(np.asarray(getattr(cols, n)), dtype=torch.int64)
                     for n in ("lts", "lte", "uts", "ute")]).to(device)
    t = t.clamp_(0, seqlen_q)
    lts, lte, uts, ute = t.unbind(0)
    lt_empty = lte <= lts
    ut_empty = ute <= uts
    lts = torch.where(lt_empty, seqlen_q, lts)
    lte = torch.where(lt_empty, seqlen_q, lte)
    uts = torch.where(ut_empty, 0, uts)
    ute = torch.where(ut_empty, 0, ute)
    return torch.stack([lts, lte, uts, ute]).to(torch.int32).contiguous()


def tile_bounds(cols: torch.Tensor, block_n: int) -> torch.Tensor:
    """FlashMask's preprocessing: per key tile of ``block_n`` columns, int32 ``[num_tiles, 8]``
    ``[LTS_min, LTS_max, LTE_min, LTE_max, UTS_min, UTS_max, UTE_min, UTE_max]``.

    ``cols`` is int32 ``[4, Sk]`` (LTS, LTE, UTS, UTE). Torch ops on ``cols``' device, ``O(Sk)``.
    The ragged last tile is padded with its last real column, which leaves min and max unchanged.
    """
    sk = cols.shape[1]
    num_n = triton.cdiv(sk, block_n)
    if num_n == 0:
        return torch.zeros((0, 8), dtype=torch.int32, device=cols.device)
    pad = num_n * block_n - sk
    if pad:
        cols = torch.cat([cols, cols[:, -1:].expand(4, pad)], dim=1)
    t = cols.reshape(4, num_n, block_n)
    mm = torch.stack([t.amin(dim=2), t.amax(dim=2)], dim=2)  # [4, num_n, 2]
    return mm.permute(1, 0, 2).reshape(num_n, 8).to(torch.int32).contiguous()


def _columns_of(mask_or_columns) -> FlashMaskColumns:
    if isinstance(mask_or_columns, FlashMaskColumns):
        return mask_or_columns
    if isinstance(mask_or_columns, BlockSparseMask):
        raise NotExpressible("FlashMask columns need a RangeMask; block-sparse masks are not "
                             "column intervals")
    if isinstance(mask_or_columns, RangeMask):
        return flashmask_columns(mask_or_columns)  # raises NotExpressible with the column
    raise ValueError(f"mask_or_columns must be a RangeMask or FlashMaskColumns, got "
                     f"{type(mask_or_columns).__name__}")


def flashmask_plan(mask_or_columns, seqlen_q: int, device) -> FlashMaskPlan:
    """The device metadata for a ``RangeMask`` or ``FlashMaskColumns``, cached on the columns
    (so, for a mask, on the mask: its lowering is cached there) per device and ``Sq``."""
    cols = _columns_of(mask_or_columns)
    sk = len(cols.lts)
    if not (len(cols.lte) == len(cols.uts) == len(cols.ute) == sk):
        raise ValueError("FlashMaskColumns vectors have different lengths: "
                         f"{len(cols.lts)}, {len(cols.lte)}, {len(cols.uts)}, {len(cols.ute)}")
    # a frozen dataclass without slots still has a __dict__ to hang a cache on
    cache = cols.__dict__.setdefault("_triton_plans", {})
    key = (str(torch.device(device)), int(seqlen_q))
    if key not in cache:
        t = _normalised_columns(cols, int(seqlen_q), device)
        has_lt = bool((t[1] > t[0]).any().item())
        has_ut = bool((t[3] > t[2]).any().item())
        cache[key] = FlashMaskPlan(int(seqlen_q), sk, t, has_lt, has_ut, {})
    return cache[key]


def classify_tiles(plan: FlashMaskPlan, block_m: int, block_n: int) -> torch.Tensor:
    """int8 ``[cdiv(Sq, block_m), cdiv(Sk, block_n)]`` of ``EMPTY / PARTIAL / FULL``, computed by
    the kernels' own ``_classify`` (a Triton launch: CUDA, or the interpreter on a CPU)."""
    num_m, num_n = triton.cdiv(plan.seqlen_q, block_m), triton.cdiv(plan.seqlen_k, block_n)
    out = torch.empty((num_m, num_n), dtype=torch.int8, device=plan.cols.device)
    if num_m * num_n:
        flashmask_classify_kernel[(num_m, num_n)](
            plan.bounds_for(block_n), out, plan.seqlen_q, plan.seqlen_k, BLOCK_M=block_m,
            BLOCK_N=block_n, HAS_LT=plan.has_lt, HAS_UT=plan.has_ut)
    return out


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _check_inputs(q, k, v, sq_mask: Optional[int], sk_cols: int):
    _check_qkv(q, k, v, SUPPORTED_HEAD_DIMS, "flashmask attention")
    sq, sk = q.shape[1], k.shape[1]
    if sq_mask is not None and sq_mask != sq:
        raise ValueError(f"mask is {sq_mask} x {sk_cols} but q/k have Sq={sq}, Sk={sk}")
    if sk_cols != sk:
        raise ValueError(f"the columns describe Sk={sk_cols} keys but k/v have Sk={sk}")


def flashmask_fwd(q, k, v, plan: FlashMaskPlan, softmax_scale: float, cfg: dict):
    """Launch the forward kernel. Returns ``out [B, Sq, Hq, D]`` (q's dtype), ``lse [B, Hq, Sq]``."""
    q, k, v = (_descriptor_ready(t) for t in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = torch.empty((b, sq, hq, d), device=q.device, dtype=q.dtype)
    lse = torch.empty((b, hq, sq), device=q.device, dtype=torch.float32)
    if b * hq * sq == 0:
        return out, lse
    if sk == 0:  # nothing to attend: every row fully masked
        return out.zero_(), lse.fill_(float("-inf"))
    _ensure_allocator(q.device)
    grid = (triton.cdiv(sq, cfg["BLOCK_M"]) * b * hq,)
    flashmask_fwd_kernel[grid](
        q, k, v, out, lse, plan.cols, plan.bounds_for(cfg["BLOCK_N"]),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        softmax_scale * LOG2E,
        sq, sk, b * hq, hq, hq // hkv,
        HEAD_DIM=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        HAS_LT=plan.has_lt, HAS_UT=plan.has_ut,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, lse


def flashmask_bwd(dout, q, k, v, out, lse, plan: FlashMaskPlan, softmax_scale: float, cfg: dict,
                  dlse=None):
    """Launch preprocess, dK/dV and dQ. Returns ``dq, dk, dv`` in the inputs' dtype."""
    q, k, v, out, dout = (_descriptor_ready(t) for t in (q, k, v, out, dout))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    dq = torch.empty((b, sq, hq, d), device=q.device, dtype=q.dtype)
    dk = torch.empty((b, sk, hkv, d), device=k.device, dtype=k.dtype)
    dv = torch.empty((b, sk, hkv, d), device=v.device, dtype=v.dtype)
    if b * hq * d == 0 or sq == 0 or sk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    _ensure_allocator(q.device)
    lse = lse.contiguous()
    delta = launch_bwd_preprocess(out, dout, dlse)  # [B, Hq, Sq] float32
    flashmask_bwd_dkdv_kernel[(triton.cdiv(sk, cfg["DKDV_BLOCK_N"]) * b * hkv,)](
        q, k, v, dout, lse, delta, dk, dv, plan.cols, plan.bounds_for(cfg["DKDV_BLOCK_N"]),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        softmax_scale, softmax_scale * LOG2E,
        sq, sk, b * hkv, hq, hkv, hq // hkv,
        HEAD_DIM=d, BLOCK_M=cfg["DKDV_BLOCK_M"], BLOCK_N=cfg["DKDV_BLOCK_N"],
        HAS_LT=plan.has_lt, HAS_UT=plan.has_ut,
        num_warps=cfg["dkdv_num_warps"], num_stages=cfg["dkdv_num_stages"],
    )
    flashmask_bwd_dq_kernel[(triton.cdiv(sq, cfg["DQ_BLOCK_M"]) * b * hq,)](
        q, k, v, dout, lse, delta, dq, plan.cols, plan.bounds_for(cfg["DQ_BLOCK_N"]),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        softmax_scale, softmax_scale * LOG2E,
        sq, sk, b * hq, hq, hq // hkv,
        HEAD_DIM=d, BLOCK_M=cfg["DQ_BLOCK_M"], BLOCK_N=cfg["DQ_BLOCK_N"],
        HAS_LT=plan.has_lt, HAS_UT=plan.has_ut,
        num_warps=cfg["dq_num_warps"], num_stages=cfg["dq_num_stages"],
    )
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Autograd and the public function
# ----------------------------------------------------------------------------------------------


class FlashMaskAttentionFunction(torch.autograd.Function):
    """``(q, k, v) -> (out, lse)`` with the plan and config carried as non-tensor arguments."""

    @staticmethod
    def forward(ctx, q, k, v, plan, softmax_scale, cfg):
        out, lse = flashmask_fwd(q, k, v, plan, softmax_scale, cfg)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.softmax_scale = softmax_scale
        ctx.cfg = cfg
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = flashmask_bwd(dout, q, k, v, out, lse, ctx.plan, ctx.softmax_scale, ctx.cfg,
                                   dlse=dlse)
        return dq, dk, dv, None, None, None


def flashmask_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_or_columns,
                        softmax_scale=None, return_lse: bool = False,
                        config: Optional[dict] = None):
    """FlashMask attention of ``q [B, Sq, Hq, D]`` over ``k, v [B, Sk, Hkv, D]``.

    ``mask_or_columns`` is a ``RangeMask`` (lowered with ``flashmask_columns``; a mask that is not
    column intervals raises ``NotExpressible``, a ``ValueError``) or a ``FlashMaskColumns`` of
    ``Sk`` columns. Differentiable in q, k, v (and through ``lse`` when returned). ``config``
    overrides launch parameters (``CONFIG_KEYS``). Returns ``out`` in q's dtype, or
    ``(out, lse)`` with ``lse [B, Hq, Sq]`` float32 (natural log; ``-inf`` and a zero output row
    where a query row attends nothing).
    """
    cols = _columns_of(mask_or_columns)
    sq_mask = int(mask_or_columns.seqlen_q) if isinstance(mask_or_columns, RangeMask) else None
    if isinstance(mask_or_columns, RangeMask) and int(mask_or_columns.seqlen_k) != len(cols.lts):
        raise ValueError("mask and its columns disagree on Sk")  # pragma: no cover - IR invariant
    _check_inputs(q, k, v, sq_mask, len(cols.lts))
    d = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    softmax_scale = float(softmax_scale)
    if not softmax_scale > 0 or math.isinf(softmax_scale):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    cfg = resolve_config(d, q.dtype, config)
    plan = flashmask_plan(cols, q.shape[1], q.device)
    out, lse = FlashMaskAttentionFunction.apply(q, k, v, plan, softmax_scale, cfg)
    return (out, lse) if return_lse else out

r"""Step 5 — GQA: one program serves all query heads of a KV group, so K/V tiles are loaded once.

What changed (from step 4)
--------------------------
With grouped-query attention (``Hq = G · Hkv``, here 64:8, ``G = 8``) the ``G`` query heads of a
group read the *same* K and V. Up to step 4 each of them had its own programs, and each loaded
every K/V tile itself. Now the query tile is *packed*: its ``BLOCK_M`` rows are ``ROWS = BLOCK_M
// G`` query positions times the ``G`` heads of one KV group::

    packed row r  ->  position  i = start + r // G,   head  h = h_kv · G + r % G

    S = Q_packed · Kᵀ        [ROWS·G, D] x [D, BLOCK_N]       one K tile, G heads at once
    O_packed += P · V        [ROWS·G, BLOCK_N] x [BLOCK_N, D] one V tile, G heads at once

The grid becomes (position tile, batch · KV head) instead of (row tile, batch · query head). All
packed rows of one position share its mask row, so the block tables are taken at ``ROWS x BLOCK_N``
(``mask.block_tables(ROWS, BLOCK_N)``) and the element mask reads the intervals of ``i = r // G``.
In ``[B, S, H, D]`` layout the ``G`` heads of a position are adjacent in memory, so a packed tile is
``ROWS`` contiguous runs of ``G·D`` elements: loads stay coalesced.

Why it should help
------------------
One K/V tile load now feeds ``G`` heads. Compared with step 4 at the same number of query
*positions* per tile, K/V bytes loaded from L2 into the SM drop by ``G`` (8x here) for the same
FLOPs, and there are ``G`` times fewer programs, each with the same register footprint. That
matters where a head's own rows cannot fill a tile or K/V traffic is the bottleneck: decoding,
short query chunks, small head dims. It also changes the tile geometry: with ``G = 8`` a tile
covers 16 query positions instead of 128, so the block tables are finer along the queries (on
masks whose edges fall inside 128-row blocks, fewer wasted masked pairs). At a fixed tile height,
which is what this step runs, the first comparison does not hold; the measurement below shows
what that means for causal prefill.

Measured (H100, causal, S=16K)
------------------------------
358.8 TFLOP/s (12.26 ms): 1.00× step 4 (12.26 vs 12.27 ms, p20–p80 ranges overlapping: a tie),
61% of sdpa-cudnn; peak 256 MiB above the inputs.
(B=1, Hq:Hkv=64:8, D=128, bf16; H100 80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0;
``experiments/results/h100/ladder/ladder.md``, chart ``ladder_fwd.png`` next to it.)

Why it is flat here. Packing changes which rows share a tile, not how much each loaded tile is
reused. ``packed_tile`` keeps the production tile height (``BLOCK_M = 128``) and fills it with
``ROWS = 16`` positions x ``G = 8`` heads, so each ``[BLOCK_N, D]`` K or V tile still feeds one
128-row matmul, exactly as in step 4. Counted from the block tables: step 4 runs 64 heads x 8,256
tiles of 128 x 128, step 5 runs 8 KV heads x 66,048 tiles of (16 positions x 8 heads) x 128 keys:
the same 528,384 K tile loads (and as many V), the same 8,192 programs, and the same 135.3 M
computed pairs per head (a 16-position tile on the diagonal still reads the whole 128-key diagonal
tile, so causal wastes no fewer masked pairs). Nor was step 4 re-reading K/V from HBM per head: its
grid runs all query tiles of one head, then the next head, so the 8 heads of a group run back to
back while their KV head's K and V (8 MiB at 16K) stay in the 50 MB L2.

When it does help, and why it is worth learning. Packing pays when a head's own rows cannot fill
a tile: decoding and short query chunks (``Sq < BLOCK_M``), where one head gives a few rows and the
group gives ``G`` times more for the same K/V load; and it can skip more work on masks whose edges
fall inside 128-row blocks (documents), since its block tables are taken every 16 positions. The
production kernel (step 7) keeps step 4's one-head tiles, which also keeps Q and O rectangular for
TMA. The same "one program serves the whole group" idea is what ``bwd4_gqa`` applies to dK/dV.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    LOG2E,
    check_shapes,
    interval_mask,
    row_interval_arrays,
    softmax_scale_or_default,
    tile_config,
    tile_tables,
)


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, k_base, v_base, stride_ks, seq, offs_d,
                  TILE_IDX, t_lo, t_hi, LO, HI, Sq, Sk, qk_scale,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, NUM_IV: tl.constexpr):
    """Step 4's loop; the only change is that row ``r`` of the tile is position ``seq[r]``."""
    for t in range(t_lo, t_hi):
        start_n = tl.load(TILE_IDX + t) * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * stride_ks + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_ks + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=offs_n[:, None] < Sk, other=0.0)  # [BLOCK_N, D]
        else:
            k = tl.load(k_ptrs)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N]: G heads in one matmul
        if MASKED:
            # the element mask of packed row r is the mask row of position seq[r]
            s = tl.where(interval_mask(seq, offs_n, LO, HI, Sq, NUM_IV), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=offs_n[:, None] < Sk, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def gqa_fwd_kernel(
    Q, K, V, Out, LO, HI,
    FULL_PTR, FULL_IDX, PART_PTR, PART_IDX,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_ob, stride_os, stride_oh,
    qk_scale,  # softmax_scale * log2(e)
    Sq, Sk, num_heads_kv,
    GROUP: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_IV: tl.constexpr,
):
    pid_m = tl.program_id(0)  # tile of ROWS query positions
    bkv = tl.program_id(1)  # batch * Hkv + KV head
    b = (bkv // num_heads_kv).to(tl.int64)
    h_kv = bkv % num_heads_kv
    offs_r = tl.arange(0, BLOCK_M)  # packed rows
    seq = pid_m * ROWS + offs_r // GROUP  # [BLOCK_M] query position of each packed row
    head = h_kv * GROUP + offs_r % GROUP  # [BLOCK_M] query head of each packed row
    # when G does not divide BLOCK_M the last BLOCK_M - ROWS·G rows are padding
    row_ok = (offs_r < ROWS * GROUP) & (seq < Sq)
    offs_d = tl.arange(0, HEAD_DIM)

    q_rows = b * stride_qb + seq * stride_qs + head * stride_qh  # [BLOCK_M]
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_kb + h_kv * stride_kh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_base, v_base, stride_ks, seq, offs_d,
                                  FULL_IDX, tl.load(FULL_PTR + pid_m), tl.load(FULL_PTR + pid_m + 1),
                                  LO, HI, Sq, Sk, qk_scale, BLOCK_N, False, NUM_IV)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_base, v_base, stride_ks, seq, offs_d,
                                  PART_IDX, tl.load(PART_PTR + pid_m), tl.load(PART_PTR + pid_m + 1),
                                  LO, HI, Sq, Sk, qk_scale, BLOCK_N, True, NUM_IV)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = b * stride_ob + seq * stride_os + head * stride_oh
    tl.store(Out + o_rows[:, None] + offs_d[None, :], out.to(Out.dtype.element_ty), mask=row_ok[:, None])


def packed_tile(block_m: int, group: int) -> tuple[int, int]:
    """``(BLOCK_M, ROWS)``: the packed tile height (at least G, a power of two) and positions per tile."""
    block_m = max(block_m, triton.next_power_of_2(group))
    return block_m, block_m // group


def forward(q, k, v, mask, softmax_scale=None):
    """``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``, a ``RangeMask`` -> ``out [B, Sq, Hq, D]``."""
    check_shapes(q, k, v, mask)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    scale = softmax_scale_or_default(softmax_scale, D)
    cfg = tile_config(D, q.dtype)
    block_m, rows = packed_tile(cfg["BLOCK_M"], G)
    bn = cfg["BLOCK_N"]
    lo, hi, num_iv = row_interval_arrays(mask, q.device)
    tables = tile_tables(mask, rows, bn, q.device)  # tables over positions, ROWS per tile
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    gqa_fwd_kernel[(tables.num_m, B * Hkv)](
        q, k, v, out, lo, hi,
        tables.q_full_ptr, tables.q_full_idx, tables.q_part_ptr, tables.q_part_idx,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        scale * LOG2E, Sq, Sk, Hkv,
        GROUP=G, ROWS=rows, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=bn, NUM_IV=num_iv,
        num_warps=cfg["num_warps"], num_stages=1,
    )
    return out

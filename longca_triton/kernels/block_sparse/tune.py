"""What ``longca-triton autotune`` searches for the block-sparse kernels (``bench.autotune`` runs it).

Each key group (forward, dK/dV, dQ) is searched with the others at their defaults, because the passes
are separate kernels. A pass's list reading follows its stages (``config.list_chunk``), so searching the
stages searches it too.
"""

from __future__ import annotations

import itertools

__all__ = ["sparse_candidates", "sparse_outer", "varblock_candidates"]

_WARPS, _STAGES = (4, 8), (2, 3)


def sparse_outer(block: int, head_dim: int) -> list[int]:
    """Tiles of the side a program owns: at most the block (a row tile never spans two blocks) and
    at most 128 rows (64 for D > 128)."""
    cap = 64 if head_dim > 128 else 128
    b = 1 << (max(16, block).bit_length() - 1)  # the largest power of two <= block
    return sorted({max(16, min(b, 64)), max(16, min(b, cap))})


def sparse_candidates(group: str, block: int, head_dim: int) -> list[dict]:
    """Uniform blocks (``triton-sparse``): the inner tile is the block itself (at most 128: larger
    blocks are walked in 128-wide sub-tiles; either way no tile needs the tail mask), or at block 128
    also its 64-wide halves; the outer tile, the dQ pass's stacked GQA heads, warps and stages are
    searched."""
    inner = 1 << (max(16, min(block, 128)).bit_length() - 1)
    outer = sparse_outer(block, head_dim)
    steps = sorted({min(inner, 64), inner})
    if group == "fwd":
        return [dict(BLOCK_M=m, BLOCK_N=inner, num_warps=w, num_stages=s)
                for m, w, s in itertools.product(outer, _WARPS, _STAGES)]
    if group == "dkdv":
        # a program owns DKDV_BLOCK_N keys and steps over DKDV_BLOCK_M query rows: the whole block, or
        # (blocks of 128) 64-row halves of it
        return [dict(DKDV_BLOCK_M=m, DKDV_BLOCK_N=n, dkdv_num_warps=w, dkdv_num_stages=s)
                for m, n, w, s in itertools.product(steps, outer, _WARPS, _STAGES)]
    if group == "dq":
        # the dQ step: the block, or (blocks of 128) 64-key halves, which three stages fit beside Q and dO
        return [dict(DQ_BLOCK_M=m, DQ_BLOCK_N=n, DQ_HEADS=h, dq_num_warps=w, dq_num_stages=s)
                for m, n, h, w, s in itertools.product(outer, steps, (1, 2), _WARPS, _STAGES)]
    raise ValueError(f"unknown key group {group!r}")


def varblock_candidates(group: str, block: int, head_dim: int) -> list[dict]:
    """Variable blocks (``triton-varblock``, ``block`` = the mean block): blocks are walked in
    sub-tiles carrying their valid length, so the inner tile is searched too (the two largest powers
    of two up to the mean block, at most 128); and the dQ pass's 128-row tiles of 2, 4 or 8 stacked
    query heads, which a call's GQA group may cap."""
    b = 1 << (max(16, min(block, 128)).bit_length() - 1)
    inner = sorted({max(16, b // 2), b})
    outer = sparse_outer(block, head_dim)
    if group == "fwd":
        return [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
                for n, m, w, s in itertools.product(inner, outer, _WARPS, _STAGES)]
    if group == "dkdv":
        return [dict(DKDV_BLOCK_M=m, DKDV_BLOCK_N=n, dkdv_num_warps=w, dkdv_num_stages=s)
                for m, n, w, s in itertools.product(inner, outer, _WARPS, _STAGES)]
    if group == "dq":
        one_head = [dict(DQ_BLOCK_M=m, DQ_BLOCK_N=n, DQ_HEADS=1, dq_num_warps=w, dq_num_stages=s)
                    for n, m, w, s in itertools.product(inner, outer, _WARPS, _STAGES)]
        stacked = [dict(DQ_BLOCK_M=128 // h, DQ_BLOCK_N=n, DQ_HEADS=h, dq_num_warps=8, dq_num_stages=s)
                   for n, h, s in itertools.product(inner, (2, 4, 8), _STAGES) if head_dim <= 128]
        return one_head + stacked
    raise ValueError(f"unknown key group {group!r}")

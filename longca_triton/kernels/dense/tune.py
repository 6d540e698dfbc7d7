"""The autotune search space of the dense kernels (``triton``; ``bench/autotune.py`` runs the search).

``--block`` fixes the inner-loop tile of each pass (the key tile of the forward and dQ passes, the query
tile of the dK/dV pass); the candidates vary the rest: the outer tile, warps, pipeline stages and, for
dK/dV, the sweep order. Each group (forward, dK/dV, dQ) is tuned with the others at their defaults,
because the passes are separate kernels. Every key a candidate sets is one of ``op.CONFIG_KEYS``.
"""

from __future__ import annotations

import itertools

__all__ = ["GROUPS", "candidates"]

#: key group -> the mode whose timing decides it
GROUPS = {"fwd": "fwd", "dkdv": "bwd", "dq": "bwd"}


def candidates(group: str, block: int, head_dim: int) -> list[dict]:
    """Partial configs of key group ``group`` for inner tile ``block`` at padded head dim ``head_dim``."""
    if head_dim > 128:
        return _big_candidates(group, block)
    outer = [64, 128]
    if group == "fwd":
        return [dict(BLOCK_M=m, BLOCK_N=block, num_warps=w, num_stages=s)
                for m, w, s in itertools.product(outer, [4, 8], [2, 3, 4])]
    if group == "dkdv":
        # each tile head-major and with the row-major descending sweep: the sweep pays on one tile only
        # (the tuning table's uneven row), so the two are searched together
        return [dict(DKDV_BLOCK_M=block, DKDV_BLOCK_N=n, dkdv_num_warps=w, dkdv_num_stages=s, dkdv_sweep=sw)
                for sw, n, w, s in itertools.product([0, 2], outer, [4, 8], [2, 3])]
    if group == "dq":
        return [dict(DQ_BLOCK_M=m, DQ_BLOCK_N=block, dq_num_stages=s) for m, s in itertools.product(outer, [2, 3])]
    raise ValueError(f"unknown key group {group!r}")


def _big_candidates(group: str, block: int) -> list[dict]:
    """Head dims above 128 (tiles of 256, incl. 192/128): the tiles that compile for sm_90a without spills
    and within shared memory (compiled for sm_90a on a CPU, ``core.aot``). A 128-row tile needs 8
    warps, key tiles of 128 overflow shared memory, and dK/dV fits only 16 or 32 query rows a step, so
    ``block`` caps the key tile at 64 instead of setting it. The first candidate of each group is the
    default's tile."""
    n = min(block, 64)
    if group == "fwd":
        cands = [dict(BLOCK_M=m, BLOCK_N=bn, num_warps=8, num_stages=s)
                 for m, bn, s in itertools.product([128, 64], sorted({n, 32}, reverse=True), [2, 3])]
        return cands + [dict(BLOCK_M=64, BLOCK_N=n, num_warps=4, num_stages=2)]
    if group == "dkdv":
        return [dict(DKDV_BLOCK_M=m, DKDV_BLOCK_N=64, dkdv_num_warps=8, dkdv_num_stages=s)
                for m, s in itertools.product([16, 32], [2, 3])]
    if group == "dq":
        return [dict(DQ_BLOCK_M=m, DQ_BLOCK_N=bn, dq_num_stages=2) for m, bn in ((64, n), (64, 32), (128, 32))]
    raise ValueError(f"unknown key group {group!r}")

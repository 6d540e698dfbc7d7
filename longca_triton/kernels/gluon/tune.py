"""The Gluon family's autotune search space (``bench/autotune.py`` registers it as ``triton-gluon``).

Forward: key tile = the block (64 or 128), every ring depth that fits in shared memory, ping-pong
on and off, the exact head-dim pieces (``split_d``) against the padded tile where the dim splits,
two consumers and (where the head-dim tile is 64 wide with register P, or 128 wide with P in
shared memory or with ``pv_sync``) three, each one tile a CTA and persistent (O staged in Q's
buffers or in its own); on the persistent launch with O's own buffers and the deepest ring also
``mask_head`` 0 / 1 / 2 with ``rowsum_mma`` off and on. Backward: the dense backward, the mixed one
and the Gluon pair with either dK/dV query tile.
"""

from __future__ import annotations

import itertools

__all__ = ["gluon_candidates", "gluon_default", "gluon_device_reason", "gluon_run"]


def gluon_candidates(group: str, block: int, head_dim: int) -> list[dict]:
    """The partial configs of key group ``group`` (``"fwd"`` or ``"bwd"``) to time at this block and
    head dim."""
    from longca_triton.kernels.core.runtime import block_head_dim
    from longca_triton.kernels.gluon.config import (
        SMEM_LIMIT,
        bwd_reason,
        bwd_smem_bytes,
        bwd_tiles,
        smem_bytes,
        split_d_reason,
    )

    if group == "fwd":
        bn = block if block in (64, 128) else 128
        splits = [False, True] if not split_d_reason(head_dim) else [False]
        # (consumers, p_smem, pv_sync): three where the head-dim tile is 64 wide with register P, at
        # 128 with P in shared memory or with register P and pv_sync (with neither they spill)
        three = {64: [(3, False, False)], 128: [(3, True, False), (3, False, True)]}.get(block_head_dim(head_dim), [])
        # the launch: one tile a CTA, or persistent with O staged in Q's buffers or in its own
        launches = [(False, False), (True, False), (True, True)]
        shapes = [dict(BLOCK_N=bn, num_stages=st, pingpong=pp, split_d=sd, consumers=c, p_smem=ps, persistent=pe,
                       o_own=oo, pv_sync=pv)
                  for (c, ps, pv), sd, pp, st, (pe, oo) in itertools.product([(2, False, False)] + three, splits,
                                                                             [True, False], [2, 1, 3, 4], launches)
                  if smem_bytes(head_dim, bn, st, split_d=sd, consumers=c, p_smem=ps, o_own=oo) <= SMEM_LIMIT]
        # the partial tiles' and the softmax's knobs on the persistent launch with O's own buffers and
        # the deepest ring beside them (P in registers: three consumers with P in shared memory spill)
        deepest = {}  # per consumer count
        for c in shapes:
            if (c["persistent"] and c["o_own"] and not (c["split_d"] or c["pingpong"] or c["p_smem"])
                    and smem_bytes(head_dim, bn, c["num_stages"], consumers=c["consumers"], o_own=True,
                                   rowsum_mma=True) <= SMEM_LIMIT
                    and c["num_stages"] > deepest.get(c["consumers"], {}).get("num_stages", 0)):
                deepest[c["consumers"]] = c
        knobs = [dict(c, mask_head=mh, rowsum_mma=rs)
                 for c, mh, rs in itertools.product(deepest.values(), [0, 1, 2], [False, True])]
        return shapes + knobs
    if group == "bwd":
        if bwd_reason(head_dim):  # no Gluon backward at this dim: the dense one runs
            return [dict(bwd_design="plain")]
        stages = bwd_tiles(head_dim)["dkdv_stages"]
        return ([dict(bwd_design="mixed")]
                + [dict(bwd_design="split", dkdv_block_mq=m) for m in (32, 64)
                   if bwd_smem_bytes("dkdv", head_dim, m, stages) <= SMEM_LIMIT]
                + [dict(bwd_design="plain")])
    raise ValueError(f"unknown key group {group!r}")


def gluon_run(q, k, v, mask, config):
    """One timed call of a candidate."""
    from longca_triton.kernels.gluon.op import gluon_attention

    return gluon_attention(q, k, v, mask, config=config)


def gluon_default(head_dim, dtype, mask=None, group=1):
    """What a user gets: the shipped table's config for this mask (``config.resolve_config``)."""
    from longca_triton.kernels.gluon.config import resolve_config

    return resolve_config(head_dim, dtype, None, mask=mask)


def gluon_device_reason(device) -> str:
    """Why the Gluon kernels cannot run on ``device`` (empty when they can)."""
    from longca_triton.kernels.gluon.config import device_reason

    return device_reason(device)

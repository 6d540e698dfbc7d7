r"""Step 8 — warp specialization, written by hand: the Gluon forward (``kernels/gluon/``).

The one idea
------------
Give the three kinds of work in the loop their own warps and let them run at the same time:

* a **producer** warp only issues TMA copies of K and V into a ring of shared-memory stages and
  waits on *empty* mbarriers; it holds 24 registers;
* two **consumer** warpgroups (64 query rows each, 240 registers each, ``setmaxnreg``) only
  compute: ``S = Q K^T``, the softmax, ``O += P V``;
* inside a consumer the next ``S_j`` and the previous ``P_{j-1} V_{j-1}`` are issued as
  asynchronous wgmma back to back and the softmax of ``S_j`` runs while ``P_{j-1} V_{j-1}`` is
  still on the tensor cores (``warpgroup_mma_wait(1)``);
* between the consumers a token (two mbarriers) makes their GEMMs alternate, so one warpgroup's
  softmax fills the time the other's GEMMs use the tensor cores ("ping-pong").

Why it should help
------------------
Step 7 is one warpgroup pair doing everything in program order: Triton 3.6 on sm_90 waits for
every wgmma (``wgmma.wait_group 0``) before the softmax, so the exp2 units and the tensor cores
take turns. On an H100 the softmax of a 128x128 tile (MUFU ex2 at 16 per clock per SM quarter)
costs about half of the two GEMMs' time; hiding it is worth up to 1.3-1.5x, which is the gap
between step 7 (0.84x cuDNN) and FlashAttention-3 / cuDNN. ``tl.range(warp_specialize=True)`` in
plain Triton does not apply here (step 6's notes): Gluon states the partitions, barriers and
register split explicitly.

What it takes
-------------
The design and the schedule are in ``longca_triton/kernels/gluon/fwd.py``; the plan's
full and partial runs are merged per query tile so all partitions walk one list
(``gluon/plan.py``); ``docs/ladder.md`` explains mbarrier phases and the ping-pong in prose with
a timeline. sm_90 only; elsewhere the ladder says ``skipped`` with the reason.

Measured (H100, causal, S=16K)
------------------------------
585-598 TFLOP/s (B=1, Hq:Hkv=64:8, D=128, bf16; experiments/results/h100/gluon-first-runs/gluon_configs.md,
2026-11-23): 1.17-1.19x step 7 (501 in the same run) and 0.96-1.03x cuDNN. The ring carries it
(1 stage: 492, no better than step 7); ping-pong between the consumers measured -3 % to +1 %,
so it is off by default. The ladder command itself has not yet run this step.

What came after (the kernel this step calls grew; ``docs/ladder.md`` has each idea): three consumers
with P through shared memory on dense masks, a persistent launch on the sparser ones, the split launch
and the branch-free masked head steps (``mask_head``) that keep the mask path out of the key loop.
Measured later (experiments/results/h100/gluon-fwd-mask-head-rowsum, the harness, interleaved): causal 706-716 TFLOP/s
(1.14-1.16x cuDNN, 1.05x Flex's FA4 backend), full 722-723 (1.11-1.12x cuDNN).
"""

from __future__ import annotations

from longca_triton.kernels.gluon import device_reason, gluon_attention

from .step7_production import production_config


def forward(q, k, v, mask, softmax_scale=None):
    """``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``, a ``RangeMask`` -> ``out [B, Sq, Hq, D]``."""
    return gluon_attention(q, k, v, mask, softmax_scale=softmax_scale, config=production_config(q, k, mask, "triton-gluon"))


__all__ = ["forward", "device_reason"]

r"""The kernel ladder: from the attention formula to the production kernel, one idea per step.

Every step is one small file that reads top to bottom (docstring with the math and the tiling,
``@triton.jit`` kernels, launcher, public function) and differs from the previous step by one idea.

Forward steps take ``forward(q, k, v, mask, softmax_scale=None) -> out`` with ``q [B, Sq, Hq, D]``,
``k, v [B, Sk, Hkv, D]`` (``Hq % Hkv == 0``) and a ``RangeMask``; they compute masked attention
exactly (fully masked rows give zeros), whether or not they use the mask to skip work.

Backward steps take ``backward(q, k, v, mask, out, lse, dout, softmax_scale=None) -> (dq, dk, dv)``
with the forward's ``out`` and ``lse [B, Hq, Sq]`` (float32, natural log). For timing, a step may
also offer ``prepare_backward(q, k, v, mask, out, lse, softmax_scale) -> fn(dout)`` that does its
setup outside the timed region (the production step runs its forward there).

Measured on one H100 (causal, ``S = 16K``, ``B = 1``, ``Hq:Hkv = 64:8``, ``D = 128``, bf16;
``experiments/results/h100/ladder/ladder.md``), TFLOP/s over allowed pairs:

    forward   22.7 -> 1.9 -> 100.9 -> 160.8 -> 358.3 -> 358.8 -> 459.4 -> 492.9
              (step 7: 84% of sdpa-cudnn's 589.2 in the same run; step 8, Gluon, not yet timed)
    backward  16.6 -> 120.8 -> 294.2 -> 293.2 -> 397.8
              (bwd5: 75% of sdpa-cudnn's 529.8 in the same run; bwd6, one launch, not yet timed)

Each step's docstring explains its own number, including the three that do not gain: step 1
(slower than step 0), step 5 and bwd4 (flat).

``STEPS`` lists them in order; ``longca-triton ladder`` checks and times them
(``longca_triton/bench/ladder.py``). Import this package after choosing the device
(``longca_triton.runtime.select_device``): it imports Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from . import (
    bwd1_naive,
    bwd2_two_kernels,
    bwd3_mask_skipping,
    bwd4_gqa,
    bwd5_production,
    bwd6_one_launch,
    step0_naive,
    step1_row_program,
    step2_tiled_two_pass,
    step3_online_softmax,
    step4_mask_skipping,
    step5_gqa,
    step6_hopper,
    step7_production,
    step8_warp_specialized,
)

__all__ = ["Step", "STEPS", "steps_for", "get_step"]

_HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Step:
    """One rung of the ladder."""

    name: str  # "step3_online_softmax"
    idea: str  # what this step adds over the previous one, in a few words
    mode: str  # "fwd" or "bwd"
    fn: Callable  # forward(...) -> out, or backward(...) -> (dq, dk, dv)
    module: object
    triton: bool = True  # False for the plain-PyTorch steps
    #: ``limit(B, Hq, Hkv, Sq, Sk, D) -> reason or None``: why it is not run at this size
    limit: Optional[Callable] = None
    #: backward only: ``prepare_backward(q, k, v, mask, out, lse, softmax_scale) -> fn(dout)``
    prepare: Optional[Callable] = None
    #: ``notes() -> str``: what happened at run time worth a line in the table (e.g. features off)
    notes: Optional[Callable] = None
    #: ``device_reason(torch.device) -> str``: why the step cannot run on that device ("" if it can)
    device_reason: Optional[Callable] = None

    @property
    def file(self) -> str:
        """Path relative to the repository root, e.g. ``longca_triton/kernels/ladder/step3_online_softmax.py``."""
        return f"longca_triton/kernels/ladder/{self.name}.py"

    @property
    def path(self) -> Path:
        return _HERE / f"{self.name}.py"

    def prepare_backward(self, q, k, v, mask, out, lse, softmax_scale=None):
        """``fn(dout) -> (dq, dk, dv)`` with setup done now (default: nothing to set up)."""
        if self.prepare is not None:
            return self.prepare(q, k, v, mask, out, lse, softmax_scale)
        return lambda dout: self.fn(q, k, v, mask, out, lse, dout, softmax_scale)


STEPS: list[Step] = [
    Step("step0_naive", "PyTorch, materialised S×S scores", "fwd", step0_naive.forward, step0_naive,
         triton=False, limit=step0_naive.limit),
    Step("step1_row_program", "one Triton program per query row, two passes", "fwd",
         step1_row_program.forward, step1_row_program, limit=step1_row_program.limit),
    Step("step2_tiled_two_pass", "BLOCK_M-row tiles: tl.dot on tensor cores", "fwd",
         step2_tiled_two_pass.forward, step2_tiled_two_pass),
    Step("step3_online_softmax", "online softmax: one pass (FlashAttention-2 loop)", "fwd",
         step3_online_softmax.forward, step3_online_softmax),
    Step("step4_mask_skipping", "block tables: skip empty tiles, no mask math on full ones", "fwd",
         step4_mask_skipping.forward, step4_mask_skipping),
    Step("step5_gqa", "GQA: pack a KV group's query heads into one tile", "fwd",
         step5_gqa.forward, step5_gqa),
    Step("step6_hopper", "TMA descriptors, software pipelining, warp specialization", "fwd",
         step6_hopper.forward, step6_hopper, notes=step6_hopper.notes),
    Step("step7_production", "the production kernel (dense_attention)", "fwd",
         step7_production.forward, step7_production),
    Step("step8_warp_specialized", "Gluon: producer warp, ping-pong consumers, softmax over async wgmma",
         "fwd", step8_warp_specialized.forward, step8_warp_specialized,
         device_reason=step8_warp_specialized.device_reason),
    Step("bwd1_naive", "PyTorch, materialised P and dS", "bwd", bwd1_naive.backward, bwd1_naive,
         triton=False, limit=bwd1_naive.limit),
    Step("bwd2_two_kernels", "FA2 backward: recompute P, key-major dK/dV + query-major dQ", "bwd",
         bwd2_two_kernels.backward, bwd2_two_kernels),
    Step("bwd3_mask_skipping", "block tables in both orientations", "bwd",
         bwd3_mask_skipping.backward, bwd3_mask_skipping),
    Step("bwd4_gqa", "dK/dV program sums its KV group in registers", "bwd",
         bwd4_gqa.backward, bwd4_gqa),
    Step("bwd5_production", "the production backward (dense_attention autograd)", "bwd",
         bwd5_production.backward, bwd5_production, prepare=bwd5_production.prepare_backward),
    Step("bwd6_one_launch", "dK/dV and dQ program sets in one launch (as Flex)", "bwd",
         bwd6_one_launch.backward, bwd6_one_launch, prepare=bwd6_one_launch.prepare_backward),
]


def steps_for(mode: str) -> list[Step]:
    """The steps of one mode (``"fwd"`` or ``"bwd"``), in ladder order."""
    if mode not in ("fwd", "bwd"):
        raise ValueError(f"mode must be 'fwd' or 'bwd', got {mode!r}")
    return [s for s in STEPS if s.mode == mode]


def get_step(name: str) -> Step:
    for s in STEPS:
        if s.name == name:
            return s
    raise ValueError(f"unknown ladder step {name!r}; steps: {', '.join(s.name for s in STEPS)}")

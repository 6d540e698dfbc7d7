"""Context parallelism on ``torch.distributed``: six schemes, any ``RangeMask``.

>>> plan = cp.make_plan(mask, world_size, kind="zigzag")
>>> q_local = cp.dispatch(q, plan, rank)            # likewise k, v
>>> out_local = cp.attention(q_local, k_local, v_local, plan, scheme="ring_p2p", backend="triton")
>>> out = cp.undispatch(out_local, plan)            # [B, S, H, D] on every rank

Schemes: ``ulysses``, ``ring_p2p``, ``ring_allgather``, ``usp``, ``loongtrain`` (``attention.py``),
``group_cast`` (``group_cast.py``: moves only the key ranges the mask needs, from ``need.py``); plans: ``contiguous``, ``zigzag``, ``balanced`` (``plan.py``); byte counts and the closed-form
communication model in ``comm.py``; docs/cp.md describes the design.
"""

from .attention import attention, merge_
from .comm import COUNTER, SCHEMES, CommCounter, CommRow, comm_model, model_snapshot
from .kernels import AutogradStep, StepKernel, TorchStep, TritonStep, get_step_kernel
from .mesh import CPMesh, get_mesh, resolve_dims
from .need import NeedLayout, need_layout
from .plan import PLAN_KINDS, CPPlan, assemble, clip_slice, dispatch, layout_mask, make_plan, undispatch

__all__ = [
    "COUNTER", "PLAN_KINDS", "SCHEMES", "AutogradStep", "CPMesh", "CPPlan", "CommCounter", "CommRow", "NeedLayout", "StepKernel",
    "TorchStep", "TritonStep", "assemble", "attention", "clip_slice", "comm_model", "dispatch", "get_mesh",
    "get_step_kernel", "layout_mask", "make_plan", "merge_", "model_snapshot", "need_layout", "resolve_dims", "undispatch",
]

r"""Dense structured-mask attention in Gluon, warp-specialized for sm_90 (Hopper) only: the launchers,
the autograd function and ``gluon_attention``.

The forward is ``fwd.gluon_fwd_kernel`` (FlashAttention-3's design: a TMA producer warp, two or three
consumer warpgroups, async wgmma with the softmax of one key tile overlapping the ``P V`` of the
previous one). The backward (config ``bwd_design``, ``config.py``) is the dense family's on this
forward's ``out`` and ``lse`` (``"plain"``), the Gluon dQ kernel beside the dense dK/dV kernel on a
second stream (``"mixed"``), or the Gluon dQ and dK/dV kernels (``"split"``, ``bwd.py``). Every
gradient tile is written once by one program: no atomics, bitwise reproducible.

Head dims: the forward takes every head dim the dense kernels take (multiples of 8 up to 256, D_v
may differ from D_qk) on power-of-two tiles, or with ``split_d`` a dim that is two powers of two as
two exact pieces; the Gluon backward kernels take 64 and 128 with D_v == D_qk (``BWD_HEAD_DIMS``).
Launch configs: ``config.resolve_config`` and the shipped table ``kernels/tuning/gluon.toml``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from longca_triton.kernels.core.autograd import attention_function
from longca_triton.kernels.core.jit import LOG2E
from longca_triton.kernels.core.plan_cache import PlanCache
from longca_triton.kernels.core.runtime import (
    bsh_strides,
    check_qkv,
    config_head_dim,
    descriptor_ready,
    ensure_allocator,
    head_dim_meta,
    resolve_scale,
    side_stream,
)
from longca_triton.kernels.dense.op import check_deterministic as dense_check_deterministic
from longca_triton.kernels.dense.op import check_plan, dense_bwd, launch_bwd_dkdv, launch_bwd_preprocess
from longca_triton.kernels.dense.op import resolve_config as dense_resolve_config
from longca_triton.kernels.dense.plan import get_tile_plan
from longca_triton.kernels.gluon.config import (
    BLOCK_M,
    bwd_tiles,
    consumer_regs,
    device_reason,
    fwd_block_m,
    regs,
    resolve_config,
    split_partial_reason,
)
from longca_triton.kernels.gluon.fwd_parts import o_fits_q
from longca_triton.kernels.gluon.plan import HEAD_TILES, WsPlan, get_ws_plan

__all__ = ["GluonAttentionFunction", "check_inputs", "dq_plan", "fwd_plan", "gluon_attention", "gluon_backward",
           "gluon_bwd", "gluon_forward", "gluon_fwd", "launch_gluon_bwd_dkdv", "launch_gluon_bwd_dq", "plans_for_gluon"]


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
        _launch_fwd(q, k, v, out, lse, piece, softmax_scale, dict(cfg, persistent=True) if i else cfg,
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
    cregs = consumer_regs(cfg["consumers"])
    producer_regs, maxnreg = regs(cregs, cfg["consumers"])
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
        STORE_TMA=store_tma and (cfg["o_own"] or o_fits_q(d, dv, dims["BLOCK_DQK"], dims["BLOCK_DV"], split)),
        CONSUMER_REGS=cregs,
        PRODUCER_REGS=producer_regs,
        SPLIT_D=split, CONSUMERS=cfg["consumers"], P_SMEM=cfg["p_smem"], O_OWN=store_tma and cfg["o_own"],
        PERSISTENT=cfg["persistent"], SNAKE=cfg["persistent"], MERGE=merge, MASK_HEAD=plan.mask_head, ROWSUM_MMA=cfg["rowsum_mma"],
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


def _bwd_regs(head_dim: int) -> dict:
    cregs = bwd_tiles(head_dim)["bwd_consumer_regs"]
    producer_regs, maxnreg = regs(cregs)
    return dict(CONSUMER_REGS=cregs, PRODUCER_REGS=producer_regs, num_warps=4, maxnreg=maxnreg)


def launch_gluon_bwd_dq(q, k, v, dout, dq, lse, delta, plan: WsPlan, softmax_scale: float, cfg: dict):
    """The Gluon dQ kernel (query-major) into ``dq``; inputs as ``_bwd_inputs`` returns them."""
    from longca_triton.kernels.gluon.bwd import gluon_bwd_dq_kernel

    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    tiles = bwd_tiles(d)
    gluon_bwd_dq_kernel[(plan.tiles.num_m * b * hq,)](
        q, k, v, dout, dq, lse, delta,
        *bsh_strides(q, k, v, dout, dq),
        *plan.tensors(),
        softmax_scale * LOG2E, softmax_scale,
        sq, sk, b * hq, hq, hq // hkv,
        HEAD_DIM=d, BLOCK_N=tiles["dq_block_n"], NUM_IV=plan.tiles.num_iv, NUM_STAGES=tiles["dq_stages"],
        HAS_PARTIAL_TILES=plan.has_partial, MASK_HEAD=plan.mask_head, **_bwd_regs(d),
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
        NUM_STAGES=bwd_tiles(d)["dkdv_stages"], HAS_PARTIAL_TILES=plan.has_partial, **_bwd_regs(d),
    )


def gluon_bwd(dout, q, k, v, out, lse, dq_plan: WsPlan, dkdv_plan, softmax_scale: float,
              cfg: dict, dlse=None, bwd_cfg: Optional[dict] = None):
    """Launch delta preprocess, the Gluon dQ kernel and the dK/dV kernel of ``cfg["bwd_design"]``:
    the Gluon one (``"split"``, ``dkdv_plan`` a key-major :class:`WsPlan`, after dQ) or the dense one
    (``"mixed"``: ``dense.launch_bwd_dkdv`` on the dense :class:`TilePlan` ``dkdv_plan`` with
    ``bwd_cfg``'s dK/dV keys, first, with dQ beside it on a second stream). Each tile of dQ, dK, dV
    is written once by one program. Returns ``dq, dk, dv`` in the inputs' dtype."""
    mixed = cfg["bwd_design"] == "mixed"
    check_plan(dq_plan.tiles, BLOCK_M, bwd_tiles(q.shape[-1])["dq_block_n"], "dQ")
    if mixed:
        check_plan(dkdv_plan, bwd_cfg["DKDV_BLOCK_M"], bwd_cfg["DKDV_BLOCK_N"], "dK/dV")
    else:
        check_plan(dkdv_plan.tiles, cfg["dkdv_block_mq"], BLOCK_M, "dK/dV")
    q, k, v, dout, lse, delta, (dq, dk, dv) = _bwd_inputs(dout, q, k, v, out, lse, dlse)
    if delta is None:
        return dq, dk, dv
    if mixed:
        # the dK/dV programs (the longer ones) first; dQ's fill the SMs beside them and after
        with side_stream(q.device, True) as beside:
            launch_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, dkdv_plan, softmax_scale, bwd_cfg)
            with beside():
                launch_gluon_bwd_dq(q, k, v, dout, dq, lse, delta, dq_plan, softmax_scale, cfg)
        return dq, dk, dv
    launch_gluon_bwd_dq(q, k, v, dout, dq, lse, delta, dq_plan, softmax_scale, cfg)
    launch_gluon_bwd_dkdv(q, k, v, dout, dk, dv, lse, delta, dkdv_plan, softmax_scale, cfg)
    return dq, dk, dv


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


def dq_plan(mask, head_dim: int, device):
    """The Gluon dQ kernel's plan: the merged runs, or at D = 128 (``config.bwd_tiles``: ``dq_mask_head``)
    on a mask whose query tiles each have at most two partial key tiles the head plan (``part="head"``,
    ``head`` = the most any tile has): the dQ kernel then masks its first steps without a branch and
    compiles its loop without the mask path. dQ has no cheap merge for a second launch, so a mask with
    more partial tiles in some query tile keeps the merged plan."""
    tiles = bwd_tiles(head_dim)
    plan = get_ws_plan(mask, BLOCK_M, tiles["dq_block_n"], device, "q")
    if not (tiles["dq_mask_head"] and plan.has_partial):
        return plan
    # partial tiles per query tile as the tile plan lists them: the mask's partial tiles and the
    # key tiles cut by the sequence's ragged end (the head plan must hold every one of them)
    ptr, start, end = (t.cpu().numpy() for t in plan.tiles.q_part)
    runs_tile = np.repeat(np.arange(len(ptr) - 1), np.diff(ptr))
    most = int(np.bincount(runs_tile, weights=end - start, minlength=len(ptr) - 1).max()) if len(start) else 0
    if most == 0 or most > max(HEAD_TILES):
        return plan
    return get_ws_plan(mask, BLOCK_M, tiles["dq_block_n"], device, "q", part="head", head=most)


_PLANS = PlanCache(64)


def plans_for_gluon(mask, head_dim: int, cfg: dict, bwd_cfg: dict, device):
    """The forward's plan and the backward's two plans: the Gluon dQ plan and the Gluon key-major dK/dV
    plan (``"split"``) or the dense dK/dV :class:`TilePlan` of ``bwd_cfg``'s tiles (``"mixed"``), or the
    dense dK/dV and dQ plans (``"plain"``). Each plan is cached, and so is the triple, by the mask's
    content, the head dim, both configs and the device (one lookup for a call that has been seen)."""
    key = ("gluon", int(head_dim), tuple(cfg.items()), tuple(bwd_cfg.items()))
    return _PLANS.get(mask, key, device, lambda dev: _plans_for_gluon(mask, head_dim, cfg, bwd_cfg, dev))


def _plans_for_gluon(mask, head_dim: int, cfg: dict, bwd_cfg: dict, device):
    fwd = fwd_plan(mask, cfg, device)
    if cfg["bwd_design"] == "split":
        return fwd, dq_plan(mask, head_dim, device), get_ws_plan(mask, cfg["dkdv_block_mq"], BLOCK_M, device, "k")
    # the dense backward's plans only (not the dense forward's, which no design runs)
    dkdv = get_tile_plan(mask, bwd_cfg["DKDV_BLOCK_M"], bwd_cfg["DKDV_BLOCK_N"], device)
    if cfg["bwd_design"] == "mixed":
        return fwd, dq_plan(mask, head_dim, device), dkdv
    return fwd, dkdv, get_tile_plan(mask, bwd_cfg["DQ_BLOCK_M"], bwd_cfg["DQ_BLOCK_N"], device)


# ----------------------------------------------------------------------------------------------
# Autograd and the public function
# ----------------------------------------------------------------------------------------------

def _fwd(q, k, v, plan, bwd_a, bwd_b, softmax_scale, cfg, bwd_cfg):
    return gluon_fwd(q, k, v, plan, softmax_scale, cfg)


def _bwd(dout, dlse, q, k, v, out, lse, plan, bwd_a, bwd_b, softmax_scale, cfg, bwd_cfg):
    if cfg["bwd_design"] == "plain":
        return dense_bwd(dout, q, k, v, out, lse, bwd_a, bwd_b, softmax_scale, bwd_cfg, dlse=dlse)
    return gluon_bwd(dout, q, k, v, out, lse, bwd_a, bwd_b, softmax_scale, cfg, dlse=dlse, bwd_cfg=bwd_cfg)


#: ``apply(q, k, v, plan, bwd_a, bwd_b, softmax_scale, cfg, bwd_cfg) -> (out, lse)``; the backward
#: plans are ``plans_for_gluon``'s
GluonAttentionFunction = attention_function(
    "GluonAttentionFunction", _fwd, _bwd,
    """``(q, k, v) -> (out, lse)``: Gluon forward; Gluon or dense backward.""")


def _configs_for(q, k, v, mask, config, bwd_config):
    """The forward's and the dense backward's resolved configs of one call, memoised on the mask (they
    depend on the mask, head dims, dtype, GQA group, device, the explicit configs and the autotune cache)."""
    from longca_triton.kernels.core.plan_cache import mask_memo
    from longca_triton.kernels.core.tuned import generation

    d, dv = q.shape[-1], v.shape[-1]

    def build():
        return (resolve_config(d, q.dtype, config, q=q, k=k, mask=mask, v=v),
                dense_resolve_config(config_head_dim(d, dv), q.dtype, bwd_config, q=q, k=k, mask=mask,
                                     v=v if dv != d else None))

    key = ("gluon", d, dv, q.dtype, q.shape[2] // k.shape[2], str(q.device),
           *(None if c is None else repr(sorted(c.items())) for c in (config, bwd_config)), generation())
    cfg, bwd_cfg = mask_memo(mask, key, build)
    return dict(cfg), dict(bwd_cfg)


def gluon_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, softmax_scale=None,
                    return_lse: bool = False, config: Optional[dict] = None,
                    bwd_config: Optional[dict] = None, deterministic: bool = False):
    """Attention of ``q [B, Sq, Hq, D_qk]`` over ``k [B, Sk, Hkv, D_qk]``, ``v [B, Sk, Hkv, D_v]``
    under a ``RangeMask`` on an sm_90 GPU: the warp-specialized Gluon forward and the backward of
    ``bwd_design`` (``config.py``).

    ``config`` sets the launch (``config.CONFIG_KEYS``), ``bwd_config`` the dense backward's (the dense
    kernel's keys: all of them with ``"plain"``, its dK/dV keys with ``"mixed"``).
    ``deterministic=True``: bitwise-identical gradients run to run (no Gluon design has atomics; the
    dense backward has no atomics, so every config of it is).
    Returns ``out`` or ``(out, lse)`` like ``dense_attention``.
    """
    check_inputs(q, k, v, mask)
    d, dv = q.shape[-1], v.shape[-1]
    softmax_scale = resolve_scale(softmax_scale, d)
    cfg, bwd_cfg = _configs_for(q, k, v, mask, config, bwd_config)
    if deterministic and cfg["bwd_design"] == "plain":
        dense_check_deterministic(bwd_cfg, True, "the Gluon attention's dense backward")
    plan, bwd_a, bwd_b = plans_for_gluon(mask, d, cfg, bwd_cfg, q.device)
    out, lse = GluonAttentionFunction.apply(q, k, v, plan, bwd_a, bwd_b, softmax_scale, cfg, bwd_cfg)
    return (out, lse) if return_lse else out


def gluon_forward(q, k, v, mask, softmax_scale: float):
    """``gluon_attention``'s forward without autograd: ``(out, lse)`` under the call's resolved config
    and plans (memoised on the mask). For callers that do their own autograd, such as the
    ``longca_triton::attention`` custom op, which pairs it with :func:`gluon_backward`."""
    check_inputs(q, k, v, mask)
    cfg, bwd_cfg = _configs_for(q, k, v, mask, None, None)
    plan, _, _ = plans_for_gluon(mask, q.shape[-1], cfg, bwd_cfg, q.device)
    return gluon_fwd(q, k, v, plan, softmax_scale, cfg)


def gluon_backward(dout, dlse, q, k, v, out, lse, mask, softmax_scale: float):
    """The backward of :func:`gluon_forward`'s ``(out, lse)`` (the design its config names): ``dq, dk, dv``."""
    cfg, bwd_cfg = _configs_for(q, k, v, mask, None, None)
    plan, bwd_a, bwd_b = plans_for_gluon(mask, q.shape[-1], cfg, bwd_cfg, q.device)
    return _bwd(dout, dlse, q, k, v, out, lse, plan, bwd_a, bwd_b, softmax_scale, cfg, bwd_cfg)

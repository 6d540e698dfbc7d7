"""Issue 13 on an H100: the backward of ``triton`` as two kernels (default), as one launch (dK/dV and
dQ program sets in one grid, ``one_launch``), and with dQ by fp32 atomics (``fused_dq``), against
FlexAttention (Triton backend, compiled) and cuDNN SDPA, on the same inputs.

Run from the repository root on a CUDA machine (the package need not be installed):

    PYTHONUNBUFFERED=1 python experiments/gpu/bwd_variants.py --out $OUT

Cases: full, causal, causal_document, share_question at S=16K, GQA 64:8, D=128, bf16 (masks as in
``dense_check.bench_mask``). Per mask:

1. correctness of every variant of ours (``longca_triton.bench.check``: one KV group against a
   float32 reference), and ``deterministic=True`` giving bitwise-equal dq/dk/dv on two runs for
   the two-kernel and best one-launch variants (``fused_dq`` is reported, not required, equal);
2. backward time (preprocess + kernels, ``dense_check.time_ours_bwd``) of each variant, Flex's
   backward and (full, causal) cuDNN's, all by ``longca_triton.bench.timing.time_fn``.

Block-sparse (``--sparse-masks``, after the dense masks): ``triton-sparse`` (uniform block 128) and
``triton-varblock`` (variable blocks, mean 256) at S=32K, density 0.3, GQA 64:8, 8 patterns: two
kernels vs one launch, each checked, against Flex's block-sparse backward; all timed through
autograd (``torch.autograd.grad``), as Flex can only be.

Rows go to ``<out>/bwd_variants.jsonl`` as measured; ``<out>/bwd_variants.md`` gets the tables with
the issue's targets (dense backward >= 1.1x Flex, >= 0.8x cuDNN on full and causal; block-sparse
>= 1.05x Flex; variable blocks >= 0.8x uniform). Then put the numbers into the kernels'
docstrings and, where one launch wins, make it the default.

``--smoke`` runs the same code on the CPU interpreter at a toy size (no Flex, no cuDNN), so that
the script itself is tested without a GPU.

A/B of two versions of the kernels in one device call: ``LONGCA_PACKAGE_ROOT=DIR`` imports
``longca_triton`` from ``DIR`` (e.g. ``git archive HEAD longca_triton | tar -x -C _base``) instead of
this checkout; ``--variants`` picks variants by name (``TILE_VARIANTS`` adds dK/dV tiles to the
list); every two-kernel variant also gets a ``split`` row (the dK/dV and the dQ kernel timed alone).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # a plain checkout runs without installing
sys.path.insert(0, str(HERE))
if os.environ.get("LONGCA_PACKAGE_ROOT"):
    # why import it here: dense_check puts this checkout first on sys.path; a package already in
    # sys.modules wins over the path, and its subpackages load from its own directory
    sys.path.insert(0, os.path.abspath(os.environ["LONGCA_PACKAGE_ROOT"]))
    import longca_triton  # noqa: F401

import dense_check as DC
import torch

from longca_triton.bench.check import compare, reference_group
from longca_triton.kernels.block_sparse import op as BS
from longca_triton.kernels.dense import op as D
from longca_triton.masks import make_mask

MASKS = ("full", "causal", "causal_document", "share_question")
FUSED_DQ = dict(fused_dq=True, DKDV_BLOCK_M=64, DKDV_BLOCK_N=64, dkdv_num_warps=8, dkdv_num_stages=2, dkdv_sweep=0)

def dkdv_tile(m: int, n: int, warps: int, stages: int) -> dict:
    """A dK/dV tile overlay: ``m`` query rows per step, ``n`` keys per program."""
    return dict(DKDV_BLOCK_M=m, DKDV_BLOCK_N=n, dkdv_num_warps=warps, dkdv_num_stages=stages)


def dq_tile(m: int, n: int, warps: int, stages: int) -> dict:
    """A dQ tile overlay: ``m`` query rows per program, ``n`` keys per step."""
    return dict(DQ_BLOCK_M=m, DQ_BLOCK_N=n, dq_num_warps=warps, dq_num_stages=stages)


#: dK/dV tiles (DKDV_BLOCK_M query rows per step x DKDV_BLOCK_N keys per program) beside the
#: default 32x64/4 warps/3 stages; sm_90a registers / spills / shared memory (compiled on a CPU, the
#: dP^T-first update of ``core.dkdv_update``): 32x64 w4 s2 235 / 0 / 66 KB; 32x128 w8 230 / 0 /
#: 115 KB (s3); 64x128 w8 s3 255 / 88 B / 165 KB (Flex's tile); 64x64 w4 s2 255 / 88 B / 99 KB
_DKDV_TILES = ((32, 64, 4, 2), (32, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 3), (64, 64, 4, 2))
# dQ tiles beside the default 128x64/8 warps/3 stages (one block per SM: 164 KB of shared memory)
_DQ_TILES = ((128, 64, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 8, 3))
TILE_VARIANTS = {**{"dkdv{}x{}w{}s{}".format(*t): dkdv_tile(*t) for t in _DKDV_TILES},
                 **{"dq{}x{}w{}s{}".format(*t): dq_tile(*t) for t in _DQ_TILES}}
#: the dK/dV kernel's row-major sweeps (``dkdv_sweep``: per query tile every head of the GQA group;
#: 2 = query tiles descending), with the mask's default tile and with the 32x64 / 64x64 tiles. sm_90a
#: (CPU, causal, D = 128): sweep 2 at 32x64/4/3 241 registers, no spills (the head-major default: 255,
#: 28 B); at 64x64/4/2 96 B of spills (head-major 16 B)
TILE_VARIANTS.update({
    "sweep1": {"dkdv_sweep": 1},
    "sweep2": {"dkdv_sweep": 2},
    "sweep2-dkdv32x64w4s3": {"dkdv_sweep": 2, **dkdv_tile(32, 64, 4, 3)},
    "sweep2-dkdv64x64w4s2": {"dkdv_sweep": 2, **dkdv_tile(64, 64, 4, 2)},
    # the dK/dV grid with the KV head slowest (``dkdv_head_outer``; won in the block-sparse kernel)
    "outer": {"dkdv_head_outer": True},
    # head-major on a named tile whatever the mask's default sweep (``dense.HOPPER_UNEVEN_MASK``)
    **{"hm-dkdv{}x{}w{}s{}".format(*t): {"dkdv_sweep": 0, **dkdv_tile(*t)}
       for t in ((32, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (32, 128, 8, 3), (64, 128, 8, 2))},
})


def variants(smoke: bool) -> dict:
    """name -> config overlay. One launch: every program order x warps x stages with the default
    tiles, and the dQ tile that fits 4 warps (64x64)."""
    out = {"two-kernels": {}, "fused_dq": FUSED_DQ}
    grid = [(0, 4, 1)] if smoke else itertools.product((0, 1, 2), (4, 8), (2, 3))
    for order, warps, stages in grid:
        out[f"one-launch o{order} w{warps} s{stages}"] = dict(one_launch=True, bwd_order=order, bwd_num_warps=warps,
                                                              bwd_num_stages=stages)
    if not smoke:
        for order in (0, 2):
            out[f"one-launch o{order} w4 s2 dq64x64"] = dict(one_launch=True, bwd_order=order, bwd_num_warps=4,
                                                             bwd_num_stages=2, DQ_BLOCK_M=64, DQ_BLOCK_N=64)
    return out


def all_variants(smoke: bool) -> dict:
    """Every variant a ``--variants`` name may pick: ``variants`` and ``TILE_VARIANTS``."""
    return {**variants(smoke), **TILE_VARIANTS}


_TILE_PART = re.compile(r"^s?(dkdv|dq|fwd)(\d+)x(\d+)w(\d+)s(\d+)$")
_TILE_OF = {"dkdv": dkdv_tile, "dq": dq_tile,
            "fwd": lambda m, n, w, s: dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)}
_ONE_LAUNCH_PART = re.compile(r"^one(\d)w(\d+)s(\d+)$")
_CHUNK_PART = re.compile(r"^(fwd|dq|dkdv)?chunk(\d+)$")
_CHUNK_KEY = {"fwd": ("list_chunk",), "dq": ("dq_list_chunk",), "dkdv": ("dkdv_list_chunk",),
              None: ("list_chunk", "dkdv_list_chunk", "dq_list_chunk")}
_SWITCH_PARTS = {"outer": {"dkdv_head_outer": True}, "inner": {"dkdv_head_outer": False}, "hm": {"dkdv_sweep": 0},
                 "sweep1": {"dkdv_sweep": 1}, "sweep2": {"dkdv_sweep": 2}, "expand": {"_expand": True},
                 "pack": {"pack_list": True, "dq_pack_list": True, "dkdv_pack_list": True},
                 "nopack": {"pack_list": False, "dq_pack_list": False, "dkdv_pack_list": False},
                 "fwdpack": {"pack_list": True}, "dqpack": {"dq_pack_list": True}, "dqnopack": {"dq_pack_list": False},
                 "dkdvpack": {"dkdv_pack_list": True}, "dkdvnopack": {"dkdv_pack_list": False},
                 "porder": {"dkdv_pattern_order": True}, "noporder": {"dkdv_pattern_order": False}}
_HEADS_PART = re.compile(r"^(fwd|dq|dkdv)heads(\d)$")
_TAIL_PART = re.compile(r"^(fwd|dq|dkdv)tail(\d+)$")
_TAIL_KEY = {"fwd": "tail_rows", "dq": "dq_tail_rows", "dkdv": "dkdv_tail_rows"}
_HEADS_KEY = {"fwd": "HEADS", "dq": "DQ_HEADS", "dkdv": "DKDV_HEADS"}


def compose(name: str) -> dict | None:
    """A variant spelled out: parts joined by ``+``, each a tile (``dkdv64x128w8s3``: 64 query rows per
    step x 128 keys per program, 8 warps, 3 stages; ``dq128x64w8s3``; an ``s`` prefix is allowed), one
    launch (``one2w8s2``: program order 2, 8 warps, 2 stages) or a switch (``outer``, ``inner``, ``hm``,
    ``sweep1``, ``sweep2``; block-sparse only: ``expand``, the KV heads repeated per query head,
    ``pack`` / ``nopack`` (every pass's packed lists for variable blocks; one pass: ``fwdpack``,
    ``dqpack`` / ``dqnopack``, ``dkdvpack`` / ``dkdvnopack``), ``porder`` / ``noporder``
    (``dkdv_pattern_order``), ``dqheads2`` (``DQ_HEADS``; ``fwdheads2``,
    ``dkdvheads2``: heads stacked in a tile), ``dkdvtail64`` (``dkdv_tail_rows``; ``fwdtail64``,
    ``dqtail64``: block remainders in tail tiles of their own), and ``chunk64``, every pass's list read in register chunks of 64: ``list_chunk``, ``dkdv_list_chunk``,
    ``dq_list_chunk``; one pass's: ``fwdchunk64``, ``dqchunk64``, ``dkdvchunk64``); ``fwd128x64w8s3`` is a forward tile (block-sparse: a tile part without
    ``chunkN`` reads that pass's list entry by entry, ``block_sparse.resolve_config``). None
    when a part is none of these."""
    cfg = {}
    for part in name.split("+"):
        m = _TILE_PART.match(part)
        one = _ONE_LAUNCH_PART.match(part)
        chunk = _CHUNK_PART.match(part)
        heads = _HEADS_PART.match(part)
        tail = _TAIL_PART.match(part)
        if tail:
            cfg[_TAIL_KEY[tail.group(1)]] = int(tail.group(2))
        elif heads:
            cfg[_HEADS_KEY[heads.group(1)]] = int(heads.group(2))
        elif m:
            cfg.update(_TILE_OF[m.group(1)](*(int(x) for x in m.groups()[1:])))
        elif one:
            order, warps, stages = (int(x) for x in one.groups())
            cfg.update(one_launch=True, bwd_order=order, bwd_num_warps=warps, bwd_num_stages=stages)
        elif chunk:
            cfg.update({key: int(chunk.group(2)) for key in _CHUNK_KEY[chunk.group(1)]})
        elif part in _SWITCH_PARTS:
            cfg.update(_SWITCH_PARTS[part])
        else:
            return None
    return cfg


def pick(available: dict, names: str | None) -> dict:
    """``available`` restricted to the comma-separated ``names`` (all when None), a name ``available``
    lacks spelled out by ``compose``; names that are neither raise."""
    if names is None:
        return available
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    chosen = {n: available[n] if n in available else compose(n) for n in wanted}
    unknown = [n for n, c in chosen.items() if c is None]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {sorted(available)} or tiles/switches joined by '+' "
                         "(e.g. dkdv64x128w8s3+outer)")
    return chosen


def split_ms(p: DC.Problem, cfg: dict, out, lse) -> dict:
    """The dK/dV and the dQ kernel of the two-kernel backward timed alone (preprocess excluded)."""
    kplan = DC.get_tile_plan(p.mask, cfg["DKDV_BLOCK_M"], cfg["DKDV_BLOCK_N"], DC.DEV)
    qplan = DC.get_tile_plan(p.mask, cfg["DQ_BLOCK_M"], cfg["DQ_BLOCK_N"], DC.DEV)
    q, k, v, o, do = (D._descriptor_ready(t) for t in (p.q, p.k, p.v, out, p.dout))
    lse = lse.contiguous()
    delta = D.launch_bwd_preprocess(o, do)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dkdv = lambda: D.launch_bwd_dkdv(q, k, v, do, lse, delta, dk, dv, kplan, p.scale, cfg)  # noqa: E731
    dqf = lambda: D.launch_bwd_dq(q, k, v, do, lse, delta, dq, qplan, p.scale, cfg)  # noqa: E731
    dkdv(), dqf()
    return {"dkdv_ms": DC.median_ms(dkdv, rep=250), "dq_ms": DC.median_ms(dqf, rep=250)}


def sparse_split_ms(p, mask, cfg: dict) -> dict:
    """The block-sparse dK/dV and dQ kernels timed alone (``block_sparse_bwd(passes=...)``; the
    delta preprocess is in both), from one forward's out / lse."""
    tables = BS.tables_for(mask, cfg, p.q.device)
    out, lse = BS.block_sparse_fwd(p.q, p.k, p.v, mask, tables["fwd"], p.scale, cfg, tables.get("fwd_tail"))
    run = lambda passes: BS.block_sparse_bwd(p.dout, p.q, p.k, p.v, out, lse, mask, tables, p.scale, cfg,  # noqa: E731
                                             passes=passes)
    run(("dkdv", "dq"))
    return {"dkdv_ms": DC.median_ms(lambda: run(("dkdv",)), rep=250),
            "dq_ms": DC.median_ms(lambda: run(("dq",)), rep=250)}


def grads(p: DC.Problem, config: dict, deterministic: bool = False):
    q, k, v = (t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v))
    out, lse = D.dense_attention(q, k, v, p.mask, return_lse=True, config=config, deterministic=deterministic)
    out.backward(p.dout)
    return out.detach(), lse, (q.grad, k.grad, v.grad)


def check_variant(emit, p, ref, name: str, config: dict, dtype) -> bool:
    try:
        out, lse, g = grads(p, config)
        res = compare(ref, out, lse, g, dtype)
    except Exception as e:  # noqa: BLE001 - a variant that fails loses, the run goes on
        emit(dict(kind="check", variant=name, status=f"error: {e!r}"[:400]))
        return False
    emit(dict(kind="check", variant=name, config=config, **res.as_row(), message=res.message))
    return res.ok


def timed(emit, time_one, flops: float, **row) -> float:
    """``time_one()`` in ms, emitted with its TFLOP/s; a failure is emitted and counts as inf."""
    try:
        t = time_one()
    except Exception as e:  # noqa: BLE001
        emit(dict(kind="bwd", **row, status=f"error: {e!r}"[:400]))
        return float("inf")
    emit(dict(kind="bwd", **row, ms=t, tflops=flops / t * 1e-9))
    return t


def bitwise_twice(emit, p, name: str, config: dict) -> bool:
    deterministic = not config.get("fused_dq", False)
    a = grads(p, config, deterministic)[2]
    b = grads(p, config, deterministic)[2]
    equal = all(torch.equal(x, y) for x, y in zip(a, b))
    emit(dict(kind="bitwise", variant=name, deterministic=deterministic, equal=equal))
    return equal


def run_mask(emit, mname: str, S: int, hq: int, hkv: int, d: int, dtype, smoke: bool, budget: float,
             chosen: dict | None = None, vendors: bool = True, split: bool = True) -> dict:
    p = DC.Problem(DC.bench_mask(mname, S), hq=hq, hkv=hkv, d=d, dtype=dtype)
    ref = reference_group(p.mask, p.q, p.k, p.v, p.dout, p.scale, True)
    # the default a user gets (full masks: HOPPER_FULL_MASK; GQA on uneven masks: HOPPER_UNEVEN_MASK)
    base = D.resolve_config(d, dtype, q=p.q, k=p.k, mask=p.mask)
    row = dict(mask=mname, S=S, Hq=hq, Hkv=hkv, D=d, times={})
    ok = {}
    chosen = variants(smoke) if chosen is None else chosen
    for name, var in chosen.items():
        if DC.elapsed() > budget:
            emit(dict(kind="bwd", mask=mname, variant=name, status="skipped: time"))
            continue
        ok[name] = check_variant(lambda r: emit(dict(mask=mname, **r)), p, ref, name, var, dtype)
        if not ok[name]:
            continue
        cfg = D.resolve_config(d, dtype, {**base, **var})
        out, lse = DC.fwd_once(p, cfg)
        t = timed(emit, lambda: DC.time_ours_bwd(p, cfg, out, lse), p.bwd_flops, mask=mname, S=S, variant=name,
                  config=var)
        row["times"][name] = t
        if split and t != float("inf") and not (cfg["one_launch"] or cfg["fused_dq"]):
            emit(dict(kind="split", mask=mname, S=S, variant=name, config=var, **split_ms(p, cfg, out, lse)))
    ones = {n: t for n, t in row["times"].items() if n.startswith("one-launch")}
    best_one = min(ones, key=ones.get) if ones else None
    for name in ("two-kernels", best_one, "fused_dq"):
        if name is not None and ok.get(name):
            bitwise_twice(lambda r: emit(dict(mask=mname, **r)), p, name, chosen[name])
    if not smoke and vendors:
        for vendor, fn in (("flex", lambda: DC.time_flex(p)[1]),
                           ("sdpa-cudnn", (lambda: DC.time_cudnn(p, mname == "causal")[1])
                            if mname in ("full", "causal") else None)):
            if fn is None or DC.elapsed() > budget:
                continue
            row["times"][vendor] = timed(emit, fn, p.bwd_flops, mask=mname, S=S, variant=vendor)
    row["tflops"] = {n: p.bwd_flops / t * 1e-9 for n, t in row["times"].items() if t != float("inf")}
    row["best_one_launch"] = best_one
    return row


# ------------------------------------------------------------------------------ block-sparse
def aligned_bounds(S: int, unit: int = 128, mean: int = 256, seed: int = 0) -> dict:
    """Variable blocks whose sizes are multiples of ``unit`` (``unit`` to ``2 * mean - unit``, mean
    ``mean``): variable blocks without ragged tiles at ``unit``-sized tiles (an experiment that tells
    the ragged tiles' cost from the variable structure's)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sizes = []
    while sum(sizes) < S:
        sizes.append(unit * int(rng.integers(1, 2 * mean // unit)))
    sizes[-1] -= sum(sizes) - S
    if sizes[-1] <= 0:
        sizes.pop()
        sizes[-1] += S - sum(sizes)
    bounds = [0]
    for x in sizes:
        bounds.append(bounds[-1] + x)
    return {"min_block": unit, "block_bounds": bounds}


SPARSE_MASKS = {  # name -> (make_mask name, block, extra parameters or a function of S giving them)
    "uniform128": ("block_sparse", 128, {}),
    "uniform64": ("block_sparse", 64, {}),
    "varblock256": ("varblock_sparse", 256, {"min_block": 128}),
    "varblock128": ("varblock_sparse", 128, {"min_block": 64}),
    "varblock512": ("varblock_sparse", 512, {"min_block": 256}),
    "varblock256x128": ("varblock_sparse", 256, aligned_bounds),
}


#: block-sparse (block 128) tiles beside its default (dK/dV 64x128/8 warps/2 stages, Flex's; dQ
#: 128x64/8 warps/2 stages): the dense kernel's dK/dV tiles and a deeper dQ ring
SPARSE_TILE_VARIANTS = {
    **{"sdkdv{}x{}w{}s{}".format(*t): dkdv_tile(*t) for t in ((64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 3),
                                                             (32, 128, 8, 3))},
    "sdq128x64w8s3": dq_tile(128, 64, 8, 3),
    "sdkdv64x64w4s2-dqs3": {**dkdv_tile(64, 64, 4, 2), **dq_tile(128, 64, 8, 3)},
    # the row-major dK/dV sweeps (``dkdv_sweep``; only where the GQA group shares a pattern). sm_90a
    # (CPU, 32K, per-KV-head pattern, the default 64x128/8/2 tile): sweep 2 spills 56 / 64 bytes,
    # head-major 112 / 120
    "ssweep1": {"dkdv_sweep": 1},
    "ssweep2": {"dkdv_sweep": 2},
    # the dK/dV grid with the KV head slowest (``dkdv_head_outer``): key tiles of one KV head together
    "souter": {"dkdv_head_outer": True},
    "sinner": {"dkdv_head_outer": False},  # the KV head fastest (the default before session 11)
    "souter-ssweep2": {"dkdv_head_outer": True, "dkdv_sweep": 2},
    "souter-sdkdv64x64w4s2": {"dkdv_head_outer": True, **dkdv_tile(64, 64, 4, 2)},
    "souter-one-launch-o0w8s2": {"dkdv_head_outer": True, "one_launch": True, "bwd_order": 0, "bwd_num_warps": 8,
                                 "bwd_num_stages": 2},
}


def sparse_variants(smoke: bool) -> dict:
    out = {"two-kernels": {}}
    for order, warps, stages in ([(2, 4, 1)] if smoke else itertools.product((0, 2), (4, 8), (2, 3))):
        out[f"one-launch o{order} w{warps} s{stages}"] = dict(one_launch=True, bwd_order=order, bwd_num_warps=warps,
                                                              bwd_num_stages=stages)
    return out


def autograd_bwd_ms(p, attn) -> float:
    """Median ms of ``torch.autograd.grad`` through ``attn(q, k, v)`` (inputs ``[B, S, H, D]``)."""
    leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]
    out = attn(*leaves)
    return DC.median_ms(lambda: torch.autograd.grad(out, leaves, p.dout, retain_graph=True), rep=250)


def flex_sparse_attn(p):
    from torch.nn.attention.flex_attention import flex_attention

    from longca_triton.adapters.flex import raise_recompile_limits
    from longca_triton.masks import flex_block_mask

    raise_recompile_limits()
    bm = flex_block_mask(p.mask, 128, device="cuda", num_heads=p.hq)
    flex = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: flex(*(t.transpose(1, 2).contiguous() for t in (q, k, v)), block_mask=bm,
                                enable_gqa=True).transpose(1, 2)


def check_autograd(emit, p, ref, attn, dtype, **row) -> bool:
    """``attn(q, k, v) -> (out, lse)`` run forward and backward on ``p``'s inputs and compared with
    ``ref`` (one KV group in float32); the check row emitted; False on a failure or an exception."""
    try:
        leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]
        out, lse = attn(*leaves)
        out.backward(p.dout)
        res = compare(ref, out.detach(), lse, [t.grad for t in leaves], dtype)
    except Exception as e:  # noqa: BLE001 - a variant that fails loses, the run goes on
        emit(dict(kind="check", **row, status=f"error: {e!r}"[:400]))
        return False
    emit(dict(kind="check", **row, **res.as_row(), message=res.message))
    return res.ok


def fwd_ms(p, attn) -> float:
    """Median ms of the forward ``attn(q, k, v)`` alone (no graph kept)."""
    with torch.no_grad():
        return DC.median_ms(lambda: attn(p.q, p.k, p.v), rep=250)


def run_sparse(emit, name: str, S: int, hq: int, hkv: int, d: int, dtype, smoke: bool, budget: float,
               chosen: dict | None = None, vendors: bool = True, density: float = 0.3, patterns: int = 0,
               split: bool = True, mode: str = "bwd") -> dict:
    """Each variant checked (forward and backward) and timed: the backward through autograd, or with
    ``mode="fwd"`` the forward alone (``row["mode"]`` says which)."""
    time_of = autograd_bwd_ms if mode == "bwd" else fwd_ms
    kind, block, extra = SPARSE_MASKS[name]
    if callable(extra):
        extra = extra(S, 32, 64) if smoke else extra(S)
    mask = make_mask(kind, S, block=block if not smoke else 32, density=density, patterns=patterns or hkv, seed=0,
                     **({"min_block": 16} if smoke and extra and "block_bounds" not in extra else extra))
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, S, h, d, device=DC.DEV, dtype=dtype) for h in (hq, hkv, hkv, hq))
    p = SimpleNamespace(mask=mask, q=q, k=k, v=v, dout=dout, hq=hq, scale=d ** -0.5)  # DC.Problem's fields
    ref = reference_group(mask, p.q, p.k, p.v, p.dout, p.scale, True)
    row = dict(mask=name, S=S, Hq=hq, Hkv=hkv, D=d, density=mask.density, patterns=patterns or hkv, mode=mode,
               times={})
    for vname, var in (sparse_variants(smoke) if chosen is None else chosen).items():
        if DC.elapsed() > budget:
            emit(dict(kind="sparse_bwd", mask=name, variant=vname, status="skipped: time"))
            continue
        var = dict(var)
        # "expand": the KV heads repeated to one per query head (autograd sums dK / dV over the group):
        # dK/dV programs of one query head each, so the programs in flight share one head's q / dO
        # (an experiment on the L2 working set of the GQA head loop, not a backend)
        group = hq // hkv if var.pop("_expand", False) else 1
        attn = lambda q, k, v, var=var, g=group: BS.block_sparse_attention(  # noqa: E731
            q, k.repeat_interleave(g, 2), v.repeat_interleave(g, 2), mask, return_lse=True, config=var)
        if check_autograd(emit, p, ref, attn, dtype, mask=name, variant=vname, config=var):
            row["times"][vname] = timed(emit, lambda attn=attn: time_of(p, lambda *t: attn(*t)[0]),
                                        mask.flops(hq, d, mode), mask=name, S=S, variant=vname, config=var, mode=mode)
            cfg = BS.resolve_config(mask, d, var)
            if split and mode == "bwd" and group == 1 and not cfg["one_launch"]:
                emit(dict(kind="split", mask=name, S=S, variant=vname, config=var, **sparse_split_ms(p, mask, cfg)))
    if not smoke and vendors and DC.elapsed() <= budget:
        row["times"]["flex"] = timed(emit, lambda: time_of(p, flex_sparse_attn(p)), mask.flops(hq, d, mode),
                                     mask=name, S=S, variant="flex", mode=mode)
    row["tflops"] = {n: mask.flops(hq, d, mode) / t * 1e-9 for n, t in row["times"].items() if t != float("inf")}
    return row


def run_flashmask(emit, mname: str, S: int, hq: int, hkv: int, d: int, dtype, smoke: bool, budget: float,
                  chosen: dict, vendors: bool = True) -> dict:
    """``triton-flashmask`` (our FlashMask port) on a dense mask: each variant checked, then its
    backward timed through autograd, next to Flex's (``--flashmask-variants``)."""
    from longca_triton.kernels.flashmask.op import flashmask_attention

    p = DC.Problem(DC.bench_mask(mname, S), hq=hq, hkv=hkv, d=d, dtype=dtype)
    ref = reference_group(p.mask, p.q, p.k, p.v, p.dout, p.scale, True)
    row = dict(mask=mname, S=S, Hq=hq, Hkv=hkv, D=d, times={})
    for vname, var in chosen.items():
        if DC.elapsed() > budget:
            emit(dict(kind="flashmask_bwd", mask=mname, variant=vname, status="skipped: time"))
            continue
        attn = lambda q, k, v, var=var: flashmask_attention(q, k, v, p.mask, return_lse=True, config=var)  # noqa: E731
        if check_autograd(emit, p, ref, attn, dtype, kernel="flashmask", mask=mname, variant=vname, config=var):
            row["times"][vname] = timed(emit, lambda attn=attn: autograd_bwd_ms(p, lambda *t: attn(*t)[0]),
                                        p.bwd_flops, kernel="flashmask", mask=mname, S=S, variant=vname, config=var)
    if not smoke and vendors and DC.elapsed() <= budget:
        row["times"]["flex"] = timed(emit, lambda: DC.time_flex(p)[1], p.bwd_flops, kernel="flashmask", mask=mname,
                                     S=S, variant="flex")
    row["tflops"] = {n: p.bwd_flops / t * 1e-9 for n, t in row["times"].items() if t != float("inf")}
    return row


def sparse_table(rows: list) -> str:
    lines = ["| mask | two kernels | best one launch | Flex | ours best / Flex |", "|---|---|---|---|---|"]
    for r in rows:
        tf = r["tflops"]
        ones = {n: x for n, x in tf.items() if n.startswith("one-launch")}
        one = max(ones, key=ones.get) if ones else None
        ours = max([x for n, x in tf.items() if n != "flex"], default=0.0)
        two = f"{tf['two-kernels']:.3g}" if "two-kernels" in tf else "-"
        best_one = f"{ones[one]:.3g} ({one})" if one else "-"
        flex = f"{tf['flex']:.3g}" if "flex" in tf else "-"
        ratio = f"{ours / tf['flex']:.2f}" if "flex" in tf and ours else "-"
        lines.append(f"| {r['mask']} | {two} | {best_one} | {flex} | {ratio} |")
    by = {r["mask"]: r for r in rows if r["tflops"]}
    if "uniform128" in by and "varblock256" in by:
        best = [max(by[m]["tflops"][n] for n in by[m]["tflops"] if n != "flex") for m in ("uniform128", "varblock256")]
        lines += ["", f"variable / uniform (ours, best of each): {best[1] / best[0]:.2f} (target >= 0.8)"]
    return "\n".join(lines)


def table(rows: list) -> str:
    lines = ["| mask | two kernels | best one launch | fused_dq | best of ours | Flex | cuDNN | ours best / Flex "
             "| ours best / cuDNN |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tf = r["tflops"]
        one = r["best_one_launch"]
        mine = {n: x for n, x in tf.items() if n not in ("flex", "sdpa-cudnn")}
        best = max(mine, key=mine.get) if mine else None
        ours = mine[best] if best else 0.0
        cell = lambda n: f"{tf[n]:.0f}" if n in tf else "-"
        ratio = lambda n: f"{ours / tf[n]:.2f}" if n in tf and ours else "-"
        lines.append(f"| {r['mask']} | {cell('two-kernels')} | {cell(one) if one else '-'} ({one}) | {cell('fused_dq')} | "
                     f"{cell(best) if best else '-'} ({best}) | {cell('flex')} | {cell('sdpa-cudnn')} | {ratio('flex')} "
                     f"| {ratio('sdpa-cudnn')} |")
    return "\n".join(lines)


class Emitter:
    def __init__(self, out_dir: Path):
        self.path = out_dir / "bwd_variants.jsonl"

    def __call__(self, row: dict):
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        print(json.dumps(row, default=str), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget", type=float, default=560.0, help="wall-clock seconds for everything")
    ap.add_argument("--S", type=int, default=16384)
    ap.add_argument("--masks", default=",".join(MASKS))
    ap.add_argument("--sparse-masks", default="uniform128,varblock256",
                    help=f"block-sparse cases, of {', '.join(SPARSE_MASKS)} ('' for none)")
    ap.add_argument("--sparse-S", type=int, default=32768)
    ap.add_argument("--sparse-density", type=float, default=0.3)
    ap.add_argument("--sparse-patterns", type=int, default=0, help="block patterns (0: one per KV head; 1: one for all)")
    ap.add_argument("--sparse-fwd", action="store_true",
                    help="time the block-sparse variants' forward instead of their backward (both still checked)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated variant names (default: two kernels, fused_dq, every one launch)")
    ap.add_argument("--sparse-variants", default=None, help="comma-separated block-sparse variant names")
    ap.add_argument("--flashmask-masks", default="", help="dense masks to run triton-flashmask's variants on")
    ap.add_argument("--flashmask-variants", default="two-kernels",
                    help="comma-separated triton-flashmask variants (tiles / switches joined by '+', e.g. "
                         "dkdv64x64w4s2+sweep1)")
    ap.add_argument("--no-vendors", action="store_true", help="skip Flex and cuDNN (an A/B run of ours only)")
    ap.add_argument("--heads", default="64:8", help="query heads:KV heads of the dense and block-sparse cases")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-split", action="store_true", help="skip timing the dK/dV and dQ kernels alone (halves the run)")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, toy size, ours only")
    a = ap.parse_args(argv)
    try:
        hq, hkv = (int(x) for x in a.heads.split(":"))
    except ValueError:
        ap.error(f"--heads must be HQ:HKV (e.g. 64:8), got {a.heads!r}")
    if hq % hkv:
        ap.error(f"--heads {a.heads}: query heads must be a multiple of KV heads")
    chosen = pick(all_variants(a.smoke), a.variants) if a.variants else None
    schosen = (pick({**sparse_variants(a.smoke), **SPARSE_TILE_VARIANTS}, a.sparse_variants)
               if a.sparse_variants else None)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    emit = Emitter(out_dir)
    if a.smoke:
        DC.DEV = "cpu"
        S, hq, hkv, d, dtype = 96, 4, 2, 32, torch.float32
    else:
        S, d, dtype = a.S, a.head_dim, torch.bfloat16
        emit(dict(kind="env", package=os.path.dirname(D.__file__), **DC.env_info()))
    rows, srows = [], []
    for mname in filter(None, a.masks.split(",")):
        rows.append(run_mask(emit, mname, S, hq, hkv, d, dtype, a.smoke, a.budget, chosen, not a.no_vendors,
                             not a.no_split))
        emit(dict(kind="summary", **rows[-1]))
    for sname in filter(None, a.sparse_masks.split(",")):
        srows.append(run_sparse(emit, sname, S if a.smoke else a.sparse_S, hq, hkv, d, dtype, a.smoke, a.budget,
                                schosen, not a.no_vendors, a.sparse_density, a.sparse_patterns, not a.no_split,
                                "fwd" if a.sparse_fwd else "bwd"))
        emit(dict(kind="sparse_summary", **srows[-1]))
    for fname in filter(None, a.flashmask_masks.split(",")):
        frow = run_flashmask(emit, fname, S, hq, hkv, d, dtype, a.smoke, a.budget,
                             pick({"two-kernels": {}}, a.flashmask_variants), not a.no_vendors)
        emit(dict(kind="flashmask_summary", **frow))
    md = [f"# Backward variants of `triton` (S={S}, GQA {hq}:{hkv}, D={d}, {str(dtype)[6:]}), TFLOP/s", "",
          "Targets (issue 13): ours >= 1.1x Flex on every mask, >= 0.8x cuDNN on full and causal.", "",
          table(rows), "", f"variants: {json.dumps(chosen or variants(a.smoke))}", "",
          f"## Block-sparse backward (S={S if a.smoke else a.sparse_S}, density {a.sparse_density}, through autograd), TFLOP/s", "",
          "Targets: ours >= 1.05x Flex; variable blocks >= 0.8x uniform.", "",
          sparse_table(srows), "", f"variants: {json.dumps(schosen or sparse_variants(a.smoke))}", "",
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {DC.elapsed():.0f} s"]
    (out_dir / "bwd_variants.md").write_text("\n".join(md) + "\n")
    print("\n".join(md), flush=True)
    return rows, srows


if __name__ == "__main__":
    main()

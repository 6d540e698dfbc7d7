"""Autotuning our kernels' launch configs (the search; the cache the kernels read at run time is
:mod:`longca_triton.kernels.core.tuned`).

``longca-triton autotune --block 64`` fixes the *inner-loop tile* of every kernel to the block
size (the key tile of the forward and dQ passes, the query tile of the dK/dV pass; for the
block-sparse kernel ``triton-sparse`` the block itself, on uniform block-sparse masks of that
block) and searches the rest: outer tile, warps, pipeline stages, stacked GQA heads and the
kernels' switches (warp specialisation; for the block-sparse kernels the backward's layout, two
kernels or one launch, as a last group; the dense search space is ``kernels/dense/tune.py``). ``--varblock`` tunes ``triton-varblock`` on
variable-block masks of a mean block (256 by default), searching the inner tile too. Each group of
keys (forward, dK/dV, dQ) is tuned with the others at their defaults, because the passes are
separate kernels.

The cache is JSON, keyed by ``GPU name | Triton version`` and then by *problem class*
(kernel, head dim, dtype, GQA group, mask class, sequence bucket, block; for block-sparse masks
the mask's own block, or the power of two nearest its mean block). Entries keep the
measured TFLOP/s of the default and tuned configs, so the kernels pick the best block for a class
and ``autotune`` can print what it found. No cache means defaults: nothing here probes hardware at
import time.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from longca_triton.kernels.dense import tune as dense_tune
from longca_triton.kernels.core.tuned import (
    cache_path,
    device_key,
    load_cache,
    problem_class,
    save_cache,
    uniform_pow2,
)
from ..masks import BlockSparseMask, Mask
from .search import geomean, halving_search, planned_measurements
from .timing import time_fn

__all__ = ["Tunable", "TUNABLES", "register_tunable", "TuneCase", "tune", "cases_for", "build_cases",
           "vendor_tflops", "record_vendors", "planned_work", "group_classes", "cached_entry"]



# ---------------------------------------------------------------------------- what can be tuned
@dataclass
class Tunable:
    """A kernel family with a launch config: how to enumerate candidates and how to run one."""

    name: str  # the backend name it runs under ("triton", "triton-sparse", ...)
    #: key groups tuned one at a time, e.g. {"fwd": [...], "dkdv": [...], "dq": [...]}
    groups: dict[str, str]  # group -> mode whose timing decides it ("fwd" or "bwd")
    candidates: Callable[[str, int, int], list[dict]]  # (group, block, head_dim) -> partial configs
    run: Callable  # (q, k, v, mask, config) -> out, differentiable
    #: (head_dim, dtype, mask, group) -> full default config (group: query heads per KV head)
    default: Callable[..., dict]
    accepts: Callable[[Mask], bool] = lambda mask: True
    #: its own tuning cases ``(block, seqlens, head_dims, dtypes, heads, densities, seed)`` ->
    #: ``[TuneCase]``; None: the command's ``--masks`` (filtered by ``accepts``)
    make_cases: Callable | None = None
    #: backends its summary compares against
    vendors: tuple[str, ...] = ("sdpa-cudnn", "fa4", "flex-fa4", "flex")
    #: what ``block`` means for it: "block" (tile = block) or "mean block" (variable blocks)
    block_meaning: str = "block"
    #: ``device_reason(torch.device) -> str``: why it cannot run on that device ("" if it can)
    device_reason: Callable | None = None


TUNABLES: dict[str, Tunable] = {}


def register_tunable(t: Tunable) -> Tunable:
    TUNABLES[t.name] = t
    return t


def _pow2_choices(block: int, options=(64, 128)) -> list[int]:
    return sorted({o for o in options} | {block})


def with_qmajor(cands: list[dict]) -> list[dict]:
    """Block-sparse dK/dV candidates, each also with query-major scores (``dkdv_qmajor``) where its step keeps one
    exponential a score: at least 64 query rows a warpgroup (the head-major loop only)."""
    def fits(c):
        rows = c["DKDV_BLOCK_M"] * c.get("DKDV_HEADS", 1)
        return c.get("dkdv_sweep", 0) == 0 and rows >= 16 * c["dkdv_num_warps"]

    return cands + [dict(c, dkdv_qmajor=True) for c in cands if fits(c)]


def _one_launch_candidates(big: bool) -> list[dict]:
    """The ``bwd`` group of ``triton-sparse``, ``triton-varblock``, tuned after dkdv and
    dq (their tiles stay): two kernels first (so its keys are the group's, the ones reset to the
    default when nothing wins), then one launch of both program sets per program order (dK/dV
    first, interleaved), warps and stages."""
    off = dict(one_launch=False, bwd_order=0, bwd_num_warps=8, bwd_num_stages=2 if big else 3)
    return [off] + [dict(one_launch=True, bwd_order=o, bwd_num_warps=w, bwd_num_stages=s)
                    for o, w, s in itertools.product([0, 2], [4, 8], [2] if big else [2, 3])]


def _dense_tunable() -> Tunable:
    def run(q, k, v, mask, config):
        from longca_triton.kernels.dense.op import dense_attention

        return dense_attention(q, k, v, mask, config=config)

    def default(head_dim, dtype, mask=None, group=1):
        from longca_triton.kernels.dense.op import default_config

        return default_config(head_dim, dtype, mask, group)

    return Tunable(
        name="triton",
        groups=dict(dense_tune.GROUPS),
        candidates=dense_tune.candidates,
        run=run,
        default=default,
        accepts=lambda mask: not isinstance(mask, BlockSparseMask),
    )


register_tunable(_dense_tunable())


def _gluon_candidates(group: str, block: int, head_dim: int) -> list[dict]:
    """The Gluon kernels' knobs. Forward: key tile = the block (64 or 128), every ring depth that
    fits in shared memory, ping-pong on/off, and at head dims that split (80, 96, ...) the exact
    pieces (``split_d``) against the padded tile. Backward: the dQ kernel's key tile and ring, the
    dK/dV kernel's query tile (32 and 64 at every dim: 64 won by 15-17 % at D = 128 on the masks
    without partial tiles, gluon/run3), ring and skew; the Gluon dQ kernel with the plain-Triton
    dK/dV kernel (``bwd_design="mixed"``, the D = 128 default: session 18); and the plain-Triton
    backward under the Gluon forward (``gluon_bwd=False``: ahead on share_question in the same run;
    at head dims without a Gluon backward the only candidate). The register split stays at FA3's 240/240/24 (232/232/40
    spills at D=128, tests/test_gluon.py), 160 a consumer with three (P through shared memory,
    ``p_smem``, where the head-dim tile is 128 wide). Each forward candidate runs one tile a CTA
    and persistent (``persistent``, O staged in Q's buffers or, where it fits, its own: ``o_own``);
    on the persistent launch with O's own buffers also ``mask_head`` 0 / 1 / 2 with ``rowsum_mma`` off
    and on (the other candidates leave both to their rules)."""
    from longca_triton.kernels.core.runtime import block_head_dim
    from longca_triton.kernels.gluon.op import (
        SMEM_LIMIT,
        bwd_reason,
        bwd_smem_bytes,
        smem_bytes,
        split_d_reason,
    )

    if group == "fwd":
        bn = block if block in (64, 128) else 128
        splits = [False, True] if not split_d_reason(head_dim) else [False]
        # three consumer warpgroups (160 registers each): where the head-dim tile is 64 wide with P in
        # registers (the default there), at 128 with P through shared memory (p_smem: the default on
        # dense masks, session 14); at 128 with P in registers they spill and measured slower
        # (bwd_session13); and at 128-wide tiles three with P in registers, each P V finished before its S
        # (pv_sync: they fit 160 registers then; D = 96's dense default since session 29)
        three = {64: [(3, False, False)], 128: [(3, True, False), (3, False, True)]}.get(block_head_dim(head_dim), [])
        # the launch: one tile a CTA, or persistent with O staged in Q's buffers or in its own (o_own:
        # the default at D = 128 on the sparser masks, session 15)
        launches = [(False, False), (True, False), (True, True)]
        shapes = [dict(BLOCK_N=bn, num_stages=st, pingpong=pp, consumer_regs=240 if c == 2 else 160, split_d=sd,
                       consumers=c, p_smem=ps, persistent=pe, o_own=oo, pv_sync=pv)
                  for (c, ps, pv), sd, pp, st, (pe, oo) in itertools.product([(2, False, False)] + three, splits,
                                                                             [True, False], [2, 1, 3, 4], launches)
                  if smem_bytes(head_dim, bn, st, split_d=sd, consumers=c, p_smem=ps, o_own=oo) <= SMEM_LIMIT]
        # the partial tiles' and the softmax's knobs (session 19), on the persistent launch with O's own
        # buffers and the deepest ring beside them (the sparser masks' default shape): mask_head 0 / 1 / 2
        # (the shapes above leave it to its rule) and the row sums by the tensor cores, off and on
        # (P in registers: three consumers with P in shared memory spill with either, sm_90a)
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
        if bwd_reason(head_dim):  # no Gluon backward at this dim: the plain-Triton one runs
            return [dict(gluon_bwd=False)]
        dq = [(bn, qs) for bn, qs in itertools.product([64, 128], [2, 3])
              if bwd_smem_bytes("dq", head_dim, bn, qs) <= SMEM_LIMIT]
        return ([dict(bwd_design="mixed", dq_block_n=bn, dq_stages=qs) for bn, qs in dq]
                + [dict(bwd_design="split", dq_block_n=bn, dq_stages=qs, dkdv_block_mq=m, dkdv_stages=ks,
                        dkdv_skew=skew)
                   for (bn, qs), m, ks, skew in itertools.product(dq, [32, 64], [3, 2, 4], [False, True])
                   if bwd_smem_bytes("dkdv", head_dim, m, ks) <= SMEM_LIMIT] + [dict(gluon_bwd=False)])
    raise ValueError(f"unknown key group {group!r}")


def _gluon_tunable() -> Tunable:
    def run(q, k, v, mask, config):
        from longca_triton.kernels.gluon.op import gluon_attention

        return gluon_attention(q, k, v, mask, config=config)

    def default(head_dim, dtype, mask=None, group=1):
        # what a user gets: the defaults with their mask-dependent rules (resolve_config)
        from longca_triton.kernels.gluon.op import resolve_config

        return resolve_config(head_dim, dtype, None, mask=mask)

    def device_reason(device):
        from longca_triton.kernels.gluon.op import device_reason as why

        return why(device)

    return Tunable(name="triton-gluon", groups={"fwd": "fwd", "bwd": "bwd"}, candidates=_gluon_candidates, run=run,
                   default=default, accepts=lambda mask: not isinstance(mask, BlockSparseMask),
                   device_reason=device_reason)


register_tunable(_gluon_tunable())


def _sparse_outer(block: int, head_dim: int) -> list[int]:
    """Tiles of the side a program owns: at most the block (a row tile never spans two blocks) and
    at most 128 rows (64 for D > 128)."""
    cap = 64 if head_dim > 128 else 128
    b = 1 << (max(16, block).bit_length() - 1)  # the largest power of two <= block
    return sorted({max(16, min(b, 64)), max(16, min(b, cap))})


#: the block-sparse passes' list reading searched: entry by entry, or in register chunks of 64
_CHUNKS = (0, 64)


def _sparse_candidates(group: str, block: int, head_dim: int) -> list[dict]:
    """Uniform blocks (``triton-sparse``): the inner tile is the block itself (at most 128: larger
    blocks are walked in 128-wide sub-tiles; either way no tile needs the tail mask), or at block
    128 also its 64-wide halves; the outer tile, stacked GQA heads, warps, stages and the backward
    passes' list reading (entry by entry or chunked) are searched."""
    inner = 1 << (max(16, min(block, 128)).bit_length() - 1)
    outer = _sparse_outer(block, head_dim)
    warps, stages = [4, 8], [2, 3]
    heads = [1, 2]
    if group == "fwd":
        return [dict(BLOCK_M=m, BLOCK_N=inner, HEADS=h, num_warps=w, num_stages=s, warp_specialize=ws, list_chunk=c)
                for m, h, w, s, ws, c in itertools.product(outer, heads, warps, stages, [False, True], _CHUNKS)]
    if group == "dkdv":
        # a program owns DKDV_BLOCK_N keys and steps over DKDV_BLOCK_M query rows: the whole block, or
        # (blocks of 128) 64-row halves of it, the default's step (a 128-row step measured 1.5x slower
        # on an H100: experiments/results/h100/bwd_session12, call 1)
        # each list read entry by entry or in register chunks (``dkdv_list_chunk``: the chunked loop
        # prefetches num_stages - 1 steps ahead; bwd_session13)
        steps = sorted({min(inner, 64), inner})
        return with_qmajor([dict(DKDV_BLOCK_M=m, DKDV_BLOCK_N=n, DKDV_HEADS=h, dkdv_num_warps=w, dkdv_num_stages=s,
                                 dkdv_list_chunk=c)
                            for m, n, h, w, s, c in itertools.product(steps, outer, heads if inner <= 64 else [1],
                                                                      warps, stages, _CHUNKS)])
    if group == "dq":
        # the dQ step: the block, or (blocks of 128) 64-key halves, which three stages fit beside Q and dO
        steps = sorted({min(inner, 64), inner})
        return [dict(DQ_BLOCK_M=m, DQ_BLOCK_N=n, DQ_HEADS=h, dq_num_warps=w, dq_num_stages=s, dq_list_chunk=c)
                for m, n, h, w, s, c in itertools.product(outer, steps, heads, warps, stages, _CHUNKS)]
    if group == "bwd":
        return _one_launch_candidates(head_dim > 128)
    raise ValueError(f"unknown key group {group!r}")


def _varblock_candidates(group: str, block: int, head_dim: int) -> list[dict]:
    """Variable blocks (``triton-varblock``, ``block`` = the mean block): blocks are walked in
    sub-tiles carrying their valid length, so the inner tile is searched too (the two largest
    powers of two up to the mean block, at most 128); one head per tile; and the variable blocks'
    own options: tail row tiles, packed lists (backward passes), the dK/dV sweep."""
    b = 1 << (max(16, min(block, 128)).bit_length() - 1)
    inner = sorted({max(16, b // 2), b})
    outer = _sparse_outer(block, head_dim)
    warps, stages = [4, 8], [2, 3]
    # a block's remainder in 64-row tail tiles of its own, where the owned tile is larger (``tail_rows``)
    tails = lambda m: [0, 64] if m > 64 else [0]  # noqa: E731
    if group == "fwd":
        # the forward's list read entry by entry or in register chunks (the 64x64 default: chunks); its
        # key lists stay plain (packed, its K/V gathers lost to TMA boxes: session 16)
        return [dict(BLOCK_M=m, BLOCK_N=n, HEADS=1, num_warps=w, num_stages=s, warp_specialize=False, list_chunk=c,
                     tail_rows=t)
                for n, m, w, s, c in itertools.product(inner, outer, warps, stages, _CHUNKS) for t in tails(m)]
    if group == "dkdv":
        # packed query lists (they won at every tile measured: session 16), head-major or the row-major
        # sweep (``dkdv_sweep`` 2)
        base = [dict(DKDV_BLOCK_M=m, DKDV_BLOCK_N=n, DKDV_HEADS=1, dkdv_num_warps=w, dkdv_num_stages=s,
                     dkdv_pack_list=True, dkdv_sweep=sw, dkdv_tail_rows=t)
                for m, n, w, s, sw in itertools.product(inner, outer, warps, stages, [0, 2]) for t in tails(n)]
        # the 64-key tails beside a key-major main tile on 8 warps: query-major at 64 query rows a step on their own
        # 4 warps (``dkdv_tail_cols`` 64, the default since session 28, which the base candidates inherit), key-major
        # (0, the default before), 128 rows on 8 warps, or 128 in the main launch beside their blocks' tiles, on its
        # warps (``dkdv_tail_order`` 3); and the lists walked in one part (``dkdv_full_first`` off: the default before
        # session 29)
        tails_qm = [dict(c, **extra)
                    for c in base if c["dkdv_tail_rows"] and c["dkdv_num_warps"] == 8 and c["dkdv_sweep"] == 0
                    for extra in (dict(dkdv_tail_cols=0), dict(dkdv_tail_cols=128, dkdv_tail_warps=8),
                                  dict(dkdv_tail_cols=128, dkdv_tail_order=3), dict(dkdv_full_first=False))]
        return with_qmajor(base) + tails_qm
    if group == "dq":
        # plain key lists boxed by TMA (packed ones gather K/V: equal at 64 x 64, slower at 128 x 64); and
        # 128-row tiles of 2, 4 or 8 stacked query heads (the default is 4 x 32, ``block_sparse.VARBLOCK_DQ``: a
        # block's remainder wastes < 64, < 32 or < 16 rows; sessions 21, 26), which a call's GQA group may cap
        one_head = [dict(DQ_BLOCK_M=m, DQ_BLOCK_N=n, DQ_HEADS=1, dq_num_warps=w, dq_num_stages=s, dq_list_chunk=c,
                         dq_pack_list=False, dq_tail_rows=t)
                    for n, m, w, s, c in itertools.product(inner, outer, warps, stages, _CHUNKS) for t in tails(m)]
        stacked = [dict(DQ_BLOCK_M=128 // h, DQ_BLOCK_N=n, DQ_HEADS=h, dq_num_warps=8, dq_num_stages=s,
                        dq_list_chunk=c, dq_pack_list=False, dq_tail_rows=0)
                   for n, h, s, c in itertools.product(inner, [2, 4, 8], stages, _CHUNKS) if head_dim <= 128]
        return one_head + stacked
    if group == "bwd":
        return _one_launch_candidates(head_dim > 128)
    raise ValueError(f"unknown key group {group!r}")


def _sparse_cases(mask_name: str):
    def make(block, seqlens, head_dims, dtypes, heads, densities, seed=0) -> list[TuneCase]:
        from ..masks import make_mask

        hq, hkv = heads
        extra = dict(min_block=max(1, block // 2)) if mask_name == "varblock_sparse" else {}
        out = []
        for S, dens, D, dt in itertools.product(seqlens, densities, head_dims, dtypes):
            # one pattern per KV head (MASKS.md §2's default), as in experiments/sparse.toml
            m = make_mask(mask_name, S, seed=seed, block=block, density=float(dens), patterns=hkv, **extra)
            out.append(TuneCase(m, hq, hkv, D, dt, label=f"{mask_name} block={block} density={dens} S={S} D={D} "
                                                         f"{str(dt).replace('torch.', '')}"))
        return out

    return make


def _block_sparse_tunable(name: str) -> Tunable:
    def run(q, k, v, mask, config):
        from longca_triton.kernels.block_sparse.op import block_sparse_attention

        return block_sparse_attention(q, k, v, mask, config=config)

    def default(head_dim, dtype, mask=None, group=1):
        from longca_triton.kernels.block_sparse.op import default_config

        return default_config(mask, head_dim)

    uniform = name == "triton-sparse"
    return Tunable(
        name=name,
        groups={"fwd": "fwd", "dkdv": "bwd", "dq": "bwd", "bwd": "bwd"},
        candidates=_sparse_candidates if uniform else _varblock_candidates,
        run=run,
        default=default,
        accepts=(lambda mask: isinstance(mask, BlockSparseMask) and bool(uniform_pow2(mask))) if uniform
        else (lambda mask: isinstance(mask, BlockSparseMask)),
        make_cases=_sparse_cases("block_sparse" if uniform else "varblock_sparse"),
        vendors=("flex", "flashinfer-bsr", "flashinfer-varblock", "vsa-triton", "vsa-cuda") if uniform
        else ("flex", "flashinfer-varblock"),
        block_meaning="block" if uniform else "mean block",
    )


register_tunable(_block_sparse_tunable("triton-sparse"))
register_tunable(_block_sparse_tunable("triton-varblock"))



# ---------------------------------------------------------------------------- tuning
@dataclass
class TuneCase:
    mask: Mask
    heads_q: int = 64
    heads_kv: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    batch: int = 1
    label: str = ""
    _inputs: tuple | None = field(default=None, repr=False)

    def inputs(self, device):
        if self._inputs is None:
            g = torch.Generator(device=device).manual_seed(0)
            S = self.mask.seqlen_q
            shape_q = (self.batch, S, self.heads_q, self.head_dim)
            shape_k = (self.batch, self.mask.seqlen_k, self.heads_kv, self.head_dim)
            q = torch.randn(shape_q, device=device, dtype=self.dtype, generator=g).requires_grad_()
            k = torch.randn(shape_k, device=device, dtype=self.dtype, generator=g).requires_grad_()
            v = torch.randn(shape_k, device=device, dtype=self.dtype, generator=g).requires_grad_()
            self._inputs = (q, k, v, torch.randn(shape_q, device=device, dtype=self.dtype, generator=g))
        return self._inputs

    def flops(self, mode: str) -> float:
        return self.batch * self.mask.flops(self.heads_q, self.head_dim, mode)


def _time(fn, device, quick: bool = False) -> float:
    """Median milliseconds of ``fn`` (CUDA events via the harness; wall clock in the interpreter).
    ``quick``: the screening round's short timing (a few repetitions: ranks, not measures)."""
    if torch.device(device).type == "cuda":
        return time_fn(fn, warmup_ms=10, rep=5)["median_ms"] if quick else time_fn(fn, warmup_ms=25, rep=20)["median_ms"]
    return time_fn(fn, rep=1, flush_l2=False, device=device, warmup_calls=0)["median_ms"]  # one call, host clock


def measure(tunable: Tunable, case: TuneCase, config: dict, mode: str, device, quick: bool = False) -> float:
    """TFLOP/s of one config on one case (``mode`` fwd: forward; bwd: backward alone)."""
    q, k, v, do = case.inputs(device)
    if mode == "fwd":
        with torch.no_grad():
            ms = _time(lambda: tunable.run(q, k, v, case.mask, config), device, quick)
    else:
        out = tunable.run(q, k, v, case.mask, config)
        ms = _time(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), device, quick)
    return case.flops(mode) / (ms * 1e-3) / 1e12


def search_space(tunable: Tunable, group: str, block: int, head_dim: int, switches: bool = False) -> list[dict]:
    """The candidates searched for one key group. ``switches=False`` leaves out
    ``warp_specialize=True``: on sm_90 with Triton 3.6 it changes nothing (the pass does not apply
    to these loops), no tuned class ever chose it, and some of its configs fail to compile
    (experiments/results/h100/autotune_search/). ``--search-switches`` puts them back."""
    cands = tunable.candidates(group, block, head_dim)
    return cands if switches else [c for c in cands if not c.get("warp_specialize")]


def group_classes(tunable: Tunable, cases: list[TuneCase], block: int) -> dict[str, list[TuneCase]]:
    """The cases by problem class (what one cache entry serves)."""
    by_class: dict[str, list[TuneCase]] = {}
    for c in cases:
        cls = problem_class(tunable.name, c.head_dim, c.dtype, c.heads_q // c.heads_kv, c.mask, block)
        by_class.setdefault(cls, []).append(c)
    return by_class


def planned_work(tunable: Tunable, cases: list[TuneCase], block: int, exhaustive: bool = False,
                 switches: bool = False) -> int:
    """How many timed runs :func:`tune` makes for these cases (a progress bar's total; classes
    reused from the cache make fewer)."""
    total = 0
    for members in group_classes(tunable, cases, block).values():
        n, modes = len(members), len(set(tunable.groups.values()))
        total += 2 * modes * n  # the default before, the tuned combination after
        for group in tunable.groups:
            total += planned_measurements(len(search_space(tunable, group, block, members[0].head_dim, switches)), n,
                                          exhaustive=exhaustive)
    return total


def cached_entry(tunable: Tunable, cls: str, members: list[TuneCase], device) -> dict | None:
    """This class's cache entry when it was tuned on exactly these cases on this GPU, else None."""
    entry = load_cache().get(device_key(device), {}).get(cls)
    if entry and entry.get("cases") == [c.label for c in members] and "search" in entry:
        return entry
    return None


def tune(
    tunable: Tunable,
    cases: list[TuneCase],
    block: int,
    device="cuda",
    groups: list[str] | None = None,
    *,
    exhaustive: bool = False,
    deadline: float | None = None,
    force: bool = False,
    switches: bool = False,
    on_measure: Callable | None = None,
    write: bool = True,
) -> list[dict]:
    """Tune every problem class the cases fall in; return one summary per class.

    Each key group (forward, dK/dV, dQ) is searched by successive halving (``bench/search.py``:
    every candidate screened on the heaviest case with a short timing, the best quarter timed on
    every case; ``exhaustive=True`` times all of them on all cases), candidates scored by the
    geometric mean of TFLOP/s over the class's cases; a candidate that fails to compile or run is
    recorded and skipped. A class already in the cache, tuned on the same cases on this GPU, is
    reused as it is (``force=True`` tunes it again). ``deadline`` (``time.monotonic()``) caps the
    search: past it every group decides among what it measured. ``switches``: search the kernels'
    on/off switches too (:func:`search_space`).
    """
    groups = groups or list(tunable.groups)
    summaries = []
    path = cache_path()
    for cls, members in group_classes(tunable, cases, block).items():
        labels = [c.label for c in members]
        entry = None if force else cached_entry(tunable, cls, members, device)
        if entry is not None:
            summaries.append(dict(problem_class=cls, cases=labels, default=entry.get("default", {}),
                                  tuned=entry["config"], default_tflops=entry["default_tflops"],
                                  tuned_tflops=entry["tuned_tflops"], failures=[], reused=True,
                                  search=entry["search"], vendors=entry.get("vendors", {})))
            continue
        t0 = time.monotonic()
        head_dim, dtype = members[0].head_dim, members[0].dtype
        default = tunable.default(head_dim, dtype, members[0].mask, group=members[0].heads_q // members[0].heads_kv)
        tuned = dict(default)
        default_scores, tuned_scores, failures, measured = {}, {}, [], 0

        def note(round_, cand, case, tf, err, cls=cls):
            if on_measure:
                on_measure(cls, round_, cand, case, tf, err)

        for group in groups:
            mode = tunable.groups[group]
            if mode not in default_scores:
                default_scores[mode] = geomean([measure(tunable, c, default, mode, device) for c in members])
                measured += len(members)
                for c in members:
                    note("default", {}, c, None, "")
            res = halving_search(
                search_space(tunable, group, block, head_dim, switches), members,
                lambda cand, case, quick, mode=mode: measure(tunable, case, {**tuned, **cand}, mode, device, quick),
                weight=lambda case: case.mask.area, exhaustive=exhaustive, deadline=deadline,
                on_measure=lambda rnd, cand, case, tf, err, group=group: note(f"{group} {rnd}", cand, case, tf, err))
            measured += res.measurements
            failures += res.failures
            if res.best is not None:
                tuned.update(res.best)
                tuned_scores[mode] = res.score
        for mode in sorted(set(tunable.groups.values())):
            if mode not in tuned_scores:
                continue
            # re-measure the final combination; where it does not beat the default, keep the default
            tuned_scores[mode] = geomean([measure(tunable, c, tuned, mode, device) for c in members])
            measured += len(members)
            if tuned_scores[mode] <= default_scores[mode]:
                for group, m in tunable.groups.items():
                    if m == mode:
                        for key in tunable.candidates(group, block, head_dim)[0]:
                            tuned[key] = default[key]
                tuned_scores[mode] = default_scores[mode]
        search = dict(method="exhaustive" if exhaustive else "successive halving", measurements=measured,
                      seconds=round(time.monotonic() - t0, 1),
                      stopped_by_deadline=bool(deadline is not None and time.monotonic() > deadline))
        summaries.append(dict(problem_class=cls, cases=labels, default=default, tuned=tuned,
                              default_tflops=default_scores, tuned_tflops=tuned_scores, failures=failures,
                              reused=False, search=search, vendors={}))
        if write:  # keyed by the device: interpreter timings never serve a GPU
            data = json.loads(json.dumps(load_cache(path)))  # a private copy
            score = geomean([tuned_scores.get(m, 0.0) for m in tuned_scores]) if tuned_scores else 0.0
            data.setdefault(device_key(device), {})[cls] = dict(
                config=tuned, default=default, score=score, default_tflops=default_scores,
                tuned_tflops=tuned_scores, cases=labels, search=search,
                when=time.strftime("%Y-%m-%dT%H:%M:%S"),
            )
            save_cache(data, path)
    return summaries


def record_vendors(summary: dict, vendors: dict, device) -> None:
    """Keep a class's vendor numbers in its cache entry (a warm rerun prints them without timing)."""
    summary["vendors"] = vendors
    path = cache_path()
    data = json.loads(json.dumps(load_cache(path)))
    entry = data.get(device_key(device), {}).get(summary["problem_class"])
    if entry is not None:
        entry["vendors"] = vendors
        save_cache(data, path)


# ---------------------------------------------------------------------------- the command's work
DEFAULT_MASKS = ("full", "causal", "causal_document", "share_question", "sliding_window_causal")
DEFAULT_VENDORS = ("sdpa-cudnn", "fa4", "flex-fa4", "flex")


def build_cases(masks, seqlens, head_dims, dtypes, heads, seed=0) -> list[TuneCase]:
    from ..masks import make_mask

    hq, hkv = heads
    return [
        TuneCase(make_mask(m, S, seed=seed), hq, hkv, D, dt, label=f"{m} S={S} D={D} {str(dt).replace('torch.', '')}")
        for m, S, D, dt in itertools.product(masks, seqlens, head_dims, dtypes)
    ]


DEFAULT_DENSITIES = (0.2, 0.5, 0.8)


def cases_for(tunable: Tunable, block: int, masks, seqlens, head_dims, dtypes, heads, densities=DEFAULT_DENSITIES,
              seed=0) -> list[TuneCase]:
    """The cases ``tunable`` is tuned on: its own (block-sparse kernels: masks at ``block`` and
    each density, one pattern per KV head), or the range masks ``masks`` it accepts."""
    if tunable.make_cases is not None:
        return tunable.make_cases(block, seqlens, head_dims, dtypes, heads, densities, seed)
    return [c for c in build_cases(masks, seqlens, head_dims, dtypes, heads, seed) if tunable.accepts(c.mask)]


def vendor_tflops(cases: list[TuneCase], mode: str, vendors, device) -> dict[str, float | str]:
    """Each vendor backend on the same cases: the geometric mean of its TFLOP/s, or why not
    (``unsupported: ...`` when it cannot run one of them, ``error: ...`` when it failed)."""
    from ..adapters import Problem, get_backend

    out: dict[str, float | str] = {}
    for name in vendors:
        try:
            backend = get_backend(name)
        except ValueError as e:
            out[name] = f"unknown: {e}"
            continue
        scores = []
        for case in cases:
            q, k, v, do = case.inputs(device)
            problem = Problem(mask=case.mask, batch=case.batch, heads_q=case.heads_q, heads_kv=case.heads_kv,
                              head_dim=case.head_dim, dtype=case.dtype, mode=mode,
                              device=torch.device(device).type)
            ok, why = backend.check(problem)
            if not ok:
                out[name] = f"unsupported: {why}"
                break
            try:
                fn = backend.prepare(problem, q, k, v)
                if mode == "fwd":
                    with torch.no_grad():
                        ms = _time(fn, device)
                else:
                    res = fn()[0]
                    ms = _time(lambda: torch.autograd.grad(res, (q, k, v), do, retain_graph=True), device)
            except Exception as e:  # a vendor failing here is reported, not fatal
                out[name] = f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]}"
                break
            scores.append(case.flops(mode) / (ms * 1e-3) / 1e12)
        else:
            out[name] = geomean(scores)
    return out

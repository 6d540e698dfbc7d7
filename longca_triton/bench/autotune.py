"""What ``longca-triton autotune`` can tune: one :class:`~longca_triton.bench.autotune_run.Tunable`
per kernel, its key groups and their candidate configs (the search loop and the cache rows it
writes are :mod:`longca_triton.bench.autotune_run`; the cache the kernels read at run time is
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
"""

from __future__ import annotations

import itertools

from longca_triton.kernels.core.tuned import uniform_pow2
from ..masks import BlockSparseMask
from .autotune_run import Tunable, TuneCase

from longca_triton.kernels.block_sparse.tune import sparse_candidates, varblock_candidates
from longca_triton.kernels.dense import tune as dense_tune

__all__ = ["TUNABLES", "register_tunable"]



# ---------------------------------------------------------------------------- what can be tuned
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


def _gluon_tunable() -> Tunable:
    from longca_triton.kernels.gluon.tune import gluon_candidates, gluon_default, gluon_device_reason, gluon_run

    return Tunable(name="triton-gluon", groups={"fwd": "fwd", "bwd": "bwd"}, candidates=gluon_candidates,
                   run=gluon_run, default=gluon_default, accepts=lambda mask: not isinstance(mask, BlockSparseMask),
                   device_reason=gluon_device_reason)


register_tunable(_gluon_tunable())


def _sparse_cases(mask_name: str):
    def make(block, seqlens, head_dims, dtypes, heads, densities, seed=0) -> list[TuneCase]:
        from ..masks import make_mask

        hq, hkv = heads
        extra = dict(min_block=max(1, block // 2)) if mask_name == "varblock_sparse" else {}
        out = []
        for S, dens, D, dt in itertools.product(seqlens, densities, head_dims, dtypes):
            # one pattern per KV head (docs/masks.md §2's default), as in experiments/sparse.toml
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
        from longca_triton.kernels.block_sparse.config import default_config

        return default_config(mask, head_dim)

    uniform = name == "triton-sparse"
    return Tunable(
        name=name,
        groups={"fwd": "fwd", "dkdv": "bwd", "dq": "bwd"},
        candidates=sparse_candidates if uniform else varblock_candidates,
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



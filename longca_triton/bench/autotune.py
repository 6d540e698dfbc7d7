"""What ``longca-triton autotune`` can tune: one :class:`~longca_triton.bench.autotune_run.Tunable`
per kernel, its key groups and their candidate configs (the search loop and the cache rows it
writes are :mod:`longca_triton.bench.autotune_run`; the cache the kernels read at run time is
:mod:`longca_triton.kernels.core.tuned`).

``longca-triton autotune --block 64`` fixes the *inner-loop tile* of every kernel to the block
size (the key tile of the forward and dQ passes, the query tile of the dK/dV pass; for the
block-sparse kernel ``triton-sparse`` the block itself, on uniform block-sparse masks of that
block) and searches the rest: outer tile, warps, pipeline stages, stacked GQA heads and the kernels'
switches. Each family declares its search space in ``kernels/<family>/tune.py``. ``--varblock`` tunes ``triton-varblock`` on
variable-block masks of a mean block (256 by default), searching the inner tile too. Each group of
keys (forward, dK/dV, dQ) is tuned with the others at their defaults, because the passes are
separate kernels.
"""

from __future__ import annotations

import itertools

from longca_triton.kernels.block_sparse.tune import sparse_candidates, varblock_candidates
from longca_triton.kernels.core.tuned import uniform_pow2
from longca_triton.kernels.dense import tune as dense_tune

from ..masks import BlockSparseMask
from .autotune_run import Tunable, TuneCase

__all__ = ["TUNABLES", "register_tunable"]

# ---------------------------------------------------------------------------- what can be tuned
TUNABLES: dict[str, Tunable] = {}


def register_tunable(t: Tunable) -> Tunable:
    TUNABLES[t.name] = t
    return t


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
        table="dense",
    )


register_tunable(_dense_tunable())


def _gluon_tunable() -> Tunable:
    from longca_triton.kernels.gluon.tune import gluon_candidates, gluon_default, gluon_device_reason, gluon_run

    return Tunable(name="triton-gluon", groups={"fwd": "fwd", "bwd": "bwd"}, candidates=gluon_candidates,
                   run=gluon_run, default=gluon_default, accepts=lambda mask: not isinstance(mask, BlockSparseMask),
                   device_reason=gluon_device_reason, table="gluon")


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
        table="block_sparse",
    )


register_tunable(_block_sparse_tunable("triton-sparse"))
register_tunable(_block_sparse_tunable("triton-varblock"))



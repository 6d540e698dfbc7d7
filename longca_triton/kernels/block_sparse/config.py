"""Block-sparse launch configs: the keys, the shipped table lookup, and what each pass derives from them.

A config has a tile, warps and stages per pass (forward ``BLOCK_*``, dQ ``DQ_*``, dK/dV ``DKDV_*``) and
four switches. ``resolve_config`` is: explicit config > the user's autotune cache > the shipped table
``kernels/tuning/block_sparse.toml`` (matched on the GPU arch, the padded head dim, the mask class and
the heads a dQ tile can stack) > validation. What a pass does beyond its tile follows from the config
(:func:`pass_plans`): a pass of three or more stages reads its lists in register chunks, and
``ragged_bwd`` turns on the variable-block treatment of the backward's ragged tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from longca_triton.kernels.core import config as _config_mod
from longca_triton.kernels.core.config import ConfigSpec
from longca_triton.kernels.core.config import resolve as _resolve
from longca_triton.kernels.core.runtime import interpreting
from longca_triton.kernels.tuning import Problem, table_config

__all__ = ["CONFIG_KEYS", "PassPlan", "default_config", "mask_class", "pass_plans", "resolve_config", "stack",
           "tile_sizes"]

#: ``BLOCK_M`` query rows a forward tile, ``BLOCK_N`` keys a step; ``DQ_BLOCK_M`` positions of
#: ``DQ_HEADS`` stacked query heads a dQ tile (they must share the pattern and the KV head: the launcher
#: lowers ``DQ_HEADS`` to what the head layout allows), ``DQ_BLOCK_N`` keys a step; a dK/dV program owns
#: ``DKDV_BLOCK_N`` keys and steps over ``DKDV_BLOCK_M`` query rows. ``bwd_streams``: the dQ launches on
#: a second CUDA stream beside dK/dV's. ``dkdv_pattern_order``: a KV head's dK/dV programs heaviest first
#: by its own pattern's lists (where its GQA group shares one pattern). ``dkdv_stats_tma``: the dK/dV steps
#: of full, unpacked entries read lse / delta by one TMA box. ``ragged_bwd``: the variable-block backward
#: (:func:`pass_plans`).
CONFIG_KEYS = (
    "BLOCK_M", "BLOCK_N", "num_warps", "num_stages",
    "DQ_BLOCK_M", "DQ_BLOCK_N", "DQ_HEADS", "dq_num_warps", "dq_num_stages",
    "DKDV_BLOCK_M", "DKDV_BLOCK_N", "dkdv_num_warps", "dkdv_num_stages",
    "bwd_streams", "dkdv_pattern_order", "dkdv_stats_tma", "ragged_bwd",
)


def mask_class(mask) -> str:
    """The table's mask class: ``"block<b>"`` for uniform power-of-two blocks >= 16 (blocks above 128
    are walked as 128), else ``"variable"``."""
    ub = mask.uniform_block
    if ub is not None and ub >= 16 and ub & (ub - 1) == 0:
        return f"block{min(ub, 128)}"
    return "variable"


_SPEC = ConfigSpec("block-sparse", CONFIG_KEYS,
                   tile_keys=("BLOCK_M", "BLOCK_N", "DQ_BLOCK_M", "DQ_BLOCK_N", "DKDV_BLOCK_M", "DKDV_BLOCK_N"),
                   pack_keys=("DQ_HEADS",),
                   bool_keys=("bwd_streams", "dkdv_pattern_order", "dkdv_stats_tma", "ragged_bwd"),
                   tuned_name=lambda mask: "triton-varblock" if mask_class(mask) == "variable" else "triton-sparse")


def stack(requested: int, group_size: int, heads_per_pattern: int) -> int:
    """Heads stacked in one tile: a power of two dividing both the GQA group and the heads of a
    pattern (so stacked heads share K/V and the key list), at most ``requested``."""
    g = math.gcd(group_size, heads_per_pattern)
    s = 1
    while s * 2 <= requested and g % (s * 2) == 0:
        s *= 2
    return s


def default_config(mask, head_dim: int, heads: Optional[tuple] = None) -> dict:
    """The shipped table's config for ``mask`` at padded head dim ``head_dim``; ``heads`` = (query
    heads, KV heads) picks the dQ stack of variable blocks (unknown: a group of at least 4)."""
    group = None
    if heads is not None:
        hq, hkv = heads
        group = stack(1 << 30, hq // hkv, hq // mask.num_patterns)
    problem = Problem(arch="cpu" if interpreting() else "sm90", head_dim=int(head_dim), mask=mask_class(mask),
                      group=group)
    return table_config("block_sparse", problem, CONFIG_KEYS)


def resolve_config(mask, head_dim: int, config: Optional[dict] = None, *, q=None, k=None, v=None,
                   heads: Optional[tuple] = None) -> dict:
    """``config``, else (given ``q, k``; ``v`` when its head dim differs) the autotune cache's entry,
    overlaid on :func:`default_config`; unknown keys and bad tile sizes raise ``ValueError``. A config
    that sets the dQ row tile without ``DQ_HEADS`` gets one head a tile. ``heads`` = (query heads, KV
    heads) where the tensors are not at hand."""
    overlay = config if config is not None else _config_mod.tuned_config(_SPEC, q, k, mask, v)
    if q is not None and k is not None:
        heads = (q.shape[2], k.shape[2])
    base = default_config(mask, head_dim, heads)
    if overlay and "DQ_BLOCK_M" in overlay and "DQ_HEADS" not in overlay:
        base["DQ_HEADS"] = 1
    return _resolve(_SPEC, base, overlay or {})


def tile_sizes(cfg: dict) -> dict:
    """(rows a program owns, columns it steps over) per pass: the tables' tile sizes."""
    return {"fwd": (cfg["BLOCK_M"], cfg["BLOCK_N"]), "dq": (cfg["DQ_BLOCK_M"], cfg["DQ_BLOCK_N"]),
            "dkdv": (cfg["DKDV_BLOCK_N"], cfg["DKDV_BLOCK_M"])}


@dataclass(frozen=True)
class PassPlan:
    """What one pass (fwd, dq, dkdv) derives from a config: its tables' build options and list reading."""

    rows: int  # rows a program owns (dK/dV: keys)
    cols: int  # columns a step covers
    chunk: int  # list entries read into registers at a time (0: entry by entry)
    pack: bool  # packed lists where the blocks allow it (plan.py)
    tail_rows: int  # a block's remainder of at most this many rows runs in a launch of tiles this size (0: none)
    tail_cols: int  # the tail tiles' column step
    short_cols: int  # each list's entries of at most this many columns last, in tiles this wide (0: none)
    by_steps: bool  # programs ordered by their lists' entries alone
    full_first: bool  # each list's whole contiguous entries first, walked unmasked


def _half(tile: int) -> int:
    return tile // 2 if tile >= 32 else 0


def list_chunk(stages: int) -> int:
    """Entries of a list read into registers at a time by a pass of ``stages`` stages: with three or more,
    the loads then depend on no load of their own loop and are prefetched ``stages - 1`` steps ahead (at two
    the prefetch is one step either way and the chunk costs registers); 16 in the interpreter, whose tests
    use short lists."""
    return 0 if stages < 3 else (16 if interpreting() else 64)


def pass_plans(cfg: dict) -> dict:
    """Each pass's :class:`PassPlan`. The forward walks plain lists. Without ``ragged_bwd`` the backward
    passes read packed lists where the blocks allow it (only ragged ones change). With it (variable blocks:
    their runs' remainders cost whole tiles) the lists are read entry by entry and: dQ reads plain lists
    (K/V by TMA boxes) with each list's entries of at most half a key tile last, in half-width tiles, and
    with one head a tile a block's remainder of at most half a tile in a launch of half-size tiles; dK/dV
    reads packed lists, each list's whole contiguous entries first (unmasked steps, the stats by boxes),
    and a key block's remainder of at most half a tile in a launch of its own, run first, stepping
    ``DKDV_BLOCK_M`` query rows with query-major scores on 4 warps; both passes order their programs by
    their lists' entries, so a block's short last tile runs beside its full ones."""
    ragged = bool(cfg["ragged_bwd"])
    fwd = PassPlan(cfg["BLOCK_M"], cfg["BLOCK_N"], list_chunk(cfg["num_stages"]), False, 0, cfg["BLOCK_N"], 0,
                   False, False)
    dq = PassPlan(cfg["DQ_BLOCK_M"], cfg["DQ_BLOCK_N"], 0 if ragged else list_chunk(cfg["dq_num_stages"]),
                  not ragged, _half(cfg["DQ_BLOCK_M"]) if ragged and cfg["DQ_HEADS"] == 1 else 0, cfg["DQ_BLOCK_N"],
                  _half(cfg["DQ_BLOCK_N"]) if ragged else 0, ragged, False)
    dkdv = PassPlan(cfg["DKDV_BLOCK_N"], cfg["DKDV_BLOCK_M"], 0 if ragged else list_chunk(cfg["dkdv_num_stages"]),
                    True, _half(cfg["DKDV_BLOCK_N"]) if ragged else 0, cfg["DKDV_BLOCK_M"], 0, ragged, ragged)
    return {"fwd": fwd, "dq": dq, "dkdv": dkdv}

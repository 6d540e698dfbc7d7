"""The Gluon family's launch config: its keys, the shipped table lookup and the validation.

``resolve_config`` is: an explicit ``config`` > the user's autotune cache (``core.config.tuned_config``)
> the rows of ``kernels/tuning/gluon.toml`` (each names the results that measured it) > validation.
A row matches on the true head dims (``head_dim`` / ``head_dim_v``), the mask's density and its tile
class (``mask``: ``"whole_tiles"`` where every tile the mask touches at 64 x 128 is full, else
``"partial_tiles"``). A table row that sets one of ``ANCHOR_KEYS`` is skipped where the overlay
(explicit or cached) gives that key another value: the row's other keys were measured with it.

Keys (``CONFIG_KEYS``):

* ``BLOCK_N``: key-tile rows of the forward (64 or 128).
* ``num_stages``: depth of the forward's K/V ring; where the config does not name it, the deepest up
  to the table's that fits in shared memory beside Q (and P, O) tiles.
* ``pingpong``: the consumer warpgroups hand a token round robin so that their GEMMs alternate.
* ``split_d``: a head dim that is two powers of two (80 = 64 + 16, 96 = 64 + 32) runs as two exact
  pieces instead of one zero-padded tile (``split_d_reason``).
* ``consumers``: consumer warpgroups of the forward (``CONSUMERS``), 64 query rows each; their
  registers follow (``consumer_regs``).
* ``p_smem``: ``O += P V`` reads P from a shared buffer of each consumer instead of registers.
* ``persistent``: one CTA per SM walks the query tiles (in a boustrophedon) instead of one CTA a tile.
* ``o_own``: O is staged for its TMA store in buffers of its own, freeing Q's right after the last S.
* ``split_partial``: on a mask with partial tiles, the full tiles in the kernel compiled without the
  mask path, then the partial tiles in a second launch that merges into the first; ``"auto"``: where
  partial tiles are at most ``SPLIT_PARTIAL_SHARE`` of the visited tiles.
* ``mask_head``: each query tile's first 0, 1 or 2 partial key tiles move to the front of its walk and
  are masked without a branch (the loop compiled without the mask path); ``"auto"``:
  ``default_mask_head``.
* ``rowsum_mma``: the softmax's row sums by one more wgmma against a block of ones instead of FADDs.
* ``pv_sync``: each consumer's ``P V`` finishes before its next ``S`` (no overlap inside a warpgroup,
  so register P fits three consumers' registers).
* ``bwd_design``: ``"plain"`` (the dense family's backward on this forward's out and lse),
  ``"mixed"`` (the Gluon dQ kernel and the dense dK/dV kernel, side by side on two streams) or
  ``"split"`` (the Gluon dQ and dK/dV kernels); the Gluon kernels take ``BWD_HEAD_DIMS`` only.
* ``dkdv_block_mq``: query-tile rows of the Gluon dK/dV kernel (32 or 64).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from longca_triton.kernels.core import config as _config_mod
from longca_triton.kernels.core.config import ConfigSpec
from longca_triton.kernels.core.config import resolve as _resolve
from longca_triton.kernels.core.runtime import block_head_dim, head_dim_label
from longca_triton.kernels.gluon.fwd_parts import head_pieces, split_pieces
from longca_triton.kernels.gluon.plan import HEAD_TILES
from longca_triton.kernels.tuning import Problem, table_config

__all__ = [
    "BLOCK_M", "BWD_DESIGNS", "BWD_HEAD_DIMS", "CONFIG_KEYS", "CONSUMERS", "GPU_CHECKED_HEAD_DIMS", "MASK_HEAD",
    "SMEM_LIMIT", "bwd_reason", "bwd_smem_bytes", "bwd_tiles", "consumer_regs", "default_mask_head",
    "device_reason", "fwd_block_m", "problem_of", "regs", "resolve_config", "smem_bytes", "split_d_reason",
    "split_partial_reason",
]

#: query-tile rows per CTA of the backward kernels
BLOCK_M = 128
#: the Gluon backward's head dims (with D_v == D_qk); other dims run the dense backward
BWD_HEAD_DIMS = (64, 128)
#: (D_qk, D_v) pairs (padded to multiples of 8) whose forward and backward passed the GPU tests
#: (``tests/kernels/test_flash_matrix.py``: every multiple of 8 and five pairs with D_v != D_qk on a
#: windowed causal mask, FlashAttention's matrix at its head dims): the ``triton-gluon`` backend runs
#: Gluon on these, our plain-Triton kernels on any other pair
GPU_CHECKED_HEAD_DIMS = tuple((d, d) for d in range(8, 257, 8)) + ((192, 128), (128, 64), (64, 128), (96, 64),
                                                                    (256, 128))
#: dynamic shared memory one CTA may use on sm_90 (227 KB)
SMEM_LIMIT = 232448
#: registers per thread summed over the warpgroups (consumers + producer): FA3's 240 + 240 + 24
REG_BUDGET = 504
#: the register file of an SM, in 32-bit registers
REG_FILE = 65536
#: consumer warpgroups of the forward (``consumers``)
CONSUMERS = (2, 3)
#: ``mask_head`` values: 0, or how many of each query tile's partial key tiles its first steps mask
MASK_HEAD = (0,) + HEAD_TILES
BWD_DESIGNS = ("plain", "mixed", "split")
#: ``split_partial="auto"``: the largest share of partial tiles among the visited tiles that splits
SPLIT_PARTIAL_SHARE = 0.025
#: ``mask_head="auto"``: the largest share of query tiles with partial tiles beyond the head ones
MASK_HEAD_REST_TILES = 0.6
#: keys whose value a table row's other keys were measured with (the module docstring)
ANCHOR_KEYS = ("split_d", "consumers", "p_smem")

CONFIG_KEYS = ("BLOCK_N", "num_stages", "pingpong", "split_d", "consumers", "p_smem", "persistent", "o_own",
               "split_partial", "mask_head", "rowsum_mma", "pv_sync", "bwd_design", "dkdv_block_mq")
_SPEC = ConfigSpec("gluon-attention", CONFIG_KEYS, tile_keys=("BLOCK_N", "dkdv_block_mq"),
                   bool_keys=("pingpong", "split_d", "p_smem", "persistent", "o_own", "rowsum_mma", "pv_sync"),
                   tuned_name="triton-gluon")


def consumer_regs(consumers: int) -> int:
    """Registers per thread of each consumer warpgroup (``setmaxnreg``): 240 with two (FA3's split),
    160 with three (four warpgroups share the register file)."""
    return 160 if int(consumers) == 3 else 240


def regs(consumer_regs_: int, consumers: int = 2) -> tuple[int, int]:
    """``(producer_regs, maxnreg)``: the producer gets what the ``consumers`` warpgroups leave of
    ``REG_BUDGET``; ``maxnreg`` is the launch's even share of the register file over ``consumers + 1``
    warpgroups of 128 threads, a multiple of 8."""
    return REG_BUDGET - consumers * consumer_regs_, REG_FILE // (128 * (consumers + 1)) // 8 * 8


def bwd_tiles(head_dim: int) -> dict:
    """The Gluon backward's fixed tiles: the dQ kernel's 64-row key tiles and ring, the dK/dV kernel's
    ring (deeper at D = 64, where a stage is half the size), and at D = 128 the dQ kernel's
    ``mask_head`` plan (``op.dq_plan``); its consumers at 240 registers."""
    d128 = head_dim > 64
    return dict(dq_block_n=64, dq_stages=3 if d128 else 2, dkdv_stages=2 if d128 else 3,
                dq_mask_head=head_dim == 128, bwd_consumer_regs=240)


def fwd_block_m(cfg: dict) -> int:
    """Query rows per CTA of the forward: 64 per consumer warpgroup."""
    return 64 * int(cfg["consumers"])


def smem_bytes(head_dim: int, block_n: int, num_stages: int, elem: int = 2, *,
               head_dim_v: Optional[int] = None, split_d: bool = False, consumers: int = 2,
               p_smem: bool = False, o_own: bool = False, rowsum_mma: bool = False) -> int:
    """Shared memory of one forward CTA, an upper bound: a 64-row Q tile per consumer (padded D_qk,
    or with ``split_d`` its two exact pieces), the ring of K and V tiles, with ``p_smem`` a
    ``[64, block_n]`` P tile per consumer, with ``o_own`` a ``64 x D_v`` O tile per consumer, with
    ``rowsum_mma`` the block of ones, and 1 KB for the mbarriers and alignment."""
    dv = head_dim if head_dim_v is None else head_dim_v
    dqk = sum(head_pieces(head_dim, block_head_dim(head_dim), split_d))
    dv = sum(head_pieces(dv, block_head_dim(dv), split_d))
    q = 64 * consumers * dqk * elem
    ring = num_stages * block_n * (dqk + dv) * elem
    p = 64 * consumers * block_n * elem if p_smem else 0
    o = 64 * consumers * dv * elem if o_own else 0
    ones = block_n * 8 * elem if rowsum_mma else 0
    return q + ring + p + o + ones + 1024


def bwd_smem_bytes(kind: str, head_dim: int, tile: int, num_stages: int, elem: int = 2) -> int:
    """Shared memory of a backward CTA (upper bound, 1 KB for barriers): ``"dq"`` holds Q and dO
    (128 rows each) and a ring of K, V tiles of ``tile`` rows; ``"dkdv"`` holds K and V (128 rows)
    and a ring of Q, dO tiles of ``tile`` rows."""
    if kind not in ("dq", "dkdv"):
        raise ValueError(f"kind must be 'dq' or 'dkdv', got {kind!r}")
    return (2 * BLOCK_M * head_dim + num_stages * 2 * tile * head_dim) * elem + 1024


def default_mask_head(partial_per_tile, consumers: int) -> int:
    """``mask_head="auto"`` on a mask whose query tiles have ``partial_per_tile`` partial key tiles
    each: 1 where no query tile has more than one, else 2 with two consumers (three spill there) and
    1 with three, where at most ``MASK_HEAD_REST_TILES`` of the query tiles keep partial tiles beyond
    those for the split launch's second half; 0 without partial tiles or where more do."""
    per_tile = np.asarray(partial_per_tile)
    if not per_tile.any():
        return 0
    k = 1 if per_tile.max() <= 1 or consumers != 2 else 2
    return k if int((per_tile > k).sum()) <= MASK_HEAD_REST_TILES * len(per_tile) else 0


def split_partial_reason(cfg: dict, head_dim: int, head_dim_v: Optional[int] = None) -> str:
    """Why the split launch (``split_partial``, ``mask_head``) cannot take ``cfg`` at these head dims
    (empty when it can): its second launch merges O as one head-dim piece."""
    dv = head_dim if head_dim_v is None else head_dim_v
    if head_pieces(dv, block_head_dim(dv), bool(cfg["split_d"]))[1]:
        return f"its merge takes O as one head-dim piece: D_v={dv} with split_d=True is two; use split_d=False"
    return ""


def bwd_reason(head_dim: int, head_dim_v: Optional[int] = None) -> str:
    """Why the Gluon backward kernels cannot take these head dims (empty when they can)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    if head_dim in BWD_HEAD_DIMS and dv == head_dim:
        return ""
    return (f"the Gluon backward takes head dims {BWD_HEAD_DIMS} with D_v == D_qk, not "
            f"{head_dim_label(head_dim, dv)}; the dense backward runs instead (bwd_design='plain')")


def split_d_reason(head_dim: int, head_dim_v: Optional[int] = None) -> str:
    """Why ``split_d`` cannot take these head dims (empty when it can): at least one of D_qk, D_v is
    not a power of two, and each such dim is two powers of two ``D0 > D1 >= 16`` (``split_pieces``)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    odd = [d for d in dict.fromkeys((head_dim, dv)) if d & (d - 1)]
    label = head_dim_label(head_dim, dv)
    if not odd:
        return f"head dims {label} are powers of two: nothing to split (split_d is for 80, 96, ...)"
    bad = [d for d in odd if split_pieces(d) is None]
    if bad:
        return (f"head dim {bad[0]} (of {label}) is not two powers of two D0 > D1 >= 16 (wgmma's k16 step): "
                f"split_d takes 48, 80, 96, 144, 160, 192; use split_d=False (a zero-padded tile)")
    return ""


def device_reason(device) -> str:
    """Why the Gluon kernels cannot run on ``device`` (empty when they can): sm_90 (Hopper) only."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return (f"the Gluon kernel needs an sm_90 (Hopper) GPU; device is {dev.type} "
                "(Triton's CPU interpreter cannot run Gluon)")
    cap = torch.cuda.get_device_capability(dev)
    if cap != (9, 0):
        return f"the Gluon kernel is written for sm_90 (Hopper: wgmma, setmaxnreg); this GPU is sm_{cap[0]}{cap[1]}"
    return ""


def _has_tiles(mask) -> bool:
    return mask is not None and hasattr(mask, "block_tables")


def problem_of(head_dim: int, head_dim_v: int, mask) -> Problem:
    """What the table's rows match: the true head dims, the mask's density and tile class."""
    cls = None
    if _has_tiles(mask):
        cls = "whole_tiles" if mask.block_tables(64, 128).num_partial == 0 else "partial_tiles"
    density = getattr(mask, "density", None) if mask is not None else None
    return Problem(arch="sm90", head_dim=int(head_dim), head_dim_v=int(head_dim_v), mask=cls,
                   density=None if density is None else float(density))


def _table(problem: Problem, overlay: dict) -> dict:
    """The table's config for ``problem``: defaults, then every matching row in file order, skipping
    a row whose ``ANCHOR_KEYS`` the overlay sets otherwise."""
    from longca_triton.kernels.tuning import load_table

    table = load_table("gluon", CONFIG_KEYS)
    cfg = dict(table.defaults)
    for row in table.matching(problem):
        if any(key in overlay and overlay[key] != row.config[key] for key in ANCHOR_KEYS if key in row.config):
            continue
        cfg.update(row.config)
    return cfg


def _fit_stages(cfg: dict, head_dim: int, dv: int, upto: int) -> int:
    """The deepest ring up to ``upto`` that fits in shared memory with ``cfg``'s tiles (1 if none)."""
    return next((st for st in range(upto, 0, -1)
                 if smem_bytes(head_dim, cfg["BLOCK_N"], st, head_dim_v=dv, split_d=cfg["split_d"],
                               consumers=int(cfg["consumers"]), p_smem=cfg["p_smem"], o_own=cfg["o_own"],
                               rowsum_mma=cfg["rowsum_mma"]) <= SMEM_LIMIT), 1)


def _mask_head_value(value) -> int:
    """``mask_head`` as an int in ``MASK_HEAD``."""
    if isinstance(value, bool) or value not in MASK_HEAD:
        raise ValueError(f"config['mask_head'] must be one of {MASK_HEAD} (how many of each query tile's partial "
                         f"key tiles its first steps mask without a branch) or 'auto', got {value!r}")
    return int(value)


def resolve_config(head_dim: int, dtype: torch.dtype, config: Optional[dict] = None, *, q=None,
                   k=None, mask=None, v=None, head_dim_v: Optional[int] = None) -> dict:
    """``config`` (else the autotune cache's ``triton-gluon`` entry) over the shipped table's config
    for these head dims and ``mask``, validated. ``head_dim`` is D_qk, ``head_dim_v`` D_v (else
    ``v``'s, else D_qk). Where the Gluon backward cannot take the dims (``bwd_reason``) ``bwd_design``
    becomes ``"plain"``, silently unless an explicit ``config`` asks for a Gluon design; ``split_d``
    likewise (``split_d_reason``). A config that sets ``dkdv_block_mq`` but no ``bwd_design`` asks for
    ``"split"``."""
    if head_dim_v is None:
        head_dim_v = head_dim if v is None else int(v.shape[-1])
    dv = head_dim_v
    # the explicit config, else the autotune cache's entry (``config`` stays the explicit one: the
    # checks below raise for what a user asked for and quietly fix what the cache holds)
    overlay = config if config is not None else _config_mod.tuned_config(_SPEC, q, k, mask,
                                                                          v if dv != head_dim else None)
    named = dict(overlay or {})
    base = _table(problem_of(head_dim, dv, mask), named)
    no_bwd = bwd_reason(head_dim, dv)
    if "dkdv_block_mq" in named and "bwd_design" not in named:
        base["bwd_design"] = "split"
    cfg = _resolve(_SPEC, base, named)
    if cfg["bwd_design"] not in BWD_DESIGNS:
        raise ValueError(f"config['bwd_design'] must be one of {BWD_DESIGNS}, got {cfg['bwd_design']!r}")
    if no_bwd and cfg["bwd_design"] != "plain":
        if config is not None and config.get("bwd_design", "plain") != "plain":
            raise ValueError(f"config['bwd_design']={config['bwd_design']!r}: {no_bwd}")
        cfg["bwd_design"] = "plain"
    if cfg["split_d"]:
        no_split = split_d_reason(head_dim, dv)
        if no_split:
            if config is not None and config.get("split_d"):
                raise ValueError(f"config['split_d']=True: {no_split}")
            cfg["split_d"] = False
    if cfg["BLOCK_N"] not in (64, 128):
        raise ValueError(f"config['BLOCK_N'] must be 64 or 128 for the Gluon forward, got {cfg['BLOCK_N']}")
    if isinstance(cfg["consumers"], bool) or cfg["consumers"] not in CONSUMERS:
        raise ValueError(f"config['consumers'] must be one of {CONSUMERS} (consumer warpgroups of the forward), "
                         f"got {cfg['consumers']!r}")
    cfg["consumers"] = consumers = int(cfg["consumers"])
    if cfg["split_partial"] == "auto":
        cfg["split_partial"] = False
        if _has_tiles(mask):
            bt = mask.block_tables(fwd_block_m(cfg), int(cfg["BLOCK_N"]))
            cfg["split_partial"] = bool(bt.num_partial) and bt.num_partial <= SPLIT_PARTIAL_SHARE * (
                bt.num_full + bt.num_partial)
    cfg["split_partial"] = bool(cfg["split_partial"])
    if cfg["mask_head"] == "auto":
        # a config that names the split launch gets the split launch; split head-dim tiles cannot merge
        cfg["mask_head"] = 0
        if "split_partial" not in named and not split_partial_reason(cfg, head_dim, dv) and _has_tiles(mask):
            bt = mask.block_tables(fwd_block_m(cfg), int(cfg["BLOCK_N"]))
            cfg["mask_head"] = default_mask_head(np.diff(np.asarray(bt.q_part_ptr)), consumers)
    cfg["mask_head"] = _mask_head_value(cfg["mask_head"])
    if (cfg["split_partial"] or cfg["mask_head"]) and split_partial_reason(cfg, head_dim, dv):
        key = "mask_head" if cfg["mask_head"] else "split_partial"
        raise ValueError(f"config[{key!r}]={cfg[key]!r}: {split_partial_reason(cfg, head_dim, dv)}")
    if (cfg["o_own"] and "o_own" not in named and "num_stages" in named
            and smem_bytes(head_dim, cfg["BLOCK_N"], int(cfg["num_stages"]), head_dim_v=dv, split_d=cfg["split_d"],
                           consumers=consumers, p_smem=cfg["p_smem"], o_own=True) > SMEM_LIMIT):
        # a ring the config asked for that leaves no room for O's buffers: O is staged in Q's
        cfg["o_own"] = False
    if "num_stages" not in named:
        cfg["num_stages"] = _fit_stages(cfg, head_dim, dv, int(cfg["num_stages"]))
    stages = cfg["num_stages"] = int(cfg["num_stages"])
    need = smem_bytes(head_dim, cfg["BLOCK_N"], max(stages, 1), head_dim_v=dv, split_d=cfg["split_d"],
                      consumers=consumers, p_smem=cfg["p_smem"], o_own=cfg["o_own"], rowsum_mma=cfg["rowsum_mma"])
    if stages < 1 or need > SMEM_LIMIT:
        raise ValueError(f"config['num_stages']={cfg['num_stages']} does not fit: the ring needs "
                         f"{need} B of shared memory at D={head_dim_label(head_dim, dv)}, "
                         f"BLOCK_N={cfg['BLOCK_N']} (limit {SMEM_LIMIT} B); use >= 1 stage and fewer than that")
    if cfg["dkdv_block_mq"] not in (32, 64):
        raise ValueError(f"config['dkdv_block_mq'] must be 32 or 64; got {cfg['dkdv_block_mq']}")
    return cfg

"""One ``resolve_config`` for the three kernels: explicit config, else the autotune cache, else the
kernel's defaults; one validation with one clear error.

Each kernel describes its config by a :class:`ConfigSpec` (its keys and which are tile sizes,
head-pack counts or booleans) and keeps its own ``resolve_config`` as a thin wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

__all__ = ["BWD_ORDERS", "ConfigSpec", "check_bwd_layout", "resolve", "tuned_config", "with_one_launch_defaults"]

#: ``bwd_order`` values of a one-launch backward (``one_launch=True``: dK/dV and dQ program sets in
#: one grid; dense, FlashMask and block-sparse configs carry the same four keys ``one_launch``,
#: ``bwd_order``, ``bwd_num_warps``, ``bwd_num_stages``)
BWD_ORDERS = {0: "dK/dV set first", 1: "dQ set first", 2: "interleaved"}


@dataclass(frozen=True)
class ConfigSpec:
    """What a kernel's config dict may hold.

    ``tuned_name``: the kernel's name in the autotune cache (``kernels.tuned``), or a function of
    the mask giving it, or None (never tuned). ``tile_keys`` must be powers of two >= 16,
    ``pack_keys`` powers of two >= 1; ``bool_keys`` are turned into bools.
    """

    what: str
    keys: tuple
    tile_keys: tuple
    pack_keys: tuple = ()
    bool_keys: tuple = ()
    tuned_name: Union[str, Callable, None] = None


@torch.compiler.disable
def tuned_config(spec: ConfigSpec, q, k, mask, v=None) -> Optional[dict]:
    """The autotune cache's config for this call (read once per process), or None.

    Outside any compiled graph: the lookup reads a file and asks the GPU's name once.
    """
    if spec.tuned_name is None or q is None or k is None or mask is None:
        return None
    name = spec.tuned_name(mask) if callable(spec.tuned_name) else spec.tuned_name
    from longca_triton.kernels.core.tuned import lookup

    return lookup(name, q, k, mask, v=v)


def resolve(spec: ConfigSpec, defaults: dict, config: Optional[dict] = None, *, q=None, k=None,
            mask=None, v=None) -> dict:
    """``defaults`` overlaid with ``config``; with ``config=None``, with the autotune cache's entry
    for ``(q, k, mask)`` when there is one (``tuned_config``). An explicit config always wins.

    Unknown keys and bad tile / pack sizes raise ``ValueError`` naming the key and the valid ones.
    """
    if config is None:
        config = tuned_config(spec, q, k, mask, v)
    cfg = dict(defaults)
    if config:
        unknown = set(config) - set(spec.keys)
        if unknown:
            raise ValueError(f"unknown {spec.what} config keys {sorted(unknown)}; "
                             f"known: {list(spec.keys)}")
        cfg.update(config)
    for key in spec.tile_keys:
        val = int(cfg[key])
        if val < 16 or val & (val - 1):
            raise ValueError(f"config[{key!r}] must be a power of two >= 16, got {cfg[key]} "
                             f"({spec.what} tile keys: {list(spec.tile_keys)})")
        cfg[key] = val
    for key in spec.pack_keys:
        val = int(cfg[key])
        if val < 1 or val & (val - 1):
            raise ValueError(f"config[{key!r}] must be a power of two >= 1, got {cfg[key]}")
        cfg[key] = val
    for key in spec.bool_keys:
        cfg[key] = bool(cfg[key])
    return cfg


def with_one_launch_defaults(cfg: dict) -> dict:
    """``cfg`` plus the one-launch keys, off (and ``bwd_streams``, off unless ``cfg`` sets it):
    ``bwd_num_warps`` the larger of the two kernels' warps
    (the one that fits the bigger tile), ``bwd_num_stages`` the smaller of their stages (the shared
    memory of both bodies must fit one budget)."""
    return {"bwd_streams": False, **cfg, "one_launch": False, "bwd_order": 0,
            "bwd_num_warps": max(cfg["dkdv_num_warps"], cfg["dq_num_warps"]),
            "bwd_num_stages": min(cfg["dkdv_num_stages"], cfg["dq_num_stages"])}


def check_bwd_layout(cfg: dict, what: str) -> dict:
    """Validate the one-launch keys of a resolved config: ``bwd_order`` in ``BWD_ORDERS``, and not
    ``one_launch`` together with ``fused_dq`` (two different backward layouts)."""
    cfg["bwd_order"] = int(cfg["bwd_order"])
    if cfg["bwd_order"] not in BWD_ORDERS:
        raise ValueError(f"{what}: config['bwd_order'] must be one of {BWD_ORDERS}, got {cfg['bwd_order']}")
    if cfg["one_launch"] and cfg.get("fused_dq", False):
        raise ValueError(f"{what}: config asks for both one_launch (dK/dV and dQ program sets in one launch) and "
                         "fused_dq (dQ by fp32 atomics from the dK/dV kernel); pick one")
    return cfg


#: ``dkdv_sweep`` values of the dense and block-sparse backward: 0 head-major (each query head of a
#: GQA group sweeps its query tiles in turn), 1 row-major (per query tile every head of the group),
#: 2 row-major with query tiles descending (``kernels/dense_bwd._dkdv_program`` says why)
DKDV_SWEEPS = (0, 1, 2)


def check_dkdv_sweep(cfg: dict, what: str) -> dict:
    """``dkdv_sweep`` an int of ``DKDV_SWEEPS`` (0 where a config predates the key), and not a
    row-major sweep with ``fused_dq`` (whose dQ reduce-add runs per head in the head-major loop)."""
    sweep = cfg.get("dkdv_sweep", 0)
    if isinstance(sweep, bool) or not isinstance(sweep, (int, float)) or sweep not in DKDV_SWEEPS:
        raise ValueError(f"{what}: config['dkdv_sweep'] must be one of {DKDV_SWEEPS} (0 head-major, 1 row-major, "
                         f"2 row-major descending), got {sweep!r}")
    cfg["dkdv_sweep"] = int(sweep)
    if cfg["dkdv_sweep"] and cfg.get("fused_dq", False):
        raise ValueError(f"{what}: config dkdv_sweep={cfg['dkdv_sweep']} (row-major dK/dV) cannot be combined with "
                         "fused_dq=True (its dQ reduce-add is the head-major loop's); pick one")
    return cfg

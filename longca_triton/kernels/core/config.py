"""One ``resolve_config`` for the three kernels: explicit config, else the autotune cache, else the
kernel's defaults; one validation with one clear error.

Each kernel describes its config by a :class:`ConfigSpec` (its keys and which are tile sizes,
head-pack counts or booleans) and keeps its own ``resolve_config`` as a thin wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from longca_triton.kernels.core.runtime import compile_disabled

__all__ = ["DKDV_SWEEPS", "ConfigSpec", "check_dkdv_sweep", "resolve", "tuned_config"]


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


@compile_disabled
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


#: ``dkdv_sweep`` values of the dense and FlashMask backward: 0 head-major (each query head of a GQA
#: group sweeps its query tiles in turn), 1 row-major (per query tile every head of the group), 2
#: row-major with query tiles descending (``kernels/dense/bwd.py`` says why)
DKDV_SWEEPS = (0, 1, 2)


def check_dkdv_sweep(cfg: dict, what: str) -> dict:
    """``dkdv_sweep`` an int of ``DKDV_SWEEPS`` (0 where a config predates the key)."""
    sweep = cfg.get("dkdv_sweep", 0)
    if isinstance(sweep, bool) or not isinstance(sweep, (int, float)) or sweep not in DKDV_SWEEPS:
        raise ValueError(f"{what}: config['dkdv_sweep'] must be one of {DKDV_SWEEPS} (0 head-major, 1 row-major, "
                         f"2 row-major descending), got {sweep!r}")
    cfg["dkdv_sweep"] = int(sweep)
    return cfg

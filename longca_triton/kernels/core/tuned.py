"""The autotune cache as the kernels read it: path, keys, problem classes, lookup.

``longca-triton autotune`` (``longca_triton.bench.autotune``, the search) writes the cache; the kernels'
``resolve_config`` reads it through :func:`lookup`. The file is read once per process (and again
only after :func:`reload`, which the tuner calls after writing), so a launch never stats the file.
No hardware is probed at import; :func:`device_key` asks the GPU's name once per device.

The cache is JSON keyed by ``GPU name | Triton version`` and then by *problem class*
(kernel, head dim, dtype, GQA group, mask class, sequence bucket, block). The head dim reads
``D=128``, or ``D=192/128`` when v's head dim differs from q's and k's (``D_qk/D_v``): any int, so
80 or 96 have classes of their own.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from longca_triton.masks import BlockSparseMask, Mask

__all__ = [
    "CACHE_ENV", "SEQ_BUCKETS", "cache_path", "device_key", "mask_class", "seq_bucket", "sparse_block",
    "problem_class", "load_cache", "save_cache", "reload", "lookup", "best_entry", "uniform_pow2",
    "measured_tflops",
]

CACHE_ENV = "LONGCA_TRITON_AUTOTUNE_CACHE"


def cache_path() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "longca-triton" / "autotune.json"


def device_key(device: torch.device | str) -> str:
    """``GPU name|triton-<version>`` (asked once per device and process)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _device_key(str(device))


@functools.lru_cache(maxsize=None)
def _device_key(device: str) -> str:
    import triton

    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu-interpreter"
    return f"{name}|triton-{triton.__version__}"


def uniform_pow2(mask: BlockSparseMask) -> int | None:
    """The uniform block when it is a power of two >= 16 (what triton-sparse takes), else None."""
    ub = mask.uniform_block
    return int(ub) if ub and ub >= 16 and ub & (ub - 1) == 0 else None


def mask_class(mask: Mask) -> str:
    if isinstance(mask, BlockSparseMask):
        return "uniform-sparse" if uniform_pow2(mask) else "varblock-sparse"
    return "full" if mask.area == mask.seqlen_q * mask.seqlen_k else "masked"


def uneven_key_work(mask: Mask, block_n: int = 64, tol: float = 0.25) -> float:
    """The share of a range mask's non-empty key tiles (``block_n`` keys) whose attended area differs
    from the median tile's by more than ``tol`` of it: 0 for full and sliding windows (every dK/dV
    program sweeps as many query rows), 0.75 for causal, 0.9 for the document masks; from the
    mask's (cached) ``key_tile_areas``. 0.0 for block-sparse masks (their tiles are the blocks)."""
    if isinstance(mask, BlockSparseMask):
        return 0.0
    work = mask.key_tile_areas(block_n)
    work = work[work > 0]
    if work.size == 0:
        return 0.0
    med = float(np.median(work))
    return float(np.mean(np.abs(work - med) > tol * med))


SEQ_BUCKETS = ("S<=4K", "S<=16K", "S<=64K", "S>64K")


def seq_bucket(seqlen: int) -> str:
    for limit in (4096, 16384, 65536):
        if seqlen <= limit:
            return f"S<={limit // 1024}K"
    return "S>64K"


def sparse_block(mask: Mask) -> int | None:
    """The block a block-sparse mask is tuned under: its uniform block, or for variable blocks the
    power of two nearest (in log scale) to its mean query block. None for range masks."""
    if not isinstance(mask, BlockSparseMask):
        return None
    if uniform_pow2(mask):
        return uniform_pow2(mask)
    mean = mask.seqlen_q / max(1, len(mask.q_block_bounds) - 1)
    return 1 << max(0, round(math.log2(max(mean, 1.0))))


def problem_class(kernel: str, head_dim: int, dtype: torch.dtype, group: int, mask: Mask, block: int,
                  head_dim_v: int | None = None) -> str:
    """``kernel|D|dtype|G|mask class|S bucket|block``. For block-sparse masks ``block`` is the
    mask's own (``sparse_block``): a config is only ever looked up for the block it was tuned at.
    ``D`` is ``head_dim``, or ``head_dim/head_dim_v`` when the value head dim differs."""
    from longca_triton.kernels.core.runtime import head_dim_label

    dt = str(dtype).replace("torch.", "")
    block = sparse_block(mask) or block
    d = head_dim_label(head_dim, head_dim_v)
    return f"{kernel}|D={d}|{dt}|G={group}|{mask_class(mask)}|{seq_bucket(mask.seqlen_q)}|block={block}"


_LOADED: dict[str, dict] = {}


def load_cache(path: Path | None = None) -> dict:
    """The cache's contents (``{}`` when missing or unreadable), read once per process and path."""
    key = str(path or cache_path())
    if key not in _LOADED:
        try:
            _LOADED[key] = json.loads(Path(key).read_text())
        except (OSError, json.JSONDecodeError):
            _LOADED[key] = {}
    return _LOADED[key]


def reload(path: Path | None = None) -> None:
    """Forget what was read (the tuner calls this after writing; tests after pointing elsewhere)."""
    if path is None:
        _LOADED.clear()
    else:
        _LOADED.pop(str(path), None)


def save_cache(data: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    reload(path)


def lookup(kernel: str, q: torch.Tensor, k: torch.Tensor, mask: Mask, v: torch.Tensor | None = None) -> dict | None:
    """The tuned config for this call's problem class, or None (use the kernel's defaults).

    Range masks: the best over the tuned blocks. Block-sparse masks: the entry tuned at the mask's
    own block only (``sparse_block``), at its sequence bucket or else the nearest tuned one."""
    if q.device.type != "cuda":
        return None
    data = load_cache()
    if not data:
        return None
    d_v = None if v is None else v.shape[-1]
    return best_entry(data.get(device_key(q.device), {}), kernel, q.shape[-1], q.dtype, q.shape[2] // k.shape[2], mask,
                      head_dim_v=d_v)


def best_entry(entries: dict, kernel: str, head_dim: int, dtype: torch.dtype, group: int, mask: Mask,
               head_dim_v: int | None = None) -> dict | None:
    """``lookup``'s choice among one device's cache entries (a copy of the config, or None)."""
    entry = _chosen_entry(entries, kernel, head_dim, dtype, group, mask, head_dim_v)
    return dict(entry["config"]) if entry else None


def _chosen_entry(entries: dict, kernel: str, head_dim: int, dtype: torch.dtype, group: int, mask: Mask,
                  head_dim_v: int | None = None) -> dict | None:
    """The cache entry whose config ``lookup`` returns (the entry itself, or None)."""
    cls = problem_class(kernel, head_dim, dtype, group, mask, 0, head_dim_v)
    if isinstance(mask, BlockSparseMask):
        entry = entries.get(cls)
        if entry is None:
            # no entry at this sequence bucket: the one tuned at the nearest bucket (the longer on a
            # tie). Block-sparse tiles see the same block structure at every S, and the sparse study
            # (32K-128K) is too slow to tune at full length.
            head, bucket, tail = cls.split("|")[:5], cls.split("|")[5], cls.split("|")[6:]
            target = SEQ_BUCKETS.index(bucket)
            near = [(abs(i - target), -i, b) for i, b in enumerate(SEQ_BUCKETS)
                    if "|".join(head + [b] + tail) in entries]
            if near:
                entry = entries["|".join(head + [min(near)[2]] + tail)]
        return entry
    prefix = cls.rsplit("|block=", 1)[0]
    best = None
    for c, entry in entries.items():
        if c.startswith(prefix + "|block=") and (best is None or entry["score"] > best["score"]):
            best = entry
    return best


def measured_tflops(kernel: str, q: torch.Tensor, k: torch.Tensor, mask: Mask, v: torch.Tensor | None = None,
                    mode: str = "fwd") -> float | None:
    """The TFLOP/s the cache recorded in ``mode`` for the config ``lookup`` would give ``kernel``
    on this call, or None when it was never tuned here."""
    if q.device.type != "cuda":
        return None
    entries = load_cache().get(device_key(q.device), {})
    d_v = None if v is None else v.shape[-1]
    entry = _chosen_entry(entries, kernel, q.shape[-1], q.dtype, q.shape[2] // k.shape[2], mask, d_v)
    tf = (entry or {}).get("tuned_tflops", {}).get(mode)
    return float(tf) if isinstance(tf, (int, float)) and tf > 0 else None

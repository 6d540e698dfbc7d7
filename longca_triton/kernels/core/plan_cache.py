"""One small LRU cache for the kernels' mask metadata (dense tile plans, block-sparse tables,
FlashMask column plans), keyed by mask identity, tile sizes (or any extra key) and device."""

from __future__ import annotations

import collections
import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

__all__ = ["PlanCache", "canonical_device", "mask_memo"]


def canonical_device(device) -> torch.device:
    """``device`` with an explicit CUDA index (``cuda`` -> ``cuda:<current>``)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def mask_memo(mask, key: tuple, build: Callable[[], T]) -> T:
    """``build()`` once per ``key`` for this (immutable) mask, kept on the mask: what a call resolves
    from the mask and its shapes alone (launch configs, the default backend) costs a dict lookup on
    the next call. ``key`` must hold everything else the value depends on."""
    memo = mask.__dict__.setdefault("_call_memo", {})
    if key not in memo:
        memo[key] = build()
    return memo[key]


class PlanCache:
    """LRU of ``size`` entries ``(id(mask), *key, device) -> value``, thread-safe.

    An entry holds the mask object itself, so its ``id`` cannot be reused while the entry lives.
    The build runs outside the lock (it may be slow); two threads may build the same entry once each.
    """

    def __init__(self, size: int = 64):
        self.size = size
        self._entries: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, mask, key: tuple, device, build: Callable[[torch.device], T]) -> T:
        dev = canonical_device(device)
        full = (id(mask), *key, str(dev))
        with self._lock:
            hit = self._entries.get(full)
            if hit is not None and hit[0] is mask:
                self._entries.move_to_end(full)
                return hit[1]
        value = build(dev)
        with self._lock:
            self._entries[full] = (mask, value)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

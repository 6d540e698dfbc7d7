"""One small LRU cache for the kernels' mask metadata (dense tile plans, block-sparse tables,
FlashMask column plans), keyed by mask content (else identity), tile sizes (or any extra key) and device.

A mask with a ``content_key()`` (``RangeMask``: its sizes and slices) is keyed by that: a mask built
again with the same content, as a training loop does for each batch of the same documents, finds the
plans and configs of the first."""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

__all__ = ["PlanCache", "canonical_device", "content_key", "mask_memo"]


class _ContentKey:
    """A mask's ``content_key()`` with its hash computed once (a long slice tuple is not rehashed per lookup);
    one instance per content (``content_key``), so lookups match it by identity, not by comparing slices."""

    __slots__ = ("value", "_hash", "__weakref__")

    def __init__(self, value):
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, _ContentKey) and self._hash == other._hash and self.value == other.value


#: the one key of each content some mask or cache entry still holds
_KEYS: "weakref.WeakValueDictionary[_ContentKey, _ContentKey]" = weakref.WeakValueDictionary()


def content_key(mask):
    """The cache key of ``mask``'s content (memoised on the mask), or None for a mask without
    ``content_key()``: its entries are then keyed by its identity."""
    fn = getattr(mask, "content_key", None)
    if fn is None:
        return None
    key = mask.__dict__.get("_content_key")
    if key is None:
        new = _ContentKey(fn())
        key = mask.__dict__["_content_key"] = _KEYS.setdefault(new, new)
    return key


def canonical_device(device) -> torch.device:
    """``device`` with an explicit CUDA index (``cuda`` -> ``cuda:<current>``)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


#: the memos of the last masks by content (``mask_memo``): content key -> memo dict
_MEMOS: "collections.OrderedDict[_ContentKey, dict]" = collections.OrderedDict()
_MEMOS_SIZE = 256
_MEMOS_LOCK = threading.Lock()


def mask_memo(mask, key: tuple, build: Callable[[], T]) -> T:
    """``build()`` once per ``key`` for this (immutable) mask, kept on the mask: what a call resolves
    from the mask and its shapes alone (launch configs, the default backend) costs a dict lookup on
    the next call. ``key`` must hold everything else the value depends on. Masks of equal
    ``content_key`` share one memo (the last ``_MEMOS_SIZE`` contents)."""
    memo = mask.__dict__.get("_call_memo")
    if memo is None:
        ck = content_key(mask)
        memo = {}
        if ck is not None:
            with _MEMOS_LOCK:
                memo = _MEMOS.setdefault(ck, memo)
                _MEMOS.move_to_end(ck)
                while len(_MEMOS) > _MEMOS_SIZE:
                    _MEMOS.popitem(last=False)
        memo = mask.__dict__.setdefault("_call_memo", memo)
    if key not in memo:
        memo[key] = build()
    return memo[key]


class PlanCache:
    """LRU of ``size`` entries ``(content_key(mask) or id(mask), *key, device) -> value``, thread-safe.

    An entry holds the mask object itself, so an ``id`` cannot be reused while its entry lives.
    The build runs outside the lock (it may be slow); two threads may build the same entry once each.
    """

    def __init__(self, size: int = 64):
        self.size = size
        self._entries: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, mask, key: tuple, device, build: Callable[[torch.device], T]) -> T:
        dev = canonical_device(device)
        ck = content_key(mask)
        full = (id(mask) if ck is None else ck, *key, str(dev))
        with self._lock:
            hit = self._entries.get(full)
            if hit is not None and (ck is not None or hit[0] is mask):
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

"""FlashAttention's entry points, ``flash_attn_func`` and ``flash_attn_varlen_func``, on our masks.

Same arguments and layouts as the ``flash_attn`` package: ``[B, S, H, D]`` (packed ``[total, H, D]``
for varlen), GQA / MQA by fewer key/value heads, ``causal`` and ``window_size = (left, right)``
aligned to the bottom-right corner when ``Sq != Sk``. Each call becomes one ``RangeMask``
(``masks.window_mask``, or ``masks.from_cu_seqlens`` for varlen) and one ``longca_triton.attention``
call, so every backend of the registry runs it. Masks are cached by their arguments: the layers of
a model share one mask object, and with it the kernels' tile plans cached on it.

Differences from ``flash_attn``: no dropout (``dropout_p`` must be 0); ``return_lse=True`` returns
``(out, lse)`` in place of ``return_attn_probs``' three values.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .api import attention, validate_tensors
from .masks import RangeMask, from_cu_seqlens, window_mask

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]


def _check_dropout(dropout_p) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise ValueError(f"dropout_p={dropout_p!r}: attention dropout is not supported; pass dropout_p=0.0")


def _hashable_window(window_size):
    """``window_size`` as a cache key (a list becomes a tuple; what is left is checked by the mask)."""
    return tuple(window_size) if isinstance(window_size, (list, tuple)) else window_size


@functools.lru_cache(maxsize=64)
def _window_mask(seqlen_q: int, seqlen_k: int, causal: bool, window_size) -> RangeMask:
    return window_mask(seqlen_q, seqlen_k, causal, window_size)


def flash_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                    window_size=(-1, -1), deterministic: bool = False, return_lse: bool = False,
                    backend: str | None = None):
    """FlashAttention's ``flash_attn_func``: ``q [B, Sq, Hq, D]``, ``k`` / ``v [B, Sk, Hkv, D]``
    (``Hq % Hkv == 0``: GQA, MQA at ``Hkv = 1``) -> ``out [B, Sq, Hq, D_v]``, and with ``return_lse``
    ``(out, lse [B, Hq, Sq])`` (float32, ``-inf`` on rows that attend nothing).

    Query ``i`` attends key ``j`` when ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``
    (``window_size = (left, right)``, ``-1`` unbounded; ``causal`` sets ``right = 0``). The default
    scale is ``1/sqrt(D)``. ``backend`` and ``deterministic`` are ``longca_triton.attention``'s.
    Differentiable.
    """
    _check_dropout(dropout_p)
    validate_tensors(q, k, v)
    mask = _window_mask(q.shape[1], k.shape[1], bool(causal), _hashable_window(window_size))
    return attention(q, k, v, mask, softmax_scale=softmax_scale, backend=backend, return_lse=return_lse,
                     deterministic=deterministic)


def _cu_seqlens_on_host(cu_seqlens_q, cu_seqlens_k) -> tuple[np.ndarray, np.ndarray]:
    """Both ``cu_seqlens`` as int64 numpy arrays, in one device-to-host copy where they share a device."""
    for label, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1 \
                or cu.numel() < 2:
            what = f"{cu.dtype} tensor of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(f"{label} must be a 1-D int32 or int64 tensor [num_docs + 1], got a {what}")
    if cu_seqlens_k is cu_seqlens_q:
        host = cu_seqlens_q.detach().cpu().numpy().astype(np.int64)
        return host, host
    if cu_seqlens_q.device != cu_seqlens_k.device:
        return cu_seqlens_q.detach().cpu().numpy().astype(np.int64), cu_seqlens_k.detach().cpu().numpy().astype(np.int64)
    both = torch.cat([cu_seqlens_q.detach().to(torch.int64), cu_seqlens_k.detach().to(torch.int64)]).cpu().numpy()
    return both[: cu_seqlens_q.numel()], both[cu_seqlens_q.numel():]


@functools.lru_cache(maxsize=16)
def _varlen_mask(cu_q: bytes, cu_k: bytes, causal: bool, window_size) -> RangeMask:
    return from_cu_seqlens(np.frombuffer(cu_q, np.int64), np.frombuffer(cu_k, np.int64), causal, window_size)


def _check_max_seqlen(label: str, value, lengths: np.ndarray) -> None:
    """``max_seqlen_*`` is an integer at least the longest document (FlashAttention sizes its grid by it)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{label} must be an integer, got {value!r}")
    longest = int(lengths.max()) if lengths.size else 0
    if value < longest:
        raise ValueError(f"{label}={value} is shorter than the longest document ({longest} tokens)")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                           dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                           window_size=(-1, -1), deterministic: bool = False, return_lse: bool = False,
                           backend: str | None = None):
    """FlashAttention's ``flash_attn_varlen_func``: packed ``q [total_q, Hq, D]``, ``k`` / ``v
    [total_k, Hkv, D]`` holding documents ``b`` at ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]`` (keys at
    ``cu_seqlens_k``) -> ``out [total_q, Hq, D_v]``, and with ``return_lse`` ``(out, lse [Hq,
    total_q])``.

    Query document ``b`` attends key document ``b`` only, under ``causal`` / ``window_size`` aligned
    to that pair's own bottom-right corner, as ``flash_attn_func`` would per document. All documents
    run in one kernel call on ``[1, total, H, D]`` under one block-diagonal ``RangeMask``; the
    ``cu_seqlens`` (int32 or int64, starting at 0, non-decreasing, ending at the totals; empty
    documents allowed) are copied to the host once to build it. Differentiable.
    """
    _check_dropout(dropout_p)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be 3-D [total_tokens, heads, head_dim] (the packed varlen layout), got {shape}")
    cu_q, cu_k = _cu_seqlens_on_host(cu_seqlens_q, cu_seqlens_k)
    for label, cu, t, name in (("cu_seqlens_q", cu_q, q, "q"), ("cu_seqlens_k", cu_k, k, "k")):
        if cu[-1] != t.shape[0]:
            raise ValueError(f"{label} ends at {int(cu[-1])} but {name} holds {t.shape[0]} tokens")
    mask = _varlen_mask(cu_q.tobytes(), cu_k.tobytes(), bool(causal), _hashable_window(window_size))
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, np.diff(cu_q))
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, np.diff(cu_k))
    res = attention(q[None], k[None], v[None], mask, softmax_scale=softmax_scale, backend=backend,
                    return_lse=return_lse, deterministic=deterministic)
    return (res[0][0], res[1][0]) if return_lse else res[0]

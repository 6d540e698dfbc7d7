"""What every ladder step shares: mask metadata on the device, the element mask, tile sizes.

Nothing here is an idea of the ladder; it is plumbing that would otherwise be copied into every
step. Three things:

* ``row_interval_arrays(mask, device)``: the mask IR's per-row intervals ``lo, hi: int32 [Sq, K]``
  (row ``i`` attends key ``j`` iff ``OR_t lo[i, t] <= j < hi[i, t]``), ``K`` padded to a power of
  two so that kernels can unroll over it; ``O(S)`` memory.
* ``tile_tables(mask, bm, bn, device)``: the IR's block tables (per query tile its *full* and
  *partial* key tiles as CSR lists, and the key-major transpose) as device tensors.
* ``interval_mask`` (``@triton.jit``): the element mask of one tile, evaluated from the intervals.

Everything is cached per (mask object, sizes, device), outside any timed region after the first
call, the way a real kernel library plans once per mask.
"""

from __future__ import annotations

import collections
import math
import os
import threading

import numpy as np
import torch
import triton
import triton.language as tl

# why: importing the production module applies its NumPy >= 2.4 patch to Triton's CPU
# interpreter (loaded scalars used as loop bounds); our kernels need the same patch.
from longca_triton.kernels.dense import op as _dense  # noqa: F401

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def softmax_scale_or_default(softmax_scale, head_dim: int) -> float:
    return float(1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale)


def check_shapes(q, k, v, mask) -> None:
    """``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``, ``Hq % Hkv == 0``, mask ``Sq x Sk``."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"q must be [B, Sq, Hq, D] and k, v [B, Sk, Hkv, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"incompatible q {tuple(q.shape)} and k/v {tuple(k.shape)} (batch, head dim, GQA)")
    if (mask.seqlen_q, mask.seqlen_k) != (q.shape[1], k.shape[1]):
        raise ValueError(f"mask is {mask.seqlen_q} x {mask.seqlen_k} but q/k have Sq={q.shape[1]}, Sk={k.shape[1]}")
    if not hasattr(mask, "row_intervals"):
        raise ValueError(f"the ladder's kernels take a RangeMask, got {type(mask).__name__}")
    if max(q[:1].numel(), k[:1].numel()) >= 2**31:
        # why: the teaching kernels index within one batch entry with 32-bit offsets
        raise ValueError("one batch entry of q or k has >= 2^31 elements: too large for the ladder's kernels")


_TILE_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages",
              "DKDV_BLOCK_M", "DKDV_BLOCK_N", "dkdv_num_warps", "DQ_BLOCK_M", "DQ_BLOCK_N", "dq_num_warps")


def tile_config(head_dim: int, dtype=torch.bfloat16) -> dict:
    """Tile sizes: the production kernel's defaults, so that later steps differ in ideas, not tiles.

    On the CPU interpreter this is a small pinned config (32 x 32) that keeps the tests quick.
    Keys the production config does not have (it may change) fall back to these values.
    """
    if interpreting():
        cfg = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1, DKDV_BLOCK_M=32, DKDV_BLOCK_N=32,
                   dkdv_num_warps=4, DQ_BLOCK_M=32, DQ_BLOCK_N=32, dq_num_warps=4)
    elif head_dim <= 128:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, DKDV_BLOCK_M=32, DKDV_BLOCK_N=64,
                   dkdv_num_warps=4, DQ_BLOCK_M=128, DQ_BLOCK_N=64, dq_num_warps=8)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, DKDV_BLOCK_M=16, DKDV_BLOCK_N=64,
                   dkdv_num_warps=8, DQ_BLOCK_M=64, DQ_BLOCK_N=32, dq_num_warps=4)
    try:
        prod = _dense.default_config(head_dim, dtype)
    except Exception:  # the production module is someone else's: never let it break the ladder
        prod = {}
    cfg.update({k: int(prod[k]) for k in _TILE_KEYS if k in prod})
    return cfg


# ----------------------------------------------------------------------------------------------
# Cached mask metadata on the device
# ----------------------------------------------------------------------------------------------
_CACHE: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_LOCK = threading.Lock()


def _cached(key, build):
    """LRU cache that holds the mask itself, so its ``id`` cannot be reused while cached."""
    mask = key[1]
    full_key = (key[0], id(mask)) + key[2:]
    with _LOCK:
        hit = _CACHE.get(full_key)
        if hit is not None and hit[0] is mask:
            _CACHE.move_to_end(full_key)
            return hit[1]
    value = build()
    with _LOCK:
        _CACHE[full_key] = (mask, value)
        while len(_CACHE) > 32:
            _CACHE.popitem(last=False)
    return value


def _device(device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def row_interval_arrays(mask, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(lo, hi, num_iv)``: int32 ``[Sq, num_iv]`` device tensors, ``num_iv`` a power of two."""
    dev = _device(device)

    def build():
        lo, hi = (np.asarray(a, dtype=np.int32) for a in mask.row_intervals())
        k = max(1, lo.shape[1])
        num_iv = 1 << (k - 1).bit_length()
        if num_iv != lo.shape[1]:
            pad = np.zeros((lo.shape[0], num_iv - lo.shape[1]), np.int32)  # empty slots [0, 0)
            lo, hi = np.concatenate([lo, pad], 1), np.concatenate([hi, pad], 1)
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
        return to(lo), to(hi), num_iv

    return _cached(("iv", mask, str(dev)), build)


def dense_mask_on(mask, device) -> torch.Tensor:
    """bool ``[Sq, Sk]`` on the device, built there from the row intervals (for the naive steps)."""
    dev = _device(device)

    def build():
        lo, hi, num_iv = row_interval_arrays(mask, dev)
        j = torch.arange(mask.seqlen_k, device=dev)[None, :]
        allowed = torch.zeros(mask.seqlen_q, mask.seqlen_k, dtype=torch.bool, device=dev)
        for t in range(num_iv):
            allowed |= (j >= lo[:, t : t + 1]) & (j < hi[:, t : t + 1])
        return allowed

    return _cached(("dense", mask, str(dev)), build)


class TileTables:
    """Device CSR lists of one mask at one tile size (see ``BlockTables`` in the mask IR).

    ``q_full_ptr/q_full_idx``: for query tile ``m`` the key tiles ``q_full_idx[q_full_ptr[m]:
    q_full_ptr[m+1]]`` are fully allowed; ``q_part_*`` partially; ``k_*`` the key-major transpose.
    """

    def __init__(self, bt, device):
        to = lambda a: torch.from_numpy(np.ascontiguousarray(np.asarray(a, np.int32))).to(device)  # noqa: E731
        self.block_m, self.block_n = bt.block_m, bt.block_n
        self.num_m, self.num_n = bt.num_m, bt.num_n
        self.q_full_ptr, self.q_full_idx = to(bt.q_full_ptr), to(bt.q_full_idx)
        self.q_part_ptr, self.q_part_idx = to(bt.q_part_ptr), to(bt.q_part_idx)
        self.k_full_ptr, self.k_full_idx = to(bt.k_full_ptr), to(bt.k_full_idx)
        self.k_part_ptr, self.k_part_idx = to(bt.k_part_ptr), to(bt.k_part_idx)
        # index arrays may be empty; kernels never read them then, but need a valid pointer
        for name in ("q_full_idx", "q_part_idx", "k_full_idx", "k_part_idx"):
            if getattr(self, name).numel() == 0:
                setattr(self, name, torch.zeros(1, dtype=torch.int32, device=device))


def tile_tables(mask, block_m: int, block_n: int, device) -> TileTables:
    """The mask's block tables at ``block_m x block_n`` on the device, with one fix-up:

    when ``Sk`` is not a multiple of ``block_n`` the last key tile holds keys ``>= Sk``. The IR may
    call it *full* (every in-range pair is allowed), but a kernel that skips mask math on full
    tiles would then count the padding keys. So, in the query-major lists only, that tile moves
    to the *partial* list, whose element mask (``hi <= Sk``) drops the padding keys: the full-tile
    loop needs no bounds checks at all. (Key-major loops are safe without it: padding query rows
    load ``q = dO = 0`` and contribute exactly zero to dK and dV.)
    """
    from longca_triton.masks import BlockTables

    dev = _device(device)

    def build():
        bt = mask.block_tables(block_m, block_n)
        if mask.seqlen_k % block_n:
            full, part = bt.to_dense_tiles()
            moved_full, moved_part = full.copy(), part.copy()
            moved_part[:, -1] |= moved_full[:, -1]
            moved_full[:, -1] = False
            qmajor = BlockTables.from_classification(block_m, block_n, moved_full, moved_full | moved_part)
            bt = BlockTables(block_m, block_n, bt.num_m, bt.num_n,
                             qmajor.q_full_ptr, qmajor.q_full_idx, qmajor.q_part_ptr, qmajor.q_part_idx,
                             bt.k_full_ptr, bt.k_full_idx, bt.k_part_ptr, bt.k_part_idx)
        return TileTables(bt, dev)

    return _cached(("tables", mask, int(block_m), int(block_n), str(dev)), build)


# ----------------------------------------------------------------------------------------------
# The element mask of a tile
# ----------------------------------------------------------------------------------------------
@triton.jit
def interval_mask(offs_m, offs_n, LO, HI, Sq, NUM_IV: tl.constexpr):
    """``allowed[i, j] = OR_t lo[i, t] <= j < hi[i, t]``, shape ``[len(offs_m), len(offs_n)]``.

    Rows outside ``[0, Sq)`` read empty intervals and so allow nothing; ``hi <= Sk`` keeps keys
    past the end out. ``NUM_IV`` (intervals per row, a power of two) is unrolled.
    """
    row_ok = offs_m < Sq
    allowed = (offs_n[None, :] < 0) & (offs_m[:, None] < 0)  # all False, [M, N]
    for t in tl.static_range(NUM_IV):
        lo = tl.load(LO + offs_m * NUM_IV + t, mask=row_ok, other=0)  # [M]
        hi = tl.load(HI + offs_m * NUM_IV + t, mask=row_ok, other=0)  # [M]
        allowed = allowed | ((offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None]))
    return allowed

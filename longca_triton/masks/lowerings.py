"""Lowerings of the mask IR to the arguments vendor kernels take.

Each is a pure function of the mask, cached on it, and either returns the vendor form or raises
``NotExpressible`` saying why the mask cannot be written that way:

* ``flashmask_columns(mask)``  FlashMask's column bounds ``(LTS, LTE, UTS, UTE)``;
* ``varlen_form(mask)``        ``cu_seqlens`` + window ``(left, right)`` + causal flag;
* ``flex_block_mask(mask, block_size, device)``  a FlexAttention ``BlockMask`` built straight from
  the block tables (no ``S × S`` evaluation) with an interval-based ``mask_mod`` for partial blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .ir import BlockSparseMask, Mask, RangeMask

__all__ = ["NotExpressible", "FlashMaskColumns", "VarlenForm", "flashmask_columns", "varlen_form", "flex_block_mask", "flex_mask_mod"]


class NotExpressible(ValueError):
    """The mask cannot be written in the requested vendor form."""


# ---------------------------------------------------------------------------- FlashMask columns
@dataclass(frozen=True)
class FlashMaskColumns:
    """Per key column ``j``, the masked rows are ``[lts[j], lte[j]) ∪ [uts[j], ute[j])``.

    The UT interval lies above the LT one (``ute <= lts``). ``int32 [Sk]`` numpy arrays.
    ``has_ut`` / ``has_lt`` say whether any column uses that interval (FlashMask's cheaper variants).
    """

    lts: np.ndarray
    lte: np.ndarray
    uts: np.ndarray
    ute: np.ndarray

    @property
    def has_ut(self) -> bool:
        return bool(np.any(self.ute > self.uts))

    @property
    def has_lt(self) -> bool:
        return bool(np.any(self.lte > self.lts))

    def to_dense(self, seqlen_q: int) -> torch.Tensor:
        i = torch.arange(seqlen_q)[:, None]
        t = {k: torch.from_numpy(getattr(self, k).astype(np.int64))[None, :] for k in ("lts", "lte", "uts", "ute")}
        masked = ((i >= t["lts"]) & (i < t["lte"])) | ((i >= t["uts"]) & (i < t["ute"]))
        return ~masked


def flashmask_columns(mask: Mask) -> FlashMaskColumns:
    """FlashMask's column form. A column whose allowed rows are ``[a,b) ∪ [c,d) ∪ [e,f)`` fits when
    it has one interval, two with ``a == 0`` or ``d == Sq``, or three with ``a == 0`` and ``f == Sq``."""
    if not isinstance(mask, RangeMask):
        raise NotExpressible("FlashMask columns need a RangeMask; block-sparse masks are not column intervals")
    return _flashmask_columns(mask)


def _flashmask_columns(mask: RangeMask) -> FlashMaskColumns:
    cache = mask.__dict__.setdefault("_lowering_cache", {})
    if "flashmask" in cache:
        if isinstance(cache["flashmask"], Exception):
            raise cache["flashmask"]
        return cache["flashmask"]
    Sq, Sk = mask.seqlen_q, mask.seqlen_k
    lo, hi = mask.col_intervals()
    count = (hi > lo).sum(axis=1)
    K = lo.shape[1]
    lts, lte = np.full(Sk, Sq, np.int32), np.full(Sk, Sq, np.int32)
    uts, ute = np.zeros(Sk, np.int32), np.zeros(Sk, np.int32)
    # empty column: everything masked through the UT interval
    empty = count == 0
    ute[empty] = Sq
    # the first interval [a, b) and last [e, f) of each column; the gap(s) become the masked ranges
    a, b = lo[:, 0], hi[:, 0]
    last = np.maximum(count - 1, 0)
    e, f = lo[np.arange(Sk), last], hi[np.arange(Sk), last]
    one = count == 1
    uts[one], ute[one], lts[one], lte[one] = 0, a[one], b[one], Sq
    if K >= 2:
        c, d = lo[:, 1], hi[:, 1]
        two = count == 2
        fits = two & ((a == 0) | (d == Sq))
        bad = two & ~fits
        starts0 = fits & (a == 0)  # [0,b) ∪ [c,d): UT = [b, c), LT = [d, Sq)
        uts[starts0], ute[starts0], lts[starts0], lte[starts0] = b[starts0], c[starts0], d[starts0], Sq
        ends = fits & (a != 0)  # [a,b) ∪ [c,Sq): UT = [0, a), LT = [b, c)
        uts[ends], ute[ends], lts[ends], lte[ends] = 0, a[ends], b[ends], c[ends]
        if K >= 3:
            three = count == 3
            fits3 = three & (a == 0) & (f == Sq)
            uts[fits3], ute[fits3] = b[fits3], lo[fits3, 1]
            lts[fits3], lte[fits3] = hi[fits3, 1], e[fits3]
            bad = bad | (three & ~fits3) | (count > 3)
        if bad.any():
            j = int(np.nonzero(bad)[0][0])
            ivs = [(int(x), int(y)) for x, y in zip(lo[j], hi[j]) if y > x]
            err = NotExpressible(
                f"mask {mask.name!r} is not expressible as FlashMask columns: column {j} allows rows {ivs}, "
                "which is not the complement of one upper and one lower masked interval"
            )
            cache["flashmask"] = err
            raise err
    out = FlashMaskColumns(lts, lte, uts, ute)
    cache["flashmask"] = out
    return out


# ---------------------------------------------------------------------------- varlen form
@dataclass(frozen=True)
class VarlenForm:
    """Packed documents: ``cu_seqlens`` int32 ``[n + 1]``; inside each document the window
    ``(left, right)`` (``-1`` = unbounded) and ``causal`` (``right == 0``), FlashAttention style."""

    cu_seqlens: np.ndarray
    max_seqlen: int
    causal: bool
    window: tuple[int, int]

    @property
    def num_docs(self) -> int:
        return len(self.cu_seqlens) - 1

    def to_dense(self) -> torch.Tensor:
        S = int(self.cu_seqlens[-1])
        doc = torch.bucketize(torch.arange(S), torch.from_numpy(self.cu_seqlens[1:].astype(np.int64)), right=True)
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        ok = doc[:, None] == doc[None, :]
        left, right = self.window
        if left >= 0:
            ok &= j >= i - left
        if self.causal:
            ok &= j <= i
        elif right >= 0:
            ok &= j <= i + right
        return ok


def varlen_form(mask: Mask) -> VarlenForm:
    """The (document) full / causal / sliding-window form, inferred from the IR and verified on
    every row: row ``i`` must attend exactly ``[max(start(i), i - left), min(end(i), i + right + 1))``."""
    if not isinstance(mask, RangeMask):
        raise NotExpressible("varlen form needs a RangeMask")
    cache = mask.__dict__.setdefault("_lowering_cache", {})
    if "varlen" not in cache:
        try:
            cache["varlen"] = _varlen_form(mask)
        except NotExpressible as e:
            cache["varlen"] = e
    if isinstance(cache["varlen"], Exception):
        raise cache["varlen"]
    return cache["varlen"]


def _varlen_form(mask: RangeMask) -> VarlenForm:
    S = mask.seqlen_q
    if mask.seqlen_k != S:
        raise NotExpressible(f"varlen form needs Sq == Sk, got {S} and {mask.seqlen_k}")
    lo, hi = mask.row_intervals()
    if lo.shape[1] > 1 and np.any(hi[:, 1] > lo[:, 1]):
        i = int(np.nonzero(hi[:, 1] > lo[:, 1])[0][0])
        raise NotExpressible(f"row {i} attends more than one key interval, so the mask is not documents with a window")
    lo, hi = lo[:, 0].astype(np.int64), hi[:, 0].astype(np.int64)
    i = np.arange(S)
    if np.any(hi <= lo) or np.any(lo > i) or np.any(hi <= i):
        raise NotExpressible("some row does not attend its own position (empty or shifted rows)")
    # candidate document starts: the slices' edges where neither side sees across
    edges = sorted({s[0] for s in mask.slices} | {s[1] for s in mask.slices} | {0, S})
    cuts = [b for b in edges if b in (0, S) or (lo[b] >= b and hi[b - 1] <= b)]
    cu = np.asarray(cuts, dtype=np.int64)
    doc = np.searchsorted(cu, i, side="right") - 1
    start, end = cu[doc], cu[doc + 1]
    left_seen = i - lo
    right_seen = hi - 1 - i
    clipped_l = lo > start
    clipped_r = hi < end
    left = int(left_seen[clipped_l].max()) if clipped_l.any() else -1
    right = int(right_seen[clipped_r].max()) if clipped_r.any() else -1
    exp_lo = np.maximum(start, i - left) if left >= 0 else start
    exp_hi = np.minimum(end, i + right + 1) if right >= 0 else end
    if not (np.array_equal(exp_lo, lo) and np.array_equal(exp_hi, hi)):
        bad = int(np.nonzero((exp_lo != lo) | (exp_hi != hi))[0][0])
        raise NotExpressible(
            f"row {bad} attends [{lo[bad]}, {hi[bad]}), not a document window; the mask is not a plain document/window mask"
        )
    lens = np.diff(cu)
    return VarlenForm(cu.astype(np.int32), int(lens.max()), causal=(right == 0), window=(left, right))


# ---------------------------------------------------------------------------- FlexAttention
def flex_mask_mod(mask: Mask, device):
    """An element ``mask_mod`` for FlexAttention from the IR (interval test or block-map lookup)."""
    if isinstance(mask, RangeMask):
        lo_np, hi_np = mask.row_intervals()
        # why one 1-D tensor per interval slot: Flex's FLASH (CuTe) backend cannot lower a constant
        # index into a captured 2-D tensor (``lo[q_idx, 0]``: "Expected TensorSSA, but got int")
        los = [torch.as_tensor(np.ascontiguousarray(lo_np[:, t]), device=device) for t in range(lo_np.shape[1])]
        his = [torch.as_tensor(np.ascontiguousarray(hi_np[:, t]), device=device) for t in range(hi_np.shape[1])]

        def mask_mod(b, h, q_idx, kv_idx):
            ok = (kv_idx >= los[0][q_idx]) & (kv_idx < his[0][q_idx])
            for lo_t, hi_t in zip(los[1:], his[1:]):
                ok = ok | ((kv_idx >= lo_t[q_idx]) & (kv_idx < hi_t[q_idx]))
            return ok

        return mask_mod
    assert isinstance(mask, BlockSparseMask)
    # flat (1-D) lookups, as above: the FLASH backend lowers 1-D indexing of captured tensors
    P, nqb, nkb = mask.block_map.shape
    bmap = mask.block_map.reshape(-1).to(device)
    q_blk = torch.as_tensor(np.repeat(np.arange(nqb), np.diff(mask.q_block_bounds)) * nkb, device=device)
    k_blk = torch.as_tensor(np.repeat(np.arange(nkb), np.diff(mask.k_block_bounds)), device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        # one pattern per group of heads; the caller sizes H as P (see flex_block_mask)
        return bmap[(h % P) * (nqb * nkb) + q_blk[q_idx] + k_blk[kv_idx]]

    return mask_mod


def flex_block_mask(mask: Mask, block_size: int = 128, device="cpu", num_heads: int | None = None):
    """FlexAttention ``BlockMask`` from our block tables: partial tiles carry the ``mask_mod``,
    full tiles skip it. For block-sparse masks with ``P > 1`` patterns the mask has ``P`` heads
    (pass ``num_heads`` to expand to one per query head, heads grouped ``Hq / P`` per pattern)."""
    from torch.nn.attention.flex_attention import BlockMask

    key = ("flex", block_size, str(device), num_heads)
    cache = mask.__dict__.setdefault("_lowering_cache", {})
    if key in cache:
        return cache[key]
    tables = mask.block_tables(block_size, block_size)
    full, part = tables.to_dense_tiles()
    if full.ndim == 2:
        full, part = full[None], part[None]
    if num_heads is not None and full.shape[0] != num_heads:
        pat = mask.pattern_of_head(num_heads) if isinstance(mask, BlockSparseMask) else [0] * num_heads
        full, part = full[pat], part[pat]

    def to_kv(tiles: np.ndarray):
        t = torch.from_numpy(tiles)
        num = t.sum(-1).to(torch.int32)
        # indices of kept tiles first (stable sort puts True before False when sorting on ~t)
        idx = torch.argsort((~t).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num[None].to(device), idx[None].to(device)

    kv_num, kv_idx = to_kv(part)
    full_num, full_idx = to_kv(full)
    mod = flex_mask_mod(mask, device)
    if isinstance(mask, BlockSparseMask) and num_heads is not None:
        base = mod
        group = num_heads // mask.num_patterns

        def mod(b, h, q_idx, kv_idx):  # noqa: F811 - head h -> its pattern
            return base(b, h // group, q_idx, kv_idx)

    bm = BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=mod, seq_lengths=(mask.seqlen_q, mask.seqlen_k)
    )
    cache[key] = bm
    return bm

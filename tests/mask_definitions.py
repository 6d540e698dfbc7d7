"""docs/masks.md §3 written out directly, element by element, from a mask's ``.params``; and
FlashAttention's causal / window rule, per sequence and per packed document.

This is the test oracle: it never looks at slices or lowerings, only at the definition table.
"""

import numpy as np
import torch


#: small mask parameters, so that the structure shows at small S (the defaults are tested too)
SMALL_PARAMS = {
    "sliding_window": {"window": 16},
    "sliding_window_causal": {"window": 16},
    "global_sliding_window": {"window": 16, "global_tokens": 5},
    "block_causal_document": {"block": 16},
    "block_sparse": {"block": 16, "patterns": 2},
    "varblock_sparse": {"block": 48, "min_block": 16, "patterns": 3, "density": 0.3},
}


def doc_index(S, bounds):
    return np.searchsorted(np.asarray(bounds), np.arange(S), side="right") - 1


def definition(name: str, S: int, p: dict) -> torch.Tensor:
    i = np.arange(S)[:, None]
    j = np.arange(S)[None, :]
    if "doc_bounds" in p:
        b = np.asarray(p["doc_bounds"])
        d = doc_index(S, b)
        di, dj = d[:, None], d[None, :]
        start = b[d]
        n_docs = len(b) - 1
    if name == "full":
        ok = np.ones((S, S), bool)
    elif name == "causal":
        ok = j <= i
    elif name == "full_document":
        ok = di == dj
    elif name == "causal_document":
        ok = (di == dj) & (j <= i)
    elif name == "share_question":
        ok = (j <= i) & ((dj == di) | (dj == 0))
    elif name == "causal_blockwise":
        ok = (j <= i) & ((dj == di) | (di == n_docs - 1))
    elif name == "prefix_lm_causal":
        ok = (j < p["prefix"]) | (j <= i)
    elif name == "prefix_lm_document":
        lens = np.diff(b)[d]
        pre = np.minimum(p["prefix"], lens)
        ok = (di == dj) & (((j - start[None, :]) < pre[None, :]) | (j <= i))
    elif name == "sliding_window":
        ok = np.abs(i - j) <= p["window"]
    elif name == "sliding_window_causal":
        ok = (i - p["window"] <= j) & (j <= i)
    elif name == "global_sliding_window":
        g = p["global_tokens"]
        ok = (np.abs(i - j) <= p["window"]) | (i < g) | (j < g)
    elif name == "block_causal_document":
        B = p["block"]
        ok = (di == dj) & (j // B <= i // B)
    elif name in ("block_sparse", "varblock_sparse"):
        raise AssertionError("block-sparse masks are checked against their block map, see test_masks")
    else:
        raise AssertionError(name)
    return torch.from_numpy(np.ascontiguousarray(ok))


def window_reference(sq, sk, causal, window):
    """FlashAttention's rule, one (i, j) pair at a time: bottom-right aligned, -1 unbounded."""
    left, right = window
    right = 0 if causal else right
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def documents_reference(len_q, len_k, causal, window):
    """Block-diagonal union of FlashAttention's rule per (query doc, key doc) pair, built densely."""
    dense = torch.zeros(sum(len_q), sum(len_k), dtype=torch.bool)
    oq = ok = 0
    for lq, lk in zip(len_q, len_k):
        if lq and lk:
            dense[oq:oq + lq, ok:ok + lk] = window_reference(lq, lk, causal, window)
        oq, ok = oq + lq, ok + lk
    return dense

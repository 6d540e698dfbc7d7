"""The 14 masks of docs/masks.md §3, each reproducible from ``(name, S, params, seed)``.

Static masks (1–12) are built as ``RangeMask`` slices; dynamic ones (13–14) as ``BlockSparseMask``.
Every drawn value (document bounds, prefix, block bounds...) is recorded in ``mask.params``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any, Callable

import numpy as np
import torch

from .ir import BlockSparseMask, Mask, RangeMask, SliceKind

__all__ = ["MASK_NAMES", "MASK_SPECS", "MASK_PARAMETERS", "aligned_block_bounds", "make_mask", "sample_doc_lengths",
           "load_histogram", "histogram_for"]

FULL, CAUSAL, INVCAUSAL, BICAUSAL = SliceKind.FULL, SliceKind.CAUSAL, SliceKind.INVCAUSAL, SliceKind.BICAUSAL

HISTOGRAMS = ("pile", "prolong64k", "prolong512k")


# ---------------------------------------------------------------------------- document lengths
def load_histogram(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(lo, hi, weight)`` arrays of a document-length histogram shipped with the package."""
    if name not in HISTOGRAMS:
        raise ValueError(f"unknown document-length distribution {name!r}; valid: {', '.join(HISTOGRAMS)}")
    text = resources.files("longca_triton.data").joinpath(f"{name}.json").read_text()
    lo, hi, w = [], [], []
    for key, weight in json.loads(text).items():
        a, b = key.strip("[)").split(",")
        lo.append(int(a))
        hi.append(int(b))
        w.append(float(weight))
    w = np.asarray(w)
    return np.asarray(lo), np.asarray(hi), w / w.sum()


def histogram_for(seqlen: int) -> str:
    """docs/masks.md §4: pile up to 12K, prolong64k up to 64K, prolong512k above."""
    if seqlen <= 12 * 1024:
        return "pile"
    if seqlen <= 64 * 1024:
        return "prolong64k"
    return "prolong512k"


def _sample_hist(total: int, rng: np.random.Generator, distribution: str) -> list[int]:
    lo, hi, w = load_histogram(distribution)
    lengths, left = [], total
    while left > 0:
        b = rng.choice(len(w), p=w)
        n = int(rng.integers(max(lo[b], 1), max(hi[b], lo[b] + 1)))
        n = max(1, min(n, left))
        lengths.append(n)
        left -= n
    return lengths


def sample_doc_lengths(seqlen: int, rng: np.random.Generator, docs: str = "hist", distribution: str | None = None) -> list[int]:
    """Document lengths summing to ``seqlen`` (docs/masks.md §4, and the ``docs="long"`` variant of §3)."""
    distribution = distribution or histogram_for(seqlen)
    if docs == "hist":
        return _sample_hist(seqlen, rng, distribution)
    if docs == "long":
        short_total = int(round(0.4 * seqlen))
        lengths = _sample_hist(short_total, rng, distribution) if short_total else []
        left = seqlen - short_total
        while left > 0:
            n = min(int(rng.integers(8 * 1024, 30 * 1024 + 1)), left)
            lengths.append(n)
            left -= n
        rng.shuffle(lengths)
        return [int(x) for x in lengths]
    raise ValueError(f"unknown docs option {docs!r}; valid: 'hist', 'long'")


def _bounds(lengths) -> list[int]:
    return [0] + [int(x) for x in np.cumsum(lengths)]


def aligned_block_bounds(seqlen: int, unit: int = 128, mean: int = 256, seed: int = 0) -> dict:
    """``make_mask("varblock_sparse", ...)`` parameters for variable blocks whose sizes are multiples of
    ``unit`` (``unit`` to ``2 * mean - unit``, mean about ``mean``): variable structure without ragged
    tiles at ``unit``-sized tiles, which tells the ragged tiles' cost from the variable structure's."""
    rng = np.random.default_rng(seed)
    sizes = []
    while sum(sizes) < seqlen:
        sizes.append(unit * int(rng.integers(1, 2 * mean // unit)))
    sizes[-1] -= sum(sizes) - seqlen
    if sizes[-1] <= 0:
        sizes.pop()
        sizes[-1] += seqlen - sum(sizes)
    return {"min_block": unit, "block_bounds": _bounds(sizes)}


def _doc_bounds(S: int, rng, p: dict) -> list[int]:
    """Document bounds: given explicitly (``doc_bounds`` or ``doc_lens``) or drawn from the histogram."""
    if p.get("doc_bounds") is not None:
        b = [int(x) for x in p["doc_bounds"]]
        if b[0] != 0 or b[-1] != S or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"doc_bounds must increase strictly from 0 to S={S}, got {b}")
        return b
    if p.get("doc_lens") is not None:
        lens = [int(x) for x in p["doc_lens"]]
        if sum(lens) != S or min(lens) < 1:
            raise ValueError(f"doc_lens must be positive and sum to S={S}, got sum {sum(lens)}")
        return _bounds(lens)
    return _bounds(sample_doc_lengths(S, rng, p["docs"], p["distribution"]))


# ---------------------------------------------------------------------------- static masks
def _full(S, rng, p):
    return [(0, S, 0, S, FULL)]


def _causal(S, rng, p):
    return [(0, S, 0, S, CAUSAL)]


def _full_document(S, rng, p):
    b = p["doc_bounds"] = _doc_bounds(S, rng, p)
    return [(s, e, s, e, FULL) for s, e in zip(b, b[1:])]


def _causal_document(S, rng, p):
    b = p["doc_bounds"] = _doc_bounds(S, rng, p)
    return [(s, e, s, e, CAUSAL) for s, e in zip(b, b[1:])]


def _share_question(S, rng, p):
    # doc 0 is the question: every later document (an answer) also sees all of it.
    b = p["doc_bounds"] = _doc_bounds(S, rng, p)
    out = [(s, e, s, e, CAUSAL) for s, e in zip(b, b[1:])]
    out += [(s, e, 0, b[1], FULL) for s, e in zip(b[1:], b[2:])]
    return out


def _causal_blockwise(S, rng, p):
    # the last document sees everything before it (causally)
    b = p["doc_bounds"] = _doc_bounds(S, rng, p)
    out = [(s, e, s, e, CAUSAL) for s, e in zip(b[:-2], b[1:-1])]
    out.append((b[-2], S, 0, S, CAUSAL))
    return out


def _prefix_lm_causal(S, rng, p):
    if p.get("prefix") is None:
        p["prefix"] = int(rng.integers(1, S + 1))
    pre = int(p["prefix"])
    if not 1 <= pre <= S:
        raise ValueError(f"prefix must lie in [1, S={S}], got {pre}")
    return [(0, S, 0, pre, FULL), (0, S, 0, S, CAUSAL)]


def _prefix_lm_document(S, rng, p):
    b = p["doc_bounds"] = _doc_bounds(S, rng, p)
    if p.get("prefix") is None:
        p["prefix"] = int(rng.integers(1, b[1] - b[0] + 1))
    pre = int(p["prefix"])
    if pre < 1:
        raise ValueError(f"prefix must be >= 1, got {pre}")
    out = []
    for s, e in zip(b, b[1:]):
        out.append((s, e, s, e, CAUSAL))
        out.append((s, e, s, s + min(pre, e - s), FULL))
    return out


def _window_causal_slices(S: int, w: int):
    """``i - w <= j <= i``: a causal head for the first rows, then a band (BICAUSAL of width w+1)."""
    if w + 1 >= S:
        return [(0, S, 0, S, CAUSAL)]
    return [(0, w + 1, 0, w + 1, CAUSAL), (w + 1, S, 1, S, BICAUSAL)]


def _window_anticausal_slices(S: int, w: int):
    """``i <= j <= i + w``: the mirror image of ``_window_causal_slices``."""
    if w + 1 >= S:
        return [(0, S, 0, S, INVCAUSAL)]
    return [(0, S - w - 1, 0, S - 1, BICAUSAL), (S - w - 1, S, S - w - 1, S, INVCAUSAL)]


def _check_window(p, S):
    w = p["window"]
    if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 0:
        raise ValueError(f"window must be a non-negative integer, got {w!r}")
    return int(w)


def _sliding_window(S, rng, p):
    w = _check_window(p, S)
    return _window_causal_slices(S, w) + _window_anticausal_slices(S, w)


def _sliding_window_causal(S, rng, p):
    return _window_causal_slices(S, _check_window(p, S))


def _global_sliding_window(S, rng, p):
    w = _check_window(p, S)
    if p.get("global_tokens") is None:
        p["global_tokens"] = w
    g = min(int(p["global_tokens"]), S)
    out = _sliding_window(S, rng, p)
    if g > 0:
        out += [(0, g, 0, S, FULL), (0, S, 0, g, FULL)]
    return out


def _block_causal_document(S, rng, p):
    B = int(p["block"])
    if B < 1:
        raise ValueError(f"block must be >= 1, got {B}")
    if p.get("doc_bounds") is None:
        nblocks = -(-S // B)
        counts, left = [], nblocks
        while left > 0:
            c = min(int(rng.integers(1, 9)), left)
            counts.append(c)
            left -= c
        p["doc_bounds"] = [min(S, int(x) * B) for x in np.cumsum([0] + counts)]
    b = _doc_bounds(S, rng, p)
    if any(x % B for x in b[1:-1]):
        raise ValueError(f"block_causal_document needs documents made of whole blocks of {B}, got doc_bounds {b}")
    out = []
    for s, e in zip(b, b[1:]):
        for q0 in range(s, e, B):
            q1 = min(q0 + B, e)
            out.append((q0, q1, s, q1, FULL))
    return out


# ---------------------------------------------------------------------------- dynamic masks
def _topk_map(P: int, nq: int, nk: int, density: float, rng) -> torch.Tensor:
    keep = max(1, int(round(density * nk)))
    scores = rng.random((P, nq, nk))
    top = np.argsort(-scores, axis=2, kind="stable")[:, :, :keep]
    bm = np.zeros((P, nq, nk), dtype=bool)
    np.put_along_axis(bm, top, True, axis=2)
    return torch.from_numpy(bm)


def _check_density(d):
    if not isinstance(d, (int, float)) or not 0 < d <= 1:
        raise ValueError(f"density must lie in (0, 1], got {d!r}")
    return float(d)


def _block_sparse(S, rng, p) -> BlockSparseMask:
    B = int(p["block"])
    if B < 1:
        raise ValueError(f"block must be >= 1, got {B}")
    bounds = list(range(0, S, B)) + [S]
    P = int(p["patterns"])
    bm = _topk_map(P, len(bounds) - 1, len(bounds) - 1, _check_density(p["density"]), rng)
    p["q_block_bounds"] = p["k_block_bounds"] = bounds
    return BlockSparseMask(bounds, bounds, bm, name="block_sparse", params=p)


def _varblock_sparse(S, rng, p) -> BlockSparseMask:
    mean, mn = int(p["block"]), int(p["min_block"])
    if mn < 1 or mean < mn:
        raise ValueError(f"need 1 <= min_block <= block, got min_block={mn}, block={mean}")
    if p.get("block_bounds") is not None:
        bounds = [int(x) for x in p["block_bounds"]]
    else:
        n = max(1, min(int(round(S / mean)), S // mn))
        extra = S - n * mn
        if extra < 0:  # S shorter than one minimum block: a single block
            n, extra, mn = 1, 0, S
        cuts = np.sort(rng.integers(0, extra + 1, size=n - 1))
        parts = np.diff(np.concatenate([[0], cuts, [extra]]))
        bounds = _bounds(parts + mn)
    P = int(p["patterns"])
    bm = _topk_map(P, len(bounds) - 1, len(bounds) - 1, _check_density(p["density"]), rng)
    p["block_bounds"] = p["q_block_bounds"] = p["k_block_bounds"] = bounds
    return BlockSparseMask(bounds, bounds, bm, name="varblock_sparse", params=p)


# ---------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class MaskSpec:
    name: str
    kind: str  # "static" | "dynamic"
    build: Callable
    defaults: dict
    summary: str


_DOCS = {"docs": "hist", "distribution": None, "doc_bounds": None, "doc_lens": None}

MASK_SPECS: dict[str, MaskSpec] = {
    s.name: s
    for s in [
        MaskSpec("full", "static", _full, {}, "always"),
        MaskSpec("causal", "static", _causal, {}, "j <= i"),
        MaskSpec("full_document", "static", _full_document, dict(_DOCS), "doc(i) == doc(j)"),
        MaskSpec("causal_document", "static", _causal_document, dict(_DOCS), "doc(i) == doc(j) and j <= i"),
        MaskSpec("share_question", "static", _share_question, dict(_DOCS), "j <= i and doc(j) in {doc(i), 0}"),
        MaskSpec("causal_blockwise", "static", _causal_blockwise, dict(_DOCS), "j <= i and (doc(j) == doc(i) or i in the last doc)"),
        MaskSpec("prefix_lm_causal", "static", _prefix_lm_causal, {"prefix": None}, "j < prefix or j <= i"),
        MaskSpec("prefix_lm_document", "static", _prefix_lm_document, {**_DOCS, "prefix": None}, "same doc and (j in the doc's prefix or j <= i)"),
        MaskSpec("sliding_window", "static", _sliding_window, {"window": 1024}, "|i - j| <= window"),
        MaskSpec("sliding_window_causal", "static", _sliding_window_causal, {"window": 1024}, "i - window <= j <= i"),
        MaskSpec("global_sliding_window", "static", _global_sliding_window, {"window": 1024, "global_tokens": None}, "|i - j| <= window or i < g or j < g"),
        MaskSpec("block_causal_document", "static", _block_causal_document, {"block": 1024, "doc_bounds": None}, "same doc and j // block <= i // block"),
        MaskSpec("block_sparse", "dynamic", _block_sparse, {"block": 64, "density": 0.5, "patterns": 1}, "uniform blocks, top-k kept per query-block row"),
        MaskSpec("varblock_sparse", "dynamic", _varblock_sparse, {"block": 256, "min_block": 128, "density": 0.5, "patterns": 1, "block_bounds": None}, "random blocks >= min_block, top-k kept per row"),
    ]
}

#: what every ``make_mask`` parameter means (``longca-triton masks list`` prints it; docs/masks.md §3.1)
MASK_PARAMETERS: dict[str, str] = {
    "docs": "how document lengths are drawn: 'hist' from the length histogram, 'long' 40% from it and 60% "
            "uniform in [8K, 30K], shuffled",
    "distribution": "the length histogram: pile, prolong64k or prolong512k (default: by S, docs/masks.md §4)",
    "doc_bounds": "explicit document bounds [0 = c0 < c1 < ... < cn = S] in place of drawn ones",
    "doc_lens": "explicit document lengths summing to S (another way to give doc_bounds)",
    "prefix": "prefix length p: keys j < p are seen by every query (prefix_lm_document: min(p, document length) "
              "per document); default drawn from the seed",
    "window": "window w: keys within w positions of the query (one side for sliding_window_causal)",
    "global_tokens": "g: the first g tokens see and are seen by every token (default w)",
    "block": "block size in tokens (block_causal_document: documents are whole blocks; varblock_sparse: the "
             "mean block)",
    "density": "fraction of key blocks kept in every query-block row, in (0, 1]",
    "patterns": "number of independent block maps P; query head h uses map h // (Hq / P)",
    "min_block": "smallest block of varblock_sparse",
    "block_bounds": "explicit block bounds [0 = b0 < ... < bn = S] of varblock_sparse in place of drawn ones",
}

MASK_NAMES: tuple[str, ...] = tuple(MASK_SPECS)
STATIC_MASK_NAMES: tuple[str, ...] = tuple(n for n, s in MASK_SPECS.items() if s.kind == "static")


def make_mask(name: str, seqlen: int, *, seed: int = 0, **params: Any) -> Mask:
    """Build mask ``name`` (docs/masks.md §3) for a sequence of ``seqlen`` tokens.

    ``params`` are the mask's parameters (``MASK_SPECS[name].defaults`` lists them with their defaults,
    ``MASK_PARAMETERS`` says what each means): ``window`` and ``global_tokens`` of the sliding windows,
    ``doc_bounds`` / ``doc_lens`` (explicit documents) or ``docs`` / ``distribution`` (drawn ones) of
    the document masks, ``prefix``, ``block``, and ``density`` / ``patterns`` / ``min_block`` /
    ``block_bounds`` of the block-sparse masks. What was drawn from ``seed`` is recorded in
    ``mask.params``.

    >>> m = make_mask("causal_document", 8192, seed=1)
    >>> m.params["doc_bounds"][:3], m.area
    >>> make_mask("sliding_window_causal", 8192, window=256).area
    """
    if name not in MASK_SPECS:
        raise ValueError(f"unknown mask {name!r}; valid masks: {', '.join(MASK_NAMES)}")
    if isinstance(seqlen, bool) or not isinstance(seqlen, (int, np.integer)) or seqlen < 1:
        raise ValueError(f"seqlen must be a positive integer, got {seqlen!r}")
    spec = MASK_SPECS[name]
    unknown = sorted(set(params) - set(spec.defaults))
    if unknown:
        valid = ", ".join(spec.defaults) or "none"
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)} for mask {name!r}; valid parameters: {valid}")
    S = int(seqlen)
    p = {**spec.defaults, **params}
    if "distribution" in p and p["distribution"] is None and p.get("docs") is not None:
        p["distribution"] = histogram_for(S)
    rng = np.random.default_rng(seed)
    built = spec.build(S, rng, p)
    p = {k: v for k, v in p.items() if v is not None and k != "doc_lens"}
    p["seed"] = seed
    if isinstance(built, BlockSparseMask):
        built.params = p
        return built
    return RangeMask(S, S, built, name=name, params=p)

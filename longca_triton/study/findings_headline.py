"""The findings' headline: the numbers behind the main page's conclusions and its comparison with
the paper's key findings (LongCA-bench, ICLR 2026), computed from
:class:`~longca_triton.study.findings.Findings`, never written by hand.

The headline is one *layout* (heads, head dim, dtype, batch): the one with the most compared
(mask, S) cells over its modes (GQA 64:8, D = 128 on the committed results). Its forward and
backward slices give the winners, ours against the best other backend and the backward against
the forward; the memory walls cover every layout; GQA against MHA pairs the rows of layouts that
differ in their KV heads only. A cell counts when two or more backends were measured there
(``findings.compared_cells``): a backend measured alone wins nothing.

Backends are grouped into the paper's families (``FAMILIES``). Masks are classed from the rows
too: *regular* where a FlashAttention kernel ran the mask at every length it was measured,
*heterogeneous* where the FlashAttention kernels refused it somewhere (the mask is not documents
with a window), *block-sparse* for the sparse benches' masks.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from longca_triton.bench.report import mask_label
from longca_triton.bench.store import environment_unsupported, status_kind
from longca_triton.masks.ir import FLOP_MODES

from .findings import KERNEL_KINDS, SPARSE_KINDS, Cell, Findings, compared_cells, is_ours, row_layout, valid_tflops

__all__ = ["FAMILIES", "MODES", "MODE_NAMES", "Headline", "Verdict", "family", "headline", "mask_base", "mask_rows",
           "mode_order", "ours_against_best", "table_lengths"]

#: backend families in the paper's vocabulary: (family, regular expression on the backend's name), first match wins
FAMILIES = (("ours", r"triton(-.*)?"), ("FlashAttention", r"fa[234](-.*)?|varlen-fa2"), ("Flex", r"flex(-.*)?"),
            ("SDPA", r"sdpa-.*"), ("cuDNN", r"cudnn|te"), ("FlashMask", r"flashmask"),
            ("sparse vendors", r"(vsa|flashinfer)-.*"), ("reference", r"reference(-.*)?"))
#: the families the paper says are the only ones that run heterogeneous masks
PAPER_HETEROGENEOUS = ("Flex", "FlashMask", "SDPA")
#: the order modes are shown in, and their names in sentences
MODES = ("fwd", "bwd", "fwd_bwd")
MODE_NAMES = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}


def family(backend: str) -> str:
    """The backend's family (``FAMILIES``), or its own name where none matches."""
    return next((name for name, pattern in FAMILIES if re.fullmatch(pattern, backend)), backend)


def mask_base(label: str) -> str:
    """The mask's name without its swept parameters: ``block_sparse[block=64]`` -> ``block_sparse``."""
    return label.split("[", 1)[0]


def _median(xs) -> float | None:
    xs = list(xs)
    return statistics.median(xs) if xs else None


@dataclass
class Verdict:
    """One of the paper's findings against our numbers: ``agree``, ``disagree`` or ``not measured``,
    with the numbers that decide it (``numbers``; ``key`` names the finding for the page's renderer)."""
    key: str
    claim: str
    verdict: str
    numbers: dict = field(default_factory=dict)


@dataclass
class Headline:
    """The main page's numbers: the headline layout's slices and mask classes, and what each
    conclusion and each of the paper's findings is computed from."""
    layout: tuple  # (heads_q, heads_kv, head dim, dtype, batch)
    slices: dict  # {mode: {mask label: [Cell]}} of the layout, modes in MODES order
    classes: dict  # {mask name: "regular" | "heterogeneous" | "block-sparse" | "unclassified"}
    wins: dict  # {mode: {"cells": compared cells, "families": Counter(family -> wins), "regular": (FA wins, cells)}}
    ours: dict  # {mode: {"cells", "won", "won_heterogeneous", "lost", "median", "worst", "best_other": Counter}}
    bwd_fwd: dict | None  # {"cells", "best", "ours", "time"}: medians of bwd / fwd; "flops": bwd FLOPs / fwd
    walls: list  # [{"backend", "first_fail", "last_ok", "why", "combos", "ours"}], first failing length first
    longest: int | None  # the longest length with a measurement, any layout
    gqa: dict | None  # {"pairs", "layouts", "memory", "memory_ours", "above", "tflops", "tflops_ours"}
    paper: list = field(default_factory=list)  # [Verdict]


def headline(f: Findings) -> Headline | None:
    """The headline numbers of ``f``; None without a compared kernel cell."""
    layout = _headline_layout(f)
    if layout is None:
        return None
    slices = {sk[0]: masks for sk, masks in sorted(f.cells.items(), key=lambda kv: mode_order(kv[0][0]))
              if sk[1:] == layout}
    classes = _mask_classes([r for r in f.rows if r.get("kind") in KERNEL_KINDS and row_layout(r) == layout])
    h = Headline(layout=layout, slices=slices, classes=classes,
                 wins={mode: _family_wins(masks, classes) for mode, masks in slices.items()},
                 ours={mode: _ours_summary(masks, classes) for mode, masks in slices.items()},
                 bwd_fwd=_bwd_over_fwd(slices.get("fwd", {}), slices.get("bwd", {})),
                 walls=_wall_summary(f), longest=_longest(f), gqa=_gqa_vs_mha(f))
    h.paper = _paper(h, f)
    return h


def mode_order(mode) -> int:
    """A mode's place in ``MODES`` (an unknown mode last), to sort by."""
    return MODES.index(mode) if mode in MODES else len(MODES)


def _headline_layout(f: Findings) -> tuple | None:
    """The layout with the most compared cells over its modes (the first such on a tie)."""
    score: Counter = Counter()
    for sk, masks in f.cells.items():
        score[sk[1:]] += len(compared_cells(masks))
    best = max(score.values(), default=0)
    return next((k for k, n in score.items() if n == best), None) if best else None


def _mask_classes(rows: list[dict]) -> dict[str, str]:
    """Each mask name of the rows: ``block-sparse`` (a sparse bench's rows), ``regular`` (some
    FlashAttention kernel ran it, in some mode, wherever its machine had it), ``heterogeneous``
    (no FlashAttention kernel did, and one refused it), else ``unclassified``."""
    kinds: dict = defaultdict(set)
    out = {}
    for r in rows:
        if r["kind"] in SPARSE_KINDS:
            out[r["mask"]] = "block-sparse"
        elif family(r["backend"]) == "FlashAttention" and not environment_unsupported(r):
            kinds[(r["mask"], r["backend"], r["mode"])].add("ok" if valid_tflops(r) is not None else status_kind(r))
    for m in dict.fromkeys(r["mask"] for r in rows if r["mask"] not in out):
        mine = [k for (mask, _, _), k in kinds.items() if mask == m]
        out[m] = ("regular" if any(k == {"ok"} for k in mine) else
                  "heterogeneous" if any("unsupported" in k for k in mine) else "unclassified")
    return out


def _family_wins(masks: dict, classes: dict) -> dict:
    cells = compared_cells(masks)
    families = Counter(family(c.winner[0]) for _, c in cells)
    regular = [c for m, c in cells if classes.get(mask_base(m)) == "regular"]
    return {"cells": len(cells), "families": families,
            "regular": (sum(family(c.winner[0]) == "FlashAttention" for c in regular), len(regular)),
            "regular_families": Counter(family(c.winner[0]) for c in regular)}


def _best(c: Cell | None, ours: bool) -> tuple[str, float] | None:
    """The fastest of ours (or of the others) measured in the cell."""
    if c is None:
        return None
    return next(((b, t) for b, t in c.ranking if is_ours(b) == ours), None)


def ours_against_best(c: Cell | None) -> tuple[float, str] | None:
    """(our best TFLOP/s / the best other backend's, that backend) where both were measured."""
    ours, other = _best(c, True), _best(c, False)
    return (ours[1] / other[1], other[0]) if ours and other else None


def _ours_summary(masks: dict, classes: dict) -> dict:
    pairs = [(m, x) for m, c in compared_cells(masks) if (x := ours_against_best(c))]
    lost = sorted(r for _, (r, _) in pairs if r < 1)
    won = [m for m, (r, _) in pairs if r >= 1]
    return {"cells": len(pairs), "won": len(won), "lost": len(lost), "median": _median(lost),
            "worst": lost[0] if lost else None,
            "won_heterogeneous": sum(classes.get(mask_base(m)) == "heterogeneous" for m in won),
            "best_other": Counter(b for _, (r, b) in pairs if r < 1)}


def _bwd_over_fwd(fwd: dict, bwd: dict) -> dict | None:
    """Medians over the (mask, S) cells measured in both modes: the fastest backward's TFLOP/s over
    the fastest forward's, the same for ours, and the backward's time over the forward's (its FLOPs
    are ``FLOP_MODES["bwd"]`` times the forward's)."""
    best, ours = [], []
    for m, cells in bwd.items():
        at = {c.seqlen: c for c in fwd.get(m, [])}
        for c in cells:
            a = at.get(c.seqlen)
            if a is not None and a.winner and c.winner:
                best.append(c.winner[1] / a.winner[1])
            ob, oa = _best(c, True), _best(a, True)
            if ob and oa:
                ours.append(ob[1] / oa[1])
    if not best:
        return None
    return {"cells": len(best), "best": _median(best), "ours": _median(ours), "flops": FLOP_MODES["bwd"],
            "time": _median(FLOP_MODES["bwd"] / x for x in best)}


def _wall_summary(f: Findings) -> list[dict]:
    """Per backend that failed for memory: the smallest failing length over every slice and mask,
    the largest length it ran below that, why, and in how many (slice, mask) combinations."""
    by: dict = defaultdict(list)
    for w in f.walls:
        by[w["backend"]].append(w)
    out = []
    for b, ws in by.items():
        first = min(w["first_fail"] for w in ws)
        at = [w for w in ws if w["first_fail"] == first]
        below = [w["last_ok"] for w in at if w["last_ok"] is not None]
        out.append({"backend": b, "first_fail": first, "last_ok": max(below) if below else None, "why": at[0]["why"],
                    "combos": len(ws), "ours": is_ours(b),
                    "modes": sorted({w["slice"][0] for w in ws}, key=mode_order),
                    "layouts": list(dict.fromkeys(w["slice"][1:4] for w in ws))})
    return sorted(out, key=lambda w: (w["first_fail"], w["backend"]))


def _longest(f: Findings) -> int | None:
    return max((r["seqlen"] for r in f.rows if r.get("kind") in KERNEL_KINDS and valid_tflops(r) is not None),
               default=None)


def _gqa_vs_mha(f: Findings) -> dict | None:
    """Medians of GQA rows over the MHA rows of the same backend, mode, mask, length, query heads
    and head dims: peak memory, peak memory above the inputs, TFLOP/s (all backends, and ours)."""
    points: dict = defaultdict(dict)
    for r in f.rows:
        if r.get("kind") in KERNEL_KINDS and valid_tflops(r) is not None:
            hq, hkv, *rest = row_layout(r)
            points[(r["backend"], r["mode"], mask_label(r), r["seqlen"], hq, *rest)][hkv] = r
    pairs = [(key[0], r, by[key[4]]) for key, by in points.items() if key[4] in by
             for hkv, r in by.items() if hkv and hkv < key[4]]
    if not pairs:
        return None

    def ratios(field_, ours=None):
        return _median(r[field_] / m[field_] for b, r, m in pairs if (ours is None or is_ours(b) == ours)
                       and _positive(r.get(field_)) and _positive(m.get(field_)))

    return {"pairs": len(pairs), "layouts": sorted({f"{r['heads_q']}:{r['heads_kv']} vs {m['heads_q']}:{m['heads_kv']}"
                                                    for _, r, m in pairs}),
            "memory": ratios("peak_mem_bytes"), "memory_ours": ratios("peak_mem_bytes", True),
            "above": ratios("peak_mem_above_bytes"), "tflops": ratios("tflops"), "tflops_ours": ratios("tflops", True)}


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def mask_rows(h: Headline) -> list[str]:
    """The headline's mask labels in the mask catalogue's order, each mask's variants after it."""
    from longca_triton.masks import MASK_NAMES

    labels = list(dict.fromkeys(m for masks in h.slices.values() for m in masks))
    return sorted(labels, key=lambda m: (MASK_NAMES.index(mask_base(m)) if mask_base(m) in MASK_NAMES else len(MASK_NAMES),
                                         labels.index(m)))


def table_lengths(slices: dict, most: int = 4) -> list[int]:
    """Up to ``most`` lengths for the main page's tables, spread from the shortest to the longest
    among those measured for at least two thirds as many masks as the best-covered length (a length
    only a few masks reach is left to each mask's longest-length column)."""
    count = Counter(c.seqlen for masks in slices.values() for cells in masks.values() for c in cells if c.winner)
    if not count:
        return []
    top = max(count.values())
    keep = sorted(s for s, n in count.items() if 3 * n >= 2 * top)
    if len(keep) <= most:
        return keep
    return [keep[i] for i in sorted({round(i * (len(keep) - 1) / (most - 1)) for i in range(most)})]


# ---------------------------------------------------------------------------- the paper
def _paper(h: Headline, f: Findings) -> list[Verdict]:
    return [_fa_on_regular(h), _heterogeneous(h, f), _sparse_specialists(h, f), _backward(h), _gqa_memory(h)]


def _fa_on_regular(h: Headline) -> Verdict:
    claim = "FA-family kernels are fastest on regular masks"
    per = {mode: w["regular"] for mode, w in h.wins.items() if w["regular"][1]}
    if not per:
        return Verdict("regular", claim, "not measured")
    ok = all(2 * won > n for won, n in per.values())
    runner = {mode: next((fam for fam, _ in h.wins[mode]["regular_families"].most_common() if fam != "FlashAttention"),
                         None) for mode in per}
    return Verdict("regular", claim, "agree" if ok else "disagree",
                   {"per_mode": per, "masks": [m for m, k in h.classes.items() if k == "regular"], "runner": runner})


def _heterogeneous(h: Headline, f: Findings) -> Verdict:
    """Which families ran every heterogeneous mask wherever their machine had them (some backend of
    the family, in every mode it was measured in), which ran some, which refused them all, which
    were absent; per family the backends that ran one of them so."""
    claim = "only Flex/FlashMask/SDPA run heterogeneous masks"
    masks = [m for m, k in h.classes.items() if k == "heterogeneous"]
    if not masks:
        return Verdict("heterogeneous", claim, "not measured")
    kinds: dict = defaultdict(set)  # (family, backend, mask) -> row kinds
    for r in f.rows:
        if r.get("kind") in KERNEL_KINDS and r["mask"] in masks and row_layout(r) == h.layout:
            kinds[(family(r["backend"]), r["backend"], r["mask"])].add(
                "absent" if environment_unsupported(r) else "ok" if valid_tflops(r) is not None else status_kind(r))
    fams = [fam for fam in dict.fromkeys(fam for fam, _, _ in kinds) if fam != "reference"]  # no kernel to choose
    ran = {fam: [m for m in masks if any(k - {"absent"} == {"ok"} for (g, _, mm), k in kinds.items() if (g, mm) == (fam, m))]
           for fam in fams}
    absent = [fam for fam in fams if all(k == {"absent"} for (g, _, _), k in kinds.items() if g == fam)]
    every = [fam for fam in fams if len(ran[fam]) == len(masks)]
    vendors = [fam for fam in every if fam != "ours"]
    verdict = "agree" if vendors and set(vendors) <= set(PAPER_HETEROGENEOUS) else "disagree"
    ran_by = {fam: sorted({b for (g, b, _), k in kinds.items() if g == fam and k - {"absent"} == {"ok"}}) for fam in fams}
    return Verdict("heterogeneous", claim, verdict,
                   {"masks": masks, "every": every, "vendors": vendors, "absent": absent, "ran_by": ran_by,
                    "refused": [fam for fam in fams if not ran[fam] and fam not in absent],
                    "some": [fam for fam in fams if 0 < len(ran[fam]) < len(masks)]})


def _sparse_specialists(h: Headline, f: Findings) -> Verdict:
    """Specialised kernels are those measured on the sparse benches only; the others (Flex, dense
    kernels) are general."""
    claim = "specialised sparse kernels win on block-sparse"
    dense = {r["backend"] for r in f.rows if r.get("kind") == "dense"}
    cells = [(mode, c) for mode, masks in h.slices.items() for m, c in compared_cells(masks)
             if h.classes.get(mask_base(m)) == "block-sparse"]
    if not cells:
        return Verdict("sparse", claim, "not measured")
    special = [c.winner[0] for _, c in cells if c.winner[0] not in dense]
    return Verdict("sparse", claim, "agree" if 2 * len(special) > len(cells) else "disagree",
                   {"cells": len(cells), "special": len(special), "winners": Counter(c.winner[0] for _, c in cells),
                    "ours": sum(is_ours(b) for b in special)})


def _backward(h: Headline) -> Verdict:
    claim = "the backward is the bottleneck"
    if not h.bwd_fwd:
        return Verdict("backward", claim, "not measured")
    return Verdict("backward", claim, "agree" if h.bwd_fwd["best"] < 1 else "disagree", h.bwd_fwd)


def _gqa_memory(h: Headline) -> Verdict:
    claim = "GQA saves memory"
    if not h.gqa or h.gqa["memory"] is None:
        return Verdict("gqa", claim, "not measured")
    return Verdict("gqa", claim, "agree" if h.gqa["memory"] < 1 else "disagree", h.gqa)

"""The findings' main page: what a reader needs in two minutes, every number computed from the
rows (:mod:`longca_triton.study.findings_headline`): a header naming the runs the numbers come
from, five conclusions, the paper's key findings against ours, the winner map, ours against the
best other backend per mask, the memory walls, the block-sparse picture, and links to the
appendix (:mod:`longca_triton.study.findings_report`), which holds everything else."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

from longca_triton.bench.report import markdown_table

from .findings import KERNEL_KINDS, Cell, Findings, fmt_s, is_ours, rows_by_file, shorten, time_key
from .findings_headline import (FAMILIES, MODE_NAMES, Headline, Verdict, family, headline, mask_rows, mode_order,
                                ours_against_best, table_lengths)

__all__ = ["render_main", "render_pages"]

TITLE = "# Findings: which kernel wins where"


def render_pages(f: Findings, command: str, out: Path, appendix: Path, written: dict | None = None,
                 masks: Path = Path("docs/masks.md"), h: Headline | None = None) -> dict[Path, str]:
    """``{out: the main page, appendix: the appendix}``, each linking the other, ``masks`` and the
    plots ``written`` (``findings_plots.make_findings_plots``'s answer) relative to itself; ``h``:
    ``headline(f)`` where the caller has it already."""
    from .findings_report import render_appendix

    written = written or {}
    return {out: render_main(f, command, _link(appendix, out), _plot_links(written, out), masks=_link(masks, out), h=h),
            appendix: render_appendix(f, command, _plot_links(written, appendix), main=_link(out, appendix))}


def _link(target: Path, page: Path) -> str:
    """``target`` as a link from ``page``: relative to the page's folder."""
    return Path(os.path.relpath(target, page.parent)).as_posix()


def _plot_links(written: dict, page: Path) -> dict:
    return {k: [(key, _link(p, page)) for key, p in v] for k, v in written.items()}


def render_main(f: Findings, command: str, appendix: str, plots: dict | None = None, masks: str = "masks.md",
                h: Headline | None = None) -> str:
    """The main page. ``appendix`` and ``masks`` (docs/masks.md): links relative to this page;
    ``plots``: {"winner_map" | "sparse": [(key, link)]} relative to this page; ``h``: ``headline(f)``
    where the caller has it already."""
    plots = plots or {}
    h = h or headline(f)
    P = [TITLE, "", *_header(f, h, command, appendix)]
    if h is None:
        return "\n".join(P + ["No (mask, S) cell has two measured backends: nothing to compare. "
                              f"Every row is in the [appendix]({appendix}).", ""])
    lengths = table_lengths(h.slices)
    P += _conclusions(h) + _paper_section(h) + _winner_section(h, lengths, plots, masks) + _ours_section(h, lengths)
    P += _walls_section(h) + _sparse_section(f, plots) + _links(appendix, masks)
    return "\n".join(P).rstrip() + "\n"


# ---------------------------------------------------------------------------- header
def _header(f: Findings, h: Headline | None, command: str, appendix: str) -> list[str]:
    what = ("What: the fastest attention kernel per mask and sequence length, ours (`triton*`) against the vendors', "
            "and where each runs out of memory")
    if h is not None:
        what += f"; headline layout {_layout_title(h.layout)}, every other layout in the [appendix]({appendix})"
    return [what + ".", "",
            f"Regenerate: `{command}` writes this page, the [appendix]({appendix}) and the plots; do not edit by hand.", "",
            "Numbers: " + _runs(f) + ".", ""]


def _layout_title(layout: tuple) -> str:
    hq, hkv, d, dt, b = layout
    return f"heads {hq}:{hkv}, D = {d}, {dt}" + (f", batch {b}" if b != 1 else "")


def _day(r: dict) -> str:
    return time_key(r.get("time"))[:10]


def _span(days: list[str]) -> str:
    days = sorted(d for d in days if d)
    return "" if not days else days[0] if days[0] == days[-1] else f"{days[0]} .. {days[-1]}"


def _runs(f: Findings) -> str:
    """Which runs the rows come from: per GPU and kind (kernels, CP) the files, dates and commits,
    the largest file's share, and when each of our kernels was measured."""
    groups: dict = defaultdict(list)
    for r in f.rows:
        env = r.get("env") or {}
        kind = "kernels" if r.get("kind") in KERNEL_KINDS else "CP"
        groups[(env.get("gpu") or r.get("gpu") or "an unrecorded GPU", kind)].append(r)
    used = sum(1 for i in f.files.values() if i["used"])
    parts = []
    for (gpu, kind), rs in sorted(groups.items(), key=lambda kv: (kv[0][1] != "kernels", str(kv[0][0]))):
        commits = {(r.get("env") or {}).get("git_commit", "")[:7] for r in rs} - {""}
        files = rows_by_file(rs)
        top = max(files, key=lambda p: len(files[p]))
        source = f"{len(files)} files" if len(files) > 1 else f"`{top}`"
        text = (f"{kind} on {gpu}, {len(rs):,} rows of {source}, {_span([_day(r) for r in rs])}, "
                f"{len(commits)} commit{'s' if len(commits) != 1 else ''}")
        if len(files) > 1:
            text += f" ({len(files[top]) / len(rs):.0%} from `{top}`, {_span([_day(r) for r in files[top]])})"
        parts.append(text)
    ours: dict = defaultdict(list)
    for r in f.rows:
        if r.get("kind") in KERNEL_KINDS and is_ours(r["backend"]):
            ours[r["backend"]].append(_day(r))
    text = f"{len(f.rows):,} rows of {used} of the {len(f.files)} results files read: " + "; ".join(parts)
    if ours:
        text += "; ours measured " + ", ".join(f"{b} {_span(d)}" for b, d in sorted(ours.items()))
    return text + (". A row is as old as its run: the code may have moved on since (every file's dates and commits: "
                   "the appendix's Sources)")


# ---------------------------------------------------------------------------- conclusions
def _n_of(won: int, n: int) -> str:
    return f"{won} of {n}"


def _count(n: int, what: str) -> str:
    return f"{n:,} {what}{'s' if n != 1 else ''}"


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def _conclusions(h: Headline) -> list[str]:
    out = ["## Five conclusions", ""]
    wins = "; ".join(f"{_mode_name(m)}, of {w['cells']} compared (mask, S) cells: "
                     + ", ".join(f"{fam} {k}" for fam, k in w["families"].most_common()) for m, w in h.wins.items())
    out.append(f"1. **Who wins, by family.** {wins[0].upper() + wins[1:]} (families: {_family_key(h)}).")
    out.append("2. **Ours against the best other backend.** " + _ours_sentence(h))
    out.append("3. **The backward.** " + _backward_sentence(h))
    out.append("4. **Memory walls.** " + _walls_sentence(h))
    out.append("5. **GQA against MHA.** " + _gqa_sentence(h))
    return out + [""]


def _mode_name(mode: str) -> str:
    return MODE_NAMES.get(mode, mode)


def _most(counter) -> str:
    """The most frequent entry of a Counter with its count, every one tied with it named."""
    top = counter.most_common()
    tied = [k for k, n in top if n == top[0][1]]
    return f"{', '.join(tied)} ({top[0][1]} cells{' each' if len(tied) > 1 else ''})"


def _family_key(h: Headline) -> str:
    seen = sorted({b for masks in h.slices.values() for cells in masks.values() for c in cells for b, _ in c.ranking})
    by: dict = defaultdict(list)
    for b in seen:
        by[family(b)].append(b)
    order = [name for name, _ in FAMILIES]
    return "; ".join(f"{fam}: {', '.join(bs)}" for fam, bs in sorted(by.items(), key=lambda kv: (
        order.index(kv[0]) if kv[0] in order else len(order), kv[0])))


def _ours_sentence(h: Headline) -> str:
    lost = [(m, o) for m, o in h.ours.items() if o["lost"]]
    won = [(m, o) for m, o in h.ours.items() if o["cells"]]
    if not won:
        return "no cell measured ours beside another backend."
    text = ""
    if lost:
        whose = ["the best other backend's TFLOP/s "] + [""] * (len(lost) - 1)  # said once
        medians = [f"{_x(o['median'])} {w}{_mode_name(m)} (worst {_x(o['worst'])}, most often behind "
                   f"{_most(o['best_other'])})" for w, (m, o) in zip(whose, lost)]
        text = ("Where ours lose (" + ", ".join(f"{o['lost']} of {o['cells']} {_mode_name(m)} cells" for m, o in lost)
                + "), our best kernel runs at a median " + " and ".join(medians) + "; ")
    wins = [f"{o['won']} {_mode_name(m)} cells ({o['won_heterogeneous']} on heterogeneous masks)" for m, o in won]
    return text + "ours win " + ", ".join(wins) + "."


def _backward_sentence(h: Headline) -> str:
    b = h.bwd_fwd
    if not b:
        return "not measured: no (mask, S) cell of the headline layout was measured in both modes."
    ours = f" (ours {_x(b['ours'])})" if b["ours"] is not None else ""
    return (f"Over {b['cells']} (mask, S) cells measured in both modes, the fastest backward reaches a median "
            f"{_x(b['best'])} the fastest forward's TFLOP/s{ours}; with {b['flops']:g}× the forward's FLOPs it takes a "
            f"median {_x(b['time'])} the forward's time.")


def _walls_sentence(h: Headline) -> str:
    longest = f"up to the longest length measured, {fmt_s(h.longest)}" if h.longest else "at the lengths measured"
    if not h.walls:
        return f"no backend failed for memory {longest}."
    walls = "; ".join(f"{w['backend']} fails from {fmt_s(w['first_fail'])} (largest run below: "
                      f"{fmt_s(w['last_ok']) if w['last_ok'] else 'none'}; {_why(w['why'])})" for w in h.walls)
    ours = [w["backend"] for w in h.walls if w["ours"]]
    rest = (f"of ours, {', '.join(ours)} failed for memory too" if ours else "none of ours")
    return f"{walls}. No other backend failed for memory {longest} ({rest})."


def _why(why: str) -> str:
    """A memory failure's reason, its first clause: ``out of memory``, or the refusal's reason."""
    return why.split(" (", 1)[0].split(";", 1)[0]


def _gqa_sentence(h: Headline) -> str:
    g = h.gqa
    if not g or g["memory"] is None:
        return "not measured: no GQA row has an MHA row of the same backend, mode, mask and length."
    def ours(v):
        return f" (ours {_x(v)})" if v is not None else ""

    return (f"Over {_count(g['pairs'], '(backend, mode, mask, S) pair')} of {' and '.join(g['layouts'])} rows, GQA's "
            f"peak memory is a median {_x(g['memory'])} MHA's{ours(g['memory_ours'])}, the memory above the inputs "
            f"{_x(g['above'])} (the saving is the smaller K and V), at {_x(g['tflops'])} the TFLOP/s"
            f"{ours(g['tflops_ours'])}.")


# ---------------------------------------------------------------------------- the paper
def _paper_section(h: Headline) -> list[str]:
    rows = [[f"{i}. {v.claim}", _evidence(v), f"**{v.verdict}**"] for i, v in enumerate(h.paper, 1)]
    return ["## Against the paper's key findings", "",
            "LongCA-bench (ICLR 2026) against our numbers above (headline layout; the verdict is computed from them):", "",
            markdown_table(["the paper", "our numbers", "verdict"], rows), ""]


def _evidence(v: Verdict) -> str:
    return "no rows of ours decide it" if v.verdict == "not measured" else _EVIDENCE[v.key](v.numbers)


def _regular_evidence(n: dict) -> str:
    per = ", ".join(f"{_n_of(*n['per_mode'][m])} {_mode_name(m)}" for m in n["per_mode"])
    runner = ", ".join(f"{r} {_mode_name(m)}" for m, r in n["runner"].items() if r)
    return (f"FlashAttention wins {per} cells on the regular masks ({', '.join(n['masks'])})"
            + (f"; next: {runner}" if runner else ""))


def _heterogeneous_evidence(n: dict) -> str:
    def names(fams):
        return ", ".join(f"{fam} ({', '.join(n['ran_by'][fam])})" for fam in fams) or "none"

    text = (f"of the {_count(len(n['masks']), 'heterogeneous mask')} ({', '.join(n['masks'])}), every one at every "
            f"length ran on {names(n['every'])}")
    if n["some"]:
        text += f"; some on {names(n['some'])}"
    if n["refused"]:
        text += f"; {', '.join(n['refused'])} refused every one of them at some length"
    if n["absent"]:
        text += f"; {', '.join(n['absent'])} not installed (absent)"
    return text


def _sparse_evidence(n: dict) -> str:
    return (f"specialised kernels win {_n_of(n['special'], n['cells'])} compared block-sparse cells "
            f"({', '.join(f'{b} {k}' for b, k in n['winners'].most_common())}); {n['ours']} of them ours")


def _backward_evidence(n: dict) -> str:
    return (f"the fastest backward reaches a median {_x(n['best'])} the fastest forward's TFLOP/s over {n['cells']} cells, "
            f"taking {_x(n['time'])} its time")


def _gqa_evidence(n: dict) -> str:
    return (f"GQA's peak memory is a median {_x(n['memory'])} MHA's over {_count(n['pairs'], 'pair')} "
            f"({' and '.join(n['layouts'])})")


#: the sentence of each of the paper's findings (``Verdict.key``) from its numbers
_EVIDENCE = {"regular": _regular_evidence, "heterogeneous": _heterogeneous_evidence, "sparse": _sparse_evidence,
             "backward": _backward_evidence, "gqa": _gqa_evidence}


# ---------------------------------------------------------------------------- tables
def _cell(h: Headline, mode: str, mask: str, S: int) -> Cell | None:
    return next((c for c in h.slices[mode].get(mask, []) if c.seqlen == S), None)


def _longest_of(h: Headline, mask: str) -> int | None:
    return max((c.seqlen for masks in h.slices.values() for c in masks.get(mask, []) if c.winner), default=None)


def _per_mask_table(h: Headline, lengths: list[int], text) -> str:
    """Rows = masks, columns = ``lengths`` and each mask's longest measured length where it is not
    one of them; a cell is ``text(cell)`` per mode, joined by " / " (one "—" where no mode has one)."""
    def at(m, S) -> str:
        cells = [text(_cell(h, mode, m, S)) for mode in h.slices]
        return "—" if all(c == "—" for c in cells) else " / ".join(cells)

    rows = []
    for m in mask_rows(h):
        S = _longest_of(h, m)
        rows.append([m, *(at(m, s) for s in lengths), f"{fmt_s(S)}: {at(m, S)}" if S and S not in lengths else ""])
    return markdown_table(["mask", *(fmt_s(S) for S in lengths), "longest, if not a column"], rows)


def _winner_text(c: Cell | None) -> str:
    if c is None or not c.winner:
        return "—"
    return c.winner[0] + ("" if len(c.ranking) > 1 else " (alone)")


def _ours_text(c: Cell | None) -> str:
    x = ours_against_best(c)
    if x is None:
        return "—"
    ratio, other = x
    return f"**{ratio:.2f}** {other}" if ratio >= 1 else f"{ratio:.2f} {other}"


def _modes_note(h: Headline) -> str:
    return " / ".join(_mode_name(m) for m in h.slices)


def _winner_section(h: Headline, lengths: list[int], plots: dict, masks: str) -> list[str]:
    out = ["## Winner map", "",
           ("Colour = the winning backend, × = its margin over the runner-up, grey = nothing measured; "
            f"{_layout_title(h.layout)}; TFLOP/s count the mask's allowed area only ([masks.md §5]({masks}#5-counting-work)). "
            f"No row is longer than {fmt_s(h.longest)}: for a longer sequence "
            "`longca-triton recommend --mask M --seqlen 128K` ranks the backends at the nearest measured length, and says so."), ""]
    out += [f"![winner by mask and length, {_modes_note(h)}]({p})\n" for key, p in plots.get("winner_map", [])
            if key == h.layout]
    out += [f"Winner per cell, {_modes_note(h)} (alone: the only backend measured there):", "",
            _per_mask_table(h, lengths, _winner_text), ""]
    return out


def _ours_section(h: Headline, lengths: list[int]) -> list[str]:
    return ["## Ours against the best other backend", "",
            (f"Cell: our best kernel's TFLOP/s over the best other backend's, and who that is, {_modes_note(h)}; "
             "bold: ours win (the other is then the runner-up); —: ours or every other backend not measured there."), "",
            _per_mask_table(h, lengths, _ours_text), ""]


def _walls_section(h: Headline) -> list[str]:
    out = ["## Memory walls", ""]
    if not h.walls:
        return out + [_walls_sentence(h), ""]
    rows = [[w["backend"], fmt_s(w["first_fail"]), fmt_s(w["last_ok"]) if w["last_ok"] else "none",
             f"{w['combos']} (slice, mask): {'+'.join(w['modes'])}, heads "
             + ", ".join(f"{hq}:{hkv} D {d}" for hq, hkv, d in w["layouts"]), shorten(w["why"], 70)] for w in h.walls]
    return out + [markdown_table(["backend", "fails from S", "largest S run below", "where", "why"], rows), ""]


def _sparse_section(f: Findings, plots: dict) -> list[str]:
    out = ["## Block-sparse", ""]
    if not f.sparse:
        return out + ["No block-sparse rows in these results.", ""]
    images = [f"![block-sparse TFLOP/s against density]({p})" for _, p in plots.get("sparse", [])]
    return out + images + [""] * bool(images) + [_sparse_line(f), ""]


def _sparse_line(f: Findings) -> str:
    """Per mode and (mask, block): the fastest backend's median TFLOP/s over densities and lengths,
    and the next one's."""
    import statistics

    by: dict = defaultdict(lambda: defaultdict(list))
    for d in f.sparse:
        if d["tflops"] is not None:
            by[(d["slice"][0], d["mask"], d["block"])][d["backend"]].append(d["tflops"])
    parts = []
    for (mode, m, block), backends in sorted(by.items(), key=lambda kv: (kv[0][1], -(kv[0][2] or 0), mode_order(kv[0][0]))):
        med = sorted(((statistics.median(ts), b) for b, ts in backends.items()), reverse=True)
        parts.append(f"{mode} {m} block {block}: {med[0][1]} {med[0][0]:.0f}"
                     + (f" (next {med[1][1]} {med[1][0]:.0f})" if len(med) > 1 else ""))
    return ("TFLOP/s against density and block size; median TFLOP/s over densities and lengths: " + "; ".join(parts)
            + " (every point: the appendix).")


def _links(appendix: str, masks: str) -> list[str]:
    return ["## More", "",
            (f"- [The appendix]({appendix}): sources and coverage per results file, every layout's per-mask per-length "
             "winners with runner-up and margin, crossovers, every cell where ours lose, the support matrix with "
             "reasons, block-sparse points, context-parallel efficiency."),
            f"- [docs/masks.md]({masks}): the masks and how work is counted.", ""]

"""``findings``: the study's findings, generated from result rows, never written by hand.

From the bench rows of any number of results files (``bench dense | sparse | varblock`` rows, and
``bench cp`` rows when given) this module computes, per slice (mode, heads, head dim, dtype,
batch) and per mask:

* the winner at each measured length and its margin over the runner-up;
* crossovers: the lengths between which the winner changes, and from whom to whom;
* where our kernels (backends named ``triton*``) lose, and by how much (ratio to the best);
* memory walls: the smallest length at which a backend ran out of memory (``oom`` rows, errors
  saying so, and backends that refuse a size because it would not fit), with the largest length
  it ran below it;
* the support matrix: backend x mask, ``ok`` / ``unsupported`` / ``error`` / ``OOM`` / ``absent`` with
  reasons;
* coverage: per results file the lengths and points it holds (a length with fewer problems than the
  file's fullest, or with some problems run by fewer backends than others, is called partial) and
  the backends absent from its machine;
* block-sparse TFLOP/s against density and block size;
* context-parallel efficiency per scheme and mask (best plan), when CP rows are given;

and renders them as markdown whose header names the files, the command and the environment.

Rules, so that nothing is invented: a point's latest row wins (a retried point supersedes its
earlier row, across files too, by the row's ``time``), except that a row saying the machine lacked
the backend never hides a row that ran the case (``bench.report.latest_rows``); only ``ok`` rows
with a finite positive TFLOP/s count as measurements (failed rows and NaN / zero TFLOP/s never
win); a backend absent from a run's machine (``unsupported`` because it is not installed, no GPU,
the wrong architecture: ``bench.store.environment_unsupported``) is listed as absent, never as
failing or losing, and is left out of the support matrix's verdicts on the case; a backend that has
rows for a mask at other lengths but none at this one is listed as "not measured" there; where
only one length (or one density) is measured the text says that no crossover (or trend) can be
stated.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from longca_triton.bench.report import latest_rows, markdown_table, mask_label, row_time
from longca_triton.bench.store import (
    RESULTS_PATTERNS,
    ResultStore,
    environment_unsupported,
    prefer_plain,
    status_kind,
)

__all__ = ["KERNEL_KINDS", "Cell", "Findings", "collect_paths", "compute", "load_results", "render_markdown",
           "valid_tflops"]

#: row kinds that time one kernel on one GPU (the winner tables); CP rows are kind "cp"
KERNEL_KINDS = ("dense", "sparse", "varblock")
SPARSE_KINDS = ("sparse", "varblock")
#: an error or refusal that is about memory (a memory wall, not a missing feature)
MEMORY_WORDS = re.compile(r"out of memory|\boom\b|cuda_error_out_of_memory|cannot allocate|materiali[sz]es|"
                          r"does not fit|too large for memory", re.IGNORECASE)
OURS_PREFIX = "triton"


# ---------------------------------------------------------------------------- loading
def collect_paths(inputs: Iterable[str | Path]) -> list[Path]:
    """Files as given; directories searched recursively for ``*.jsonl`` and ``*.jsonl.gz`` (where
    both ``X.jsonl`` and ``X.jsonl.gz`` are found, the plain one, with a warning:
    ``bench.store.prefer_plain``). A missing path, or a directory without any results file, is an
    error naming it."""
    out: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for pattern in RESULTS_PATTERNS for f in p.rglob(pattern))
            if not found:
                raise FileNotFoundError(f"no *.jsonl (or *.jsonl.gz) results file under {p}")
            out += prefer_plain(found)
        elif p.exists():
            out.append(p)
        else:
            raise FileNotFoundError(f"results path {p} does not exist")
    return list(dict.fromkeys(out))


def load_results(paths: Iterable[Path]) -> tuple[list[dict], dict[str, dict]]:
    """The bench rows of ``paths`` (each tagged with ``_file``; old backend names canonical), one
    per point, and per file ``{"rows": read, "used": kept, "ignored": not bench rows}``."""
    from longca_triton.adapters.base import canonical_name

    rows, per_file = [], {}
    for p in paths:
        store = ResultStore(p)
        got = store.rows()
        mine = [r for r in got if r.get("kind") in (*KERNEL_KINDS, "cp") and r.get("backend") and r.get("status")
                and r.get("seqlen") and r.get("mode")]
        for r in mine:
            r["_file"] = str(p)
            r["backend"] = canonical_name(r["backend"])
        per_file[str(p)] = {"rows": len(got), "ignored": len(got) - len(mine) + store.skipped_lines, "used": 0}
        rows += mine
    # the latest row of a point wins, across files (file order breaks ties); a "not installed" row
    # never hides a row that ran the case (report.latest_rows)
    rows = latest_rows(rows)
    for r in rows:
        per_file[r["_file"]]["used"] += 1
    return rows, per_file


def _time_key(t) -> str:
    """Row times are ISO strings, some without a zone (CP rows): compare them as UTC text."""
    return row_time({"time": t})


def valid_tflops(r: dict) -> float | None:
    """The row's TFLOP/s if it is a measurement (status ok, finite and positive), else None."""
    if status_kind(r) != "ok":
        return None
    t = r.get("tflops")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        return None
    return float(t)


def _slice(r: dict) -> tuple:
    # D_v != D_qk is its own slice, labelled "192/128" as the bench's plots name it (d192-128)
    d, dv = r.get("head_dim"), r.get("d_v")
    dims = f"{d}/{dv}" if dv is not None and d is not None and dv != d else d
    return (r.get("mode"), r.get("heads_q"), r.get("heads_kv"), dims, r.get("dtype"), r.get("batch") or 1)


def slice_title(key: tuple) -> str:
    mode, hq, hkv, d, dt, b = key
    return f"{mode}, heads {hq}:{hkv}, D = {d}, {dt}" + (f", batch {b}" if b != 1 else "")


def fmt_s(s: int) -> str:
    if s >= 1 << 20 and s % (1 << 20) == 0:
        return f"{s >> 20}M"
    return f"{s // 1024}K" if s >= 1024 and s % 1024 == 0 else str(s)


def _short(text: str, n: int = 110) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _reason(r: dict) -> str:
    """Why a row is not a measurement, one line."""
    s = str(r.get("status", ""))
    if status_kind(r) == "ok":
        return f"ok but TFLOP/s = {r.get('tflops')!r}"
    if status_kind(r) == "oom":
        return "out of memory" + (f" ({_short(r['detail'], 80)})" if r.get("detail") else "")
    return _short(s)


def is_memory_failure(r: dict) -> bool:
    return status_kind(r) == "oom" or (status_kind(r) in ("error", "unsupported") and bool(MEMORY_WORDS.search(str(r.get("status")))))


# ---------------------------------------------------------------------------- computing
@dataclass
class Cell:
    """One (slice, mask, S): who was measured, who won, by how much, who did not run and why."""
    seqlen: int
    ranking: list = field(default_factory=list)  # [(backend, tflops)] best first
    failed: dict = field(default_factory=dict)  # backend -> reason (rows that are not measurements)
    absent: list = field(default_factory=list)  # backends whose row says the machine lacked them
    not_measured: list = field(default_factory=list)  # backends of this mask with no row at this S

    @property
    def winner(self):
        return self.ranking[0] if self.ranking else None

    @property
    def margin(self) -> float | None:
        return self.ranking[0][1] / self.ranking[1][1] if len(self.ranking) > 1 else None


@dataclass
class Findings:
    files: dict
    rows: list
    #: {slice: {mask label: [Cell...] by S}}
    cells: dict = field(default_factory=dict)
    crossovers: dict = field(default_factory=dict)  # {(slice, mask): [(S_a, S_b, from, to)] or str}
    losses: list = field(default_factory=list)  # dicts: slice, mask, S, ours, tflops, best, best_tflops, ratio
    walls: list = field(default_factory=list)  # dicts: backend, slice, mask, first_fail, last_ok, why
    support: dict = field(default_factory=dict)  # {(backend, mask): {mode: (kind, reason, lengths)}}
    sparse: list = field(default_factory=list)  # dicts: slice, mask, block, S, density, backend, tflops
    cp: list = field(default_factory=list)  # dicts: gpu, world, tokens, mode, mask, scheme, plan, efficiency


def compute(rows: list[dict], files: dict | None = None, mode: str | None = None) -> Findings:
    """Everything the markdown shows, from deduplicated rows (``load_results``)."""
    if mode is not None:
        rows = [r for r in rows if r.get("mode") == mode]
    f = Findings(files=files or {}, rows=rows)
    kern = [r for r in rows if r.get("kind") in KERNEL_KINDS]
    by_slice: OrderedDict[tuple, OrderedDict[str, list]] = OrderedDict()
    for r in sorted(kern, key=lambda r: (str(r.get("mode")), r.get("heads_q") or 0, r.get("heads_kv") or 0)):
        by_slice.setdefault(_slice(r), OrderedDict()).setdefault(mask_label(r), []).append(r)
    for sk, masks in by_slice.items():
        f.cells[sk] = {}
        for m, mrows in masks.items():
            backends = list(dict.fromkeys(r["backend"] for r in mrows))
            cells = []
            for S in sorted({r["seqlen"] for r in mrows}):
                at = [r for r in mrows if r["seqlen"] == S]
                c = Cell(S)
                c.ranking = sorted(((r["backend"], t) for r in at if (t := valid_tflops(r)) is not None), key=lambda x: -x[1])
                c.failed = {r["backend"]: _reason(r) for r in at if valid_tflops(r) is None and not environment_unsupported(r)}
                c.absent = [r["backend"] for r in at if environment_unsupported(r)]
                present = {r["backend"] for r in at}
                c.not_measured = [b for b in backends if b not in present]
                cells.append(c)
            f.cells[sk][m] = cells
            f.crossovers[(sk, m)] = _crossovers(cells)
            f.losses += _losses(sk, m, cells)
            f.walls += _walls(sk, m, mrows)
    f.support = _support(kern)
    f.sparse = [{"slice": _slice(r), "mask": r["mask"], "block": (r.get("variant") or {}).get("block"),
                     "nominal": (r.get("variant") or {}).get("density"), "density": r.get("density"), "S": r["seqlen"],
                     "backend": r["backend"], "tflops": valid_tflops(r), "status": _reason(r) if valid_tflops(r) is None else "ok"}
                for r in kern if r.get("kind") in SPARSE_KINDS]
    f.cp = _cp(rows)
    return f


def _crossovers(cells: list[Cell]):
    """``[(S_a, S_b, X, Y)]`` where X won at S_a, Y at the next length S_b, and both were measured
    at both lengths (X beat Y at S_a, Y beat X at S_b); a change of winner only because one of them
    was not measured at the other length is no crossover and is said so (a string), as is too
    little data."""
    won = [c for c in cells if c.winner]
    if not won:
        return "no length has a measured backend: no winner, no crossover"
    if len(won) == 1:
        return f"one length measured ({won[0].seqlen}): no crossover can be stated"
    changes, unproven = [], []
    for a, b in itertools.pairwise(won):
        x, y = a.winner[0], b.winner[0]
        if x == y:
            continue
        if y in dict(a.ranking) and x in dict(b.ranking):
            changes.append((a.seqlen, b.seqlen, x, y))
        else:
            missing = [f"{y} at {a.seqlen}"] * (y not in dict(a.ranking)) + [f"{x} at {b.seqlen}"] * (x not in dict(b.ranking))
            unproven.append(f"the winner is {x} at {a.seqlen} and {y} at {b.seqlen}, but {' and '.join(missing)} "
                            f"{'was' if len(missing) == 1 else 'were'} not measured: no crossover can be stated")
    if changes:
        return changes + unproven
    if unproven:
        return "; ".join(unproven)
    return f"{won[0].winner[0]} wins at every measured length ({', '.join(str(c.seqlen) for c in won)}): no crossover"


def _losses(sk, mask, cells: list[Cell]) -> list[dict]:
    out = []
    for c in cells:
        if not c.winner:
            continue
        best, best_t = c.winner
        for b, t in c.ranking:
            if b.startswith(OURS_PREFIX) and b != best and not best.startswith(OURS_PREFIX):
                out.append({"slice": sk, "mask": mask, "S": c.seqlen, "ours": b, "tflops": t, "best": best, "best_tflops": best_t,
                                "ratio": t / best_t})
    return out


def _walls(sk, mask, mrows: list[dict]) -> list[dict]:
    out = []
    for b in dict.fromkeys(r["backend"] for r in mrows):
        mine = sorted((r for r in mrows if r["backend"] == b), key=lambda r: r["seqlen"])
        fails = [r for r in mine if is_memory_failure(r)]
        if not fails:
            continue
        first = fails[0]
        ok_below = [r["seqlen"] for r in mine if valid_tflops(r) is not None and r["seqlen"] < first["seqlen"]]
        ok_above = [r["seqlen"] for r in mine if valid_tflops(r) is not None and r["seqlen"] > first["seqlen"]]
        out.append({"backend": b, "slice": sk, "mask": mask, "first_fail": first["seqlen"],
                        "last_ok": max(ok_below) if ok_below else None, "ok_above": ok_above, "why": _reason(first)})
    return out


def _support(kern: list[dict]) -> dict:
    """{(backend, mask): {mode: (summary, reasons)}} over every slice and length."""
    by: dict = defaultdict(lambda: defaultdict(list))
    for r in kern:
        by[(r["backend"], r["mask"])][r["mode"]].append(r)
    out = {}
    for key, modes in by.items():
        out[key] = {}
        for mode, rs in modes.items():
            ok = sorted({r["seqlen"] for r in rs if valid_tflops(r) is not None})
            bad = [r for r in rs if valid_tflops(r) is None]
            kinds = sorted({_fail_kind(r) for r in bad})
            reasons = list(dict.fromkeys(_reason(r) for r in bad))
            if not bad:
                summary = "ok"
            elif not ok:
                summary = "/".join(kinds)
            else:
                summary = "ok at " + ",".join(fmt_s(s) for s in ok) + "; " + "/".join(kinds) + " at " + \
                    ",".join(fmt_s(s) for s in sorted({r["seqlen"] for r in bad}))
            out[key][mode] = (summary, reasons)
    return out


def _fail_kind(r: dict) -> str:
    if environment_unsupported(r):
        return "absent"
    return "memory" if is_memory_failure(r) else status_kind(r)


def _cp(rows: list[dict]) -> list[dict]:
    """Best plan per (GPU, world, tokens per GPU, mode, mask, scheme); peers keep their backend name."""
    best: dict = {}
    for r in rows:
        if r.get("kind") != "cp" or r.get("scheme") in (None, "single"):
            continue
        eff = r.get("efficiency")
        ok = status_kind(r) == "ok" and isinstance(eff, (int, float)) and math.isfinite(eff) and eff > 0
        scheme = r["scheme"] if r["backend"] == "triton" else r["backend"]
        key = (r.get("gpu"), r.get("world_size"), r.get("tokens_per_gpu"), r["mode"], r["mask"], scheme)
        cur = best.get(key)
        if ok and (cur is None or cur["efficiency"] is None or eff > cur["efficiency"]):
            best[key] = dict(zip(("gpu", "world", "tokens", "mode", "mask", "scheme"), key), plan=r.get("plan"), efficiency=eff)
        elif not ok and cur is None:
            best[key] = dict(zip(("gpu", "world", "tokens", "mode", "mask", "scheme"), key), plan=r.get("plan"),
                             efficiency=None, reason=_reason(r))
    return list(best.values())


# ---------------------------------------------------------------------------- rendering
def _env_rows(rows: list[dict], files: dict) -> list[list]:
    table = []
    for path, info in files.items():
        mine = [r for r in rows if r.get("_file") == path]
        envs = [r.get("env") or {} for r in mine]
        env = next((e for e in envs if e), {})
        commits = sorted({(e.get("git_commit") or "")[:7] for e in envs if e.get("git_commit")})
        times = sorted(_time_key(r.get("time")) for r in mine if r.get("time"))
        kinds = ",".join(sorted({r.get("kind") for r in mine})) or "—"
        table.append([f"`{path}`", kinds, f"{info['used']} of {info['rows']}", _timing(mine),
                      env.get("gpu") or (mine[0].get("gpu") if mine else "") or "—",
                      env.get("torch") or "—", env.get("triton") or "—", env.get("cuda") or "—", env.get("cudnn") or "—",
                      ", ".join(commits) or "—", f"{times[0][:10]}" + (f" .. {times[-1][:10]}" if times[-1][:10] != times[0][:10] else "") if times else "—"])
    return table


def _timing(rows: list[dict]) -> str:
    """How a file's timed rows were timed: ``interleaved`` (the backends of a problem round by round,
    one clock for all), ``sequential`` (one point after the other: every row before the harness
    interleaved says nothing and was timed so), both, or ``—`` without a timed row."""
    kinds = {r.get("timing") or "sequential" for r in rows if r.get("status") == "ok" and r.get("time_ms")}
    return " + ".join(sorted(kinds)) if kinds else "—"


def _vendors(rows: list[dict]) -> str:
    v: dict = {}
    for r in rows:
        for k, ver in ((r.get("env") or {}).get("vendors") or {}).items():
            v.setdefault(k, set()).add(ver)
    return ", ".join(f"{k} {'/'.join(sorted(vs))}" for k, vs in sorted(v.items())) or "none recorded"


def _t(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.3g}"


def render_markdown(f: Findings, command: str, plots: dict | None = None) -> str:
    """The findings page. ``plots``: {"tflops": [paths], "winners": [paths], "sparse": [paths]} as
    links relative to the page."""
    plots = plots or {}
    P: list[str] = []
    P += ["# Findings: which kernel wins where", "",
          f"Generated by `{command}` from the result rows below; do not edit by hand, rerun the command.",
          "", ("Rules: a point's latest row wins (retries supersede earlier rows, across files); only `ok` rows "
          "with a finite, positive TFLOP/s are measurements; TFLOP/s count the mask's allowed area only "
          "(MASKS.md §5); `bwd` is the backward pass alone. Backends named `triton*` are ours. A backend whose "
          "row says the run's machine lacked it (not installed, no GPU, the wrong architecture) is *absent* "
          "there: not a measurement, not a loss, not a verdict on the case, and it never hides a row of another "
          "run that measured the point; which runs lacked which backends is under Coverage. Rows of "
          "different files may come from different commits and runs (Sources): a comparison across lengths "
          "measured in different runs carries their run-to-run noise (a few percent). Rows timed *interleaved* (Sources: timing) shared the "
          "GPU's clock with the other backends of their problem; rows timed one after the other did not, and "
          "there a backend that compiled for seconds just before its timing met a cool GPU (Flex's backward "
          "read ~10 % faster so)."), ""]
    P += ["## Sources", "",
          markdown_table(["file", "kinds", "rows used", "timing", "GPU", "torch", "triton", "CUDA", "cuDNN", "commits",
                          "measured"],
                         _env_rows(f.rows, f.files)), "",
          f"Vendor packages recorded in the rows: {_vendors(f.rows)}.", ""]
    ignored = {p: i["ignored"] for p, i in f.files.items() if i["ignored"]}
    if ignored:
        P += ["Rows that are not bench rows (check logs, summaries) or not parseable were skipped: "
              + ", ".join(f"`{p}` {n}" for p, n in ignored.items()) + ".", ""]
    P += _summary(f) + _coverage(f)
    for sk, masks in f.cells.items():
        P += [f"## Winners: {slice_title(sk)}", ""]
        P += _plots_for(plots, "tflops", sk) + _plots_for(plots, "winners", sk)
        for m, cells in masks.items():
            P += [f"### {m}", ""]
            table = []
            for c in cells:
                w = c.winner
                table.append([c.seqlen, w[0] if w else "none measured", _t(w[1]) if w else "",
                              f"{c.ranking[1][0]} {_t(c.ranking[1][1])}" if len(c.ranking) > 1 else "—",
                              f"{c.margin:.2f}×" if c.margin else ("only one backend measured" if w else ""),
                              _ours_text(c), ", ".join(c.not_measured) or "", ", ".join(c.absent),
                              "; ".join(f"{b}: {why}" for b, why in c.failed.items())])
            P += [markdown_table(["S", "winner", "TFLOP/s", "runner-up", "margin", "ours (ratio to best)", "not measured",
                                  "absent from the machine", "failed or refused"], table,
                                 ["---:", "---", "---:", "---", "---:", "---", "---", "---", "---"]), ""]
            x = f.crossovers[(sk, m)]
            if isinstance(x, str):
                P += [f"Crossovers: {x}.", ""]
            else:
                P += ["Crossovers: " + "; ".join(f"between S = {c[0]} and {c[1]} the winner changes from {c[2]} to {c[3]}"
                                                 if isinstance(c, tuple) else c for c in x) + ".", ""]
    P += _losses_section(f) + _walls_section(f) + _support_section(f) + _sparse_section(f, plots) + _cp_section(f)
    return "\n".join(P).rstrip() + "\n"


def _plots_for(plots: dict, kind: str, sk) -> list[str]:
    out = []
    for key, path in plots.get(kind, []):
        if key == sk:
            out += [f"![{kind}: {slice_title(sk)}]({path})", ""]
    return out


def _ours_text(c: Cell) -> str:
    if not c.winner:
        return ""
    parts = [f"{b} {t / c.winner[1]:.2f}" for b, t in c.ranking if b.startswith(OURS_PREFIX)]
    parts += [f"{b} failed" for b in c.failed if b.startswith(OURS_PREFIX)]
    return ", ".join(parts)


def _summary(f: Findings) -> list[str]:
    out = ["## In short", ""]
    for sk, masks in f.cells.items():
        lengths = sorted({c.seqlen for cells in masks.values() for c in cells})
        wins: dict = defaultdict(int)
        n = 0
        ours_won = 0
        alone = 0
        for cells in masks.values():
            for c in cells:
                if len(c.ranking) > 1:
                    n += 1
                    wins[c.winner[0]] += 1
                    ours_won += c.winner[0].startswith(OURS_PREFIX)
                elif c.winner:
                    alone += 1
        if not n:
            out.append(f"- {slice_title(sk)}: no (mask, S) cell with two measured backends: nothing to compare.")
            continue
        tally = ", ".join(f"{b} {k}" for b, k in sorted(wins.items(), key=lambda x: -x[1]))
        ratios = sorted(d["ratio"] for d in f.losses if d["slice"] == sk)
        med = f"; where ours lose, median ratio to the best {ratios[len(ratios) // 2]:.2f} (worst {ratios[0]:.2f})" if ratios else ""
        per_mask = defaultdict(list)
        for m, cells in masks.items():
            per_mask[tuple(c.seqlen for c in cells if c.ranking)].append(m)
        cover = "; ".join(f"{len(ms)} at {', '.join(fmt_s(s) for s in ls) or 'none'}"
                          for ls, ms in sorted(per_mask.items(), key=lambda x: (-len(x[0]), x[0])))
        thin = (f" Only one length measured ({lengths[0]}): no trend with length can be stated."
                if len(lengths) == 1 else f" Lengths with a measurement, masks per set of lengths: {cover}.")
        absent: dict = defaultdict(set)
        for cells in masks.values():
            for c in cells:
                for b in c.absent:
                    absent[b].add(c.seqlen)
        gone = "; ".join(f"{', '.join(bs)} at {', '.join(fmt_s(x) for x in ls)}" for ls, bs in _group_by_lengths(absent))
        out.append(f"- {slice_title(sk)}: {len(masks)} masks, {n} (mask, S) cells with two or more measured backends"
                   f" — wins: {tally}; ours win {ours_won}{med}."
                   + (f" {alone} cell{'s' if alone > 1 else ''} had one measured backend only (not counted)." if alone else "") + thin
                   + (f" Absent from the machine (not counted: the wins there are among the backends present): {gone}."
                      if gone else ""))
    if f.walls:
        first: dict = {}
        for w in f.walls:
            first[w["backend"]] = min(first.get(w["backend"], w["first_fail"]), w["first_fail"])
        out.append("- Memory walls (see below): " + ", ".join(f"{b} from S = {s}" for b, s in first.items())
                   + f" ({len(f.walls)} (backend, mask, slice) combinations).")
    else:
        out.append("- Memory walls: no row in these results failed for memory (none of the measured lengths reached one).")
    return out + [""]


def _group_by_lengths(by_backend: dict) -> list[tuple[tuple, list]]:
    """``{backend: lengths}`` -> ``[(lengths, [backends])]``, most lengths first."""
    groups: dict = defaultdict(list)
    for b, ls in sorted(by_backend.items()):
        groups[tuple(sorted(ls))].append(b)
    return sorted(groups.items(), key=lambda x: (-len(x[0]), x[0]))


def _absence_kind(r: dict) -> str:
    s = str(r.get("status", "")).lower()
    if any(w in s for w in ("not installed", "cannot import", "no module named")):
        return "not installed"
    if any(w in s for w in ("gpu", "sm_", "capability", "hopper", "on the cpu", "cpu interpreter", "cuda only", "cuda device")):
        return "no GPU or not this one"
    return "this build lacks it"


def _problem(r: dict) -> tuple:
    """A row's problem within its length: mask, heads, head dim, mode."""
    return mask_label(r), r.get("heads_q"), r.get("heads_kv"), r.get("head_dim"), r.get("mode")


def _partly_absent(path: str, by_b: dict, probs: dict) -> list[str]:
    """Notes for backends measured somewhere in a file but missing (every row of a problem saying
    the machine lacked them) at some of its lengths: a run without a vendor's wheels appended to a
    file that has them elsewhere. At those problems they neither win nor lose."""
    gaps: dict = defaultdict(list)  # (S, missing problems, why) -> backends
    for b, rs in sorted(by_b.items()):
        per: dict = defaultdict(list)
        for r in rs:
            per[(r["seqlen"], _problem(r))].append(r)
        for S in sorted(probs):
            miss = [k for k, v in per.items() if k[0] == S and all(environment_unsupported(r) for r in v)]
            if miss:
                gaps[(S, len(miss), _absence_kind(per[miss[0]][0]))].append(b)
    out = []
    for (S, n, why), bs in sorted(gaps.items()):
        share = "every problem" if n >= len(probs[S]) else f"{n} of its {len(probs[S])} problems"
        out.append(f"- `{path}` at {fmt_s(S)}: {', '.join(bs)} missing on {share} ({why}): there they neither win nor "
                   "lose, and the winners stand for the backends that ran.")
    return out


def _coverage(f: Findings) -> list[str]:
    """Per results file: lengths, the (mask, heads, head dim, mode) problems and points at each (a
    length with fewer problems than the file's fullest, or with problems run by fewer backends than
    others: partial), backends measured and absent."""
    out = ["## Coverage", ""]
    kern = [r for r in f.rows if r.get("kind") in KERNEL_KINDS]
    if not kern:
        return out + ["No kernel rows.", ""]
    out += [("Per results file (rows used here): the lengths it covers, with the problems (mask × heads × head dim "
             "× mode) and points (× backend) at each; a length with fewer problems than the file's fullest, or whose "
             "problems were not all run by as many backends, is *partial* (a run cut short or a slice of the grid: its "
             "winners stand for the problems and backends measured there only). Backends measured: "
             "at least one measurement in the file. Absent: every row of the backend in that file says the machine "
             "lacked it; no conclusion about those backends can be drawn from that file."), ""]
    table, notes = [], []
    for path in sorted({r["_file"] for r in kern}):
        mine = [r for r in kern if r["_file"] == path]
        per: dict = defaultdict(Counter)  # S -> problem -> points (the backends that ran it)
        for r in mine:
            per[r["seqlen"]][_problem(r)] += 1
        probs = {S: set(c) for S, c in per.items()}
        pts = {S: c.total() for S, c in per.items()}
        full = max(len(v) for v in probs.values())

        def partial(S) -> str:
            if len(probs[S]) < full:
                return ", **partial**"
            counts = list(per[S].values())
            top = max(counts)
            if min(counts) < top:  # a slice of the grid ran there (e.g. one head layout, or one backend)
                return f", **partial**: {sum(c == top for c in counts)} of them with {top} backends, the rest fewer"
            return ""

        lengths = ", ".join(f"{fmt_s(S)} ({len(probs[S])} problems, {pts[S]} points{partial(S)})" for S in sorted(probs))
        measured = sorted({r["backend"] for r in mine if valid_tflops(r) is not None})
        by_b: dict = defaultdict(list)
        for r in mine:
            by_b[r["backend"]].append(r)
        absent: dict = defaultdict(list)
        for b, rs in sorted(by_b.items()):
            if all(environment_unsupported(r) for r in rs):
                absent[_absence_kind(rs[0])].append(b)
        table.append([f"`{path}`", lengths, ", ".join(measured) or "none",
                      "; ".join(f"{', '.join(bs)} ({why})" for why, bs in absent.items()) or "none"])
        gone = [b for bs in absent.values() for b in bs]
        if gone:
            at = ", ".join(fmt_s(S) for S in sorted(probs))
            notes.append(f"- `{path}` ran without {', '.join(gone)} on its machine ({'; '.join(absent)}): at {at} its "
                         f"winners are among {', '.join(measured) or 'none'} only, and the absent backends neither win nor "
                         "lose there (where another file measured the same point, that row stands).")
        notes += _partly_absent(path, {b: rs for b, rs in by_b.items() if b not in gone}, probs)
    return out + [markdown_table(["file", "lengths (problems, points)", "backends measured", "absent from its machine"], table),
                  "", *notes, *([""] if notes else [])]


def _losses_section(f: Findings) -> list[str]:
    out = ["## Where our kernels lose", ""]
    if not f.losses:
        return out + ["No cell where one of our kernels ran and a vendor kernel was faster.", ""]
    out.append("Every (mask, S, mode) where a vendor kernel beat one of ours, worst first (ratio = ours / best):")
    out.append("")
    rows = [[slice_title(d["slice"]), d["mask"], d["S"], d["ours"], _t(d["tflops"]), d["best"], _t(d["best_tflops"]),
             f"{d['ratio']:.2f}"] for d in sorted(f.losses, key=lambda d: d["ratio"])]
    return out + [markdown_table(["slice", "mask", "S", "ours", "TFLOP/s", "best", "TFLOP/s", "ratio"], rows,
                                 ["---", "---", "---:", "---", "---:", "---", "---:", "---:"]), ""]


def _walls_section(f: Findings) -> list[str]:
    out = ["## Memory walls", ""]
    if not f.walls:
        return out + [("None in these results: no row failed for memory (out of memory, or a refusal because the "
                      "problem would not fit). The lengths measured may simply not reach a wall."), ""]
    groups: OrderedDict[tuple, list] = OrderedDict()
    for w in f.walls:
        groups.setdefault((w["backend"], w["slice"][0], w["slice"][1:4], w["first_fail"], w["last_ok"], w["why"]), []).append(w["mask"])
    rows = []
    for (b, mode, (hq, hkv, d), first, last, why), masks in groups.items():
        rows.append([b, mode, f"{hq}:{hkv}, D {d}", first, last if last is not None else "none measured below",
                     ", ".join(masks), why])
    return out + ["The smallest length at which each backend failed for memory, and the largest it ran below it:", "",
                  markdown_table(["backend", "mode", "heads", "fails from S", "largest ok S", "masks", "why"], rows,
                                 ["---", "---", "---", "---:", "---:", "---", "---"]), ""]


def _support_section(f: Findings) -> list[str]:
    out = ["## Support matrix", "",
           ("Per backend and mask, over every length and head layout measured: `ok`, `unsupported`, `error`, "
           "`memory` (out of memory, or refused because it would not fit), or `absent` (the run's machine lacked "
           "the backend: no verdict on the case); — = not measured. Reasons are numbered below the table."), ""]
    if not f.support:
        return out + ["No kernel rows.", ""]
    backends = list(dict.fromkeys(b for b, _ in sorted(f.support, key=lambda k: (not k[0].startswith(OURS_PREFIX), k[0]))))
    from longca_triton.masks import MASK_NAMES

    masks = sorted(dict.fromkeys(m for _, m in f.support), key=lambda m: MASK_NAMES.index(m) if m in MASK_NAMES else 99)
    notes: OrderedDict[str, int] = OrderedDict()
    rows = []
    for b in backends:
        line = [b]
        for m in masks:
            modes = f.support.get((b, m))
            if not modes:
                line.append("—")
                continue
            texts = {}
            for mode, (summary, reasons) in modes.items():
                refs = "".join(f"[{notes.setdefault(r, len(notes) + 1)}]" for r in reasons)
                texts[mode] = summary + (" " + refs if refs else "")
            if len(set(texts.values())) == 1:
                line.append(next(iter(texts.values())))
            else:
                line.append("; ".join(f"{mode}: {t}" for mode, t in sorted(texts.items())))
        rows.append(line)
    out += [markdown_table(["backend", *masks], rows), ""]
    out += [f"{i}. {r}" for r, i in notes.items()]
    return out + [""]


def _sparse_section(f: Findings, plots: dict) -> list[str]:
    out = ["## Block-sparse: TFLOP/s against density and block", ""]
    if not f.sparse:
        return out + ["No block-sparse rows in these results.", ""]
    for _, path in plots.get("sparse", []):
        out += [f"![block-sparse TFLOP/s against density]({path})", ""]
    groups: OrderedDict[tuple, list] = OrderedDict()
    for d in f.sparse:
        groups.setdefault((d["slice"], d["mask"], d["block"], d["S"]), []).append(d)
    backends = list(dict.fromkeys(d["backend"] for d in f.sparse))
    rows = []
    for (sk, m, block, S), ds in groups.items():
        for dens in sorted({d["nominal"] for d in ds}, key=lambda x: (x is None, x)):
            at = {d["backend"]: d for d in ds if d["nominal"] == dens}
            actual = next((d["density"] for d in at.values() if isinstance(d["density"], (int, float))), None)
            rows.append([slice_title(sk), m, block, S, dens, f"{actual:.3f}" if actual is not None else ""]
                        + [(_t(at[b]["tflops"]) if at[b]["tflops"] is not None else _short(at[b]["status"], 40)) if b in at else ""
                           for b in backends])
    out += [markdown_table(["slice", "mask", "block", "S", "density", "kept fraction", *backends], rows), ""]
    for (m, block), dens in _by(f.sparse, lambda d: (d["mask"], d["block"]), lambda d: d["nominal"]).items():
        if len(dens) < 2:
            out.append(f"- {m}, block {block}: one density measured ({', '.join(str(x) for x in dens)}): "
                       "no trend against density can be stated.")
    blocks = _by(f.sparse, lambda d: d["mask"], lambda d: d["block"])
    for m, bl in blocks.items():
        if len(bl) < 2:
            out.append(f"- {m}: one block size measured ({', '.join(str(x) for x in bl)}): no comparison across blocks.")
    return out + [""]


def _by(items, key, val) -> dict:
    out: dict = OrderedDict()
    for d in items:
        v = val(d)
        out.setdefault(key(d), [])
        if v not in out[key(d)]:
            out[key(d)].append(v)
    return out


def _cp_section(f: Findings) -> list[str]:
    if not f.cp:
        return ["## Context parallelism", "", "No CP rows in these results.", ""]
    out = ["## Context parallelism: efficiency per scheme (best plan)", "",
           ("Efficiency = single-GPU time of the same kernel on the whole sequence / (N × the slowest rank's time); "
           "each cell is the best plan of the scheme (named)."), ""]
    groups: OrderedDict[tuple, list] = OrderedDict()
    for d in sorted(f.cp, key=lambda d: (str(d["gpu"]), d["world"] or 0, d["tokens"] or 0, d["mode"])):
        groups.setdefault((d["gpu"], d["world"], d["tokens"], d["mode"]), []).append(d)
    for (gpu, world, tokens, mode), ds in groups.items():
        schemes = list(dict.fromkeys(d["scheme"] for d in ds))
        masks = list(dict.fromkeys(d["mask"] for d in ds))
        cell = {(d["mask"], d["scheme"]): d for d in ds}
        rows = []
        for m in masks:
            line = [m]
            for s in schemes:
                d = cell.get((m, s))
                if d is None:
                    line.append("not measured")
                elif d["efficiency"] is None:
                    line.append(_short(d.get("reason", ""), 50))
                else:
                    line.append(f"{d['efficiency']:.2f} ({d['plan']})")
            rows.append(line)
        out += [f"### {world} × {gpu}, {tokens} tokens per GPU, {mode}", "", markdown_table(["mask", *schemes], rows), ""]
        best = defaultdict(list)
        for m in masks:
            ok = [(cell[(m, s)]["efficiency"], s) for s in schemes if (m, s) in cell and cell[(m, s)]["efficiency"]]
            if ok:
                best[max(ok)[1]].append(m)
        out += ["Best scheme per mask: " + "; ".join(f"{s} on {', '.join(ms)}" for s, ms in best.items()) + ".", ""]
    return out

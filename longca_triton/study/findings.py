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

which :mod:`longca_triton.study.findings_report` renders in full as the appendix page, whose header
names the files, the command and the environment; :mod:`longca_triton.study.findings_headline`
distils the main page's conclusions from it and :mod:`longca_triton.study.findings_main` renders
that page.

Rules, so that nothing is invented: a point's latest row wins (a retried point supersedes its
earlier row, across files too, by the row's ``time``), except that a row saying the machine lacked
the backend never hides a row that ran the case (``bench.report.latest_rows``); only ``ok`` rows
with a finite positive TFLOP/s count as measurements (failed rows and NaN / zero TFLOP/s never
win); a backend absent from a run's machine (``unsupported`` because it is not installed, no GPU,
the wrong architecture: ``bench.store.environment_unsupported``) is listed as absent, never as
failing or losing, and is left out of the support matrix's verdicts on the case; a backend that has
rows for a mask at other lengths but none at this one is listed as "not measured" there; where
only one length (or one density) is measured the text says that no crossover (or trend) can be
stated; rows measured on a CPU (``bench.store.on_cpu``: the Triton interpreter's smoke runs) are
left out of every conclusion, and the page says how many per file.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import OrderedDict, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from longca_triton.bench.report import latest_rows, mask_label, row_time
from longca_triton.bench.store import (
    RESULTS_PATTERNS,
    ResultStore,
    environment_unsupported,
    on_cpu,
    prefer_plain,
    status_kind,
)

__all__ = ["KERNEL_KINDS", "OURS_PREFIX", "SPARSE_KINDS", "Cell", "Findings", "collect_paths", "compared_cells",
           "compute", "fmt_s", "is_ours", "load_results", "row_layout", "rows_by_file", "shorten", "slice_title",
           "time_key", "valid_tflops"]

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
    per point, and per file ``{"rows": read, "used": kept, "ignored": not bench rows, "cpu": bench rows
    measured on a CPU, left out}``."""
    from longca_triton.adapters.base import canonical_name

    rows, per_file = [], {}
    for p in paths:
        store = ResultStore(p)
        got = store.rows()
        bench = [r for r in got if r.get("kind") in (*KERNEL_KINDS, "cp") and r.get("backend") and r.get("status")
                 and r.get("seqlen") and r.get("mode")]
        mine = [r for r in bench if not on_cpu(r)]  # CPU timings are no performance numbers
        for r in mine:
            r["_file"] = str(p)
            r["backend"] = canonical_name(r["backend"])
        per_file[str(p)] = {"rows": len(got), "ignored": len(got) - len(bench) + store.skipped_lines, "used": 0,
                            "cpu": len(bench) - len(mine)}
        rows += mine
    # the latest row of a point wins, across files (file order breaks ties); a "not installed" row
    # never hides a row that ran the case (report.latest_rows)
    rows = latest_rows(rows)
    for r in rows:
        per_file[r["_file"]]["used"] += 1
    return rows, per_file


def rows_by_file(rows: list[dict]) -> dict[str, list[dict]]:
    """The rows grouped by the file they were read from (``_file``), in first-seen order: one pass
    where a filter per file would read every row once per file."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r.get("_file"), []).append(r)
    return out


def time_key(t) -> str:
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


def row_layout(r: dict) -> tuple:
    """(heads_q, heads_kv, head dims, dtype, batch): a slice less its mode."""
    # D_v != D_qk is its own slice, labelled "192/128" as the bench's plots name it (d192-128)
    d, dv = r.get("head_dim"), r.get("d_v")
    dims = f"{d}/{dv}" if dv is not None and d is not None and dv != d else d
    return (r.get("heads_q"), r.get("heads_kv"), dims, r.get("dtype"), r.get("batch") or 1)


def _slice(r: dict) -> tuple:
    return (r.get("mode"), *row_layout(r))


def slice_title(key: tuple) -> str:
    mode, hq, hkv, d, dt, b = key
    return f"{mode}, heads {hq}:{hkv}, D = {d}, {dt}" + (f", batch {b}" if b != 1 else "")


def fmt_s(s: int) -> str:
    if s >= 1 << 20 and s % (1 << 20) == 0:
        return f"{s >> 20}M"
    return f"{s // 1024}K" if s >= 1024 and s % 1024 == 0 else str(s)


def shorten(text: str, n: int = 110) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def is_ours(backend: str) -> bool:
    """Whether the backend is one of our kernels (named ``triton*``)."""
    return backend.startswith(OURS_PREFIX)


def _reason(r: dict) -> str:
    """Why a row is not a measurement, one line."""
    s = str(r.get("status", ""))
    if status_kind(r) == "ok":
        return f"ok but TFLOP/s = {r.get('tflops')!r}"
    if status_kind(r) == "oom":
        return "out of memory" + (f" ({shorten(r['detail'], 80)})" if r.get("detail") else "")
    return shorten(s)


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


def compared_cells(masks: dict) -> list[tuple[str, Cell]]:
    """The (mask, cell) pairs of one slice where two or more backends were measured: the cells a
    win is counted in (a backend measured alone wins nothing)."""
    return [(m, c) for m, cells in masks.items() for c in cells if len(c.ranking) > 1]


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
                for r in at:  # a measurement, a row saying the machine lacked the backend, or a failure
                    if (t := valid_tflops(r)) is not None:
                        c.ranking.append((r["backend"], t))
                    elif environment_unsupported(r):
                        c.absent.append(r["backend"])
                    else:
                        c.failed[r["backend"]] = _reason(r)
                c.ranking.sort(key=lambda x: -x[1])
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
            if is_ours(b) and b != best and not is_ours(best):
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

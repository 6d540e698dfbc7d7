"""Markdown reports of a results file (no table library: the tables are written here)."""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Iterable

from .params import row_head_dim
from .store import (
    CPU_CAVEAT,
    environment_unsupported,
    measured_on,
    on_cpu,
    result_rows,
    results_in,
    row_key,
    status_kind,
)

__all__ = ["REPORT_COLUMNS", "at_power_limit", "latest_rows", "row_time", "load_rows", "mask_label", "markdown_report",
           "markdown_table", "report_rows", "short_status", "slices"]


def load_rows(path: str | Path) -> list[dict]:
    """Rows of a results file (``.jsonl``, or gzipped ``.jsonl.gz``), or of the one inside a directory
    (``results.jsonl``, else ``results.jsonl.gz``; both there: the plain one, with a warning:
    ``store.results_in``); a ``ValueError`` naming the file when it is not a results file
    (``store.result_rows``)."""
    p = Path(path)
    if p.is_dir():
        p = results_in(p)
    if not p.exists():
        raise FileNotFoundError(f"no results file at {p}")
    return result_rows(p)


def row_time(r: dict) -> str:
    """A row's ``time`` as comparable text: ISO strings, some without a zone (CP rows), read as UTC."""
    return str(r.get("time") or "").removesuffix("+00:00")


def latest_rows(rows: Iterable[dict]) -> list[dict]:
    """One row per point (``row_key``): the latest by the row's ``time`` (ties and rows without a
    time: the order given, i.e. the last one written), so a retried point supersedes its earlier
    row, across files too. One exception: a row saying the machine lacked the backend
    (``store.environment_unsupported``: not installed, no GPU, wrong architecture) never supersedes
    a row that ran or judged the case; it stands for the point only where nothing else does.
    Every reader of results goes through this: the report, the plots, ``findings``, ``recommend``
    and the resume of ``run_experiment``."""
    by_key: "OrderedDict[tuple, dict]" = OrderedDict()
    for r in sorted(rows, key=row_time):
        k = row_key(r)
        old = by_key.get(k)
        if old is not None and environment_unsupported(r) and not environment_unsupported(old):
            continue
        by_key.pop(k, None)
        by_key[k] = r
    return list(by_key.values())


def mask_label(row: dict) -> str:
    """The mask as tables and plots show it: its name, or ``block_sparse[block=64,density=0.2]``
    for one variant of a sweep over mask parameters."""
    return row.get("mask_label") or row["mask"]


def short_status(row: dict) -> str:
    kind = status_kind(row)
    if kind == "ok":
        t = row.get("tflops")
        if not isinstance(t, (int, float)):
            return "ok"
        return f"{t:.1f}" if t >= 1 else f"{t:.3g}"
    if kind == "unsupported":
        return "unsup"
    if kind == "oom":
        return "OOM"
    if "wrong result" in str(row.get("status", "")):
        return "WRONG"
    return "ERR"


def markdown_table(header: list[str], rows: list[list], align: list[str] | None = None) -> str:
    def esc(x) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    align = align or ["---"] * len(header)
    lines = ["| " + " | ".join(esc(h) for h in header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _slice_key(r: dict) -> tuple:
    return (r.get("mode"), r.get("heads_q"), r.get("heads_kv"), row_head_dim(r), r.get("dtype"), r.get("batch"))


def slices(rows: list[dict]) -> "OrderedDict[tuple, list[dict]]":
    """Rows grouped by (mode, heads_q, heads_kv, head dim, dtype, batch), in first-seen order; the
    head dim as ``params.row_head_dim`` writes it (``"128"``, ``"192/128"``)."""
    out: "OrderedDict[tuple, list[dict]]" = OrderedDict()
    for r in rows:
        out.setdefault(_slice_key(r), []).append(r)
    return out


def _order(values: Iterable) -> list:
    seen = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen


def _fmt_bytes(b) -> str:
    return f"{b / 2**30:.2f}" if isinstance(b, (int, float)) else ""


def _fmt(x, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else ""


def _env_section(rows: list[dict]) -> str:
    env = next((r.get("env") for r in rows if r.get("env")), {}) or {}
    times = sorted(r.get("time") for r in rows if r.get("time"))
    items = [
        ("GPU", env.get("gpu") or "none (CPU)"),
        ("driver", env.get("driver")),
        ("CUDA", env.get("cuda")),
        ("torch", env.get("torch")),
        ("triton", env.get("triton")),
        ("cuDNN", env.get("cudnn")),
        ("vendor packages", ", ".join(f"{k} {v}" for k, v in sorted((env.get("vendors") or {}).items())) or "none"),
        ("git commit", (env.get("git_commit") or "unknown") + (" (dirty)" if env.get("git_dirty") else "")),
        ("host", env.get("hostname")),
        ("measured", f"{times[0]} .. {times[-1]}" if times else None),
    ]
    text = markdown_table(["", ""], [[k, v if v is not None else "unknown"] for k, v in items])
    if any(on_cpu(r) for r in rows):
        interp = " (Triton interpreter)" if any(r.get("interpreted") for r in rows) else ""
        text += f"\n\n> **CPU run{interp}.** {CPU_CAVEAT}"
    return text


#: median board power at or above this share of the enforced limit reads as "at the power limit"
AT_LIMIT = 0.97


def at_power_limit(r: dict) -> bool:
    """Whether row ``r`` was timed with the board at its power limit (median sampled power >= ``AT_LIMIT`` of the
    enforced limit; False where either was not recorded)."""
    p, lim = r.get("power_w"), r.get("power_limit_w")
    return isinstance(p, (int, float)) and isinstance(lim, (int, float)) and lim > 0 and p >= AT_LIMIT * lim


def _clock_cell(rs: list[dict]) -> str:
    """``"1515 MHz, 695 W"`` (``", at limit"`` appended there) for one problem's rows: the first row that carries a
    clock sample (the backends of an interleaved problem share one)."""
    r = next((r for r in rs if isinstance(r.get("sm_clock_mhz"), (int, float))), None)
    if r is None:
        return ""
    text = f"{r['sm_clock_mhz']:.0f} MHz"
    if isinstance(r.get("power_w"), (int, float)):
        text += f", {r['power_w']:.0f} W"
    return text + (", at limit" if at_power_limit(r) else "")


def _clock_note(rows: list[dict]) -> str:
    """One paragraph on the clocks and power the timed rows saw ('' where none was sampled)."""
    timed = [r for r in rows if isinstance(r.get("sm_clock_mhz"), (int, float))]
    if not timed:
        return ""
    clocks = [r["sm_clock_mhz"] for r in timed]
    top = max(r.get("sm_clock_max_mhz") or r["sm_clock_mhz"] for r in timed)
    text = (f"Clock and power, sampled while timing: median SM clock {min(clocks):.0f}–{max(clocks):.0f} MHz over "
            f"the timed points (highest sample {top:.0f} MHz)")
    limits = {r["power_limit_w"] for r in timed if isinstance(r.get("power_limit_w"), (int, float))}
    if limits:
        n = sum(at_power_limit(r) for r in timed)
        text += (f"; {n} of {len(timed)} at the board's power limit ({', '.join(f'{x:.0f}' for x in sorted(limits))} W: "
                 f"median power >= {AT_LIMIT:.0%} of it). There the GPU holds its power by its clock, so a kernel's "
                 "TFLOP/s follow its energy per FLOP as well as its cycles")
    return text + ". Backends timed interleaved on one problem share its clock (the tables' `clock` column)."


def _launch_note(rows: list[dict]) -> str:
    """One paragraph on our kernels' launch configs ('' where no row recorded one): per backend, how many timed
    points ran the kernels' defaults, an autotune cache entry or a given config (``notes.launch_config``)."""
    by: "OrderedDict[str, dict]" = OrderedDict()
    for r in rows:
        src = ((r.get("notes") or {}).get("launch_config") or {}).get("source")
        if src:
            d = by.setdefault(r["backend"], {})
            d[src] = d.get(src, 0) + 1
    if not by:
        return ""
    parts = [f"{b}: " + ", ".join(f"{n} point{'s' * (n != 1)} {src}" for src, n in d.items()) for b, d in by.items()]
    text = "Launch configs of our kernels: " + "; ".join(parts)
    if any(src != "kernel defaults" for d in by.values() for src in d):
        text += (". A row's `notes.launch_config.config` is the config that ran where it is not the kernels' defaults "
                 "(an autotune cache entry reads `longca-triton autotune`'s tuning on this GPU)")
    return text + "."


def markdown_report(rows: list[dict], title: str | None = None, source: str | None = None) -> str:
    rows = latest_rows(rows)
    exp = next((r.get("experiment") for r in rows if r.get("experiment")), "results")
    parts = [f"# {title or f'Benchmark report: {exp}'}", ""]
    if source:
        parts += [f"Source: `{source}` ({len(rows)} points).", ""]
    parts += ["## Environment", "", _env_section(rows), ""]
    counts = defaultdict(int)
    for r in rows:
        counts[status_kind(r)] += 1
    parts += ["Points: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), ""]
    parts += ["TFLOP/s count only the allowed (mask) area (docs/masks.md §5); `bwd` is the backward pass alone "
              "(2.5× the forward count), `fwd_bwd` both (3.5×). Cells: TFLOP/s, or `unsup` (unsupported), "
              "`OOM`, `ERR` (error), `WRONG` (failed the correctness check, not timed), blank (not run).", ""]
    for note in (_clock_note([r for r in rows if status_kind(r) == "ok"]),
                 _launch_note([r for r in rows if status_kind(r) == "ok"])):
        if note:
            parts += [note, ""]
    for (mode, hq, hkv, D, dt, B), srows in slices(rows).items():
        backends = _order(r["backend"] for r in srows)
        masks = _order(mask_label(r) for r in srows)
        seqlens = sorted({r["seqlen"] for r in srows})
        cell = {(mask_label(r), r["seqlen"], r["backend"]): r for r in srows}
        clocked = any(isinstance(r.get("sm_clock_mhz"), (int, float)) for r in srows)
        table = []
        for m in masks:
            for S in seqlens:
                if not any((m, S, b) in cell for b in backends):
                    continue
                dens = next((cell[(m, S, b)].get("density") for b in backends if (m, S, b) in cell), None)
                line = [m, S, _fmt(dens, ".3f")]
                best = max((cell[(m, S, b)].get("tflops") or 0.0 for b in backends if (m, S, b) in cell
                            and status_kind(cell[(m, S, b)]) == "ok"), default=None)
                for b in backends:
                    r = cell.get((m, S, b))
                    s = short_status(r) if r else ""
                    if r and status_kind(r) == "ok" and best and r.get("tflops") == best and len(backends) > 1:
                        s = f"**{s}**"
                    line.append(s)
                if clocked:
                    line.append(_clock_cell([cell[(m, S, b)] for b in backends if (m, S, b) in cell
                                             and status_kind(cell[(m, S, b)]) == "ok"]))
                table.append(line)
        parts += [f"## {mode}: heads {hq}:{hkv}, head dim {D}, {dt}, batch {B}", ""]
        if any(on_cpu(r) for r in srows):
            parts += [f"> {CPU_CAVEAT}", ""]
        header = ["mask", "S", "density"] + backends + (["clock"] if clocked else [])
        parts += [markdown_table(header, table, ["---", "---:", "---:"] + ["---:"] * len(backends)
                                 + (["---"] if clocked else [])), ""]
    bad = [r for r in rows if status_kind(r) != "ok"]
    if bad:
        parts += ["## Not measured, and why", ""]
        reasons: "OrderedDict[tuple, list]" = OrderedDict()
        for r in bad:
            reasons.setdefault((r["backend"], r.get("status", "")), []).append(f"{mask_label(r)}@{r['seqlen']}/{r.get('mode')}")
        table = [[b, s, ", ".join(_order(where))[:300]] for (b, s), where in reasons.items()]
        parts += [markdown_table(["backend", "status", "points"], table), ""]
    ok = [r for r in rows if status_kind(r) == "ok"]
    if ok:
        parts += ["## All measurements", ""]
        table = [[r["backend"], mask_label(r), r["seqlen"], f"{r['heads_q']}:{r['heads_kv']}", row_head_dim(r), r["dtype"], r["mode"],
                  _fmt(r.get("time_ms"), ".3f"), f"{_fmt(r.get('p20_ms'), '.3f')}–{_fmt(r.get('p80_ms'), '.3f')}",
                  _fmt(r.get("tflops"), ".1f"), _fmt_bytes(r.get("peak_mem_bytes")), _fmt_bytes(r.get("peak_mem_above_bytes")),
                  _fmt(r.get("sm_clock_mhz"), ".0f"), _fmt(r.get("power_w"), ".0f"), _check_text(r)] for r in ok]
        parts += [markdown_table(
            ["backend", "mask", "S", "heads", "D", "dtype", "mode", "median ms", "p20–p80 ms", "TFLOP/s", "peak GiB", "above inputs GiB",
             "SM MHz", "W", "check"],
            table, ["---"] * 7 + ["---:"] * 7 + ["---"]), ""]
    return "\n".join(parts).rstrip() + "\n"


#: the columns of ``report --format json|csv``: one line per point
REPORT_COLUMNS = ("backend", "mask", "seqlen", "heads_q", "heads_kv", "head_dim", "dtype", "batch", "mode", "status",
                  "tflops", "time_ms", "p20_ms", "p80_ms", "peak_mem_bytes", "peak_mem_above_bytes", "measured_on")


def report_rows(rows: list[dict]) -> list[dict]:
    """The report's points for scripts: each point's latest row as ``REPORT_COLUMNS`` (the mask as
    tables show it, ``measured_on`` the GPU or ``cpu (Triton interpreter)``)."""
    return [{**{c: r.get(c) for c in REPORT_COLUMNS}, "mask": mask_label(r), "head_dim": row_head_dim(r),
             "measured_on": measured_on(r)} for r in latest_rows(rows)]


def _check_text(r: dict) -> str:
    c = r.get("check")
    if not c:
        return "not checked"
    if c.get("self"):
        return "reference"
    errs = [f"{k.replace('_rel', '').replace('_abs', '')} {v:.1e}" for k, v in c.items() if k.endswith(("_rel", "_abs")) and isinstance(v, (int, float))]
    return ("ok " if c.get("ok") else "FAIL ") + ", ".join(errs)

"""Kernel-ladder outputs: rich table, ``ladder.jsonl`` (rows of a problem replaced on a re-run),
``ladder.md`` and ``ladder_<mode>.png``. :mod:`.ladder` runs the ladder and calls these."""

from __future__ import annotations

from pathlib import Path

from .store import ResultStore

#: tolerance multiple of PyTorch's own error (see .ladder); the vendor kernel timed beside the steps
TOL_MULT = 4.0
VENDOR = "sdpa-cudnn"

__all__ = ["COLUMNS", "CHECK_COLUMNS", "print_records", "print_table", "render_markdown", "plot_chart", "write_outputs"]


# ----------------------------------------------------------------------------------------------
# outputs: rich table, jsonl, markdown, chart
# ----------------------------------------------------------------------------------------------
def _fmt(x, spec, empty="—"):
    return empty if x is None else format(x, spec)


def _cells(row: dict) -> dict:
    timed = row.get("median_ms") is not None
    reason = row.get("reason") or ""
    if row.get("kind") == "vendor":
        check = "—"
    elif "check_err" in row:
        check = f"{row['check']} {row['check_err']:.1e}"
    else:
        check = row.get("check", "—")
    status = row.get("status", "")
    if timed:
        notes = row.get("notes", "")
    elif status in ("skipped", "checked"):
        notes = f"{status}: {reason}" if status == "skipped" else reason
    else:
        notes = f"{status}: {reason}".strip(": ")
    return {
        "step": row["step"], "idea": row.get("idea", ""), "check": check,
        "ms": f"{row['median_ms']:.2f} ({row['p20_ms']:.2f}–{row['p80_ms']:.2f})" if timed else "—",
        "tflops": _fmt(row.get("tflops"), ".1f"),
        "x_prev": _fmt(row.get("x_prev"), ".2f") if row.get("x_prev") is None else f"{row['x_prev']:.2f}×",
        "pct": _fmt(row.get("pct_vendor"), ".0f") if row.get("pct_vendor") is None else f"{row['pct_vendor']:.0f}%",
        "mem": _fmt(row.get("peak_mib"), ".0f"),
        "vs_prod": _fmt(row.get("vs_production"), ".1e"),
        "notes": notes,
    }


COLUMNS = [("step", "step"), ("idea", "idea"), ("check", "check (err)"), ("ms", "ms (p20–p80)"),
           ("tflops", "TFLOP/s"), ("x_prev", "× prev"), ("pct", f"% {VENDOR}"), ("mem", "peak MiB"),
           ("vs_prod", "Δ vs prod @S"), ("notes", "notes")]


#: the columns left when nothing was timed (the interpreter)
CHECK_COLUMNS = [("step", "step"), ("idea", "idea"), ("check", "check (err)"), ("notes", "notes")]


def _columns(rows: list[dict]) -> list[tuple[str, str]]:
    return COLUMNS if any(r.get("median_ms") is not None for r in rows) else CHECK_COLUMNS


def print_table(rows: list[dict], title: str, console=None, fmt: str = "table") -> None:
    """The ladder's table (``fmt`` table, json or csv: ``output.emit``); ``console`` is unused
    and kept for callers that pass one."""
    from ..output import emit

    cols = _columns(rows)
    emit([_cells(r) for r in rows], [k for k, _ in cols], fmt=fmt, title=title, headers=dict(cols))


def print_records(tables: list[tuple[str, list[dict]]], fmt: str) -> None:
    """Every mode's ladder (``[(mode, rows)]``) as one json or csv table, a ``mode`` column first."""
    from ..output import emit

    cols = [("mode", "mode")] + _columns([r for _, rows in tables for r in rows])
    emit([{"mode": m, **_cells(r)} for m, rows in tables for r in rows], [k for k, _ in cols], fmt=fmt)


def _group_key(row: dict) -> tuple:
    return (row.get("device"), row.get("mode"), row.get("mask"), row.get("seqlen"), row.get("batch"),
            row.get("heads_q"), row.get("heads_kv"), row.get("head_dim"), row.get("dtype"))


def render_markdown(rows: list[dict], command: str | None = None) -> str:
    """Markdown tables of every problem in ``rows`` (grouped by device and problem)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(_group_key(r), []).append(r)
    lines = ["# Kernel ladder", "",
             "Produced by `longca-triton ladder` (`longca_triton/bench/ladder.py`); steps in `longca_triton/kernels/ladder/`.",
             "TFLOP/s count allowed pairs only (docs/masks.md §5). `check`: max error at the check size, relative",
             f"to max(1, |ref|), against an fp32 reference; tolerance = max({TOL_MULT:g} × PyTorch's own error",
             "in the same dtype, a floor). `Δ vs prod @S`: the same error against the production step at full size.",
             ""]
    for key, grp in groups.items():
        first = grp[0]
        env = first.get("env") or {}
        lines += [f"## {first['mode']}: {first['mask']}, S={first['seqlen']}, B={first['batch']}, "
                  f"Hq:Hkv={first['heads_q']}:{first['heads_kv']}, D={first['head_dim']}, {first['dtype']}", ""]
        lines.append(f"Device: {first.get('device')} · torch {env.get('torch')} · triton {env.get('triton')} · "
                     f"CUDA {env.get('cuda')} · commit {str(env.get('git_commit') or '?')[:10]}"
                     f"{' (dirty)' if env.get('git_dirty') else ''} · "
                     f"{first.get('time', '')}. Checked at S={first.get('check_seqlen')}"
                     + (f" (PyTorch's own error {first['torch_err']:.1e}, tolerance {first['check_tol']:.1e})."
                        if first.get("torch_err") is not None else "."))
        if first.get("command") or command:
            lines.append(f"Command: `{first.get('command') or command}`")
        lines.append("")
        cols = _columns(grp)
        lines.append("| " + " | ".join(h for _, h in cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for r in grp:
            c = _cells(r)
            cells = [c[k].replace("|", "\\|") for k, _ in cols]
            cells[0] = f"`{cells[0]}`" if r.get("kind") != "vendor" else f"*{cells[0]}*"
            lines.append("| " + " | ".join(cells) + " |")
        if any(r.get("median_ms") is not None for r in grp):
            lines += ["", f"![{first['mode']} ladder]({_chart_name(first['mode'], first)})"]
        lines.append("")
    return "\n".join(lines)


def _chart_name(mode: str, row: dict | None = None) -> str:
    return f"ladder_{mode}.png"


def plot_chart(rows: list[dict], path: Path, title: str) -> bool:
    """Bar chart of TFLOP/s per step, the vendor as a dashed line. False when nothing was timed."""
    steps = [r for r in rows if r.get("kind") == "ladder"]
    vendor = next((r for r in rows if r.get("kind") == "vendor" and r.get("tflops")), None)
    vals = [r.get("tflops") or 0.0 for r in steps]
    positive = [x for x in vals if x > 0]
    if not positive:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    top = max(positive + ([vendor["tflops"]] if vendor else []))
    # the ladder spans orders of magnitude: a log axis keeps the early steps visible
    log = top / min(positive) > 30
    floor = min(positive) / 2 if log else 0.0
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(steps)), 4.5))
    colors = ["#4c72b0" if r.get("triton") else "#8c8c8c" for r in steps]
    ax.bar(range(len(steps)), [v if v > 0 else floor for v in vals], color=colors)
    for i, r in enumerate(steps):
        label = f"{r['tflops']:.0f}" if r.get("tflops") else (r.get("status") or "—")
        if r.get("x_prev"):
            label += f"\n{r['x_prev']:.1f}×"
        ax.text(i, max(vals[i], floor), label, ha="center", va="bottom", fontsize=8)
    if vendor:
        ax.axhline(vendor["tflops"], color="#c44e52", ls="--", lw=1)
        ax.text(len(steps) - 0.5, vendor["tflops"], f"{VENDOR} {vendor['tflops']:.0f}", color="#c44e52",
                ha="right", va="bottom", fontsize=8)
    ax.set_xticks(range(len(steps)))
    ax.set_xticklabels([r["step"].replace("_", "\n", 1) for r in steps], fontsize=8)
    ax.set_ylabel("TFLOP/s (allowed pairs, docs/masks.md §5)")
    if log:
        ax.set_yscale("log")
        ax.set_ylim(floor, top * 3)
    else:
        ax.set_ylim(0, top * 1.18)
    ax.legend(handles=[Patch(color="#8c8c8c", label="PyTorch"), Patch(color="#4c72b0", label="Triton")],
              loc="upper left", fontsize=8, frameon=False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def write_outputs(rows: list[dict], out_dir, command: str | None = None) -> list[Path]:
    """Merge ``rows`` into ``out_dir/ladder.jsonl`` (replacing rows of the same problem), rewrite
    ``ladder.md`` from the whole file, and draw ``ladder_<mode>.png`` for this run."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if command:
        rows = [{**r, "command": command} for r in rows]
    jsonl = out / "ladder.jsonl"
    store = ResultStore(jsonl)  # the harness's store; a re-run replaces the rows of its problem
    keys = {_group_key(r) for r in rows}
    merged = [r for r in store.rows() if _group_key(r) not in keys] + rows
    store.rewrite(merged)
    md = out / "ladder.md"
    md.write_text(render_markdown(merged))
    written = [jsonl, md]
    if rows:
        first = rows[0]
        title = (f"Kernel ladder: {first['mask']} S={first['seqlen']} {first['mode']}, "
                 f"Hq:Hkv={first['heads_q']}:{first['heads_kv']} D={first['head_dim']} {first['dtype']}, {first.get('device')}")
        png = out / _chart_name(first["mode"])
        if plot_chart(rows, png, title):
            written.append(png)
    return written

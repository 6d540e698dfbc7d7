"""The paper's views of a results file (matplotlib, Agg backend).

* ``tflops_<slice>.png``: TFLOP/s against S, one panel per mask (per mask variant where the
  experiment sweeps mask parameters, e.g. block size × density), one line per backend;
* ``memory_<slice>.png``: peak memory (absolute, solid; above the inputs, dotted) against S;
* ``heatmap_<slice>.png``: backend × mask at the largest S of the slice: colour = TFLOP/s,
  text = the value or why there is none (unsup / OOM / ERR / WRONG).

A slice is one (mode, heads, head dim, dtype, batch), so fwd and bwd get their own figures.
"""

from __future__ import annotations

import math
from pathlib import Path

from .report import latest_rows, mask_label, short_status, slices
from .store import CPU_TAG, on_cpu, status_kind

__all__ = ["VIEWS", "make_plots", "register_plotter", "PLOTTERS"]

# rows of another ``kind`` (e.g. "cp") are drawn by a plotter registered for that kind:
# ``fn(rows, out_dir) -> list[Path]``. The harness knows no such kind; the CLI (or a caller) registers them.
PLOTTERS: dict = {}


def register_plotter(kind: str, fn) -> None:
    """Draw rows with ``row["kind"] == kind`` with ``fn(rows, out_dir)`` instead of the attention views."""
    PLOTTERS[kind] = fn


def _slice_tag(key) -> str:
    mode, hq, hkv, D, dt, B = key
    tag = f"{mode}_h{hq}-{hkv}_d{str(D).replace('/', '-')}_{dt}"  # "192/128" -> d192-128 in a file name
    return tag + (f"_b{B}" if B not in (1, None) else "")


def _slice_title(key) -> str:
    mode, hq, hkv, D, dt, B = key
    return f"{mode}, heads {hq}:{hkv}, D={D}, {dt}, batch {B}"


def _fmt_s(S: int) -> str:
    return f"{S // 1024}K" if S % 1024 == 0 and S >= 1024 else str(S)


def _order(values):
    seen = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen


def _short_labels(labels: list[str]) -> tuple[list[str], str | None]:
    """Variants of one mask (``block_sparse[block=64,density=0.2]``, ...) shown by their swept
    values alone, with the mask's name returned for the title."""
    names = {lab.split("[", 1)[0] for lab in labels}
    if len(names) == 1 and labels and all(lab.endswith("]") and "[" in lab for lab in labels):
        return [lab.split("[", 1)[1][:-1] for lab in labels], names.pop()
    return list(labels), None


VIEWS = ("tflops", "memory", "heatmap")


def make_plots(rows: list[dict], out_dir: str | Path, views=VIEWS) -> list[Path]:
    """Write the views (``VIEWS``, or the ones named) of every slice; returns the files."""
    bad = sorted(set(views) - set(VIEWS))
    if bad:
        raise ValueError(f"unknown plot view(s) {', '.join(bad)}; valid: {', '.join(VIEWS)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for kind, plotter in PLOTTERS.items():  # e.g. context-parallel rows: scheme x plan x world size views
        kind_rows = [r for r in rows if r.get("kind") == kind]
        if kind_rows:
            written += plotter(kind_rows, out)
            rows = [r for r in rows if r.get("kind") != kind]
    if not rows:
        return written
    rows = latest_rows(rows)
    all_backends = _order(r["backend"] for r in rows)
    cmap = plt.get_cmap("tab10" if len(all_backends) <= 10 else "tab20")
    color = {b: cmap(i % cmap.N) for i, b in enumerate(all_backends)}
    markers = "osD^v<>pPX*h"
    marker = {b: markers[i % len(markers)] for i, b in enumerate(all_backends)}

    for key, srows in slices(rows).items():
        masks = _order(mask_label(r) for r in srows)  # a panel per mask (per variant of a parameter sweep)
        backends = _order(r["backend"] for r in srows)
        tag, title = _slice_tag(key), _slice_title(key)
        short, common = _short_labels(masks)
        if common:
            title = f"{common}, {title}"
        if any(on_cpu(r) for r in srows):
            title = f"{title} [{CPU_TAG}]"
        n = len(masks)
        ncols = min(4, n)
        nrows = math.ceil(n / ncols)
        for what in [v for v in ("tflops", "memory") if v in views]:
            fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.3 * nrows), squeeze=False)
            any_line = False
            for i, m in enumerate(masks):
                ax = axes[i // ncols][i % ncols]
                for b in backends:
                    pts = sorted(((r["seqlen"], r) for r in srows if mask_label(r) == m and r["backend"] == b and status_kind(r) == "ok"),
                                 key=lambda sr: sr[0])
                    if what == "tflops":
                        xs = [s for s, r in pts if isinstance(r.get("tflops"), (int, float))]
                        ys = [r["tflops"] for s, r in pts if isinstance(r.get("tflops"), (int, float))]
                        if xs:
                            ax.plot(xs, ys, marker=marker[b], color=color[b], label=b, lw=1.5, ms=4)
                            any_line = True
                    else:
                        xs = [s for s, r in pts if isinstance(r.get("peak_mem_bytes"), (int, float))]
                        ys = [r["peak_mem_bytes"] / 2**30 for s, r in pts if isinstance(r.get("peak_mem_bytes"), (int, float))]
                        ya = [r["peak_mem_above_bytes"] / 2**30 for s, r in pts if isinstance(r.get("peak_mem_above_bytes"), (int, float))]
                        if xs:
                            ax.plot(xs, ys, marker=marker[b], color=color[b], label=b, lw=1.5, ms=4)
                            if len(ya) == len(xs):
                                ax.plot(xs, ya, ls=":", color=color[b], lw=1)
                            any_line = True
                ax.set_title(short[i], fontsize=10)
                ax.set_xscale("log", base=2)
                seqlens = sorted({r["seqlen"] for r in srows if mask_label(r) == m})
                if seqlens:
                    ax.set_xticks(seqlens)
                    ax.set_xticklabels([_fmt_s(s) for s in seqlens], fontsize=8)
                ax.tick_params(axis="y", labelsize=8)
                ax.grid(True, alpha=0.3)
                if i % ncols == 0:
                    ax.set_ylabel("TFLOP/s" if what == "tflops" else "peak memory (GiB)", fontsize=9)
                if i // ncols == nrows - 1:
                    ax.set_xlabel("sequence length", fontsize=9)
            for j in range(n, nrows * ncols):
                axes[j // ncols][j % ncols].axis("off")
            if not any_line:
                plt.close(fig)
                continue
            handles = [plt.Line2D([], [], color=color[b], marker=marker[b], label=b) for b in backends]
            fig.legend(handles=handles, loc="lower center", ncol=min(len(backends), 6), fontsize=8, frameon=False)
            sub = "TFLOP/s (allowed area only)" if what == "tflops" else "peak memory: absolute (solid), above inputs (dotted)"
            fig.suptitle(f"{sub} — {title}", fontsize=11)
            fig.tight_layout(rect=(0, 0.06 + 0.02 * (len(backends) > 6), 1, 0.95))
            path = out / f"{what}_{tag}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)

        if "heatmap" not in views:
            continue
        # heat map at the largest S of the slice
        S = max(r["seqlen"] for r in srows)
        cell = {(r["backend"], mask_label(r)): r for r in srows if r["seqlen"] == S}
        if not cell:
            continue
        longest = max(len(x) for x in short)
        fig, ax = plt.subplots(figsize=(max(6.5, 2.0 + 1.05 * len(masks)), 1.2 + 0.45 * len(backends) + 0.06 * longest))
        import numpy as np

        data = np.full((len(backends), len(masks)), np.nan)
        for bi, b in enumerate(backends):
            for mi, m in enumerate(masks):
                r = cell.get((b, m))
                if r is not None and status_kind(r) == "ok" and isinstance(r.get("tflops"), (int, float)):
                    data[bi, mi] = r["tflops"]
        cm = plt.get_cmap("viridis").with_extremes(bad="#dddddd")
        im = ax.imshow(np.ma.masked_invalid(data), cmap=cm, aspect="auto")
        vmax = np.nanmax(data) if np.isfinite(data).any() else 1.0
        for bi, b in enumerate(backends):
            for mi, m in enumerate(masks):
                r = cell.get((b, m))
                text = short_status(r) if r is not None else ""
                v = data[bi, mi]
                ax.text(mi, bi, text, ha="center", va="center", fontsize=7,
                        color="white" if np.isfinite(v) and v < 0.6 * vmax else "black")
        ax.set_xticks(range(len(masks)))
        ax.set_xticklabels(short, rotation=35, ha="right", fontsize=8)
        ax.set_yticks(range(len(backends)))
        ax.set_yticklabels(backends, fontsize=8)
        fig.colorbar(im, ax=ax, label="TFLOP/s")
        ax.set_title(f"support and speed at S={_fmt_s(S)} — {title}", fontsize=10)
        fig.tight_layout()
        path = out / f"heatmap_{tag}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written

"""The findings' figures (matplotlib, Agg backend), written next to the markdown.

* ``tflops_<slice>.png``: TFLOP/s against S, a panel per mask, a line per backend: the harness's
  own view (``bench.plot.make_plots``, TFLOP/s only) on the dense rows;
* ``winners_<slice>.png``: the winner by (mask, S): colour = the winning backend, text = its name
  and its margin over the runner-up (grey: nothing measured there);
* ``winner_map_<layout>.png``: the main page's picture, the headline layout's winner maps of
  every mode side by side with one colour per backend;
* ``sparse_density_<slice>.png``: block-sparse TFLOP/s against density, a panel per (mask, block,
  S), a line per backend.

Every PNG is rewritten with a 256-colour palette (Pillow's median cut, deterministic): about 3x
smaller than matplotlib's RGBA for these charts, with no visible change; the page's plots are
committed and every regeneration adds them to the history.
"""

from __future__ import annotations

from pathlib import Path

from longca_triton.bench.plot import _slice_tag, make_plots

from .findings import Findings, fmt_s, slice_title
from .findings_headline import MODE_NAMES, Headline, headline, mask_rows

__all__ = ["make_findings_plots"]


def make_findings_plots(f: Findings, out_dir: str | Path,
                        h: Headline | None = None) -> dict[str, list[tuple[tuple, Path]]]:
    """Write every figure; returns ``{"tflops" | "winners" | "sparse": [(slice key, path)], "winner_map":
    [(layout, path)]}``. ``h``: ``headline(f)`` where the caller has it already."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, list] = {"tflops": [], "winners": [], "winner_map": [], "sparse": []}
    dense = [r for r in f.rows if r.get("kind") == "dense"]
    if dense:
        paths = make_plots(dense, out, views=("tflops",))
        for p in paths:
            _palette_png(p)
        for sk in f.cells:
            p = out / f"tflops_{_slice_tag(sk)}.png"
            if p in paths:
                written["tflops"].append((sk, p))
    for sk, masks in f.cells.items():
        if p := _winner_map(sk, masks, out):
            written["winners"].append((sk, p))
    h = h or headline(f)
    if h is not None and (p := _layout_map(h.layout, h.slices, mask_rows(h), out)):
        written["winner_map"].append((h.layout, p))
    for sk in dict.fromkeys(d["slice"] for d in f.sparse):
        if p := _sparse_density(sk, [d for d in f.sparse if d["slice"] == sk], out):
            written["sparse"].append((sk, p))
    return written


def _palette_png(path: Path) -> None:
    """Rewrite a PNG with a 256-colour palette (see module doc)."""
    from PIL import Image

    with Image.open(path) as im:
        _write_palette(im, path)


def _write_palette(im, path: Path) -> None:
    im.convert("RGB").quantize(256).save(path, optimize=True)


def _save_palette(fig, path: Path, dpi: int = 110) -> None:
    """Write a figure as a 256-colour PNG straight from its pixels (the same file as ``savefig``
    then ``_palette_png``, without encoding and decoding a full-colour PNG in between); closes it."""
    import matplotlib.pyplot as plt
    from PIL import Image

    fig.set_dpi(dpi)
    fig.canvas.draw()
    _write_palette(Image.frombuffer("RGBA", fig.canvas.get_width_height(physical=True), fig.canvas.buffer_rgba(),
                                    "raw", "RGBA", 0, 1), path)
    plt.close(fig)


def _backend_colors(names):
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {b: cmap(i % cmap.N) for i, b in enumerate(names)}


def _winner_map(sk, masks: dict, out: Path) -> Path | None:
    import matplotlib.pyplot as plt

    names = list(masks)
    lengths = sorted({c.seqlen for cells in masks.values() for c in cells})
    winners = _winners([masks])
    if not winners:
        return None
    fig, ax = plt.subplots(figsize=(max(6.5, 2.5 + 1.25 * len(lengths)), 1.6 + 0.5 * len(names)))
    _draw_winners(ax, masks, names, lengths, winners, _backend_colors(winners), fontsize=7)
    ax.set_yticklabels(names, fontsize=8)
    ax.set_title(f"winner by (mask, S), × = margin over the runner-up\n{slice_title(sk)}", fontsize=9)
    fig.tight_layout()
    path = out / f"winners_{_slice_tag(sk)}.png"
    _save_palette(fig, path)
    return path


def _winners(slices: list[dict]) -> list[str]:
    """The backends that win a cell of the slices, in first-seen order (their colours' order)."""
    return list(dict.fromkeys(c.winner[0] for masks in slices for cells in masks.values() for c in cells if c.winner))


def _draw_winners(ax, masks: dict, names: list[str], lengths: list[int], winners: list[str], color: dict,
                  fontsize: float) -> None:
    """One winner map on ``ax``: a row per mask of ``names``, a column per length; colour = the
    winner, text = its name and its margin over the runner-up (grey: nothing measured)."""
    import numpy as np
    from matplotlib.colors import ListedColormap

    data = np.full((len(names), len(lengths)), np.nan)
    text = [["" for _ in lengths] for _ in names]
    for mi, m in enumerate(names):
        for c in masks.get(m, []):
            si = lengths.index(c.seqlen)
            if c.winner:
                data[mi, si] = winners.index(c.winner[0])
                text[mi][si] = c.winner[0] + (f"\n×{c.margin:.2f}" if c.margin else "\n(alone)")
            else:
                text[mi][si] = "none ok"
    cm = ListedColormap([color[w] for w in winners]).with_extremes(bad="#dddddd")
    ax.imshow(np.ma.masked_invalid(data), cmap=cm, vmin=-0.5, vmax=len(winners) - 0.5, aspect="auto")
    for mi in range(len(names)):
        for si in range(len(lengths)):
            # inside the axes: left out of tight_layout's measuring, which would otherwise size every cell's text
            ax.text(si, mi, text[mi][si], ha="center", va="center", fontsize=fontsize).set_in_layout(False)
    ax.set_xticks(range(len(lengths)))
    ax.set_xticklabels([fmt_s(s) for s in lengths], fontsize=8)
    ax.set_yticks(range(len(names)))
    ax.set_xlabel("sequence length")


def _layout_map(layout: tuple, slices: dict, names: list[str], out: Path) -> Path | None:
    """The main page's picture: the winner maps of one layout's modes side by side, one colour per
    backend across the panels, the masks in ``names`` order."""
    import matplotlib.pyplot as plt

    winners = _winners(list(slices.values()))
    if not winners:
        return None
    color = _backend_colors(winners)
    lengths = sorted({c.seqlen for masks in slices.values() for cells in masks.values() for c in cells})
    fig, axes = plt.subplots(1, len(slices), sharey=True, squeeze=False,
                             figsize=(2.6 + len(slices) * (0.8 + 0.85 * len(lengths)), 1.2 + 0.3 * len(names)))
    for ax, (mode, masks) in zip(axes[0], slices.items()):
        _draw_winners(ax, masks, names, lengths, winners, color, fontsize=6)
        ax.set_title(MODE_NAMES.get(mode, mode), fontsize=9)
    axes[0][0].set_yticklabels(names, fontsize=7)
    hq, hkv, d, dt, b = layout
    fig.suptitle(f"winner by (mask, S), × = margin over the runner-up; heads {hq}:{hkv}, D = {d}, {dt}"
                 + (f", batch {b}" if b != 1 else ""), fontsize=9)
    fig.tight_layout()
    path = out / f"winner_map_{_slice_tag(('mode', *layout)).removeprefix('mode_')}.png"  # a slice's tag less its mode
    _save_palette(fig, path)
    return path


def _sparse_density(sk, items: list[dict], out: Path) -> Path | None:
    import math

    import matplotlib.pyplot as plt

    ok = [d for d in items if d["tflops"] is not None and d["nominal"] is not None]
    if not ok:
        return None
    panels = list(dict.fromkeys((d["mask"], d["block"], d["S"]) for d in ok))
    backends = list(dict.fromkeys(d["backend"] for d in ok))
    color = _backend_colors(backends)
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.4 * ncols, 3.4 * nrows), squeeze=False)
    for i, (m, block, S) in enumerate(panels):
        ax = axes[i // ncols][i % ncols]
        for b in backends:
            pts = sorted((d["nominal"], d["tflops"]) for d in ok if (d["mask"], d["block"], d["S"], d["backend"]) == (m, block, S, b))
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=color[b], label=b, lw=1.5, ms=5)
        ax.set_title(f"{m}, block {block}, S = {fmt_s(S)}", fontsize=9)
        ax.set_xlabel("density (kept fraction of blocks)", fontsize=8)
        ax.set_xlim(0, 1)
        ax.grid(True, alpha=0.3)
        if i % ncols == 0:
            ax.set_ylabel("TFLOP/s (kept area)", fontsize=8)
    for j in range(len(panels), nrows * ncols):
        axes[j // ncols][j % ncols].axis("off")
    handles = [plt.Line2D([], [], color=color[b], marker="o", label=b) for b in backends]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(backends), 5), fontsize=8, frameon=False)
    fig.suptitle(f"block-sparse TFLOP/s against density — {slice_title(sk)}", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.94))
    path = out / f"sparse_density_{_slice_tag(sk)}.png"
    _save_palette(fig, path)
    return path

"""Statistics and pictures of a mask, for ``longca-triton masks show`` (and notebooks)."""

from __future__ import annotations

import numpy as np

from .ir import BlockSparseMask, Mask, RangeMask


def mask_stats(mask: Mask, tile: int = 128) -> dict:
    """Area, density, structure and tile counts, all from the IR (no dense ``S × S``)."""
    stats: dict = {"mask": mask.describe()}
    area = mask.area
    stats["area"] = area if isinstance(area, int) else f"{area} (per pattern)"
    stats["density"] = f"{mask.density:.4f}"
    if isinstance(mask, RangeMask):
        stats["slices"] = len(mask.slices)
        lo, hi = mask.row_intervals()
        stats["max key intervals per row"] = lo.shape[1]
        empty = int(((hi - lo).sum(axis=1) == 0).sum())
        stats["rows attending nothing"] = empty
    else:
        sizes = np.diff(mask.q_block_bounds)
        stats["patterns"] = mask.num_patterns
        stats["blocks"] = f"{len(sizes)} (sizes {int(sizes.min())}..{int(sizes.max())}, mean {sizes.mean():.1f})"
    if "doc_bounds" in mask.params:
        lens = np.diff(mask.params["doc_bounds"])
        stats["documents"] = f"{len(lens)} (lengths {int(lens.min())}..{int(lens.max())}, mean {lens.mean():.1f})"
    t = mask.block_tables(tile, tile)
    total = t.num_m * t.num_n * mask.num_patterns
    stats[f"tiles {tile}x{tile}"] = (
        f"{t.num_full} full, {t.num_partial} partial, {total - t.num_full - t.num_partial} empty of {total}"
    )
    return stats


def _picture(mask: Mask, pixels: int) -> tuple[np.ndarray, int]:
    """Fraction of allowed pairs per picture cell (``[n, n]``), and the cell size in tokens."""
    S = max(mask.seqlen_q, mask.seqlen_k)
    cell = max(1, -(-S // pixels))
    t = mask.block_tables(cell, cell)
    full, part = t.to_dense_tiles()
    if full.ndim == 3:  # block-sparse: show the first pattern
        full, part = full[0], part[0]
    img = full.astype(float)
    if cell == 1 or not part.any():
        return img, cell
    # partial cells: exact coverage from the row intervals (range masks) or the dense map (small S)
    if isinstance(mask, RangeMask):
        rows, lo, hi = mask.merged_row_intervals()
        cover = np.zeros((t.num_m, t.num_n), dtype=np.float64)
        for m, n in zip(*np.nonzero(part)):
            sel = (rows >= m * cell) & (rows < (m + 1) * cell)
            a, b = n * cell, min((n + 1) * cell, mask.seqlen_k)
            cover[m, n] = np.clip(np.minimum(hi[sel], b) - np.maximum(lo[sel], a), 0, None).sum()
        rows_in = np.minimum(cell, mask.seqlen_q - np.arange(t.num_m) * cell)[:, None]
        cols_in = np.minimum(cell, mask.seqlen_k - np.arange(t.num_n) * cell)[None, :]
        img = np.where(part, cover / (rows_in * cols_in), img)
    else:
        img = np.where(part, 0.5, img)
    return img, cell


def plot_mask(mask: Mask, path: str, pixels: int = 512) -> None:
    """A picture of the mask: exact for ``S <= pixels``, else each pixel a ``cell × cell`` tile shaded by its coverage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img, cell = _picture(mask, pixels)
    fig, ax = plt.subplots(figsize=(6, 6), dpi=120)
    ax.imshow(img, cmap="Blues", vmin=0, vmax=1, interpolation="nearest", extent=(0, mask.seqlen_k, mask.seqlen_q, 0))
    title = f"{mask.name}  S={mask.seqlen_q}  density={mask.density:.3f}"
    if isinstance(mask, BlockSparseMask) and mask.num_patterns > 1:
        title += f"  (pattern 0 of {mask.num_patterns})"
    ax.set_title(title + (f"\n(one pixel = {cell}×{cell} tokens)" if cell > 1 else ""), fontsize=9)
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

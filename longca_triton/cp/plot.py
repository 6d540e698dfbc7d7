"""Views of a CP results file (rows with ``kind == "cp"``; matplotlib, Agg backend).

* ``cp_efficiency_<mode>_N<N>.png``: one panel per mask, grouped bars: a group per scheme (and
  per peer row), a bar per plan, height = efficiency (single-GPU time of the same kernel on the
  whole sequence / (N x the slowest rank's time)); the 0.85 line is the CP target.
* ``cp_scaling_<mode>.png`` (when more than one world size is present): per-GPU TFLOP/s of each
  scheme's best plan against N, one panel per mask, with the single-GPU TFLOP/s at N = 1, and
  below it the efficiency and the bytes per device the closed-form ``comm`` model predicts for
  each scheme and N (``group_cast``: the busiest device, from the row's mask rebuilt by its
  recorded parameters). Sequences grow with N (fixed tokens per GPU), so the dotted line is the
  single-GPU kernel on each N's whole sequence, the denominator of the efficiency.

``longca-triton plot RESULTS`` sends CP rows here; ``bench cp`` writes these under ``OUT/plots``.
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["make_cp_plots", "latest_cp_rows"]

_SCHEME_ORDER = ("ulysses", "ring_p2p", "ring_allgather", "usp", "loongtrain", "group_cast")
_PLAN_ORDER = ("contiguous", "zigzag", "balanced")


def latest_cp_rows(rows) -> list[dict]:
    """One row per CP point (the last written wins), CP rows only."""
    latest: dict = {}
    for r in rows:
        if r.get("kind") != "cp":
            continue
        key = (r.get("backend"), r.get("mask"), r.get("seqlen"), r.get("mode"), r.get("world_size"),
               r.get("scheme"), r.get("plan"), r.get("ulysses_degree"), r.get("heads_q"), r.get("heads_kv"),
               r.get("head_dim"), r.get("dtype"))
        latest.pop(key, None)
        latest[key] = r
    return list(latest.values())


def _row_mask(r):
    """The row's mask, rebuilt from its name, length and recorded parameters (document bounds, window,
    prefix, block: what ``make_mask`` accepts), for the group_cast comm model (busiest device)."""
    from longca_triton.masks import MASK_SPECS, make_mask

    name, params = r["mask"], dict(r.get("mask_params") or {})
    if name not in MASK_SPECS:
        raise ValueError(f"unknown mask {name!r}")
    keep = {k: v for k, v in params.items() if k in MASK_SPECS[name].defaults and k not in ("docs", "distribution", "doc_lens")}
    return make_mask(name, int(r["seqlen"]), seed=int(params.get("seed", 0)), **keep)


def _ok(r) -> bool:
    return str(r.get("status", "")).startswith("ok") and isinstance(r.get("efficiency"), (int, float))


def _group(r) -> str:
    """Bar group: the scheme for our layer, the backend label for a peer row."""
    b = str(r.get("backend", ""))
    return b if b.startswith("yunchang") else r["scheme"]


def _where(rows) -> str:
    """The GPU the rows ran on, for a title; rows measured on a CPU say they are no performance numbers."""
    from longca_triton.bench.store import CPU_TAG, on_cpu

    return f"[{CPU_TAG}]" if any(on_cpu(r) for r in rows) else str(rows[0].get("gpu") or "")


def _order(values, first=()):
    seen = [v for v in first if v in values]
    return seen + sorted(v for v in set(values) if v not in seen)


def make_cp_plots(rows, out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = latest_cp_rows(rows)
    written: list[Path] = []
    plan_color = {p: plt.get_cmap("tab10")(i) for i, p in enumerate(_PLAN_ORDER)}
    for mode in _order({r["mode"] for r in rows}, ("fwd", "fwd_bwd", "bwd")):
        mrows = [r for r in rows if r["mode"] == mode]
        worlds = sorted({r["world_size"] for r in mrows if r["world_size"] > 1})
        masks = _order([r["mask"] for r in mrows], ("full", "causal"))
        for N in worlds:
            nrows_ = [r for r in mrows if r["world_size"] == N]
            ncols = min(3, len(masks))
            nr = math.ceil(len(masks) / ncols)
            fig, axes = plt.subplots(nr, ncols, figsize=(5.2 * ncols, 3.4 * nr), squeeze=False)
            for i, m in enumerate(masks):
                ax = axes[i // ncols][i % ncols]
                mr = [r for r in nrows_ if r["mask"] == m]
                groups = _order([_group(r) for r in mr], _SCHEME_ORDER)
                width = 0.8 / len(_PLAN_ORDER)
                for gi, g in enumerate(groups):
                    for pi, p in enumerate(_PLAN_ORDER):
                        pts = [r for r in mr if _group(r) == g and r["plan"] == p]
                        x = gi + (pi - (len(_PLAN_ORDER) - 1) / 2) * width
                        if pts and _ok(pts[0]):
                            ax.bar(x, pts[0]["efficiency"], width, color=plan_color[p])
                        elif pts:  # unsupported / error: say so instead of a zero-height bar
                            ax.text(x, 0.02, "n/a", rotation=90, ha="center", va="bottom", fontsize=6, color="grey")
                ax.axhline(0.85, color="k", ls=":", lw=1)
                ax.axhline(1.0, color="grey", lw=0.6)
                ax.set_xticks(range(len(groups)))
                ax.set_xticklabels([g.replace("yunchang-usp", "yunchang") for g in groups], rotation=25, ha="right", fontsize=7)
                ax.set_ylim(0, 1.15)
                ax.set_title(m, fontsize=10)
                ax.tick_params(axis="y", labelsize=8)
                if i % ncols == 0:
                    ax.set_ylabel("efficiency", fontsize=9)
            for j in range(len(masks), nr * ncols):
                axes[j // ncols][j % ncols].axis("off")
            handles = [plt.Rectangle((0, 0), 1, 1, color=plan_color[p], label=p) for p in _PLAN_ORDER]
            fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
            r0 = nrows_[0]
            fig.suptitle(f"CP efficiency, {mode}, N = {N}, {r0.get('tokens_per_gpu')} tokens/GPU, heads "
                         f"{r0.get('heads_q')}:{r0.get('heads_kv')}, D={r0.get('head_dim')}, {r0.get('dtype')}, "
                         f"{_where(nrows_)} (dotted: 0.85)", fontsize=10)
            fig.tight_layout(rect=(0, 0.05, 1, 0.94))
            path = out / f"cp_efficiency_{mode}_N{N}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
        if len(worlds) >= 2:
            written.append(_scaling(plt, mrows, masks, mode, out))
    return written


def _model_mib(scheme: str, N: int, row: dict, mode: str, plan: str, ulysses_degree) -> float | None:
    """MiB the ``comm`` model says one GPU sends for ``scheme`` at ``N`` on ``row``'s problem (fwd, or
    fwd + bwd); ``None`` where it cannot (group_cast of a mask the row does not let us rebuild)."""
    from .comm import comm_model

    try:
        comm = comm_model(scheme, N, ulysses_degree, seqlen=row["seqlen"], heads=(row["heads_q"], row["heads_kv"]),
                          head_dim=row["head_dim"], dtype_bytes=2 if row.get("dtype") in ("bfloat16", "float16") else 4,
                          plan=plan, window=row.get("window"), mask=_row_mask(row) if scheme == "group_cast" else None,
                          chunks_per_rank=row.get("chunks_per_rank") if plan == "balanced" and row.get("plan") == "balanced"
                          else None)
    except ValueError:
        return None
    phases = ("fwd",) if mode == "fwd" else ("fwd", "bwd")
    return sum(c.bytes_sent for c in comm if c.phase in phases) / 2**20


def _unmeasured(mr: list, scheme: str, worlds: list) -> list:
    """``(N, reference row)`` for each world size where ``scheme`` has no row but was measured at
    another N (so its line has a gap the model can fill) and another scheme has a row of that N."""
    have = {r["world_size"] for r in mr if r["scheme"] == scheme}
    if not have:
        return []
    out = []
    for N in worlds:
        refs = [r for r in mr if r["world_size"] == N and r["scheme"] != "single"]
        if N not in have and refs:
            out.append((N, min(refs, key=lambda r: (r["plan"] != "balanced", r["scheme"]))))
    return out


def _scaling(plt, mrows, masks, mode, out: Path) -> Path:
    ncols = len(masks)
    fig, axes = plt.subplots(3, ncols, figsize=(4.2 * ncols, 9.2), squeeze=False)
    colors = {s: plt.get_cmap("tab10")(i) for i, s in enumerate(_SCHEME_ORDER)}
    r0 = mrows[0]
    for i, m in enumerate(masks):
        ax, axe, axc = axes[0][i], axes[1][i], axes[2][i]
        mr = [r for r in mrows if r["mask"] == m and _ok(r) and not str(r.get("backend", "")).startswith("yunchang")]
        worlds = sorted({r["world_size"] for r in mr if r["world_size"] > 1})
        for s in _SCHEME_ORDER:
            xs, ys, effs, bytes_ = [], [], [], []
            for N in worlds:
                pts = [r for r in mr if r["scheme"] == s and r["world_size"] == N]
                if pts:
                    best = max(pts, key=lambda r: r["tflops_per_gpu"])
                    xs.append(N)
                    ys.append(best["tflops_per_gpu"])
                    effs.append(best["efficiency"])
                    bytes_.append(_model_mib(s, N, best, mode, best["plan"], best.get("ulysses_degree")))
            if xs:
                ax.plot(xs, ys, marker="o", color=colors[s], label=s)
                axe.plot(xs, effs, marker="o", color=colors[s], label=s)
                pts = [(x, y) for x, y in zip(xs, bytes_) if y is not None]
                if pts:
                    axc.plot([x for x, _ in pts], [y for _, y in pts], marker="s", ls="--", color=colors[s], label=s)
                # world sizes the scheme was not run at: its modelled bytes (hollow), from another
                # scheme's row of the same mask and N, on the balanced plan
                model = [(N, _model_mib(s, N, ref, mode, "balanced", None)) for N, ref in _unmeasured(mr, s, worlds)]
                model = [(x, y) for x, y in model if y is not None]
                if model:
                    axc.plot([x for x, _ in model], [y for _, y in model], marker="s", mfc="none", ls="none",
                             color=colors[s], label=f"{s} (model only)")
        # the single-GPU kernel on each world size's whole sequence (weak scaling: S grows with N)
        singles = sorted((r["seqlen"], r["tflops_per_gpu"])
                         for r in mr if r["world_size"] == 1)
        if singles:
            xs1 = [r_s // mr[0]["tokens_per_gpu"] for r_s, _ in singles]
            ax.plot(xs1, [t for _, t in singles], ls=":", color="k", marker="x", label="1 GPU, same S")
        axe.axhline(0.85, color="k", ls=":", lw=1)
        for a in (ax, axe, axc):
            a.set_xscale("log", base=2)
            a.grid(True, alpha=0.3)
            a.tick_params(labelsize=8)
        ax.set_title(m, fontsize=10)
        axc.set_xlabel("GPUs (N)", fontsize=9)
        if i == 0:
            ax.set_ylabel("TFLOP/s per GPU (best plan)", fontsize=9)
            axe.set_ylabel("efficiency (best plan)", fontsize=9)
            axc.set_ylabel("comm model: MiB sent per GPU", fontsize=9)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"CP scaling, {mode}, {r0.get('tokens_per_gpu')} tokens/GPU, heads {r0.get('heads_q')}:"
                 f"{r0.get('heads_kv')}, D={r0.get('head_dim')}, {r0.get('dtype')}, {_where(mrows)}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    path = out / f"cp_scaling_{mode}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

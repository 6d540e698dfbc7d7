"""Which config ``timer_bias.py`` runs put ahead of the baseline under every timer, in every case.

Session 21's rule (a default changes only where the harness's timer agrees): for each ``timer_bias.jsonl``
folder (one case each, e.g. 32K and 64K) and each config, the ratio of its mean TFLOP/s over the rounds to the
baseline's, per timer; a config is **ahead** when every ratio in every folder is above 1 + ``--margin``, and
**behind** when any ``time_fn`` ratio (the harness's back-to-back timer) is below 1 - ``--margin``.

    python experiments/gpu/timer_verdict.py $OUT/t32 $OUT/t64 [--baseline now] [--margin 0.005]

Prints one table row per (config, folder, timer) and a verdict line per config; exits 0 either way.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

HARNESS_TIMER = "time_fn"


def load(folder: Path) -> dict:
    """``{(timer, variant): [tflops, ...]}`` of one folder's ``timer_bias.jsonl``."""
    rows = defaultdict(list)
    for line in (folder / "timer_bias.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows[(r["timer"], r["variant"])].append(float(r["tflops"]))
    return rows


def ratios(rows: dict, baseline: str) -> dict:
    """``{variant: {timer: mean(variant) / mean(baseline)}}`` where both were timed."""
    out = defaultdict(dict)
    for (timer, variant), xs in rows.items():
        base = rows.get((timer, baseline))
        if variant != baseline and base:
            out[variant][timer] = statistics.fmean(xs) / statistics.fmean(base)
    return out


def verdicts(folders: list[Path], baseline: str = "now", margin: float = 0.005) -> tuple[list, dict]:
    """Table rows ``(variant, folder, timer, ratio)`` and ``{variant: "ahead" | "behind" | "mixed"}``."""
    table, per, seen = [], defaultdict(list), defaultdict(set)
    for f in folders:
        for variant, by_timer in sorted(ratios(load(f), baseline).items()):
            seen[variant].add(f)
            for timer, x in sorted(by_timer.items()):
                table.append((variant, f.name, timer, x))
                per[variant].append((timer, x))
    out = {}
    for variant, xs in per.items():
        if any(t == HARNESS_TIMER and x < 1 - margin for t, x in xs):
            out[variant] = "behind"
        elif seen[variant] == set(folders) and all(x > 1 + margin for _, x in xs):
            out[variant] = "ahead"
        else:
            out[variant] = "mixed"
    return table, out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--baseline", default="now")
    ap.add_argument("--margin", type=float, default=0.005)
    a = ap.parse_args(argv)
    table, out = verdicts(a.folders, a.baseline, a.margin)
    for variant, folder, timer, x in table:
        print(f"{variant:12s} {folder:8s} {timer:32s} {x:.3f}x {a.baseline}")
    for variant, v in sorted(out.items()):
        print(f"verdict {variant}: {v} (margin {a.margin:.3f}; the harness's timer is {HARNESS_TIMER})")


if __name__ == "__main__":
    main()

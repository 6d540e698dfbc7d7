"""Compare two trees' benchmark rows point by point: ``before_*.jsonl`` against ``after_*.jsonl``.

    python3 experiments/gpu/compare_runs.py DIR/before_dense_r1.jsonl DIR/after_dense_r1.jsonl ...

A file's label is the part of its name before the first ``_``; rounds of the same label are pooled
(median TFLOP/s). Prints a markdown table: per (backend, mask, S, mode) the before and after medians,
after / before, and the spread of each label over its rounds (max/min - 1) as the noise to read it by.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def main(paths: list[str]) -> int:
    if not paths or paths[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if paths else 2
    tflops: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for p in paths:
        label = Path(p).name.split("_", 1)[0]
        for line in Path(p).read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a killed run
                continue
            if r.get("status") != "ok":
                continue
            # the backend under its current name (old rows may carry a renamed one)
            key = (r["backend"].replace("flashmask-triton", "triton-flashmask"), r.get("mask_label") or r["mask"],
                   r["seqlen"], r["mode"])
            tflops[key][label].append(float(r["tflops"]))
    print("| backend | mask | S | mode | before TFLOP/s | after TFLOP/s | after / before | spread before | spread after |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    worst = 1.0
    for key in sorted(tflops):
        b, a = tflops[key].get("before", []), tflops[key].get("after", [])
        if not b or not a:
            continue
        mb, ma = statistics.median(b), statistics.median(a)
        worst = min(worst, ma / mb)
        spread = lambda xs: f"{max(xs) / min(xs) - 1:.1%}" if len(xs) > 1 else "—"  # noqa: E731
        print(f"| {' | '.join(map(str, key))} | {mb:.1f} | {ma:.1f} | {ma / mb:.3f} | {spread(b)} | {spread(a)} |")
    print(f"\nworst after / before: {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

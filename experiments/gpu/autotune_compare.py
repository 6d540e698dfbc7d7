"""Time the configs two autotune caches chose, side by side on the same cases (one process, one GPU).

    python3 experiments/gpu/autotune_compare.py halving.json exhaustive.json [--block 64]

For every problem class both caches hold (same GPU key), the two tuned configs (and the default)
are timed on the class's cases, alternating A, B, A, B, and scored like the tuner scores them
(geometric mean of TFLOP/s per mode). Prints a markdown table with B / A per class and mode.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from longca_triton.bench import autotune as at
from longca_triton.kernels.core import tuned


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", help="first cache (e.g. the halving search's)")
    p.add_argument("b", help="second cache (e.g. the exhaustive search's)")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    key = tuned.device_key("cuda")
    A, B = (json.load(open(x)).get(key, {}) for x in (args.a, args.b))
    print(f"| problem class | mode | default | {args.a} | {args.b} | b / a |")
    print("| --- | --- | --- | --- | --- | --- |")
    worst = None
    for cls in sorted(set(A) & set(B)):
        kernel = cls.split("|")[0]
        tunable = at.TUNABLES[kernel]
        labels = A[cls]["cases"]
        # rebuild the class's cases from the autotune defaults, keeping those the cache names
        cases = [c for c in at.cases_for(tunable, args.block, list(at.DEFAULT_MASKS), [4096, 16384], [128],
                                         [torch.bfloat16], (64, 8)) if c.label in labels]
        if not cases:
            continue
        for mode in sorted(set(tunable.groups.values())):
            score = {"default": [], "a": [], "b": []}
            cfgs = {"default": A[cls].get("default") or tunable.default(128, torch.bfloat16, cases[0].mask),
                    "a": A[cls]["config"], "b": B[cls]["config"]}
            for _ in range(args.rounds):
                for name, cfg in cfgs.items():
                    score[name].append(at.geomean([at.measure(tunable, c, cfg, mode, "cuda") for c in cases]))
            d, a, b = (statistics.median(score[n]) for n in ("default", "a", "b"))
            worst = b / a if worst is None else max(worst, b / a)
            print(f"| {cls} | {mode} | {d:.1f} | {a:.1f} | {b:.1f} | {b / a:.3f} |", flush=True)
    print(f"\nlargest b / a (how much the second search's config beats the first's): {worst:.3f}" if worst else "no common class")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

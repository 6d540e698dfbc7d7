"""Time the configs of two autotune caches against each other on the same cases: the default search's
winners (``--fast``) and an exhaustive search's (``--exhaustive``), interleaved, several rounds.

    python3 experiments/gpu/autotune_vs_exhaustive.py --fast A.json --exhaustive B.json \\
        [--kernel triton] [--masks causal,full] [--seqlens 4096] [--rounds 3] [--out rows.jsonl]

Both caches are written by ``longca-triton autotune`` with the same case options (one with
``--exhaustive``); pass those options here too, so the same problem classes and cases are rebuilt.
For each class both caches hold and each mode its row measured, the two configs run interleaved
(``bench.timing.time_interleaved``) on every case of the class, ``--rounds`` times; one JSON row per
(class, mode, round) with both geometric-mean TFLOP/s and their ratio fast / exhaustive, and a closing
table of the median ratio per (class, mode). The target of the search: every ratio >= 0.98.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from longca_triton.bench import autotune as at  # noqa: E402 - after the path above
from longca_triton.bench import autotune_run as run  # noqa: E402
from longca_triton.bench.search import geomean  # noqa: E402
from longca_triton.bench.timing import time_interleaved  # noqa: E402
from longca_triton.kernels.core.tuned import class_match, device_key, load_cache  # noqa: E402


def rows_by_class(path: str, kernel: str, device) -> dict:
    """The cache's rows of ``kernel`` on this GPU by their match (one per problem class)."""
    rows = load_cache(Path(path)).get((device_key(device), kernel), ())
    return {json.dumps(r.match, sort_keys=True): r for r in rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fast", required=True, help="autotune cache of the default search")
    p.add_argument("--exhaustive", required=True, help="autotune cache of an --exhaustive search")
    p.add_argument("--kernel", default="triton")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--masks", default=",".join(run.DEFAULT_MASKS))
    p.add_argument("--seqlens", default="4096,16384")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--heads", default="64:8")
    p.add_argument("--densities", default="0.2,0.5,0.8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep", type=int, default=20)
    p.add_argument("--out", default=None, help="JSONL file for the rows (appended)")
    a = p.parse_args()

    device = torch.device("cuda")
    tunable = at.TUNABLES[a.kernel]
    heads = tuple(int(x) for x in a.heads.split(":"))
    cases = run.cases_for(tunable, a.block, a.masks.split(","), [int(s) for s in a.seqlens.split(",")],
                          [a.head_dim], [torch.bfloat16], heads, [float(d) for d in a.densities.split(",")])
    fast, exh = rows_by_class(a.fast, a.kernel, device), rows_by_class(a.exhaustive, a.kernel, device)
    gpu = torch.cuda.get_device_name(0)
    summary = []
    for cls, members in run.group_classes(tunable, cases, a.block).items():
        c0 = members[0]
        match = json.dumps(class_match(c0.head_dim, c0.dtype, c0.heads_q // c0.heads_kv, c0.mask, a.block),
                           sort_keys=True)
        if match not in fast or match not in exh:
            print(f"{cls}: not in both caches, skipped", flush=True)
            continue
        cfg_fast, cfg_exh = fast[match].config, exh[match].config
        for mode in sorted(fast[match].measured.get("tflops", {})):
            ratios = []
            for rnd in range(a.rounds):
                tf = {"fast": [], "exhaustive": []}
                for case in members:
                    q, k, v, do = case.inputs(device)
                    fns = []
                    for cfg in (cfg_fast, cfg_exh):
                        if mode == "fwd":
                            def fn(cfg=cfg, q=q, k=k, v=v, case=case):
                                with torch.no_grad():
                                    return tunable.run(q, k, v, case.mask, cfg)
                        else:
                            out = tunable.run(q, k, v, case.mask, cfg)

                            def fn(out=out, q=q, k=k, v=v, do=do):
                                return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                        fns.append(fn)
                    t_fast, t_exh = time_interleaved(fns, rep=a.rep)
                    tf["fast"].append(case.flops(mode) / t_fast["median_ms"] / 1e9)
                    tf["exhaustive"].append(case.flops(mode) / t_exh["median_ms"] / 1e9)
                g_fast, g_exh = geomean(tf["fast"]), geomean(tf["exhaustive"])
                ratios.append(g_fast / g_exh)
                row = dict(problem_class=cls, mode=mode, round=rnd, fast_tflops=g_fast, exhaustive_tflops=g_exh,
                           ratio=g_fast / g_exh, same_config=cfg_fast == cfg_exh, cases=[c.label for c in members],
                           fast_config=cfg_fast, exhaustive_config=cfg_exh, gpu=gpu)
                print(json.dumps({k: row[k] for k in ("problem_class", "mode", "round", "ratio", "same_config")}),
                      flush=True)
                if a.out:
                    with open(a.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
            summary.append((cls, mode, statistics.median(ratios), cfg_fast == cfg_exh))
    print("\n| problem class | mode | fast / exhaustive (median of rounds) | same config |\n| --- | --- | --- | --- |")
    for cls, mode, r, same in summary:
        print(f"| {cls} | {mode} | {r:.3f} | {'yes' if same else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

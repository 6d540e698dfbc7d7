"""How long the full-breadth study (dense.toml, sparse.toml, varblock.toml) takes on one H100, from
the committed results: run on any machine (CPU), prints the estimate that study_sweep.sh's header quotes.

    python3 experiments/gpu/study_plan.py [--call-s 420] [--setup-s 90]

Model (said in the output): a point's wall time = a + k x (its timed work), with timed work =
(repetitions + 3 untimed calls: check, memory, first call) x the call's time + the warm-up, and
repetitions capped by the config's ``max_ms`` as the harness does (``timing.time_fn``). ``a`` and
``k`` are fitted by least squares on the committed runs (consecutive rows' timestamps: 1 s
resolution, so only sums are meaningful). A call's time at a new point = the point's FLOPs / the
backend's median TFLOP/s of that mode in the committed rows (300 where it has none); backends whose
every committed row was refused, or that the host lacks, cost ``a`` (they answer `unsupported` at
once), as do sdpa-math and the reference where the scores cannot fit. It ignores compile time growing with new shapes and the float32 reference check growing
with S (one KV-head group, computed once per problem): treat the result as +-40%.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from longca_triton.adapters.base import canonical_name
from longca_triton.bench.config import load_experiment
from longca_triton.bench.runner import plan_points
from longca_triton.masks import MASK_SPECS, make_mask

FIT_FILES = ["experiments/results/h100/dense_16k/results.jsonl", "experiments/results/h100/dense_quick/results.jsonl",
             "experiments/results/h100/sparse_64k/s64/results.jsonl", "experiments/results/h100/sparse_64k/v64/results.jsonl"]
#: dense backends the offline host cannot install (ANCHORS.md): they answer `unsupported` at once
NOT_ON_HOST = {"fa2", "fa3", "te", "flashmask"}
#: backends that materialise the Hq x S x S scores: past 80 GB (fp32) they fail at once (oom, or the
#: reference's refusal), costing only the fixed part
MATERIALISE = {"sdpa-math", "reference"}
GPU_BYTES = 80e9


def _rows(path):
    return [json.loads(line) for line in open(ROOT / path) if line.strip()]


def work_s(t_ms: float, rep: int, max_ms: float | None, warmup_ms: float) -> float:
    n = rep if max_ms is None else max(min(rep, 3), min(rep, int(max_ms / max(t_ms, 1e-3))))
    return ((n + 3) * t_ms + warmup_ms) / 1e3


def fit():
    xs, ys = [], []
    for f in FIT_FILES:
        prev = None
        for r in _rows(f):
            t = dt.datetime.fromisoformat(r["time"])
            if prev is not None and prev[0] == r["run_id"]:
                xs.append(((r["reps"] + 3) * r["time_ms"] + r["warmup_ms"]) / 1e3 if r.get("reps") else 0.0)
                ys.append((t - prev[1]).total_seconds())
            prev = (r["run_id"], t)
    n, sx, sy = len(xs), sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
    k = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return max((sy - k * sx) / n, 0.05), k, n


def measured_tflops():
    by: dict = {}
    refused: dict = {}
    for f in FIT_FILES:
        for r in _rows(f):
            b = canonical_name(r["backend"])
            if r["status"] == "ok" and r.get("tflops"):
                by.setdefault((b, r["mode"]), []).append(r["tflops"])
            refused.setdefault(b, True)
            refused[b] &= r["status"] != "ok"
    return {k: statistics.median(v) for k, v in by.items()}, {b for b, v in refused.items() if v}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--call-s", type=float, default=420, help="bench seconds per device call (9 min less setup)")
    ap.add_argument("--setup-s", type=float, default=90, help="setup per call: wheels, pip install, doctor")
    args = ap.parse_args()
    a, k, n = fit()
    tf, refused = measured_tflops()
    print(f"fit on {n} committed points: wall = {a:.2f} s + {k:.2f} x timed work")
    area_cache: dict = {}
    grand = 0.0
    for cfg in ("experiments/dense.toml", "experiments/sparse.toml", "experiments/varblock.toml"):
        exp = load_experiment(ROOT / cfg)
        exp.validate()
        total, npts, by_s = 0.0, 0, {}
        for (mask, S, hq, hkv, D, dtype, vi), pts in plan_points(exp):
            params = exp.params_for(mask, S, (hq, hkv), vi)
            if MASK_SPECS[mask].kind == "dynamic":
                area = params.get("density", 0.5) * S * S
            else:
                key = (mask, S)
                if key not in area_cache:
                    area_cache[key] = make_mask(mask, S, seed=exp.seed, **params).area
                area = area_cache[key]
            for p in pts:
                npts += 1
                if (p.backend in NOT_ON_HOST or p.backend in refused
                        or (p.backend in MATERIALISE and 4 * hq * S * S > GPU_BYTES)):
                    sec = a
                else:
                    flops = 4 * D * hq * area * (2.5 if p.mode == "bwd" else 1.0)
                    t_ms = flops / (tf.get((p.backend, p.mode), 300.0) * 1e12) * 1e3
                    sec = a + k * work_s(t_ms, exp.rep, exp.max_ms, exp.warmup_ms)
                total += sec
                by_s[S] = by_s.get(S, 0.0) + sec
        calls = math.ceil(total / args.call_s)
        grand += total
        print(f"{cfg}: {npts} points, about {total / 60:.0f} min of bench time = {calls} device calls of "
              f"{args.call_s / 60:.0f} min (+{args.setup_s:.0f} s setup each)")
        print("   per S: " + ", ".join(f"{S // 1024}K {v / 60:.1f} min" for S, v in sorted(by_s.items())))
    calls = math.ceil(grand / args.call_s)
    device_min = (grand + calls * args.setup_s) / 60
    print(f"all: about {grand / 60:.0f} min of bench time, {calls} calls, {device_min:.0f} min of device time; "
          f"at 30 device-minutes per session, about 5 of them spent starting the machine: "
          f"~{math.ceil(device_min / 25)} sessions. +-40%")


if __name__ == "__main__":
    main()

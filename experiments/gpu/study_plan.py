"""How long the full-breadth study (dense.toml, sparse.toml, varblock.toml) takes on one H100, from
the committed results: run on any machine (CPU), prints the estimate for study_sweep.sh.

    python3 experiments/gpu/study_plan.py [--call-s 360] [--setup-s 150]

Model (said in the output): a point that runs costs a + k x (its timed work), with timed work =
(repetitions + 3 untimed calls: check, memory, first call) x the call's time + the warm-up, and
repetitions capped by the config's ``max_ms`` as the harness does (``timing.time_fn``); a point the
backend refuses at once (``unsupported``: a package the host lacks, a mask or mode it cannot take)
costs ``r``, measured (a few ms, not ``a``). ``a``, ``k`` are fitted by least squares and ``r`` is the
mean gap, on the committed runs (consecutive rows' timestamps: 1 s resolution, so only sums are
meaningful), the dense study's own 1K-4K slice included. A call's time at a new point = the point's
FLOPs / the backend's median TFLOP/s of that mode at the nearest measured length (300 where it has
none). Refused: backends the offline host cannot install (``NOT_ON_HOST``), backends every committed
row of which was refused, a (backend, mask, mode) that committed rows refused for a reason of the
case (``bench.store.environment_unsupported`` tells those from "not installed"), and sdpa-math / the
reference where the scores cannot fit (they fail at once). It checks itself on the measured slice
(the model with that run's missing wheels against its rows' timestamps) and ignores compile time
growing with new shapes and the float32 reference check growing with S: treat the result as +-40%.
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
from longca_triton.bench.store import read_lines
from longca_triton.masks import MASK_SPECS, make_mask

FIT_FILES = ["experiments/results/h100/dense-16k/results.jsonl", "experiments/results/h100/dense-quick/results.jsonl",
             "experiments/results/h100/sparse-64k/s64/results.jsonl", "experiments/results/h100/sparse-64k/v64/results.jsonl",
             "experiments/results/h100/dense-study/results.jsonl.gz"]
#: the dense study's first slice (2026-11-23, 1K-2K complete, 4K partial, no vendor wheels carried)
SLICE = "experiments/results/h100/dense-study/results.jsonl.gz"
#: dense backends the offline host cannot install (docs/anchors.md): they answer `unsupported` at once
NOT_ON_HOST = {"fa2", "fa3", "te", "flashmask"}
#: backends that materialise the Hq x S x S scores: past 80 GB (fp32) they fail at once (oom, or the
#: reference's refusal), costing only the fixed part
MATERIALISE = {"sdpa-math", "reference"}
GPU_BYTES = 80e9


def _rows(path):
    return [json.loads(line) for line in read_lines(ROOT / path) if line.strip()]  # plain or .gz


def work_s(t_ms: float, rep: int, max_ms: float | None, warmup_ms: float) -> float:
    n = rep if max_ms is None else max(min(rep, 3), min(rep, int(max_ms / max(t_ms, 1e-3))))
    return ((n + 3) * t_ms + warmup_ms) / 1e3


def _gaps(files):
    """(row, seconds since the previous row of the same run) for consecutive rows."""
    for f in files:
        prev = None
        for r in _rows(f):
            t = dt.datetime.fromisoformat(r["time"])
            if prev is not None and prev[0] == r["run_id"]:
                yield r, (t - prev[1]).total_seconds()
            prev = (r["run_id"], t)


def fit():
    """``a``, ``k`` (points that ran: ok rows) and ``r`` (refused points: unsupported rows)."""
    xs, ys, refused = [], [], []
    for r, gap in _gaps(FIT_FILES):
        if r["status"] == "ok" and r.get("reps"):
            xs.append(((r["reps"] + 3) * r["time_ms"] + r["warmup_ms"]) / 1e3)
            ys.append(gap)
        elif r["status"].startswith("unsupported"):
            refused.append(gap)
    n, sx, sy = len(xs), sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
    k = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    r = sum(refused) / len(refused) if refused else 0.0
    return max((sy - k * sx) / n, 0.05), k, r, n, len(refused)


def measured():
    """``{(backend, mode): {S: median TFLOP/s}}``, backends every row of which was refused, and the
    (backend, mask, mode) refused for a reason of the case."""
    from longca_triton.bench.store import environment_unsupported

    by: dict = {}
    refused_all: dict = {}
    case_refused = set()
    for f in FIT_FILES:
        for r in _rows(f):
            b = canonical_name(r["backend"])
            if r["status"] == "ok" and r.get("tflops"):
                by.setdefault((b, r["mode"]), {}).setdefault(r["seqlen"], []).append(r["tflops"])
            refused_all.setdefault(b, True)
            refused_all[b] &= r["status"] != "ok"
            if r["status"].startswith("unsupported") and not environment_unsupported(r):
                case_refused.add((b, r["mask"], r["mode"]))
    tf = {k: {S: statistics.median(v) for S, v in d.items()} for k, d in by.items()}
    return tf, {b for b, v in refused_all.items() if v}, case_refused


def _tflops_at(tf: dict, backend: str, mode: str, S: int) -> float:
    d = tf.get((backend, mode))
    if not d:
        return 300.0
    return d[min(d, key=lambda s: (abs(math.log2(s / S)), -s))]


def estimate(exp, model, absent=frozenset(), area_cache=None):
    """``(points, seconds, {S: seconds})`` of the experiment's points, ``absent``: backends whose
    package the run lacks (refused at once)."""
    a, k, r, tf, refused, case_refused = model
    area_cache = {} if area_cache is None else area_cache
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
            if p.backend in absent or p.backend in refused or (p.backend, mask, p.mode) in case_refused:
                sec = r
            elif p.backend in MATERIALISE and 4 * hq * S * S > GPU_BYTES:
                sec = a
            else:
                flops = 4 * D * hq * area * (2.5 if p.mode == "bwd" else 1.0)
                t_ms = flops / (_tflops_at(tf, p.backend, p.mode, S) * 1e12) * 1e3
                sec = a + k * work_s(t_ms, exp.rep, exp.max_ms, exp.warmup_ms)
            total += sec
            by_s[S] = by_s.get(S, 0.0) + sec
    return npts, total, by_s


def check_on_slice(model) -> str:
    """The model on the measured slice's first run (the one that started from nothing; later runs
    resume it and retry points, so their rows neither cover whole lengths nor count once) and its
    complete lengths, with that run's absent backends, against the time its rows took."""
    from longca_triton.bench.store import environment_unsupported

    rows = _rows(SLICE)
    first_run = rows[0]["run_id"]
    rows = [r for r in rows if r["run_id"] == first_run]
    absent = {r["backend"] for r in rows if environment_unsupported(r)}
    counts: dict = {}
    for r in rows:
        counts[r["seqlen"]] = counts.get(r["seqlen"], 0) + 1
    full = [S for S, n in counts.items() if n == max(counts.values())]
    took = sum(gap for r, gap in _gaps([SLICE]) if r["run_id"] == first_run and r["seqlen"] in full)
    exp = load_experiment(ROOT / "experiments" / "dense.toml")
    exp.seqlens = sorted(full)
    exp.validate()
    npts, est, _ = estimate(exp, model, absent)
    first, last = rows[0]["time"], rows[-1]["time"]
    span = (dt.datetime.fromisoformat(last) - dt.datetime.fromisoformat(first)).total_seconds()
    return (f"check on the measured slice's first run ({SLICE}, run {first_run}: {len(rows)} rows in {span:.0f} s "
            f"from first to last row, {', '.join(f'{S // 1024}K {n}' for S, n in sorted(counts.items()))} points; "
            f"absent: {', '.join(sorted(absent))}): its complete lengths "
            f"({', '.join(f'{S // 1024}K' for S in sorted(full))}, {npts} points) took "
            f"{took:.0f} s, the model says {est:.0f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--call-s", type=float, default=360, help="bench seconds per device call (study_sweep.sh's MINUTES=6)")
    ap.add_argument("--setup-s", type=float, default=150,
                    help="the rest of a call: wheels, pip install, doctor, bench start-up, report and plots")
    args = ap.parse_args()
    a, k, r, n, nr = fit()
    model = (a, k, r, *measured())
    print(f"fit on {n} committed points that ran: wall = {a:.2f} s + {k:.2f} x timed work; "
          f"{nr} refused points: {r * 1e3:.0f} ms each")
    print(check_on_slice(model))
    area_cache: dict = {}
    grand = 0.0
    for cfg in ("experiments/dense.toml", "experiments/sparse.toml", "experiments/varblock.toml"):
        exp = load_experiment(ROOT / cfg)
        exp.validate()
        npts, total, by_s = estimate(exp, model, NOT_ON_HOST, area_cache)
        calls = math.ceil(total / args.call_s)
        grand += total
        print(f"{cfg}: {npts} points, about {total / 60:.0f} min of bench time = {calls} device calls of "
              f"{args.call_s / 60:.0f} min (+{args.setup_s:.0f} s setup each)")
        print("   per S: " + ", ".join(f"{S // 1024}K {v / 60:.1f} min" for S, v in sorted(by_s.items())))
    calls = math.ceil(grand / args.call_s)
    device_min = (grand + calls * args.setup_s) / 60
    print(f"all: about {grand / 60:.0f} min of bench time, {calls} calls, {device_min:.0f} min of device time; "
          f"at 30 device-minutes a lease, about 5 of them spent starting the machine: "
          f"~{math.ceil(device_min / 25)} leases. +-40%")


if __name__ == "__main__":
    main()

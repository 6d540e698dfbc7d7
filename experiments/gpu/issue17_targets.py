"""Issue 17's targets, read off harness results (``bench dense --head-dim 64,96,128,192/128,256``): the forward at
each head dim against ``sdpa-cudnn`` (>= 0.8x where cuDNN runs the dim) and D = 96 against our own D = 128 per
counted FLOP (>= 0.85x), full and causal at 16K, GQA 64:8, bf16; then, for reference, every backend's D = 96 / 128
ratio (is 0.85 reached by any kernel?) and the backward beside the forward.

    python experiments/gpu/issue17_targets.py experiments/results/h200/session25/call4_dims.tgz [--ours triton-gluon]

Inputs as ``issue13_targets.py`` reads them (tarballs or folders, the latest row per point).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from issue13_targets import Target, provenance, read_rows  # noqa: E402

from longca_triton.bench.report import latest_rows  # noqa: E402

MASKS, SEQLEN, HEADS, DTYPE = ("full", "causal"), 16384, (64, 8), "bfloat16"
DIMS = ("64", "96", "128", "192/128", "256")


def _dim(row: dict) -> str:
    d, dv = row.get("head_dim"), row.get("d_v") or row.get("head_dim")
    return f"{d}" if d == dv else f"{d}/{dv}"


def table(rows: list[dict]) -> dict:
    """``{(backend, mask, dim, mode): row}`` of the latest rows at 16K, GQA 64:8, bf16."""
    return {(r["backend"], r["mask"], _dim(r), r["mode"]): r for r in latest_rows(rows)
            if r.get("seqlen") == SEQLEN and (r.get("heads_q"), r.get("heads_kv")) == HEADS and r.get("dtype") == DTYPE}


def _ok(t: dict, *key) -> float | None:
    r = t.get(key)
    return r["tflops"] if r is not None and r.get("status") == "ok" else None


def targets(rows: list[dict], ours: str = "triton-gluon") -> list[Target]:
    t, out = table(rows), []
    for m in MASKS:
        for d in ("64", "96", "192/128", "256"):
            cudnn = t.get(("sdpa-cudnn", m, d, "fwd"))
            if cudnn is not None and cudnn.get("status", "").startswith("unsupported"):
                continue  # the target holds where cuDNN runs the dim
            out.append(Target(f"{ours} vs cuDNN", f"{m} D={d}", _ok(t, ours, m, d, "fwd"), _ok(t, "sdpa-cudnn", m, d, "fwd"),
                              0.8))
        out.append(Target("D=96 vs own D=128 per FLOP", f"{ours} {m}", _ok(t, ours, m, "96", "fwd"),
                          _ok(t, ours, m, "128", "fwd"), 0.85))
    return out


def reference_lines(rows: list[dict]) -> list[str]:
    """Every backend's D = 96 / D = 128 forward per FLOP, and each of ours' backward TFLOP/s by dim."""
    t, out = table(rows), []
    for b in sorted({k[0] for k in t}):
        for m in MASKS:
            a, c = _ok(t, b, m, "96", "fwd"), _ok(t, b, m, "128", "fwd")
            if a and c:
                out.append(f"{b} {m}: D=96 {a:.1f} / D=128 {c:.1f} TFLOP/s = {a / c:.3f} per FLOP")
    for b in sorted({k[0] for k in t if k[3] == "bwd"}):
        for m in MASKS:
            vals = [f"D={d} {x:.1f}" for d in DIMS if (x := _ok(t, b, m, d, "bwd"))]
            if vals:
                out.append(f"{b} {m} backward: " + ", ".join(vals))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--ours", default="triton-gluon", help="our backend the targets name (default: triton-gluon)")
    a = ap.parse_args(argv)
    rows = read_rows(a.paths)
    ts = targets(rows, a.ours)
    print("| target | case | ours | peer | ratio | need | |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for x in ts:
        f = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        print(f"| {x.name} | {x.case} | {f(x.ours)} | {f(x.peer)} | {f(x.ratio, 3)} | {x.need} | {x.verdict} |")
    print(f"\n{sum(x.verdict == 'met' for x in ts)} of {len(ts)} targets met; "
          f"{sum(x.verdict == 'missing' for x in ts)} missing")
    for line in reference_lines(rows):
        print(line)
    for line in provenance(list(table(rows).values())):
        print("rows from", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

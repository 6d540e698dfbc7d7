"""The SASS instructions a kernel's warps stall on most, from an ncu source-page CSV
(``experiments/gpu/ncu_profile.sh``): per kernel, the share of each stall reason over all samples and
the ``--top`` instructions by samples with their two largest reasons.

    python experiments/gpu/ncu_source_top.py $OUT/ncu/d128-src.csv.gz
"""

from __future__ import annotations

import argparse
import csv
import gzip


def parse(path: str) -> list[dict]:
    """``[{"name": kernel, "rows": [one dict per SASS instruction]}]`` (``.csv`` or ``.csv.gz``)."""
    opener = gzip.open if path.endswith(".gz") else open
    kernels, cur, hdr = [], None, None
    with opener(path, "rt") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                cur, hdr = {"name": row[1], "rows": []}, None
                kernels.append(cur)
            elif row[0] == "Address":
                hdr = row
            elif hdr and cur is not None:
                cur["rows"].append(dict(zip(hdr, row)))
    return kernels


def _num(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return 0.0


def report(kernels: list[dict], top: int) -> str:
    lines = []
    for k in kernels:
        rows = k["rows"]
        total = sum(_num(r["Warp Stall Sampling (All Samples)"]) for r in rows) or 1.0
        reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
        share = sorted(((sum(_num(r[c]) for r in rows) / total, c[6:]) for c in reasons), reverse=True)
        lines.append(f"== {k['name']}: {len(rows)} instructions, {int(total)} samples")
        lines.append("   " + ", ".join(f"{name} {v:.3f}" for v, name in share[:8]))
        ranked = sorted(enumerate(rows), key=lambda x: -_num(x[1]["Warp Stall Sampling (All Samples)"]))[:top]
        for i, r in ranked:
            s = _num(r["Warp Stall Sampling (All Samples)"]) / total
            why = sorted(((_num(r[c]) / total, c[6:]) for c in reasons), reverse=True)[:2]
            lines.append(f"   #{i:<5d} {s:6.3f}  {r['Source'].strip()[:64]:64s}  "
                         + "  ".join(f"{n} {v:.3f}" for v, n in why))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args(argv)
    for path in a.csv:
        print(report(parse(path), a.top))


if __name__ == "__main__":
    main()

"""Issue 13's targets, read off harness results: every target with its case, our TFLOP/s, the peer's, the ratio,
what it needs and whether it is met (or which row is missing).

The targets (issue 13, backward, GQA 64:8, D = 128, bf16):

* dense, S = 16K: ``triton`` >= 1.1x ``flex`` on each of the 12 static masks, >= 0.8x ``sdpa-cudnn`` on full and causal;
* block 128 (32K and 64K, densities 0.3 and 0.5, a pattern per KV head and one for all): ``triton-sparse`` >= 1.05x
  ``flex``;
* block 64: ``triton-sparse`` >= 1.0x ``vsa-triton``;
* variable blocks (mean 256): ``triton-varblock`` >= 0.8x ``triton-sparse`` at block 128, a pattern per KV head, the
  same S and density.

    python experiments/gpu/issue13_targets.py experiments/results/h200/session27/final.tgz .../accept.tgz [--format md]

Inputs are ``.tgz`` files (as the session scripts pack them) or folders, searched for ``results.jsonl``; rows go
through ``bench.report.latest_rows`` (the latest row per point). The commits and GPUs the used rows name are printed:
a closing run's rows should name one commit.
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from longca_triton.adapters.base import canonical_name  # noqa: E402
from longca_triton.bench.report import latest_rows  # noqa: E402
from longca_triton.masks import STATIC_MASK_NAMES  # noqa: E402

HEADS, HEAD_DIM, DTYPE = (64, 8), 128, "bfloat16"
SPARSE_S, DENSITIES = (32768, 65536), (0.3, 0.5)


@dataclass
class Target:
    name: str
    case: str
    ours: float | None
    peer: float | None
    need: float

    @property
    def ratio(self) -> float | None:
        return self.ours / self.peer if self.ours and self.peer else None

    @property
    def verdict(self) -> str:
        if self.ratio is None:
            return "missing"
        return "met" if self.ratio >= self.need else "NOT met"


def read_rows(paths: list[Path]) -> list[dict]:
    """Every ``results.jsonl`` row under ``paths`` (tarballs unpacked to a temporary folder)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, p in enumerate(paths):
            root = p
            if p.is_file():
                root = Path(tmp) / str(i)
                with tarfile.open(p) as tf:
                    try:
                        tf.extractall(root, filter="data")
                    except TypeError:  # a Python without extraction filters (< 3.10.12)
                        tf.extractall(root)
            for f in sorted(root.rglob("results.jsonl")):
                for line in f.read_text().splitlines():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue  # a cut last line
    return rows


def _ours(rows: list[dict]) -> list[dict]:
    return [r for r in latest_rows(rows) if r.get("mode") == "bwd" and r.get("status") == "ok"
            and (r.get("heads_q"), r.get("heads_kv")) == HEADS and r.get("head_dim") == HEAD_DIM
            and r.get("dtype") == DTYPE]


def _tflops(rows, backend, **want) -> float | None:
    """The TFLOP/s of the one row of ``backend`` whose fields (``mask``, ``seqlen``) and mask parameters
    (``block``, ``density``, ``patterns``) equal ``want``."""
    params = {k: want.pop(k) for k in ("block", "density", "patterns") if k in want}
    hits = [r["tflops"] for r in rows if r["backend"] == backend and all(r.get(k) == v for k, v in want.items())
            and all(r.get("mask_params", {}).get(k) == v for k, v in params.items())]
    return hits[-1] if hits else None


def targets(rows: list[dict], varblock: str = "triton-varblock") -> list[Target]:
    """The targets, variable blocks read from backend ``varblock`` (a config of it: ``triton-varblock{...}``)."""
    rows = _ours(rows)
    out = []
    for m in STATIC_MASK_NAMES:
        ours = _tflops(rows, "triton", mask=m, seqlen=16384)
        out.append(Target("dense vs Flex", f"{m} 16K", ours, _tflops(rows, "flex", mask=m, seqlen=16384), 1.1))
        if m in ("full", "causal"):
            out.append(Target("dense vs cuDNN", f"{m} 16K", ours, _tflops(rows, "sdpa-cudnn", mask=m, seqlen=16384),
                              0.8))
    for S in SPARSE_S:
        for d in DENSITIES:
            for p, label in ((HEADS[1], "a pattern per KV head"), (1, "one pattern")):
                kw = dict(mask="block_sparse", seqlen=S, block=128, density=d, patterns=p)
                out.append(Target("block 128 vs Flex", f"{S // 1024}K {d} {label}", _tflops(rows, "triton-sparse", **kw),
                                  _tflops(rows, "flex", **kw), 1.05))
    for S in SPARSE_S:
        for d in DENSITIES:
            kw = dict(mask="block_sparse", seqlen=S, block=64, density=d)
            ours = _tflops(rows, "triton-sparse", **kw)
            if ours is not None or S == 65536 and d == 0.5:  # the harness's case (sparse_64k.toml); others if run
                out.append(Target("block 64 vs VSA", f"{S // 1024}K {d}", ours, _tflops(rows, "vsa-triton", **kw), 1.0))
    for S in SPARSE_S:
        for d in DENSITIES:
            var = _tflops(rows, varblock, mask="varblock_sparse", seqlen=S, block=256, density=d,
                          patterns=HEADS[1])
            uni = _tflops(rows, "triton-sparse", mask="block_sparse", seqlen=S, block=128, density=d, patterns=HEADS[1])
            out.append(Target("variable vs uniform 128", f"{S // 1024}K {d}", var, uni, 0.8))
    return out


def provenance(rows: list[dict]) -> list[str]:
    """``commit (dirty) on GPU: n rows`` for ``rows`` (the ones the targets read)."""
    seen: dict = {}
    for r in rows:
        env = r.get("env") or {}
        key = (str(env.get("git_commit"))[:12] + (" (dirty)" if env.get("git_dirty") else ""), r.get("gpu"))
        seen[key] = seen.get(key, 0) + 1
    return [f"{c} on {g}: {n} rows" for (c, g), n in sorted(seen.items(), key=str)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--varblock", default="triton-varblock",
                    help='the variable-block backend: triton-varblock, or one named with a launch config')
    a = ap.parse_args(argv)
    rows = read_rows(a.paths)
    ts = targets(rows, canonical_name(a.varblock))
    print("| target | case | ours | peer | ratio | need | |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for t in ts:
        f = lambda x, p=1: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
        print(f"| {t.name} | {t.case} | {f(t.ours)} | {f(t.peer)} | {f(t.ratio, 3)} | {t.need} | {t.verdict} |")
    met = sum(t.verdict == "met" for t in ts)
    print(f"\n{met} of {len(ts)} targets met; {sum(t.verdict == 'missing' for t in ts)} missing")
    for line in provenance(_ours(rows)):
        print("rows from", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time the default backend against ``triton`` and ``triton-gluon`` (and SDPA-cuDNN where it runs).

    PYTHONUNBUFFERED=1 python experiments/gpu/default_backend.py --out $OUT/default.jsonl \\
        [--seqlens 4096,16384,65536] [--random 5] [--modes fwd,bwd] [--heads 64:8] [--head-dim 128] [--rounds 3]

For each of the 12 static masks of docs/masks.md and ``--random`` random RangeMasks (overlapping
slices of every kind; the 2nd and 4th with Sq != Sk), at each length and mode, the backends run
interleaved (``bench.timing.time_interleaved``, L2 flushed) on one set of bf16 inputs, ``--rounds`` times.
One JSON row per (mask, length, mode, backend, round): median and 20th / 80th percentile ms, TFLOP/s
(docs/masks.md §5), the backend the default ran (``ran``, for the mode's autograd state), and the plan features the
default rule reads (``longca_triton.api.plan_features``), so that the shipped rule
(``kernels/tuning/default.toml``) can be fitted from and checked against these rows. A rerun appends
only the points the file lacks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import longca_triton as lt  # noqa: E402 - after the path above
from longca_triton.masks import STATIC_MASK_NAMES, RangeMask  # noqa: E402

KINDS = ("FULL", "CAUSAL", "INVCAUSAL", "BICAUSAL")


def random_range_mask(sq: int, sk: int, seed: int, n_slices: int = 8) -> RangeMask:
    """Overlapping slices of every kind (cycling), random extents from a tenth to all of each axis."""
    rng = np.random.default_rng(seed)
    slices = []
    for i in range(n_slices):
        lq, lk = (int(rng.integers(max(1, n // 10), n + 1)) for n in (sq, sk))
        q0, k0 = int(rng.integers(0, sq - lq + 1)), int(rng.integers(0, sk - lk + 1))
        slices.append((q0, q0 + lq, k0, k0 + lk, KINDS[i % 4]))
    return RangeMask(sq, sk, slices, name=f"random{seed}", params={"seed": seed})


def masks_at(S: int, n_random: int):
    for name in STATIC_MASK_NAMES:
        yield lt.make_mask(name, S, seed=0)
    # random1 has fewer keys than queries, random3 fewer queries than keys; the others are square
    lengths = {1: (S, S // 2 + 2000), 3: (S // 2, S)}
    for i in range(n_random):
        yield random_range_mask(*lengths.get(i, (S, S)), seed=i)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSONL file (appended; points already there are skipped)")
    p.add_argument("--seqlens", default="4096,16384,65536")
    p.add_argument("--random", type=int, default=5, help="random RangeMasks per length")
    p.add_argument("--modes", default="fwd,bwd")
    p.add_argument("--heads", default="64:8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--backends", default="triton,triton-gluon,default")
    p.add_argument("--cudnn", default="full,causal", help="masks also timed on sdpa-cudnn (its causal is bottom-right)")
    p.add_argument("--rep", type=int, default=15)
    p.add_argument("--rounds", type=int, default=1, help="interleaved timings of each point (a claim within a few %% needs 3)")
    p.add_argument("--masks", default=None, help="only these mask names (random masks: random0 ...)")
    a = p.parse_args()

    from longca_triton.api import plan_features
    from longca_triton.bench.runner import allow_retained_backward
    from longca_triton.bench.timing import time_interleaved

    allow_retained_backward()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            r = json.loads(line)
            done.add((r["mask"], r["seqlen_q"], r["seqlen_k"], r["mode"]))
    hq, hkv = (int(x) for x in a.heads.split(":"))
    D = a.head_dim
    gpu = torch.cuda.get_device_name(0)
    only = set(a.masks.split(",")) if a.masks else None
    for S in (int(x) for x in a.seqlens.split(",")):
        for mask in masks_at(S, a.random):
            if only and mask.name not in only:
                continue
            sq, sk = mask.seqlen_q, mask.seqlen_k
            modes = [m for m in a.modes.split(",") if (mask.name, sq, sk, m) not in done]
            if not modes:
                continue
            torch.manual_seed(0)
            q = torch.randn(1, sq, hq, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(1, sk, hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            backends = a.backends.split(",") + (["sdpa-cudnn"] if mask.name in a.cudnn.split(",") and sq == sk else [])
            feats = plan_features(mask, D, D)
            for mode in modes:
                # what the default runs depends on whether autograd records the call
                ins = (q, k, v) if mode == "fwd" else tuple(t.detach().requires_grad_() for t in (q, k, v))
                default_name = lt.api.default_backend(mask, *ins)
                fns, names = [], []
                for b in backends:
                    name = None if b == "default" else b
                    if mode == "fwd":
                        def fn(name=name):
                            with torch.no_grad():
                                return lt.attention(q, k, v, mask, backend=name)
                    else:
                        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                        o = lt.attention(qg, kg, vg, mask, backend=name)
                        do = torch.randn_like(o)

                        def fn(o=o, do=do, ins=(qg, kg, vg)):
                            return torch.autograd.grad(o, ins, do, retain_graph=True)
                    fns.append(fn)
                    names.append(b)
                flops = mask.flops(hq, D, mode)
                for rnd in range(a.rounds):
                    times = time_interleaved(fns, warmup_ms=25, rep=a.rep, max_ms=2000)
                    with out.open("a") as f:
                        for b, t in zip(names, times):
                            row = dict(mask=mask.name, seqlen_q=sq, seqlen_k=sk, mode=mode, backend=b, round=rnd,
                                       ran=default_name if b == "default" else b, median_ms=t["median_ms"],
                                       p20_ms=t.get("p20_ms"), p80_ms=t.get("p80_ms"),
                                       tflops=flops / t["median_ms"] / 1e9, heads=a.heads, head_dim=D, gpu=gpu,
                                       features=feats)
                            f.write(json.dumps(row) + "\n")
                best = max(zip(names, times), key=lambda x: -x[1]["median_ms"])
                print(f"{mask.name:24s} {sq:>6d}x{sk:<6d} {mode}: " + "  ".join(
                    f"{b} {flops / t['median_ms'] / 1e9:6.1f}" for b, t in zip(names, times)) + f"  (fastest {best[0]})",
                    flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The Gluon forward's launch knobs on a GPU: ping-pong on/off, ring depth, key-tile rows.

    python3 experiments/gpu/gluon_configs.py --out $OUT [-S 16384] [--masks full,causal]

bf16, GQA 64:8, D = 128 (``--head-dim 64`` too), forward only, timed with the harness's one timer
(``bench.timing.time_fn``: CUDA events, L2 flush, median). Each config is first checked against
the plain-Triton forward on the same inputs (relative L2 of out <= 1e-2, lse within 2e-2), so a
fast wrong config shows up as ``wrong``. Rows go to OUT/gluon_configs.jsonl as they finish and a
table to OUT/gluon_configs.md; ``sdpa-cudnn`` and ``triton`` rows give the scale.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from longca_triton.adapters import Problem, get_backend
from longca_triton.bench.timing import time_fn
from longca_triton.kernels.dense.op import dense_attention
from longca_triton.kernels.gluon.op import SMEM_LIMIT, gluon_attention, smem_bytes
from longca_triton.masks import make_mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("-S", "--seqlen", type=int, default=16384)
    ap.add_argument("--masks", default="full,causal,causal_document")
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    d, S = a.head_dim, a.seqlen
    torch.manual_seed(0)
    q = torch.randn(1, S, 64, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, S, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    configs = [dict(pingpong=pp, num_stages=st, BLOCK_N=bn)
               for pp, bn, st in itertools.product((True, False), (128, 64), (1, 2, 3, 4))
               if smem_bytes(d, bn, st) <= SMEM_LIMIT]

    def emit(row):
        rows.append(row)
        with open(out / "gluon_configs.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    for name in a.masks.split(","):
        mask = make_mask(name, S, seed=0)
        flops = mask.flops(64, d, "fwd")
        base, base_lse = dense_attention(q, k, v, mask, return_lse=True)
        for label, fn in (("triton", lambda: dense_attention(q, k, v, mask)),):
            t = time_fn(fn, rep=20, max_ms=400)["median_ms"]
            emit(dict(mask=name, S=S, D=d, kernel=label, config="default", ms=t, tflops=flops / t / 1e9))
        cudnn = get_backend("sdpa-cudnn")
        p = Problem(mask=mask, heads_q=64, heads_kv=8, head_dim=d, dtype=torch.bfloat16, mode="fwd")
        ok, why = cudnn.check(p)
        if ok:
            fn = cudnn.prepare(p, q, k, v)
            t = time_fn(fn, rep=20, max_ms=400)["median_ms"]
            emit(dict(mask=name, S=S, D=d, kernel="sdpa-cudnn", config="-", ms=t, tflops=flops / t / 1e9))
        else:
            emit(dict(mask=name, S=S, D=d, kernel="sdpa-cudnn", config="-", status=f"unsupported: {why}"))
        for cfg in configs:
            label = "-".join(f"{k}={v}" for k, v in cfg.items())
            t0 = time.time()
            try:
                o, lse = gluon_attention(q, k, v, mask, return_lse=True, config=cfg)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a config that fails is a result
                emit(dict(mask=name, S=S, D=d, kernel="triton-gluon", config=label, status=f"failed: {e!r}"[:300]))
                continue
            err = ((o.float() - base.float()).norm() / base.float().norm()).item()
            fin = torch.isfinite(base_lse)
            lerr = (lse[fin] - base_lse[fin]).abs().max().item()
            if not (err <= 1e-2 and lerr <= 2e-2) or not torch.equal(torch.isinf(lse), torch.isinf(base_lse)):
                emit(dict(mask=name, S=S, D=d, kernel="triton-gluon", config=label, status="wrong",
                          out_rel=err, lse_abs=lerr))
                continue
            t = time_fn(lambda: gluon_attention(q, k, v, mask, config=cfg), rep=20, max_ms=400)["median_ms"]
            emit(dict(mask=name, S=S, D=d, kernel="triton-gluon", config=label, ms=t, tflops=flops / t / 1e9,
                      out_rel=err, compile_s=round(time.time() - t0, 1)))

    lines = ["| mask | kernel | config | TFLOP/s | status |", "|---|---|---|---:|---|"]
    for r in rows:
        tf = f"{r['tflops']:.0f}" if "tflops" in r else ""
        lines.append(f"| {r['mask']} | {r['kernel']} | {r['config']} | {tf} | {r.get('status', 'ok')} |")
    (out / "gluon_configs.md").write_text(
        f"# Gluon forward configs, S={S}, GQA 64:8, D={d}, bf16 ({torch.cuda.get_device_name()}, "
        f"torch {torch.__version__})\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""Issue 17: what each GEMM shape costs the Gluon forward. Times the forward (full mask, GQA 64:8, bf16) at head-dim
pairs whose ``Q K^T`` or ``P V`` GEMM differs in one dimension only, e.g. D_qk = 96 with D_v = 64 / 96 / 128: the
time differences between them price the ``P V`` GEMM's N = 64 / 64 + 32 / 128 wgmma shapes (and D_qk at fixed D_v
the ``Q K^T`` K dimension), per key tile. Each (pair, config) is checked against the float32 chunked reference in
the first round (relative error of ``out`` < 0.02) before it is timed; later rounds time the same kernels again.
Calls ``gluon_attention`` directly: head-dim pairs the backend's registry gates (not yet GPU-tested there) run.

    python experiments/gpu/shape_cost.py --out $OUT [--S 16384] [--pairs 96/64,96/96,...] [--configs JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gluon_diag import _rel, _tail  # noqa: E402

PAIRS = "96/64,96/96,96/128,128/64,128/96,128/128,64/64,64/128"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--S", type=int, default=16384)
    ap.add_argument("--pairs", default=PAIRS, help="D_qk/D_v pairs")
    ap.add_argument("--configs", default='[{}]', help="JSON list of Gluon configs to time at each pair")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    import torch

    from longca_triton.bench.timing import time_fn
    from longca_triton.kernels.gluon.op import gluon_attention
    from longca_triton.masks import make_mask
    from longca_triton.reference import chunked_attention

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    mask = make_mask("full", a.S, seed=0)
    configs = json.loads(a.configs)
    for rnd in range(a.rounds):
        for pair in a.pairs.split(","):
            dqk, dv = (int(x) for x in pair.split("/"))
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(1, a.S, 64, dqk, device="cuda", dtype=torch.bfloat16, generator=g)
            k = torch.randn(1, a.S, 8, dqk, device="cuda", dtype=torch.bfloat16, generator=g)
            v = torch.randn(1, a.S, 8, dv, device="cuda", dtype=torch.bfloat16, generator=g)
            ref = None
            for cfg in configs:
                if all(x & (x - 1) == 0 for x in (dqk, dv)):
                    cfg = {k: val for k, val in cfg.items() if k != "split_d"}  # nothing to split
                row = dict(round=rnd, D_qk=dqk, D_v=dv, config=cfg)
                try:
                    with torch.no_grad():
                        o = gluon_attention(q, k, v, mask, config=cfg or None)
                        if ref is None and rnd == 0:
                            ref = chunked_attention(q.float(), k.float(), v.float(), mask, chunk=1024)
                        if ref is not None:
                            row["err_out"] = _rel(o, ref)
                            assert row["err_out"] < 0.02, row["err_out"]
                        t = time_fn(lambda: gluon_attention(q, k, v, mask, config=cfg or None), max_ms=1500)
                    flops = 2.0 * a.S * a.S * 64 * (dqk + dv)  # full mask: 2 S^2 H (D_qk + D_v)
                    row.update(ms=t["median_ms"], tflops=flops / t["median_ms"] / 1e9,
                               us_per_tile=t["median_ms"] * 1e3 / (64 * (a.S // 128) * (a.S // 128)))
                except Exception as e:  # noqa: BLE001
                    row["error"] = _tail(e)
                print("ROW " + json.dumps(row), flush=True)
                with (out / "shape_cost.jsonl").open("a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

"""Does a backward's time depend on the timer? One problem, two configs, timed by the harness's
``time_fn`` (one config's repetitions back to back) and by ``time_interleaved`` (both configs' repetitions
alternating), in both orders, in one process (session 21: ``bwd_configs_ab.py`` read variable blocks'
stacked dQ tiles 8 % faster than the default, ``bwd_variants.py`` equal).

    PYTHONPATH=. python experiments/gpu/timer_bias.py --out $OUT [--configs JSON] [--sparse varblock256:32768:0.3]

Rows (``timer``, ``round``, ``variant``, ``ms``, ``tflops``) go to ``<out>/timer_bias.jsonl`` as measured.
``--smoke`` runs it on the CPU interpreter at a toy size (host clock, float32), for the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from longca_triton.bench.timing import time_fn, time_interleaved  # noqa: E402
from longca_triton.kernels.block_sparse.op import block_sparse_attention  # noqa: E402
from longca_triton.masks import make_mask  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sparse", default="varblock256:32768:0.3")
    # one head's 128-row dQ tiles with 64-row tails (the default before session 21) against four stacked heads
    ap.add_argument("--configs", default='{"one_head": {"DQ_BLOCK_M": 128, "DQ_HEADS": 1, "dq_tail_rows": 64}, '
                                          '"stack32x4": {"DQ_BLOCK_M": 32, "DQ_HEADS": 4, "dq_tail_rows": 0}}')
    ap.add_argument("--rep", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, toy size (S from --sparse), float32")
    args = ap.parse_args(argv)
    from bwd_variants import SPARSE_MASKS

    name, S, dens = args.sparse.split(":")
    kind, block, extra = SPARSE_MASKS[name]
    extra = extra(int(S)) if callable(extra) else extra
    hq, hkv, d, dev, dtype = (64, 8, 128, "cuda", torch.bfloat16) if not args.smoke else (4, 2, 32, "cpu", torch.float32)
    if args.smoke:  # toy blocks for the interpreter
        block, extra, args.rep = 32, {"min_block": 16} if "min_block" in extra else {}, 2
    mask = make_mask(kind, int(S), block=block, density=float(dens), patterns=hkv, seed=0, **extra)
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, int(S), h, d, device=dev, dtype=dtype) for h in (hq, hkv, hkv, hq))
    configs = json.loads(args.configs)
    fns = {}
    for n, cfg in configs.items():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = block_sparse_attention(*leaves, mask, config=cfg)
        fns[n] = lambda out=out, leaves=leaves: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    flops = mask.flops(hq, d, "bwd")
    path = Path(args.out) / "timer_bias.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)

    def emit(**row):
        row["tflops"] = flops / row["ms"] * 1e-9
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")

    names = list(fns)
    rows = []
    for rnd in range(2):
        for n in (names if rnd == 0 else names[::-1]):
            emit(timer="time_fn", round=rnd, variant=n, ms=time_fn(fns[n], rep=args.rep)["median_ms"])
        for n in (names if rnd == 0 else names[::-1]):
            emit(timer="time_interleaved[one]", round=rnd, variant=n,
                 ms=time_interleaved([fns[n]], rep=args.rep)[0]["median_ms"])
        order = names if rnd == 0 else names[::-1]
        res = time_interleaved([fns[n] for n in order], rep=args.rep)
        for n, r in zip(order, res):
            emit(timer="time_interleaved[all]", round=rnd, variant=n, ms=r["median_ms"])
        # the same, no L2 flush between calls
        res = time_interleaved([fns[n] for n in order], rep=args.rep, flush_l2=False)
        for n, r in zip(order, res):
            emit(timer="time_interleaved[all,no flush]", round=rnd, variant=n, ms=r["median_ms"])
    return rows


if __name__ == "__main__":
    main()

"""Where variable blocks' backward spends its time against uniform block 128's, launch by launch (issue 13).

For each case ``name:S:density`` (``bwd_variants.SPARSE_MASKS``, a pattern per KV head, GQA 64:8, D = 128,
bf16) the resolved default config's launches are timed interleaved (``bench.timing.time_interleaved``, L2
flushed between calls), each a call of ``block_sparse.block_sparse_bwd`` on tables built before timing:

* ``bwd``: the whole backward as autograd runs it (delta, dK/dV main + tails, dQ; ``bwd_streams`` as
  configured);
* ``dkdv``: delta + the dK/dV launches (main and tail tiles); ``dkdv_main``: without the tail launch;
  ``dkdv_tail``: only the tail launch (delta + an empty main table);
* ``dq``: delta + the dQ launches;
* ``bwd_no_dkdv_tail``: the whole backward without the dK/dV tail launch (its remainders' dK / dV left
  unwritten): what the backward would take if the key blocks' remainders cost nothing, the ceiling of
  any change to them.

Plus ``--configs`` (JSON ``{name: overlay}``): each overlay's whole backward beside the default's (``--no-parts``:
beside the default's whole backward only).

    PYTHONPATH=. python experiments/gpu/varblock_parts.py --out $OUT \\
        --cases varblock256:32768:0.3,uniform128:32768:0.3 --configs '{"tailw8": {"dkdv_tail_warps": 8}}'

Rows (``kind``: env / time) go to ``<out>/varblock_parts.jsonl`` as measured; the summary prints per case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402


def launches(mask, q, k, v, overlays: dict, parts: bool = True):
    """``{name: fn}``: the parts (module doc) of the default config (``parts``; else its whole backward only) and
    each overlay's whole backward."""
    from longca_triton.kernels.block_sparse import op as BS

    scale = q.shape[-1] ** -0.5
    cfg = BS.resolve_config(mask, q.shape[-1], None, q=q, k=k)
    tables = BS.tables_for(mask, cfg, q.device)
    out, lse = BS.block_sparse_fwd(q, k, v, mask, tables["fwd"], scale, cfg, tables.get("fwd_tail"))
    dout = torch.randn_like(out)

    def bwd(tabs, c=cfg, passes=("dkdv", "dq")):
        return lambda: BS.block_sparse_bwd(dout, q, k, v, out, lse, mask, tabs, scale, c, passes=passes)

    fns = {"bwd": bwd(tables)}
    if parts:
        fns.update(dq=bwd(tables, passes=("dq",)), dkdv=bwd(tables, passes=("dkdv",)))
    if parts and tables.get("dkdv_tail") is not None and tables["dkdv_tail"].num_tiles:
        no_tail = {n: t for n, t in tables.items() if n != "dkdv_tail"}
        fns["dkdv_main"] = bwd(no_tail, passes=("dkdv",))
        fns["dkdv_tail"] = bwd({**tables, "dkdv": tables["dkdv"].without_rows()}, passes=("dkdv",))
        fns["bwd_no_dkdv_tail"] = bwd(no_tail)
    for name, over in overlays.items():
        c = BS.resolve_config(mask, q.shape[-1], over, q=q, k=k)
        fns[name] = bwd(BS.tables_for(mask, c, q.device), c)
    return fns, cfg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default="varblock256:32768:0.3,uniform128:32768:0.3")
    ap.add_argument("--configs", default="{}", metavar="JSON")
    ap.add_argument("--heads", default="64:8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=20)
    ap.add_argument("--ms", type=float, default=1000.0)
    ap.add_argument("--no-parts", action="store_true", help="the default's whole backward only, beside --configs")
    args = ap.parse_args(argv)
    from bwd_variants import SPARSE_MASKS

    from longca_triton.bench.timing import time_interleaved
    from longca_triton.masks import make_mask

    dev = torch.device("cuda")
    hq, hkv = (int(x) for x in args.heads.split(":"))
    overlays = json.loads(args.configs)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    sink = open(Path(args.out) / "varblock_parts.jsonl", "a")

    def emit(row):
        sink.write(json.dumps(row) + "\n")
        sink.flush()

    emit(dict(kind="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__,
              triton=__import__("triton").__version__, argv=sys.argv[1:], t=time.time()))
    for case in args.cases.split(","):
        name, S, dens = case.split(":")
        kind, block, extra = SPARSE_MASKS[name]
        S = int(S)
        extra = extra(S) if callable(extra) else extra
        mask = make_mask(kind, S, block=block, density=float(dens), patterns=hkv, seed=0, **extra)
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, S, h, args.head_dim, device=dev, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
        fns, cfg = launches(mask, q, k, v, overlays, not args.no_parts)
        names = list(fns)
        times = {n: [] for n in names}
        for r in range(args.rounds):
            stats = time_interleaved([fns[n] for n in names], rep=args.rep, max_ms=args.ms, device=dev)
            for n, st in zip(names, stats):
                times[n].append(st["median_ms"])
                emit(dict(kind="time", case=case, part=n, round=r, ms=st["median_ms"]))
        flops = mask.flops(hq, args.head_dim, "bwd")
        print(f"{case}:")
        for n in names:
            ms = statistics.median(times[n])
            print(f"  {n:18s} {ms:8.2f} ms  rounds {' '.join(f'{t:.2f}' for t in times[n])}"
                  + (f"  ({flops / ms * 1e-9:.1f} TFLOP/s)" if n == "bwd" or n in overlays else ""), flush=True)
        del fns, q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

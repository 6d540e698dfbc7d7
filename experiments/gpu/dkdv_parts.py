"""The block-sparse dK/dV pass in parts: the whole pass, its main tiles' launch alone and its tail tiles'
launch alone (``block_sparse_bwd(passes=("dkdv",))`` on tables with one or the other), per mask and config,
plus the main tiles' count and the tiles' area over the kept area. A diagnostic for where variable blocks'
dK/dV time goes (session 22); the delta preprocess is in every number.

    PYTHONPATH=. python experiments/gpu/dkdv_parts.py --out $OUT --sparse varblock256:32768:0.3 \\
        --configs '{"k128": {"DKDV_BLOCK_N": 128, "dkdv_num_warps": 8, "dkdv_tail_rows": 64}}'

Rows go to ``<out>/dkdv_parts.jsonl`` as measured; ``--smoke`` runs a toy size on the CPU interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from longca_triton.kernels.block_sparse import op as BS  # noqa: E402
from longca_triton.masks import make_mask  # noqa: E402


def tile_area(t) -> int:
    """Keys x query rows the dK/dV programs of table ``t`` cover, summed over patterns (one head each)."""
    ptr = t.ptr.long()
    per_block = (ptr[1:] - ptr[:-1]).view(t.num_patterns, t.num_row_blocks)  # entries per (pattern, block)
    return int(per_block[:, t.row_block.long()].sum()) * t.tile_rows * t.tile_cols


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sparse", default="varblock256:32768:0.3", help="comma-separated name:S:density")
    ap.add_argument("--configs", default='{"default": {}}')
    ap.add_argument("--heads", default="64:8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rep", type=int, default=50)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    from bwd_variants import SPARSE_MASKS

    import dense_check as DC

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "dkdv_parts.jsonl"
    dev, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    if args.smoke:
        DC.DEV = "cpu"
    hq, hkv = (int(x) for x in args.heads.split(":"))
    d = 32 if args.smoke else args.head_dim
    t0 = time.time()

    def emit(row):
        row = {"elapsed_s": round(time.time() - t0, 1), **row}
        with open(path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        print(json.dumps(row, default=str), flush=True)

    for spec in filter(None, args.sparse.split(",")):
        name, S, dens = spec.split(":")
        kind, block, extra = SPARSE_MASKS[name]
        S = 256 if args.smoke else int(S)
        extra = extra(S) if callable(extra) else extra
        if args.smoke:
            block, extra = 32, {"min_block": 16} if "min_block" in extra else {}
        mask = make_mask(kind, S, block=block, density=float(dens), patterns=hkv, seed=0, **extra)
        torch.manual_seed(0)
        q, dout = (torch.randn(1, S, hq, d, device=dev, dtype=dtype) for _ in range(2))
        k, v = (torch.randn(1, S, hkv, d, device=dev, dtype=dtype) for _ in range(2))
        scale = d ** -0.5
        for cname, over in json.loads(args.configs).items():
            cfg = BS.resolve_config(mask, d, over, q=q, k=k)
            tables = BS.tables_for(mask, cfg, dev)
            o, lse = BS.block_sparse_fwd(q, k, v, mask, tables["fwd"], scale, cfg, tables.get("fwd_tail"))
            main_only = {n: t for n, t in tables.items() if n != "dkdv_tail"}
            parts = {"pass": tables, "main": main_only}
            tail = tables.get("dkdv_tail")
            if tail is not None and tail.num_tiles:
                # the tail table run by the launcher's main launch: one head, 4 warps, as its tail launch does
                parts["tail"] = {**main_only, "dkdv": tail}
            kept = sum(mask.head_areas(hq))
            row = dict(kind="parts", problem=spec, config=cname, over=over, main_tiles=tables["dkdv"].num_tiles,
                       tail_tiles=tail.num_tiles if tail is not None else 0,
                       area_main=tile_area(tables["dkdv"]) * (hq // hkv),
                       area_tail=tile_area(tail) * (hq // hkv) if tail is not None else 0, kept=kept)
            for part, tb in parts.items():
                pcfg = dict(cfg, dkdv_num_warps=4, DKDV_HEADS=1) if part == "tail" else cfg
                fn = lambda tb=tb, pcfg=pcfg: BS.block_sparse_bwd(dout, q, k, v, o, lse, mask, tb, scale,  # noqa: E731
                                                                  pcfg, passes=("dkdv",))
                fn()
                row[part + "_ms"] = DC.median_ms(fn, rep=args.rep)
            emit(row)


if __name__ == "__main__":
    main()

"""What each half of the Gluon forward's split launch costs (issue 12: causal_blockwise and
full_document, whose partial tiles are 4.9 / 8.7 % of the work, lose with the split launch).

For each mask (16K, GQA 64:8, D = 128, bf16, seed 0) and its default config, times interleaved in
one ``time_interleaved`` call: ``one`` (one launch, ``split_partial=False``), ``split`` (both
launches), ``first`` (the full tiles alone, the kernel without the mask path) and ``second`` (the
partial tiles alone, merging into what ``first`` left). Both launches are checked against the
float32 reference first. One JSON row per (mask, variant) on stdout and in
``$OUT/split_cost.jsonl``, with the partial tiles' share and the number of second-launch items::

    python experiments/gpu/split_cost.py --masks causal_blockwise,full_document,prefix_lm_causal,causal

``LONGCA_PACKAGE_ROOT=DIR`` imports ``longca_triton`` from ``DIR`` (an A/B of two versions).
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if os.environ.get("LONGCA_PACKAGE_ROOT"):
    sys.path.insert(0, os.path.abspath(os.environ["LONGCA_PACKAGE_ROOT"]))

import torch  # noqa: E402

from longca_triton.bench.timing import time_interleaved  # noqa: E402
from longca_triton.kernels.gluon.op import fwd_block_m, fwd_plan, gluon_fwd, resolve_config  # noqa: E402
from longca_triton.masks import make_mask  # noqa: E402
from longca_triton.reference import chunked_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--S", type=int, default=16384)
    ap.add_argument("--masks", default="causal_blockwise,full_document,prefix_lm_causal,causal")
    ap.add_argument("--config-json", default="{}", help="overlaid on every mask's default config")
    ap.add_argument("--label", default=os.environ.get("LONGCA_PACKAGE_ROOT", "checkout"))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    S, extra = a.S, json.loads(a.config_json)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, S, 64, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, S, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    scale = 128 ** -0.5
    cases, rows = [], []
    for name in a.masks.split(","):
        mask = make_mask(name, S, seed=0)
        base = resolve_config(128, torch.bfloat16, extra or None, mask=mask)
        one_cfg = dict(base, split_partial=False)
        split_cfg = dict(base, split_partial=True)
        one_plan, pair = fwd_plan(mask, one_cfg, q.device), fwd_plan(mask, split_cfg, q.device)
        if not isinstance(pair, tuple):
            print(json.dumps(dict(mask=name, skipped="no partial tiles")), flush=True)
            continue
        ref = chunked_attention(q.float(), k.float(), v.float(), mask, chunk=1024)
        with torch.no_grad():
            for label, plan, cfg in (("one", one_plan, one_cfg), ("split", pair, split_cfg)):
                o, _ = gluon_fwd(q, k, v, plan, scale, cfg)
                err = ((o.float() - ref).norm() / ref.norm()).item()
                assert err < 0.02, (name, label, err)
                rows.append(dict(mask=name, variant=label, err_out=err))
        del ref
        # the halves alone: the second merges into the buffers the first wrote (its result is not
        # checked after repeated merges, only its time)
        out = torch.empty(q.shape[:3] + (128,), device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(1, 64, S, device="cuda", dtype=torch.float32)
        from longca_triton.kernels.gluon.op import _launch_fwd

        def first(p=pair[0], c=split_cfg):
            _launch_fwd(q, k, v, out, lse, p, scale, c, merge=False)

        def second(p=pair[1], c=split_cfg):
            _launch_fwd(q, k, v, out, lse, p, scale, dict(c, persistent=True, snake=True), merge=True)

        bt = mask.block_tables(fwd_block_m(base), base["BLOCK_N"])
        info = dict(mask=name, consumers=base["consumers"], persistent=base["persistent"],
                    partial_share=bt.num_partial / max(1, bt.num_full + bt.num_partial),
                    second_items=len(pair[1].order) * 64, flops=mask.flops(64, 128, "fwd"))
        for label, fn in (("one", lambda p=one_plan, c=one_cfg: gluon_fwd(q, k, v, p, scale, c)),
                          ("split", lambda p=pair, c=split_cfg: gluon_fwd(q, k, v, p, scale, c)),
                          ("first", first), ("second", second)):
            cases.append(dict(info, variant=label, fn=fn))
    with torch.no_grad():
        stats = time_interleaved([c["fn"] for c in cases], rep=30, max_ms=3000)
    errs = {(r["mask"], r["variant"]): r["err_out"] for r in rows}
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "split_cost.jsonl").open("a") as f:
        for c, st in zip(cases, stats):
            c.pop("fn")
            flops = c.pop("flops")
            c.update(ms=st["median_ms"], code=a.label, err_out=errs.get((c["mask"], c["variant"])))
            if c["variant"] in ("one", "split"):
                c["fwd_tflops"] = flops / st["median_ms"] / 1e9
            f.write(json.dumps(c) + "\n")
            print(json.dumps(c), flush=True)


if __name__ == "__main__":
    main()

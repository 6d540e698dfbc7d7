"""What the Gluon forward pays for partial tiles (issue 12: prefix_lm_causal runs at 0.93 of full).

Times, interleaved in one ``time_interleaved`` call (16K, GQA 64:8, D = 128, bf16), the default
config on: ``full`` (no partial tile: the kernel compiled without the mask path), ``prefix_lm_causal``
with ``prefix = S - 1`` (one partial key tile a row tile: the mask path compiled in, almost never
run), with ``prefix = 12288`` (a multiple of both query tiles: partial tiles on the diagonal only),
with the generator's seed-0 prefix (the harness's case: the prefix boundary cuts a key tile too), and
``causal``; each with its own default config and with the config given by ``--config-json``. Every
case is checked against the float32 reference first. One JSON row per (mask, config) on stdout and in
``$OUT/partial_cost.jsonl``::

    python experiments/gpu/partial_cost.py --config-json '{"consumers": 3, "p_smem": true}'
"""

import argparse
import json
import os
from pathlib import Path

import torch

from longca_triton.bench.timing import time_interleaved
from longca_triton.kernels.gluon.op import gluon_attention, resolve_config
from longca_triton.masks import make_mask
from longca_triton.reference import chunked_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--S", type=int, default=16384)
    ap.add_argument("--config-json", default="[]", help="configs timed beside each mask's default (a list)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--more-masks", default="", metavar="NAME,...", help="static masks timed after those (seed 0)")
    ap.add_argument("--only", action="store_true", help="only the --more-masks")
    a = ap.parse_args()
    S = a.S
    extra = json.loads(a.config_json)
    extra = extra if isinstance(extra, list) else [extra]
    masks = [("full", make_mask("full", S)), ("prefix=S-1", make_mask("prefix_lm_causal", S, prefix=S - 1)),
             ("prefix=12288", make_mask("prefix_lm_causal", S, prefix=12288)),
             ("prefix_lm_causal", make_mask("prefix_lm_causal", S, seed=0)), ("causal", make_mask("causal", S))]
    if a.only:
        masks = []
    masks += [(name, make_mask(name, S, seed=0)) for name in a.more_masks.split(",") if name]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, S, 64, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, S, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cases = []
    for label, mask in masks:
        ref = chunked_attention(q.float(), k.float(), v.float(), mask, chunk=1024)
        for cfg in [{}, *extra]:
            with torch.no_grad():
                o = gluon_attention(q, k, v, mask, config=cfg or None)
            err = ((o.float() - ref).norm() / ref.norm()).item()
            assert err < 0.02, (label, cfg, err)
            resolved = resolve_config(128, torch.bfloat16, cfg or None, mask=mask)
            cases.append(dict(mask=label, config=cfg, density=mask.density, err_out=err,
                              consumers=resolved["consumers"], persistent=resolved["persistent"],
                              fn=lambda m=mask, c=cfg: gluon_attention(q, k, v, m, config=c or None),
                              flops=mask.flops(64, 128, "fwd")))
        del ref
    with torch.no_grad():
        stats = time_interleaved([c["fn"] for c in cases], rep=30, max_ms=3000)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "partial_cost.jsonl").open("a") as f:
        for c, st in zip(cases, stats):
            c.pop("fn")
            c["fwd_ms"] = st["median_ms"]
            c["fwd_tflops"] = c.pop("flops") / st["median_ms"] / 1e9
            f.write(json.dumps(c) + "\n")
            print(json.dumps(c), flush=True)


if __name__ == "__main__":
    main()

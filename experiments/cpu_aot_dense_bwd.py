"""Compile the dense backward's dQ / dK/dV launches for sm_90a on a CPU (no GPU): registers, spills, shared
memory, and each loop's SASS (instruction count, the order of its HGMMA / wgmma waits / MUFU events).

The launches are the real ones (``dense.dense_bwd`` on CPU tensors of the real shapes with its kernels swapped for
recorders: ``kernels.aot``), so every constexpr is what a GPU run would pass.

    PYTHONPATH=. python experiments/cpu_aot_dense_bwd.py --masks full,causal --passes dq \\
        --configs '{"default": {}, "skew": {"dq_skew": true}}' [--dump DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from cpu_aot_varblock import common_args, report  # noqa: E402

KERNELS = {"dq": "dense_bwd_dq_kernel", "dkdv": "dense_bwd_dkdv_kernel"}


def record(mask, cfg_over: dict, hq: int, hkv: int, d: int, passes=("dq",)):
    """The dense backward's launches of ``passes`` for ``mask`` under ``cfg_over``, recorded (never run)."""
    from longca_triton.kernels.core import aot
    from longca_triton.kernels.dense import op as dense

    dense._interpreting = lambda: False
    S = int(mask.seqlen_q)
    q = torch.empty(1, S, hq, d, dtype=torch.bfloat16)
    k = torch.empty(1, S, hkv, d, dtype=torch.bfloat16)
    v = torch.empty(1, S, hkv, d, dtype=torch.bfloat16)
    cfg = dense.resolve_config(d, q.dtype, cfg_over, q=q, k=k, v=v, mask=mask)
    _, dkdv_plan, dq_plan = dense.plans_for(mask, cfg, "cpu")
    out, dout = torch.empty_like(q), torch.empty_like(q)
    lse = torch.empty(1, hq, S, dtype=torch.float32)
    with aot.recorded_launches(dense, tuple(KERNELS.values())) as rec, \
            aot.recorded_launches(dense, ("dense_bwd_preprocess_kernel",)):
        dense.dense_bwd(dout, q, k, v, out, lse, dkdv_plan, dq_plan, d ** -0.5, {**cfg, "bwd_streams": False})
    return cfg, [ln for ln in rec if ln.name in {KERNELS[p] for p in passes}]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--masks", default="full,causal")
    common_args(ap, "dq")
    ap.set_defaults(S=16384)
    args = ap.parse_args(argv)
    from longca_triton.masks import make_mask

    hq, hkv = (int(x) for x in args.heads.split(":"))
    for mname in args.masks.split(","):
        mask = make_mask(mname, args.S, seed=0)
        for name, over in json.loads(args.configs).items():
            _, launches = record(mask, over, hq, hkv, args.head_dim, tuple(args.passes.split(",")))
            report(launches, f"{mname}-{name}", args.dump, mask=mname)


if __name__ == "__main__":
    main()

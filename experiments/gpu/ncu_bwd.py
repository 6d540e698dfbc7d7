"""One backward under Nsight Compute: the hardware counters behind issue 13's two questions.

1. Does the row-major dK/dV sweep raise the L2 hit rate of the dense dK/dV kernel on causal (the
   hypothesis in ``kernels/dense_bwd._dkdv_program``), or is its gain something else?
2. Where does our block-sparse backward lose to Flex's (0.85x at 32K / 0.3 / block 128 per KV head):
   L2, DRAM, tensor-pipe issue, stalls, occupancy?

Each case runs forward and backward twice (compile, then the profiled pass); the backward's kernels
run on autograd's device thread, so ``ncu`` picks them by name, skipping the first pass's launches:

    ncu --clock-control none -k regex:'bwd_dkdv|bwd_dq' -s 2 -c 2 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \\
        --section WarpStateStats --csv --page details \\
        python experiments/gpu/ncu_bwd.py --case dense-causal-sweep > $OUT/dense-causal-sweep.csv

``experiments/gpu/ncu_bwd.sh`` runs every case. Cases: dense-causal-hm32 (head-major 32x64/4/3, the
old default), dense-causal-hm64 (head-major 64x64/4/2), dense-causal-sweep (the new default: sweep 2
on 64x64/4/2), sparse-ours, sparse-flex, varblock-ours, varblock-big (``VARBLOCK``). S = 16K (dense) / 32K (block-sparse), GQA 64:8, D = 128, bf16.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]  # bwd_variants; the repository's package

DENSE = {
    "dense-causal-hm32": dict(dkdv_sweep=0, DKDV_BLOCK_M=32, DKDV_BLOCK_N=64, dkdv_num_warps=4, dkdv_num_stages=3),
    "dense-causal-hm64": dict(dkdv_sweep=0, DKDV_BLOCK_M=64, DKDV_BLOCK_N=64, dkdv_num_warps=4, dkdv_num_stages=2),
    "dense-causal-sweep": dict(dkdv_sweep=2, DKDV_BLOCK_M=64, DKDV_BLOCK_N=64, dkdv_num_warps=4, dkdv_num_stages=2),
}
#: variable blocks (mean 256, min 128; session 16): the default tiles, and uniform block 128's backward tiles
#: (128 keys a dK/dV program, 64 query rows a step) with the blocks' remainders in 64-row tail tiles
VARBLOCK = {
    "varblock-ours": {},
    "varblock-aligned": {},  # blocks of 128 / 256 / 384 (bwd_variants.aligned_bounds): no ragged tile
    "varblock-big": dict(DKDV_BLOCK_M=64, DKDV_BLOCK_N=128, dkdv_num_warps=8, dkdv_num_stages=3, dkdv_list_chunk=64,
                         dkdv_tail_rows=64, DQ_BLOCK_M=128, DQ_BLOCK_N=64, dq_num_warps=8, dq_num_stages=3,
                         dq_list_chunk=64, dq_tail_rows=64),
}
CASES = (*DENSE, "sparse-ours", "sparse-flex", *VARBLOCK)


def backward_fn(case: str):
    """(the attention function of ``case``, its leaves q / k / v, dO)."""
    from longca_triton.kernels.block_sparse import op as BS
    from longca_triton.kernels.dense import op as D
    from longca_triton.masks import make_mask

    torch.manual_seed(0)
    hq, hkv, d = 64, 8, 128
    if case in DENSE:
        S = 16384
        mask = make_mask("causal", S)
    elif case in VARBLOCK:
        S = 32768
        from bwd_variants import aligned_bounds

        extra = aligned_bounds(S) if case == "varblock-aligned" else {"min_block": 128}
        mask = make_mask("varblock_sparse", S, block=256, density=0.3, patterns=hkv, seed=0, **extra)
    else:
        S = 32768
        mask = make_mask("block_sparse", S, block=128, density=0.3, patterns=hkv, seed=0)
    q, k, v, dout = (torch.randn(1, S, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    if case in DENSE:
        cfg = {**D.resolve_config(d, torch.bfloat16, q=q, k=k, mask=mask), **DENSE[case]}
        attn = lambda *t: D.dense_attention(*t, mask, config=cfg)  # noqa: E731
    elif case == "sparse-ours":
        attn = lambda *t: BS.block_sparse_attention(*t, mask)  # noqa: E731
    elif case in VARBLOCK:
        attn = lambda *t: BS.block_sparse_attention(*t, mask, config=VARBLOCK[case] or None)  # noqa: E731
    else:
        from bwd_variants import flex_sparse_attn
        from types import SimpleNamespace

        attn = flex_sparse_attn(SimpleNamespace(mask=mask, hq=hq))
    return attn, leaves, dout


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=CASES, required=True)
    a = ap.parse_args(argv)
    attn, leaves, dout = backward_fn(a.case)
    for i in range(2):
        out = attn(*leaves)
        torch.cuda.synchronize()
        torch.autograd.grad(out, leaves, dout)
        torch.cuda.synchronize()
    print(f"# {a.case}: done", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Query-major dK/dV scores (``dkdv_qmajor``, ``dkdv_tail_cols``) and the dK/dV tails in the main launch
(``dkdv_tail_order`` 3) on a GPU (``-m gpu``; written in session 27 on a CPU, not yet run on a GPU).

In bf16 at real sizes each variant's gradients against float64 on one KV group, within 2x the error of the
same computation by PyTorch in bf16; the tails in the main launch equal, bit for bit, the same tail tiles in a
launch of their own (the same tile code, disjoint outputs)."""

import pytest
import torch
from utils import assert_grads_near_float64

from longca_triton.kernels.block_sparse.op import block_sparse_attention
from longca_triton.masks import make_mask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TAILS128 = {"dkdv_tail_cols": 128, "dkdv_tail_warps": 8}


def _inputs(S, hq, hkv, d=128):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(1, S, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv, hq)]


def _grads(fn, mask, q, k, v, dout, config):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    fn(*leaves, mask, config=config).backward(dout)
    return [t.grad for t in leaves]


CASES = {
    # id: (attention, mask factory, S, config)
    "varblock-tails128-apart-S=4096": (block_sparse_attention, lambda S: make_mask(
        "varblock_sparse", S, block=256, min_block=128, density=0.4, patterns=2, seed=0), 4096, TAILS128),
    "varblock-tails64-apart-S=4096": (block_sparse_attention, lambda S: make_mask(
        "varblock_sparse", S, block=256, min_block=128, density=0.4, patterns=2, seed=3), 4096, {"dkdv_tail_cols": 64}),
    "varblock-tails128-merged-S=4096": (block_sparse_attention, lambda S: make_mask(
        "varblock_sparse", S, block=256, min_block=128, density=0.4, patterns=2, seed=1), 4096,
        {**TAILS128, "dkdv_tail_order": 3}),
    "varblock-main64x64-qmajor-S=4096": (block_sparse_attention, lambda S: make_mask(
        "varblock_sparse", S, block=256, min_block=128, density=0.4, patterns=2, seed=2), 4096,
        {"DKDV_BLOCK_N": 64, "dkdv_num_warps": 4, "dkdv_tail_rows": 0, "dkdv_qmajor": True}),
    "block_sparse-64-qmajor-S=4096": (block_sparse_attention, lambda S: make_mask(
        "block_sparse", S, block=64, density=0.4, patterns=2, seed=0), 4096, {"dkdv_qmajor": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_qmajor_against_float64(case):
    fn, mk, S, cfg = CASES[case]
    hq, hkv = 8, 2
    mask = mk(S)
    q, k, v, dout = _inputs(S, hq, hkv)
    assert_grads_near_float64(_grads(fn, mask, q, k, v, dout, cfg), q, k, v, dout, mask)


def test_merged_tails_equal_bits():
    """Variable blocks at GQA 16:2, S = 8192: the tails in the main launch (order 3) against their own launch
    (order 2), both with 128-row query-major tail steps: equal bit for bit."""
    mask = make_mask("varblock_sparse", 8192, block=256, min_block=128, density=0.3, patterns=2, seed=0)
    q, k, v, dout = _inputs(8192, 16, 2)
    apart = _grads(block_sparse_attention, mask, q, k, v, dout, {**TAILS128, "dkdv_tail_order": 2})
    merged = _grads(block_sparse_attention, mask, q, k, v, dout, {**TAILS128, "dkdv_tail_order": 3})
    for name, a, b in zip(("dq", "dk", "dv"), apart, merged):
        assert torch.isfinite(a).all() and torch.equal(a, b), f"{name} differs with the tails in the main launch"

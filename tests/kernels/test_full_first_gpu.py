"""Whole entries first (``dkdv_full_first``, ``dq_full_first``) on a GPU (``-m gpu``; written in session 29 on a
CPU): variable blocks' dK/dV and dQ lists walked in two parts, the whole contiguous entries through the even,
unpacked steps (the dK/dV stats by TMA boxes), the rest through the packed / masked ones.

In bf16 at real sizes, each config's gradients against float64 on one KV group, within 2x the error of the same
computation by PyTorch in bf16 (``utils.assert_grads_near_float64``)."""

import pytest
import torch
from utils import assert_grads_near_float64

from longca_triton.kernels.block_sparse.op import block_sparse_attention
from longca_triton.masks import make_mask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _inputs(S, hq, hkv, d=128):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(1, S, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv, hq)]


def _grads(mask, q, k, v, dout, config):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    block_sparse_attention(*leaves, mask, config=config).backward(dout)
    return [t.grad for t in leaves]


CASES = {
    # id: (mask factory, S, config)
    "dkdv-S=4096": (lambda S: make_mask("varblock_sparse", S, block=256, min_block=128, density=0.4, patterns=2,
                                        seed=0), 4096, {"dkdv_full_first": True}),
    "dq-S=4096": (lambda S: make_mask("varblock_sparse", S, block=256, min_block=128, density=0.4, patterns=2,
                                      seed=1), 4096, {"dq_full_first": True}),
    "both-S=5000": (lambda S: make_mask("varblock_sparse", S, block=256, min_block=128, density=0.3, patterns=2,
                                        seed=2), 5000, {"dkdv_full_first": True, "dq_full_first": True}),
    "both-no-boxes-block128-S=4096": (lambda S: make_mask("varblock_sparse", S, block=128, min_block=64, density=0.5,
                                                          patterns=2, seed=3), 4096,
                                      {"dkdv_full_first": True, "dq_full_first": True, "dkdv_stats_tma": False}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_full_first_against_float64(case):
    mk, S, cfg = CASES[case]
    mask = mk(S)
    q, k, v, dout = _inputs(S, 8, 2)
    assert_grads_near_float64(_grads(mask, q, k, v, dout, cfg), q, k, v, dout, mask)

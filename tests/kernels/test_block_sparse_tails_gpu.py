"""The variable-block dK/dV tails (query-major scores) on a GPU (``-m gpu``): bf16 gradients at real sizes
against float64 on one KV group, within 2x the error of the same computation by PyTorch in bf16."""

import pytest
import torch
from utils import assert_grads_near_float64

from longca_triton.kernels.block_sparse.op import block_sparse_attention
from longca_triton.masks import make_mask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

def _inputs(S, hq, hkv, d=128):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(1, S, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv, hq)]


def _grads(fn, mask, q, k, v, dout, config):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    fn(*leaves, mask, config=config).backward(dout)
    return [t.grad for t in leaves]


CASES = {
    # id: (attention, mask factory, S, config)
    "varblock-default-tails-S=4096": (block_sparse_attention, lambda S: make_mask(
        "varblock_sparse", S, block=256, min_block=128, density=0.4, patterns=2, seed=3), 4096, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_varblock_tails_against_float64(case):
    fn, mk, S, cfg = CASES[case]
    hq, hkv = 8, 2
    mask = mk(S)
    q, k, v, dout = _inputs(S, hq, hkv)
    assert_grads_near_float64(_grads(fn, mask, q, k, v, dout, cfg), q, k, v, dout, mask)

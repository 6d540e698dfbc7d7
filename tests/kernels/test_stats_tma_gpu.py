"""``dkdv_stats_tma`` and variable blocks' 128-key dK/dV tile on a GPU (``-m gpu``).

The dK/dV steps' lse / delta read from the preprocess's 16-byte rows by TMA boxes must give the pointer
path's gradients bit for bit (the same values enter the same arithmetic): block-sparse uniform blocks (the
default there), 128-aligned variable blocks (full entries: the boxes apply) and ragged variable blocks
(packed entries: the launcher keeps the pointer loads). Variable blocks' dK/dV default against a float64
reference in bf16."""

import pytest
import torch
from utils import assert_grads_near_float64

from longca_triton.kernels.block_sparse.op import block_sparse_attention
from longca_triton.masks import aligned_block_bounds, make_mask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _aligned_varblock(S: int):
    """Variable blocks whose sizes are multiples of 128: full entries at the 128-key tile, so the stats
    boxes apply."""
    return make_mask("varblock_sparse", S, block=256, density=0.3, patterns=2, seed=0, **aligned_block_bounds(S))


CASES = {
    "block_sparse-128-S=8192-GQA16:2": (block_sparse_attention, lambda: make_mask(
        "block_sparse", 8192, block=128, density=0.3, patterns=2, seed=0), 8192, 16, 2),
    "varblock-aligned128-S=8192-GQA16:2": (block_sparse_attention, lambda: _aligned_varblock(8192), 8192, 16, 2),
    "varblock-ragged-S=8192-GQA16:2": (block_sparse_attention, lambda: make_mask(
        "varblock_sparse", 8192, block=256, min_block=128, density=0.3, patterns=2, seed=0), 8192, 16, 2),
}


def _inputs(S, hq, hkv, d=128):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(1, S, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv, hq)]


def _grads(fn, mask, q, k, v, dout, config):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, mask, config=config)
    out.backward(dout)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("case", list(CASES))
def test_stats_tma_equal_bits(case):
    fn, mk, S, hq, hkv = CASES[case]
    mask = mk()
    q, k, v, dout = _inputs(S, hq, hkv)
    ptr = _grads(fn, mask, q, k, v, dout, {"dkdv_stats_tma": False})
    tma = _grads(fn, mask, q, k, v, dout, {"dkdv_stats_tma": True})
    for name, a, b in zip(("dq", "dk", "dv"), ptr, tma):
        assert torch.isfinite(a).all(), f"{name} not finite"
        assert torch.equal(a, b), f"{name} differs with dkdv_stats_tma"


@pytest.mark.parametrize("seed", [0, 1])
def test_varblock_dkdv_default_against_float64(seed):
    """Variable blocks (mean 256 / min 128, ragged) with the default dK/dV (128-key tiles, 64-key tails)
    against float64 on one KV group; its error within 2x the same computation's in bf16 by PyTorch."""
    S, hq, hkv = 4096, 8, 2
    mask = make_mask("varblock_sparse", S, block=256, min_block=128, density=0.4, patterns=2, seed=seed)
    q, k, v, dout = _inputs(S, hq, hkv)
    assert_grads_near_float64(_grads(block_sparse_attention, mask, q, k, v, dout, None), q, k, v, dout, mask)

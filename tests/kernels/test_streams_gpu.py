"""``bwd_streams`` on a GPU (``-m gpu``): the dQ launches on a second CUDA stream beside dK/dV's must
give the gradients of the one-stream backward bit for bit (same kernels, no atomics), also when the
caller runs on a stream of its own (the side stream must wait for the caller's work, and the caller's
next work for it). bf16 at sizes where the kernels run many waves; the log of a run is committed
under experiments/results/h100/."""

import pytest
import torch

from longca_triton.kernels.block_sparse.op import block_sparse_attention
from longca_triton.kernels.dense.op import dense_attention
from longca_triton.kernels.flashmask.op import flashmask_attention
from longca_triton.masks import make_mask

pytestmark = pytest.mark.gpu

CASES = {
    # id: (attention function, mask factory, S, Hq, Hkv)
    "dense-sliding_window_causal-S=4096-GQA16:2": (dense_attention, lambda S: make_mask(
        "sliding_window_causal", S, window=512), 4096, 16, 2),
    "dense-causal_document-S=3001-GQA8:8": (dense_attention, lambda S: make_mask("causal_document", S, seed=1),
                                            3001, 8, 8),
    "flashmask-causal-S=4096-GQA16:2": (flashmask_attention, lambda S: make_mask("causal", S), 4096, 16, 2),
    "block_sparse-128-S=8192-GQA16:2": (block_sparse_attention, lambda S: make_mask(
        "block_sparse", S, block=128, density=0.3, patterns=2, seed=0), 8192, 16, 2),
    # variable blocks: the dQ tile stacks four heads of the group (one launch on the side stream); at MHA
    # one head's tiles and the tail tiles (two launches on the side stream)
    "varblock_sparse-256-S=8192-GQA16:2": (block_sparse_attention, lambda S: make_mask(
        "varblock_sparse", S, block=256, min_block=128, density=0.3, patterns=2, seed=0), 8192, 16, 2),
    "varblock_sparse-256-S=8192-MHA8:8": (block_sparse_attention, lambda S: make_mask(
        "varblock_sparse", S, block=256, min_block=128, density=0.3, patterns=8, seed=0), 8192, 8, 8),
}


def _grads(fn, mask, q, k, v, dout, streams: bool):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, mask, config={"bwd_streams": streams})
    out.backward(dout)
    return [t.grad for t in leaves]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(CASES))
def test_bwd_streams_equal_bits(case):
    fn, mk, S, hq, hkv = CASES[case]
    mask = mk(S)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(1, S, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                     for h in (hq, hkv, hkv, hq))
    one = _grads(fn, mask, q, k, v, dout, False)
    two = _grads(fn, mask, q, k, v, dout, True)
    for name, a, b in zip(("dq", "dk", "dv"), one, two):
        assert torch.isfinite(a).all(), f"{name} not finite"
        assert torch.equal(a, b), f"{name} differs with bwd_streams"
    # on a stream of the caller's: the inputs are written there just before (a side stream that did
    # not wait for it would read them half written), and read back there right after
    user = torch.cuda.Stream()
    user.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(user):
        q2, k2, v2, do2 = (torch.empty_like(t).copy_(t) for t in (q, k, v, dout))
        three = _grads(fn, mask, q2, k2, v2, do2, True)
        same = [torch.equal(a, b) for a, b in zip(one, three)]
    torch.cuda.current_stream().wait_stream(user)
    assert all(same), f"bwd_streams on a caller's stream: equal dq, dk, dv = {same}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("patterns", [8, 1], ids=["per-kv-head", "one-pattern"])
def test_dkdv_pattern_order_equal_bits(patterns):
    """``dkdv_pattern_order`` only reorders the dK/dV programs: the gradients are the summed order's bit for bit."""
    mask = make_mask("block_sparse", 8192, block=128, density=0.3, patterns=patterns, seed=0)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(1, 8192, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                     for h in (32, 8, 8, 32))
    grads = []
    for order in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        block_sparse_attention(*leaves, mask, config={"dkdv_pattern_order": order}).backward(dout)
        grads.append([t.grad for t in leaves])
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert torch.isfinite(a).all() and torch.equal(a, b), f"{name} differs with dkdv_pattern_order"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stack", [8, 4, 2], ids=["8x16", "4x32", "2x64"])
def test_varblock_stacked_dq_equal_bits(stack):
    """Variable blocks' stacked dQ tile (``stack`` query heads x 128 / stack
    positions in 128 rows, no tail launch) only regroups rows: each row walks the same key tiles in the same
    order, so the gradients are one head's 128-row tiles with 64-row tails bit for bit."""
    mask = make_mask("varblock_sparse", 8192, block=256, min_block=128, density=0.3, patterns=2, seed=0)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(1, 8192, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                     for h in (16, 2, 2, 16))
    grads = []
    for cfg in ({"DQ_BLOCK_M": 128, "DQ_HEADS": 1}, {"DQ_BLOCK_M": 128 // stack, "DQ_HEADS": stack}):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        block_sparse_attention(*leaves, mask, config=cfg).backward(dout)
        grads.append([t.grad for t in leaves])
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert torch.isfinite(a).all() and torch.equal(a, b), f"{name} differs with the stacked dQ tile"

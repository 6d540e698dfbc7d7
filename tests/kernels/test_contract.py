"""What every dense-mask kernel of ours owes its callers, checked once for all of them: an empty
mask gives zeros and lse = -inf, and tiles that are neither square nor equal across the passes
compute the same answer as the float64 reference."""

import pytest
import torch
from utils import ODD_CONFIG, compare_to_reference, needs_triton, small_mask

from longca_triton.kernels.dense.op import dense_attention
from longca_triton.kernels.flashmask.op import flashmask_attention
from longca_triton.masks import RangeMask

pytestmark = needs_triton
KERNELS = {"dense": dense_attention, "flashmask": flashmask_attention}


def run(kernel, mask, B, Hq, Hkv, D, dtype, config=None):
    fn = KERNELS[kernel]
    return compare_to_reference(lambda q, k, v: fn(q, k, v, mask, return_lse=True, config=config), mask,
                                mask.seqlen_q, mask.seqlen_k, B, Hq, Hkv, D, dtype)


@pytest.mark.parametrize("kernel", KERNELS)
def test_completely_empty_mask(kernel):
    out, lse = run(kernel, RangeMask(40, 40, [], name="empty"), 1, 2, 1, 32, torch.float32)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


@pytest.mark.parametrize("name", ["causal_document", "share_question", "global_sliding_window"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_uneven_tiles(kernel, name):
    run(kernel, small_mask(name, 150, seed=4), 1, 4, 2, 32, torch.float32, config=ODD_CONFIG)

"""What every dense-mask kernel of ours owes its callers, checked once for all of them: an empty
mask gives zeros and lse = -inf, and tiles that are neither square nor equal across the passes
compute the same answer as the float64 reference. And what ``deterministic=True`` promises through
the API: a backend that cannot keep it refuses by name, FlashAttention's is asked for its own. (Each
kernel family's equal bits on two runs are in its own tests.)"""

import pytest
import torch
from utils import DEVICE, ODD_CONFIG, compare_to_reference, needs_triton, small_mask

import longca_triton as lt

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


# ------------------------------------------------------------------ deterministic=True through the API
def test_api_refuses_deterministic_where_the_backend_cannot_promise_it():
    mask = small_mask("causal", 40)
    q, k, v = (torch.randn(1, 40, h, 32, device=DEVICE) for h in (2, 1, 1))
    with pytest.raises(ValueError, match="'reference' cannot promise deterministic"):
        lt.attention(q, k, v, mask, backend="reference", deterministic=True)


def test_flash_adapter_asks_flashattention_for_determinism():
    """FA2/FA3: ``deterministic=True`` goes to the vendor function where its signature has it, else a
    ValueError naming the backend (no flash-attn needed: the plan holds the functions)."""
    from longca_triton.adapters.flash import FA2, _FlashPlan

    def with_flag(q, k, v, softmax_scale=None, causal=False, deterministic=False):
        pass

    def without_flag(q, k, v, softmax_scale=None, causal=False):
        pass

    plan = _FlashPlan(fa=None, cu=None, max_seqlen=8, dense_fn=with_flag, varlen_fn=with_flag,
                      dense_kw={"causal": True}, varlen_kw={"causal": True})
    det = FA2().deterministic_plan(plan)
    assert det.dense_kw == {"causal": True, "deterministic": True} and det.varlen_kw["deterministic"] is True
    assert "deterministic" not in plan.dense_kw  # the cached plan is left alone
    old = _FlashPlan(fa=None, cu=None, max_seqlen=8, dense_fn=with_flag, varlen_fn=without_flag,
                     dense_kw={}, varlen_kw={})
    with pytest.raises(ValueError, match="'fa2' cannot promise deterministic.*without_flag"):
        FA2().deterministic_plan(old)

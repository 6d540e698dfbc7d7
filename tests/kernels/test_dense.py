"""Correctness of the dense structured-mask Triton kernels (``longca_triton/kernels/dense/op.py``) on the CPU.

Runs the kernels in Triton's interpreter (``TRITON_INTERPRET=1``, set below before triton is
imported) in float32 and float16, and compares out, lse, dq, dk, dv with the float64 naive
reference for all 12 static masks at awkward sizes, GQA 4:1 and 1:1, head dims 32/64, fully
masked rows, random ``RangeMask``s, non-contiguous inputs, an lse gradient and the custom op.
"""

import pytest
import torch
from utils import DEVICE, compare_to_reference, needs_triton, random_range_mask, small_mask

from longca_triton.kernels.dense.op import (
    CONFIG_KEYS,
    dense_attention,
    dense_attention_op,
    default_config,
    resolve_config,
)
from longca_triton.masks import STATIC_MASK_NAMES, make_mask
from longca_triton.reference.naive import naive_attention

pytestmark = needs_triton

def run_and_compare(mask, B, Hq, Hkv, D, dtype, *, config=None, seed=0, layout="bshd", dlse=False,
                    use_op=False):
    fn = dense_attention_op if use_op else dense_attention
    return compare_to_reference(lambda q, k, v: fn(q, k, v, mask, return_lse=True, config=config), mask,
                                mask.seqlen_q, mask.seqlen_k, B, Hq, Hkv, D, dtype, seed=seed, layout=layout, dlse=dlse)


# ------------------------------------------------------------------ all 12 static masks
CASES = []
for S in (1, 17, 239):
    for name in STATIC_MASK_NAMES:
        CASES.append(pytest.param(S, 4, 1, 32, torch.float32, name, id=f"S={S}-Hq=4-Hkv=1-D=32-fp32-{name}"))
for name in STATIC_MASK_NAMES:
    CASES.append(pytest.param(300, 2, 2, 64, torch.float16, name, id=f"S=300-Hq=2-Hkv=2-D=64-fp16-{name}"))


@pytest.mark.parametrize("S,Hq,Hkv,D,dtype,name", CASES)
def test_static_masks(S, Hq, Hkv, D, dtype, name):
    run_and_compare(small_mask(name, S, seed=S), 1, Hq, Hkv, D, dtype)


# ------------------------------------------------------------------ random masks, empty rows
@pytest.mark.parametrize("sq,sk,seed", [(64, 64, 0), (100, 37, 1), (45, 130, 2), (239, 239, 3)],
                         ids=lambda x: str(x))
def test_random_range_masks(sq, sk, seed):
    mask = random_range_mask(sq, sk, seed)
    assert (~mask.to_dense().any(1)).any(), "the test wants fully masked rows"
    out, lse = run_and_compare(mask, 2, 4, 2, 32, torch.float32, seed=seed)
    empty = ~mask.to_dense().any(1)
    assert torch.all(out[:, empty] == 0)
    assert torch.all(lse[:, :, empty] == float("-inf"))



# ------------------------------------------------------------------ configs, layouts, lse grad



FUSED_CONFIG = dict(fused_dq=True, DKDV_BLOCK_M=16, DKDV_BLOCK_N=32)


@pytest.mark.parametrize("name", ["causal", "causal_document", "global_sliding_window", "prefix_lm_document"])
def test_fused_dq(name):
    run_and_compare(small_mask(name, 130, seed=9), 1, 4, 1, 32, torch.float32, config=FUSED_CONFIG)


def test_fused_dq_random_mask_fp16():
    run_and_compare(random_range_mask(90, 70, seed=10), 2, 2, 2, 64, torch.float16,
                    config=FUSED_CONFIG, dlse=True)


def test_non_contiguous_and_batch():
    run_and_compare(small_mask("prefix_lm_document", 77, seed=5), 2, 4, 1, 64, torch.float16,
                    layout="bhsd")


def test_lse_gradient():
    run_and_compare(small_mask("causal_blockwise", 90, seed=6), 1, 2, 1, 32, torch.float32, dlse=True)


def test_custom_op_path_matches():
    mask = small_mask("causal_document", 70, seed=7)
    run_and_compare(mask, 1, 4, 2, 32, torch.float32, use_op=True, dlse=True)


def test_custom_op_under_torch_compile():
    from longca_triton.kernels.dense.op import dense_attention_from_plans, plans_for

    mask = small_mask("sliding_window_causal", 50, seed=8)
    torch.manual_seed(0)
    q = torch.randn(1, 50, 2, 32, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 50, 1, 32, device=DEVICE, requires_grad=True)
    v = torch.randn(1, 50, 1, 32, device=DEVICE, requires_grad=True)
    cfg = resolve_config(32, q.dtype)
    plans = plans_for(mask, cfg, q.device)

    def f(q, k, v):
        return dense_attention_from_plans(q, k, v, *plans, 32 ** -0.5, cfg).sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    loss = compiled(q, k, v)
    loss.backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = naive_attention(q64, k64, v64, mask).sum()
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-3
    for a, b in ((q, q64), (k, k64), (v, v64)):
        assert (a.grad.double() - b.grad).abs().max().item() < 1e-3


# ------------------------------------------------------------------ validation and configs
def test_validation_errors():
    mask = make_mask("causal", 16)
    q = torch.randn(1, 16, 4, 32, device=DEVICE)
    k = torch.randn(1, 16, 3, 32, device=DEVICE)
    with pytest.raises(ValueError, match="GQA"):
        dense_attention(q, k, k, mask)
    with pytest.raises(ValueError, match="multiples of 8 from 8 to 256"):
        dense_attention(q[..., :20], q[..., :20], q[..., :20], mask)  # not a multiple of 8
    with pytest.raises(ValueError, match="head dim of v 264 not supported"):
        dense_attention(q, q, torch.randn(1, 16, 4, 264), mask)  # v's own head dim, over 256
    with pytest.raises(ValueError, match="q and k share D_qk"):
        dense_attention(q, q[..., :16], q, mask)
    with pytest.raises(ValueError, match="mask is 16 x 16"):
        dense_attention(q[:, :8], q[:, :8], q[:, :8], mask)
    with pytest.raises(ValueError, match=r"\[B, S, H, D\]"):
        dense_attention(q[0], q[0], q[0], mask)
    with pytest.raises(ValueError, match="dtypes differ"):
        dense_attention(q, q.half(), q, mask)
    with pytest.raises(ValueError, match="unknown dense-attention config"):
        dense_attention(q, q, q, mask, config={"BLOCKM": 64})
    with pytest.raises(ValueError, match="power of two"):
        dense_attention(q, q, q, mask, config={"BLOCK_M": 48})
    with pytest.raises(ValueError, match="softmax_scale"):
        dense_attention(q, q, q, mask, softmax_scale=-1.0)


def test_default_config_keys():
    for d in (32, 64, 128, 256):
        assert set(default_config(d, torch.bfloat16)) == set(CONFIG_KEYS)


def test_float32_partials_for_context_parallelism():
    """``out_dtype`` / ``grad_dtype`` (what the CP layer's Triton step asks for) store the same
    values as the fp16 path, unrounded: fp16 results equal the float32 ones rounded once."""
    from longca_triton.kernels.dense.op import dense_bwd, dense_fwd, plans_for, resolve_config

    torch.manual_seed(0)
    S, Hq, Hkv, D = 150, 4, 2, 32
    mask = make_mask("causal_document", S, doc_lens=[70, 80])
    q, k, v, do = (torch.randn(1, S, h, D, device=DEVICE, dtype=torch.float16) for h in (Hq, Hkv, Hkv, Hq))
    cfg = resolve_config(D, torch.float16)
    fwd, dkdv, dq_plan = plans_for(mask, cfg, q.device)
    scale = D ** -0.5
    o16, lse16 = dense_fwd(q, k, v, fwd, scale, cfg)
    o32, lse32 = dense_fwd(q, k, v, fwd, scale, cfg, out_dtype=torch.float32)
    assert o16.dtype == torch.float16 and o32.dtype == torch.float32
    assert torch.equal(lse16, lse32)
    assert torch.equal(o32.to(torch.float16), o16)
    g16 = dense_bwd(do, q, k, v, o16, lse16, dkdv, dq_plan, scale, cfg)
    g32 = dense_bwd(do, q, k, v, o16, lse16, dkdv, dq_plan, scale, cfg, grad_dtype=torch.float32)
    for a, b in zip(g16, g32):
        assert a.dtype == torch.float16 and b.dtype == torch.float32
        assert torch.equal(b.to(torch.float16), a)

"""Argument lowering of the block-sparse vendor adapters (VSA, FlashInfer), checked on the CPU.

Each lowering is turned back into a dense boolean mask and compared with ``to_dense()``; cases the
vendor cannot express must raise ``Unsupported`` with a reason. No vendor package is needed.
"""

import numpy as np
import pytest
import torch

from longca_triton.adapters import Problem, Unsupported, get_backend
from longca_triton.adapters.flashinfer import bsr_lowering, bsr_to_dense, varblock_lowering, varblock_to_dense
from longca_triton.adapters.vsa import vsa_index_tensors, vsa_lowering, vsa_to_dense
from longca_triton.masks import BlockSparseMask, make_mask


def per_head_dense(mask, hq):
    return mask.to_dense()[torch.as_tensor(mask.pattern_of_head(hq))]


# ------------------------------------------------------------------------------ FlashInfer BSR
@pytest.mark.parametrize("block,S", [(64, 512), (128, 1024), (16, 96)], ids=lambda x: str(x))
def test_bsr_roundtrip(block, S):
    mask = make_mask("block_sparse", S, block=block, density=0.4, patterns=1, seed=block)
    a = bsr_lowering(mask)
    assert a.indptr.dtype == np.int32 and a.indices.dtype == np.int32
    assert (a.R, a.C, a.M, a.N) == (block, block, S, S)
    assert torch.equal(bsr_to_dense(a), mask.to_dense()[0])


def test_bsr_short_last_query_block():
    qb = [0, 64, 128, 150]
    kb = [0, 64, 128, 192]
    bm = torch.tensor([[[1, 0, 1], [0, 1, 1], [1, 1, 0]]], dtype=torch.bool)
    mask = BlockSparseMask(qb, kb, bm)
    assert torch.equal(bsr_to_dense(bsr_lowering(mask)), mask.to_dense()[0])


@pytest.mark.parametrize("case", ["varblock", "patterns", "ragged-keys", "range-mask"])
def test_bsr_unsupported(case):
    mask = {
        "varblock": lambda: make_mask("varblock_sparse", 1024, block=256, min_block=128, density=0.5),
        "patterns": lambda: make_mask("block_sparse", 512, block=64, density=0.5, patterns=2),
        "ragged-keys": lambda: make_mask("block_sparse", 500, block=64, density=0.5),
        "range-mask": lambda: make_mask("causal", 256),
    }[case]()
    with pytest.raises(Unsupported):
        bsr_lowering(mask)


# ------------------------------------------------------------------------------ FlashInfer variable blocks
@pytest.mark.parametrize("P", [1, 2], ids=lambda p: f"P={p}")
def test_varblock_roundtrip(P):
    hq, hkv = 4, 2
    mask = make_mask("varblock_sparse", 3000, block=256, min_block=128, density=0.3, patterns=P, seed=P)
    a = varblock_lowering(mask, hq, hkv)
    assert a.block_mask_map.shape == (hkv, len(mask.q_block_bounds) - 1, len(mask.k_block_bounds) - 1)
    assert a.block_row_sz.dtype == torch.int32 and a.block_row_sz.shape[0] == hkv
    dense = varblock_to_dense(a)  # [Hkv, S, S]; KV head h serves query heads h*G .. h*G+G-1
    ref = per_head_dense(mask, hq)[:: hq // hkv]
    assert torch.equal(dense, ref)


def test_varblock_uniform_mask_too():
    mask = make_mask("block_sparse", 300, block=64, density=0.5, patterns=2, seed=0)
    a = varblock_lowering(mask, 2, 2)
    assert torch.equal(varblock_to_dense(a), mask.to_dense())


def test_varblock_per_query_head_patterns_unsupported():
    mask = make_mask("varblock_sparse", 2048, block=256, min_block=128, density=0.5, patterns=4)
    with pytest.raises(Unsupported, match="per query head"):
        varblock_lowering(mask, 4, 2)


# ------------------------------------------------------------------------------ VSA
@pytest.mark.parametrize("block,P,hq", [(64, 1, 2), (64, 2, 4), (128, 4, 4), (128, 1, 2)],
                         ids=["b64-P1", "b64-P=Hkv", "b128-P=Hq", "b128-P1"])
def test_vsa_roundtrip(block, P, hq):
    S = 512
    mask = make_mask("block_sparse", S, block=block, density=0.4, patterns=P, seed=block + P)
    idx, num, sizes = vsa_index_tensors(mask, hq)
    assert idx.dtype == torch.int32 and num.dtype == torch.int32 and sizes.dtype == torch.int32
    assert idx.shape[:3] == (1, hq, S // 64) and num.shape == (1, hq, S // 64)
    assert torch.all(sizes == 64)
    # padding is -1 past each row's count, kept tiles ascending
    for h in range(hq):
        for i in range(S // 64):
            n = int(num[0, h, i])
            row = idx[0, h, i]
            assert torch.all(row[n:] == -1) and torch.all(row[:n].diff() > 0)
    assert torch.equal(vsa_to_dense(idx, num, sizes, S), per_head_dense(mask, hq))


@pytest.mark.parametrize("case", ["block32", "varblock", "ragged-S", "range-mask"])
def test_vsa_unsupported(case):
    mask = {
        "block32": lambda: make_mask("block_sparse", 512, block=32, density=0.5),
        "varblock": lambda: make_mask("varblock_sparse", 1024, block=256, min_block=128, density=0.5),
        "ragged-S": lambda: make_mask("block_sparse", 500, block=64, density=0.5),
        "range-mask": lambda: make_mask("full", 256),
    }[case]()
    with pytest.raises(Unsupported):
        vsa_lowering(mask, 2)


# ------------------------------------------------------------------------------ the registered backends
@pytest.mark.parametrize("name", ["vsa-cuda", "vsa-triton", "flashinfer-bsr", "flashinfer-varblock"])
def test_backends_answer_with_reasons(name):
    """Registered; ``check`` answers (ok, reason) and never raises, whatever is installed."""
    b = get_backend(name)
    mask = make_mask("block_sparse", 1024, block=64, density=0.5, patterns=1)
    ok, why = b.check(Problem(mask, heads_q=4, heads_kv=2, head_dim=128, dtype=torch.bfloat16))
    assert isinstance(ok, bool) and (ok or why)
    if not torch.cuda.is_available():
        assert not ok


def test_flashinfer_is_forward_only():
    b = get_backend("flashinfer-varblock")
    mask = make_mask("varblock_sparse", 1024, block=256, min_block=128, density=0.5)
    ok, why = b.check(Problem(mask, heads_q=2, heads_kv=2, head_dim=128, dtype=torch.bfloat16, mode="bwd"))
    assert not ok and why


def test_vsa_scale_and_dtype_reasons():
    b = get_backend("vsa-triton")
    mask = make_mask("block_sparse", 1024, block=64, density=0.5)
    ok, why = b.supports(Problem(mask, heads_q=2, heads_kv=2, head_dim=128, dtype=torch.float16))
    assert not ok and "float16" in why
    ok, why = b.supports(Problem(mask, heads_q=2, heads_kv=2, head_dim=128, dtype=torch.bfloat16, softmax_scale=0.5))
    assert not ok and ("scale" in why or "CUDA" in why)

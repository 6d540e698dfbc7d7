"""Numerics of the Gluon kernels on an sm_90 GPU (``-m gpu``; the CPU interpreter cannot run Gluon).

bf16 at awkward sizes against a float32 reference (the chunked reference, TF32 off): random
overlapping ``RangeMask``s with fully masked rows, ``Sq != Sk``, GQA, every static mask, head dims
64 and 128 and the padded ones (80, 96, 192/128, 256: the forward on power-of-two tiles, the
plain-Triton backward, which those dims get automatically), the split ones (``split_d``: 80, 96,
96/128, 128/96, 192/128 as two exact power-of-two pieces per operand), both ping-pong settings, 64- and
128-row key tiles, fwd and bwd (every ``bwd_design``: the Gluon dQ and dK/dV kernels, the Gluon dQ
kernel with the plain-Triton dK/dV kernel, and the plain-Triton backward). The bar is PyTorch's own bf16 attention on the
same inputs (SDPA with the boolean mask): our error must stay within 2x of its error (plus 1e-3
for cases where PyTorch is near-exact). Rows that attend nothing must be exactly 0 with lse -inf.
"""

import pytest
import torch
import torch.nn.functional as F
from utils import random_range_mask, small_mask

import longca_triton as lt
from longca_triton.masks import STATIC_MASK_NAMES
from longca_triton.reference import chunked_attention

pytestmark = pytest.mark.gpu


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")


def _rel(x, ref, rows=None):
    x, ref = x.float(), ref.float()
    if rows is not None:
        x, ref = x[:, rows], ref[:, rows]
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _check(mask, Hq, Hkv, D, config=None, seed=0, Dv=None, B=1):
    from longca_triton.kernels.gluon.op import gluon_attention

    torch.backends.cuda.matmul.allow_tf32 = False
    sq, sk = mask.seqlen_q, mask.seqlen_k
    Dv = D if Dv is None else Dv
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, sq, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, sk, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, sk, Hkv, Dv, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(B, sq, Hq, Dv, device="cuda", dtype=torch.bfloat16, generator=g)

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = gluon_attention(qg, kg, vg, mask, return_lse=True, config=config)
    out.backward(dout)
    assert out.shape == (B, sq, Hq, Dv)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()

    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    ref, ref_lse = chunked_attention(q32, k32, v32, mask, return_lse=True, chunk=1024)
    ref.backward(dout.float())

    dense = mask.to_dense().cuda()  # [Sq, Sk] bool (small sizes only)
    rows = dense.any(1)
    # PyTorch's bf16 attention on the same inputs: the bar (rows with nothing allowed excluded)
    G = Hq // Hkv
    qt, kt, vt = (t.detach().clone().transpose(1, 2).requires_grad_() for t in
                  (q, k.repeat_interleave(G, 2), v.repeat_interleave(G, 2)))
    pt = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=dense)  # [B, Hq, Sq, Dv]
    pt.backward(dout.transpose(1, 2))
    pt = pt.transpose(1, 2)

    assert torch.all(out[:, ~rows] == 0), "rows that attend nothing must be 0"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "lse -inf pattern"
    fin = torch.isfinite(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max().item() <= 2e-2
    bar = _rel(pt, ref, rows)
    err = _rel(out, ref, rows)
    assert err <= 2 * bar + 1e-3, f"out rel err {err:.2e} vs PyTorch bf16 {bar:.2e}"
    # gradients (the Gluon backward, or the plain-Triton one with bwd_design="plain")
    for name, x, r in (("dq", qg.grad, q32.grad), ("dk", kg.grad, k32.grad), ("dv", vg.grad, v32.grad)):
        e = _rel(x, r)
        assert e <= 5e-2, f"{name} rel err {e:.2e}"
    return err, bar


RANDOM = [(1000, 1000, 0), (777, 2049, 1), (2048, 300, 2), (129, 4000, 3)]


#: the backward designs: the defaults (at D = 128 the mixed one: the Gluon dQ kernel and the plain-Triton
#: dK/dV kernel; at D = 64 the plain-Triton one), the mixed one at D = 64 too, the plain-Triton backward
#: under the Gluon forward and the Gluon split one: every numerics case runs with each
DESIGNS = {"default": {}, "mixed": dict(bwd_design="mixed"), "plain": dict(bwd_design="plain"),
           "split": dict(bwd_design="split")}


@needs_sm90
@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D={d}")
@pytest.mark.parametrize("sq,sk,seed", RANDOM, ids=[f"Sq={a}-Sk={b}" for a, b, _ in RANDOM])
def test_random_overlapping_masks(sq, sk, seed, D, design):
    mask = random_range_mask(sq, sk, seed, n_slices=6)
    _check(mask, 8, 2, D, config=DESIGNS[design], seed=seed)


PADDED = [(80, 80), (96, 96), (192, 128), (256, 256)]


@needs_sm90
@pytest.mark.parametrize("D,Dv", PADDED, ids=lambda d: str(d))
@pytest.mark.parametrize("sq,sk,seed", RANDOM, ids=[f"Sq={a}-Sk={b}" for a, b, _ in RANDOM])
def test_padded_head_dims(sq, sk, seed, D, Dv):
    """The forward on padded power-of-two tiles (zero-filled loads, clipped stores), GQA, Sq != Sk;
    the backward is the plain-Triton one (bwd_design "plain" at these dims)."""
    mask = random_range_mask(sq, sk, seed, n_slices=6)
    _check(mask, 8, 2, D, seed=seed, Dv=Dv)


@needs_sm90
@pytest.mark.parametrize("D,Dv,config", [(192, 128, dict(num_stages=1, BLOCK_N=128)),
                                         (256, 256, dict(num_stages=1)), (96, 96, dict(BLOCK_N=64)),
                                         (64, 128, None), (256, 64, None)], ids=str)
def test_padded_head_dims_configs(D, Dv, config):
    """Other rings and key tiles at padded dims; D_v wider than D_qk (O by the masked pointer store)."""
    _check(random_range_mask(1500, 1700, seed=5, n_slices=6), 4, 2, D, config=config, Dv=Dv)


SPLIT = [(80, 80), (96, 96)]


@needs_sm90
@pytest.mark.parametrize("D,Dv", SPLIT, ids=lambda d: str(d))
@pytest.mark.parametrize("sq,sk,seed", RANDOM, ids=[f"Sq={a}-Sk={b}" for a, b, _ in RANDOM])
def test_split_head_dims(sq, sk, seed, D, Dv):
    """``split_d``: Q, K, V, O as two exact pieces (80 = 64 + 16, 96 = 64 + 32: two descriptors
    each, S = Q0 K0^T + Q1 K1^T, O0 = P V0 and O1 = P V1, two TMA stores), GQA, Sq != Sk, rows
    that attend nothing; the backward is the plain-Triton one."""
    mask = random_range_mask(sq, sk, seed, n_slices=6)
    _check(mask, 8, 2, D, config=dict(split_d=True), seed=seed, Dv=Dv)


@needs_sm90
@pytest.mark.parametrize("D,Dv,config", [
    (96, 96, dict(num_stages=4)), (80, 80, dict(num_stages=5)), (96, 96, dict(BLOCK_N=64, num_stages=4)),
    (80, 80, dict(BLOCK_N=64)), (96, 96, dict(pingpong=True, num_stages=2)), (96, 96, dict(num_stages=1)),
    # one operand splits, the other is one tile: Q K^T only (O by the pointer store), P V only
    (96, 128, None), (128, 96, None),
    # 192 as 128 + 64 (instead of a 256-wide tile with a zero quarter), D_v 128 one tile
    (192, 128, None), (160, 160, None), (48, 48, None),
    # three consumers with register P, each P V finished before its S (pv_sync; D = 96's default on
    # dense masks), with ping-pong, and the row sums by the tensor cores
    (96, 96, dict(consumers=3, pv_sync=True)), (80, 80, dict(consumers=3, pv_sync=True)),
    (96, 96, dict(consumers=3, pv_sync=True, pingpong=True)),
    (96, 96, dict(consumers=3, pv_sync=True, rowsum_mma=True)),
], ids=str)
def test_split_head_dims_configs(D, Dv, config):
    """Deeper rings (the split tiles need less shared memory), 64-row key tiles, ping-pong, one
    stage; mixed split / power-of-two operands; the other dims that split."""
    _check(random_range_mask(1500, 1700, seed=5, n_slices=6), 4, 2, D, config=dict(config or {}, split_d=True),
           Dv=Dv)


@needs_sm90
@pytest.mark.parametrize("D,Dv", [(96, 96), (80, 80), (96, 128)], ids=str)
def test_split_head_dims_fp32_partial_output(D, Dv):
    """The float32 partial output through the pointer store, one store per piece (columns D0..)."""
    from longca_triton.kernels.gluon.config import resolve_config
    from longca_triton.kernels.gluon.op import gluon_fwd
    from longca_triton.kernels.gluon.plan import get_ws_plan

    mask = random_range_mask(700, 900, seed=2, n_slices=6)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(1, n, 4, D, device="cuda", dtype=torch.bfloat16, generator=g) for n in (700, 900))
    v = torch.randn(1, 900, 4, Dv, device="cuda", dtype=torch.bfloat16, generator=g)
    cfg = resolve_config(D, torch.bfloat16, dict(split_d=True), head_dim_v=Dv)
    plan = get_ws_plan(mask, 128, cfg["BLOCK_N"], "cuda")
    out, lse = gluon_fwd(q, k, v, plan, D ** -0.5, cfg, out_dtype=torch.float32)
    ref = chunked_attention(q.float(), k.float(), v.float(), mask, chunk=1024)
    rows = mask.to_dense().cuda().any(1)
    assert out.dtype == torch.float32 and out.shape == (1, 700, 4, Dv)
    assert torch.all(out[:, ~rows] == 0)
    assert _rel(out, ref, rows) <= 2e-2


@needs_sm90
def test_split_matches_padded():
    """The split forward and the padded one compute the same sums in another order: close to each
    other (bf16 output rounding apart), on every static mask at D = 96."""
    from longca_triton.kernels.gluon.op import gluon_attention

    for name in STATIC_MASK_NAMES:
        mask = small_mask(name, 1500, seed=7)
        g = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (torch.randn(1, 1500, h, 96, device="cuda", dtype=torch.bfloat16, generator=g)
                   for h in (8, 2, 2))
        a, la = gluon_attention(q, k, v, mask, return_lse=True)
        b, lb = gluon_attention(q, k, v, mask, return_lse=True, config=dict(split_d=True))
        assert torch.equal(torch.isinf(la), torch.isinf(lb)), name
        fin = torch.isfinite(la)
        assert (la[fin] - lb[fin]).abs().max().item() <= 1e-4, name
        assert _rel(b, a) <= 1e-2, name


@needs_sm90
def test_padded_head_dims_fp32_partial_output():
    """The float32 partial output (context parallelism) through the pointer store, masked columns."""
    from longca_triton.kernels.gluon.config import resolve_config
    from longca_triton.kernels.gluon.op import gluon_fwd
    from longca_triton.kernels.gluon.plan import get_ws_plan

    mask = random_range_mask(700, 900, seed=2, n_slices=6)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(1, n, 4, 192, device="cuda", dtype=torch.bfloat16, generator=g) for n in (700, 900))
    v = torch.randn(1, 900, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    cfg = resolve_config(192, torch.bfloat16, head_dim_v=128)
    plan = get_ws_plan(mask, 128, cfg["BLOCK_N"], "cuda")
    out, lse = gluon_fwd(q, k, v, plan, 192 ** -0.5, cfg, out_dtype=torch.float32)
    ref = chunked_attention(q.float(), k.float(), v.float(), mask, chunk=1024)
    rows = mask.to_dense().cuda().any(1)
    assert out.dtype == torch.float32 and out.shape == (1, 700, 4, 128)
    assert _rel(out, ref, rows) <= 2e-2


@needs_sm90
@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("name", STATIC_MASK_NAMES)
def test_static_masks_gqa(name, design):
    _check(small_mask(name, 3001, seed=7), 8, 2, 128, config=DESIGNS[design])


#: the persistent forward (one CTA per SM walking the tiles, whole-tensor descriptors, the next tile's
#: Q and K/V loaded while a tile's epilogue runs): O staged in Q's buffers or in its own, 2 or 3
#: consumers, ping-pong, 64-row key tiles, the split and padded head dims, two batches whose rows
#: the TMA must clip per batch (Sq = 3001 is not a multiple of the 128-row tile); 3001 x 8 heads x
#: 2 batches is 384 tiles, ~3 a CTA on an H100
PERSISTENT = [(128, 128, dict(persistent=True)), (128, 128, dict(persistent=True, o_own=True, num_stages=2)),
              (128, 128, dict(persistent=True, consumers=3, p_smem=True)),
              (128, 128, dict(persistent=True, pingpong=True, num_stages=2)),
              (128, 128, dict(persistent=True, BLOCK_N=64, o_own=True)),
              (64, 64, dict(persistent=True)), (64, 64, dict(persistent=True, consumers=2, o_own=True)),
              (96, 96, dict(persistent=True, split_d=True)), (96, 96, dict(persistent=True, o_own=True)),
              (192, 128, dict(persistent=True)), (256, 256, dict(persistent=True, o_own=True, num_stages=1)),
              # D = 96's dense default, and pv_sync on two consumers at D = 128
              (96, 96, dict(persistent=True, split_d=True, consumers=3, pv_sync=True, pingpong=True)),
              (128, 128, dict(pv_sync=True))]


@needs_sm90
@pytest.mark.parametrize("D,Dv,config", PERSISTENT,
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) if isinstance(c, dict) else str(c))
@pytest.mark.parametrize("name", ["random", "causal_document", "sliding_window_causal"])
def test_persistent_forward(name, D, Dv, config):
    mask = (random_range_mask(3001, 2500, seed=11, n_slices=6) if name == "random"
            else small_mask(name, 3001, seed=7))
    _check(mask, 8, 2, D, config=config, Dv=Dv, B=2)


@needs_sm90
def test_persistent_fp32_partial_output_and_equal_bits():
    """Persistent: the float32 partial output through the pointer store (two batches), and the same
    bits as the one-tile-a-CTA forward (the same sums in the same order, only the schedule moves)."""
    from longca_triton.kernels.gluon.config import resolve_config
    from longca_triton.kernels.gluon.op import gluon_attention, gluon_fwd
    from longca_triton.kernels.gluon.plan import get_ws_plan

    mask = random_range_mask(3001, 2500, seed=2, n_slices=6)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 3001, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 2500, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cfg = resolve_config(128, torch.bfloat16, dict(persistent=True))
    plan = get_ws_plan(mask, 128, cfg["BLOCK_N"], "cuda")
    out, lse = gluon_fwd(q, k, v, plan, 128 ** -0.5, cfg, out_dtype=torch.float32)
    ref = chunked_attention(q.float(), k.float(), v.float(), mask, chunk=1024)
    rows = mask.to_dense().cuda().any(1)
    assert out.dtype == torch.float32 and torch.all(out[:, ~rows] == 0)
    assert _rel(out, ref, rows) <= 2e-2
    for extra in ({}, dict(o_own=True, num_stages=2), dict(consumers=3, p_smem=True)):
        a, la = gluon_attention(q, k, v, mask, return_lse=True, config=dict(persistent=False, **extra))
        b, lb = gluon_attention(q, k, v, mask, return_lse=True, config=dict(persistent=True, **extra))
        assert torch.equal(a, b) and torch.equal(la, lb), extra


CONFIGS = [dict(pingpong=True, num_stages=2), dict(BLOCK_N=64, num_stages=3), dict(num_stages=1),
           dict(BLOCK_N=64, pingpong=True, num_stages=2), dict(bwd_design="plain"),
           dict(dkdv_block_mq=64), dict(dkdv_block_mq=32, bwd_design="split")]


@needs_sm90
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_configs(config):
    _check(random_range_mask(1500, 1700, seed=5, n_slices=6), 4, 4, 128, config=config)


#: the split launch (split_partial): the full tiles, then the partial tiles merged into them; the
#: D = 128 defaults (three consumers on dense masks, two persistent on the others), two persistent
#: consumers, D = 64 (three consumers), 96 on its padded tile
SPLIT_PARTIAL = [(128, {}), (128, dict(consumers=2, persistent=True, o_own=True, num_stages=2)), (64, {}),
                 (96, dict(split_d=False))]


@needs_sm90
@pytest.mark.parametrize("D,config", SPLIT_PARTIAL,
                         ids=lambda x: str(x) if isinstance(x, int) else "-".join(f"{k}={v}" for k, v in x.items()))
@pytest.mark.parametrize("name", ["random", "causal", "prefix_lm_causal", "sliding_window_causal", "causal_document"])
def test_split_partial_forward(name, D, config):
    """Two launches merge to the one-launch result: float32 reference, lse, rows with nothing allowed
    (0 and -inf), two batches, Sq = 3001 (ragged), GQA 8:2; random masks with several intervals a row."""
    mask = (random_range_mask(1500, 1700, seed=5, n_slices=6) if name == "random"
            else small_mask(name, 3001, seed=7))
    _check(mask, 8, 2, D, config=dict(split_partial=True, **config), B=2)


@needs_sm90
@pytest.mark.parametrize("D,config", SPLIT_PARTIAL,
                         ids=lambda x: str(x) if isinstance(x, int) else "-".join(f"{k}={v}" for k, v in x.items()))
@pytest.mark.parametrize("name", ["random", "causal", "prefix_lm_causal", "sliding_window_causal", "causal_document",
                                  "full_document"])
def test_mask_head_forward(name, D, config):
    """Each query tile's first partial key tile at the front of its walk, masked at step 0 without a
    branch (full tiles there too: the interval mask passes them whole), the others merged by a second
    launch: the same checks (random masks give several partial tiles a query tile, causal one)."""
    mask = (random_range_mask(1500, 1700, seed=5, n_slices=6) if name == "random"
            else small_mask(name, 3001, seed=7))
    _check(mask, 8, 2, D, config=dict(mask_head=1, **config), B=2)


def _head_case(name):
    """The masks of the head-plan tests: random multi-interval (several partial tiles a query tile),
    documents of 1-60 tokens (one-tile walks), Sk = 100 (one key tile), or a small static mask."""
    if name == "random":
        return random_range_mask(1500, 1700, seed=5, n_slices=6)
    if name == "tiny_documents":
        return lt.make_mask("causal_document", 1000, doc_lens=[37, 5, 60, 1] * 5 + [381, 104])
    if name == "one_key_tile":
        return random_range_mask(700, 100, seed=2, n_slices=3)
    return small_mask(name, 3001, seed=7)


#: mask_head=2 is for two consumers (three spill): one tile a CTA and persistent, D = 128 / 64 / 96
MASK_HEAD2 = [(128, dict(consumers=2)), (128, dict(consumers=2, persistent=True, o_own=True, num_stages=2)),
              (64, dict(consumers=2, persistent=True, o_own=True)), (96, dict(consumers=2, split_d=False)),
              # D = 64's sparse-mask default (three persistent consumers, rowsum_mma) with two masked steps
              (64, dict(persistent=True, o_own=True, rowsum_mma=True)),
              # D = 96's sparse-mask default (two persistent consumers on the padded tile)
              (96, dict(split_d=False, persistent=True, o_own=True))]


@needs_sm90
@pytest.mark.parametrize("D,config", MASK_HEAD2,
                         ids=lambda x: str(x) if isinstance(x, int) else "-".join(f"{k}={v}" for k, v in x.items()))
@pytest.mark.parametrize("name", ["random", "causal", "sliding_window_causal", "causal_document", "full_document",
                                  "share_question", "tiny_documents", "one_key_tile"])
def test_mask_head2_forward(name, D, config):
    """Each query tile's first two partial key tiles at the front, both masked without a branch (step
    1 peeled out of the loop); a query tile that walks one key tile walks a fully masked neighbour too
    (tiny documents; Sk = 100: one key tile, the pad past the keys, zero-filled by the TMA); the rest
    merged by the second launch (random, share_question: more than two a tile)."""
    _check(_head_case(name), 8, 2, D, config=dict(mask_head=2, **config), B=2)


@needs_sm90
@pytest.mark.parametrize("design", ["mixed", "split"])
@pytest.mark.parametrize("name", ["causal", "prefix_lm_causal", "random", "tiny_documents", "one_key_tile"])
def test_dq_mask_head(name, design):
    """D = 128's dQ kernel: its first (up to two) steps masked without a branch where no query tile has
    more partial tiles (causal and prefix_lm_causal: two 64-key tiles; Sk = 100: one), the merged plan
    elsewhere (random masks and tiny documents have more); the same checks as every backward."""
    _check(_head_case(name), 8, 2, 128, config=dict(bwd_design=design), B=2)


#: rowsum_mma on the defaults' shapes: two consumers, three with P in shared memory, persistent with
#: two masked head steps, the split launch (its merging second half), split D = 96, D = 64
ROWSUM = [(128, {}), (128, dict(consumers=3, p_smem=True)),
          (128, dict(consumers=2, persistent=True, o_own=True, num_stages=2, mask_head=2)),
          (128, dict(split_partial=True, mask_head=0)), (96, dict(split_d=True)), (64, {}),
          (96, dict(split_d=False, consumers=2, persistent=True, o_own=True)),
          (64, dict(persistent=True, o_own=True))]


@needs_sm90
@pytest.mark.parametrize("D,config", ROWSUM,
                         ids=lambda x: str(x) if isinstance(x, int) else "-".join(f"{k}={v}" for k, v in x.items()))
@pytest.mark.parametrize("name", ["random", "causal", "sliding_window_causal", "full_document"])
def test_rowsum_mma_forward(name, D, config):
    """The row sums by one more wgmma against a block of ones (``rowsum_mma``): the same checks as
    every forward (float32 reference, lse, rows with nothing allowed giving 0 and -inf, B = 2, GQA,
    Sq = 3001)."""
    mask = (random_range_mask(1500, 1700, seed=5, n_slices=6) if name == "random"
            else small_mask(name, 3001, seed=7))
    _check(mask, 8, 2, D, config=dict(rowsum_mma=True, **config), B=2)


@needs_sm90
@pytest.mark.parametrize("design", DESIGNS)
def test_long_causal_document_mha(design):
    _check(small_mask("causal_document", 8192, seed=3), 4, 4, 128, config=DESIGNS[design])


@needs_sm90
@pytest.mark.parametrize("design", ["split", "mixed"])
def test_deterministic_backward_is_bitwise(design):
    """The Gluon designs write every gradient tile once: gradients bitwise identical run to run."""
    from longca_triton.kernels.gluon.op import gluon_attention

    mask = random_range_mask(1000, 1000, seed=2, n_slices=6)
    q, k, v = (torch.randn(1, 1000, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    grads = []
    for _ in range(2):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        gluon_attention(qg, kg, vg, mask, config=DESIGNS[design], deterministic=True).sum().backward()
        grads.append((qg.grad, kg.grad, vg.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
def test_mixed_batches_match_split(D):
    """B = 2, GQA 6:2: the mixed design hands the Gluon dQ kernel's inputs (heads of a group contiguous)
    to the plain-Triton dK/dV kernel (the other cases have B = 1). Its gradients equal the split
    design's to bf16 accuracy."""
    from longca_triton.kernels.gluon.op import gluon_attention

    mask = random_range_mask(900, 1100, seed=4, n_slices=6)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 900, 6, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 1100, 2, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    dout = torch.randn(2, 900, 6, D, device="cuda", dtype=torch.bfloat16, generator=g)
    grads = []
    for cfg in (DESIGNS["split"], DESIGNS["mixed"]):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        gluon_attention(qg, kg, vg, mask, config=cfg).backward(dout)
        grads.append((qg.grad, kg.grad, vg.grad))
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert torch.isfinite(b).all(), name
        assert _rel(b, a) <= 1e-2, f"{name}: mixed vs split rel {_rel(b, a):.2e}"


@needs_sm90
@pytest.mark.parametrize("D,Dv,config", [(64, 64, {}), (64, 64, dict(pingpong=True)), (48, 48, {}),
                                         (128, 128, dict(consumers=3, BLOCK_N=64, num_stages=4)),
                                         (96, 96, dict(consumers=3, split_d=True, BLOCK_N=64, num_stages=4)),
                                         # P through shared memory (p_smem: the D = 128 default on dense
                                         # masks), with three consumers, two, and a split head dim
                                         (128, 128, dict(consumers=3, p_smem=True)),
                                         (128, 128, dict(consumers=2, p_smem=True)),
                                         (64, 64, dict(p_smem=True)),
                                         (96, 96, dict(consumers=3, split_d=True, p_smem=True, pingpong=True))],
                         ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else str(x))
@pytest.mark.parametrize("sq,sk,seed", RANDOM, ids=[f"Sq={a}-Sk={b}" for a, b, _ in RANDOM])
def test_three_consumers(sq, sk, seed, D, Dv, config):
    """Three consumer warpgroups (a 192-row query tile: the default at D = 64, asked for elsewhere):
    query lengths that are no multiple of 192, GQA, empty rows, against float32."""
    _check(random_range_mask(sq, sk, seed=seed), 4, 2, D, Dv=Dv, config=config)


@needs_sm90
@pytest.mark.parametrize("D,config", [(64, None), (128, dict(consumers=3, p_smem=True))],
                         ids=["D=64", "D=128-consumers=3-p_smem"])
def test_three_consumers_fp32_partial_output(D, config):
    """Three consumers with a float32 output (the CP step's partials: the masked pointer store), P in
    registers (D = 64's default) and through shared memory."""
    from longca_triton.kernels.gluon.config import fwd_block_m, resolve_config
    from longca_triton.kernels.gluon.op import gluon_fwd
    from longca_triton.kernels.gluon.plan import get_ws_plan

    mask = random_range_mask(900, 700, seed=7, n_slices=6)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 900, 4, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, 700, 2, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cfg = resolve_config(D, torch.bfloat16, config)
    assert cfg["consumers"] == 3
    plan = get_ws_plan(mask, fwd_block_m(cfg), cfg["BLOCK_N"], "cuda")
    out, lse = gluon_fwd(q, k, v, plan, D ** -0.5, cfg, out_dtype=torch.float32)
    ref = chunked_attention(q.float(), k.float(), v.float(), mask, chunk=1024)
    rows = mask.to_dense().cuda().any(1)
    assert out.dtype == torch.float32 and not torch.isnan(out).any()
    assert _rel(out, ref, rows) <= 2e-2

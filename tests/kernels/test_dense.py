"""Correctness of the dense structured-mask Triton kernels (``longca_triton/kernels/dense``) on the CPU.

Runs the kernels in Triton's interpreter in float32 and float16, and compares out, lse, dq, dk, dv with
the float64 naive reference for all 12 static masks at awkward sizes, GQA 4:1 and 1:1, head dims 32/64,
fully masked rows, random ``RangeMask``s, non-contiguous inputs, an lse gradient and the custom op; the
backward's variants (row-major dK/dV sweeps, the skewed dQ, dQ on a second stream) and
``deterministic=True``. The configs themselves: ``test_dense_config.py``.
"""

import pytest
import torch
from utils import (
    DEVICE,
    ODD_CONFIG,
    compare_to_reference,
    fake_side_stream,
    needs_triton,
    random_range_mask,
    small_mask,
    spy_launches,
)

import longca_triton as lt
import longca_triton.kernels.dense.op as D

from longca_triton.kernels.dense.op import (
    CONFIG_KEYS,
    dense_attention,
    dense_attention_op,
    default_config,
    resolve_config,
)
from longca_triton.masks import STATIC_MASK_NAMES, RangeMask, make_mask
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




# ------------------------------------------------------------------ layouts, lse grad, the custom op
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


# ------------------------------------------------------------------ row-major dK/dV sweeps
SWEEPS = [
    # (S, Hq, Hkv, D, dtype, mask, dkdv_sweep): GQA groups of 1, 2 and 4 heads, tiles cut by S
    (17, 4, 1, 32, torch.float32, "causal", 2),
    (239, 4, 1, 32, torch.float32, "causal_document", 1),
    (239, 4, 2, 32, torch.float32, "causal_document", 2),
    (150, 2, 2, 64, torch.float16, "share_question", 2),
    (150, 4, 1, 32, torch.float16, "global_sliding_window", 1),
    (130, 4, 2, 64, torch.float32, "full", 2),
]


@pytest.mark.parametrize("S,Hq,Hkv,D,dtype,name,sweep", [
    pytest.param(*c, id=f"S={c[0]}-Hq={c[1]}-Hkv={c[2]}-D={c[3]}-{str(c[4])[6:]}-{c[5]}-sweep{c[6]}") for c in SWEEPS])
def test_dkdv_sweep_static_masks(S, Hq, Hkv, D, dtype, name, sweep):
    run_and_compare(small_mask(name, S, seed=S), 1, Hq, Hkv, D, dtype, config=dict(dkdv_sweep=sweep))


@pytest.mark.parametrize("sweep", [1, 2], ids=["sweep1", "sweep2"])
def test_dkdv_sweep_empty_rows_and_padded_dims(sweep):
    """Sq != Sk with fully masked rows, uneven tiles, an lse gradient, D_qk 40 / D_v 24 (the 3-d
    descriptors' padded head-dim columns must read zero, not the next head's)."""
    mask = random_range_mask(100, 37, 1)
    assert (~mask.to_dense().any(1)).any()
    compare_to_reference(lambda q, k, v: dense_attention(q, k, v, mask, return_lse=True,
                                                         config=dict(dkdv_sweep=sweep, **ODD_CONFIG)),
                         mask, 100, 37, 1, 4, 2, 40, torch.float32, dlse=True, dv=24)


@pytest.mark.parametrize("sweep", [0, 1, 2])
def test_dkdv_sweep_reaches_the_kernel(sweep, monkeypatch):
    seen = spy_launches(monkeypatch, D, "dense_bwd_dkdv_kernel", "SWEEP")
    mask = small_mask("causal", 64)
    q, k, v = (torch.randn(1, 64, h, 32, requires_grad=True) for h in (4, 2, 2))
    dense_attention(q, k, v, mask, config={"dkdv_sweep": sweep}).sum().backward()
    assert seen == [sweep]


# ------------------------------------------------------------------ dQ GEMM one step late (dq_skew)
@pytest.mark.parametrize("name,S,Hq,Hkv,dtype", [
    ("causal_document", 150, 4, 2, torch.float32), ("sliding_window", 137, 4, 1, torch.float16),
    ("full", 70, 2, 2, torch.float32), ("prefix_lm_causal", 96, 4, 2, torch.float16)],
    ids=["S=150-Hq=4-Hkv=2-fp32-causal_document", "S=137-Hq=4-Hkv=1-fp16-sliding_window", "S=70-Hq=2-Hkv=2-fp32-full",
         "S=96-Hq=4-Hkv=2-fp16-prefix_lm_causal"])
def test_dq_skew_gradients(name, S, Hq, Hkv, dtype):
    """``dq_skew``: every dQ step adds the previous step's ``dS K`` (its runs chained: full runs, then
    partial runs), the last one after the runs; against float64, with an lse gradient."""
    mask = make_mask(name, S, seed=1)
    compare_to_reference(lambda q, k, v: dense_attention(q, k, v, mask, return_lse=True, config={"dq_skew": True}),
                         mask, S, S, 1, Hq, Hkv, 32, dtype, dlse=True)


def test_dq_skew_same_bits_and_rows_that_see_nothing(monkeypatch):
    """The skewed dQ adds the same products in the same order (plus one ``0 * K``): the plain loop's bits;
    query rows that see no key get dQ = 0, not a carried step's ``dS K``; the flag reaches the kernel."""
    seen = spy_launches(monkeypatch, D, "dense_bwd_dq_kernel", "SKEW")
    S = 100
    # rows [0, 60) see keys [0, 40) (one partial 32-key tile: the partial run follows a full one), rows
    # [60, 100) see nothing
    mask = RangeMask(S, S, [(0, 60, 0, 40, "full")], name="first_rows_only")
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, S, h, 32, generator=g) for h in (4, 2, 2, 4))
    grads = []
    for skew in (False, True):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        dense_attention(qq, kk, vv, mask, config={"dq_skew": skew}).backward(do)
        grads.append([t.grad for t in (qq, kk, vv)])
    assert seen == [False, True]
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert torch.count_nonzero(grads[1][0][:, 60:]) == 0 and torch.count_nonzero(grads[1][0][:, :60]) > 0


# ------------------------------------------------------------------ bwd_streams: dQ beside dK/dV
class _RecordBeside:
    """A kernel stand-in appending ``(name, launched beside)`` to ``events`` (``utils.fake_side_stream``)."""

    def __init__(self, name, events, state):
        self.name, self.events, self.state = name, events, state

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.events.append((self.name, self.state["beside"]))


@pytest.mark.parametrize("on", [False, True], ids=["one-stream", "bwd_streams"])
def test_bwd_streams_puts_the_dq_launch_beside_dkdv(on, monkeypatch):
    events: list = []
    fake, state = fake_side_stream(events)
    monkeypatch.setattr(D, "side_stream", fake)
    monkeypatch.setattr(D, "dense_bwd_dkdv_kernel", _RecordBeside("dkdv", events, state))
    monkeypatch.setattr(D, "dense_bwd_dq_kernel", _RecordBeside("dq", events, state))
    q, k, v, out, do = (torch.randn(1, 96, h, 32) for h in (4, 2, 2, 4, 4))
    mask = small_mask("causal", 96)
    cfg = resolve_config(32, torch.float32, {"bwd_streams": on})
    plans = D.plans_for(mask, cfg, "cpu")
    D.dense_bwd(do, q, k, v, out, torch.zeros(1, 4, 96), plans[1], plans[2], 32 ** -0.5, cfg)
    assert events == [("side_stream", on), ("dkdv", False), ("dq", True)]


def test_bwd_streams_gradients_match_the_reference():
    """The whole backward with ``bwd_streams`` on (in order on the CPU) against float64."""
    run_and_compare(small_mask("causal_document", 150, seed=4), 1, 4, 2, 32, torch.float32,
                    config={"bwd_streams": True})


# ------------------------------------------------------------------ deterministic
def _grads(q, k, v, mask, **kw):
    """dq, dk, dv of one fresh forward + backward (new leaves, same values)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = dense_attention(q, k, v, mask, **kw)
    g = torch.Generator(device=out.device).manual_seed(7)
    out.backward(torch.randn(out.shape, generator=g, device=out.device, dtype=out.dtype))
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("config", [None, {"dkdv_sweep": 2, "dq_skew": True}], ids=["defaults", "sweep2-dq_skew"])
def test_deterministic_gives_equal_bits_twice(config):
    mask = small_mask("causal_document", 130, seed=2)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 130, h, 32, device=DEVICE) for h in (4, 2, 2))
    first = _grads(q, k, v, mask, config=config, deterministic=True)
    second = _grads(q, k, v, mask, config=config, deterministic=True)
    for name, a, b in zip("qkv", first, second):
        assert a.abs().sum() > 0, f"d{name} is all zero: nothing was checked"
        assert torch.equal(a, b), f"d{name} differs between two deterministic runs"


def test_api_passes_deterministic_to_the_kernel(monkeypatch):
    seen = []
    real = D.dense_attention

    def spy(*a, deterministic=False, **kw):
        seen.append(deterministic)
        return real(*a, deterministic=deterministic, **kw)

    monkeypatch.setattr(D, "dense_attention", spy)
    mask = small_mask("causal", 40)
    q, k, v = (torch.randn(1, 40, h, 32, device=DEVICE) for h in (2, 1, 1))
    lt.attention(q, k, v, mask, backend="triton", deterministic=True)
    lt.attention(q, k, v, mask, backend="triton")
    lt.attention(q, k, v, mask, deterministic=True)  # no backend named: triton for range masks
    assert seen == [True, False, True]

"""Correctness of the FlashMask Triton kernels (``longca_triton/kernels/flashmask/op.py``) on the CPU.

Runs the kernels in Triton's interpreter (float32 and float16) and compares out, lse, dq, dk, dv
with the float64 naive reference: all 12 static masks at awkward sizes, GQA 4:1 and 1:1, head
dims 32/64, random expressible ``RangeMask``s and raw random ``FlashMaskColumns``, fully masked
rows, an lse gradient, uneven tiles, strided inputs. The run-time tile classification (the
kernels' own ``_classify``) is checked against a NumPy mirror of FlashMask's rule and against
the dense mask: a FULL tile allows every pair, an EMPTY tile none. Helpers and tolerances come
from ``tests/utils.py``.
"""

import numpy as np
import pytest
import torch
from utils import DEVICE, compare_to_reference, needs_triton, random_range_mask, small_mask, spy_launches

import longca_triton as lt
from longca_triton.adapters import Problem, get_backend
from longca_triton.kernels.flashmask.op import (
    CONFIG_KEYS,
    EMPTY,
    FULL,
    PARTIAL,
    classify_tiles,
    flashmask_attention,
    flashmask_plan,
    resolve_config,
    tile_bounds,
)
from longca_triton.masks import (
    STATIC_MASK_NAMES,
    FlashMaskColumns,
    NotExpressible,
    RangeMask,
    flashmask_columns,
    make_mask,
)
from longca_triton.reference.naive import naive_attention

pytestmark = needs_triton

BACKEND = "triton-flashmask"
SMALL = dict(BLOCK_M=16, BLOCK_N=16, DKDV_BLOCK_M=16, DKDV_BLOCK_N=16, DQ_BLOCK_M=16, DQ_BLOCK_N=16)


class _DenseMask:
    """What ``naive_attention`` reads of a range mask (``to_dense``), for raw columns."""

    def __init__(self, allowed: torch.Tensor):
        self.allowed = allowed

    def to_dense(self) -> torch.Tensor:
        return self.allowed


def expressible(mask) -> bool:
    try:
        flashmask_columns(mask)
        return True
    except NotExpressible:
        return False


def run_and_compare(mask, B, Hq, Hkv, D, dtype, *, sq=None, config=None, seed=0, layout="bshd",
                    dlse=False):
    """``mask`` is a RangeMask or FlashMaskColumns (then ``sq`` gives Sq)."""
    if isinstance(mask, FlashMaskColumns):
        sk = len(mask.lts)
        ref_mask = _DenseMask(mask.to_dense(sq))
    else:
        sq, sk = mask.seqlen_q, mask.seqlen_k
        ref_mask = mask
    return compare_to_reference(lambda q, k, v: flashmask_attention(q, k, v, mask, return_lse=True, config=config),
                                ref_mask, sq, sk, B, Hq, Hkv, D, dtype, seed=seed, layout=layout, dlse=dlse)


def assert_unsupported(mask, Hq=4, Hkv=1, D=32):
    ok, why = get_backend(BACKEND).supports(Problem(mask=mask, heads_q=Hq, heads_kv=Hkv, head_dim=D,
                                                    dtype=torch.float32, device=DEVICE))
    assert not ok and "not expressible as FlashMask columns" in why
    q = torch.randn(1, mask.seqlen_q, Hq, D)
    k = torch.randn(1, mask.seqlen_k, Hkv, D)
    with pytest.raises(NotExpressible):
        flashmask_attention(q, k, k, mask)


# ------------------------------------------------------------------ all 12 static masks
def _id(S, Hq, Hkv, D, dtype, name):
    return f"S={S}-Hq={Hq}-Hkv={Hkv}-D={D}-{'fp32' if dtype == torch.float32 else 'fp16'}-{name}"


STATIC = [(1, 4, 1, 32, torch.float32), (17, 4, 2, 64, torch.float32),
          (239, 4, 1, 32, torch.float32), (300, 2, 2, 64, torch.float16)]
CASES = [pytest.param(*c, name, id=_id(*c, name)) for c in STATIC for name in STATIC_MASK_NAMES]
#: S=239 runs on uneven tiles and S=300 on 64 x 64 ones (fewer tiles: the interpreter's time
#: goes per tile); the pinned 32 x 32 default runs at the other sizes
MIXED = dict(BLOCK_M=64, BLOCK_N=32, DKDV_BLOCK_M=32, DKDV_BLOCK_N=64, DQ_BLOCK_M=64, DQ_BLOCK_N=32)
BIG = dict(BLOCK_M=64, BLOCK_N=64, DKDV_BLOCK_M=64, DKDV_BLOCK_N=64, DQ_BLOCK_M=64, DQ_BLOCK_N=64)


@pytest.mark.parametrize("S,Hq,Hkv,D,dtype,name", CASES)
def test_static_masks(S, Hq, Hkv, D, dtype, name):
    mask = small_mask(name, S, seed=S)
    if not expressible(mask):
        assert_unsupported(mask)
        return
    run_and_compare(mask, 1, Hq, Hkv, D, dtype, config={239: MIXED, 300: BIG}.get(S))


# ------------------------------------------------------------------ random masks, empty rows
def _first_seed(sq, sk, want: bool, start=0):
    """The first seed whose random mask is (or, ``want=False``, is not) FlashMask-expressible."""
    return next(s for s in range(start, start + 200) if expressible(random_range_mask(sq, sk, s)) == want)


RANDOM = [(64, 64), (100, 37), (45, 130), (239, 239)]


@pytest.mark.parametrize("sq,sk", RANDOM, ids=[f"Sq={a}-Sk={b}" for a, b in RANDOM])
def test_random_range_masks(sq, sk):
    seed = _first_seed(sq, sk, True)
    mask = random_range_mask(sq, sk, seed)
    empty = ~mask.to_dense().any(1)
    assert empty.any(), "the test wants fully masked rows"
    batch = 1 if sq * sk > 20000 else 2  # keeps the interpreter quick
    out, lse = run_and_compare(mask, batch, 4, 2, 32, torch.float32, seed=seed)
    assert torch.all(out[:, empty] == 0)
    assert torch.all(lse[:, :, empty] == float("-inf"))


def test_random_not_expressible_is_unsupported():
    mask = random_range_mask(64, 64, _first_seed(64, 64, False))
    assert_unsupported(mask)


def random_columns(sq, sk, seed) -> FlashMaskColumns:
    """Arbitrary column form: per column ``0 <= UTS <= UTE <= LTS <= LTE <= Sq`` at random."""
    rng = np.random.default_rng(seed)
    bounds = np.sort(rng.integers(0, sq + 1, size=(sk, 4)), axis=1).astype(np.int32)
    # some columns without an LT or a UT interval, a few fully masked ones
    no_lt, no_ut = rng.random(sk) < 0.2, rng.random(sk) < 0.2
    bounds[no_lt, 3] = bounds[no_lt, 2]
    bounds[no_ut, 1] = bounds[no_ut, 0]
    cols = FlashMaskColumns(lts=bounds[:, 2].copy(), lte=bounds[:, 3].copy(),
                            uts=bounds[:, 0].copy(), ute=bounds[:, 1].copy())
    full = rng.random(sk) < 0.1
    cols.uts[full], cols.ute[full] = 0, sq
    return cols


@pytest.mark.parametrize("sq,sk,dtype", [(77, 150, torch.float16), (150, 77, torch.float32)],
                         ids=["Sq=77-Sk=150-fp16", "Sq=150-Sk=77-fp32"])
def test_random_columns(sq, sk, dtype):
    run_and_compare(random_columns(sq, sk, seed=sq), 1, 2, 1, 64, dtype, sq=sq, config=SMALL)


def test_fully_masked_rows():
    # rows [0, 20) masked in every column (UT), rows [60, 64) too (LT): out 0, lse -inf there
    sk = 50
    cols = FlashMaskColumns(lts=np.full(sk, 60, np.int32), lte=np.full(sk, 64, np.int32),
                            uts=np.zeros(sk, np.int32), ute=np.arange(20, 20 + sk, dtype=np.int32))
    out, lse = run_and_compare(cols, 1, 2, 1, 32, torch.float32, sq=64, config=SMALL)
    assert torch.all(out[:, :20] == 0) and torch.all(out[:, 60:] == 0)
    assert torch.all(lse[:, :, :20] == float("-inf")) and torch.all(lse[:, :, 60:] == float("-inf"))
    assert torch.isfinite(lse[:, :, 20:60]).all()


def test_lower_interval_only():
    # anti-causal (j >= i): every column masks rows (j, Sq) through LT alone, so HAS_UT is off
    mask = RangeMask(100, 100, [(0, 100, 0, 100, "INVCAUSAL")], name="anticausal")
    plan = flashmask_plan(mask, 100, DEVICE)
    assert plan.has_lt and not plan.has_ut
    run_and_compare(mask, 1, 4, 2, 32, torch.float32, config=MIXED)



# ------------------------------------------------------------------ configs, layouts, lse grad

def test_non_contiguous_and_batch():
    run_and_compare(small_mask("prefix_lm_document", 77, seed=5), 2, 4, 1, 64, torch.float16,
                    layout="bhsd")


def test_lse_gradient():
    run_and_compare(small_mask("causal_blockwise", 90, seed=6), 1, 2, 1, 32, torch.float32,
                    dlse=True)


# ------------------------------------------------------------------ tile classification
def mirror_classify(cols: np.ndarray, sq: int, bm: int, bn: int) -> np.ndarray:
    """FlashMask's rule in NumPy, straight from the per-tile min/max of the column vectors."""
    lts, lte, uts, ute = cols.astype(np.int64)
    has_lt, has_ut = bool((lte > lts).any()), bool((ute > uts).any())
    sk = cols.shape[1]
    out = np.empty((-(-sq // bm), -(-sk // bn)), np.int8)
    for tm in range(out.shape[0]):
        m0, m1 = tm * bm, min(tm * bm + bm, sq)
        for tn in range(out.shape[1]):
            c = slice(tn * bn, tn * bn + bn)
            empty = (has_lt and m0 >= lts[c].max() and m1 <= lte[c].min()) or \
                    (has_ut and m0 >= uts[c].max() and m1 <= ute[c].min())
            touch = (tn + 1) * bn > sk or (has_lt and m1 > lts[c].min() and m0 < lte[c].max()) or \
                    (has_ut and m1 > uts[c].min() and m0 < ute[c].max())
            out[tm, tn] = EMPTY if empty else (PARTIAL if touch else FULL)
    return out


CLASSIFY = [(name, 239) for name in STATIC_MASK_NAMES] + [("random_columns", 150)]


@pytest.mark.parametrize("name,S", CLASSIFY, ids=[f"S={s}-{n}" for n, s in CLASSIFY])
def test_tile_classification(name, S):
    if name == "random_columns":
        cols = random_columns(S, S + 13, seed=1)
        dense = cols.to_dense(S)
    else:
        mask = small_mask(name, S, seed=S)
        cols, dense = flashmask_columns(mask), mask.to_dense()
    sq, sk = dense.shape
    plan = flashmask_plan(cols, sq, DEVICE)
    assert torch.equal(torch.as_tensor(FlashMaskColumns(*plan.cols.cpu().numpy()).to_dense(sq)), dense), \
        "normalised columns changed the mask"
    for bm, bn in ((16, 32), (32, 16), (32, 32)):
        got = classify_tiles(plan, bm, bn).cpu().numpy()
        assert np.array_equal(got, mirror_classify(plan.cols.cpu().numpy(), sq, bm, bn))
        for tm, tn in zip(*np.nonzero(got != PARTIAL)):
            tile = dense[tm * bm:(tm + 1) * bm, tn * bn:(tn + 1) * bn]
            if got[tm, tn] == FULL:
                assert tile.all() and (tn + 1) * bn <= sk, f"FULL tile ({tm}, {tn}) has masked pairs"
            else:
                assert not tile.any(), f"EMPTY tile ({tm}, {tn}) has allowed pairs"


def test_classification_is_exact_for_causal():
    S, B = 128, 32
    plan = flashmask_plan(make_mask("causal", S), S, DEVICE)
    got = classify_tiles(plan, B, B).cpu().numpy()
    tm, tn = np.indices(got.shape)
    expected = np.where(tn > tm, EMPTY, np.where(tn < tm, FULL, PARTIAL))
    assert np.array_equal(got, expected)
    assert not plan.has_lt and plan.has_ut  # causal is the UT interval [0, j) only
    full = flashmask_plan(make_mask("full", 100), 100, DEVICE)
    assert not full.has_lt and not full.has_ut
    # only the ragged last key tile needs a mask
    assert classify_tiles(full, 32, 32).cpu().numpy().tolist() == [[FULL, FULL, FULL, PARTIAL]] * 4


def test_tile_bounds():
    cols = torch.tensor(np.random.default_rng(0).integers(0, 50, size=(4, 37)), dtype=torch.int32)
    tb = tile_bounds(cols, 16)
    assert tb.shape == (3, 8) and tb.dtype == torch.int32
    for t in range(3):
        c = cols[:, t * 16:(t + 1) * 16]
        expect = torch.stack([c.amin(1), c.amax(1)], 1).reshape(8)
        assert torch.equal(tb[t], expect)


# ------------------------------------------------------------------ backend and validation
def test_backend_registered_and_supports():
    b = get_backend(BACKEND)
    assert "FlashMask" in b.description and b.available() == (True, "")
    assert b.check(Problem(mask=make_mask("causal", 64), heads_q=4, heads_kv=2, head_dim=64,
                           dtype=torch.float32, device=DEVICE, mode="fwd_bwd")) == (True, "")
    bs = make_mask("block_sparse", 128, block=32, density=0.5, patterns=1)
    ok, why = b.supports(Problem(mask=bs, head_dim=64, dtype=torch.float16, device=DEVICE))
    assert not ok and "block-sparse" in why
    assert b.supports(Problem(mask=make_mask("causal", 64), head_dim=100, dtype=torch.float16,
                              device=DEVICE)) == (True, "")  # no multiple of 8: zero-padded to 104 inside
    ok, why = b.supports(Problem(mask=make_mask("causal", 64), head_dim=300, dtype=torch.float16, device=DEVICE))
    assert not ok and "head_dim 300" in why
    assert b.supports(Problem(mask=make_mask("causal", 64), head_dim=80, head_dim_v=48, dtype=torch.float16,
                              device=DEVICE)) == (True, "")


def test_public_api_and_prepare():
    mask = small_mask("sliding_window_causal", 70, seed=2)
    torch.manual_seed(0)
    q = torch.randn(1, 70, 4, 32, device=DEVICE)
    k = torch.randn(1, 70, 2, 32, device=DEVICE)
    v = torch.randn(1, 70, 2, 32, device=DEVICE)
    out, lse = lt.attention(q, k, v, mask, backend=BACKEND, return_lse=True)
    ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), mask, return_lse=True)
    assert (out.double() - ref).abs().max().item() < 1e-4
    problem = Problem(mask=mask, heads_q=4, heads_kv=2, head_dim=32, dtype=torch.float32,
                      device=DEVICE)
    out2, lse2 = get_backend(BACKEND).prepare(problem, q, k, v)()
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


def test_validation_errors():
    mask = make_mask("causal", 16)
    q = torch.randn(1, 16, 4, 32, device=DEVICE)
    k = torch.randn(1, 16, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="mask is 16 x 16"):
        flashmask_attention(q[:, :8], k, k, mask)
    with pytest.raises(ValueError, match="Sk=16"):
        flashmask_attention(q, k[:, :8], k[:, :8], mask)
    with pytest.raises(ValueError, match="unknown flashmask config"):
        flashmask_attention(q, k, k, mask, config={"BLOCKM": 64})
    with pytest.raises(ValueError, match="power of two"):
        flashmask_attention(q, k, k, mask, config={"BLOCK_N": 48})
    with pytest.raises(ValueError, match="head dim"):
        flashmask_attention(q[..., :20], k[..., :20], k[..., :20], mask)  # not a multiple of 8
    with pytest.raises(ValueError, match="RangeMask or FlashMaskColumns"):
        flashmask_attention(q, k, k, "causal")
    for d in (32, 64, 128, 256):
        assert set(resolve_config(d, torch.bfloat16)) == set(CONFIG_KEYS)


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_configs_are_the_dense_ones(monkeypatch, d):
    """FlashMask and the dense kernel are compared on equal tiling: the same keys, resolved from the same
    table with the same mask rules (``test_dense_config.py`` checks the whole grid)."""
    from longca_triton.kernels.dense import op as dense

    monkeypatch.setattr(dense, "_interpreting", lambda: False)
    assert resolve_config(d, torch.bfloat16) == dense.resolve_config(d, torch.bfloat16)
    q, k = torch.zeros(1, 8, 16, d), torch.zeros(1, 8, 2, d)
    for name in ("full", "causal", "sliding_window"):
        mask = make_mask(name, 4096)
        assert resolve_config(d, torch.bfloat16, q=q, k=k, mask=mask) == dense.resolve_config(
            d, torch.bfloat16, q=q, k=k, mask=mask), name


def test_resolve_config_takes_the_group_and_a_named_tile_goes_head_major(monkeypatch):
    """The dense table's descending sweep (2) runs here as this kernel's row-major sweep, ascending."""
    from longca_triton.kernels.dense import op as dense

    monkeypatch.setattr(dense, "_interpreting", lambda: False)
    mask = make_mask("causal", 4096)
    q, k = torch.zeros(1, 8, 16, 128), torch.zeros(1, 8, 2, 128)
    assert resolve_config(128, torch.bfloat16, None, q=q, k=k, mask=mask)["dkdv_sweep"] == 2
    assert resolve_config(128, torch.bfloat16, None, q=q, k=k[:, :, :1].expand(1, 8, 16, 128),
                          mask=mask)["dkdv_sweep"] == 0, "MHA: no sweep"
    cfg = resolve_config(128, torch.bfloat16, dict(DKDV_BLOCK_M=32), q=q, k=k, mask=mask)
    assert cfg["dkdv_sweep"] == 0 and cfg["DKDV_BLOCK_M"] == 32
    assert resolve_config(128, torch.bfloat16, dict(DKDV_BLOCK_M=32, dkdv_sweep=1), q=q, k=k,
                          mask=mask)["dkdv_sweep"] == 1
    # FlashMask columns carry no mask class: the table's rows without one
    assert resolve_config(128, torch.bfloat16, None, q=q, k=k, mask=flashmask_columns(mask))["dkdv_sweep"] == 0


@pytest.mark.parametrize("table_dim", [64, 128, 256], ids=lambda d: f"tiles-of-D={d}")
def test_hopper_tiles_are_correct_in_the_interpreter(table_dim):
    """The dense table's Hopper tiles were timed for the dense kernel only; the FlashMask kernels run
    each entry's tile combination here (at D = 64, fp32, sizes off every tile, GQA) against the
    reference: the tiles' numerics, not their speed."""
    from longca_triton.kernels.dense import op as dense
    from longca_triton.kernels.tuning import Problem as TableProblem
    from longca_triton.kernels.tuning import table_config

    tiles = {k: v for k, v in table_config("dense", TableProblem(head_dim=table_dim), dense.CONFIG_KEYS).items()
             if k.endswith(("BLOCK_M", "BLOCK_N"))}
    run_and_compare(small_mask("causal_document", 211), 1, 4, 2, 64, torch.float32,
                    config=dict(tiles, num_stages=1, dkdv_num_stages=1, dq_num_stages=1))


# ------------------------------------------------------------------ the row-major dK/dV sweep
SWEEP_CASES = [(239, 8, 2, "causal_document", None), (150, 4, 1, "share_question", BIG),
               (97, 6, 3, "sliding_window_causal", MIXED)]


@pytest.mark.parametrize("S,Hq,Hkv,name,tiles", SWEEP_CASES,
                         ids=[f"S={s}-Hq={a}-Hkv={b}-{n}" for s, a, b, n, t in SWEEP_CASES])
def test_dkdv_sweep(S, Hq, Hkv, name, tiles):
    """``dkdv_sweep=1``: per query tile every head of the GQA group (one flat loop per run), against the
    reference; fully masked rows stay 0 / -inf."""
    mask = small_mask(name, S, seed=S)
    run_and_compare(mask, 1, Hq, Hkv, 32, torch.float32, config={**(tiles or {}), "dkdv_sweep": 1})


def test_dkdv_sweep_reaches_the_kernel_and_bad_values_are_refused(monkeypatch):
    import longca_triton.kernels.flashmask.op as FM

    launched = spy_launches(monkeypatch, FM, "flashmask_bwd_dkdv_kernel", "SWEEP")
    mask = make_mask("causal", 40)
    q = torch.randn(1, 40, 4, 32, requires_grad=True)
    k = torch.randn(1, 40, 2, 32, requires_grad=True)
    for sweep in (0, 1, 2):
        flashmask_attention(q, k, k, mask, config={"dkdv_sweep": sweep}).sum().backward()
    assert launched == [0, 1, 1]  # the dense kernel's descending 2 runs ascending here
    assert resolve_config(128, torch.bfloat16)["dkdv_sweep"] == 0
    for bad in (3, True, "1", -1):
        with pytest.raises(ValueError, match="dkdv_sweep.*must be one of"):
            flashmask_attention(q, k, k, mask, config={"dkdv_sweep": bad})


# ------------------------------------------------------------------ dQ beside dK/dV, deterministic
@pytest.mark.parametrize("on", [False, True], ids=["one-stream", "bwd_streams"])
def test_bwd_streams_puts_the_dq_launch_beside_dkdv(on, monkeypatch):
    import longca_triton.kernels.flashmask.op as FM
    from utils import fake_side_stream

    events: list = []
    fake, state = fake_side_stream(events)

    class Record:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: events.append((self.name, state["beside"]))

    monkeypatch.setattr(FM, "side_stream", fake)
    monkeypatch.setattr(FM, "flashmask_bwd_dkdv_kernel", Record("dkdv"))
    monkeypatch.setattr(FM, "flashmask_bwd_dq_kernel", Record("dq"))
    q, k, v, out, do = (torch.randn(1, 96, h, 32) for h in (4, 2, 2, 4, 4))
    mask = small_mask("causal", 96)
    cfg = resolve_config(32, torch.float32, {"bwd_streams": on})
    FM.flashmask_bwd(do, q, k, v, out, torch.zeros(1, 4, 96), flashmask_plan(mask, 96, "cpu"), 32 ** -0.5, cfg)
    assert events == [("side_stream", on), ("dkdv", False), ("dq", True)]


def test_deterministic_gives_equal_bits_twice():
    mask = small_mask("causal_document", 130, seed=2)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 130, h, 32, device=DEVICE) for h in (4, 2, 2))
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flashmask_attention(*leaves, mask, config={"dkdv_sweep": 1}, deterministic=True)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))
        grads.append([t.grad for t in leaves])
    for name, a, b in zip("qkv", *grads):
        assert a.abs().sum() > 0, f"d{name} is all zero: nothing was checked"
        assert torch.equal(a, b), f"d{name} differs between two deterministic runs"

"""Backward variants on the CPU (Triton interpreter): the block-sparse kernels' one-launch backward, sweeps,
streams, tails and list layouts against the float64 reference, and ``deterministic=True`` (bitwise-equal
gradients on two runs; reaching the kernel from ``longca_triton.attention``). The dense and FlashMask
variants are in ``test_dense.py`` / ``test_flashmask.py``."""

import json

import pytest
import torch
from utils import (
    DEVICE,
    compare_to_reference,
    fake_side_stream,
    needs_triton,
    small_mask,
)

import longca_triton as lt
from longca_triton.kernels.block_sparse.op import block_sparse_attention
from longca_triton.kernels.core.config import BWD_ORDERS
from longca_triton.masks import make_mask

pytestmark = needs_triton

def one_launch(order, **extra):
    return dict(one_launch=True, bwd_order=order, **extra)


def _record_launches(monkeypatch, module, names) -> list:
    """Replace ``module``'s kernels ``names`` by stand-ins that keep each launch's keyword arguments
    (in the returned list) instead of running."""
    launches = []

    class Record:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    for n in names:
        monkeypatch.setattr(module, n, Record())
    return launches


# ------------------------------------------------------------------ FlashMask, one launch
# ------------------------------------------------------------------ block-sparse, one launch
BS_CASES = {
    "uniform32-S=200-GQA4:2-dkdv-first": (lambda: make_mask("block_sparse", 200, block=32, density=0.5, patterns=2,
                                                            seed=3), 0, False),
    "varblock-S=150-GQA4:2-interleaved": (lambda: make_mask("varblock_sparse", 150, block=48, min_block=20,
                                                            density=0.4, patterns=2, seed=2), 2, False),
    "uniform16-S=100-GQA4:2-dq-first-op": (lambda: make_mask("block_sparse", 100, block=16, density=0.3, patterns=1,
                                                             seed=5), 1, True),
}


@pytest.mark.parametrize("case", BS_CASES)
def test_block_sparse_one_launch(case):
    from longca_triton.kernels.block_sparse.op import block_sparse_attention_op

    make, order, use_op = BS_CASES[case]
    mask = make()
    fn = block_sparse_attention_op if use_op else block_sparse_attention
    cfg = one_launch(order)
    compare_to_reference(lambda q, k, v: fn(q, k, v, mask, return_lse=True, config=cfg), mask,
                         mask.seqlen_q, mask.seqlen_k, 1, 4, 2, 32, torch.float32, dlse=order == 2)


BS_SWEEP_CASES = {
    # the GQA group shares a pattern (one per KV head / one for all): the sweep runs row-major
    "uniform32-S=200-per-kv-head-descending": (lambda: make_mask("block_sparse", 200, block=32, density=0.5,
                                                                 patterns=2, seed=3), dict(dkdv_sweep=2)),
    "uniform16-S=100-one-pattern-ascending-one-launch": (lambda: make_mask("block_sparse", 100, block=16, density=0.3,
                                                                           patterns=1, seed=5),
                                                         one_launch(2, dkdv_sweep=1)),
    "varblock-S=150-per-kv-head-descending": (lambda: make_mask("varblock_sparse", 150, block=48, min_block=20,
                                                                density=0.4, patterns=2, seed=2), dict(dkdv_sweep=2)),
    # a pattern per query head: the group has no one key list, the launcher keeps head-major
    "uniform32-S=130-per-q-head-falls-back": (lambda: make_mask("block_sparse", 130, block=32, density=0.5,
                                                                patterns=4, seed=4), dict(dkdv_sweep=2)),
    # the dK/dV grid with the KV head slowest (dkdv_head_outer), alone, with the sweep, in one launch
    "uniform32-S=200-per-kv-head-head-outer": (lambda: make_mask("block_sparse", 200, block=32, density=0.5,
                                                                 patterns=2, seed=3), dict(dkdv_head_outer=True)),
    "varblock-S=150-per-q-head-head-outer-sweep": (lambda: make_mask("varblock_sparse", 150, block=48, min_block=20,
                                                                     density=0.4, patterns=4, seed=2),
                                                   dict(dkdv_head_outer=True, dkdv_sweep=2)),
    "uniform16-S=100-one-pattern-head-outer-one-launch": (lambda: make_mask("block_sparse", 100, block=16,
                                                                            density=0.3, patterns=1, seed=5),
                                                          one_launch(1, dkdv_head_outer=True)),
}


@pytest.mark.parametrize("case", BS_SWEEP_CASES)
def test_block_sparse_dkdv_sweep(case):
    make, cfg = BS_SWEEP_CASES[case]
    mask = make()
    compare_to_reference(lambda q, k, v: block_sparse_attention(q, k, v, mask, return_lse=True, config=cfg), mask,
                         mask.seqlen_q, mask.seqlen_k, 1, 4, 2, 32, torch.float32)


@pytest.mark.parametrize("patterns,launched", [(2, 2), (1, 2), (4, 0)], ids=["per-kv-head", "one", "per-q-head"])
def test_block_sparse_dkdv_sweep_reaches_the_kernel_only_where_the_group_shares_a_pattern(patterns, launched,
                                                                                            monkeypatch):
    import longca_triton.kernels.block_sparse.op as BS

    launches = _record_launches(monkeypatch, BS, ("block_sparse_bwd_dkdv_kernel", "block_sparse_bwd_dq_kernel"))
    mask = make_mask("block_sparse", 64, block=32, density=0.5, patterns=patterns, seed=1)
    q, k, v, out, do = (torch.randn(1, 64, h, 32) for h in (4, 2, 2, 4, 4))
    cfg = BS.resolve_config(mask, 32, {"dkdv_sweep": 2})
    BS.block_sparse_bwd(do, q, k, v, out, torch.zeros(1, 4, 64), mask, BS.tables_for(mask, cfg, "cpu"), 32 ** -0.5,
                        cfg)
    assert [kw["SWEEP"] for kw in launches if "SWEEP" in kw] == [launched]


def test_block_sparse_dkdv_head_outer_reaches_the_kernel(monkeypatch):
    """``dkdv_head_outer`` is a bool of the config (on by default: measured 4-15 % faster on H100)
    passed to the dK/dV kernel only."""
    import longca_triton.kernels.block_sparse.op as BS

    launches = _record_launches(monkeypatch, BS, ("block_sparse_bwd_dkdv_kernel", "block_sparse_bwd_dq_kernel"))
    mask = make_mask("block_sparse", 64, block=32, density=0.5, patterns=2, seed=1)
    q, k, v, out, do = (torch.randn(1, 64, h, 32) for h in (4, 2, 2, 4, 4))
    for value, want in ((None, True), (0, False)):
        cfg = BS.resolve_config(mask, 32, None if value is None else {"dkdv_head_outer": value})
        assert cfg["dkdv_head_outer"] is want
        BS.block_sparse_bwd(do, q, k, v, out, torch.zeros(1, 4, 64), mask, BS.tables_for(mask, cfg, "cpu"),
                            32 ** -0.5, cfg)
    assert [kw["HEAD_OUTER"] for kw in launches if "HEAD_OUTER" in kw] == [True, False]


def test_block_sparse_dkdv_sweep_bad_value():
    import longca_triton.kernels.block_sparse.op as BS

    with pytest.raises(ValueError, match="dkdv_sweep"):
        BS.resolve_config(make_mask("block_sparse", 64, block=32), 32, {"dkdv_sweep": 5})


# ------------------------------------------------------------------ config checks
@pytest.mark.parametrize("kernel", ["block-sparse"])
def test_config_rejects_unknown_bwd_order(kernel):
    import longca_triton.kernels.block_sparse.op as BS

    assert set(BWD_ORDERS) == {0, 1, 2}
    bad = dict(one_launch=True, bwd_order=3)
    resolve = {"block-sparse": lambda: BS.resolve_config(make_mask("block_sparse", 64, block=32), 32, bad)}[kernel]
    with pytest.raises(ValueError, match=f"{kernel}.*bwd_order"):
        resolve()


# ------------------------------------------------------------------ deterministic
def _grads(fn, q, k, v, mask, **kw):
    """dq, dk, dv of one fresh forward + backward (new leaves, same values)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, mask, **kw)
    g = torch.Generator(device=out.device).manual_seed(7)
    out.backward(torch.randn(out.shape, generator=g, device=out.device, dtype=out.dtype))
    return q.grad, k.grad, v.grad


DETERMINISTIC = {
    "block-sparse": (block_sparse_attention,
                     lambda: make_mask("block_sparse", 128, block=32, density=0.5, patterns=2, seed=1), None),
    "block-sparse-one-launch": (block_sparse_attention,
                                lambda: make_mask("block_sparse", 128, block=32, density=0.5, patterns=2, seed=1),
                                one_launch(2)),
    "varblock": (block_sparse_attention,
                 lambda: make_mask("varblock_sparse", 150, block=48, min_block=20, density=0.5, patterns=2, seed=2),
                 None),
}


@pytest.mark.parametrize("kernel", DETERMINISTIC)
def test_deterministic_gives_equal_bits_twice(kernel):
    fn, make, config = DETERMINISTIC[kernel]
    mask = make()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, s, h, 32, device=DEVICE) for s, h in
               ((mask.seqlen_q, 4), (mask.seqlen_k, 2), (mask.seqlen_k, 2)))
    first = _grads(fn, q, k, v, mask, config=config, deterministic=True)
    second = _grads(fn, q, k, v, mask, config=config, deterministic=True)
    for name, a, b in zip("qkv", first, second):
        assert a.abs().sum() > 0, f"d{name} is all zero: nothing was checked"
        assert torch.equal(a, b), f"d{name} differs between two deterministic runs"


def test_api_deterministic_error_paths(monkeypatch):
    from longca_triton.adapters import get_backend

    mask = small_mask("causal", 40)
    q, k, v = (torch.randn(1, 40, h, 32, device=DEVICE) for h in (2, 1, 1))
    with pytest.raises(ValueError, match="'reference' cannot promise deterministic"):
        lt.attention(q, k, v, mask, backend="reference", deterministic=True)


def test_flash_adapter_asks_flashattention_for_determinism():
    """FA2/FA3: ``deterministic=True`` goes to the vendor call where its signature has it, else a
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


# ------------------------------------------------------------------ autotune
@pytest.mark.parametrize("tunable", ["triton-sparse", "triton-varblock"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_autotune_searches_the_backward_layout(tunable, head_dim):
    """The ``bwd`` group: two kernels first (its keys are the group's, the ones reset to the
    default when nothing wins), then one-launch candidates; all resolve for their kernel."""
    import longca_triton.kernels.block_sparse.op as BS
    from longca_triton.bench import autotune as at

    t = at.TUNABLES[tunable]
    assert t.groups["bwd"] == "bwd" and list(t.groups)[-1] == "bwd"
    cands = t.candidates("bwd", 128, head_dim)
    assert cands[0]["one_launch"] is False and all(set(c) == set(cands[0]) for c in cands)
    assert {c["bwd_order"] for c in cands if c["one_launch"]} == {0, 2}
    mask = make_mask("block_sparse", 256, block=128)
    for c in cands:
        cfg = BS.resolve_config(mask, head_dim, c)
        assert cfg["one_launch"] == c["one_launch"] and not cfg.get("fused_dq", False)


def test_autotune_varblock_dkdv_group_searches_query_major_tails(monkeypatch):
    """Variable blocks' ``dkdv`` group: each head-major 8-warp main tile with 64-key tails (query-major at 64 rows a
    step: the default's ``dkdv_tail_cols``) also with them key-major (0), at 128 query rows on 8 warps, at 128 in
    the main launch (``dkdv_tail_order`` 3), and with its lists in one part (``dkdv_full_first`` off); no tail
    variant where the tile has no tails; every candidate resolves over the Hopper default."""
    import longca_triton.kernels.block_sparse.op as BS
    from longca_triton.bench import autotune as at

    cands = at.TUNABLES["triton-varblock"].candidates("dkdv", 256, 128)
    mains = [c for c in cands if "dkdv_tail_cols" not in c and "dkdv_full_first" not in c and not c.get("dkdv_qmajor")
             and c["dkdv_tail_rows"]
             and c["dkdv_num_warps"] == 8 and c["dkdv_sweep"] == 0]
    assert mains
    for c in mains:
        for extra in ({"dkdv_tail_cols": 0}, {"dkdv_tail_cols": 128, "dkdv_tail_warps": 8},
                      {"dkdv_tail_cols": 128, "dkdv_tail_order": 3}, {"dkdv_full_first": False}):
            assert {**c, **extra} in cands
    # the default's whole-entries-first walk steps aside for the merged tails and the sweep
    monkeypatch.setattr(BS, "_interpreting", lambda: False)
    mask = make_mask("varblock_sparse", 2048, block=256, min_block=128, density=0.5, patterns=2, seed=1)
    for c in cands:
        BS.resolve_config(mask, 128, c)
    assert all(c["dkdv_tail_rows"] for c in cands if "dkdv_tail_cols" in c)
    assert len(cands) == len({json.dumps(c, sort_keys=True) for c in cands})


# ------------------------------------------------------------------ the GPU script, at toy size
@pytest.mark.parametrize("block,head_dim,want", [(128, 128, (128, 64, 3, 64)), (256, 64, (128, 64, 3, 64)),
                                                 (128, 256, (64, 64, 2, 0)), (64, 128, (64, 64, 2, 0)),
                                                 (32, 128, (32, 32, 2, 0))],
                         ids=lambda x: str(x))
def test_block_sparse_hopper_defaults(block, head_dim, want, monkeypatch):
    """Uniform blocks >= 128 at D <= 128: every pass reads its list in register chunks of 64 with
    three stages, the dQ pass owning 128 rows and stepping over 64 keys (backward 2-5 %, forward
    10-13 % faster on an H100, bwd_session13); D > 128 and smaller blocks keep their backward tiles
    and read those lists entry by entry (block 64 chunked measured slower)."""
    import longca_triton.kernels.block_sparse.op as BS

    monkeypatch.setattr(BS, "_interpreting", lambda: False)
    mask = make_mask("block_sparse", 4 * block, block=block, density=0.5, patterns=2, seed=1)
    cfg = BS.default_config(mask, head_dim)
    assert (cfg["DQ_BLOCK_M"], cfg["DQ_BLOCK_N"], cfg["dq_num_stages"], cfg["dq_list_chunk"]) == want
    assert cfg["dkdv_list_chunk"] == want[3]
    # session 22: the dK/dV steps' stats by TMA boxes (uniform blocks >= 64 at D <= 128: measured at 64 and 128)
    assert cfg["dkdv_stats_tma"] is (head_dim <= 128 and block >= 64)
    if want[3]:
        assert (cfg["DKDV_BLOCK_M"], cfg["DKDV_BLOCK_N"], cfg["dkdv_num_stages"]) == (64, 128, 3)
        assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"], cfg["list_chunk"]) == (128, 128, 3, 64)
    # session 20: dQ beside dK/dV on a second stream (uniform blocks >= 128 at D <= 128), a KV head's dK/dV
    # tiles in its own pattern's order (there and at block 64, D <= 128: measured there)
    assert cfg["bwd_streams"] is bool(want[3])
    assert cfg["dkdv_pattern_order"] is (head_dim <= 128 and block in (64, 128, 256))
    # the forward reads its list in chunks at 128 x 128 and 64 x 64 (block 64, variable blocks), three stages
    fwd_chunked = (block, head_dim) != (128, 256) and block >= 64
    assert (cfg["list_chunk"], cfg["num_stages"]) == ((64, 3) if fwd_chunked else (0, 2))


def test_block_sparse_varblock_defaults(monkeypatch):
    import longca_triton.kernels.block_sparse.op as BS

    monkeypatch.setattr(BS, "_interpreting", lambda: False)
    mask = make_mask("varblock_sparse", 2048, block=256, min_block=128, density=0.5, patterns=2, seed=1)
    cfg = BS.default_config(mask, 128)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"], cfg["list_chunk"]) == (64, 64, 3, 64)
    assert not cfg["pack_list"] and cfg["tail_rows"] == 0  # the forward: plain lists, one launch
    # the backward: dK/dV over packed query lists entry by entry (session 16), since session 22 in uniform
    # block 128's 128-key tile on 8 warps, head-major, its remainders in 64-key tail tiles (VARBLOCK_DKDV);
    # dQ over plain key lists, 64 keys a step; session 21: 128-row tiles of four stacked query
    # heads x 32 positions, no tail launch (VARBLOCK_DQ; before: one head's 128 rows plus 64-row tails; 8 x 16
    # measured in session 26 and not kept)
    assert (cfg["DKDV_BLOCK_M"], cfg["DKDV_BLOCK_N"], cfg["dkdv_sweep"], cfg["dkdv_list_chunk"]) == (64, 128, 0, 0)
    assert (cfg["dkdv_num_warps"], cfg["dkdv_num_stages"]) == (8, 3)
    assert cfg["dkdv_pack_list"] and cfg["dkdv_tail_rows"] == 64 and cfg["dkdv_pattern_order"]
    assert cfg["dkdv_tail_order"] == 2  # session 26: the tails first, on the side stream
    assert cfg["dkdv_tail_cols"] == 64 and cfg["dkdv_tail_warps"] == 4  # session 28: query-major, 64 rows a step
    assert cfg["dkdv_full_first"] and not cfg["dq_full_first"]  # session 29: whole query entries first (dK/dV only)
    # a config that walks the dK/dV lists another way walks them in one part
    for over in ({"dkdv_sweep": 2}, {"dkdv_list_chunk": 16}, {"dkdv_tail_order": 3, "dkdv_tail_cols": 128}):
        assert not BS.resolve_config(mask, 128, over)["dkdv_full_first"]
    assert cfg["order_by_steps"]  # session 26: the backward's programs by their lists' steps
    # session 23: the stacked dQ tile reads its key list entry by entry (+3 to +6 % over chunks of 64)
    assert (cfg["DQ_BLOCK_N"], cfg["dq_num_stages"], cfg["dq_list_chunk"]) == (64, 3, 0)
    assert (cfg["DQ_BLOCK_M"], cfg["DQ_HEADS"], cfg["dq_num_warps"]) == (32, 4, 8)
    assert cfg["dq_tail_rows"] == 0 and not cfg["dq_pack_list"]
    assert BS.default_config(mask, 128, dq_stack=1)["dq_tail_rows"] == 64
    assert cfg["bwd_streams"]  # session 20: streams +2.4 %
    # D > 128 keeps the 64 x 64 backward
    big = BS.default_config(mask, 256)
    assert (big["DQ_BLOCK_M"], big["dq_tail_rows"], big["dkdv_sweep"], big["DKDV_BLOCK_N"]) == (64, 0, 0, 64)
    assert big["dkdv_tail_rows"] == 0 and not big["dkdv_stats_tma"]
    # a config written before with a 64-key dK/dV tile and no tail size keeps its remainders in its own tiles
    old = BS.resolve_config(mask, 128, {"DKDV_BLOCK_N": 64, "dkdv_num_warps": 4, "dkdv_num_stages": 2})
    assert (old["DKDV_BLOCK_N"], old["dkdv_tail_rows"]) == (64, 0)


_CHUNK_CASES = {
    # lists longer than the chunk (several chunks and a partial last one), GQA, one pattern per KV head
    "uniform32-S=1000-GQA2:1-chunk16": (lambda: make_mask("block_sparse", 1000, block=32, density=0.7, patterns=1,
                                                          seed=4), {}),
    # ragged blocks (masked tails), rows keeping nothing, a pattern per query head
    "varblock-S=700-GQA4:2-chunk16": (lambda: make_mask("varblock_sparse", 700, block=40, min_block=20, density=0.6,
                                                        patterns=4, seed=5), {}),
    "uniform32-S=1000-GQA2:1-chunk16-one-launch": (lambda: make_mask("block_sparse", 1000, block=32, density=0.7,
                                                                     patterns=1, seed=4), one_launch(0)),
}


@pytest.mark.parametrize("case", list(_CHUNK_CASES))
def test_block_sparse_list_chunks_give_the_same_bits(case):
    """Lists read in register chunks (``list_chunk`` / ``dkdv_list_chunk`` / ``dq_list_chunk``) walk the same entries
    in the same order as reading them entry by entry: equal bits, and right against the reference."""
    from longca_triton.kernels.block_sparse.op import tables_for, resolve_config

    make, extra = _CHUNK_CASES[case]
    mask = make()
    hq, hkv = (2, 1) if mask.num_patterns == 1 else (4, 2)
    tables = tables_for(mask, resolve_config(mask, 16, extra), "cpu")
    longest = max(int((t.ptr[1:] - t.ptr[:-1]).max()) for t in (tables["dq"], tables["dkdv"]))
    assert longest > 16, f"the case must need several chunks, its longest list has {longest} entries"
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, mask.seqlen_q, hq, 16, generator=g, requires_grad=True)
    k = torch.randn(1, mask.seqlen_k, hkv, 16, generator=g, requires_grad=True)
    v = torch.randn(1, mask.seqlen_k, hkv, 16, generator=g, requires_grad=True)
    dout = torch.randn(1, mask.seqlen_q, hq, 16, generator=g)
    got = []
    for chunk in (0, 16):
        cfg = dict(extra, list_chunk=chunk, dkdv_list_chunk=chunk, dq_list_chunk=chunk)
        out = block_sparse_attention(q, k, v, mask, config=cfg)
        got.append((out.detach(), *torch.autograd.grad(out, (q, k, v), dout)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *got):
        assert torch.equal(a, b), f"{name} differs between chunked and entry-by-entry lists"
    chunked = dict(extra, list_chunk=16, dkdv_list_chunk=16, dq_list_chunk=16)
    compare_to_reference(lambda q, k, v: block_sparse_attention(q, k, v, mask, return_lse=True, config=chunked),
                         mask, mask.seqlen_q, mask.seqlen_k, 1, hq, hkv, 16, torch.float32)


@pytest.mark.parametrize("bad", [3, 48, 256, -16, True, 16.0], ids=lambda x: repr(x))
def test_block_sparse_list_chunk_values_are_checked(bad):
    from longca_triton.kernels.block_sparse.op import resolve_config

    mask = make_mask("block_sparse", 128, block=32, density=0.5)
    for key in ("list_chunk", "dkdv_list_chunk", "dq_list_chunk"):
        with pytest.raises(ValueError, match=key):
            resolve_config(mask, 32, {key: bad})


def test_block_sparse_dq_128x128_step_is_right():
    """The 128 x 128 dQ step on block-128 tables, a ragged last block, GQA, in the interpreter."""
    mask = make_mask("block_sparse", 300, block=128, density=0.5, patterns=2, seed=2)
    cfg = dict(DQ_BLOCK_M=128, DQ_BLOCK_N=128, dq_num_warps=8, dq_num_stages=2)
    compare_to_reference(lambda q, k, v: block_sparse_attention(q, k, v, mask, return_lse=True, config=cfg), mask,
                         mask.seqlen_q, mask.seqlen_k, 1, 4, 2, 32, torch.float32)



def test_ncu_source_top_reads_the_source_page(tmp_path):
    """experiments/gpu/ncu_source_top.py: per kernel of an ncu source-page CSV (plain or gzipped),
    the stall-reason shares and the instructions with the most samples, largest first."""
    import gzip
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "experiments" / "gpu" / "ncu_source_top.py"
    spec = importlib.util.spec_from_file_location("ncu_source_top", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    hdr = '"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb","stall_barrier",' \
          '"stall_long_sb (Not Issued)"'
    text = "\n".join(['"Kernel Name","k_dq",', hdr, '"0x10","LDG.E R1, [R2]","30","30","0","9"',
                      '"0x20","HGMMA.64x64x16","10","0","10","0"', '"Kernel Name","k_flex",', hdr,
                      '"0x10","BAR.SYNC","5","1","4","0"'])
    (tmp_path / "p.csv.gz").write_bytes(gzip.compress(text.encode()))
    kernels = mod.parse(str(tmp_path / "p.csv.gz"))
    assert [k["name"] for k in kernels] == ["k_dq", "k_flex"] and len(kernels[0]["rows"]) == 2
    out = mod.report(kernels, top=1)
    assert "== k_dq: 2 instructions, 40 samples" in out
    assert "long_sb 0.750, barrier 0.250" in out  # shares of all samples, the Not-Issued column left out
    assert "LDG.E R1, [R2]" in out and "HGMMA" not in out  # --top 1: the instruction with most samples


def test_block_sparse_configs_without_a_list_key_read_entry_by_entry(monkeypatch):
    """A config (explicit or from the autotune cache) that sets a pass's tile, warps or stages but not
    its list key gets that pass's list read entry by entry (such configs predate the key; chunks at
    two stages measured slower); the other passes keep the default, and a named key wins."""
    from longca_triton.kernels.core import tuned
    from longca_triton.kernels.block_sparse.op import resolve_config

    mask = make_mask("block_sparse", 128, block=32, density=0.5)
    default = resolve_config(mask, 32)
    assert default["dq_list_chunk"] == default["dkdv_list_chunk"] == default["list_chunk"] == 16  # interpreter
    cfg = resolve_config(mask, 32, {"dq_num_stages": 1})
    assert (cfg["list_chunk"], cfg["dq_list_chunk"], cfg["dkdv_list_chunk"]) == (16, 0, 16)
    cfg = resolve_config(mask, 32, {"BLOCK_N": 32, "DKDV_BLOCK_M": 32})
    assert (cfg["list_chunk"], cfg["dq_list_chunk"], cfg["dkdv_list_chunk"]) == (0, 16, 0)
    assert resolve_config(mask, 32, {"dq_num_stages": 1, "dq_list_chunk": 32})["dq_list_chunk"] == 32
    assert resolve_config(mask, 32, {"one_launch": True})["dq_list_chunk"] == 16  # not a pass's launch key
    monkeypatch.setattr(tuned, "lookup", lambda kernel, q, k, mask, v=None: {"dkdv_num_stages": 1})
    q = torch.zeros(1, 128, 2, 32)
    cfg = resolve_config(mask, 32, q=q, k=q)
    assert (cfg["dq_list_chunk"], cfg["dkdv_list_chunk"]) == (16, 0)


# ------------------------------------------------------------------ bwd_streams: dQ beside dK/dV
class _RecordBeside:
    """A kernel stand-in appending ``(name, launched beside)`` to ``events`` (``utils.fake_side_stream``)."""

    def __init__(self, name, events, state):
        self.name, self.events, self.state = name, events, state

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.events.append((self.name, self.state["beside"]))


_STREAM_KERNELS = {
    "block-sparse": ("longca_triton.kernels.block_sparse.op", "block_sparse_bwd_dkdv_kernel",
                     "block_sparse_bwd_dq_kernel"),
}


def _stream_backward(kernel, cfg_extra):
    """Run ``kernel``'s backward launcher on small CPU tensors with ``cfg_extra`` over its defaults."""
    import importlib

    mod = importlib.import_module(_STREAM_KERNELS[kernel][0])
    q, k, v, out, do = (torch.randn(1, 96, h, 32) for h in (4, 2, 2, 4, 4))
    lse = torch.zeros(1, 4, 96)
    # variable blocks with tail row tiles in both passes: four launches, two per chain
    mask = make_mask("varblock_sparse", 96, block=40, min_block=20, density=0.6, patterns=2, seed=5)
    cfg = mod.resolve_config(mask, 32, {"dq_tail_rows": 16, "dkdv_tail_rows": 16, **cfg_extra})
    mod.block_sparse_bwd(do, q, k, v, out, lse, mask, mod.tables_for(mask, cfg, "cpu"), 32 ** -0.5, cfg)


@pytest.mark.parametrize("kernel", list(_STREAM_KERNELS))
@pytest.mark.parametrize("on", [False, True], ids=["one-stream", "bwd_streams"])
def test_bwd_streams_puts_the_dq_launches_beside_dkdv(kernel, on, monkeypatch):
    """``bwd_streams`` switches the side stream on; every dQ launch (and a dQ tail launch) goes inside
    ``beside()``, every dK/dV launch outside it and before the dQ ones."""
    import importlib

    name, dkdv, dq = _STREAM_KERNELS[kernel]
    mod = importlib.import_module(name)
    events: list = []
    fake, state = fake_side_stream(events)
    monkeypatch.setattr(mod, "side_stream", fake)
    monkeypatch.setattr(mod, dkdv, _RecordBeside("dkdv", events, state))
    monkeypatch.setattr(mod, dq, _RecordBeside("dq", events, state))
    _stream_backward(kernel, {"bwd_streams": on} if on else {})
    assert events[0] == ("side_stream", on)
    launches = events[1:]
    want = 2 if kernel == "block-sparse" else 1  # main tiles + tail tiles per pass there
    assert launches == [("dkdv", False)] * want + [("dq", True)] * want


class _RecordWarps:
    """A kernel stand-in appending ``(name, grid, num_warps, BLOCK_N)`` of each launch to ``events``."""

    def __init__(self, name, events):
        self.name, self.events = name, events

    def __getitem__(self, grid):
        return lambda *args, **kw: self.events.append((self.name, grid[0], kw["num_warps"], kw["BLOCK_N"]))


@pytest.mark.parametrize("warps", [None, 4, 8], ids=["default", "tail_warps=4", "tail_warps=8"])
def test_dkdv_tail_warps_sets_only_the_dkdv_tail_launch(warps, monkeypatch):
    """``dkdv_tail_warps``: the dK/dV tail launch (16-key tiles here) runs on that many warps (4 when unset);
    the main dK/dV launch and both dQ launches keep their own."""
    from longca_triton.kernels.block_sparse import op as BS

    events: list = []
    monkeypatch.setattr(BS, "block_sparse_bwd_dkdv_kernel", _RecordWarps("dkdv", events))
    monkeypatch.setattr(BS, "block_sparse_bwd_dq_kernel", _RecordWarps("dq", events))
    _stream_backward("block-sparse", {} if warps is None else {"dkdv_tail_warps": warps})
    cfg = BS.resolve_config(make_mask("varblock_sparse", 96, block=40, min_block=20, density=0.6, patterns=2,
                                      seed=5), 32, {"dq_tail_rows": 16, "dkdv_tail_rows": 16})
    assert [e[0] for e in events] == ["dkdv", "dkdv", "dq", "dq"]
    assert all(e[1] > 0 for e in events)  # the small mask has remainders on both sides
    assert events[0][2:] == (cfg["dkdv_num_warps"], cfg["DKDV_BLOCK_N"])
    assert events[1][2:] == (warps or 4, 16)
    assert [e[2] for e in events[2:]] == [cfg["dq_num_warps"], 4]


class _RecordPlace:
    """A kernel stand-in appending ``(name, launched beside, BLOCK_N)`` to ``events``."""

    def __init__(self, name, events, state):
        self.name, self.events, self.state = name, events, state

    def __getitem__(self, grid):
        return lambda *a, **kw: self.events.append((self.name, self.state["beside"], kw["BLOCK_N"]))


@pytest.mark.parametrize("streams", [True, False], ids=["bwd_streams", "one-stream"])
@pytest.mark.parametrize("order", [0, 1, 2], ids=lambda o: f"dkdv_tail_order={o}")
def test_dkdv_tail_order_places_the_dkdv_tail_launch(order, streams, monkeypatch):
    """``dkdv_tail_order``: 0 the dK/dV tail launch (16-key tiles) after the main dK/dV launch on its stream, 1
    first in the dQ chain, 2 on the side stream before the main dK/dV launch; the other launches keep their
    places (dQ main, then dQ tails, beside with ``bwd_streams``)."""
    from longca_triton.kernels.block_sparse import op as BS

    events: list = []
    fake, state = fake_side_stream(events)
    monkeypatch.setattr(BS, "side_stream", fake)
    monkeypatch.setattr(BS, "block_sparse_bwd_dkdv_kernel", _RecordPlace("dkdv", events, state))
    monkeypatch.setattr(BS, "block_sparse_bwd_dq_kernel", _RecordPlace("dq", events, state))
    _stream_backward("block-sparse", {"dkdv_tail_order": order, "bwd_streams": streams})
    assert events[0] == ("side_stream", streams)
    # (the stand-in's beside() marks its launches whether or not the stream is on: off, the real one is a no-op)
    main, tail = ("dkdv", False, 32), ("dkdv", order != 0, 16)
    dqs = [("dq", True, 32), ("dq", True, 32)]
    want = {0: [main, tail, *dqs], 1: [main, tail, *dqs], 2: [tail, main, *dqs]}[order]
    assert events[1:] == want


def test_dkdv_tail_order_keeps_the_bits_and_passes():
    """Every order gives the same gradients (disjoint outputs), and a dK/dV-only backward still runs its tails."""
    from longca_triton.kernels.block_sparse import op as BS

    mask = make_mask("varblock_sparse", 150, block=48, min_block=20, density=0.5, patterns=2, seed=4)
    torch.manual_seed(0)
    q, k, v, out, do = (torch.randn(1, 150, h, 32) for h in (4, 2, 2, 4, 4))
    lse = torch.rand(1, 4, 150) + 5.0
    got = []
    for order in (0, 1, 2):
        cfg = BS.resolve_config(mask, 32, {"dkdv_tail_rows": 16, "dkdv_tail_order": order})
        tables = BS.tables_for(mask, cfg, "cpu")
        assert tables["dkdv_tail"].num_tiles > 0
        both = BS.block_sparse_bwd(do, q, k, v, out, lse, mask, tables, 32 ** -0.5, cfg)
        _, dk, dv = BS.block_sparse_bwd(do, q, k, v, out, lse, mask, tables, 32 ** -0.5, cfg, passes=("dkdv",))
        assert torch.equal(dk, both[1]) and torch.equal(dv, both[2])
        got.append(both)
    for other in got[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got[0], other))


@pytest.mark.parametrize("bad", [4, -1, True, "1"], ids=str)
def test_dkdv_tail_order_rejects_other_values(bad):
    from longca_triton.kernels.block_sparse import op as BS

    mask = make_mask("varblock_sparse", 96, block=40, min_block=20, density=0.6, patterns=2, seed=5)
    with pytest.raises(ValueError, match="dkdv_tail_order"):
        BS.resolve_config(mask, 32, {"dkdv_tail_order": bad})


@pytest.mark.parametrize("bad", [2, 6, 16, True, "8"], ids=str)
def test_dkdv_tail_warps_rejects_other_counts(bad):
    from longca_triton.kernels.block_sparse import op as BS

    mask = make_mask("varblock_sparse", 96, block=40, min_block=20, density=0.6, patterns=2, seed=5)
    with pytest.raises(ValueError, match="dkdv_tail_warps"):
        BS.resolve_config(mask, 32, {"dkdv_tail_warps": bad})


def test_dkdv_tail_warps_gradients_match_the_reference():
    """Variable blocks with 16-key dK/dV tails launched on 8 warps, against float64."""
    mask = make_mask("varblock_sparse", 173, block=48, min_block=20, density=0.4, patterns=2, seed=3)
    cfg = {"dkdv_tail_rows": 16, "dkdv_tail_warps": 8}
    compare_to_reference(lambda q, k, v: block_sparse_attention(q, k, v, mask, return_lse=True, config=cfg), mask,
                         173, 173, 1, 4, 2, 32, torch.float32)


def test_bwd_streams_defaults_off_and_is_a_bool():
    from longca_triton.kernels.block_sparse import op as BS

    mask = make_mask("block_sparse", 64, block=32, density=0.5, patterns=1, seed=1)
    assert BS.resolve_config(mask, 32)["bwd_streams"] is False


def test_side_stream_off_cuda_keeps_launches_in_order():
    """Off CUDA (the interpreter) the side stream is a no-op context, whatever the switch says."""
    from longca_triton.kernels.core.runtime import side_stream

    order = []
    with side_stream(torch.device("cpu"), True) as beside:
        order.append("dkdv")
        with beside():
            order.append("dq")
    assert order == ["dkdv", "dq"]


@pytest.mark.parametrize("kernel", ["varblock"])
def test_bwd_streams_gradients_match_the_reference(kernel):
    """The whole backward with ``bwd_streams`` on (in order on the CPU) against float64."""
    mask = make_mask("varblock_sparse", 150, block=48, min_block=20, density=0.4, patterns=2, seed=2)
    cfg = {"bwd_streams": True, "dq_tail_rows": 16, "dkdv_tail_rows": 16}
    compare_to_reference(lambda q, k, v: block_sparse_attention(q, k, v, mask, return_lse=True, config=cfg), mask,
                         150, 150, 1, 4, 2, 32, torch.float32)


def _run_gpu_script(name: str, argv: list):
    """``experiments/gpu/<name>.py``'s ``main(argv)``, loaded with its folder on ``sys.path`` (its siblings'
    imports), which is removed again afterwards."""
    import importlib.util
    import sys
    from pathlib import Path

    gpu_dir = Path(__file__).resolve().parents[2] / "experiments" / "gpu"
    sys.path.insert(0, str(gpu_dir))
    try:
        spec = importlib.util.spec_from_file_location(name, gpu_dir / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.main(argv)
    finally:
        sys.path.remove(str(gpu_dir))


# ------------------------------------------------------------------ dK/dV programs in their own pattern's order
@pytest.mark.parametrize("kind,patterns,outer,one", [
    ("block_sparse", 2, True, False), ("block_sparse", 1, False, False), ("varblock_sparse", 2, True, False),
    ("block_sparse", 4, True, False), ("block_sparse", 2, True, True)],
                         ids=["uniform-per-kv-head", "uniform-one-pattern-kv-fastest", "varblock-tails",
                              "per-q-head-not-applied", "one-launch"])
def test_dkdv_pattern_order_gradients(kind, patterns, outer, one):
    """``dkdv_pattern_order``: each KV head's key tiles in its own pattern's order (the programs' work and
    sums are unchanged, so the gradients too) against float64; with tail row tiles, and in one launch."""
    extra = {"min_block": 20, "block": 48} if kind == "varblock_sparse" else {"block": 32}
    mask = make_mask(kind, 150, density=0.5, patterns=patterns, seed=3, **extra)
    cfg = {"dkdv_pattern_order": True, "dkdv_head_outer": outer, **(one_launch(2) if one else {})}
    if kind == "varblock_sparse":
        cfg.update(dkdv_tail_rows=16, dq_tail_rows=16)
    compare_to_reference(lambda q, k, v: block_sparse_attention(q, k, v, mask, return_lse=True, config=cfg), mask,
                         150, 150, 1, 4, 2, 32, torch.float32)


@pytest.mark.parametrize("patterns,want", [(2, True), (1, True), (4, False)], ids=["per-kv-head", "one", "per-q-head"])
def test_dkdv_pattern_order_reaches_the_kernel_only_where_the_group_shares_a_pattern(patterns, want, monkeypatch):
    import longca_triton.kernels.block_sparse.op as BS

    launches = _record_launches(monkeypatch, BS, ("block_sparse_bwd_dkdv_kernel", "block_sparse_bwd_dq_kernel"))
    mask = make_mask("block_sparse", 64, block=32, density=0.5, patterns=patterns, seed=1)
    q, k, v, out, do = (torch.randn(1, 64, h, 32) for h in (4, 2, 2, 4, 4))
    for value in (False, True):
        cfg = BS.resolve_config(mask, 32, {"dkdv_pattern_order": value})
        BS.block_sparse_bwd(do, q, k, v, out, torch.zeros(1, 4, 64), mask, BS.tables_for(mask, cfg, "cpu"),
                            32 ** -0.5, cfg)
    assert [kw["PATTERN_ORDER"] for kw in launches if "PATTERN_ORDER" in kw] == [False, want]
    # the one-launch kernel takes it too
    one = _record_launches(monkeypatch, BS, ("block_sparse_bwd_one_launch_kernel",))
    cfg = BS.resolve_config(mask, 32, {"dkdv_pattern_order": True, **one_launch(0)})
    BS.block_sparse_bwd(do, q, k, v, out, torch.zeros(1, 4, 64), mask, BS.tables_for(mask, cfg, "cpu"), 32 ** -0.5,
                        cfg)
    assert [kw["DKDV_PATTERN_ORDER"] for kw in one] == [want]


def test_timer_bias_script_smoke(tmp_path):
    """experiments/gpu/timer_bias.py --smoke: both configs timed by every timer in both rounds, rows written."""
    import json

    rows = _run_gpu_script("timer_bias", ["--smoke", "--out", str(tmp_path), "--sparse", "varblock256:64:0.5",
                                          "--configs", '{"a": {}, "b": {"DQ_BLOCK_M": 16, "DQ_HEADS": 2, '
                                          '"dq_tail_rows": 0}}'])
    timers = {"time_fn", "time_interleaved[one]", "time_interleaved[all]", "time_interleaved[all,no flush]"}
    assert {(r["timer"], r["round"], r["variant"]) for r in rows} == {
        (t, rnd, v) for t in timers for rnd in (0, 1) for v in ("a", "b")}
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in rows)
    lines = [json.loads(x) for x in (tmp_path / "timer_bias.jsonl").read_text().splitlines()]
    assert len(lines) == len(rows) == 16


def test_timer_verdict_reads_every_timer_and_case(tmp_path):
    """experiments/gpu/timer_verdict.py: a config is ahead only when every timer in every case puts it ahead of the
    baseline, behind when the harness's timer (time_fn) puts it behind in any case, else mixed; a config missing
    from a case is not ahead."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "experiments" / "gpu" / "timer_verdict.py"
    spec = importlib.util.spec_from_file_location("timer_verdict", path)
    tv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tv)
    tflops = {  # case -> (timer, variant) -> two rounds
        "t32": {("time_fn", "now"): (300, 302), ("time_fn", "a"): (310, 312), ("time_fn", "b"): (290, 291),
                ("time_fn", "c"): (305, 305), ("time_interleaved[all]", "now"): (300, 300),
                ("time_interleaved[all]", "a"): (306, 309), ("time_interleaved[all]", "b"): (320, 320),
                ("time_interleaved[all]", "c"): (299, 300), ("time_fn", "d"): (320, 320),
                ("time_interleaved[all]", "d"): (320, 320)},
        "t64": {("time_fn", "now"): (280, 280), ("time_fn", "a"): (290, 290), ("time_fn", "b"): (300, 300)},
    }
    folders = []
    for case, rows in tflops.items():
        (tmp_path / case).mkdir()
        lines = [json.dumps(dict(timer=t, round=i, variant=v, ms=1.0, tflops=x))
                 for (t, v), xs in rows.items() for i, x in enumerate(xs)]
        (tmp_path / case / "timer_bias.jsonl").write_text("\n".join(lines) + "\n")
        folders.append(tmp_path / case)
    table, out = tv.verdicts(folders, "now", 0.005)
    assert out == {"a": "ahead", "b": "behind", "c": "mixed", "d": "mixed"}
    assert ("a", "t64", "time_fn", pytest.approx(290 / 280)) in table
    # d is ahead at 32K under every timer but was not timed at 64K: ahead on 32K alone, not on both
    only32 = tv.verdicts(folders[:1], "now", 0.005)[1]
    assert only32["d"] == "ahead" and only32["c"] == "mixed"


# ------------------------------------------------------------------ dK/dV stats by TMA boxes (dkdv_stats_tma)
@pytest.mark.parametrize("kind,S,extra,cfgx", [
    ("block_sparse", 150, {"block": 32}, {}),
    ("block_sparse", 160, {"block": 32}, {"dkdv_sweep": 2}),
    ("block_sparse", 150, {"block": 48}, {}),
    ("varblock_sparse", 150, {"block": 48, "min_block": 20}, {"dkdv_tail_rows": 16})],
    ids=["uniform32-S=150-ragged-Sq", "uniform32-sweep2", "uniform48-partial-entries-pointer-path",
         "varblock-packed-pointer-path"])
def test_block_sparse_stats_tma_gradients(kind, S, extra, cfgx):
    """``dkdv_stats_tma``: the dK/dV steps read (lse, delta) from the preprocess's 16-byte rows by TMA boxes
    (full, unpacked entries; the others keep the pointer loads), against float64 with an lse gradient."""
    mask = make_mask(kind, S, density=0.5, patterns=2, seed=3, **extra)
    cfg = {"dkdv_stats_tma": True, "DKDV_HEADS": 1, **cfgx}
    compare_to_reference(lambda q, k, v: block_sparse_attention(q, k, v, mask, return_lse=True, config=cfg), mask,
                         S, S, 1, 4, 2, 32, torch.float32, dlse=True)


@pytest.mark.parametrize("kind,block,heads,want", [
    ("block_sparse", 32, 1, True), ("block_sparse", 48, 1, False), ("varblock_sparse", 48, 1, False),
    ("block_sparse", 32, 2, False)], ids=["full-entries", "partial-entries", "packed", "stacked-heads"])
def test_block_sparse_stats_tma_reaches_the_kernel_only_on_full_unpacked_entries(kind, block, heads, want,
                                                                                  monkeypatch):
    import longca_triton.kernels.block_sparse.op as BS
    import longca_triton.kernels.dense.op as D

    launches = _record_launches(monkeypatch, BS, ("block_sparse_bwd_dkdv_kernel", "block_sparse_bwd_dq_kernel"))
    pre = _record_launches(monkeypatch, D, ("bwd_preprocess_kernel",))
    extra = {"min_block": 20} if kind == "varblock_sparse" else {}
    mask = make_mask(kind, 192, block=block, density=0.5, patterns=2, seed=1, **extra)
    q, k, v, out, do = (torch.randn(1, 192, h, 32) for h in (4, 2, 2, 4, 4))
    cfg = BS.resolve_config(mask, 32, {"dkdv_stats_tma": True, "DKDV_HEADS": heads})
    BS.block_sparse_bwd(do, q, k, v, out, torch.zeros(1, 4, 192), mask, BS.tables_for(mask, cfg, "cpu"),
                        32 ** -0.5, cfg)
    assert [kw["STATS_TMA"] for kw in launches if "STATS_TMA" in kw] == [want]
    assert [kw["STATS"] for kw in pre] == [want]  # the 16-byte stats rows are written only when read


# ------------------------------------------------------------------ dQ GEMM one step late (dq_skew)
@pytest.mark.parametrize("kind,S,extra,cfgx", [
    ("block_sparse", 150, {"block": 32}, {}),
    ("block_sparse", 150, {"block": 48}, {"dq_list_chunk": 0}),
    ("varblock_sparse", 150, {"block": 48, "min_block": 20}, {"DQ_HEADS": 2, "dq_pack_list": False}),
    ("varblock_sparse", 150, {"block": 48, "min_block": 20}, {"dq_pack_list": True})],
    ids=["uniform32-S=150-chunked", "uniform48-partial-entries", "varblock-2-heads-stacked", "varblock-packed-plain-step"])
def test_block_sparse_dq_skew_gradients(kind, S, extra, cfgx):
    """``dq_skew`` in the block-sparse dQ program (entries read in register chunks or one by one, partial key
    tiles, stacked heads; packed lists keep the plain step), against float64 with an lse gradient."""
    mask = make_mask(kind, S, density=0.5, patterns=2, seed=3, **extra)
    cfg = {"dq_skew": True, **cfgx}
    compare_to_reference(lambda q, k, v: block_sparse_attention(q, k, v, mask, return_lse=True, config=cfg), mask,
                         S, S, 1, 4, 2, 32, torch.float32, dlse=True)


@pytest.mark.parametrize("pack,want", [(False, True), (True, False)], ids=["plain-lists", "packed-lists"])
def test_block_sparse_dq_skew_reaches_the_kernel_only_on_unpacked_lists(pack, want, monkeypatch):
    import longca_triton.kernels.block_sparse.op as BS

    launches = _record_launches(monkeypatch, BS, ("block_sparse_bwd_dkdv_kernel", "block_sparse_bwd_dq_kernel"))
    mask = make_mask("varblock_sparse", 192, block=48, min_block=40, density=0.5, patterns=2, seed=1)
    q, k, v, out, do = (torch.randn(1, 192, h, 32) for h in (4, 2, 2, 4, 4))
    cfg = BS.resolve_config(mask, 32, {"dq_skew": True, "dq_pack_list": pack})
    tables = BS.tables_for(mask, cfg, "cpu")
    assert tables["dq"].packed is pack
    BS.block_sparse_bwd(do, q, k, v, out, torch.zeros(1, 4, 192), mask, tables, 32 ** -0.5, cfg)
    assert [kw["SKEW"] for kw in launches if "SKEW" in kw] == [want]


# ------------------------------------------------------------------ dQ short entries last (dq_short_keys)
def _short_mask(S=211, seed=3):
    """Variable blocks whose key runs end in remainders of at most 16 keys (the interpreter's dQ tile is 32)."""
    return make_mask("varblock_sparse", S, block=44, min_block=18, density=0.5, patterns=2, seed=seed)


def test_dq_short_tables_move_short_entries_last():
    """``short_cols``: every list keeps its entries, the long ones first (in order), then those of at most
    ``short_cols`` columns; ``col_split`` points at the first short one; a packed table ignores it."""
    from longca_triton.kernels.block_sparse.plan import build_side_tables

    m = _short_mask()
    plain = build_side_tables(m.q_block_bounds, m.k_block_bounds, m.block_map, 32, 32, "cpu")
    split = build_side_tables(m.q_block_bounds, m.k_block_bounds, m.block_map, 32, 32, "cpu", short_cols=16)
    assert plain.col_split is None and split.short_cols == 16 and torch.equal(plain.ptr, split.ptr)
    n_short = 0
    for lst in range(plain.ptr.numel() - 1):
        lo, hi, mid = int(plain.ptr[lst]), int(plain.ptr[lst + 1]), int(split.col_split[lst])
        before = list(zip(plain.col_start[lo:hi].tolist(), plain.col_end[lo:hi].tolist()))
        after = list(zip(split.col_start[lo:hi].tolist(), split.col_end[lo:hi].tolist()))
        assert after == [e for e in before if e[1] - e[0] > 16] + [e for e in before if e[1] - e[0] <= 16]
        assert lo <= mid <= hi and all(e - s0 <= 16 for s0, e in after[mid - lo:])
        n_short += hi - mid
    assert n_short > 0  # the mask has short remainders: the split is exercised
    packed = build_side_tables(m.q_block_bounds, m.k_block_bounds, m.block_map, 32, 16, "cpu", pack_cols=True,
                               short_cols=8)
    assert packed.packed and packed.col_split is None and packed.short_cols == 0
    with pytest.raises(ValueError, match="short_cols"):
        build_side_tables(m.q_block_bounds, m.k_block_bounds, m.block_map, 32, 32, "cpu", short_cols=32)


@pytest.mark.parametrize("S,cfgx,dtype", [
    (211, {}, torch.float32),
    (211, {"DQ_HEADS": 1}, torch.float16),
    (173, {"dq_tail_rows": 16}, torch.float32)],
    ids=["S=211-2-heads-stacked-fp32", "S=211-1-head-fp16", "S=173-tail-rows-fp32"])
def test_dq_short_keys_gradients(S, cfgx, dtype):
    """``dq_short_keys``: each dQ list's short entries walked last in 16-key tiles, against float64 with an lse
    gradient (GQA 4:2, two patterns, stacked or single heads, tail row tiles)."""
    import longca_triton.kernels.block_sparse.op as BS

    mask = _short_mask(S)
    cfg = {"dq_short_keys": 16, "dq_pack_list": False, "dq_list_chunk": 0, **cfgx}
    # every dQ table this config builds (main and tail row tiles) holds short entries: the second loop runs
    tables = BS.tables_for(mask, BS.resolve_config(mask, 32, cfg), "cpu")
    assert all(bool((t.col_split < t.ptr[1:]).any()) for n, t in tables.items() if n.startswith("dq"))
    compare_to_reference(lambda q, k, v: block_sparse_attention(q, k, v, mask, return_lse=True, config=cfg), mask,
                         S, S, 1, 4, 2, 32, dtype, dlse=True)


def _op_path_grads_equal(mask, cfg, S=211):
    """The autograd path's and the torch.library ops' gradients for ``cfg`` (GQA 4:2, D = 32, fp32): finite and
    equal bit for bit. Returns the inputs ``q, k, v, dout``."""
    import longca_triton.kernels.block_sparse.op as BS

    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, S, h, 32) for h in (4, 2, 2, 4))
    grads = []
    for fn in (BS.block_sparse_attention, BS.block_sparse_attention_op):
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        fn(qq, kk, vv, mask, config=cfg).backward(do)
        grads.append([x.grad for x in (qq, kk, vv)])
    for a, b in zip(*grads):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    return q, k, v, do


def test_dq_short_keys_op_path_and_kernel_switch(monkeypatch):
    """Through the torch.library ops the split table travels with the others (the same gradients as the
    autograd path, bit for bit), and the launcher hands the dQ kernel ``SHORT_N`` only with it."""
    import longca_triton.kernels.block_sparse.op as BS

    mask = _short_mask()
    cfg = {"dq_short_keys": 16, "dq_pack_list": False, "dq_list_chunk": 0}
    q, k, v, do = _op_path_grads_equal(mask, cfg)
    for short, want in ((16, 16), (0, 0)):
        launches = _record_launches(monkeypatch, BS, ("block_sparse_bwd_dkdv_kernel", "block_sparse_bwd_dq_kernel"))
        c = BS.resolve_config(mask, 32, {**cfg, "dq_short_keys": short})
        tables = BS.tables_for(mask, c, "cpu")
        BS.block_sparse_bwd(do, q, k, v, torch.zeros_like(q), torch.zeros(1, 4, 211), mask, tables, 32 ** -0.5, c)
        assert [kw["SHORT_N"] for kw in launches if "SHORT_N" in kw] == [want]


# ------------------------------------------------------------------ whole entries first (dkdv_full_first / dq_full_first)
def _full_first_mask(S=211, seed=3):
    """Variable blocks of 40..48 rows: with 32-row (key) entries every list holds whole entries, entries that cross
    from one run into the next (packed) and short ones."""
    return make_mask("varblock_sparse", S, block=48, min_block=40, density=0.5, patterns=2, seed=seed)


def _entries(t, lo, hi):
    return list(zip(t.col_start[lo:hi].tolist(), t.col_end[lo:hi].tolist(), t.col_next[lo:hi].tolist(),
                    t.col_count[lo:hi].tolist()))


@pytest.mark.parametrize("pack,short", [(True, 0), (False, 0), (False, 8)], ids=["packed", "plain", "plain-short8"])
def test_full_first_tables_put_whole_entries_first(pack, short):
    """``full_first``: every list keeps its entries; its whole contiguous ones (``end - start == tile``, all valid)
    first in their order, ``col_full`` at the first other one; the rest in order (a packed list's short last entry
    stays last, so only it is short); with ``short_cols`` the short ones still last, behind ``col_split``."""
    from longca_triton.kernels.block_sparse.plan import build_side_tables

    m = _full_first_mask()
    args = (m.k_block_bounds, m.q_block_bounds, m.block_map.transpose(1, 2).contiguous(), 32, 16, "cpu")
    plain = build_side_tables(*args, pack_cols=pack, short_cols=short)
    full = build_side_tables(*args, pack_cols=pack, short_cols=short, full_first=True)
    assert plain.col_full is None and full.full_first and full.packed is pack and torch.equal(plain.ptr, full.ptr)
    whole_n = rest_n = 0
    for lst in range(plain.ptr.numel() - 1):
        lo, hi, mid = int(plain.ptr[lst]), int(plain.ptr[lst + 1]), int(full.col_full[lst])
        before, after = _entries(plain, lo, hi), _entries(full, lo, hi)
        whole = [e for e in before if e[1] - e[0] == 16]
        assert lo <= mid <= hi and after[:mid - lo] == whole and all(e[3] == 16 for e in whole)
        rest = after[mid - lo:]
        if short:
            split = int(full.col_split[lst])
            assert mid <= split <= hi and all(e[1] - e[0] <= short for e in after[split - lo:])
            assert rest == [e for e in before if short < e[1] - e[0] != 16] + [e for e in before if e[1] - e[0] <= short]
        else:
            assert rest == [e for e in before if e[1] - e[0] != 16]
        if pack and rest:
            assert all(e[3] == 16 for e in rest[:-1]) and rest[-1] == before[-1]
        whole_n, rest_n = whole_n + len(whole), rest_n + len(rest)
    assert whole_n > 0 and rest_n > 0  # both loops have work on this mask
    even = build_side_tables([0, 64, 128], [0, 64, 128], torch.ones(1, 2, 2, dtype=torch.bool), 32, 32, "cpu",
                             full_first=True)
    assert even.even_cols and not even.full_first  # every entry is whole already: nothing to split


_FULL = {"dkdv_full_first": True, "dkdv_list_chunk": 0, "dq_full_first": True, "dq_list_chunk": 0,
         "dq_pack_list": False}


@pytest.mark.parametrize("S,cfgx,dtype", [
    (211, {"DKDV_HEADS": 1, "dkdv_stats_tma": True}, torch.float32),
    (211, {}, torch.float16),
    (173, {"DKDV_HEADS": 1, "dkdv_stats_tma": True, "dkdv_tail_rows": 16, "dkdv_tail_cols": 16, "dq_tail_rows": 16,
           "dq_short_keys": 16}, torch.float32),
    (173, {"dkdv_tail_rows": 16, "dq_short_keys": 16, "DQ_HEADS": 1}, torch.float16)],
    ids=["S=211-stats-boxes-fp32", "S=211-2-heads-stacked-fp16", "S=173-tails-qmajor-short16-fp32",
         "S=173-tails-1-head-fp16"])
def test_full_first_gradients(S, cfgx, dtype):
    """``dkdv_full_first`` and ``dq_full_first``: whole entries through the even, unpacked steps (the dK/dV stats
    by boxes), the rest through the packed / masked ones, main and tail tables, against float64 with an lse
    gradient (GQA 4:2, two patterns)."""
    import longca_triton.kernels.block_sparse.op as BS

    mask = _full_first_mask(S)
    cfg = {**_FULL, **cfgx}
    tables = BS.tables_for(mask, BS.resolve_config(mask, 32, cfg), "cpu")
    for t in tables.values():
        if t.col_full is not None:  # both parts of some list are walked in every table
            assert bool((t.col_full > t.ptr[:-1]).any()) and bool((t.col_full < t.ptr[1:]).any())
    assert all(tables[n].full_first for n in ("dq", "dkdv"))
    compare_to_reference(lambda q, k, v: block_sparse_attention(q, k, v, mask, return_lse=True, config=cfg), mask,
                         S, S, 1, 4, 2, 32, dtype, dlse=True)


def test_full_first_op_path_and_kernel_switches(monkeypatch):
    """Through the torch.library ops the reordered tables travel with the others (the autograd path's gradients
    bit for bit); the launcher hands both kernels ``FULL_FIRST`` with their tables' ``col_full``, and the main dK/dV
    launch the stats boxes (its whole entries), which a packed table without it does not get."""
    import longca_triton.kernels.block_sparse.op as BS

    mask = _full_first_mask()
    cfg = {**_FULL, "DKDV_HEADS": 1, "dkdv_stats_tma": True, "dq_short_keys": 16}
    q, k, v, do = _op_path_grads_equal(mask, cfg)
    for full in (True, False):
        launches = _record_launches(monkeypatch, BS, ("block_sparse_bwd_dkdv_kernel", "block_sparse_bwd_dq_kernel"))
        c = BS.resolve_config(mask, 32, {**cfg, "dkdv_full_first": full, "dq_full_first": full})
        tables = BS.tables_for(mask, c, "cpu")
        BS.block_sparse_bwd(do, q, k, v, torch.zeros_like(q), torch.zeros(1, 4, 211), mask, tables, 32 ** -0.5, c)
        assert [kw["FULL_FIRST"] for kw in launches] == [full, full]
        assert [kw["COL_FULL"] is not None for kw in launches] == [full, full]
        assert [kw["STATS_TMA"] for kw in launches if "STATS_TMA" in kw] == [full]


@pytest.mark.parametrize("over,match", [
    ({"dkdv_full_first": True, "dkdv_list_chunk": 16}, "dkdv_full_first"),
    ({"dkdv_full_first": True, "dkdv_list_chunk": 0, "dkdv_sweep": 1}, "dkdv_full_first"),
    ({"dkdv_full_first": True, "dkdv_list_chunk": 0, "one_launch": True}, "dkdv_full_first"),
    ({"dkdv_full_first": True, "dkdv_list_chunk": 0, "dkdv_tail_rows": 16, "dkdv_tail_order": 3}, "dkdv_full_first"),
    ({"dq_full_first": True, "dq_list_chunk": 0}, "dq_full_first"),
    ({"dq_full_first": True, "dq_list_chunk": 0, "dq_pack_list": False, "dq_skew": True}, "dq_full_first"),
    ({"dq_full_first": 1}, "dq_full_first")],
    ids=["dkdv-chunked", "dkdv-sweep", "dkdv-one-launch", "dkdv-merged-tails", "dq-packed", "dq-skew", "dq-not-bool"])
def test_full_first_config_errors(over, match):
    import longca_triton.kernels.block_sparse.op as BS

    with pytest.raises(ValueError, match=match):
        BS.resolve_config(_full_first_mask(), 32, over)


@pytest.mark.parametrize("over,match", [
    ({"dq_short_keys": 24}, "dq_short_keys"),
    ({"dq_short_keys": 32}, "below DQ_BLOCK_N"),
    ({"dq_short_keys": True}, "dq_short_keys"),
    ({"dq_short_keys": 16, "dq_list_chunk": 16}, "entry by entry"),
    ({"dq_short_keys": 16, "dq_pack_list": True}, "entry by entry"),
    ({"dq_short_keys": 16, "dq_skew": True}, "entry by entry")],
    ids=["not-a-tile", "not-below-the-tile", "bool", "chunked-list", "packed-list", "skew"])
def test_dq_short_keys_bad_configs(over, match):
    import longca_triton.kernels.block_sparse.op as BS

    with pytest.raises(ValueError, match=match):
        BS.resolve_config(_short_mask(), 32, {"dq_pack_list": False, "dq_list_chunk": 0, **over})


def test_dkdv_parts_script_smoke(tmp_path):
    """experiments/gpu/dkdv_parts.py --smoke: the dK/dV pass, its main launch and (with tails) its tail launch
    timed apart, with the tiles' area against the kept area, one row per (problem, config), as measured."""
    import json

    _run_gpu_script("dkdv_parts", ["--smoke", "--out", str(tmp_path), "--heads", "4:2", "--rep", "1",
                                   "--configs", '{"t16": {"DKDV_BLOCK_N": 32, "dkdv_tail_rows": 16}}'])
    rows = [json.loads(x) for x in (tmp_path / "dkdv_parts.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["config"] == "t16"
    r = rows[0]
    assert r["tail_tiles"] > 0 and all(r[k] > 0 for k in ("pass_ms", "main_ms", "tail_ms"))
    # the tiles cover every kept pair at least once (main tiles and tails together)
    assert r["area_main"] + r["area_tail"] >= r["kept"] > 0


# ------------------------------------------------------------------ program order by steps (order_by_steps)
@pytest.mark.parametrize("major", ["q", "k"])
def test_order_by_steps_sorts_by_entries_and_keeps_a_blocks_tiles_together(major):
    """``by_steps``: the order is a permutation sorted by each tile's list entries (heaviest first, over all patterns
    and per pattern), ties in tile order, so one block's tiles (one list) sit next to each other; the lists
    themselves are unchanged. Without it a block's short last tile sorts after its full ones."""
    from longca_triton.kernels.block_sparse.plan import build_side_tables

    m = make_mask("varblock_sparse", 300, block=60, min_block=30, density=0.5, patterns=2, seed=7)
    rows, cols, bm = ((m.q_block_bounds, m.k_block_bounds, m.block_map) if major == "q"
                      else (m.k_block_bounds, m.q_block_bounds, m.block_map.transpose(1, 2).contiguous()))
    old = build_side_tables(rows, cols, bm, 16, 16, "cpu")
    new = build_side_tables(rows, cols, bm, 16, 16, "cpu", by_steps=True)
    for f in ("row_start", "row_end", "row_block", "ptr", "col_start", "col_end"):
        assert torch.equal(getattr(old, f), getattr(new, f))
    T, P, R = new.num_tiles, new.num_patterns, new.num_row_blocks
    steps = (new.ptr[1:] - new.ptr[:-1]).view(P, R)[:, new.row_block.long()]  # [P, T]
    for p, w in [(None, steps.sum(0))] + [(p, steps[p]) for p in range(P)]:
        seg = new.order[:T] if p is None else new.order[T * (1 + p):T * (2 + p)]
        assert sorted(seg.tolist()) == list(range(T))
        ws = w[seg.long()].tolist()
        assert ws == sorted(ws, reverse=True)
        # equal steps keep the tiles' own order: a block's tiles come out in a run
        for a, b in zip(seg.tolist(), seg.tolist()[1:]):
            if w[a] == w[b]:
                assert a < b
    # the old order weighs a block's short last tile by its rows: some block's tiles are split apart there
    sizes = (old.row_end - old.row_start)
    assert bool((sizes < 16).any())
    assert not torch.equal(old.order, new.order)


def test_order_by_steps_config_reaches_every_table_and_keeps_the_bits():
    """The config key builds every pass's tables (main and tail) by steps; the gradients are the default's bit for
    bit (only the programs' launch order changes)."""
    import longca_triton.kernels.block_sparse.op as BS

    mask = make_mask("varblock_sparse", 173, block=48, min_block=20, density=0.4, patterns=2, seed=3)
    cfgx = {"dkdv_tail_rows": 16, "dq_tail_rows": 16}
    cfg = BS.resolve_config(mask, 32, {**cfgx, "order_by_steps": True})
    assert cfg["order_by_steps"] is True and BS.resolve_config(mask, 32)["order_by_steps"] is False
    tables = BS.tables_for(mask, cfg, "cpu")
    plain = BS.tables_for(mask, BS.resolve_config(mask, 32, cfgx), "cpu")
    assert {"fwd", "dq", "dkdv", "dq_tail", "dkdv_tail"} <= set(tables)
    # the backward's tables are ordered by steps (some order moves on this mask), the forward's stays as it was
    assert torch.equal(tables["fwd"].order, plain["fwd"].order)
    assert any(not torch.equal(tables[n].order, plain[n].order) for n in ("dq", "dkdv", "dq_tail", "dkdv_tail"))
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, 173, h, 32) for h in (4, 2, 2, 4))
    grads = []
    for c in (cfgx, {**cfgx, "order_by_steps": True}):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        block_sparse_attention(*leaves, mask, config=c).backward(dout)
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_varblock_parts_launches_split_the_backward():
    """experiments/gpu/varblock_parts.py's parts (interpreter): the dK/dV main-only and tail-only calls together give
    the whole backward's dK / dV (each writes its own key rows: the tail table's rows and the main table's), the
    dQ-only call its dQ, and the backward without the tails its dQ; overlays add their whole backward."""
    import sys
    from pathlib import Path

    import longca_triton.kernels.block_sparse.op as BS

    saved = list(sys.path)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "gpu"))
    try:
        import varblock_parts as VP
    finally:
        sys.path[:] = saved  # the script puts its own folders first too
    mask = make_mask("varblock_sparse", 173, block=48, min_block=20, density=0.5, patterns=2, seed=3)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 173, h, 32) for h in (4, 2, 2))
    resolve = BS.resolve_config
    try:
        BS.resolve_config = lambda m, d, c=None, **kw: resolve(m, d, {"dkdv_tail_rows": 16, **(c or {})}, **kw)
        fns, cfg = VP.launches(mask, q, k, v, {"steps": {"order_by_steps": True}})
        assert list(fns) == ["bwd", "dq", "dkdv", "dkdv_main", "dkdv_tail", "bwd_no_dkdv_tail", "steps"]
        tables = BS.tables_for(mask, cfg, "cpu")
    finally:
        BS.resolve_config = resolve
    torch.manual_seed(1)
    dq, dk, dv = fns["bwd"]()
    tail_rows = torch.cat([torch.arange(int(s), int(e)) for s, e in zip(tables["dkdv_tail"].row_start,
                                                                          tables["dkdv_tail"].row_end)])
    main_rows = torch.cat([torch.arange(int(s), int(e)) for s, e in zip(tables["dkdv"].row_start,
                                                                         tables["dkdv"].row_end)])
    assert tail_rows.numel() and main_rows.numel() + tail_rows.numel() == 173
    _, dk_m, dv_m = fns["dkdv_main"]()
    _, dk_t, dv_t = fns["dkdv_tail"]()
    assert torch.equal(dk_m[:, main_rows], dk[:, main_rows]) and torch.equal(dv_m[:, main_rows], dv[:, main_rows])
    assert torch.equal(dk_t[:, tail_rows], dk[:, tail_rows]) and torch.equal(dv_t[:, tail_rows], dv[:, tail_rows])
    assert torch.equal(fns["dq"]()[0], dq) and torch.equal(fns["bwd_no_dkdv_tail"]()[0], dq)
    assert all(torch.equal(a, b) for a, b in zip(fns["steps"](), (dq, dk, dv)))

"""The dense family's launch configs (``kernels/tuning/dense.toml`` through ``dense.op.resolve_config``), on the CPU.

The resolved config of every (head dim, mask, GQA group, tensors given or not) on a faked sm_90 device is
compared with a frozen copy of what the resolver gave before the defaults became a table (its code rules),
with the retired keys left out: they were off in every one of those configs. FlashMask resolves the same
configs (same keys, same table). Also: the mask kinds, the explicit-config rules, the autotune search space.
"""

import pytest
import torch

import longca_triton.kernels.core.config as C
from longca_triton.kernels.core.runtime import config_head_dim
from longca_triton.kernels.dense import op as D
from longca_triton.kernels.dense import tune
from longca_triton.kernels.flashmask import op as FM
from longca_triton.masks import make_mask

KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "DKDV_BLOCK_M", "DKDV_BLOCK_N", "dkdv_num_warps",
        "dkdv_num_stages", "DQ_BLOCK_M", "DQ_BLOCK_N", "dq_num_stages", "dkdv_sweep", "bwd_streams", "dq_skew")
#: the distinct configs (keys in ``KEYS`` order)
FROZEN = {
    'c0': (64, 128, 4, 2, 64, 64, 4, 3, 128, 64, 3, 0, False, False),
    'c1': (128, 64, 8, 2, 32, 64, 8, 2, 64, 64, 2, 0, False, False),
    'c2': (128, 128, 8, 3, 32, 64, 4, 3, 128, 64, 3, 0, False, False),
    'c3': (128, 128, 8, 3, 64, 64, 4, 2, 128, 64, 3, 0, True, False),
    'c4': (128, 128, 8, 3, 64, 64, 4, 2, 128, 64, 3, 0, True, True),
    'c5': (128, 128, 8, 3, 64, 64, 4, 2, 128, 64, 3, 2, False, False),
    'c6': (128, 128, 8, 3, 32, 64, 4, 3, 128, 64, 3, 0, True, False),
}
#: case ``D_qk/D_v:mask:group:tensors`` -> its config in ``FROZEN``
CASES = {
    'c0': (
        "32/32:None:1:1 32/32:None:1:0 32/32:None:2:1 32/32:None:8:1 32/32:full:1:1 32/32:full:1:0 32/32:full:2:1 "
        "32/32:full:8:1 32/32:causal:1:1 32/32:causal:1:0 32/32:causal:2:1 32/32:causal:8:1 "
        "32/32:causal_document:1:1 32/32:causal_document:1:0 32/32:causal_document:2:1 32/32:causal_document:8:1 "
        "32/32:sliding_window:1:1 32/32:sliding_window:1:0 32/32:sliding_window:2:1 32/32:sliding_window:8:1 "
        "32/32:share_question:1:1 32/32:share_question:1:0 32/32:share_question:2:1 32/32:share_question:8:1 "
        "32/32:prefix_lm_causal:1:1 32/32:prefix_lm_causal:1:0 32/32:prefix_lm_causal:2:1 "
        "32/32:prefix_lm_causal:8:1 32/32:global_sliding_window:1:1 32/32:global_sliding_window:1:0 "
        "32/32:global_sliding_window:2:1 32/32:global_sliding_window:8:1 64/64:None:1:1 64/64:None:1:0 "
        "64/64:None:2:1 64/64:None:8:1 64/64:full:1:1 64/64:full:1:0 64/64:full:2:1 64/64:full:8:1 "
        "64/64:causal:1:1 64/64:causal:1:0 64/64:causal:2:1 64/64:causal:8:1 64/64:causal_document:1:1 "
        "64/64:causal_document:1:0 64/64:causal_document:2:1 64/64:causal_document:8:1 64/64:sliding_window:1:1 "
        "64/64:sliding_window:1:0 64/64:sliding_window:2:1 64/64:sliding_window:8:1 64/64:share_question:1:1 "
        "64/64:share_question:1:0 64/64:share_question:2:1 64/64:share_question:8:1 64/64:prefix_lm_causal:1:1 "
        "64/64:prefix_lm_causal:1:0 64/64:prefix_lm_causal:2:1 64/64:prefix_lm_causal:8:1 "
        "64/64:global_sliding_window:1:1 64/64:global_sliding_window:1:0 64/64:global_sliding_window:2:1 "
        "64/64:global_sliding_window:8:1 "
    ),
    'c1': (
        "192/128:None:1:1 192/128:None:1:0 192/128:None:2:1 192/128:None:8:1 192/128:full:1:1 192/128:full:1:0 "
        "192/128:full:2:1 192/128:full:8:1 192/128:causal:1:1 192/128:causal:1:0 192/128:causal:2:1 "
        "192/128:causal:8:1 192/128:causal_document:1:1 192/128:causal_document:1:0 192/128:causal_document:2:1 "
        "192/128:causal_document:8:1 192/128:sliding_window:1:1 192/128:sliding_window:1:0 "
        "192/128:sliding_window:2:1 192/128:sliding_window:8:1 192/128:share_question:1:1 "
        "192/128:share_question:1:0 192/128:share_question:2:1 192/128:share_question:8:1 "
        "192/128:prefix_lm_causal:1:1 192/128:prefix_lm_causal:1:0 192/128:prefix_lm_causal:2:1 "
        "192/128:prefix_lm_causal:8:1 192/128:global_sliding_window:1:1 192/128:global_sliding_window:1:0 "
        "192/128:global_sliding_window:2:1 192/128:global_sliding_window:8:1 256/256:None:1:1 256/256:None:1:0 "
        "256/256:None:2:1 256/256:None:8:1 256/256:full:1:1 256/256:full:1:0 256/256:full:2:1 256/256:full:8:1 "
        "256/256:causal:1:1 256/256:causal:1:0 256/256:causal:2:1 256/256:causal:8:1 256/256:causal_document:1:1 "
        "256/256:causal_document:1:0 256/256:causal_document:2:1 256/256:causal_document:8:1 "
        "256/256:sliding_window:1:1 256/256:sliding_window:1:0 256/256:sliding_window:2:1 "
        "256/256:sliding_window:8:1 256/256:share_question:1:1 256/256:share_question:1:0 "
        "256/256:share_question:2:1 256/256:share_question:8:1 256/256:prefix_lm_causal:1:1 "
        "256/256:prefix_lm_causal:1:0 256/256:prefix_lm_causal:2:1 256/256:prefix_lm_causal:8:1 "
        "256/256:global_sliding_window:1:1 256/256:global_sliding_window:1:0 256/256:global_sliding_window:2:1 "
        "256/256:global_sliding_window:8:1 "
    ),
    'c2': (
        "80/80:None:1:1 80/80:None:1:0 80/80:None:2:1 80/80:None:8:1 80/80:causal:1:1 80/80:causal:1:0 "
        "80/80:causal_document:1:1 80/80:causal_document:1:0 80/80:share_question:1:1 80/80:share_question:1:0 "
        "96/96:None:1:1 96/96:None:1:0 96/96:None:2:1 96/96:None:8:1 96/96:causal:1:1 96/96:causal:1:0 "
        "96/96:causal_document:1:1 96/96:causal_document:1:0 96/96:share_question:1:1 96/96:share_question:1:0 "
        "128/128:None:1:1 128/128:None:1:0 128/128:None:2:1 128/128:None:8:1 128/128:causal:1:1 "
        "128/128:causal:1:0 128/128:causal_document:1:1 128/128:causal_document:1:0 128/128:share_question:1:1 "
        "128/128:share_question:1:0 "
    ),
    'c3': (
        "80/80:full:1:1 80/80:full:2:1 80/80:full:8:1 80/80:sliding_window:1:1 80/80:sliding_window:2:1 "
        "80/80:sliding_window:8:1 80/80:global_sliding_window:1:1 80/80:global_sliding_window:2:1 "
        "80/80:global_sliding_window:8:1 96/96:full:1:1 96/96:full:2:1 96/96:full:8:1 96/96:sliding_window:1:1 "
        "96/96:sliding_window:2:1 96/96:sliding_window:8:1 96/96:global_sliding_window:1:1 "
        "96/96:global_sliding_window:2:1 96/96:global_sliding_window:8:1 "
    ),
    'c4': (
        "80/80:full:1:0 80/80:sliding_window:1:0 80/80:global_sliding_window:1:0 96/96:full:1:0 "
        "96/96:sliding_window:1:0 96/96:global_sliding_window:1:0 128/128:full:1:1 128/128:full:1:0 "
        "128/128:full:2:1 128/128:full:8:1 128/128:sliding_window:1:1 128/128:sliding_window:1:0 "
        "128/128:sliding_window:2:1 128/128:sliding_window:8:1 128/128:global_sliding_window:1:1 "
        "128/128:global_sliding_window:1:0 128/128:global_sliding_window:2:1 128/128:global_sliding_window:8:1 "
    ),
    'c5': (
        "80/80:causal:2:1 80/80:causal:8:1 80/80:causal_document:2:1 80/80:causal_document:8:1 "
        "80/80:share_question:2:1 80/80:share_question:8:1 96/96:causal:2:1 96/96:causal:8:1 "
        "96/96:causal_document:2:1 96/96:causal_document:8:1 96/96:share_question:2:1 96/96:share_question:8:1 "
        "128/128:causal:2:1 128/128:causal:8:1 128/128:causal_document:2:1 128/128:causal_document:8:1 "
        "128/128:share_question:2:1 128/128:share_question:8:1 "
    ),
    'c6': (
        "80/80:prefix_lm_causal:1:1 80/80:prefix_lm_causal:1:0 80/80:prefix_lm_causal:2:1 "
        "80/80:prefix_lm_causal:8:1 96/96:prefix_lm_causal:1:1 96/96:prefix_lm_causal:1:0 "
        "96/96:prefix_lm_causal:2:1 96/96:prefix_lm_causal:8:1 128/128:prefix_lm_causal:1:1 "
        "128/128:prefix_lm_causal:1:0 128/128:prefix_lm_causal:2:1 128/128:prefix_lm_causal:8:1 "
    ),
}
#: the interpreter's one pinned config, whatever the case
INTERPRETER = (32, 32, 4, 1, 32, 32, 4, 1, 32, 32, 1, 0, False, False)
S = 1024


def _cases():
    for name, text in CASES.items():
        for case in text.split():
            dims, mask, group, tensors = case.split(":")
            yield pytest.param(case, name, id=case.replace(":", "-").replace("/", "_"))


@pytest.fixture
def no_cache(monkeypatch):
    monkeypatch.setattr(C, "tuned_config", lambda *a, **kw: None)


def _resolve(module, case):
    dims, mask_name, group, tensors = case.split(":")
    d_qk, d_v = map(int, dims.split("/"))
    mask = None if mask_name == "None" else make_mask(mask_name, S)
    kw = dict(mask=mask)
    if tensors == "1":
        g = int(group)
        kw.update(q=torch.empty(1, 4, 8 * g, d_qk), k=torch.empty(1, 4, 8, d_qk), v=torch.empty(1, 4, 8, d_v))
    return module.resolve_config(config_head_dim(d_qk, d_v), torch.bfloat16, **kw)


@pytest.mark.parametrize("case,want", list(_cases()))
def test_resolved_config_is_the_frozen_one_on_sm90(case, want, no_cache, monkeypatch):
    monkeypatch.setattr(D, "_interpreting", lambda: False)
    cfg = _resolve(D, case)
    assert set(cfg) == set(KEYS) == set(D.CONFIG_KEYS)
    assert tuple(cfg[k] for k in KEYS) == FROZEN[want]
    assert _resolve(FM, case) == cfg  # FlashMask: the dense config


@pytest.mark.parametrize("case", ["64/64:causal:8:1", "96/96:full:1:1", "192/128:None:1:0", "128/128:sliding_window:2:1"])
def test_interpreter_config_is_pinned(case, no_cache):
    cfg = _resolve(D, case)
    assert tuple(cfg[k] for k in KEYS) == INTERPRETER
    assert _resolve(FM, case) == cfg


def test_mask_kinds():
    """``mask_kind`` at the measured length: full masks, masks of (nearly) equal dK/dV work, and the rest."""
    kinds = {m: D.mask_kind(make_mask(m, 16384)) for m in ("full", "causal", "causal_document", "sliding_window")}
    assert kinds == {"full": "full", "causal": "uneven", "causal_document": "uneven", "sliding_window": "even"}
    assert D.mask_kind(None) is None
    assert [D.table_dim(d) for d in (16, 64, 80, 128, 192, 256)] == [64, 64, 128, 128, 256, 256]


def test_explicit_dkdv_tile_runs_head_major(no_cache, monkeypatch):
    """A config naming a dK/dV tile key without ``dkdv_sweep`` goes head-major (the table's sweep was measured on
    its own tile); a forward tweak keeps the sweep; bad values are refused."""
    monkeypatch.setattr(D, "_interpreting", lambda: False)
    causal = make_mask("causal", 1024)

    def resolve(config, hq=8, hkv=1):
        q, k = torch.empty(1, 1024, hq, 128), torch.empty(1, 1024, hkv, 128)
        return D.resolve_config(128, torch.bfloat16, config, q=q, k=k, mask=causal)

    assert resolve(None)["dkdv_sweep"] == 2 and resolve(None)["DKDV_BLOCK_M"] == 64
    assert resolve(None, 8, 8)["dkdv_sweep"] == 0
    assert resolve({"BLOCK_M": 64})["dkdv_sweep"] == 2
    assert resolve({"DKDV_BLOCK_M": 32}) == {**resolve(None), "DKDV_BLOCK_M": 32, "dkdv_sweep": 0}
    assert resolve({"DKDV_BLOCK_M": 32, "dkdv_sweep": 2})["dkdv_sweep"] == 2
    for bad in (3, -1, 1.5, True, "rows"):
        with pytest.raises(ValueError, match="dkdv_sweep"):
            D.resolve_config(32, torch.float32, {"dkdv_sweep": bad})
    with pytest.raises(ValueError, match="unknown dense-attention config keys"):
        D.resolve_config(32, torch.float32, {"one_launch": True})
    assert D.resolve_config(32, torch.float32, {"bwd_streams": 1})["bwd_streams"] is True


def test_dq_skew_only_where_the_head_dim_fills_the_tile(no_cache, monkeypatch):
    """Full masks take ``dq_skew`` at D = 128, not at 80 / 96 on the same padded tile nor with D_v = 64 under it;
    an explicit config still sets it."""
    monkeypatch.setattr(D, "_interpreting", lambda: False)
    full = make_mask("full", 256)
    k = torch.empty(1, 256, 2, 128)
    for d, want in ((128, True), (96, False), (80, False)):
        q = torch.empty(1, 256, 8, d)
        assert D.resolve_config(128, torch.bfloat16, None, q=q, k=k[..., :d], v=k[..., :d], mask=full)["dq_skew"] is want
    q = torch.empty(1, 256, 8, 128)
    assert D.resolve_config(128, torch.bfloat16, None, q=q, k=k, v=k[..., :64], mask=full)["dq_skew"] is False
    q = torch.empty(1, 256, 8, 96)
    cfg = D.resolve_config(128, torch.bfloat16, {"dq_skew": True}, q=q, k=k[..., :96], v=k[..., :96], mask=full)
    assert cfg["dq_skew"] is True


def test_autotune_cache_overrides_the_table(monkeypatch):
    monkeypatch.setattr(C, "tuned_config", lambda *a, **kw: {"DQ_BLOCK_M": 64})
    q = torch.empty(1, 64, 4, 32)
    cfg = D.resolve_config(32, torch.float32, q=q, k=q, mask=make_mask("causal", 64))
    assert cfg["DQ_BLOCK_M"] == 64
    assert D.resolve_config(32, torch.float32, {}, q=q, k=q, mask=make_mask("causal", 64))["DQ_BLOCK_M"] == 32


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_autotune_candidates_resolve(head_dim):
    """Every candidate of every group sets only dense keys and resolves; the dK/dV group searches each tile
    head-major (first) and with the descending sweep at D <= 128, the measured pair among them."""
    for group in tune.GROUPS:
        cands = tune.candidates(group, 64, head_dim)
        assert cands
        for c in cands:
            assert set(c) <= set(D.CONFIG_KEYS)
            D.resolve_config(head_dim, torch.bfloat16, c)
    if head_dim <= 128:
        cands = tune.candidates("dkdv", 64, head_dim)
        head_major = [c for c in cands if c["dkdv_sweep"] == 0]
        assert cands[0]["dkdv_sweep"] == 0
        assert [{**c, "dkdv_sweep": 2} for c in head_major] == [c for c in cands if c["dkdv_sweep"] == 2]
        assert dict(DKDV_BLOCK_M=64, DKDV_BLOCK_N=64, dkdv_num_warps=4, dkdv_num_stages=2, dkdv_sweep=2) in cands
    with pytest.raises(ValueError, match="key group"):
        tune.candidates("bwd", 64, head_dim)


def test_uneven_key_work_separates_the_static_masks():
    """``tuned.uneven_key_work``: the share of key tiles whose area is off the median by more than a
    quarter. The masks the table's uneven row was measured a gain on are above ``UNEVEN_SHARE``, the ones
    it lost on (even programs) below it."""
    from longca_triton.kernels.core.tuned import uneven_key_work

    S = 16384  # the measured length; O(S) from the column intervals
    work = {m: uneven_key_work(make_mask(m, S, seed=0, **({"prefix": S // 3} if m == "prefix_lm_causal" else {})))
            for m in ("full", "causal", "causal_document", "share_question", "full_document", "prefix_lm_causal",
                      "sliding_window", "sliding_window_causal", "global_sliding_window")}
    assert work["full"] == 0.0
    for m in ("causal", "causal_document", "share_question", "full_document", "prefix_lm_causal"):
        assert work[m] >= D.UNEVEN_SHARE, (m, work[m])
    for m in ("sliding_window", "sliding_window_causal", "global_sliding_window"):
        assert work[m] < D.UNEVEN_SHARE, (m, work[m])
    assert 0.7 <= work["causal"] <= 0.8  # a quarter of the tiles sit within 25 % of the median
    assert uneven_key_work(make_mask("block_sparse", 1024, block=128, density=0.3, seed=0)) == 0.0


@pytest.mark.parametrize("sq,sk,seed", [(300, 300, 1), (100, 437, 2), (513, 90, 3)])
def test_uneven_key_work_counts_each_key_tiles_area(sq, sk, seed):
    """``RangeMask.key_tile_areas`` (behind ``uneven_key_work``: a difference array over the row
    intervals) are the dense mask's column sums per tile, Sq != Sk and empty columns included."""
    import numpy as np

    from longca_triton.kernels.core.tuned import uneven_key_work
    from utils import random_range_mask

    mask = random_range_mask(sq, sk, seed)
    cols = mask.to_dense().sum(0).numpy()  # [Sk]
    for block_n in (16, 64):
        work = np.add.reduceat(cols, np.arange(0, sk, block_n))
        assert np.array_equal(mask.key_tile_areas(block_n), work)
        work = work[work > 0]
        med = np.median(work)
        assert uneven_key_work(mask, block_n) == pytest.approx(np.mean(np.abs(work - med) > 0.25 * med))

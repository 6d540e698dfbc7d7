"""The Gluon family's launch config on the CPU (``kernels/gluon/config.py``, ``kernels/tuning/gluon.toml``):
the shipped table's configs (frozen), the rules an explicit or cached config meets, validation, shared
memory, and the autotune search space (``kernels/gluon/tune.py``)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from utils import random_range_mask, small_mask

import longca_triton as lt
from longca_triton.kernels.gluon import config as G
from longca_triton.kernels.gluon import op as GO
from longca_triton.kernels.gluon.tune import gluon_candidates
from longca_triton.kernels.tuning import load_table
from longca_triton.masks import STATIC_MASK_NAMES

#: resolve_config's output before the defaults became a table (the rows replaced if-rules): per head
#: dims, per mask (name@S) and explicit config, the kept keys, then consumer_regs and snake (now derived)
_FROZEN = json.loads((Path(__file__).parent / "data" / "gluon_resolved_base.json").read_text())
_DIMS = [(64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (256, 256), (32, 32), (48, 48), (120, 120),
         (64, 128), (128, 64), (160, 160)]
_OVERLAYS = {"": None, "consumers=2": {"consumers": 2}, "consumers=3": {"consumers": 3},
             "split_d=0": {"split_d": False}, "p_smem=1": {"p_smem": True}, "p_smem=0": {"p_smem": False},
             "stages=2": {"num_stages": 2}, "persistent=0": {"persistent": False}, "mq=64": {"dkdv_block_mq": 64},
             "split_partial=1": {"split_partial": True}, "mask_head=1": {"mask_head": 1}}


def _frozen_masks():
    masks = {"none": None}
    masks.update({f"{n}@4096": lt.make_mask(n, 4096) for n in STATIC_MASK_NAMES})
    masks.update({f"{n}@16384": lt.make_mask(n, 16384) for n in ("full", "causal", "causal_document",
                                                                   "prefix_lm_causal", "sliding_window_causal",
                                                                   "share_question")})
    masks["random@4096x2048"] = random_range_mask(4096, 2048, seed=3)
    masks["random@1000x3000"] = random_range_mask(1000, 3000, seed=4)
    return masks


@pytest.mark.parametrize("d,dv", _DIMS, ids=lambda x: str(x))
def test_resolved_configs_equal_the_frozen_ones(d, dv, monkeypatch):
    """Every head dim (80, 96, 192/128, 256 ...), every static mask at 4K and 16K, masks with Sq != Sk,
    no mask, GQA 64:8 through q / k, and explicit configs that meet the rules: the table gives what the
    if-rules gave, key for key (``consumer_regs`` and ``snake`` now follow ``consumers`` and
    ``persistent``; an explicit config that was refused is refused)."""
    monkeypatch.setenv("LONGCA_TRITON_AUTOTUNE_CACHE", "/nonexistent/autotune.json")
    keys, cases = _FROZEN["keys"], _FROZEN["cases"][f"{d}/{dv}"]
    seen = 0
    for mname, mask in _frozen_masks().items():
        for oname, overlay in _OVERLAYS.items():
            want = cases.get(f"{mname}|{oname}")
            if want is None:
                continue
            seen += 1
            if want == "error":
                with pytest.raises(ValueError):
                    G.resolve_config(d, torch.bfloat16, overlay, mask=mask, head_dim_v=dv)
                continue
            cfg = G.resolve_config(d, torch.bfloat16, overlay, mask=mask, head_dim_v=dv)
            cfg = dict(cfg, consumer_regs=G.consumer_regs(cfg["consumers"]), snake=cfg["persistent"])
            assert [cfg[k] for k in keys] == want, (mname, oname, {k: (cfg[k], w) for k, w in zip(keys, want)
                                                                   if cfg[k] != w})
        if f"{mname}|gqa64:8" in cases:
            seen += 1
            q = torch.empty(1, 4, 64, d, dtype=torch.bfloat16)
            k = torch.empty(1, 4, 8, d, dtype=torch.bfloat16)
            v = torch.empty(1, 4, 8, dv, dtype=torch.bfloat16)
            cfg = G.resolve_config(d, torch.bfloat16, None, q=q, k=k, v=v, mask=mask)
            cfg = dict(cfg, consumer_regs=G.consumer_regs(cfg["consumers"]), snake=cfg["persistent"])
            assert [cfg[key] for key in keys] == cases[f"{mname}|gqa64:8"], mname
    assert seen == len(cases)


def test_every_key_is_set_by_a_row_or_a_candidate():
    """The table's rows and the autotune candidates between them set every config key; the defaults set
    exactly the keys."""
    table = load_table("gluon", G.CONFIG_KEYS)
    assert set(table.defaults) == set(G.CONFIG_KEYS) and len(G.CONFIG_KEYS) <= 14
    set_by = {k for row in table.rows for k in row.config}
    for group, block, d in (("fwd", 128, 128), ("fwd", 64, 96), ("fwd", 128, 64), ("bwd", 128, 128)):
        set_by |= {k for c in gluon_candidates(group, block, d) for k in c}
    assert set_by == set(G.CONFIG_KEYS), set(G.CONFIG_KEYS) - set_by
    assert all(row.results and row.note for row in table.rows)


@pytest.mark.parametrize("name,want", [("causal", 1), ("prefix_lm_causal", 1), ("causal_blockwise", 2),
                                       ("full_document", 2), ("full", 0), ("sliding_window_causal", 2),
                                       ("global_sliding_window", 2), ("causal_document", 2), ("sliding_window", 2),
                                       ("prefix_lm_document", 2), ("share_question", 0)])
def test_mask_head_default(name, want):
    """At D = 128 ``mask_head`` is the default where at most ``MASK_HEAD_REST_TILES`` of the query tiles
    have partial tiles beyond the head ones (16K): one where no query tile has two (causal), or where
    three consumers run (prefix_lm_causal, 13 of 86 beyond one); two with two consumers where any has
    two (causal_blockwise, full_document 14 of 128 beyond two, the windows none); off where more do
    (share_question 112 of 128) or there are no partial tiles; other dims do without; a config naming
    it decides . It takes precedence over the split launch."""
    mask = lt.make_mask(name, 16384)
    cfg = G.resolve_config(128, torch.bfloat16, mask=mask)
    assert cfg["mask_head"] == want and type(cfg["mask_head"]) is int
    assert G.resolve_config(64, torch.bfloat16, mask=mask)["mask_head"] == 0
    # D = 96: the same rule on its sparse masks (two consumers, padded tiles); its dense masks run split
    # tiles, which the merging launch cannot take
    d96 = G.resolve_config(96, torch.bfloat16, mask=mask)
    assert d96["mask_head"] == (0 if d96["split_d"] else want), d96
    assert G.resolve_config(128, torch.bfloat16, {"mask_head": 0}, mask=mask)["mask_head"] == 0
    assert G.resolve_config(128, torch.bfloat16, {"mask_head": 1}, mask=mask)["mask_head"] == 1
    # a config naming the split launch gets it, not mask_head
    split = G.resolve_config(128, torch.bfloat16, {"split_partial": True}, mask=mask)
    assert split["mask_head"] == 0 and split["split_partial"] is True
    pieces = GO.fwd_plan(mask, cfg, "cpu")
    assert want == (isinstance(pieces, tuple) and pieces[0].mask_head)


@pytest.mark.parametrize("name", ["full", "causal", "causal_document", "sliding_window_causal", "full_document"])
def test_rowsum_mma_default_and_smem(name):
    """``rowsum_mma`` is D = 64's default where its forward runs persistent (the sparser masks), off on
    the dense ones and at D = 96 / 128; a config decides; its block of ones counts in the shared
    memory bound (three consumers with P in shared memory at D = 128 fill it to the byte)."""
    mask = lt.make_mask(name, 16384)
    cfg = G.resolve_config(64, torch.bfloat16, mask=mask)
    assert cfg["rowsum_mma"] == cfg["persistent"] == (mask.density < 0.5)
    assert not G.resolve_config(96, torch.bfloat16, mask=mask)["rowsum_mma"]
    assert not G.resolve_config(128, torch.bfloat16, mask=mask)["rowsum_mma"]
    assert not G.resolve_config(64, torch.bfloat16, {"rowsum_mma": False}, mask=mask)["rowsum_mma"]
    assert G.resolve_config(128, torch.bfloat16, {"rowsum_mma": True}, mask=mask)["rowsum_mma"]
    base = G.smem_bytes(128, 128, 2, consumers=3, p_smem=True)
    assert G.smem_bytes(128, 128, 2, consumers=3, p_smem=True, rowsum_mma=True) == base + 128 * 8 * 2 <= G.SMEM_LIMIT


def test_default_mask_head_rule_and_bad_values():
    """``default_mask_head`` by hand; ``mask_head`` outside ``MASK_HEAD`` is refused by name."""
    n = 10
    assert G.default_mask_head(np.zeros(n, int), 2) == 0
    assert G.default_mask_head(np.ones(n, int), 2) == 1  # one partial tile a query tile: one masked step
    assert G.default_mask_head(np.full(n, 2), 2) == 2 and G.default_mask_head(np.full(n, 2), 3) == 0
    assert G.default_mask_head(np.array([2] * 5 + [1] * 5), 3) == 1  # 5 of 10 beyond one <= 0.6
    assert G.default_mask_head(np.array([3] * 7 + [2] * 3), 2) == 0  # 7 of 10 beyond two > 0.6
    mask = lt.make_mask("causal", 1024)
    for bad in (3, -1, "two", 1.5, True):
        with pytest.raises(ValueError, match="mask_head"):
            G.resolve_config(128, torch.bfloat16, {"mask_head": bad}, mask=mask)


@pytest.mark.parametrize("name,want", [("causal", True), ("prefix_lm_causal", True), ("causal_blockwise", False),
                                       ("full_document", False), ("full", False), ("sliding_window_causal", False)])
def test_split_partial_default_where_partial_tiles_are_few(name, want):
    """At D = 128 the split launch is the default where partial tiles are at most
    ``SPLIT_PARTIAL_SHARE`` of the visited ones (16K: causal 1.6 %, prefix_lm_causal 1.0 %; off at
    causal_blockwise 4.9 %, full_document 8.7 %, and without partial tiles); other dims keep one
    launch; a config naming it decides."""
    mask = lt.make_mask(name, 16384)
    cfg = G.resolve_config(128, torch.bfloat16, mask=mask)
    assert cfg["split_partial"] is want
    bt = mask.block_tables(G.fwd_block_m(cfg), cfg["BLOCK_N"])
    assert want == (0 < bt.num_partial <= G.SPLIT_PARTIAL_SHARE * (bt.num_full + bt.num_partial))
    assert G.resolve_config(64, torch.bfloat16, mask=mask)["split_partial"] is False
    assert G.resolve_config(128, torch.bfloat16, {"split_partial": False}, mask=mask)["split_partial"] is False


def test_split_partial_rules():
    """The split launch's merge takes O as one head-dim piece: refused with a split D_v."""
    assert G.resolve_config(96, torch.bfloat16, {"split_partial": True})["split_partial"] is True
    with pytest.raises(ValueError, match="one head-dim piece"):
        G.resolve_config(96, torch.bfloat16, {"split_partial": True, "split_d": True})


# ------------------------------------------------------------------ configs
#: (D_qk, D_v) the forward's defaults are checked at (64 and 128 measured, the rest compile-checked)
HEAD_DIMS = [(64, 64), (128, 128), (8, 8), (80, 80), (96, 96), (192, 128), (256, 256), (64, 128), (256, 64)]


#: (D_qk, D_v) the forward's defaults are checked at (64 and 128 measured, the rest compile-checked)
HEAD_DIMS = [(64, 64), (128, 128), (8, 8), (80, 80), (96, 96), (192, 128), (256, 256), (64, 128), (256, 64)]


@pytest.mark.parametrize("d,dv", HEAD_DIMS, ids=lambda x: str(x))
def test_default_configs_validate_and_fit(d, dv):
    cfg = G.resolve_config(d, torch.bfloat16, head_dim_v=dv)
    assert G.smem_bytes(d, cfg["BLOCK_N"], cfg["num_stages"], head_dim_v=dv, consumers=cfg["consumers"]) <= G.SMEM_LIMIT
    producer, maxnreg = G.regs(G.consumer_regs(cfg["consumers"]), cfg["consumers"])
    assert producer >= 24 and cfg["consumers"] * G.consumer_regs(cfg["consumers"]) + producer <= G.REG_BUDGET
    # the mixed backward at D = 128, the dense one elsewhere; the Gluon rings fit where they can run
    assert cfg["bwd_design"] == ("mixed" if d == dv == 128 else "plain")
    if d == dv and d in G.BWD_HEAD_DIMS:
        t = G.bwd_tiles(d)
        assert G.bwd_smem_bytes("dq", d, t["dq_block_n"], t["dq_stages"]) <= G.SMEM_LIMIT
        assert G.bwd_smem_bytes("dkdv", d, cfg["dkdv_block_mq"], t["dkdv_stages"]) <= G.SMEM_LIMIT
    # padded tiles <= 128 keep D=128's forward defaults; 256-wide ones take 64-row key tiles and
    # the deepest ring (<= 3) that fits
    wide = {(192, 128): (64, 3), (256, 256): (64, 2), (256, 64): (64, 3)}
    assert (cfg["BLOCK_N"], cfg["num_stages"]) == wide.get((d, dv), (128, 3))


@pytest.mark.parametrize("name,d,want", [("full", 128, 64), ("causal", 128, 32), ("full_document", 128, 32),
                                          ("full", 64, 64), ("block_causal_document", 128, 64),
                                          ("block_causal_document-unaligned", 128, 32), ("prefix_lm_causal", 128, 32)],
                         ids=lambda x: str(x))
def test_masks_without_partial_tiles_walk_64_row_query_tiles_in_dkdv(name, d, want):
    """Mask-dependent default: a mask whose every touched tile is full (full; block_causal_document
    on 64-aligned blocks) takes ``dkdv_block_mq=64`` at D = 128 (measured 1.17x on full, 1.15x on
    block_causal_document, 0.83-0.89x on the rest); an explicit config still wins."""
    from longca_triton.masks import make_mask

    if name == "block_causal_document":
        mask = make_mask(name, 1024, block=128)
    elif name.endswith("-unaligned"):
        mask = make_mask("block_causal_document", 1000, block=100)
    else:
        mask = small_mask(name, 300)
    assert G.resolve_config(d, torch.bfloat16, mask=mask)["dkdv_block_mq"] == want
    assert G.resolve_config(d, torch.bfloat16, dict(dkdv_block_mq=32), mask=mask)["dkdv_block_mq"] == 32
    assert G.resolve_config(d, torch.bfloat16)["dkdv_block_mq"] == (32 if d > 64 else 64)


def test_smem_bytes_pads_each_dim():
    assert G.smem_bytes(128, 128, 3) == 128 * 128 * 2 + 3 * 128 * 256 * 2 + 1024
    assert G.smem_bytes(96, 128, 3) == G.smem_bytes(128, 128, 3)
    assert G.smem_bytes(192, 64, 3, head_dim_v=128) == 128 * 256 * 2 + 3 * 64 * (256 + 128) * 2 + 1024
    assert G.smem_bytes(256, 64, 3) > G.SMEM_LIMIT >= G.smem_bytes(256, 64, 2)


@pytest.mark.parametrize("config,design", [
    (None, "mixed"),  # D = 128's default: Gluon dQ + dense dK/dV
    (dict(pingpong=True), "mixed"),  # forward keys only
    (dict(dkdv_block_mq=64), "split"),  # the Gluon dK/dV kernel's key asks for the design that runs it
    (dict(dkdv_block_mq=64, bwd_design="mixed"), "mixed"),  # unless the config names one
    (dict(bwd_design="plain"), "plain"),
    (dict(bwd_design="split"), "split"),
], ids=lambda x: str(x))
def test_bwd_design_default_and_what_a_config_asks_for(config, design):
    assert G.resolve_config(128, torch.bfloat16, config)["bwd_design"] == design
    # D = 64 runs the dense backward by default; the dK/dV key asks for the Gluon pair there; at dims
    # the Gluon kernels cannot take it asks for nothing
    assert G.resolve_config(64, torch.bfloat16)["bwd_design"] == "plain"
    assert G.resolve_config(64, torch.bfloat16, dict(dkdv_block_mq=32))["bwd_design"] == "split"
    assert G.resolve_config(96, torch.bfloat16, dict(dkdv_block_mq=64))["bwd_design"] == "plain"


def test_bwd_design_from_the_autotune_cache(monkeypatch):
    import longca_triton.kernels.core.config as C

    q = torch.zeros(1, 64, 2, 128)
    mask = lt.make_mask("causal", 64)
    for entry, design in ((dict(dkdv_block_mq=64), "split"), (dict(bwd_design="plain"), "plain"),
                          (dict(num_stages=2), "mixed"), (dict(bwd_design="mixed", dkdv_block_mq=64), "mixed")):
        monkeypatch.setattr(C, "tuned_config", lambda spec, q, k, mask, v=None, e=entry: dict(e))
        assert G.resolve_config(128, torch.bfloat16, None, q=q, k=q, mask=mask)["bwd_design"] == design


def test_gluon_backward_off_where_it_cannot_run(monkeypatch):
    for d, dv in ((96, 96), (192, 128), (256, 256), (128, 64)):
        assert "dense backward" in G.bwd_reason(d, dv)
        # explicit: refused, naming why
        for design in ("mixed", "split"):
            with pytest.raises(ValueError, match=r"bwd_design.*takes head dims \(64, 128\) with D_v == D_qk"):
                G.resolve_config(d, torch.bfloat16, dict(bwd_design=design), head_dim_v=dv)
        # the dense backward, or other keys only: fine
        assert G.resolve_config(d, torch.bfloat16, dict(bwd_design="plain"), head_dim_v=dv)["bwd_design"] == "plain"
        assert G.resolve_config(d, torch.bfloat16, dict(pingpong=True), head_dim_v=dv)["bwd_design"] == "plain"
    assert G.bwd_reason(64) == G.bwd_reason(128, 128) == ""
    # from the autotune cache: turned off silently
    import longca_triton.kernels.core.config as C

    monkeypatch.setattr(C, "tuned_config", lambda spec, q, k, mask, v=None: dict(bwd_design="mixed", num_stages=2))
    q = torch.zeros(1, 64, 2, 96)
    cfg = G.resolve_config(96, torch.bfloat16, None, q=q, k=q, mask=lt.make_mask("causal", 64))
    assert cfg["num_stages"] == 2 and cfg["bwd_design"] == "plain"
    # the backend's bwd search space at such dims is that one design
    assert gluon_candidates("bwd", 64, 256) == [dict(bwd_design="plain")]
    for c in gluon_candidates("fwd", 64, 256):
        G.resolve_config(256, torch.bfloat16, c)


@pytest.mark.parametrize("bad,match", [
    (dict(BLOCK_N=32), "64 or 128"),
    (dict(BLOCK_N=96), "power of two"),
    (dict(num_stages=4), "does not fit"),
    (dict(num_stages=0), "does not fit"),
    (dict(nope=1), "unknown gluon-attention config keys"),
    (dict(consumer_regs=240), "unknown gluon-attention config keys"),  # follows consumers
    (dict(dkdv_block_mq=128), "dkdv_block_mq"),
    (dict(bwd_design="fused"), "bwd_design"),
    (dict(split_d=True), "split_d.*nothing to split"),
], ids=lambda x: json.dumps(x) if isinstance(x, dict) else x)
def test_bad_configs_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        G.resolve_config(128, torch.bfloat16, bad)


# ------------------------------------------------------------------ split head dims (split_d)
def test_split_pieces_are_two_powers_of_two():
    """The dims split_d takes, and their pieces: two powers of two D0 > D1 >= 16 (wgmma's k16)."""
    from longca_triton.kernels.gluon.fwd_parts import MIN_PIECE, head_pieces, split_pieces

    splittable = {d: split_pieces(d) for d in range(8, 257, 8) if split_pieces(d)}
    assert splittable == {48: (32, 16), 80: (64, 16), 96: (64, 32), 144: (128, 16), 160: (128, 32),
                          192: (128, 64)}
    for d, (d0, d1) in splittable.items():
        assert d0 + d1 == d and d0 > d1 >= MIN_PIECE and not d0 & (d0 - 1) and not d1 & (d1 - 1)
    # powers of two: nothing to split; 112 = 64 + 32 + 16 (three pieces); 72 = 64 + 8, 40 = 32 + 8
    # (a piece below k16); 24 = 16 + 8
    for d in (16, 32, 64, 128, 256, 112, 72, 40, 24, 200, 136):
        assert split_pieces(d) is None, d
    # what the kernel works on: the padded tile (second piece 0) unless split_d and the dim splits
    assert head_pieces(96, 128, False) == (128, 0) and head_pieces(96, 128, True) == (64, 32)
    assert head_pieces(80, 128, True) == (64, 16) and head_pieces(128, 128, True) == (128, 0)
    assert head_pieces(112, 128, True) == (128, 0) and head_pieces(192, 256, False) == (256, 0)


@pytest.mark.parametrize("d,dv", [(80, 80), (96, 96), (96, 128), (128, 96), (192, 128), (48, 48), (160, 160)],
                         ids=str)
def test_split_d_accepted_where_a_dim_splits(d, dv):
    cfg = G.resolve_config(d, torch.bfloat16, dict(split_d=True), head_dim_v=dv)
    assert cfg["split_d"] is True
    assert G.split_d_reason(d, dv) == ""
    # the split tiles take less shared memory than the padded ones, never more
    for bn, st in ((cfg["BLOCK_N"], cfg["num_stages"]), (64, 2)):
        assert (G.smem_bytes(d, bn, st, head_dim_v=dv, split_d=True)
                < G.smem_bytes(d, bn, st, head_dim_v=dv))


@pytest.mark.parametrize("d,dv,match", [
    (128, 128, "powers of two: nothing to split"), (64, 64, "powers of two"), (64, 128, "powers of two"),
    (112, 112, "head dim 112 .*not two powers of two"), (72, 72, "head dim 72"),
    (96, 112, "head dim 112 \\(of 96/112\\)"), (200, 128, "head dim 200"),
], ids=str)
def test_split_d_refused_where_no_dim_splits(d, dv, match):
    assert G.split_d_reason(d, dv)
    with pytest.raises(ValueError, match=f"config\\['split_d'\\]=True: .*{match}"):
        G.resolve_config(d, torch.bfloat16, dict(split_d=True), head_dim_v=dv)
    # off, or other keys only: fine; the default is off at every dim
    assert not G.resolve_config(d, torch.bfloat16, dict(split_d=False), head_dim_v=dv)["split_d"]
    assert not G.resolve_config(d, torch.bfloat16, None, head_dim_v=dv)["split_d"]


@pytest.mark.parametrize("name,d,want", [("full", 96, True), ("causal", 96, True), ("causal_document", 96, False),
                                          ("full", 80, False), ("full", 128, False)], ids=lambda x: str(x))
def test_split_d_default_by_mask(name, d, want):
    """``split_d`` defaults on at D = 96 on masks of density >= 0.5 (measured: full +3 %, causal
    +8 %, causal_document -8 %; D = 80 loses on full): an explicit config still wins."""
    mask = small_mask(name, 300)
    cfg = G.resolve_config(d, torch.bfloat16, mask=mask)
    assert cfg["split_d"] is want
    # the split tile runs three persistent consumers with register P and pv_sync, a 3-deep ring beside
    # the third consumer's Q tile; with two consumers the split tile's 4-deep ring; a mask below 0.6 at
    # 128 and below 0.5 at 96 runs persistent with O's own buffers (2 stages), full at 128 three
    # consumers with P in shared memory (2 stages)
    persist = mask.density < (0.6 if d == 128 else 0.5) and d in (96, 128)
    assert cfg["num_stages"] == (3 if want else 2 if (d == 128 or persist) else 3)
    if want:
        assert (cfg["consumers"], cfg["pv_sync"], cfg["persistent"], cfg["p_smem"]) == (3, True, True, False)
        two = G.resolve_config(d, torch.bfloat16, dict(consumers=2), mask=mask)
        assert (two["num_stages"], two["pv_sync"], two["persistent"]) == (4, False, False)
    else:
        assert not cfg["pv_sync"]
    # and ping-pongs
    assert cfg["pingpong"] is want
    padded = G.resolve_config(d, torch.bfloat16, dict(split_d=False), mask=mask)
    assert padded["split_d"] is False and padded["pingpong"] is False, "the padded tile keeps its defaults"
    if want:  # ... and the split tile's three persistent consumers go with it
        assert (padded["consumers"], padded["pv_sync"], padded["persistent"]) == (2, False, False)
    assert G.resolve_config(d, torch.bfloat16, dict(split_d=False, pingpong=True), mask=mask)["pingpong"]


def test_split_d_ring_depth_leaves_a_tuned_padded_depth_alone(monkeypatch):
    """The 4-deep ring comes with the default split tile only: a tuned padded tile keeps its own
    depth, and a padded tile asked for without a depth gets the padded default."""
    import longca_triton.kernels.core.config as C

    mask = small_mask("full", 300)
    q = torch.zeros(1, 300, 2, 96)
    monkeypatch.setattr(C, "tuned_config", lambda spec, q, k, mask, v=None: dict(split_d=False, num_stages=2))
    cfg = G.resolve_config(96, torch.bfloat16, None, q=q, k=q, mask=mask)
    assert (cfg["split_d"], cfg["num_stages"], cfg["pingpong"]) == (False, 2, False)
    # a tuned ping-pong is the tuner's choice too
    monkeypatch.setattr(C, "tuned_config", lambda spec, q, k, mask, v=None: dict(split_d=False, num_stages=2,
                                                                                 pingpong=True))
    cfg = G.resolve_config(96, torch.bfloat16, None, q=q, k=q, mask=mask)
    assert (cfg["split_d"], cfg["num_stages"], cfg["pingpong"]) == (False, 2, True)
    monkeypatch.setattr(C, "tuned_config", lambda spec, q, k, mask, v=None: None)
    cfg = G.resolve_config(96, torch.bfloat16, dict(split_d=False), q=q, k=q, mask=mask)
    assert (cfg["split_d"], cfg["num_stages"]) == (False, 3)


def test_split_d_from_the_autotune_cache_is_dropped_where_it_cannot_split(monkeypatch):
    import longca_triton.kernels.core.config as C

    monkeypatch.setattr(C, "tuned_config", lambda spec, q, k, mask, v=None: dict(split_d=True))
    mask = lt.make_mask("causal", 64)
    for d, want in ((128, False), (112, False), (96, True), (80, True)):
        q = torch.zeros(1, 64, 2, d)
        assert G.resolve_config(d, torch.bfloat16, None, q=q, k=q, mask=mask)["split_d"] is want, d


def test_split_d_smem_and_deeper_rings():
    """Split tiles hold the true dims: 96 is Q 2 x 64 x 96 and K + V 128 x (96 + 96) a stage, so a
    4-stage ring fits where the padded 128-wide one does not (80: 5 stages)."""
    assert G.smem_bytes(96, 128, 3, split_d=True) == 128 * 96 * 2 + 3 * 128 * 192 * 2 + 1024
    assert G.smem_bytes(80, 128, 5, split_d=True) == 128 * 80 * 2 + 5 * 128 * 160 * 2 + 1024
    assert G.smem_bytes(96, 128, 3, head_dim_v=128, split_d=True) == 128 * 96 * 2 + 3 * 128 * 224 * 2 + 1024
    # a dim that does not split keeps its padded tile even with split_d
    assert G.smem_bytes(112, 128, 3, split_d=True) == G.smem_bytes(112, 128, 3)
    assert G.resolve_config(96, torch.bfloat16, dict(split_d=True, num_stages=4))["num_stages"] == 4
    assert G.resolve_config(80, torch.bfloat16, dict(split_d=True, num_stages=5))["num_stages"] == 5
    for d, st in ((96, 4), (80, 4), (96, 5), (80, 6)):
        with pytest.raises(ValueError, match="does not fit"):
            G.resolve_config(d, torch.bfloat16, dict(num_stages=st, split_d=st > 4 + (d == 80)))


def test_o_fits_q_by_piece():
    """O is staged in Q's buffers (TMA store) where its pieces fit Q's, piece by piece."""
    from longca_triton.kernels.gluon.fwd_parts import o_fits_q

    assert o_fits_q(96, 96, 128, 128, True) and o_fits_q(80, 80, 128, 128, True)
    assert o_fits_q(96, 80, 128, 128, True)  # (64, 16) into (64, 32): a view of piece 1
    assert not o_fits_q(96, 128, 128, 128, True)  # (128, 0) into (64, 32)
    assert not o_fits_q(80, 96, 128, 128, True)  # piece 1: 32 into 16
    assert o_fits_q(192, 128, 256, 128, True) and o_fits_q(192, 128, 256, 128, False)
    assert o_fits_q(96, 128, 128, 128, False) and not o_fits_q(64, 128, 64, 128, True)


@pytest.mark.parametrize("d,dv,bad", [
    (256, 256, dict(num_stages=3)), (256, 256, dict(BLOCK_N=128, num_stages=2)),
    (192, 128, dict(num_stages=4)), (192, 128, dict(BLOCK_N=128, num_stages=2)),
], ids=str)
def test_ring_too_deep_for_wide_head_dims(d, dv, bad):
    with pytest.raises(ValueError, match=f"does not fit.*D={d if d == dv else f'{d}/{dv}'}"):
        G.resolve_config(d, torch.bfloat16, bad, head_dim_v=dv)


def test_consumers_config():
    """``consumers``: three consumer warpgroups by default where both head-dim tiles are 64 wide (160
    registers each, a ring as deep as fits beside three Q tiles), two elsewhere; bad values and a
    register split that leaves the producer nothing are refused, naming the key."""
    bf = torch.bfloat16
    for d, dv, want in ((64, 64, 3), (48, 48, 3), (64, 128, 2), (96, 96, 2), (128, 128, 2), (256, 256, 2)):
        cfg = G.resolve_config(d, bf, head_dim_v=dv)
        assert cfg["consumers"] == want, (d, dv, cfg)
        assert G.consumer_regs(cfg["consumers"]) == (160 if want == 3 else 240)
        assert G.fwd_block_m(cfg) == 64 * want
        assert G.smem_bytes(d, cfg["BLOCK_N"], cfg["num_stages"], head_dim_v=dv, consumers=want) <= G.SMEM_LIMIT
    # asked for at D = 128: 160 registers, and the deepest ring that fits beside three Q tiles
    cfg = G.resolve_config(128, bf, {"consumers": 3})
    assert cfg["num_stages"] == 2
    assert G.smem_bytes(128, 128, 3, consumers=3) > G.SMEM_LIMIT >= G.smem_bytes(128, 128, 2, consumers=3)
    for bad in (1, 4, True, "3"):
        with pytest.raises(ValueError, match="consumers"):
            G.resolve_config(64, bf, {"consumers": bad})
    with pytest.raises(ValueError, match="does not fit"):
        G.resolve_config(128, bf, {"consumers": 3, "num_stages": 3})
    # the default's register split: the producer keeps 24, the launch gets an even share
    assert G.regs(160, 3) == (24, 128) and G.regs(240, 2) == (24, 168)


@pytest.mark.parametrize("name,want", [("full", True), ("causal", False), ("prefix_lm_causal", True),
                                       ("causal_blockwise", False), ("share_question", False),
                                       ("global_sliding_window", False), (None, False)])
def test_p_smem_default_on_dense_masks_at_d128(name, want):
    """``p_smem`` (P V with P from shared memory) with three consumers is the D = 128 default on masks
    of density >= 0.6, with the ring that fits beside three Q and three P tiles; elsewhere,
    and at other head dims, two consumers with P in registers."""
    bf = torch.bfloat16
    mask = lt.make_mask(name, 16384) if name else None  # the densities measured (16K)
    cfg = G.resolve_config(128, bf, mask=mask)
    assert (cfg["consumers"], cfg["p_smem"]) == ((3, True) if want else (2, False)), (name, cfg)
    assert cfg["pingpong"] is False
    st = cfg["num_stages"]
    assert G.smem_bytes(128, 128, st, consumers=cfg["consumers"], p_smem=cfg["p_smem"]) <= G.SMEM_LIMIT
    if want:
        # Q 48 KB + P 48 KB + 64 KB a stage: two stages
        assert st == 2 and G.smem_bytes(128, 128, 3, consumers=3, p_smem=True) > G.SMEM_LIMIT
    for d in (64, 96):  # measured: a loss at 64 (443 vs 511 TFLOP/s), a tie at 96
        assert G.resolve_config(d, bf, mask=lt.make_mask("full", 1024))["p_smem"] is False


def test_p_smem_follows_the_configs_consumers():
    """A config (or autotune entry) that picks two consumers on a dense mask gets P in registers (p_smem
    was measured with three) and two consumers' registers; p_smem asked for explicitly stays, and
    its P tiles count against shared memory."""
    bf = torch.bfloat16
    full = lt.make_mask("full", 1024)
    cfg = G.resolve_config(128, bf, {"consumers": 2}, mask=full)
    assert (cfg["consumers"], cfg["p_smem"]) == (2, False)
    cfg = G.resolve_config(128, bf, {"consumers": 2, "p_smem": True}, mask=full)
    assert cfg["p_smem"] is True and cfg["num_stages"] == 2  # Q 32 + P 32 + 3 x 64 KB does not fit
    assert G.smem_bytes(128, 128, 2, p_smem=True) - G.smem_bytes(128, 128, 2) == 2 * 64 * 128 * 2
    assert G.resolve_config(64, bf, {"p_smem": True})["num_stages"] == 3  # D = 64 fits three beside P
    with pytest.raises(ValueError, match="does not fit"):
        G.resolve_config(128, bf, {"consumers": 3, "p_smem": True, "num_stages": 3})


def test_persistent_defaults_and_rules():
    """D = 64, 96 below density 0.5 and 128 below 0.6: persistent, O in its own buffers, the deepest
    ring that fits beside them; dense masks one tile a CTA. A config that leaves two consumers / P in registers
    gets one tile a CTA back, an explicit ring that leaves no room for O's buffers stages O in Q's, and
    a config naming the consumers gets their registers."""
    from longca_triton.masks import make_mask

    bf = torch.bfloat16
    sparse, dense = make_mask("sliding_window_causal", 4096), make_mask("causal", 4096)
    cfg = G.resolve_config(128, bf, None, mask=sparse)
    assert (cfg["persistent"], cfg["o_own"], cfg["num_stages"], cfg["consumers"]) == (True, True, 2, 2)
    assert G.smem_bytes(128, 128, 2, o_own=True) <= G.SMEM_LIMIT < G.smem_bytes(128, 128, 3, o_own=True)
    cfg = G.resolve_config(128, bf, None, mask=dense)
    assert (cfg["persistent"], cfg["o_own"], cfg["consumers"]) == (True, True, 2)
    cfg = G.resolve_config(128, bf, None, mask=make_mask("full", 4096))
    assert (cfg["persistent"], cfg["o_own"], cfg["consumers"]) == (False, False, 3)
    assert G.resolve_config(128, bf, None)["persistent"] is False  # no mask: no mask rule
    # at 96 (padded, two consumers) a 2-stage ring, at 64 (three consumers) three beside O's buffers;
    # dims not measured keep one tile a CTA
    cfg = G.resolve_config(96, bf, None, mask=sparse)
    assert (cfg["persistent"], cfg["o_own"], cfg["num_stages"], cfg["split_d"]) == (True, True, 2, False)
    cfg = G.resolve_config(64, bf, None, mask=sparse)
    assert (cfg["persistent"], cfg["o_own"], cfg["num_stages"], cfg["consumers"]) == (True, True, 3, 3)
    assert G.resolve_config(64, bf, {"consumers": 2}, mask=sparse)["persistent"] is False
    for d, dv in ((80, 80), (192, 128), (256, 256)):
        assert G.resolve_config(d, bf, None, mask=sparse, head_dim_v=dv)["persistent"] is False
    # causal at 96: the split tile's three persistent consumers, not the sparse masks' launch
    cfg = G.resolve_config(96, bf, None, mask=dense)
    assert (cfg["persistent"], cfg["o_own"], cfg["consumers"], cfg["pv_sync"]) == (True, False, 3, True)
    assert G.resolve_config(64, bf, None, mask=dense)["persistent"] is False
    cfg = G.resolve_config(128, bf, {"consumers": 3, "p_smem": True}, mask=sparse)
    assert (cfg["persistent"], cfg["o_own"]) == (False, False)
    cfg = G.resolve_config(128, bf, {"num_stages": 3}, mask=sparse)
    assert (cfg["persistent"], cfg["o_own"], cfg["num_stages"]) == (True, False, 3)
    cfg = G.resolve_config(128, bf, {"persistent": False}, mask=sparse)
    assert (cfg["persistent"], cfg["o_own"], cfg["num_stages"]) == (False, True, 2)
    with pytest.raises(ValueError, match="does not fit"):
        G.resolve_config(128, bf, {"o_own": True, "num_stages": 3}, mask=sparse)


@pytest.mark.parametrize("d,three", [(64, (3, False)), (128, (3, True)), (96, (3, True)), (256, None)],
                         ids=lambda x: str(x))
def test_autotune_forward_candidates(d, three):
    """The forward's autotune candidates: two consumers with P in registers everywhere, three with P in
    registers at 64-wide tiles and through shared memory at 128-wide ones (the measured pairs), and there also
    with P in registers and ``pv_sync`` (D = 96's dense default), none at 256; every candidate fits shared memory
    and passes ``resolve_config`` as an explicit config."""
    cands = gluon_candidates("fwd", 128, d)
    pairs = {(c["consumers"], c["p_smem"]) for c in cands}
    sync = {(3, False)} if three == (3, True) else set()  # three register-P consumers with pv_sync, 128-wide tiles
    assert pairs == ({(2, False), three} | sync if three else {(2, False)}), pairs
    assert {c["consumers"] for c in cands if c["pv_sync"]} == ({3} if sync else set())
    assert all(not c["p_smem"] for c in cands if c["pv_sync"])
    # every candidate once as one tile a CTA and once persistent (O in Q's buffers), and with O's own
    # buffers where they fit
    launches = {(c["persistent"], c["o_own"]) for c in cands}
    own = G.smem_bytes(d, 128, 1, o_own=True) <= G.SMEM_LIMIT  # 256: a 128-key stage leaves no room
    assert launches == {(False, False), (True, False)} | ({(True, True)} if own else set()), launches
    for c in cands:
        r = G.resolve_config(d, torch.bfloat16, c)
        assert (r["consumers"], r["p_smem"], r["num_stages"]) == (c["consumers"], c["p_smem"], c["num_stages"])
        assert (r["persistent"], r["o_own"], r["pv_sync"]) == (c["persistent"], c["o_own"], c["pv_sync"])
        assert G.smem_bytes(d, c["BLOCK_N"], c["num_stages"], split_d=c["split_d"], consumers=c["consumers"],
                            p_smem=c["p_smem"], o_own=c["o_own"], rowsum_mma=c.get("rowsum_mma", False)) <= G.SMEM_LIMIT
        assert r["mask_head"] == c.get("mask_head", r["mask_head"]) and r["rowsum_mma"] == c.get("rowsum_mma", False)
    # mask_head 0 / 1 / 2 x rowsum_mma off / on, on the persistent launch with O's own buffers, P in registers
    knobs = [c for c in cands if "mask_head" in c]
    if own:
        assert {(c["mask_head"], c["rowsum_mma"]) for c in knobs} == {(m, r) for m in (0, 1, 2) for r in (False, True)}
        assert all(c["persistent"] and c["o_own"] and not c["p_smem"] for c in knobs), knobs
    else:
        assert not knobs


def test_gluon_tunable_search_space_fits_and_skips_off_gpu():
    from longca_triton.bench import autotune as at

    t = at.TUNABLES["triton-gluon"]
    assert t.groups == {"fwd": "fwd", "bwd": "bwd"}
    for d in (64, 128):
        bwd = t.candidates("bwd", 64, d)
        assert len(bwd) == 4
        for c in bwd:
            G.resolve_config(d, torch.bfloat16, c)
    for block, d in ((64, 128), (128, 128), (128, 64), (128, 96)):
        cands = t.candidates("fwd", block, d)
        assert cands and all(c["BLOCK_N"] == block for c in cands)
        for c in cands:
            G.resolve_config(d, torch.bfloat16, c)  # every candidate is a valid config
        assert {c["pingpong"] for c in cands} == {True, False}
        # split head dims are searched where the dim splits, and only there
        assert {c["split_d"] for c in cands} == ({False, True} if d == 96 else {False})
    # the backward's space: the three designs, the Gluon pair with either dK/dV query tile
    bwd = t.candidates("bwd", 128, 128)
    assert {c.get("dkdv_block_mq") for c in bwd} == {None, 32, 64} and dict(bwd_design="plain") in bwd
    assert {c["bwd_design"] for c in bwd} == {"mixed", "split", "plain"}
    for c in bwd:  # each candidate resolves to the design it names
        assert G.resolve_config(128, torch.bfloat16, c)["bwd_design"] == c["bwd_design"]
    # the default a search starts from is what a user gets for that mask
    assert t.default(128, torch.bfloat16, small_mask("full", 300))["dkdv_block_mq"] == 64
    assert t.default(128, torch.bfloat16, small_mask("causal", 300))["dkdv_block_mq"] == 32
    assert t.default(96, torch.bfloat16, small_mask("full", 300))["split_d"] is True
    assert "sm_90" in t.device_reason(torch.device("cpu"))

"""``dkdv_qmajor``: the dK/dV steps compute their scores query-major (``S = Q K^T``, ``core.dkdv_update_qmajor``)
in the block-sparse dK/dV kernels, on the CPU (the Triton interpreter)."""

import pytest
import torch
from utils import compare_to_reference

import longca_triton.kernels.block_sparse.op as BS
from longca_triton.kernels.block_sparse.op import block_sparse_attention
from longca_triton.masks import make_mask

SPARSE = [  # (kind, S, mask params, extra config, dtype)
    ("block_sparse", 150, {"block": 32}, {"dkdv_stats_tma": True, "DKDV_HEADS": 1}, torch.float32),
    ("block_sparse", 150, {"block": 48}, {}, torch.float16),
    ("varblock_sparse", 173, {"block": 48, "min_block": 20}, {"dkdv_tail_rows": 16}, torch.float32),
    ("varblock_sparse", 173, {"block": 48, "min_block": 20}, {"dkdv_tail_rows": 16, "dkdv_tail_order": 3},
     torch.float32),
]


@pytest.mark.parametrize("kind,S,extra,cfgx,dtype", SPARSE,
                         ids=["uniform32-stats-tma", "uniform48-partial-entries-fp16", "varblock-tails-apart",
                              "varblock-tails-merged"])
def test_block_sparse_qmajor_dkdv_matches_the_reference(kind, S, extra, cfgx, dtype):
    """Stacked heads (the interpreter's DKDV_HEADS 2), TMA stats boxes, partial and packed entries, tails in their
    own launch or the main one, against float64 with an lse gradient."""
    mask = make_mask(kind, S, density=0.5, patterns=2, seed=3, **extra)
    cfg = {"dkdv_qmajor": True, **cfgx}
    compare_to_reference(lambda q, k, v: block_sparse_attention(q, k, v, mask, return_lse=True, config=cfg), mask,
                         S, S, 1, 4, 2, 32, dtype, dlse=True)


class _Record:
    def __init__(self, events):
        self.events = events

    def __getitem__(self, grid):
        return lambda *a, **kw: self.events.append(kw)


@pytest.mark.parametrize("on", [False, True])
def test_qmajor_reaches_the_dkdv_kernels(on, monkeypatch):
    events: list = []
    monkeypatch.setattr(BS, "block_sparse_bwd_dkdv_kernel", _Record(events))
    monkeypatch.setattr(BS, "block_sparse_bwd_dq_kernel", _Record([]))
    vmask = make_mask("varblock_sparse", 173, block=48, min_block=20, density=0.4, patterns=2, seed=3)
    c = BS.resolve_config(vmask, 32, {"dkdv_qmajor": on, "dkdv_tail_rows": 16})
    q, k, v, out, do = (torch.randn(1, 173, h, 32) for h in (4, 2, 2, 4, 4))
    BS.block_sparse_bwd(do, q, k, v, out, torch.zeros(1, 4, 173), vmask, BS.tables_for(vmask, c, "cpu"), 32 ** -0.5,
                        c)
    assert [kw["QMAJOR"] for kw in events] == [on, on]  # main and tail launches


def test_block_sparse_qmajor_needs_the_two_kernel_layout():
    mask = make_mask("block_sparse", 96, block=32, density=0.5, patterns=2, seed=1)
    with pytest.raises(ValueError, match="dkdv_qmajor"):
        BS.resolve_config(mask, 32, {"dkdv_qmajor": True, "one_launch": True})



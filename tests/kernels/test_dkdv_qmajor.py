"""``dkdv_qmajor``: the dK/dV steps compute their scores query-major (``S = Q K^T``, ``core.dkdv_update_qmajor``)
in the dense dK/dV kernel (block-sparse: its tail tiles, ``test_block_sparse.py``). CPU: the Triton interpreter, and one sm_90a compile (slow)."""

import pytest
import torch
from utils import compare_to_reference, small_mask

from longca_triton.kernels.dense.op import dense_attention, resolve_config

DENSE = [  # (mask, S, Hq, Hkv, D, dtype, extra config, dlse)
    ("full", 97, 4, 2, 32, torch.float32, {}, True),
    ("causal", 150, 4, 1, 32, torch.float16, {}, False),
    ("causal_document", 239, 4, 2, 32, torch.float32, {}, True),
    ("sliding_window", 150, 2, 2, 64, torch.float32, {"fused_dq": True}, False),
    ("share_question", 150, 4, 2, 40, torch.float32, {"dkdv_stats_tma": True}, True),
]


@pytest.mark.parametrize("name,S,hq,hkv,d,dtype,cfgx,dlse", DENSE,
                         ids=[f"S={c[1]}-Hq={c[2]}-Hkv={c[3]}-D={c[4]}-{c[0]}-{str(c[5])[6:]}"
                              + "".join(f"-{k}" for k in c[6]) + ("-dlse" if c[7] else "") for c in DENSE])
def test_dense_qmajor_dkdv_matches_the_reference(name, S, hq, hkv, d, dtype, cfgx, dlse):
    """Partial tiles (masked query-major), a padded head dim, the fused dQ and the stats boxes, against float64."""
    mask = small_mask(name, S)
    cfg = {"dkdv_qmajor": True, **cfgx}
    compare_to_reference(lambda q, k, v: dense_attention(q, k, v, mask, return_lse=True, config=cfg), mask, S, S, 1,
                         hq, hkv, d, dtype, dlse=dlse)


class _Record:
    def __init__(self, events):
        self.events = events

    def __getitem__(self, grid):
        return lambda *a, **kw: self.events.append(kw)


@pytest.mark.parametrize("on", [False, True])
def test_qmajor_reaches_the_dkdv_kernels(on, monkeypatch):
    import longca_triton.kernels.dense.op as D

    events: list = []
    monkeypatch.setattr(D, "dense_bwd_dkdv_kernel", _Record(events))
    monkeypatch.setattr(D, "dense_bwd_dq_kernel", _Record([]))
    mask = small_mask("causal", 96)
    cfg = resolve_config(32, torch.float32, {"dkdv_qmajor": on})
    q, k, v, out, do = (torch.randn(1, 96, h, 32) for h in (4, 2, 2, 4, 4))
    plans = D.plans_for(mask, cfg, "cpu")
    D.dense_bwd(do, q, k, v, out, torch.zeros(1, 4, 96), plans[1], plans[2], 32 ** -0.5, cfg)
    assert [kw["QMAJOR"] for kw in events] == [on]



@pytest.mark.parametrize("over", [{"one_launch": True}, {"dkdv_sweep": 2}], ids=["one-launch", "sweep"])
def test_dense_qmajor_needs_the_head_major_two_kernel_layout(over):
    with pytest.raises(ValueError, match="dkdv_qmajor"):
        resolve_config(32, torch.float32, {"dkdv_qmajor": True, **over})


@pytest.mark.slow
def test_dense_qmajor_dkdv_compiles_for_sm90a_with_fewer_instructions_a_step():
    """``experiments/cpu_aot_dense_bwd.py`` (the real dK/dV launch, sm_90a on the CPU; S = 4K, GQA 8:1, D = 128,
    full, 64 x 64 on 4 warps): query-major, a step issues fewer instructions (a thread's lse / delta are 2 rows'
    instead of 16 columns') and spills no more; one exponential a score either way."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tile = {"DKDV_BLOCK_M": 64, "DKDV_BLOCK_N": 64, "dkdv_num_warps": 4}
    cfgs = {"km": tile, "qm": {**tile, "dkdv_qmajor": True}}
    res = subprocess.run([sys.executable, "experiments/cpu_aot_dense_bwd.py", "--passes", "dkdv", "--masks", "full",
                          "--S", "4096", "--heads", "8:1", "--configs", json.dumps(cfgs)], capture_output=True,
                         text=True, timeout=900, cwd=root, env={**env, "PYTHONPATH": str(root)})
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["config"]: r for r in map(json.loads, res.stdout.strip().splitlines())}
    km, qm = rows["full-km"], rows["full-qm"]
    assert qm["loop_instr"][0] < 0.9 * km["loop_instr"][0]
    assert qm["spills"] <= km["spills"] and qm["shared"] <= 227 * 1024
    assert qm["loop_mufu"] == km["loop_mufu"] == [64 * 64 // 128]

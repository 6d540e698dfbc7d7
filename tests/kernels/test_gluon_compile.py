"""The Gluon kernels compiled for sm_90a on the CPU (slow: each in a subprocess, ``kernels/gluon/aot.py``): every
variant compiles, with what the design needs (async wgmma with groups left in flight, per-partition
``setmaxnreg``, TMA, the shared memory the host expects, no spills where the defaults need none), and
the Gluon frontend's power-of-two shape limit that the split head dims work around."""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from longca_triton.kernels.gluon import config as G

_ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> dict:
    """Run ``code`` as a script (Gluon's jit wants its kernels in a file) in the repository root; its
    JSON lines by ``name``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "compile_case.py"
        script.write_text(code)
        res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900, cwd=_ROOT,
                             env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return {r["name"]: r for r in map(json.loads, res.stdout.strip().splitlines())}


# ------------------------------------------------------------------ sm_90a compilation (no GPU)
_COMPILE = textwrap.dedent("""
    import json, os, re
    os.environ["TRITON_INTERPRET"] = "0"
    from longca_triton.kernels.gluon.aot import compile_bwd, compile_fwd, ptxas_info
    cases = [("d128", 128, None, {}), ("d64", 64, None, {}),
             ("nopp-n64", 128, dict(pingpong=False, BLOCK_N=64, num_stages=3), {}),
             ("pp", 128, dict(pingpong=True, num_stages=2), {}),
             ("full-only", 128, None, dict(has_partial=False, num_iv=1)),
             # one interval a row: two consumers hold it in registers for the whole loop (_mask_tile)
             ("one-iv", 128, None, dict(num_iv=1)),
             ("fp32-out", 128, None, dict(store_tma=False, dtype="fp16")),
             # padded head dims: true dims as descriptor shapes, power-of-two tiles
             ("d96", 96, None, {}), ("d192-128", 192, None, dict(head_dim_v=128)), ("d256", 256, None, {}),
             ("d64-128", 64, None, dict(head_dim_v=128)),
             ("fp32-out-192-128", 192, None, dict(store_tma=False, dtype="fp16", head_dim_v=128)),
             # split head dims: two exact power-of-two pieces per operand (split_d)
             ("d96-split", 96, dict(split_d=True), {}), ("d80-split", 80, dict(split_d=True), {}),
             ("d96-split-st4", 96, dict(split_d=True, num_stages=4), dict(has_partial=False, num_iv=1)),
             ("fp32-out-d96-split", 96, dict(split_d=True), dict(store_tma=False, dtype="fp16")),
             ("d96-128-split", 96, dict(split_d=True), dict(head_dim_v=128)),
             # P through shared memory with three consumers (the D = 128 default on dense masks)
             ("psmem-d128", 128, dict(consumers=3, p_smem=True), dict(has_partial=False, num_iv=1)),
             ("psmem-d128-partial", 128, dict(consumers=3, p_smem=True), {}),
             # persistent: a CTA walks tiles with whole-tensor (4-d) descriptors; O in Q's buffers or its own
             ("persist-d128", 128, dict(persistent=True), {}),
             ("persist-own", 128, dict(persistent=True, o_own=True, num_stages=2), dict(num_iv=1)),
             ("persist-psmem", 128, dict(persistent=True, consumers=3, p_smem=True), dict(has_partial=False, num_iv=1)),
             ("persist-split", 96, dict(persistent=True, split_d=True), {}),
             ("persist-fp32-out", 128, dict(persistent=True), dict(store_tma=False, dtype="fp16")),
             # the split launch's second half: partial tiles merged into the first launch's (O, lse)
             ("persist-merge", 128, dict(persistent=True, consumers=3, p_smem=True), dict(merge=True)),
             # the same as causal's default (two persistent consumers, O's own buffers, one interval)
             ("persist-own-merge", 128, dict(persistent=True, o_own=True, num_stages=2),
              dict(merge=True, num_iv=1)),
             # mask_head: step 0 masked without a branch, the loop compiled without the mask path
             ("persist-own-head", 128, dict(persistent=True, o_own=True, num_stages=2),
              dict(has_partial=False, mask_head=1)),
             # mask_head=2: step 1 peeled out of the loop, masked without a branch too
             ("persist-own-head2", 128, dict(persistent=True, o_own=True, num_stages=2),
              dict(has_partial=False, mask_head=2)),
             # rowsum_mma: the row sums by one more wgmma against a block of ones (D = 64's persistent default)
             ("persist-own-rowsum-d64", 64, dict(persistent=True, o_own=True, rowsum_mma=True),
              dict(num_iv=1)),
             ("persist-own-d64", 64, dict(persistent=True, o_own=True, rowsum_mma=False), dict(num_iv=1)),
             ("psmem-d128-head", 128, dict(consumers=3, p_smem=True), dict(has_partial=False, mask_head=1))]
    bwd = [("dq-d128", "dq", 128, None, {}), ("dkdv-d128", "dkdv", 128, None, {}),
           ("dq-d64", "dq", 64, None, {}), ("dkdv-d64", "dkdv", 64, None, {}),
           ("dkdv-full-only", "dkdv", 128, None, dict(has_partial=False, num_iv=1)),
           # dq_mask_head: the first two steps masked without a branch, the loop without the mask path
           ("dq-d128-head2", "dq", 128, None, dict(has_partial=False, mask_head=2))]
    for name, kind, d, cfg, kw in bwd:
        c = compile_bwd(kind, d, cfg, **kw)
        info = ptxas_info(c.ptx)
        print(json.dumps(dict(name=name, d=d, shared=c.shared, regs=sorted(set(c.setmaxnreg())),
                              wgmma=c.count(r"wgmma\\.mma_async"),
                              **info)))
    for name, d, cfg, kw in cases:
        c = compile_fwd(d, cfg, **kw)
        info = ptxas_info(c.ptx)
        print(json.dumps(dict(name=name, d=d, dv=kw.get("head_dim_v", d), shared=c.shared,
                              regs=sorted(set(c.setmaxnreg())), wgmma=c.count(r"wgmma\\.mma_async"),
                              wait1=c.count(r"wgmma\\.wait_group\\.sync\\.aligned 1;"),
                              wait2=c.count(r"wgmma\\.wait_group\\.sync\\.aligned 2;"),
                              mma_shapes=sorted(set(re.findall(r"wgmma\\.mma_async\\S*\\.(m64n\\d+k16)", c.ptx))),
                              tma_load=c.count(r"cp\\.async\\.bulk\\.tensor\\.2d\\.shared::cluster\\.global"),
                              tma_store=c.count(r"cp\\.async\\.bulk\\.tensor\\.2d\\.global\\.shared"),
                              tma_load4=c.count(r"cp\\.async\\.bulk\\.tensor\\.4d\\.shared::cluster\\.global"),
                              tma_store4=c.count(r"cp\\.async\\.bulk\\.tensor\\.4d\\.global\\.shared"),
                              nctaid=c.count(r"%nctaid\\.x"),
                              stmatrix=c.count(r"stmatrix"), fence=c.count(r"fence\\.proxy\\.async"),
                              **info)))
""")


@pytest.mark.slow
def test_every_variant_compiles_for_sm90a():
    from pathlib import Path

    rows = _run(_COMPILE)
    bwd = {n: rows.pop(n) for n in [n for n in rows if n.startswith(("dq", "dkdv"))]}
    assert set(bwd) == {"dq-d128", "dkdv-d128", "dq-d64", "dkdv-d64", "dkdv-full-only", "dq-d128-head2"}
    # the peeled masked step adds its three GEMMs to the kernel, and no spills
    assert bwd["dq-d128-head2"]["wgmma"] > bwd["dq-d128"]["wgmma"] and bwd["dq-d128-head2"]["spill_stores"] == 0
    for name, r in bwd.items():
        assert r["wgmma"] > 0 and {240, 24} <= set(r["regs"]) and r["shared"] <= G.SMEM_LIMIT, r
        # the backward's tiles stay within 240 registers (a few bytes at most: 4 B for dK/dV at D=128)
        assert r["spill_stores"] <= 16 and r["spill_loads"] <= 16, r
    psmem = {n: rows.pop(n) for n in [n for n in rows if n.startswith("psmem")]}
    assert set(psmem) == {"psmem-d128", "psmem-d128-partial", "psmem-d128-head"}
    for name, r in psmem.items():
        # three consumers at 160 registers, producer 24; P stored by stmatrix, fenced for the async
        # proxy before the P V wgmma reads it (one fence per store site at least)
        assert {160, 24} <= set(r["regs"]) and 240 not in r["regs"], r
        assert r["stmatrix"] > 0 and r["fence"] >= 3, r
        # Q 48 KB + P 48 KB + two 64 KB stages, tight to 1 KB
        est = G.smem_bytes(128, 128, 2, consumers=3, p_smem=True)
        assert est - 1024 <= r["shared"] <= est <= G.SMEM_LIMIT, (name, r["shared"], est)
    # without partial tiles the main loops spill nothing (measured 4 B stored, 24 loaded, outside
    # them); the interval mask's registers cost some (measured 632 B stored with two intervals a
    # row; causal ran 2-7 % faster all the same)
    assert psmem["psmem-d128"]["spill_stores"] <= 32 and psmem["psmem-d128"]["spill_loads"] <= 32, psmem
    assert psmem["psmem-d128-partial"]["spill_stores"] <= 768, psmem
    # mask_head: the step-0 mask without a branch spills a little more than none (measured 40 B vs 24;
    # the branch's mask path 180-632) and leaves the loop on the uniform datapath
    assert psmem["psmem-d128-head"]["spill_stores"] <= 64, psmem
    persist = {n: rows.pop(n) for n in [n for n in rows if n.startswith("persist")]}
    assert set(persist) == {"persist-d128", "persist-own", "persist-psmem", "persist-split", "persist-fp32-out",
                            "persist-merge", "persist-own-merge",
                            "persist-own-head", "persist-own-head2", "persist-own-rowsum-d64", "persist-own-d64"}
    for name, r in persist.items():
        # whole-tensor descriptors only (4-d boxes), a loop over the work list in steps of the grid
        assert r["tma_load"] == 0 and r["tma_load4"] >= 3 and r["nctaid"] >= 1, r
        assert r["tma_store4"] >= (0 if name == "persist-fp32-out" else 1) and r["tma_store"] == 0, r
        assert r["shared"] <= G.SMEM_LIMIT, r
    # two consumers stay spill-free; three at 160 registers spill about as much as one tile a CTA does
    # (the merge reads the first launch's O while the last P V runs: held from the tile's start it
    # spilled 56 B there)
    # (mask_head=2's two branch-free masked steps too: its loop is the unmasked kernel's)
    for name in ("persist-d128", "persist-own", "persist-split", "persist-fp32-out", "persist-own-merge",
                 "persist-own-head", "persist-own-head2", "persist-own-d64"):
        assert persist[name]["spill_stores"] == 0 and persist[name]["spill_loads"] == 0, persist[name]
    assert persist["persist-psmem"]["spill_stores"] <= 256, persist["persist-psmem"]
    # rowsum_mma: one more wgmma per P V step (and at the last one) against the block of ones, 2 KB of it
    rs, plain = persist["persist-own-rowsum-d64"], persist["persist-own-d64"]
    assert rs["wgmma"] > plain["wgmma"] and plain["shared"] < rs["shared"] <= plain["shared"] + 2048 + 64, (rs, plain)
    # its [64, 8] accumulator beside the mask path at three consumers' 128 registers: a few bytes (measured
    # 4 B stored, 16 loaded; none without the mask path), and the GPU ran it 1-8 % faster all the same
    assert rs["spill_stores"] <= 16 and rs["spill_loads"] <= 32, rs
    # the merge epilogue loads the first launch's O (pointer loads: global, not TMA)
    assert persist["persist-merge"]["shared"] <= G.SMEM_LIMIT
    # O's own buffers: two 64 KB stages, Q 32 KB, O 32 KB, tight to 1 KB
    est = G.smem_bytes(128, 128, 2, o_own=True)
    assert est - 1024 <= persist["persist-own"]["shared"] <= est, (persist["persist-own"]["shared"], est)
    for name in ("d128", "psmem-d128", "d96-split"):  # one tile a CTA keeps per-head 2-d descriptors
        r = rows.get(name) or psmem.get(name)
        assert r is None or (r["tma_load4"] == 0 and r["tma_store4"] == 0), r
    split = {n: rows.pop(n) for n in [n for n in rows if "split" in n]}
    assert set(split) == {"d96-split", "d80-split", "d96-split-st4", "fp32-out-d96-split", "d96-128-split"}
    for name, r in split.items():
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert {240, 24} <= set(r["regs"]) and r["shared"] <= G.SMEM_LIMIT, r
    # per consumer: S_0, then per loop step S_j and P V, then the last P V; at 96 Q K^T takes 4 + 2
    # k16 steps (n128), P V 8 k16 steps each of n64 and n32: 2 x (6 + 6 + 16 + 16) = 88 (the
    # padded 128-wide tile: 64); at 80, 4 + 1 k-steps and n64 + n16: 2 x (5 + 5 + 16 + 16) = 84
    assert split["d96-split"]["wgmma"] == 88 and split["d80-split"]["wgmma"] == 84, split
    assert split["d96-split"]["mma_shapes"] == ["m64n128k16", "m64n32k16", "m64n64k16"], split["d96-split"]
    assert "m64n16k16" in split["d80-split"]["mma_shapes"]
    # S_j is waited for with both P V groups still in flight (wait_group 2, one per consumer)
    for name in ("d96-split", "d80-split", "d96-split-st4", "fp32-out-d96-split"):
        assert split[name]["wait2"] == 2 and split[name]["wait1"] == 0, split[name]
    # Q K^T split only (V 128 is one tile): one P V group, the usual wait_group 1
    assert split["d96-128-split"]["wait1"] == 2 and split["d96-128-split"]["wgmma"] == 2 * (6 + 6 + 8 + 8)
    # O leaves by two TMA stores (one per piece) unless it is fp32 or its pieces do not fit Q's
    assert split["d96-split"]["tma_store"] >= 2 and split["fp32-out-d96-split"]["tma_store"] == 0
    assert split["d96-128-split"]["tma_store"] == 0
    for name, d, dv, st in (("d96-split", 96, 96, 3), ("d80-split", 80, 80, 3), ("d96-split-st4", 96, 96, 4),
                            ("d96-128-split", 96, 128, 3)):
        est = G.smem_bytes(d, 128, st, head_dim_v=dv, split_d=True)
        assert est - 1024 <= split[name]["shared"] <= est, (name, split[name]["shared"], est)
    assert set(rows) == {"d128", "d64", "nopp-n64", "pp", "full-only", "one-iv", "fp32-out", "d96",
                         "d192-128", "d256", "d64-128", "fp32-out-192-128"}
    for name, r in rows.items():
        if name == "d64":
            # three consumers at 160 registers and a 24-register producer spill a little; measured
            # 7-18 % faster than two spill-free ones all the same (kernels/tuning/gluon.toml)
            assert G.resolve_config(64, torch.bfloat16)["consumers"] == 3
            assert 0 < r["spill_stores"] <= 512 and r["spill_loads"] <= 512, r
        else:  # the other defaults must not spill
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["wgmma"] > 0 and r["wait1"] >= 1, f"{name}: S_j and P V in flight together: {r}"
        assert r["tma_load"] >= 3, r
        assert r["shared"] <= G.SMEM_LIMIT, r
    # the register split reached the partitions: consumers 240, producer 24
    for name in ("d128", "d96", "d192-128", "d256", "d64-128"):
        assert {240, 24} <= set(rows[name]["regs"]), rows[name]
    # D = 64 runs three consumers (160 registers each, producer 24): three Q tiles and three
    # consumers' wgmma (1.5x the two-consumer D = 64 tile's, d64-128 has the same Q K^T and a wider P V)
    assert {160, 24} <= set(rows["d64"]["regs"]) and 240 not in rows["d64"]["regs"], rows["d64"]
    # D_qk=192 on a 256-wide tile: Q K^T skips the zero-filled last quarter (12 k-steps of 16, not
    # 16; P V has BLOCK_N / 16 = 4 either way): 16 wgmma per S and P V pair where D=256 has 20
    assert rows["d192-128"]["wgmma"] * 20 == rows["d256"]["wgmma"] * 16, (rows["d192-128"], rows["d256"])
    # O leaves through TMA unless the output dtype differs from the inputs'
    assert rows["d128"]["tma_store"] >= 1 and rows["fp32-out"]["tma_store"] == 0
    # ... staged in Q's buffer, which holds it where BLOCK_DV <= BLOCK_DQK (192/128: a view of it)
    assert rows["d192-128"]["tma_store"] >= 1 and rows["d256"]["tma_store"] >= 1 and rows["d96"]["tma_store"] >= 1
    assert rows["d64-128"]["tma_store"] == 0 and rows["fp32-out-192-128"]["tma_store"] == 0
    # the host's shared-memory bound holds, and is tight to 1 KB
    for name, d, bn, st in (("d128", 128, 128, 3), ("d64", 64, 128, 3), ("nopp-n64", 128, 64, 3),
                            ("pp", 128, 128, 2), ("d96", 96, 128, 3), ("d192-128", 192, 64, 3),
                            ("d256", 256, 64, 2), ("d64-128", 64, 128, 3)):
        consumers = G.resolve_config(d, torch.bfloat16, head_dim_v=rows[name]["dv"])["consumers"]
        est = G.smem_bytes(d, bn, st, head_dim_v=rows[name]["dv"], consumers=consumers)
        assert est - 1024 <= rows[name]["shared"] <= est, (name, rows[name]["shared"], est)


_PV_SYNC = textwrap.dedent("""
    import json, os
    os.environ["TRITON_INTERPRET"] = "0"
    from longca_triton.kernels.gluon.aot import compile_fwd, ptxas_info
    FULL, CAUSAL = dict(has_partial=False, num_iv=1), dict(has_partial=True, num_iv=1)
    for name, cfg, kw in [("overlap", dict(split_d=True, consumers=3), FULL),
                          ("pv_sync", dict(split_d=True, consumers=3, pv_sync=True), FULL),
                          ("pv_sync-partial", dict(split_d=True, consumers=3, pv_sync=True), CAUSAL),
                          ("default-persistent", dict(split_d=True, consumers=3, pv_sync=True, persistent=True,
                                                      pingpong=True), FULL),
                          ("default-persistent-partial", dict(split_d=True, consumers=3, pv_sync=True,
                                                              persistent=True, pingpong=True), CAUSAL)]:
        c = compile_fwd(96, cfg, **kw)
        info = ptxas_info(c.ptx)
        print(json.dumps(dict(name=name, spills=info["spill_stores"] + info["spill_loads"], regs=c.setmaxnreg(),
                              wait2=c.count(r"wgmma\\.wait_group\\.sync\\.aligned 2;"))))
""")


@pytest.mark.slow
def test_pv_sync_fits_three_register_p_consumers_at_d96():
    """``pv_sync`` (D = 96's dense default): each warpgroup's ``P V`` finished before its ``S``, so three
    consumers with register P fit 160 registers on sm_90a (the overlapped loop spills), with and without
    the mask path (persistent: a few bytes with it); the overlapped loop leaves its two ``P V`` groups in
    flight at the S wait (``wait_group 2``), pv_sync waits for everything."""
    rows = _run(_PV_SYNC)
    assert rows["overlap"]["spills"] > 0 and rows["overlap"]["wait2"] > 0, rows["overlap"]
    for name in ("pv_sync", "pv_sync-partial", "default-persistent", "default-persistent-partial"):
        assert rows[name]["wait2"] == 0 and 160 in rows[name]["regs"], rows[name]
    for name in ("pv_sync", "pv_sync-partial", "default-persistent"):
        assert rows[name]["spills"] == 0, rows[name]
    assert rows["default-persistent-partial"]["spills"] <= 64, rows["default-persistent-partial"]


_SHAPE_PROBE = textwrap.dedent("""
    import json, os, traceback
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def accumulator_probe_kernel(C, N: gl.constexpr):
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
        acc = gl.zeros([64, N], gl.float32, acc_l)
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
        gl.store(C + rows, gl.sum(acc, axis=1))

    for n in (64, 96, 128):
        try:
            triton.compile(GluonASTSource(accumulator_probe_kernel, {"C": "*fp32", "N": "constexpr"},
                                          constexprs={"N": n}),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            why = "accepted"
        except Exception:
            why = "refused: " + traceback.format_exc()
        print(json.dumps(dict(name=str(n), why=why)))
""")


@pytest.mark.slow
def test_gluon_takes_power_of_two_accumulators_only():
    """Why ``split_d`` runs D = 96 as 64 + 32 pieces: the pinned Triton's Gluon compiles a ``[64, 64]`` and a
    ``[64, 128]`` wgmma accumulator for sm_90a and refuses FA3's ``[64, 96]`` P V width with the frontend's
    power-of-two error. If a Triton ever takes it, this fails: one n96 P V GEMM becomes possible."""
    rows = _run(_SHAPE_PROBE)
    assert rows["64"]["why"] == "accepted" and rows["128"]["why"] == "accepted"
    assert rows["96"]["why"].startswith("refused") and "power of 2" in rows["96"]["why"], rows["96"]["why"][-500:]

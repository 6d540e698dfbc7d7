"""The Gluon family's host side on the CPU: the backend's ``unsupported`` answers, input checks before any
launch, the default-backend rule, and the launchers against the kernels' parameters (the kernels
recorded, not run: Gluon cannot run in the interpreter). Numerics: ``test_gluon_gpu.py`` (``-m gpu``)."""

import pytest
import torch
from utils import random_range_mask

import longca_triton as lt
from longca_triton.adapters import Problem, get_backend
from longca_triton.kernels.gluon import config as GC
from longca_triton.kernels.gluon import op as G


# ------------------------------------------------------------------ backend on a CPU
def test_backend_says_why_it_cannot_run_here():
    b = get_backend("triton-gluon")
    assert "Gluon" in b.description and "backward" in b.description
    mask = lt.make_mask("causal", 256)
    for dev in ("cpu", "cuda"):
        ok, why = b.check(Problem(mask=mask, device=dev, dtype=torch.bfloat16, head_dim=128))
        assert not ok and "sm_90" in why
    # the head-dim answers, on a machine where the device would do (checked without one): the
    # GPU-checked pairs; the other dims the plain-Triton kernels take are refused with the reason
    import longca_triton.adapters.triton_base as TB
    import longca_triton.kernels.gluon.config as GA
    real, real_here = GA.device_reason, TB.runs_here
    try:
        GA.device_reason = lambda dev: ""
        TB.runs_here = lambda dev: (True, "")
        answers = {(d, dv): b.supports(Problem(mask=mask, device="cuda", dtype=torch.bfloat16, head_dim=d,
                                                 head_dim_v=dv))
                   for d, dv in ((192, 128), (256, 256), (96, 96), (80, 80), (64, 64), (128, 128), (100, 100),
                                 (264, 264), (128, 132), (64, 128), (256, 64), (40, 40))}
    finally:
        GA.device_reason, TB.runs_here = real, real_here
    # every dim from 1 to 256 is offered; pairs no GPU checked run the plain-Triton kernels, said in the row
    for dims in ((192, 128), (256, 256), (96, 96), (80, 80), (64, 64), (128, 128), (100, 100), (128, 132), (64, 128)):
        assert answers[dims] == (True, ""), (dims, answers[dims])
    assert {(192, 128), (256, 256), (96, 96), (80, 80)} <= set(GC.GPU_CHECKED_HEAD_DIMS)
    for dims in GC.GPU_CHECKED_HEAD_DIMS:
        assert b.fallback_reason(*dims) == ""
    assert "plain-Triton" in b.fallback_reason(64, 136)
    problem = Problem(mask=mask, device="cuda", dtype=torch.bfloat16, head_dim=100, head_dim_v=36)
    assert "104/40" in b.run_notes(problem)["fallback"]
    ok, why = answers[(264, 264)]
    assert not ok and "264" in why and "1 to 256" in why, why
    q = k = v = torch.randn(1, 256, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="sm_90"):
        lt.attention(q, k, v, mask, backend="triton-gluon")


def test_kernel_entry_checks_inputs_before_any_launch():
    mask = lt.make_mask("causal", 64)
    for d in (100, 264, 4):
        q = torch.randn(1, 64, 2, d, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=f"head dim of q/k {d} not supported.*multiples of 8"):
            G.gluon_attention(q, q, q, mask)
    q = torch.randn(1, 64, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dim of v 36 not supported"):
        G.gluon_attention(q, q, q[..., :36].contiguous(), mask)
    with pytest.raises(ValueError, match="head dim mismatch"):
        G.gluon_attention(q, q[..., :32].contiguous(), q, mask)
    # the dims the forward takes get as far as the device check
    for d, dv in ((64, 64), (96, 96), (192, 128), (256, 256), (64, 32)):
        q = torch.randn(1, 64, 2, d, dtype=torch.bfloat16)
        v = torch.randn(1, 64, 2, dv, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="sm_90"):
            G.gluon_attention(q, q, v, mask)
    with pytest.raises(ValueError, match="sm_90"):
        G.gluon_attention(q, q, q, mask, config=dict(bwd_design="plain"))
    with pytest.raises(ValueError, match="mask is 64 x 64"):
        G.check_inputs(q[:, :32], q[:, :32], q[:, :32], mask)


# ------------------------------------------------------------------ the default backend rule
def test_default_backend_measured_choice(monkeypatch):
    """The user's autotune cache decides where it measured both kernels; otherwise it says nothing."""
    from longca_triton import api
    from longca_triton.kernels.core import tuned

    mask = lt.make_mask("causal", 256)
    q = k = torch.randn(1, 256, 2, 64, dtype=torch.float16)
    assert api.default_backend(mask, q, k) == "triton"  # a CPU: Gluon cannot run, never chosen
    scores = {}
    monkeypatch.setattr(tuned, "measured_tflops", lambda name, q, k, mask, v=None, mode="fwd": scores.get(name))
    scores.update({"triton-gluon": 600.0, "triton": 500.0})
    assert api._measured_choice(mask, q, k, k) == "triton-gluon"
    assert api._measured_choice(mask, q, k, k, "fwd_bwd") == "triton-gluon"  # the cache's backward speeds
    scores["triton"] = 650.0
    assert api._measured_choice(mask, q, k, k) == "triton", "measured slower: not chosen"
    del scores["triton"]
    assert api._measured_choice(mask, q, k, k) is None, "triton never measured: the shipped table decides"
    assert api.default_backend(lt.make_mask("block_sparse", 256, block=64, density=0.5), q, k) == "triton-sparse"


def test_default_backend_table_choice(monkeypatch):
    """The shipped table (kernels/tuning/default.toml) picks by arch, padded head dims and the plan's
    features; a GPU without a row runs triton."""
    from longca_triton import api
    from longca_triton.kernels.tuning import load_table

    table = load_table("default", ("backend",))
    assert table.defaults == {"backend": "triton"} and all(r.results for r in table.rows)
    mask = lt.make_mask("causal", 4096)
    q = torch.randn(1, 4096, 2, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    # with autograd: Gluon (its backward ahead at every measured length); forward only: Gluon from 8K on
    # and on masks of whole tiles, triton on shorter masks with partial tiles
    assert api._table_choice(mask, q, q, "fwd_bwd") == "triton-gluon"
    assert api._table_choice(mask, q, q, "fwd") == "triton"
    assert api._table_choice(lt.make_mask("full", 4096), q, q, "fwd") == "triton-gluon"
    q16 = torch.randn(1, 16384, 2, 128, dtype=torch.bfloat16)
    assert api._table_choice(lt.make_mask("causal", 16384), q16, q16, "fwd") == "triton-gluon"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert api._table_choice(mask, q, q, "fwd_bwd") == "triton"
    f = api.plan_features(mask, 59, 111)
    assert (f["head_dim"], f["head_dim_v"]) == (64, 112) and f["full_tiles"] + f["partial_tiles"] == 32 * 33 // 2
    assert f["partial_share"] == pytest.approx(32 / (32 * 33 // 2))


# ------------------------------------------------------------------ launchers match the kernels
class _Recorder:
    """Stands in for a Gluon kernel: records ``kernel[grid](*args, **kwargs)``."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def _check_binding(rec: _Recorder, pointers: dict):
    """Every kernel parameter gets exactly one value: positional ones in order, constexprs by name;
    pointer parameters get tensors of the expected dtype, the rest Python scalars."""
    (grid, args, kwargs), = rec.calls
    params = rec.fn.params
    consts = [p.name for p in params if p.is_constexpr]
    runtime = [p.name for p in params if not p.is_constexpr]
    launch = {k: v for k, v in kwargs.items() if k not in ("num_warps", "maxnreg")}
    assert len(args) == len(runtime), (len(args), runtime)
    assert set(launch) == set(consts), set(launch) ^ set(consts)
    # the launch's even share of the register file: 168 with two consumers, 128 with three
    assert kwargs["num_warps"] == 4 and kwargs["maxnreg"] in (168, 128)
    for name, value in zip(runtime, args):
        if name in pointers:
            assert isinstance(value, torch.Tensor) and value.dtype == pointers[name], (name, value)
        elif name.isupper():  # plan tables
            assert isinstance(value, torch.Tensor) and value.dtype == torch.int32, name
        else:
            assert isinstance(value, (int, float)) and not isinstance(value, bool), (name, value)
    assert isinstance(grid, tuple) and grid[0] > 0


def test_launchers_bind_every_kernel_parameter(monkeypatch):
    """The Gluon kernels cannot run here, but their launchers can: every argument must land on the
    parameter it is meant for (a drift between launcher and kernel shows only on a GPU otherwise)."""
    from longca_triton.kernels.dense import op as D
    from longca_triton.kernels.gluon import bwd as attention_bwd
    from longca_triton.kernels.gluon import fwd as attention_fwd
    from longca_triton.kernels.gluon.plan import get_ws_plan

    fwd = _Recorder(attention_fwd.gluon_fwd_kernel)
    dq = _Recorder(attention_bwd.gluon_bwd_dq_kernel)
    dkdv = _Recorder(attention_bwd.gluon_bwd_dkdv_kernel)
    monkeypatch.setattr(attention_fwd, "gluon_fwd_kernel", fwd)
    monkeypatch.setattr(attention_bwd, "gluon_bwd_dq_kernel", dq)
    monkeypatch.setattr(attention_bwd, "gluon_bwd_dkdv_kernel", dkdv)
    monkeypatch.setattr(G, "launch_bwd_preprocess", lambda out, dout, dlse=None: torch.zeros(
        out.shape[0], out.shape[2], out.shape[1]))
    mask = random_range_mask(300, 200, seed=4)
    q = torch.randn(2, 300, 4, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 200, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    cfg = GC.resolve_config(64, torch.bfloat16, dict(bwd_design="split"))
    plan = get_ws_plan(mask, GC.fwd_block_m(cfg), cfg["BLOCK_N"], "cpu")
    out, lse = G.gluon_fwd(q, k, v, plan, 0.125, cfg)
    assert out.shape == q.shape and lse.shape == (2, 4, 300)
    bf, f32 = torch.bfloat16, torch.float32
    _check_binding(fwd, {"Q": bf, "K": bf, "V": bf, "Out": bf, "Lse": f32})
    assert fwd.calls[0][0] == (plan.tiles.num_m * 2 * 4,)
    dq_plan = G.dq_plan(mask, 64, "cpu")
    dkdv_plan = get_ws_plan(mask, cfg["dkdv_block_mq"], GC.BLOCK_M, "cpu", "k")
    grads = G.gluon_bwd(torch.randn_like(q), q, k, v, out, lse, dq_plan, dkdv_plan, 0.125, cfg)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    ptrs = {"Q": bf, "K": bf, "V": bf, "DO": bf, "Lse": f32, "Delta": f32}
    _check_binding(dq, {**ptrs, "DQ": bf})
    _check_binding(dkdv, {**ptrs, "DK": bf, "DV": bf})
    assert dkdv.calls[0][0] == (dkdv_plan.tiles.num_n * 2 * 2,)
    # the mixed design: the Gluon dQ kernel (recorded) beside the dense dK/dV kernel, which runs here in
    # the interpreter on the dense plan of the dense config's dK/dV tiles; with a real forward and delta
    # its dK, dV equal the dense backward's bit for bit
    monkeypatch.setattr(G, "launch_bwd_preprocess", D.launch_bwd_preprocess)
    mcfg = GC.resolve_config(64, torch.bfloat16, dict(bwd_design="mixed"))
    bcfg = D.resolve_config(64, torch.float16)
    fplan, kplan, qplan = D.plans_for(mask, bcfg, "cpu")
    qh, kh, vh = (t.to(torch.float16) for t in (q, k, v))
    outh, lseh = D.dense_fwd(qh, kh, vh, fplan, 0.125, bcfg)
    douth = torch.randn_like(qh)
    grads = G.gluon_bwd(douth, qh, kh, vh, outh, lseh, dq_plan, kplan, 0.125, mcfg, bwd_cfg=bcfg)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert len(dq.calls) == 2 and len(dkdv.calls) == 1  # one more dQ launch, no Gluon dK/dV one
    _, dk_ref, dv_ref = D.dense_bwd(douth, qh, kh, vh, outh, lseh, kplan, qplan, 0.125, bcfg)
    assert torch.equal(grads[1], dk_ref) and torch.equal(grads[2], dv_ref)


def _recorded_forward(monkeypatch, d, dv, config=None):
    """``gluon_fwd`` at head dims ``d`` / ``dv`` (GQA 4:2, Sq=300, Sk=200) with the kernel recorded,
    its outputs' shapes and its pointer dtypes checked. Returns ``(recorder, run(**kw), cfg)``."""
    from longca_triton.kernels.gluon import fwd as attention_fwd
    from longca_triton.kernels.gluon.plan import get_ws_plan

    fwd = _Recorder(attention_fwd.gluon_fwd_kernel)
    monkeypatch.setattr(attention_fwd, "gluon_fwd_kernel", fwd)
    mask = random_range_mask(300, 200, seed=4)
    q = torch.randn(2, 300, 4, d, dtype=torch.bfloat16)
    k = torch.randn(2, 200, 2, d, dtype=torch.bfloat16)
    v = torch.randn(2, 200, 2, dv, dtype=torch.bfloat16)
    cfg = GC.resolve_config(d, torch.bfloat16, config, head_dim_v=dv)
    plan = get_ws_plan(mask, GC.fwd_block_m(cfg), cfg["BLOCK_N"], "cpu")
    run = lambda **kw: G.gluon_fwd(q, k, v, plan, 0.125, cfg, **kw)  # noqa: E731
    out, lse = run()
    assert out.shape == (2, 300, 4, dv) and lse.shape == (2, 4, 300)
    bf = torch.bfloat16
    _check_binding(fwd, {"Q": bf, "K": bf, "V": bf, "Out": bf, "Lse": torch.float32})
    return fwd, run, cfg


@pytest.mark.parametrize("d,dv,store_tma", [(192, 128, True), (96, 96, True), (256, 256, True), (64, 128, False)],
                         ids=lambda x: str(x))
def test_forward_launcher_binds_padded_head_dims(monkeypatch, d, dv, store_tma):
    """True dims and padded tiles reach the kernel's constexprs; out has D_v columns; O leaves by TMA
    only where its padded tile fits Q's buffer."""
    fwd, run, cfg = _recorded_forward(monkeypatch, d, dv)
    f32 = torch.float32
    kw = fwd.calls[0][2]
    pad = lambda x: max(16, 1 << (x - 1).bit_length())  # noqa: E731
    assert (kw["HEAD_DIM_QK"], kw["HEAD_DIM_V"], kw["BLOCK_DQK"], kw["BLOCK_DV"]) == (d, dv, pad(d), pad(dv))
    assert kw["BLOCK_N"] == cfg["BLOCK_N"] and kw["NUM_STAGES"] == cfg["num_stages"]
    assert kw["STORE_TMA"] == store_tma
    assert kw["SPLIT_D"] is False, "split_d is off by default"
    # a float32 output (context parallelism's partials) always takes the masked pointer store
    fwd.calls.clear()
    out, _ = run(out_dtype=f32)
    assert out.shape[-1] == dv and out.dtype == f32 and not fwd.calls[0][2]["STORE_TMA"]


@pytest.mark.parametrize("d,dv,store_tma", [(96, 96, True), (80, 80, True), (96, 128, False), (192, 128, True)],
                         ids=lambda x: str(x))
def test_forward_launcher_binds_split_d(monkeypatch, d, dv, store_tma):
    """split_d reaches the kernel as SPLIT_D; the padded tiles stay the BLOCK_D* constexprs (the
    kernel derives its pieces from both); O leaves by TMA where its pieces fit Q's."""
    fwd, _, _ = _recorded_forward(monkeypatch, d, dv, dict(split_d=True))
    kw = fwd.calls[0][2]
    assert kw["SPLIT_D"] is True and kw["STORE_TMA"] == store_tma
    assert (kw["HEAD_DIM_QK"], kw["HEAD_DIM_V"]) == (d, dv)


@pytest.mark.parametrize("design", ["mixed", "split"])
def test_backward_launch_order(design, monkeypatch):
    """The mixed design: the dense dK/dV launch first and the Gluon dQ launch inside the side stream's
    block; the split one: dQ then dK/dV on one stream, no side stream asked for."""
    from utils import fake_side_stream

    from longca_triton.kernels.dense import op as D
    from longca_triton.kernels.gluon.plan import get_ws_plan

    events: list = []
    fake, state = fake_side_stream(events)
    monkeypatch.setattr(G, "side_stream", fake)
    monkeypatch.setattr(G, "launch_gluon_bwd_dq", lambda *a, **k: events.append(("dq", state["beside"])))
    monkeypatch.setattr(G, "launch_bwd_dkdv", lambda *a, **k: events.append(("dkdv", state["beside"])))
    monkeypatch.setattr(G, "launch_gluon_bwd_dkdv", lambda *a, **k: events.append(("gluon dkdv", state["beside"])))
    monkeypatch.setattr(G, "launch_bwd_preprocess", lambda out, dout, dlse=None: torch.zeros(
        out.shape[0], out.shape[2], out.shape[1]))
    mask = random_range_mask(200, 200, seed=2)
    q = torch.randn(1, 200, 4, 128, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 200, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    cfg = GC.resolve_config(128, torch.bfloat16, dict(bwd_design=design))
    bcfg = D.resolve_config(128, torch.bfloat16)
    kplan = (D.plans_for(mask, bcfg, "cpu")[1] if design == "mixed"
             else get_ws_plan(mask, cfg["dkdv_block_mq"], GC.BLOCK_M, "cpu", "k"))
    G.gluon_bwd(torch.randn_like(q), q, k, v, torch.randn_like(q), torch.zeros(1, 4, 200), G.dq_plan(mask, 128, "cpu"),
                kplan, 0.125, cfg, bwd_cfg=bcfg)
    want = ([("side_stream", True), ("dkdv", False), ("dq", True)] if design == "mixed"
            else [("dq", False), ("gluon dkdv", False)])
    assert events == want


def test_default_backend_per_mode_and_memoised(monkeypatch):
    """On an sm_90 GPU (faked: only the device's type and capability are read) a forward-only call and a
    call autograd records get their own row of the table, each worked out once per mask and shape."""
    from longca_triton import api

    class Device:
        type = "cuda"

        def __str__(self):
            return "cuda:0"

    class Like:  # what default_backend reads of a tensor
        def __init__(self, shape, grad=False):
            self.shape, self.dtype, self.requires_grad, self.device = shape, torch.bfloat16, grad, Device()

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(api, "_measured_choice", lambda *a: None)
    monkeypatch.setattr(get_backend("triton-gluon"), "check", lambda problem: (True, ""))
    calls = []
    real = api._choose
    monkeypatch.setattr(api, "_choose", lambda *a: calls.append(a[-1]) or real(*a))
    mask = lt.make_mask("causal_document", 4096, seed=0)
    q, k = Like((1, 4096, 64, 128)), Like((1, 4096, 8, 128))
    qg = Like((1, 4096, 64, 128), grad=True)
    for _ in range(3):
        assert api.default_backend(mask, q, k, k) == "triton"  # 4K, partial tiles, forward only
        assert api.default_backend(mask, qg, k, k) == "triton-gluon"  # autograd records it
        with torch.no_grad():
            assert api.default_backend(mask, qg, k, k) == "triton"
    assert calls == ["fwd", "fwd_bwd"]

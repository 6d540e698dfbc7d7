"""Issue 12 on an H100: where the Gluon backward's time goes, pass by pass, against the plain-Triton
backward's passes on the same inputs.

Both backwards are two passes after the same delta preprocess: dQ (query-major) and dK/dV
(key-major, a GQA group's query heads walked per key tile). Each pass of each kernel family is timed
alone (``dense_check.median_ms``, the harness's timer), with its default config for the mask (the
Gluon tier's ``resolve_config``, the dense kernel's ``resolve_config`` with q / k / mask), then the
whole backwards (Gluon dQ or plain dQ x Gluon dK/dV or plain dK/dV, in either launch order), each
checked against the float32 reference (one KV group) before it is timed. ``host_ms``: the host time
of one launch (a launch slower than the GPU work queued before it leaves the GPU idle).

    PYTHONUNBUFFERED=1 python experiments/gpu/gluon_bwd_split.py --out $OUT --masks full,causal
    PYTHONUNBUFFERED=1 python experiments/gpu/gluon_bwd_split.py --out $OUT --masks full,causal --interleave

Rows go to ``<out>/gluon_bwd_split.jsonl`` as they are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dense_check as DC  # noqa: E402

from longca_triton.bench.check import compare, reference_group  # noqa: E402
from longca_triton.kernels.dense import op as D  # noqa: E402
from longca_triton.kernels.gluon import op as G  # noqa: E402

#: name -> (dQ family, dK/dV family, dK/dV launched first)
PAIRS = {"gluon": ("gluon", "gluon", False), "triton": ("triton", "triton", False),
         "gluon-dq+triton-dkdv": ("gluon", "triton", False), "triton-dq+gluon-dkdv": ("triton", "gluon", False),
         "gluon (dkdv first)": ("gluon", "gluon", True), "triton-dkdv, then gluon-dq": ("gluon", "triton", True)}


def host_ms(fn, n: int = 20) -> float:
    """Mean host time of one launch (the Python call, not waiting for the GPU), after a warm-up."""
    fn()
    torch.cuda.synchronize()
    total = 0.0
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        total += time.perf_counter() - t0
        torch.cuda.synchronize()
    return total / n * 1e3


def _pair(passes, pre, qfam: str, kfam: str, dkdv_first: bool):
    """The whole backward of one pair: the delta preprocess, then its dQ and dK/dV passes in order."""
    def whole():
        pre()
        if dkdv_first:
            passes[(kfam, "dkdv")]()
        passes[(qfam, "dq")]()
        if not dkdv_first:
            passes[(kfam, "dkdv")]()
    return whole


def _checked(emit, whole, ref, pair: str, out, lse, grads) -> bool:
    """Run ``whole`` once; with a reference, compare its gradients (a ``check`` row). False when wrong."""
    whole()
    if ref is None:
        return True
    torch.cuda.synchronize()
    res = compare(ref, out, lse, list(grads), torch.bfloat16)
    emit(dict(kind="check", pair=pair, **res.as_row(), message=res.message))
    return res.ok


def run(out_dir: Path, mname: str, S: int, hq: int, hkv: int, d: int, checks: bool, interleave: bool = False):
    def emit(row):
        row = {"mask": mname, "S": S, **row}
        with open(out_dir / "gluon_bwd_split.jsonl", "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        print(json.dumps(row, default=str), flush=True)

    p = DC.Problem(DC.bench_mask(mname, S), hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16)
    gcfg = G.resolve_config(d, p.q.dtype, None, q=p.q, k=p.k, mask=p.mask)
    gcfg["gluon_bwd"], gcfg["bwd_design"] = True, "split"
    tcfg = D.resolve_config(d, p.q.dtype, q=p.q, k=p.k, mask=p.mask)
    fplan, g_dq_plan, g_dkdv_plan = G.plans_for_gluon(p.mask, gcfg, tcfg, DC.DEV)
    t_kplan = DC.get_tile_plan(p.mask, tcfg["DKDV_BLOCK_M"], tcfg["DKDV_BLOCK_N"], DC.DEV)
    t_qplan = DC.get_tile_plan(p.mask, tcfg["DQ_BLOCK_M"], tcfg["DQ_BLOCK_N"], DC.DEV)
    emit(dict(kind="configs", gluon={k: gcfg[k] for k in ("dq_block_n", "dq_stages", "dkdv_block_mq", "dkdv_stages")},
              triton={k: v for k, v in tcfg.items() if k.startswith(("DQ", "dq", "DKDV", "dkdv"))}))
    out, lse = G.gluon_fwd(p.q, p.k, p.v, fplan, p.scale, gcfg)
    q, k, v, do, lse_c, delta, (dq, dk, dv) = G._bwd_inputs(p.dout, p.q, p.k, p.v, out, lse, None)

    passes = {
        ("gluon", "dq"): lambda: G.launch_gluon_bwd_dq(q, k, v, do, dq, lse_c, delta, g_dq_plan, p.scale, gcfg),
        ("gluon", "dkdv"): lambda: G.launch_gluon_bwd_dkdv(q, k, v, do, dk, dv, lse_c, delta, g_dkdv_plan, p.scale,
                                                           gcfg),
        ("triton", "dq"): lambda: D.launch_bwd_dq(q, k, v, do, lse_c, delta, dq, t_qplan, p.scale, tcfg),
        ("triton", "dkdv"): lambda: D.launch_bwd_dkdv(q, k, v, do, lse_c, delta, dk, dv, t_kplan, p.scale, tcfg),
    }
    pre = lambda: D.launch_bwd_preprocess(out, do)  # noqa: E731
    pre()
    emit(dict(kind="pass", family="both", name="preprocess", ms=DC.median_ms(pre, rep=150)))
    for (fam, name), fn in passes.items():
        fn()
        if not interleave:
            emit(dict(kind="pass", family=fam, name=name, ms=DC.median_ms(fn, rep=250), host_ms=host_ms(fn)))

    ref = reference_group(p.mask, p.q, p.k, p.v, p.dout, p.scale, True) if checks else None
    if interleave:
        _interleaved(emit, p, passes, pre, out, lse, dq, dk, dv, ref, mname)
        return
    for pair, (qfam, kfam, dkdv_first) in PAIRS.items():
        whole = _pair(passes, pre, qfam, kfam, dkdv_first)
        if not _checked(emit, whole, ref, pair, out, lse, (dq, dk, dv)):
            continue
        t = DC.median_ms(whole, rep=250)
        emit(dict(kind="bwd", pair=pair, ms=t, tflops=p.bwd_flops / t * 1e-9))
        # each kernel's time inside the sequence (CUDA events between the launches): which one
        # runs slower there than alone
        order = [("preprocess", pre)] + ([("dkdv", passes[(kfam, "dkdv")]), ("dq", passes[(qfam, "dq")])]
                                         if dkdv_first else
                                         [("dq", passes[(qfam, "dq")]), ("dkdv", passes[(kfam, "dkdv")])])
        seg = {name: [] for name, _ in order}
        for _ in range(15):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(order) + 1)]
            ev[0].record()
            for i, (name, fn) in enumerate(order):
                fn()
                ev[i + 1].record()
            torch.cuda.synchronize()
            for i, (name, _) in enumerate(order):
                seg[name].append(ev[i].elapsed_time(ev[i + 1]))
        emit(dict(kind="segments", pair=pair, **{n: sorted(v)[len(v) // 2] for n, v in seg.items()}))


#: the pairs ``--interleave`` times beside SDPA-cuDNN's backward
INTERLEAVED = ("triton", "gluon-dq+triton-dkdv", "triton-dkdv, then gluon-dq", "gluon")


def _interleaved(emit, p, passes, pre, out, lse, dq, dk, dv, ref, mname):
    """``--interleave``: the whole backwards of ``INTERLEAVED`` and SDPA-cuDNN's (full and causal
    only) timed with their repetitions interleaved (``time_interleaved``), each pair checked first."""
    from longca_triton.adapters import get_backend
    from longca_triton.bench.timing import time_interleaved

    fns = {}
    for pair in INTERLEAVED:
        whole = _pair(passes, pre, *PAIRS[pair])
        if _checked(emit, whole, ref, pair, out, lse, (dq, dk, dv)):
            fns[pair] = whole
    if mname in ("full", "causal"):
        # the harness's own sdpa-cudnn backend (is_causal / no mask for these two; GQA native or repeated
        # as it probes), its backward timed through autograd
        q, k, v = (t.detach().requires_grad_() for t in (p.q, p.k, p.v))
        o = get_backend("sdpa-cudnn").attention(q, k, v, p.mask, softmax_scale=p.scale)
        fns["sdpa-cudnn"] = lambda: torch.autograd.grad(o, (q, k, v), p.dout, retain_graph=True)
    stats = time_interleaved(list(fns.values()), rep=40, max_ms=4000)
    ms = {name: st["median_ms"] for name, st in zip(fns, stats)}
    for name, t in ms.items():
        emit(dict(kind="bwd_interleaved", pair=name, ms=t, tflops=p.bwd_flops / t * 1e-9,
                  vs_cudnn=ms["sdpa-cudnn"] / t if "sdpa-cudnn" in ms else None))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--S", type=int, default=16384)
    ap.add_argument("--masks", default="full,causal")
    ap.add_argument("--heads", default="64:8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--interleave", action="store_true",
                    help="only the whole backwards of INTERLEAVED and SDPA-cuDNN's, timed interleaved")
    a = ap.parse_args(argv)
    hq, hkv = (int(x) for x in a.heads.split(":"))
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "gluon_bwd_split.jsonl", "a") as f:
        f.write(json.dumps(dict(kind="env", **DC.env_info())) + "\n")
    for m in filter(None, a.masks.split(",")):
        run(out_dir, m, a.S, hq, hkv, a.head_dim, not a.no_check, a.interleave)


if __name__ == "__main__":
    main()

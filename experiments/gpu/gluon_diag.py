"""First contact of the Gluon kernels with an sm_90 GPU: each kernel checked on its own, each case in
its own process (an illegal address or a hang in one case cannot poison the next), then a short
timing of the forward and backward next to the plain-Triton kernels and cuDNN.

    PYTHONUNBUFFERED=1 python experiments/gpu/gluon_diag.py --out $OUT [--budget 300]
    # the padded head dims only (cases, then the forward timed next to sdpa-cudnn at each):
    PYTHONUNBUFFERED=1 python experiments/gpu/gluon_diag.py --out $OUT --head-dims 96,192/128,256,64
    # the Gluon forward's configs next to its default on every static mask at 16K (D = 128)
    PYTHONUNBUFFERED=1 python experiments/gpu/gluon_diag.py --out $OUT --fwd-configs 16384 --masks all \
        --config-json '[{"consumers": 3, "p_smem": true}]'
    # ... and a Gluon config next to the default one (issue 17: split head dims vs padded tiles)
    PYTHONUNBUFFERED=1 python experiments/gpu/gluon_diag.py --out $OUT --head-dims 96,80,128 --fwd-only \
        --config-json '{"split_d": true}'

Per case (bf16, against the float32 chunked reference with TF32 off):

* ``fwd``: the Gluon forward alone (``torch.no_grad``): relative L2 error of ``out`` over rows that
  attend something, max |lse - ref| over finite rows, zeros/-inf on empty rows, and the same error
  for PyTorch's bf16 SDPA (the bar);
* ``bwd``: the Gluon dQ and dK/dV kernels (``gluon_bwd=True``): relative L2 error of dq, dk, dv
  (skipped at head dims the Gluon backward does not take: the padded ones, D_v != D_qk);
* ``bwd_triton``: the plain-Triton backward after the Gluon forward (``gluon_bwd=False``);
* ``bwd_fused``: the fused Gluon backward (``bwd_design="fused"``: one kernel, dQ by atomics;
  skipped where ``bwd`` is);
* ``fwd+<key=value,...>``: with ``--config-json``, the forward with each of those configs, checked
  like ``fwd`` (skipped where ``resolve_config`` refuses it, e.g. ``split_d`` at a power-of-two
  dim). The timing then has a ``triton-gluon+<key=value,...>`` row per config next to the default.

``LONGCA_PACKAGE_ROOT=DIR`` imports ``longca_triton`` from ``DIR`` (an A/B of two versions in one call).

Each stage records ``ok`` / the error text and the traceback's last lines, so one failing kernel
still lets the others report. Rows go to ``<out>/gluon_diag.jsonl`` as they finish.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
if os.environ.get("LONGCA_PACKAGE_ROOT"):
    # A/B of two versions of the kernels in one device call: import ``longca_triton`` from this
    # directory (``git archive HEAD longca_triton | tar -x -C _base``) instead of the checkout
    sys.path.insert(0, os.path.abspath(os.environ["LONGCA_PACKAGE_ROOT"]))

# (name, mask, Sq, Sk, Hq, Hkv, D[, D_v]): from the simplest (full, one head, tile multiples) up
CASES = [
    ("full-1024-D128", "full", 1024, 1024, 2, 2, 128),
    ("causal-1000-D128-gqa", "causal", 1000, 1000, 4, 2, 128),
    ("full-1024-D64", "full", 1024, 1024, 2, 2, 64),
    ("random-777x2049-D64", "random", 777, 2049, 4, 2, 64),
    ("causal_document-4096-D128", "causal_document", 4096, 4096, 4, 1, 128),
    ("random-2048x300-D128", "random", 2048, 300, 2, 2, 128),
    # padded head dims: power-of-two tiles, true dims as the descriptors' shapes
    ("full-1024-D256", "full", 1024, 1024, 2, 2, 256),
    ("random-777x2049-D192/128-gqa", "random", 777, 2049, 4, 2, 192, 128),
    ("causal-1000-D96-gqa", "causal", 1000, 1000, 4, 2, 96),
    ("random-2048x300-D80", "random", 2048, 300, 2, 2, 80),
    ("random-777x2049-D96-gqa", "random", 777, 2049, 4, 2, 96),
    ("full-1024-D80-gqa", "full", 1024, 1024, 4, 2, 80),
    ("random-1000x1000-D256-gqa", "random", 1000, 1000, 8, 2, 256),
    ("full-1024-D64/128", "full", 1024, 1024, 2, 2, 64, 128),
]


def _dims(case) -> tuple[int, int]:
    """``(D_qk, D_v)`` of a case."""
    return case[6], case[7] if len(case) > 7 else case[6]


def _mask(kind, sq, sk):
    from utils import random_range_mask, small_mask

    return random_range_mask(sq, sk, seed=1) if kind == "random" else small_mask(kind, sq, seed=0)


def _rel(x, ref, rows=None):
    x, ref = x.float(), ref.float()
    if rows is not None:
        x, ref = x[:, rows], ref[:, rows]
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _tail(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])[-3000:]


def _extra_configs(text: str | None) -> list[dict]:
    """``--config-json``: one config object or a list of them (Gluon ``CONFIG_KEYS``)."""
    if not text:
        return []
    val = json.loads(text)
    return [val] if isinstance(val, dict) else list(val)


def _label(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items())


def _config_reason(cfg: dict, d: int, dv: int) -> str:
    """Why ``cfg`` cannot run at these head dims (empty when it can): ``resolve_config``'s error."""
    import torch

    from longca_triton.kernels.gluon.op import resolve_config

    try:
        resolve_config(d, torch.bfloat16, cfg, head_dim_v=dv)
    except ValueError as e:
        return str(e)
    return ""


def _fwd_check(q, k, v, mask, ref, ref_lse, rows, config=None) -> dict:
    """The Gluon forward alone against the reference: error, lse, empty rows, the -inf pattern."""
    import torch

    from longca_triton.kernels.gluon.op import gluon_attention

    t0 = time.time()
    try:
        with torch.no_grad():
            out, lse = gluon_attention(q, k, v, mask, return_lse=True, config=config)
        torch.cuda.synchronize()
        fin = torch.isfinite(ref_lse)
        return dict(
            ok=True, s=round(time.time() - t0, 1), err_out=_rel(out, ref, rows),
            lse_maxdiff=(lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0,
            nan=bool(torch.isnan(out).any() or torch.isnan(lse).any()),
            empty_rows_zero=bool(torch.all(out[:, ~rows] == 0)),
            lse_inf_pattern=bool(torch.equal(torch.isinf(lse), torch.isinf(ref_lse))))
    except Exception as e:  # noqa: BLE001 -- recorded, the next stage still runs
        return dict(ok=False, s=round(time.time() - t0, 1), error=_tail(e))


def run_case(idx: int, extra: list | None = None) -> dict:
    import torch
    import torch.nn.functional as F

    from longca_triton.kernels.gluon.op import gluon_attention
    from longca_triton.reference import chunked_attention

    torch.backends.cuda.matmul.allow_tf32 = False
    from longca_triton.kernels.gluon.op import bwd_reason

    name, kind, sq, sk, hq, hkv = CASES[idx][:6]
    d, dv = _dims(CASES[idx])
    row = dict(case=name, Sq=sq, Sk=sk, Hq=hq, Hkv=hkv, D=d, D_v=dv)
    mask = _mask(kind, sq, sk)
    g = torch.Generator(device="cuda").manual_seed(idx)
    q = torch.randn(1, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, sk, hkv, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(1, sq, hq, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    ref, ref_lse = chunked_attention(q32, k32, v32, mask, return_lse=True, chunk=1024)
    ref.backward(dout.float())
    dense = mask.to_dense().cuda()
    rows = dense.any(1)
    G = hq // hkv
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k.repeat_interleave(G, 2), v.repeat_interleave(G, 2)))
    pt = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=dense).transpose(1, 2)
    row["bar_out"] = _rel(pt, ref, rows)

    row["fwd"] = _fwd_check(q, k, v, mask, ref, ref_lse, rows)
    if not row["fwd"]["ok"]:
        return row
    for cfg in extra or []:
        why = _config_reason(cfg, d, dv)
        row[f"fwd+{_label(cfg)}"] = dict(skipped=why) if why else _fwd_check(q, k, v, mask, ref, ref_lse, rows, cfg)
    for stage, cfg in (("bwd", dict(gluon_bwd=True)), ("bwd_triton", dict(gluon_bwd=False)),
                       ("bwd_fused", dict(gluon_bwd=True, bwd_design="fused"))):
        if stage != "bwd_triton" and bwd_reason(d, dv):
            row[stage] = dict(skipped=bwd_reason(d, dv))
            continue
        t0 = time.time()
        try:
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            out = gluon_attention(qg, kg, vg, mask, config=cfg)
            out.backward(dout)
            torch.cuda.synchronize()
            row[stage] = dict(ok=True, s=round(time.time() - t0, 1),
                              **{f"err_{n}": _rel(x.grad, r.grad) for n, x, r in
                                 (("dq", qg, q32), ("dk", kg, k32), ("dv", vg, v32))},
                              nan=bool(any(torch.isnan(x.grad).any() for x in (qg, kg, vg))))
        except Exception as e:  # noqa: BLE001
            row[stage] = dict(ok=False, s=round(time.time() - t0, 1), error=_tail(e))
            if "illegal" in str(e) or "CUDA error" in str(e):
                break
    return row


def run_timing(S: int, d: int = 128, dv: int = 128, fwd_only: bool = False, extra: list | None = None) -> list:
    """Forward and backward (``fwd_only``: forward) TFLOP/s at ``S`` of the plain-Triton kernel,
    the Gluon one (its default config, and each of ``extra`` that is valid at these dims as
    ``triton-gluon+<key=value,...>``) and PyTorch's cuDNN SDPA (full and causal; it takes
    D_v != D_qk since torch 2.5, an error is recorded otherwise), B=1, GQA 64:8, bf16, head dims
    ``d``/``dv``. The FLOP count is that of the true dims (``mask.flops(hq, d, mode, dv)``)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from longca_triton.bench.timing import time_fn
    from longca_triton.kernels.dense.op import dense_attention
    from longca_triton.kernels.gluon.op import gluon_attention
    from longca_triton.masks import make_mask

    rows = []
    hq, hkv = 64, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, S, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, S, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, S, hkv, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(1, S, hq, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    for name in ("full", "causal", "causal_document"):
        mask = make_mask(name, S, seed=0)
        fl_f, fl_b = mask.flops(hq, d, "fwd", dv), mask.flops(hq, d, "bwd", dv)
        fns = {
            "triton": lambda c=None: dense_attention(q, k, v, mask),
            "triton-gluon": lambda: gluon_attention(q, k, v, mask),
        }
        gluon_cfgs = {"triton-gluon": None}
        for cfg in extra or []:
            if not _config_reason(cfg, d, dv):
                gluon_cfgs[f"triton-gluon+{_label(cfg)}"] = cfg
                fns[f"triton-gluon+{_label(cfg)}"] = lambda cfg=cfg: gluon_attention(q, k, v, mask, config=cfg)
        if name in ("full", "causal"):
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

            def cudnn(qt=qt, kt=kt, vt=vt, causal=name == "causal"):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
            fns["sdpa-cudnn"] = cudnn
        for b, fn in fns.items():
            row = dict(mask=name, S=S, backend=b, D=d, D_v=dv)
            try:
                with torch.no_grad():
                    t = time_fn(fn, max_ms=3000)["median_ms"]
                row["fwd_ms"], row["fwd_tflops"] = t, fl_f / t / 1e9
            except Exception as e:  # noqa: BLE001
                row["fwd_error"] = _tail(e)
            if fwd_only:
                print(json.dumps(row), flush=True)
                rows.append(row)
                continue
            try:
                qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v)) if b != "sdpa-cudnn" else \
                    (x.transpose(1, 2).clone().requires_grad_() for x in (q, k, v))
                if b == "sdpa-cudnn":
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=name == "causal", enable_gqa=True)
                    do = dout.transpose(1, 2)
                elif b == "triton":
                    o = dense_attention(qg, kg, vg, mask)
                    do = dout
                else:
                    o = gluon_attention(qg, kg, vg, mask, config=gluon_cfgs[b])
                    do = dout
                t = time_fn(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True),
                            max_ms=3000)["median_ms"]
                row["bwd_ms"], row["bwd_tflops"] = t, fl_b / t / 1e9
            except Exception as e:  # noqa: BLE001
                row["bwd_error"] = _tail(e)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


# 128-row dQ key tiles fit a ring of 2 only (3 needs 263168 B: run 2 refused them)
BWD_CONFIGS = [dict(), dict(dkdv_skew=True), dict(dkdv_block_mq=64, dq_block_n=128, dq_stages=2),
               dict(dkdv_block_mq=32), dict(dkdv_block_mq=64), dict(dq_block_n=128, dq_stages=2),
               dict(dkdv_stages=2, dq_stages=3),
               dict(bwd_consumer_regs=232),
               # the fused design (FA3's one kernel, dQ by atomics): its default and its knobs
               dict(bwd_design="fused"), dict(bwd_design="fused", fused_stages=3),
               dict(bwd_design="fused", fused_block_mq=64), dict(bwd_design="fused", bwd_consumer_regs=232),
               # its dQ-writer path (dQ^T staged in shared memory, a writer partition's 4-wide
               # atomics; 232 consumer registers by default): experiments/results/cpu-aot/gluon_fused_bwd.md
               dict(bwd_design="fused", fused_dq="writer"), dict(bwd_design="fused", fused_dq="writer", fused_stages=3),
               dict(bwd_design="fused", fused_dq="writer_keys"),
               dict(bwd_design="fused", fused_dq="writer_keys", fused_stages=3)]


def run_bwd_configs(S: int, only_fused: bool = False, masks=("full", "causal"), configs=None) -> list:
    """The Gluon backward's knobs at ``S`` (``masks``; GQA 64:8, D=128): ms of dq, dk, dv.
    ``only_fused``: the split default and the fused design's configs only; ``configs``: these
    (after the default ``{}``) instead of ``BWD_CONFIGS``. ``{"gluon_bwd": false}`` times the
    plain-Triton backward under the Gluon forward."""
    import torch

    from longca_triton.bench.timing import time_fn
    from longca_triton.kernels.gluon.op import gluon_attention
    from longca_triton.masks import make_mask

    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, S, 64, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, S, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    todo = [dict(), *configs] if configs else [c for c in BWD_CONFIGS if not only_fused or not c
                                               or c.get("bwd_design") == "fused"]
    for name in masks:
        mask = make_mask(name, S, seed=0)
        for cfg in todo:
            row = dict(mask=name, S=S, config=cfg)
            try:
                qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
                o = gluon_attention(qg, kg, vg, mask, config=cfg)
                t = time_fn(lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True),
                            max_ms=2000)["median_ms"]
                row["bwd_ms"], row["bwd_tflops"] = t, mask.flops(64, 128, "bwd") / t / 1e9
            except Exception as e:  # noqa: BLE001
                row["error"] = _tail(e)
            print("ROW " + json.dumps(row), flush=True)
            rows.append(row)
    return rows


def run_fwd_configs(S: int, masks, configs, d: int = 128, interleave: bool = False) -> list:
    """The Gluon forward's configs at ``S`` on ``masks`` (GQA 64:8, head dim ``d``): TFLOP/s of the
    default (``{}``) and each of ``configs``, each config first checked against the float32
    chunked reference (relative L2 error of ``out`` < 0.02, bf16's is ~0.002; a failing config is
    not timed). ``interleave``: a mask's configs are timed with their repetitions interleaved
    (``time_interleaved``: round r starts with config r mod n), so a drifting SM clock weighs on
    all of them alike; else one config after the other."""
    import torch

    from longca_triton.bench.timing import time_fn, time_interleaved
    from longca_triton.kernels.gluon.op import gluon_attention
    from longca_triton.masks import make_mask
    from longca_triton.reference import chunked_attention

    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, S, 64, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, S, 8, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    for name in masks:
        mask = make_mask(name, S, seed=0)
        ref = None
        timed = []
        for cfg in [dict(), *configs]:
            row = dict(mask=name, S=S, D=d, config=cfg)
            try:
                with torch.no_grad():
                    o = gluon_attention(q, k, v, mask, config=cfg or None)
                    if ref is None:
                        ref = chunked_attention(q.float(), k.float(), v.float(), mask, chunk=1024)
                    err = _rel(o, ref)
                row["err_out"] = err
                if not err < 0.02:
                    raise AssertionError(f"relative error {err} against the float32 reference")
                if interleave:
                    timed.append(row)
                    continue
                with torch.no_grad():
                    t = time_fn(lambda: gluon_attention(q, k, v, mask, config=cfg or None), max_ms=2000)["median_ms"]
                row["fwd_ms"], row["fwd_tflops"] = t, mask.flops(64, d, "fwd") / t / 1e9
            except Exception as e:  # noqa: BLE001
                row["error"] = _tail(e)
            print("ROW " + json.dumps(row), flush=True)
            rows.append(row)
        if timed:
            fns = [lambda c=r["config"]: gluon_attention(q, k, v, mask, config=c or None) for r in timed]
            with torch.no_grad():
                stats = time_interleaved(fns, rep=40, max_ms=3000)
            for row, st in zip(timed, stats):
                t = st["median_ms"]
                row["fwd_ms"], row["fwd_tflops"], row["interleaved"] = t, mask.flops(64, d, "fwd") / t / 1e9, True
                print("ROW " + json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget", type=float, default=300.0, help="wall-clock seconds for everything")
    ap.add_argument("--case", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--timing", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bwd-configs", type=int, default=None, metavar="S",
                    help="only time the Gluon backward's configs at this length")
    ap.add_argument("--fwd-configs", type=int, default=None, metavar="S",
                    help="only time the Gluon forward's --config-json configs next to its default at this "
                         "length on --masks (D = 128 unless --head-dims names one dim)")
    ap.add_argument("--interleave", action="store_true",
                    help="with --fwd-configs: time a mask's configs with their repetitions interleaved")
    ap.add_argument("--bwd-only-fused", action="store_true",
                    help="with --bwd-configs: the split default and the fused design's configs only")
    ap.add_argument("--masks", default="full,causal", metavar="NAME,...",
                    help="with --bwd-configs / --fwd-configs: the static masks to time (default full,causal; "
                         "'all': every one)")
    ap.add_argument("--S", type=int, default=16384, help="sequence length of the timing")
    ap.add_argument("--head-dims", default=None, metavar="D,...",
                    help="only the cases at these head dims (D or D_qk/D_v, e.g. 96,192/128,256), then a "
                         "timing at each (default: every case, one timing at D=128)")
    ap.add_argument("--fwd-only", action="store_true", help="time the forward only")
    ap.add_argument("--config-json", default=None, metavar="JSON",
                    help="Gluon config(s) to check and time next to the default: a JSON object or list of "
                         "them, e.g. '{\"split_d\": true}' (skipped at dims where resolve_config refuses it)")
    ap.add_argument("--dims", default="128", help=argparse.SUPPRESS)
    args = ap.parse_args()
    parse = lambda t: tuple(int(x) for x in t.split("/")) * (2 if "/" not in t else 1)  # noqa: E731
    extra = _extra_configs(args.config_json)
    if args.case is not None:
        print("ROW " + json.dumps(run_case(args.case, extra)), flush=True)
        return
    if args.bwd_configs is not None:
        from longca_triton.masks import STATIC_MASK_NAMES as STATIC_MASKS

        masks = list(STATIC_MASKS) if args.masks == "all" else [m.strip() for m in args.masks.split(",")]
        unknown = [m for m in masks if m not in STATIC_MASKS]
        if unknown:
            ap.error(f"--masks: unknown {unknown}; valid: {', '.join(STATIC_MASKS)}")
        run_bwd_configs(args.bwd_configs, args.bwd_only_fused, masks, extra or None)
        return
    if args.fwd_configs is not None:
        from longca_triton.masks import STATIC_MASK_NAMES as STATIC_MASKS

        masks = list(STATIC_MASKS) if args.masks == "all" else [m.strip() for m in args.masks.split(",")]
        unknown = [m for m in masks if m not in STATIC_MASKS]
        if unknown:
            ap.error(f"--masks: unknown {unknown}; valid: {', '.join(STATIC_MASKS)}")
        if args.head_dims and not args.head_dims.isdigit():
            ap.error(f"--fwd-configs takes one head dim in --head-dims (D_qk = D_v), got {args.head_dims!r}")
        d = int(args.head_dims) if args.head_dims else 128
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with (out / "fwd_configs.jsonl").open("a") as f:
            for r in run_fwd_configs(args.fwd_configs, masks, extra, d, args.interleave):
                f.write(json.dumps(r) + "\n")
                f.flush()
        return
    if args.timing is not None:
        for r in run_timing(args.timing, *parse(args.dims), fwd_only=args.fwd_only, extra=extra):
            print("ROW " + json.dumps(r), flush=True)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_end = time.time() + args.budget
    jl = out / "gluon_diag.jsonl"
    fwd_ok = False
    # (config label, D_qk, D_v) of extra configs that failed a case's forward check: not timed at
    # those dims (numerics first)
    failed: set = set()
    if args.head_dims:
        dims = [parse(t.strip()) for t in args.head_dims.split(",")]
        jobs = [("case", i) for i in range(len(CASES)) if _dims(CASES[i]) in dims]
        jobs += [("timing", (args.S, f"{d}/{dv}")) for d, dv in dims]
    else:
        jobs = [("case", i) for i in range(len(CASES))] + [("timing", (args.S, "128/128"))]
    for kind, arg in jobs:
        left = t_end - time.time()
        if left < 20:
            print(f"budget spent; skipped {kind} {arg}")
            continue
        if kind == "timing" and not fwd_ok:
            print("timing skipped: no case passed the forward")
            continue
        cmd = [sys.executable, __file__, f"--{kind}", str(arg)]
        if kind == "timing":
            cmd = [sys.executable, __file__, "--timing", str(arg[0]), "--dims", arg[1]]
            cmd += ["--fwd-only"] if args.fwd_only else []
        at = parse(arg[1]) if kind == "timing" else None
        timed = [c for c in extra if kind == "case" or (_label(c), *at) not in failed]
        cmd += ["--config-json", json.dumps(timed)] if timed else []
        if kind == "timing" and len(timed) < len(extra):
            print(f"timing at {arg[1]} without {[_label(c) for c in extra if c not in timed]}: their forward "
                  "failed a case there")
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=min(left, 240 if kind == "case" else 200))
            rows = [json.loads(ln[4:]) for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
            if not rows:
                rows = [dict(job=f"{kind}={arg}", rc=p.returncode, stderr=p.stderr[-3000:])]
        except subprocess.TimeoutExpired as e:
            so = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            rows = [json.loads(ln[4:]) for ln in so.splitlines() if ln.startswith("ROW ")]
            rows.append(dict(job=f"{kind}={arg}", timeout_s=round(time.time() - t0)))
        with jl.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
                print(json.dumps(r)[:1500], flush=True)
                fwd_ok |= bool(r.get("fwd", {}).get("ok") and r["fwd"].get("err_out", 1) < 0.05)
                for c in extra:
                    st = r.get(f"fwd+{_label(c)}")
                    if st is not None and "skipped" not in st and not (st.get("ok") and st.get("err_out", 1) < 0.05
                                                                       and st.get("empty_rows_zero")):
                        failed.add((_label(c), r.get("D"), r.get("D_v")))


if __name__ == "__main__":
    main()

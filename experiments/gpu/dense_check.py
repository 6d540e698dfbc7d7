"""GPU check and benchmark of our dense structured-mask Triton kernels (longca_triton/kernels/dense/op.py).

Run from the repository root on a CUDA machine (the package need not be installed):

    PYTHONUNBUFFERED=1 python experiments/gpu/dense_check.py --out $OUT

Phases (each guarded by a wall-clock budget; rows are appended to <out>/dense_check.jsonl as
they are measured, and a markdown summary goes to <out>/dense_check.md):

1. correctness, bf16: every static mask at S=4096 (GQA 16:2, D=128) and causal_document at S=16K
   (GQA 4:1): out, lse, dq, dk, dv against a float32 naive reference; PyTorch's own bf16 attention
   (SDPA with the boolean mask) against the same reference sets the bar (ours <= 2x its error).
2. config sweep on full and causal (S=16K, GQA 64:8, D=128): forward, dK/dV and dQ kernels timed
   separately over a few launch configs; the fastest of each is kept.
3. every static mask at S=16K with the kept configs: fwd and bwd TFLOP/s (docs/masks.md §5), and
   cuDNN SDPA (full, causal) and compiled FlexAttention (a few masks) in the same process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


sys.path.insert(0, str(REPO))  # a plain checkout runs without installing

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from longca_triton.bench.timing import time_fn  # noqa: E402
from longca_triton.kernels.dense import op as D  # noqa: E402
from longca_triton.kernels.dense.plan import get_tile_plan  # noqa: E402
from longca_triton.masks import STATIC_MASK_NAMES, make_mask  # noqa: E402
from longca_triton.reference.naive import naive_attention  # noqa: E402

T0 = time.time()
DEV = "cuda"  # the CPU smoke test of this script sets "cpu" (TRITON_INTERPRET=1)
ROWS: list = []


def elapsed() -> float:
    return time.time() - T0


def env_info() -> dict:
    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                cudnn=torch.backends.cudnn.version(), cuda=torch.version.cuda)
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        info["driver"] = f"unknown ({e})"
    try:
        info["commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        info["commit"] = "unknown"
    return info


def emit(out_dir: Path, row: dict):
    ROWS.append(row)
    with open(out_dir / "dense_check.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def time_variant(out_dir: Path, kind: str, time_one, flops: float, **row) -> float:
    """``time_one()`` in ms, emitted as a ``kind`` row with its TFLOP/s; a failure is emitted as an
    error row and counts as inf (the variant loses, the sweep goes on)."""
    try:
        t = time_one()
    except Exception as e:  # noqa: BLE001
        emit(out_dir, dict(kind=kind, **row, status=f"error: {e!r}"[:400]))
        return float("inf")
    emit(out_dir, dict(kind=kind, **row, ms=t, tflops=flops / t * 1e-9))
    return t


def bench_mask(name: str, S: int):
    """Masks as in docs/anchors.md (S=16K): docs from the histogram, window 1024, prefix S/3 / 512.

    ``"<document mask>/<n>"`` (e.g. ``full_document/2``) is that mask with ``n`` equal documents: a
    diagnostic with the area of ``causal`` (n = 2) in full tiles only, every loop half as long as full's.
    """
    if "/" in name:
        base, n = name.split("/")
        return make_mask(base, S, seed=0, doc_lens=[S // int(n)] * (int(n) - 1) + [S - S // int(n) * (int(n) - 1)])
    params = {}
    if name == "prefix_lm_causal":
        params["prefix"] = S // 3
    if name == "prefix_lm_document":
        params["prefix"] = 512
    if name == "global_sliding_window":
        params["global_tokens"] = 1024
    return make_mask(name, S, seed=0, **params)


def rel(x, ref) -> float:
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def median_ms(fn, rep=100) -> float:
    """Median ms over about ``rep`` ms of timed calls after 25 ms of warm-up (the harness's timer)."""
    return time_fn(fn, warmup_ms=25, rep=10**6, max_ms=rep, min_rep=1)["median_ms"]


# ------------------------------------------------------------------------------------ phase 1
def check_case(out_dir, name, S, hq, hkv, d=128, seed=0, dev="cuda", dtype=torch.bfloat16,
               config=None, config_name="default"):
    torch.manual_seed(seed)
    mask = bench_mask(name, S)
    q = torch.randn(1, S, hq, d, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(1, S, hkv, d, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(1, S, hkv, d, device=dev, dtype=dtype, requires_grad=True)
    dout = torch.randn(1, S, hq, d, device=dev, dtype=dtype)
    # poison the cached allocator's free blocks so an unwritten output element cannot pass
    if dev == "cuda":
        torch.empty(4 * S * hq * d, device=dev, dtype=torch.float32).fill_(float("nan"))
    out, lse = D.dense_attention(q, k, v, mask, return_lse=True, config=config)
    out.backward(dout)
    ours = dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad)
    # float32 reference (no TF32)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = naive_attention(q32, k32, v32, mask, return_lse=True)
    ref_out.backward(dout.float())
    ref = dict(out=ref_out.detach(), dq=q32.grad, dk=k32.grad, dv=v32.grad)
    del ref_out
    # PyTorch's own bf16 attention with the same boolean mask (K/V heads expanded for GQA)
    g = hq // hkv
    qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
    allowed = mask.to_dense().to(dev)
    tout = F.scaled_dot_product_attention(qb.transpose(1, 2), kb.repeat_interleave(g, 2).transpose(1, 2),
                                          vb.repeat_interleave(g, 2).transpose(1, 2),
                                          attn_mask=allowed).transpose(1, 2)
    tout.backward(dout)
    torch_ = dict(out=tout.detach(), dq=qb.grad, dk=kb.grad, dv=vb.grad)
    row = dict(kind="correctness", config=config_name, mask=name, S=S, Hq=hq, Hkv=hkv, D=d, dtype="bf16",
               density=mask.density)
    ok = True
    for key in ("out", "dq", "dk", "dv"):
        e_ours, e_torch = rel(ours[key], ref[key]), rel(torch_[key], ref[key])
        row[f"err_{key}"] = e_ours
        row[f"torch_err_{key}"] = e_torch
        row[f"ratio_{key}"] = e_ours / max(e_torch, 1e-12)
        ok &= bool(e_ours <= 2 * e_torch) and not math.isnan(e_ours)
    fin = torch.isfinite(ref_lse)
    row["lse_max_abs_err"] = (lse[fin] - ref_lse[fin]).abs().max().item()
    row["lse_inf_match"] = bool(torch.equal(torch.isinf(lse), torch.isinf(ref_lse)))
    ok &= row["lse_inf_match"] and row["lse_max_abs_err"] < 5e-2
    row["pass"] = ok
    emit(out_dir, row)
    del q, k, v, q32, k32, v32, qb, kb, vb, ours, ref, torch_
    if dev == "cuda":
        torch.cuda.empty_cache()
    return ok


# ------------------------------------------------------------------------------------ phase 2/3
class Problem:
    def __init__(self, mask, hq=64, hkv=8, d=128, dtype=torch.bfloat16, seed=0):
        torch.manual_seed(seed)
        S = mask.seqlen_q
        self.mask, self.hq, self.hkv, self.d = mask, hq, hkv, d
        self.q = torch.randn(1, S, hq, d, device=DEV, dtype=dtype)
        self.k = torch.randn(1, S, hkv, d, device=DEV, dtype=dtype)
        self.v = torch.randn(1, S, hkv, d, device=DEV, dtype=dtype)
        self.dout = torch.randn(1, S, hq, d, device=DEV, dtype=dtype)
        self.scale = d ** -0.5
        self.fwd_flops = 4.0 * d * hq * mask.area
        self.bwd_flops = 2.5 * self.fwd_flops


def time_ours_fwd(p: Problem, cfg):
    plan = get_tile_plan(p.mask, cfg["BLOCK_M"], cfg["BLOCK_N"], DEV)
    fn = lambda: D.dense_fwd(p.q, p.k, p.v, plan, p.scale, cfg)  # noqa: E731
    fn()
    return median_ms(fn)


def fwd_once(p: Problem, cfg):
    plan = get_tile_plan(p.mask, cfg["BLOCK_M"], cfg["BLOCK_N"], DEV)
    return D.dense_fwd(p.q, p.k, p.v, plan, p.scale, cfg)


def time_ours_bwd(p: Problem, cfg, out, lse):
    kplan = get_tile_plan(p.mask, cfg["DKDV_BLOCK_M"], cfg["DKDV_BLOCK_N"], DEV)
    qplan = get_tile_plan(p.mask, cfg["DQ_BLOCK_M"], cfg["DQ_BLOCK_N"], DEV)
    fn = lambda: D.dense_bwd(p.dout, p.q, p.k, p.v, out, lse, kplan, qplan, p.scale, cfg)  # noqa: E731
    fn()
    return median_ms(fn, rep=250)


def time_cudnn(p: Problem, causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = p.q.transpose(1, 2).detach().requires_grad_()
    k = p.k.transpose(1, 2).detach().requires_grad_()
    v = p.v.transpose(1, 2).detach().requires_grad_()
    dout = p.dout.transpose(1, 2)
    note = "enable_gqa"
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        try:
            f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)  # noqa: E731
            out = f()
            inputs = (q, k, v)
        except RuntimeError:
            g = p.hq // p.hkv
            ke, ve = (t.detach().repeat_interleave(g, 1).requires_grad_() for t in (k, v))
            f = lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=causal)  # noqa: E731
            out = f()
            inputs = (q, ke, ve)
            note = "kv expanded to Hq heads"
        with torch.no_grad():
            t_f = median_ms(f)
        out = f()
        t_b = median_ms(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True))
    return t_f, t_b, note


def time_flex(p: Problem):
    from torch.nn.attention.flex_attention import flex_attention

    from longca_triton.adapters.flex import raise_recompile_limits
    from longca_triton.masks import flex_block_mask

    raise_recompile_limits()
    bm = flex_block_mask(p.mask, 128, device="cuda")
    q = p.q.transpose(1, 2).contiguous()
    k = p.k.transpose(1, 2).contiguous()
    v = p.v.transpose(1, 2).contiguous()
    dout = p.dout.transpose(1, 2).contiguous()
    flex_fwd = torch.compile(flex_attention, dynamic=False)
    flex_train = torch.compile(flex_attention, dynamic=False)
    with torch.no_grad():
        f = lambda: flex_fwd(q, k, v, block_mask=bm, enable_gqa=True)  # noqa: E731
        f()
        t_f = median_ms(f)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out = flex_train(qg, kg, vg, block_mask=bm, enable_gqa=True)
    t_b = median_ms(lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True))
    return t_f, t_b


FWD_VARIANTS = [
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
]
# whole-backward variants: the separate dQ kernel (7 matmuls per tile pair) against dQ fused into
# the dK/dV kernel through a TMA reduce-add into fp32 (5 matmuls)
_SEP_KV = dict(DKDV_BLOCK_M=32, DKDV_BLOCK_N=64, dkdv_num_warps=4, dkdv_num_stages=3)
_SEP_Q = dict(DQ_BLOCK_M=128, DQ_BLOCK_N=64, dq_num_warps=8, dq_num_stages=3)
BWD_VARIANTS = [
    dict(fused_dq=False, **_SEP_KV, **_SEP_Q),
    dict(fused_dq=True, DKDV_BLOCK_M=64, DKDV_BLOCK_N=64, dkdv_num_warps=8, dkdv_num_stages=2),
    dict(fused_dq=True, DKDV_BLOCK_M=64, DKDV_BLOCK_N=64, dkdv_num_warps=8, dkdv_num_stages=3),
    dict(fused_dq=True, DKDV_BLOCK_M=32, DKDV_BLOCK_N=128, dkdv_num_warps=8, dkdv_num_stages=2),
    dict(fused_dq=True, DKDV_BLOCK_M=64, DKDV_BLOCK_N=128, dkdv_num_warps=8, dkdv_num_stages=2),
    dict(fused_dq=True, DKDV_BLOCK_M=32, DKDV_BLOCK_N=64, dkdv_num_warps=4, dkdv_num_stages=3),
    dict(fused_dq=True, DKDV_BLOCK_M=16, DKDV_BLOCK_N=64, dkdv_num_warps=4, dkdv_num_stages=3),
]
CHECK_CONFIGS = {
    "default": {},
    "fused_dq": dict(fused_dq=True, DKDV_BLOCK_M=64, DKDV_BLOCK_N=64, dkdv_num_warps=8, dkdv_num_stages=2),
}

# per-mask exploration: configs picked for occupancy (sm_90, D=128, from the compiler's resource
# report): 64x64/4 warps/2 stages is the only forward shape that fits two CTAs on an SM (83 KB
# shared memory, 147 registers); dK/dV 32x64/4 warps fits two (83 KB, 247 registers); dQ 64x64/
# 4 warps/2 stages fits two (99 KB, 183 registers)
EXPLORE_FWD = [
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
    dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),
]
EXPLORE_BWD = [
    dict(_SEP_KV, **_SEP_Q),
    dict(_SEP_KV, DQ_BLOCK_M=64, DQ_BLOCK_N=64, dq_num_warps=4, dq_num_stages=2),
    dict(DKDV_BLOCK_M=16, DKDV_BLOCK_N=64, dkdv_num_warps=4, dkdv_num_stages=3,
         DQ_BLOCK_M=64, DQ_BLOCK_N=64, dq_num_warps=4, dq_num_stages=2),
    dict(DKDV_BLOCK_M=32, DKDV_BLOCK_N=64, dkdv_num_warps=4, dkdv_num_stages=2, **_SEP_Q),
]


def explore(out_dir: Path, S: int, base: dict, budget: float):
    """Every static mask x a few fwd and bwd configs: which launch shape wins where."""
    table = []
    for mname in STATIC_MASK_NAMES:
        if elapsed() > budget:
            emit(out_dir, dict(kind="explore", mask=mname, status="skipped: time"))
            continue
        try:
            p = Problem(bench_mask(mname, S))
        except Exception as e:  # noqa: BLE001
            emit(out_dir, dict(kind="explore", mask=mname, status=f"error: {e!r}"[:400]))
            continue
        fwd_t, bwd_t = [], []
        for var in EXPLORE_FWD:
            cfg = {**base, **var}
            fwd_t.append(time_variant(out_dir, "explore_fwd", lambda: time_ours_fwd(p, cfg), p.fwd_flops,
                                      mask=mname, S=S, variant=var))
        out, lse = fwd_once(p, base)
        for var in EXPLORE_BWD:
            cfg = {**base, **var, "fused_dq": False}
            bwd_t.append(time_variant(out_dir, "explore_bwd", lambda: time_ours_bwd(p, cfg, out, lse), p.bwd_flops,
                                      mask=mname, S=S, variant=var))
        table.append((mname, [p.fwd_flops / t * 1e-9 for t in fwd_t], [p.bwd_flops / t * 1e-9 for t in bwd_t]))
        del out, lse, p
        torch.cuda.empty_cache()
    lines = ["## explore: TFLOP/s per config (columns: EXPLORE_FWD / EXPLORE_BWD in dense_check.py)", "",
             "| mask | " + " | ".join(f"fwd{i}" for i in range(len(EXPLORE_FWD))) + " | "
             + " | ".join(f"bwd{i}" for i in range(len(EXPLORE_BWD))) + " |",
             "|---|" + "---|" * (len(EXPLORE_FWD) + len(EXPLORE_BWD))]
    for mname, f, b in table:
        lines.append(f"| {mname} | " + " | ".join(f"{x:.0f}" for x in f) + " | " + " | ".join(f"{x:.0f}" for x in b) + " |")
    lines += ["", "fwd configs: " + json.dumps(EXPLORE_FWD), "", "bwd configs: " + json.dumps(EXPLORE_BWD), ""]
    (out_dir / "dense_explore.md").write_text("\n".join(lines))
    print("\n".join(lines), flush=True)


ANCHOR_FLEX = {  # docs/anchors.md, same card, S=16K, GQA 64:8 (fwd, bwd TFLOP/s), for the ratio column
    "full": (496, 425), "causal": (430, 386), "full_document": (382, 340),
    "causal_document": (333, 274), "sliding_window_causal": (330, 286), "share_question": (354, 259),
    "causal_blockwise": (365, 328), "prefix_lm_causal": (435, 393), "prefix_lm_document": (321, 265),
    "global_sliding_window": (401, 322),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget", type=float, default=540.0, help="wall-clock seconds for all phases")
    ap.add_argument("--S", type=int, default=16384)
    ap.add_argument("--skip", default="", help="comma list of phases to skip: check,sweep,masks,flex")
    ap.add_argument("--flex-masks", default=",".join(STATIC_MASK_NAMES))
    ap.add_argument("--config", default="", help="JSON config overriding the sweep's choice")
    ap.add_argument("--explore", action="store_true", help="also time EXPLORE_FWD/BWD on every mask")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    env = env_info()
    emit(out_dir, dict(kind="env", **env))
    S = args.S

    # ---------------------------------------------------------------- phase 1: correctness
    if "check" not in skip:
        for cname, ccfg in CHECK_CONFIGS.items():
            for name in STATIC_MASK_NAMES:
                try:
                    check_case(out_dir, name, 4096, 16, 2, config=ccfg, config_name=cname)
                except Exception as e:  # noqa: BLE001
                    emit(out_dir, dict(kind="correctness", mask=name, S=4096, config=cname,
                                       status=f"error: {e!r}"[:500]))
            try:
                check_case(out_dir, "causal_document", S, 4, 1, config=ccfg, config_name=cname)
            except Exception as e:  # noqa: BLE001
                emit(out_dir, dict(kind="correctness", mask="causal_document", S=S, config=cname,
                                   status=f"error: {e!r}"[:500]))
        print(f"[{elapsed():.0f}s] correctness done", flush=True)

    base = D.resolve_config(128, torch.bfloat16)
    if args.config:
        base.update(json.loads(args.config))
    probs = {}

    # ---------------------------------------------------------------- phase 2: sweep
    if "sweep" not in skip:
        for mname in ("full", "causal"):
            probs[mname] = Problem(bench_mask(mname, S))

        def sweep(kind, variants, budget_frac, time_one, flops_of):
            """Total ms over the masks of each variant (inf where one failed), until the budget."""
            scores = {}
            for i, var in enumerate(variants):
                if elapsed() > args.budget * budget_frac:
                    break
                cfg = {**base, **var}
                tot = 0.0
                for mname, p in probs.items():
                    tot += time_variant(out_dir, kind, lambda: time_one(mname, p, cfg), flops_of(p),
                                        variant=var, mask=mname, S=S)
                scores[i] = tot
            if scores and min(scores.values()) < float("inf"):
                base.update(variants[min(scores, key=scores.get)])

        sweep("sweep_fwd", FWD_VARIANTS, 0.45, lambda m, p, cfg: time_ours_fwd(p, cfg), lambda p: p.fwd_flops)
        fo = {m: fwd_once(p, base) for m, p in probs.items()}
        sweep("sweep_bwd", BWD_VARIANTS, 0.6, lambda m, p, cfg: time_ours_bwd(p, cfg, *fo[m]), lambda p: p.bwd_flops)
        emit(out_dir, dict(kind="chosen_config", config=base, elapsed_s=elapsed()))
        print(f"[{elapsed():.0f}s] sweep done: {base}", flush=True)

    # ---------------------------------------------------------------- phase 3: all masks
    cudnn = {}
    if "masks" not in skip:
        for mname in ("full", "causal"):
            p = probs.get(mname) or Problem(bench_mask(mname, S))
            probs[mname] = p
            try:
                t_f, t_b, note = time_cudnn(p, causal=(mname == "causal"))
                cudnn[mname] = (t_f, t_b)
                emit(out_dir, dict(kind="bench", backend="sdpa-cudnn", mask=mname, S=S, Hq=p.hq, Hkv=p.hkv, D=p.d,
                                   fwd_ms=t_f, bwd_ms=t_b, fwd_tflops=p.fwd_flops / t_f * 1e-9,
                                   bwd_tflops=p.bwd_flops / t_b * 1e-9, note=note))
            except Exception as e:  # noqa: BLE001
                emit(out_dir, dict(kind="bench", backend="sdpa-cudnn", mask=mname, status=f"error: {e!r}"[:400]))
        for mname in STATIC_MASK_NAMES:
            if elapsed() > args.budget * 0.8:
                emit(out_dir, dict(kind="bench", backend="triton", mask=mname, status="skipped: time"))
                continue
            try:
                p = probs.get(mname) or Problem(bench_mask(mname, S))
                t_f = time_ours_fwd(p, base)
                out, lse = fwd_once(p, base)
                t_b = time_ours_bwd(p, base, out, lse)
                row = dict(kind="bench", backend="triton", mask=mname, S=S, Hq=p.hq, Hkv=p.hkv, D=p.d,
                           density=p.mask.density, fwd_ms=t_f, bwd_ms=t_b,
                           fwd_tflops=p.fwd_flops / t_f * 1e-9, bwd_tflops=p.bwd_flops / t_b * 1e-9)
                if mname in cudnn:
                    row["fwd_vs_cudnn"] = cudnn[mname][0] / t_f
                    row["bwd_vs_cudnn"] = cudnn[mname][1] / t_b
                if mname in ANCHOR_FLEX:
                    row["fwd_vs_anchor_flex"] = row["fwd_tflops"] / ANCHOR_FLEX[mname][0]
                    row["bwd_vs_anchor_flex"] = row["bwd_tflops"] / ANCHOR_FLEX[mname][1]
                if "doc_bounds" in p.mask.params:
                    row["num_docs"] = len(p.mask.params["doc_bounds"]) - 1
                emit(out_dir, row)
                del out, lse
            except Exception as e:  # noqa: BLE001
                emit(out_dir, dict(kind="bench", backend="triton", mask=mname, status=f"error: {e!r}"[:400]))
            p = None
            if DEV == "cuda":
                torch.cuda.empty_cache()
        print(f"[{elapsed():.0f}s] masks done", flush=True)

    write_summary(out_dir, env)  # early copy, in case the Flex compiles run past the limit
    if args.explore:
        explore(out_dir, S, base, args.budget)

    # ---------------------------------------------------------------- phase 3b: flex
    if "flex" not in skip:
        for mname in filter(None, args.flex_masks.split(",")):
            # a Flex mask costs about a minute of compilation (forward and backward)
            if elapsed() > args.budget - 75:
                emit(out_dir, dict(kind="bench", backend="flex", mask=mname, status="skipped: time"))
                continue
            try:
                p = Problem(bench_mask(mname, S))
                t_f, t_b = time_flex(p)
                emit(out_dir, dict(kind="bench", backend="flex", mask=mname, S=S, Hq=p.hq, Hkv=p.hkv, D=p.d,
                                   fwd_ms=t_f, bwd_ms=t_b, fwd_tflops=p.fwd_flops / t_f * 1e-9,
                                   bwd_tflops=p.bwd_flops / t_b * 1e-9))
            except Exception as e:  # noqa: BLE001
                emit(out_dir, dict(kind="bench", backend="flex", mask=mname, status=f"error: {e!r}"[:400]))
            p = None
            torch.cuda.empty_cache()

    flex = {r["mask"]: r for r in ROWS if r["kind"] == "bench" and r.get("backend") == "flex" and "fwd_ms" in r}
    for r in ROWS:
        if r["kind"] == "bench" and r.get("backend") == "triton" and r["mask"] in flex and "fwd_ms" in r:
            r["fwd_vs_flex"] = flex[r["mask"]]["fwd_ms"] / r["fwd_ms"]
            r["bwd_vs_flex"] = flex[r["mask"]]["bwd_ms"] / r["bwd_ms"]
            emit(out_dir, dict(kind="ratio_vs_flex", mask=r["mask"], fwd=r["fwd_vs_flex"], bwd=r["bwd_vs_flex"]))
    write_summary(out_dir, env)
    print(f"[{elapsed():.0f}s] done", flush=True)


def write_summary(out_dir: Path, env: dict):
    lines = [f"# dense_check: {env.get('gpu')} torch {env.get('torch')} triton {env.get('triton')} "
             f"cuDNN {env.get('cudnn')} driver {env.get('driver')}", ""]
    corr = [r for r in ROWS if r["kind"] == "correctness"]
    if corr:
        lines += ["## correctness (bf16, rel. Frobenius error vs fp32 naive; ratio = ours / PyTorch bf16 SDPA)", "",
                  "| config | mask | S | Hq:Hkv | out | dq | dk | dv | lse max abs | pass |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in corr:
            if "err_out" not in r:
                lines.append(f"| {r.get('config')} | {r['mask']} | {r.get('S')} | | {r.get('status')} | | | | | False |")
                continue
            cells = " | ".join(f"{r['err_' + k]:.2e} ({r['ratio_' + k]:.2f}x)" for k in ("out", "dq", "dk", "dv"))
            lines.append(f"| {r['config']} | {r['mask']} | {r['S']} | {r['Hq']}:{r['Hkv']} | {cells} | {r['lse_max_abs_err']:.1e} | {r['pass']} |")
        lines.append("")
    bench = [r for r in ROWS if r["kind"] == "bench"]
    if bench:
        lines += ["## speed (S=16K, B=1, Hq=64, Hkv=8, D=128, bf16; median, bench.timing)", "",
                  "| backend | mask | density | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd vs cuDNN | bwd vs cuDNN | fwd vs Flex | bwd vs Flex | fwd vs Flex(anchor) | bwd vs Flex(anchor) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in bench:
            if "fwd_ms" not in r:
                lines.append(f"| {r['backend']} | {r['mask']} | {r.get('status')} |||||||||||")
                continue

            def f(key, fmt="{:.2f}"):
                return fmt.format(r[key]) if key in r else ""

            lines.append(f"| {r['backend']} | {r['mask']} | {f('density', '{:.3f}')} | {f('fwd_ms', '{:.3f}')} | "
                         f"{f('fwd_tflops', '{:.0f}')} | {f('bwd_ms', '{:.3f}')} | {f('bwd_tflops', '{:.0f}')} | "
                         f"{f('fwd_vs_cudnn')} | {f('bwd_vs_cudnn')} | {f('fwd_vs_flex')} | {f('bwd_vs_flex')} | "
                         f"{f('fwd_vs_anchor_flex')} | {f('bwd_vs_anchor_flex')} |")
        lines.append("")
    chosen = [r for r in ROWS if r["kind"] == "chosen_config"]
    if chosen:
        lines += ["## chosen config", "", "```", json.dumps(chosen[-1]["config"]), "```", ""]
    (out_dir / "dense_check.md").write_text("\n".join(lines))
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()

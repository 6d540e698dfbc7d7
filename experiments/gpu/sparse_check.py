"""GPU check and benchmark of our block-sparse Triton kernels (longca_triton/kernels/block_sparse/op.py).

Run from the repository root on a CUDA machine (the package need not be installed):

    PYTHONUNBUFFERED=1 python experiments/gpu/sparse_check.py --out $OUT [--heads 64:8] [--budget 220]

Phases, each under a wall-clock budget (rows are appended to <out>/sparse_check.jsonl as they are
measured; <out>/sparse_check.md gets a summary):

1. correctness, bf16, S=8K (and a ragged S), D=128: out, lse, dq, dk, dv against a float32 naive
   reference on the dense mask, for uniform blocks 128 / 64, variable blocks (mean 256) and
   pattern layouts P = Hkv, Hq, 1; plus the table build time.
2. speed, S=64K, density 0.5, D=128, bf16: uniform block 128, 64 and variable mean 256, forward
   and backward TFLOP/s over the kept area (docs/masks.md §5), a few launch configs each (the best is
   reported); our kernel on a density-1 block-128 map and our dense kernel on the full mask as
   the dense baselines; compiled FlexAttention block-sparse as the peer.
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
import triton  # noqa: E402

from longca_triton.bench.timing import time_fn  # noqa: E402
from longca_triton.kernels.block_sparse import op as BS  # noqa: E402
from longca_triton.masks import BlockSparseMask, make_mask  # noqa: E402
from longca_triton.reference.naive import naive_attention  # noqa: E402

T0 = time.time()
ROWS: list = []
OUT_DIR = Path(".")
BUDGET = 220.0


def elapsed() -> float:
    return time.time() - T0


def env_info() -> dict:
    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, python=sys.version.split()[0])
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        info["driver"] = f"unknown ({e})"
    return info


def emit(row: dict):
    ROWS.append(row)
    with open(OUT_DIR / "sparse_check.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def rel(x, ref) -> float:
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def time_ms(fn, reps: int = 5) -> float:
    """Median ms (the harness's timer: CUDA events, L2 flushed): about one call of warm-up, ``reps`` timed calls."""
    return time_fn(fn, warmup_ms=0.0, rep=reps, min_rep=reps)["median_ms"]


def sparse_mask(kind: str, S: int, density: float, patterns: int, seed: int = 0) -> BlockSparseMask:
    if kind == "b128":
        return make_mask("block_sparse", S, block=128, density=density, patterns=patterns, seed=seed)
    if kind == "b64":
        return make_mask("block_sparse", S, block=64, density=density, patterns=patterns, seed=seed)
    if kind == "var256":
        return make_mask("varblock_sparse", S, block=256, min_block=128, density=density, patterns=patterns, seed=seed)
    raise ValueError(kind)


# ------------------------------------------------------------------------------------ phase 1
def check_case(kind, S, hq, hkv, P, density=0.5, d=128, seed=0, cfg=None):
    mask = sparse_mask(kind, S, density, P, seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, S, hq, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(1, S, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(1, S, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    out, lse = BS.block_sparse_attention(q, k, v, mask, return_lse=True, config=cfg)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ro, rl = naive_attention(qf, kf, vf, mask, return_lse=True)
    rq, rk, rv = torch.autograd.grad(ro, (qf, kf, vf), dout.float())
    finite = torch.isfinite(rl)
    row = dict(kind="check", mask=kind, S=S, Hq=hq, Hkv=hkv, P=P, density=density,
               out=rel(out, ro), lse_maxabs=(lse[finite] - rl[finite]).abs().max().item(),
               lse_inf_match=bool(torch.equal(torch.isinf(lse), torch.isinf(rl))),
               dq=rel(dq, rq), dk=rel(dk, rk), dv=rel(dv, rv),
               nan=bool(any(torch.isnan(t).any() for t in (out, dq, dk, dv))))
    row["ok"] = (not row["nan"] and row["lse_inf_match"] and max(row["out"], row["dq"], row["dk"], row["dv"]) < 2e-2
                 and row["lse_maxabs"] < 5e-2)
    tb = BS.table_build_time(mask, d, "cuda", cfg, repeats=3)
    row["table_build_ms"] = tb
    emit(row)
    del q, k, v, out, lse, dq, dk, dv, ro, rl, rq, rk, rv
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ phase 2
class Inputs:
    def __init__(self, S, hq, hkv, d=128, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.q = torch.randn(1, S, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        self.k = torch.randn(1, S, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        self.v = torch.randn(1, S, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        self.dout = torch.randn(1, S, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        self.S, self.hq, self.hkv, self.d = S, hq, hkv, d


def tflops(mask, hq, d, ms, mode):
    return mask.flops(hq, d, mode) / (ms * 1e-3) / 1e12


def ours_fwd(x: Inputs, mask, cfg):
    c = BS.resolve_config(mask, x.d, cfg)
    t = BS.tables_for(mask, c, "cuda")
    scale = 1.0 / math.sqrt(x.d)
    return lambda: BS.block_sparse_fwd(x.q, x.k, x.v, mask, t["fwd"], scale, c, t.get("fwd_tail"))


def ours_bwd(x: Inputs, mask, cfg, passes=("dkdv", "dq")):
    c = BS.resolve_config(mask, x.d, cfg)
    t = BS.tables_for(mask, c, "cuda")
    scale = 1.0 / math.sqrt(x.d)
    out, lse = BS.block_sparse_fwd(x.q, x.k, x.v, mask, t["fwd"], scale, c)
    return lambda: BS.block_sparse_bwd(x.dout, x.q, x.k, x.v, out, lse, mask, t, scale, c, passes=passes)


def bench_ours(x, mask, label, fwd_variants, bwd_variants):
    best = {}
    for mode, variants in (("fwd", fwd_variants), ("bwd", bwd_variants)):
        for name, cfg in variants:
            if elapsed() > BUDGET:
                emit(dict(kind="bench", backend="triton-sparse", mask=label, mode=mode, variant=name, status="skipped: time"))
                continue
            try:
                fn = ours_fwd(x, mask, cfg) if mode == "fwd" else ours_bwd(x, mask, cfg)
                ms = time_ms(fn)
                tf = tflops(mask, x.hq, x.d, ms, mode)
                emit(dict(kind="bench", backend="triton-sparse", mask=label, mode=mode, variant=name, cfg=cfg,
                          S=x.S, Hq=x.hq, Hkv=x.hkv, density=mask.density, ms=ms, tflops=tf, status="ok"))
                if tf > best.get(mode, (0, None))[0]:
                    best[mode] = (tf, name)
            except Exception as e:  # noqa: BLE001
                emit(dict(kind="bench", backend="triton-sparse", mask=label, mode=mode, variant=name,
                          status=f"error: {e!r}"[:400]))
    return best


def bench_flex(x: Inputs, mask, label, block_sizes=(128,)):
    from torch.nn.attention.flex_attention import flex_attention

    from longca_triton.adapters.flex import raise_recompile_limits
    from longca_triton.masks import flex_block_mask

    raise_recompile_limits()
    q, k, v, dout = (t.transpose(1, 2).contiguous() for t in (x.q, x.k, x.v, x.dout))
    best = {}
    for bs in block_sizes:
        if elapsed() > BUDGET:
            emit(dict(kind="bench", backend="flex", mask=label, block=bs, status="skipped: time"))
            continue
        try:
            bm = flex_block_mask(mask, bs, device="cuda", num_heads=x.hq)
            flex_fwd = torch.compile(flex_attention, dynamic=False)
            with torch.no_grad():
                f = lambda: flex_fwd(q, k, v, block_mask=bm, enable_gqa=True)  # noqa: E731
                ms = time_ms(f)
            tf = tflops(mask, x.hq, x.d, ms, "fwd")
            emit(dict(kind="bench", backend="flex", mask=label, mode="fwd", variant=f"block{bs}", S=x.S, Hq=x.hq,
                      Hkv=x.hkv, ms=ms, tflops=tf, status="ok"))
            best["fwd"] = max(best.get("fwd", (0, None)), (tf, f"block{bs}"))
            if elapsed() > BUDGET:
                continue
            flex_train = torch.compile(flex_attention, dynamic=False)
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            out = flex_train(qg, kg, vg, block_mask=bm, enable_gqa=True)
            ms = time_ms(lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True))
            tf = tflops(mask, x.hq, x.d, ms, "bwd")
            emit(dict(kind="bench", backend="flex", mask=label, mode="bwd", variant=f"block{bs}", S=x.S, Hq=x.hq,
                      Hkv=x.hkv, ms=ms, tflops=tf, status="ok"))
            best["bwd"] = max(best.get("bwd", (0, None)), (tf, f"block{bs}"))
            del out, qg, kg, vg
        except Exception as e:  # noqa: BLE001
            emit(dict(kind="bench", backend="flex", mask=label, block=bs, status=f"error: {e!r}"[:400]))
    return best


def bench_dense(x: Inputs, S):
    """Our dense kernel (longca_triton/kernels/dense/op.py, another engineer's) on the full mask, fwd and bwd."""
    try:
        from longca_triton.kernels.dense import op as D
    except Exception as e:  # noqa: BLE001
        emit(dict(kind="bench", backend="triton-dense", mask="full", status=f"error: {e!r}"[:300]))
        return {}
    mask = make_mask("full", S)
    q, k, v, dout = (t[:, :S] for t in (x.q, x.k, x.v, x.dout))
    best = {}
    try:
        cfg = D.resolve_config(x.d, q.dtype)
        fp, kp, qp = D.plans_for(mask, cfg, "cuda")
        scale = 1.0 / math.sqrt(x.d)
        ms = time_ms(lambda: D.dense_fwd(q, k, v, fp, scale, cfg))
        best["fwd"] = tflops(mask, x.hq, x.d, ms, "fwd")
        emit(dict(kind="bench", backend="triton-dense", mask="full", mode="fwd", S=S, Hq=x.hq, Hkv=x.hkv, ms=ms,
                  tflops=best["fwd"], status="ok"))
        out, lse = D.dense_fwd(q, k, v, fp, scale, cfg)
        ms = time_ms(lambda: D.dense_bwd(dout, q, k, v, out, lse, kp, qp, scale, cfg))
        best["bwd"] = tflops(mask, x.hq, x.d, ms, "bwd")
        emit(dict(kind="bench", backend="triton-dense", mask="full", mode="bwd", S=S, Hq=x.hq, Hkv=x.hkv, ms=ms,
                  tflops=best["bwd"], status="ok"))
    except Exception as e:  # noqa: BLE001
        emit(dict(kind="bench", backend="triton-dense", mask="full", status=f"error: {e!r}"[:400]))
    return best


# variants: (name, config overrides); the first of each list is the default
V128_FWD = [("default", None), ("stages3", dict(num_stages=3)), ("ws", dict(warp_specialize=True))]
V128_BWD = [("default", None), ("dkdv_w4", dict(dkdv_num_warps=4))]
V64_FWD = [("default", None), ("heads2", dict(HEADS=2, num_warps=8))]
V64_BWD = [("default", None), ("stages3", dict(dkdv_num_stages=3, dq_num_stages=3))]
VVAR_FWD = [("default", None), ("w8", dict(num_warps=8)), ("heads2", dict(HEADS=2, num_warps=8))]
VVAR_BWD = [("default", None), ("w8", dict(dkdv_num_warps=8, dq_num_warps=8)),
            ("heads2", dict(DQ_HEADS=2, DKDV_HEADS=2, dq_num_warps=8, dkdv_num_warps=8))]


def merge_best(a: dict, b: dict) -> dict:
    out = dict(a)
    for m, v in b.items():
        if m not in out or v[0] > out[m][0]:
            out[m] = v
    return out


def main():
    global OUT_DIR, BUDGET
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget", type=float, default=220.0, help="seconds; later phases are skipped past it")
    ap.add_argument("--heads", default="32:4", help="Hq:Hkv for the speed phase")
    ap.add_argument("--seqlen", type=int, default=65536)
    ap.add_argument("--variants", type=int, default=3, help="launch configs tried per case and mode")
    ap.add_argument("--skip", default="", help="comma list: check,dense,flex,full")
    args = ap.parse_args()
    OUT_DIR = Path(args.out)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    BUDGET = args.budget
    skip = set(filter(None, args.skip.split(",")))
    env = env_info()
    env["command"] = " ".join(["python"] + sys.argv)
    emit(dict(kind="env", **env))

    if "check" not in skip:
        for kind, S, hq, hkv, P in (("b128", 8192, 8, 2, 2), ("b64", 8192, 8, 2, 2), ("var256", 8192, 8, 2, 2),
                                    ("b64", 8000, 4, 4, 4), ("var256", 8000, 8, 2, 1), ("b128", 8000, 8, 2, 8)):
            try:
                check_case(kind, S, hq, hkv, P)
            except Exception as e:  # noqa: BLE001
                emit(dict(kind="check", mask=kind, S=S, Hq=hq, Hkv=hkv, P=P, ok=False, status=f"error: {e!r}"[:400]))

    hq, hkv = (int(x) for x in args.heads.split(":"))
    S = args.seqlen
    x = Inputs(S, hq, hkv)
    summary = {}
    cases = [("b128", V128_FWD, V128_BWD), ("b64", V64_FWD, V64_BWD), ("var256", VVAR_FWD, VVAR_BWD)]
    masks = {kind: sparse_mask(kind, S, 0.5, hkv) for kind, _, _ in cases}
    for kind, m in masks.items():
        emit(dict(kind="tables", mask=kind, S=S, P=hkv, blocks=int(m.block_map.shape[1]),
                  build_ms=BS.table_build_time(m, 128, "cuda", repeats=3)))
    # defaults first, then the peer, then the other launch configs while time lasts
    for kind, vf, vb in cases:
        summary[kind] = {"ours": bench_ours(x, masks[kind], kind, vf[:1], vb[:1])}
    if "flex" not in skip:
        for kind, _, _ in cases:
            summary[kind]["flex"] = bench_flex(x, masks[kind], kind)
    for kind, vf, vb in cases:
        more = bench_ours(x, masks[kind], kind, vf[1:args.variants], vb[1:args.variants])
        summary[kind]["ours"] = merge_best(summary[kind]["ours"], more)
    if "full" not in skip and elapsed() < BUDGET:
        m1 = sparse_mask("b128", S, 1.0, 1)
        summary["b128_density1"] = {"ours": bench_ours(x, m1, "b128_density1", V128_FWD[:1], V128_BWD[:1])}
    if "dense" not in skip and elapsed() < BUDGET:
        summary["dense_full"] = {"ours": bench_dense(x, min(S, 32768))}
    write_summary(env, summary, S, hq, hkv)


def write_summary(env, summary, S, hq, hkv):
    lines = ["# sparse_check", "", f"command: `{env['command']}`", "",
             f"device: {env['gpu']}, driver {env.get('driver')}, torch {env['torch']}, triton {env['triton']}, "
             f"CUDA {env['cuda']}, Python {env['python']}", "", "## correctness (bf16 vs fp32 naive reference)", "",
             "| mask | S | Hq:Hkv | P | out | lse max abs | dq | dk | dv | ok | table build ms (fwd/dq/dkdv) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in ROWS:
        if r.get("kind") == "check" and "out" in r:
            tb = r.get("table_build_ms", {})
            lines.append(f"| {r['mask']} | {r['S']} | {r['Hq']}:{r['Hkv']} | {r['P']} | {r['out']:.2e} | "
                         f"{r['lse_maxabs']:.2e} | {r['dq']:.2e} | {r['dk']:.2e} | {r['dv']:.2e} | {r['ok']} | "
                         f"{tb.get('fwd', 0):.2f} / {tb.get('dq', 0):.2f} / {tb.get('dkdv', 0):.2f} |")
        elif r.get("kind") == "check":
            lines.append(f"| {r['mask']} | {r['S']} | {r['Hq']}:{r['Hkv']} | {r['P']} | {r.get('status')} |")
    lines += ["", f"## speed (S={S}, B=1, Hq:Hkv={hq}:{hkv}, D=128, bf16, density 0.5, P=Hkv; TFLOP/s over the kept area)",
              "", "| case | ours fwd (config) | ours bwd (config) | flex fwd | flex bwd | fwd vs flex | bwd vs flex |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for kind, s in summary.items():
        o, f = s.get("ours", {}), s.get("flex", {})

        def val(d, m):
            v = d.get(m)
            return v[0] if isinstance(v, tuple) else v

        def cell(d, m):
            v = d.get(m)
            if v is None:
                return "-"
            return f"{v[0]:.0f} ({v[1]})" if isinstance(v, tuple) else f"{v:.0f}"

        ratio = lambda m: (f"{val(o, m) / val(f, m):.2f}" if val(o, m) and val(f, m) else "-")  # noqa: E731
        lines.append(f"| {kind} | {cell(o, 'fwd')} | {cell(o, 'bwd')} | {cell(f, 'fwd')} | {cell(f, 'bwd')} | "
                     f"{ratio('fwd')} | {ratio('bwd')} |")
    lines += ["", f"elapsed {elapsed():.0f} s"]
    (OUT_DIR / "sparse_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()

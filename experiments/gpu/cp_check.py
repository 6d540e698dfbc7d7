"""GPU check of the context-parallel layer, then the CP benchmark, in one command.

Run from the repository root on a machine with 2+ CUDA GPUs (the package need not be installed):

    PYTHONUNBUFFERED=1 python experiments/gpu/cp_check.py --out $OUT

1. correctness (torchrun over every visible GPU): bf16, 8K tokens per GPU, GQA 64:8, D=128, our
   Triton kernel (``--backend``), masks full, causal, causal_document, share_question,
   sliding_window_causal (w=1024) and a random RangeMask; every scheme x plan (usp / loongtrain on
   their default meshes). out, lse, dq, dk, dv of every rank are compared with (a) the single-GPU
   run of the same kernel on the whole sequence and (b) a float32 chunked reference ("truth");
   a case passes when its error against the truth is at most 2x the single-GPU kernel's own error
   (+1e-3) for every tensor. Rows: OUT/cp_check.jsonl, summary OUT/cp_check.md.
2. benchmark: ``longca-triton bench cp --config experiments/cp.toml --out OUT/cp`` (rows in
   OUT/cp/results.jsonl), within the time left of ``--max-minutes``; rerunning resumes.

yunchang (the peer row) is installed from .whl/cp (``shared/scripts/vendor-wheels.sh cp``) into a
temporary folder when it is there and not importable.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "results/cp-check"))
    p.add_argument("--nproc", type=int, default=None, help="GPUs to use (default: all visible)")
    p.add_argument("--backend", default="triton")
    p.add_argument("--tokens-per-gpu", type=int, default=8192)
    p.add_argument("--heads", default="64:8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--config", default=str(REPO / "experiments" / "cp.toml"), help="bench config")
    p.add_argument("--max-minutes", type=float, default=8.5, help="wall-clock budget of both phases")
    p.add_argument("--schemes", default=None, help="comma-separated schemes for both phases (default: all)")
    p.add_argument("--bench-masks", default=None, help="comma-separated masks for the bench (default: the config's)")
    p.add_argument("--bench-modes", default=None, help="comma-separated modes for the bench (default: the config's)")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)  # gloo + reference kernel: a dry run of the code paths
    return p.parse_args(argv)


# ------------------------------------------------------------------------------ phase 1 (per rank)
def check_worker(a) -> int:
    from datetime import timedelta

    import numpy as np
    import torch
    import torch.distributed as dist

    from longca_triton import cp
    from longca_triton.cp.check import Case, _rel_err, make_problem, run_case
    from longca_triton.masks import RangeMask, make_mask
    from longca_triton.reference import chunked_attention

    local = int(os.environ["LOCAL_RANK"])
    if a.cpu:
        dist.init_process_group("gloo", timeout=timedelta(seconds=600))
        dev, dtype, tdtype = torch.device("cpu"), torch.float32, torch.float64
    else:
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timedelta(seconds=600))
        dev, dtype, tdtype = torch.device("cuda", local), torch.bfloat16, torch.float32
    rank, N = dist.get_rank(), dist.get_world_size()
    hq, _, hkv = a.heads.partition(":")
    heads = (int(hq), int(hkv or hq))
    S = a.tokens_per_gpu * N
    rng = np.random.default_rng(5)
    rand_slices = []
    for _ in range(12):
        qs = int(rng.integers(0, S - 1)); qe = int(rng.integers(qs + 1, min(S, qs + S // 3) + 1))
        ks = int(rng.integers(0, S - 1)); ke = int(rng.integers(ks + 1, min(S, ks + S // 3) + 1))
        rand_slices.append((qs, qe, ks, ke, int(rng.integers(0, 4))))
    masks = {
        "full": make_mask("full", S), "causal": make_mask("causal", S),
        "causal_document": make_mask("causal_document", S, seed=1),
        "share_question": make_mask("share_question", S, seed=2),
        "sliding_window_causal": make_mask("sliding_window_causal", S, window=1024),
        "random": RangeMask(S, S, rand_slices, name="random"),
    }
    out_path = Path(a.out) / "cp_check.jsonl"
    rows = []
    deadline = float(os.environ.get("CP_CHECK_DEADLINE", "inf"))
    for mname, mask in masks.items():
        if time.time() > deadline:
            break
        prob = make_problem(mask, 1, heads, a.head_dim, dtype, dev, seed=3, reference="kernel", backend=a.backend)
        # float32 truth (chunked reference under autograd)
        q, k, v = (t.to(tdtype).requires_grad_(True) for t in (prob.q, prob.k, prob.v))
        o, l = chunked_attention(q, k, v, mask, None, True, chunk=1024)
        fin = torch.isfinite(l)
        loss = (o * prob.gout.to(tdtype)).sum() + (torch.where(fin, l, torch.zeros_like(l)) * prob.glse.to(tdtype)).sum()
        loss.backward()
        truth = dict(out=o.detach(), lse=l.detach(), dq=q.grad, dk=k.grad, dv=v.grad)
        del q, k, v, o, l, loss
        single_err = {n: _rel_err(prob.ref[n][fin], truth[n][fin]) if n == "lse" else _rel_err(prob.ref[n], truth[n])
                      for n in truth}
        for scheme in (a.schemes.split(",") if a.schemes else cp.SCHEMES):
            for kind in cp.PLAN_KINDS:
                plan = cp.make_plan(mask, N, kind)
                res = run_case(Case(scheme, plan, a.backend, label=f"{mname}/{scheme}/{kind}"), prob, tol=3e-2, keep=True)
                got, valid = res.pop("_got"), res.pop("_valid")
                vs_truth = {}
                for n in ("out", "lse", "dq", "dk", "dv"):
                    ref = cp.dispatch(truth[n], plan, rank, dim=2 if n == "lse" else 1)
                    g = got[n]
                    if n == "lse":
                        r_, g_ = ref[:, :, valid], g[:, :, valid]
                        f = torch.isfinite(r_)
                        vs_truth[n] = _rel_err(g_[f], r_[f])
                    else:
                        vs_truth[n] = _rel_err(g[:, valid], ref[:, valid])
                # every rank's worst error
                t = torch.tensor([vs_truth[n] for n in vs_truth] + [res[f"err_{n}"] for n in vs_truth], device=dev, dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                names = list(vs_truth)
                row = {"mask": mask.name if mname == "random" else mname, "scheme": scheme, "plan": kind, "world_size": N,
                       "seqlen": S, "heads": a.heads, "head_dim": a.head_dim, "dtype": str(dtype).replace("torch.", ""),
                       "backend": a.backend,
                       "err_vs_truth": {n: t[i].item() for i, n in enumerate(names)},
                       "err_vs_single_gpu": {n: t[len(names) + i].item() for i, n in enumerate(names)},
                       "single_gpu_err_vs_truth": single_err, "seconds": res["seconds"],
                       "imbalance": plan.imbalance}
                row["ok"] = all(row["err_vs_truth"][n] <= 2 * single_err[n] + 1e-3 for n in names)
                rows.append(row)
                if rank == 0:
                    with open(out_path, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    worst = max(row["err_vs_truth"].values())
                    print(f"{'ok  ' if row['ok'] else 'FAIL'} {mname:22s} {scheme:14s} {kind:10s} worst err vs fp32 {worst:.2e} "
                          f"(single GPU {max(single_err.values()):.2e})", flush=True)
                del got
        del prob, truth
        torch.cuda.empty_cache()
    if rank == 0:
        _summary(rows, Path(a.out) / "cp_check.md", N, S)
    dist.barrier(device_ids=None if a.cpu else [local])
    dist.destroy_process_group()
    return 0 if all(r["ok"] for r in rows) else 3


def _summary(rows, path: Path, N, S):
    lines = [f"# CP correctness on {N} GPUs, S = {S} (bf16, vs float32 truth)", "",
             "| mask | scheme | plan | worst err vs truth | single GPU err | worst err vs single GPU | ok |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['mask']} | {r['scheme']} | {r['plan']} | {max(r['err_vs_truth'].values()):.2e} | "
                     f"{max(r['single_gpu_err_vs_truth'].values()):.2e} | {max(r['err_vs_single_gpu'].values()):.2e} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    n_ok = sum(r["ok"] for r in rows)
    lines += ["", f"{n_ok} of {len(rows)} cases pass (error vs float32 truth <= 2 x single-GPU error + 1e-3, every tensor)."]
    path.write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------ driver
def _yunchang_path(out: Path) -> str | None:
    try:
        import yunchang  # noqa: F401

        return None
    except ImportError:
        pass
    wheels = glob.glob(str(REPO / ".whl" / "cp" / "*" / "*.whl")) + glob.glob(str(REPO / ".whl" / "cp" / "*.whl"))
    if not wheels:
        print("yunchang: not installed and no wheel under .whl/cp (the peer rows will say so)")
        return None
    # why: outside OUT, so the installed package never crowds the results out of what comes back
    site = Path(tempfile.gettempdir()) / "longca_yunchang_site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site)] + wheels, capture_output=True, text=True)
    if r.returncode:
        print("yunchang install failed:", r.stderr[-500:])
        return None
    return str(site)


def main() -> int:
    a = _args()
    if a.phase == "check":
        return check_worker(a)
    import torch

    t0 = time.time()
    deadline = t0 + a.max_minutes * 60
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    n = a.nproc or torch.cuda.device_count()
    if n < 2 and not a.cpu:
        print(f"cp_check needs at least 2 CUDA GPUs, found {torch.cuda.device_count()}")
        return 2
    env = dict(os.environ)
    extra = [str(REPO)]
    yc = _yunchang_path(out)
    if yc:
        extra.append(yc)
    env["PYTHONPATH"] = os.pathsep.join(extra + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONUNBUFFERED", "1")
    rc = 0
    if not a.no_check:
        # the check gets at most 45% of the budget; the bench the rest
        env["CP_CHECK_DEADLINE"] = str(t0 + 0.45 * (deadline - t0))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", __file__,
               "--phase", "check", "--out", str(out), "--backend", a.backend, "--tokens-per-gpu", str(a.tokens_per_gpu),
               "--heads", a.heads, "--head-dim", str(a.head_dim)] + (["--cpu"] if a.cpu else []) + \
              (["--schemes", a.schemes] if a.schemes else [])
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, env=env).returncode
        print(f"[cp_check] correctness phase rc={rc} after {time.time() - t0:.0f} s; see {out / 'cp_check.md'}", flush=True)
    if not a.no_bench:
        left = (deadline - time.time()) / 60
        grid = ["--preset", "smoke"] if a.cpu else ["--config", a.config, "--backend", a.backend]
        cmd = [sys.executable, "-m", "longca_triton.cp.cli", *grid, "--out", str(out / "cp"),
               "--max-minutes", f"{max(left - 0.5, 0.5):.2f}", "--world", str(n)] + \
              (["--schemes", a.schemes] if a.schemes else []) + (["--masks", a.bench_masks] if a.bench_masks else []) + \
              (["--modes", a.bench_modes] if a.bench_modes else [])
        print("+", " ".join(cmd), flush=True)
        rb = subprocess.run(cmd, env=env).returncode
        print(f"[cp_check] bench rc={rb} after {time.time() - t0:.0f} s; rows in {out / 'cp' / 'results.jsonl'}", flush=True)
        rc = rc or rb
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""GPU check of issue 17: every head dim people train with (64, 96, 128, 192/128, 256), ours next to
the vendors, with the issue's targets computed from the measured rows.

Run from the repository root on a CUDA machine (the package need not be installed):

    PYTHONUNBUFFERED=1 python experiments/gpu/headdim_check.py --out $OUT [--max-minutes 9]

Everything goes through the benchmark harness (``longca_triton.bench.runner``): inputs drawn once
per problem, each backend checked in bf16 against a float32 reference on the real problem (the last
KV-head group at the full S; out, lse, dq, dk, dv; ``bench.check``) before ``bench.timing.time_fn``
times it, one JSONL row per point. Rows are appended as they finish, so a run cut by the time limit
resumes where it stopped: rerun with the same ``--out``.

Phases (files in ``--out``):

1. ``kernels.jsonl``: our other kernels at every head dim, S = 16K, bf16, fwd and bwd, checked and
   briefly timed: ``triton-flashmask`` on causal_document, ``triton-sparse`` (block 128, density
   0.5) and ``triton-varblock`` (mean block 256).
2. ``results.jsonl``, ``report.md``: the grid of ``experiments/headdim.toml`` (full, causal,
   causal_document x head dims x ours, sdpa-cudnn, sdpa-flash, flex, fa3, fa4 x fwd, bwd).
3. ``headdim_check.md``: per mask and head dim, ours / sdpa-cudnn forward (target >= 0.8 where
   cuDNN runs the dim) and backward beside it, the best FlashAttention and Flex, and ours at D = 96
   per counted FLOP against ours at D = 128 (target >= 0.85). FLOPs: MASKS.md §5 with
   ``2 (D_qk + D_v)`` per allowed pair, never the padded tile.

``--configs`` (instead of the phases above): the default launch config of ``triton`` against the
candidates of ``kernels.dense.HEADDIM_CANDIDATES`` (``"old"``: the default before the sm_90a AOT sweep,
``experiments/results/cpu-aot/headdim_configs.md``) per head dim (``--dims``, default 256, 192/128, 64)
at S = 16K, GQA 64:8, bf16, full and causal, fwd (candidates that change forward keys) and bwd
(those that change backward keys), next to ``sdpa-cudnn``; every point checked against float32
first. The kernels are compiled up front in parallel (``--jobs``) into Triton's cache, so the
timed loop does not wait on the compiler. Files: ``configs.jsonl`` (resumable), ``configs.md``.

    PYTHONUNBUFFERED=1 python experiments/gpu/headdim_check.py --configs --out $OUT --max-minutes 8.5

``--smoke``: the same phases (or ``--configs``) at toy sizes on the CPU (``TRITON_INTERPRET=1``,
float32), to check the script itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # a plain checkout runs without installing

from longca_triton.bench.config import Experiment, load_experiment  # noqa: E402
from longca_triton.bench.params import format_head_dim, parse_head_dim, row_head_dim  # noqa: E402
from longca_triton.bench.report import latest_rows, markdown_report, markdown_table  # noqa: E402
from longca_triton.bench.runner import run_experiment  # noqa: E402
from longca_triton.bench.store import ResultStore, status_kind  # noqa: E402
from longca_triton.kernels.core.runtime import block_head_dim  # noqa: E402

OURS = "triton"
BASE = "sdpa-cudnn"
FLASH = ("sdpa-flash", "fa3", "fa4")
FWD_TARGET, D96_TARGET = 0.8, 0.85


def smoke_overrides() -> dict:
    """Toy sizes for the CPU interpreter: what the script does, not performance."""
    return {"seqlens": [128], "heads": ["4:2"], "head_dims": ["32", "48", "24/16"], "dtypes": ["float32"],
            "backends": ["triton", "sdpa-math", "flex"], "warmup_ms": 0.0, "rep": 1, "max_ms": 20.0}


def kernels_experiment(dims: list, smoke: bool) -> Experiment:
    """Phase 1: our FlashMask port and block-sparse kernels at every head dim (checked, briefly timed)."""
    exp = Experiment(name="headdim_kernels", kind="dense", masks=["causal_document"], seqlens=["16K"], heads=["64:8"],
                     head_dims=dims, dtypes=["bfloat16"], modes=["fwd", "bwd"], backends=["triton-flashmask"],
                     warmup_ms=5.0, rep=5, max_ms=100.0, check=True)
    return exp.with_overrides(**{**smoke_overrides(), "backends": ["triton-flashmask"]}) if smoke else exp


def sparse_experiment(kind: str, dims: list, smoke: bool) -> Experiment:
    mask, backend = ("block_sparse", "triton-sparse") if kind == "sparse" else ("varblock_sparse", "triton-varblock")
    params = {"block": 128, "density": 0.5} if kind == "sparse" else {"block": 256, "min_block": 128, "density": 0.5}
    if smoke:
        params = {"block": 32, "density": 0.5} if kind == "sparse" else {"block": 48, "min_block": 24, "density": 0.5}
    exp = Experiment(name=f"headdim_{kind}", kind=kind, masks=[mask], seqlens=["16K"], heads=["64:8"], head_dims=dims,
                     dtypes=["bfloat16"], modes=["fwd", "bwd"], backends=[backend], mask_params={mask: params},
                     warmup_ms=5.0, rep=5, max_ms=100.0, check=True)
    return exp.with_overrides(**{**smoke_overrides(), "backends": [backend]}) if smoke else exp


def run(exp: Experiment, store: ResultStore, device: str, deadline: float) -> bool:
    """Run (or resume) ``exp`` until ``deadline``; True when every point is done."""
    left = (deadline - time.time()) / 60
    if left <= 0.05:
        return False
    exp.validate()
    print(f"[headdim] {exp.name}: {exp.grid_summary()}, {left:.1f} min left", flush=True)
    res = run_experiment(exp, store, device=device, max_minutes=left,
                         on_row=lambda r: print(f"  {r['backend']} {r.get('mask_label', r['mask'])} "
                                                f"D={row_head_dim(r)} {r['mode']}: {r['status'][:90]} "
                                                f"{r.get('tflops') or 0:.1f} TFLOP/s", flush=True))
    return not (res.budget_hit or res.interrupted or res.aborted) and res.remaining == 0


# ------------------------------------------------------------------------------------ targets
def _tflops(rows: dict, backend, mask, dim, mode):
    r = rows.get((backend, mask, dim, mode))
    return r.get("tflops") if r is not None and status_kind(r) == "ok" else None


def _cell(rows: dict, backend, mask, dim, mode) -> str:
    r = rows.get((backend, mask, dim, mode))
    if r is None:
        return ""
    if status_kind(r) != "ok":
        return status_kind(r)
    return f"{r['tflops']:.0f}"


def _ratio(a, b, target=None) -> str:
    if a is None or not b:
        return ""
    x = a / b
    return f"{x:.2f}" + ("" if target is None else (" ✓" if x >= target else " ✗"))


def targets(rows: list[dict], dims: list) -> str:
    """The issue's targets from the measured rows, as markdown."""
    rows = [r for r in latest_rows(rows) if r.get("seqlen")]
    by = {(r["backend"], r.get("mask_label", r["mask"]), row_head_dim(r), r["mode"]): r for r in rows}
    masks = list(dict.fromkeys(r.get("mask_label", r["mask"]) for r in rows))
    labels = [format_head_dim(*parse_head_dim(d)) for d in dims]
    legend = (f"`ours/cuDNN` is our forward TFLOP/s over `{BASE}`'s (target >= {FWD_TARGET} where cuDNN runs the "
              f"dim), backward beside it; `D=96 / D=128` is ours at 96 over ours at 128, per counted FLOP "
              f"(target >= {D96_TARGET}). `tile` is the padded head-dim tile our kernels compute on "
              "(`BLOCK_DQK/BLOCK_DV`): work above the true dim is done but not credited.")
    out = ["## Targets (issue 17)", "", legend, ""]
    header = ["mask", "D", "tile", "ours fwd", "cuDNN fwd", "ours/cuDNN fwd", "ours bwd", "cuDNN bwd", "ours/cuDNN bwd",
              "best FA fwd", "flex fwd"]
    table = []
    for m in masks:
        for d in labels:
            dqk, dv = parse_head_dim(d)
            of, cf = _tflops(by, OURS, m, d, "fwd"), _tflops(by, BASE, m, d, "fwd")
            ob, cb = _tflops(by, OURS, m, d, "bwd"), _tflops(by, BASE, m, d, "bwd")
            fa = [(b, _tflops(by, b, m, d, "fwd")) for b in FLASH]
            fa = [(b, t) for b, t in fa if t]
            best_fa = max(fa, key=lambda x: x[1]) if fa else None
            table.append([m, d, format_head_dim(block_head_dim(dqk), block_head_dim(dv)), _cell(by, OURS, m, d, "fwd"),
                          _cell(by, BASE, m, d, "fwd"), _ratio(of, cf, FWD_TARGET), _cell(by, OURS, m, d, "bwd"),
                          _cell(by, BASE, m, d, "bwd"), _ratio(ob, cb),
                          f"{best_fa[1]:.0f} ({best_fa[0]})" if best_fa else "", _cell(by, "flex", m, d, "fwd")])
    out += [markdown_table(header, table), ""]
    per_flop = []
    for m in masks:
        for mode in ("fwd", "bwd"):
            a, b = _tflops(by, OURS, m, "96", mode), _tflops(by, OURS, m, "128", mode)
            per_flop.append([m, mode, f"{a:.0f}" if a else "", f"{b:.0f}" if b else "",
                             _ratio(a, b, D96_TARGET if mode == "fwd" else None)])
    out += [markdown_table(["mask", "mode", "ours D=96", "ours D=128", "D=96 / D=128"], per_flop), ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------------ --configs
FWD_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "warp_specialize")
CONFIG_DIMS = ("256", "192/128", "64")


def _cfg_label(cfg: dict, mode: str) -> str:
    if mode == "fwd":
        return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"
    return (f"dkdv {cfg['DKDV_BLOCK_M']}x{cfg['DKDV_BLOCK_N']} w{cfg['dkdv_num_warps']} s{cfg['dkdv_num_stages']}, "
            f"dq {cfg['DQ_BLOCK_M']}x{cfg['DQ_BLOCK_N']} w{cfg['dq_num_warps']} s{cfg['dq_num_stages']}")


def config_entries(d_qk: int, d_v: int, mode: str) -> list[tuple[str, dict]]:
    """``[(name, full config)]`` timed in ``mode``: the default, then each candidate that changes a
    key of that mode (forward keys for fwd, any other key for bwd)."""
    from longca_triton.kernels.dense.op import headdim_candidates

    cands = headdim_candidates(d_qk, d_v)
    base = cands.pop("default")
    keys = [k for k in base if (k in FWD_KEYS) == (mode == "fwd")]
    return [("default", base)] + [(n, c) for n, c in cands.items() if any(c[k] != base[k] for k in keys)]


def precompile(dims: list, jobs: int) -> None:
    """Compile every kernel ``--configs`` launches into Triton's cache, ``jobs`` at a time (the
    launches recorded on CPU tensors, ``kernels.aot``); a failure is only printed (the timed run
    then compiles, or reports, it)."""
    from concurrent.futures import ProcessPoolExecutor

    todo = []
    for label in dims:
        d_qk, d_v = parse_head_dim(label)
        for mode in ("fwd", "bwd"):
            for name, cfg in config_entries(d_qk, d_v, mode):
                for mask in ("full", "causal"):
                    for kernel in (("fwd",) if mode == "fwd" else ("dkdv", "dq")):
                        todo.append((format_head_dim(d_qk, d_v), mask, kernel, cfg))
    t0 = time.time()
    with ProcessPoolExecutor(max(1, jobs)) as ex:
        bad = [r for r in ex.map(_compile_job, todo) if r]
    print(f"[headdim] precompiled {len(todo)} kernels in {time.time() - t0:.0f} s on {jobs} processes"
          + (f"; failed: {bad}" if bad else ""), flush=True)


def _compile_job(job) -> str:
    sys.path.insert(0, str(REPO / "experiments"))
    try:
        import triton
        from cpu_aot_headdim import record
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from longca_triton.kernels.core.aot import specialize

        label, mask, kernel, cfg = job
        launch = record(label, mask, kernel, cfg)
        sig, consts, attrs = specialize(launch)
        triton.compile(ASTSource(launch.kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
        return ""
    except Exception as e:  # noqa: BLE001 - the timed run reports it properly
        return f"{job[:3]}: {type(e).__name__}: {str(e)[:120]}"


def run_configs(out: Path, dims: list, smoke: bool, deadline: float, jobs: int) -> bool:
    """``--configs``: rows into ``configs.jsonl``, the table into ``configs.md``; True when complete."""
    import json

    import torch

    from longca_triton.adapters import Problem, get_backend
    from longca_triton.bench.runner import _Group, _run_point
    from longca_triton.masks import make_mask

    device = "cpu" if smoke else "cuda"
    S, (hq, hkv), dtype = (128, (4, 2), torch.float32) if smoke else (16384, (64, 8), torch.bfloat16)
    base_backend = "sdpa-math" if smoke else BASE
    exp = Experiment(name="headdim_configs", warmup_ms=0.0 if smoke else 10.0, rep=1 if smoke else 10,
                     max_ms=20.0 if smoke else 150.0, check=True, seed=0)
    path = out / "configs.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    done = {(r["name"], r["mask"], r["dims"], r["mode"]) for r in rows}
    if not smoke and jobs > 0:
        precompile(dims, jobs)
    complete = True
    for label in dims:
        d_qk, d_v = parse_head_dim(label)
        label = format_head_dim(d_qk, d_v)
        for mname in ("full", "causal"):
            mask = make_mask(mname, S)
            key = (mname, S, hq, hkv, label, "bfloat16" if not smoke else "float32")
            grp = None
            for mode in ("fwd", "bwd"):
                entries = [(base_backend, None)] + config_entries(d_qk, d_v, mode)
                for name, cfg in entries:
                    if (name, mname, label, mode) in done:
                        continue
                    if time.time() > deadline:
                        complete = False
                        break
                    if grp is None:
                        grp = _Group(mask, exp, key, device, need_grads=True)
                    backend = get_backend(base_backend if cfg is None else OURS)
                    problem = Problem(mask=mask, batch=1, heads_q=hq, heads_kv=hkv, head_dim=d_qk,
                                      head_dim_v=None if d_v == d_qk else d_v, dtype=dtype, mode=mode,
                                      device=device, extra={} if cfg is None else {"config": cfg})
                    base = dict(name=name, backend=backend.name, config=cfg, mask=mname, dims=label, mode=mode,
                                seqlen=S, heads_q=hq, heads_kv=hkv, flops=problem.flops(), status=None,
                                time_ms=None, tflops=None)
                    row = _run_point(backend, problem, grp, exp, base)
                    row["gpu"] = torch.cuda.get_device_name() if device == "cuda" else "cpu-interpreter"
                    with path.open("a") as f:
                        f.write(json.dumps(row, default=str) + "\n")
                    rows.append(row)
                    print(f"  D={label} {mname} {mode} {name}: {row['status'][:90]} "
                          f"{row.get('tflops') or 0:.1f} TFLOP/s", flush=True)
            del grp
    (out / "configs.md").write_text(configs_table(rows, dims, smoke, complete))
    return complete


def configs_table(rows: list[dict], dims: list, smoke: bool = False, complete: bool = True) -> str:
    """``configs.md``: per head dim, mask and mode, each config's TFLOP/s, over the default's and
    over sdpa-cudnn's (the issue's forward target is >= 0.8)."""
    latest = {(r["name"], r["mask"], r["dims"], r["mode"]): r for r in rows}
    out = ["# Head dims (issue 17): launch configs of `triton` against its defaults", "",
           ("CPU interpreter smoke run: not performance. " if smoke else "")
           + f"S = {rows[0]['seqlen'] if rows else '?'}, GQA {rows[0]['heads_q'] if rows else '?'}:"
           f"{rows[0]['heads_kv'] if rows else '?'}; each point checked against float32 before it is timed; "
           f"{'complete' if complete else 'INCOMPLETE: rerun with the same --out to resume'}. "
           "Candidates: `kernels.dense.HEADDIM_CANDIDATES`; `old` is the default before the sm_90a AOT sweep.", ""]
    vendor_name = next((r["name"] for r in rows if r["config"] is None), BASE)
    header = ["mask", "mode", "config", "tiles", "TFLOP/s", "/ default", f"/ {vendor_name}", "check"]
    for label in dims:
        label = format_head_dim(*parse_head_dim(label))
        table = []
        for mname in ("full", "causal"):
            for mode in ("fwd", "bwd"):
                here = [r for (n, m, d, md), r in latest.items() if m == mname and d == label and md == mode]
                ref = next((r for r in here if r["name"] == "default"), None)
                vendor = next((r for r in here if r["config"] is None), None)
                ok = [r for r in here if r["config"] is not None and status_kind(r) == "ok"]
                best = max(ok, key=lambda r: r["tflops"])["name"] if ok else None
                for r in sorted(here, key=lambda r: (r["config"] is not None, r["name"] != "default", r["name"])):
                    tf = r.get("tflops") if status_kind(r) == "ok" else None
                    name = r["name"] + (" **best**" if r["name"] == best and len(ok) > 1 else "")
                    table.append([mname, mode, name, _cfg_label(r["config"], mode) if r["config"] else "",
                                  f"{tf:.0f}" if tf else status_kind(r),
                                  _ratio(tf, ref and ref.get("tflops")) if r["config"] else "",
                                  _ratio(tf, vendor and vendor.get("tflops"), FWD_TARGET if mode == "fwd" else None),
                                  "ok" if (r.get("check") or {}).get("ok") else (r.get("status") or "")[:60]])
        out += [f"## D = {label}", "", markdown_table(header, table), ""]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="results folder (rerun with the same one to resume)")
    ap.add_argument("--config", default=str(REPO / "experiments" / "headdim.toml"))
    ap.add_argument("--max-minutes", type=float, default=9.0, help="wall clock for this call (then rerun to resume)")
    ap.add_argument("--skip-kernels", action="store_true", help="skip phase 1 (FlashMask port, block-sparse)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (TRITON_INTERPRET=1), float32")
    ap.add_argument("--configs", action="store_true",
                    help="time the default launch config against kernels.dense.HEADDIM_CANDIDATES (and sdpa-cudnn)")
    ap.add_argument("--dims", default=None,
                    help=f"--configs: head dims, in the order they run (default {','.join(CONFIG_DIMS)})")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                    help="--configs: processes compiling the kernels up front (0: none)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + 60 * args.max_minutes
    if args.configs:
        dims = args.dims.split(",") if args.dims else (["32", "136/24"] if args.smoke else list(CONFIG_DIMS))
        done = run_configs(out, dims, args.smoke, deadline, args.jobs)
        print(f"[headdim] wrote {out / 'configs.md'}; {'complete' if done else 'incomplete: rerun to resume'}",
              flush=True)
        return 0 if done else 3
    device = "cpu" if args.smoke else "cuda"
    grid = load_experiment(args.config)
    if args.smoke:
        grid = grid.with_overrides(**smoke_overrides())
    dims = grid.validate().head_dims

    done = True
    if not args.skip_kernels:
        kstore = ResultStore(out / "kernels.jsonl")
        for exp in (kernels_experiment(dims, args.smoke), sparse_experiment("sparse", dims, args.smoke),
                    sparse_experiment("varblock", dims, args.smoke)):
            done &= run(exp, kstore, device, deadline)
    store = ResultStore(out / "results.jsonl")
    done &= run(grid, store, device, deadline)

    rows = store.rows()
    (out / "report.md").write_text(markdown_report(rows, title="Head dims (issue 17): the grid", source="results.jsonl"))
    parts = ["# Head dims (issue 17)", "",
             f"Grid: `{Path(args.config).name}`" + (" with `--smoke` overrides (CPU interpreter: not performance)"
                                                      if args.smoke else "") + f"; {'complete' if done else 'INCOMPLETE: rerun to resume'}.",
             "", targets(rows, dims)]
    if not args.skip_kernels:
        krep = markdown_report(ResultStore(out / "kernels.jsonl").rows(), title="kernels")
        first_slice = krep.find("\n## ", krep.find("## Environment") + 1)  # the tables after the environment
        parts += ["## Our other kernels (checked against float32, then timed briefly)", "", krep[first_slice + 1:]]
    (out / "headdim_check.md").write_text("\n".join(parts))
    bad = [r for r in rows if status_kind(r) == "error"]
    print(f"[headdim] wrote {out / 'headdim_check.md'}; {len(rows)} rows, {len(bad)} errors; "
          f"{'complete' if done else 'incomplete: rerun with the same --out to resume'}", flush=True)
    return 0 if done else 3


if __name__ == "__main__":
    sys.exit(main())

"""Issue 17 on a CPU: what the dense ``triton`` kernels compile to for sm_90a at each head dim.

For every head dim (``64, 96, 128, 192/128, 256``) and kernel (forward, dK/dV, dQ) it records the
real launch (``dense.dense_fwd`` / ``dense.dense_bwd`` on CPU tensors of the H100 problem: S = 16K,
GQA 64:8, bf16, through ``kernels.aot.recorded_launches``) with the default config and with every
candidate of a sweep, compiles each for sm_90a with Triton's own ``ptxas`` and tabulates registers,
spill bytes, shared memory and the H100 occupancy (blocks and warps per SM) that follows.

    PYTHONPATH=. python experiments/cpu_aot_headdim.py --out experiments/results/cpu-aot [--jobs 2]

Results are cached in ``<out>/headdim_configs.jsonl`` (a rerun compiles only what is missing);
``<out>/headdim_configs.md`` is the table. ``--smoke`` compiles a handful (for the test).
The sweep compiles the causal plan (it has the partial-tile loop: the superset of the code); the
defaults and the chosen candidates are compiled for the full mask too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["TRITON_INTERPRET"] = "0"

S, HQ, HKV = 16384, 64, 8
DIMS = ("64", "96", "128", "192/128", "256")
SWEEP_DIMS = ("64", "192/128", "256")  # 96 compiles to the 128 tile (same configs); 128 is tuned on a GPU
KERNELS = {"fwd": "dense_fwd_kernel", "dkdv": "dense_bwd_dkdv_kernel", "dq": "dense_bwd_dq_kernel"}
#: the config keys of each kernel, in the order ``(block_m, block_n, warps, stages)``
KEYS = {"fwd": ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
        "dkdv": ("DKDV_BLOCK_M", "DKDV_BLOCK_N", "dkdv_num_warps", "dkdv_num_stages"),
        "dq": ("DQ_BLOCK_M", "DQ_BLOCK_N", "dq_num_warps", "dq_num_stages")}
SWEEP = {"fwd": ((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)),
         "dkdv": ((16, 32, 64), (32, 64, 128), (4, 8), (2, 3)),
         "dq": ((32, 64, 128), (16, 32, 64), (4, 8), (2, 3))}


def dims_of(label: str) -> tuple[int, int]:
    a, _, b = label.partition("/")
    return int(a), int(b or a)


def sweep_configs(kernel: str) -> list[dict]:
    return [dict(zip(KEYS[kernel], c)) for c in itertools.product(*SWEEP[kernel])]


_PLANS: dict = {}


def record(label: str, mask_name: str, kernel: str, cfg_over: dict):
    """The recorded launch of ``kernel`` at head dims ``label`` with the default config overlaid by
    ``cfg_over``."""
    import torch

    from longca_triton.kernels.core import aot
    from longca_triton.kernels.dense import op as dense
    from longca_triton.kernels.core.runtime import config_head_dim
    from longca_triton.masks import make_mask

    dqk, dv = dims_of(label)
    cfg = dense.resolve_config(config_head_dim(dqk, dv), torch.bfloat16, cfg_over or None)
    mask = _PLANS.setdefault(("mask", mask_name), None) or make_mask(mask_name, S)
    _PLANS[("mask", mask_name)] = mask
    fwd, dkdv, dq = dense.plans_for(mask, cfg, "cpu")
    bf = torch.bfloat16
    q = torch.empty(1, S, HQ, dqk, dtype=bf)
    k = torch.empty(1, S, HKV, dqk, dtype=bf)
    v = torch.empty(1, S, HKV, dv, dtype=bf)
    out = torch.empty(1, S, HQ, dv, dtype=bf)
    lse = torch.empty(1, HQ, S, dtype=torch.float32)
    names = tuple(KERNELS.values()) + ("dense_bwd_preprocess_kernel",)
    with aot.recorded_launches(dense, names) as rec:
        if kernel == "fwd":
            dense.dense_fwd(q, k, v, fwd, 0.1, cfg)
        else:
            dense.dense_bwd(out, q, k, v, out, lse, dkdv, dq, 0.1, cfg)
    return next(r for r in rec if r.name == KERNELS[kernel])


def compile_one(job: tuple) -> dict:
    label, mask_name, kernel, cfg_over = job
    from longca_triton.kernels.core import aot

    row = dict(dims=label, mask=mask_name, kernel=kernel, config=cfg_over)
    t0 = time.time()
    try:
        launch = record(label, mask_name, kernel, cfg_over)
        row["config"] = dict(BLOCK_M=launch.args["BLOCK_M"], BLOCK_N=launch.args["BLOCK_N"],
                             num_warps=launch.num_warps, num_stages=launch.num_stages)  # as launched
        r = aot.compile_launch(launch)
        row.update(registers=r.registers, spill_stores=r.spill_stores, spill_loads=r.spill_loads, shared=r.shared,
                   wgmma=r.wgmma, blocks_per_sm=r.blocks_per_sm, warps_per_sm=r.blocks_per_sm * r.num_warps,
                   error="")
    except Exception as e:  # a config the compiler rejects is a result too
        row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
    row["seconds"] = round(time.time() - t0, 1)
    return row


def job_key(label, mask_name, kernel, cfg_over) -> str:
    return json.dumps([label, mask_name, kernel, sorted((cfg_over or {}).items())])


def row_key(r: dict) -> str:
    return job_key(r["dims"], r["mask"], r["kernel"], r.get("requested"))


def default_job_config(label: str, kernel: str) -> dict:
    """The default config's four keys of ``kernel`` at ``label`` (what a plain call launches)."""
    import torch

    from longca_triton.kernels.dense import op as dense
    from longca_triton.kernels.core.runtime import config_head_dim

    cfg = dense.default_config(config_head_dim(*dims_of(label)), torch.bfloat16)
    return {k: cfg[k] for k in KEYS[kernel]}


def plan_jobs(smoke: bool, extra: dict | None = None) -> list[tuple]:
    jobs = []
    dims = ("64", "256") if smoke else DIMS
    for label in dims:
        for kernel in KERNELS:
            d = default_job_config(label, kernel)
            for mask_name in ("full", "causal"):
                jobs.append((label, mask_name, kernel, d))
            if smoke:
                continue
            if label in SWEEP_DIMS:
                jobs += [(label, "causal", kernel, c) for c in sweep_configs(kernel)]
            for _, c in (extra or {}).get((label, kernel), []):
                jobs += [(label, m, kernel, c) for m in ("full", "causal")]
    seen, out = set(), []
    for j in jobs:
        key = job_key(*j)
        if key not in seen:
            seen.add(key)
            out.append(j)
    return out


# ------------------------------------------------------------------------------------ the table
def _cfg_str(kernel: str, c: dict) -> str:
    return f"{c[KEYS[kernel][0]]}x{c[KEYS[kernel][1]]} w{c[KEYS[kernel][2]]} s{c[KEYS[kernel][3]]}"


def _spill(r: dict) -> str:
    s = max(r["spill_stores"], 0) + max(r["spill_loads"], 0)
    return "0" if s == 0 else f"**{r['spill_stores']}/{r['spill_loads']}**"


def _smem(r: dict) -> str:
    from longca_triton.kernels.core.aot import H100_SMEM_PER_BLOCK

    kb = f"{r['shared'] / 1024:.0f}"
    return f"**{kb} (> 227)**" if r["shared"] > H100_SMEM_PER_BLOCK else kb


def _row(r: dict, note: str = "") -> list:
    c = r["requested"]
    if r["error"]:
        return [_cfg_str(r["kernel"], c), r["mask"], "", "", "", "", "", "", f"error: {r['error'][:80]}"]
    return [_cfg_str(r["kernel"], c), r["mask"], r["registers"], _spill(r), _smem(r), r["blocks_per_sm"],
            r["warps_per_sm"], r["wgmma"], note]


def ok(r: dict) -> bool:
    from longca_triton.kernels.core.aot import H100_SMEM_PER_BLOCK

    return (not r["error"] and r["spill_stores"] == 0 and r["spill_loads"] == 0
            and r["shared"] <= H100_SMEM_PER_BLOCK and r["blocks_per_sm"] > 0)


def table(rows: list[dict], command: str, chosen: dict | None = None) -> str:
    from longca_triton.bench.report import markdown_table

    chosen = chosen or {}
    hdr = ["config (M x N, warps, stages)", "mask", "registers", "spill B (st/ld)", "shared KiB", "blocks/SM",
           "warps/SM", "wgmma", "note"]
    out = ["# Dense `triton` kernels compiled for sm_90a on a CPU, per head dim (issue 17)", "",
           f"Command: `{command}`", "",
           "Real launches (`dense.dense_fwd` / `dense.dense_bwd` recorded on CPU tensors: S = 16K, GQA 64:8, bf16), "
           "compiled by `triton.compile` for `GPUTarget('cuda', 90, 32)` with Triton's bundled `ptxas -v` "
           "(`longca_triton/kernels/core/aot.py`). `blocks/SM`: H100 occupancy from registers (65536 per SM, "
           "allocated per warp in 256s), shared memory (228 KiB per SM, 227 per block, 1 KiB reserved per block) "
           "and 64 warps. `wgmma`: `wgmma.mma_async` instructions in the PTX (0: the dots fell back to `mma.sync`, a tile dim below the 64 rows a warpgroup's wgmma needs). Spills and shared memory over 227 KiB in bold. Not timed: which spill-free config "
           "is fastest is for the GPU (`experiments/gpu/headdim_check.py --configs`).", ""]
    by_dim: dict = {}
    for r in rows:
        by_dim.setdefault(r["dims"], {}).setdefault(r["kernel"], []).append(r)
    for label in DIMS:
        if label not in by_dim:
            continue
        out += [f"## D = {label}", ""]
        for kernel in KERNELS:
            rs = by_dim[label].get(kernel, [])
            if not rs:
                continue
            d = default_job_config(label, kernel)
            pick = [c for _, c in chosen.get((label, kernel), [])]
            names = {json.dumps(c, sort_keys=True): [] for c in pick}
            for n, c in chosen.get((label, kernel), []):
                names[json.dumps(c, sort_keys=True)].append(n)
            lines = []
            for r in sorted(rs, key=lambda r: (r["requested"] != d, r["requested"] not in pick,
                                               not ok(r), -(r.get("warps_per_sm") or 0),
                                               json.dumps(r["requested"], sort_keys=True), r["mask"])):
                key = json.dumps(r["requested"], sort_keys=True)
                note = "default" if r["requested"] == d else ("candidate " + ", ".join(f"`{n}`" for n in names[key])
                                                               if key in names else "")
                lines.append(_row(r, note))
            clean = sum(ok(r) for r in rs if r["mask"] == "causal")
            out += [f"### {kernel}: {len(rs)} compiles, {clean} spill-free within shared memory (causal plan)", "",
                    markdown_table(hdr, lines), ""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "experiments" / "results" / "cpu-aot"))
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--smoke", action="store_true", help="a handful of compiles (the defaults at 64 and 256)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / ("headdim_configs_smoke.jsonl" if args.smoke else "headdim_configs.jsonl")
    rows = [json.loads(x) for x in store.read_text().splitlines()] if store.exists() else []
    done = {row_key(r) for r in rows}
    chosen = candidates_by_dim()
    jobs = [j for j in plan_jobs(args.smoke, chosen) if job_key(*j) not in done]
    print(f"[aot] {len(jobs)} compiles to do ({len(done)} cached) on {args.jobs} processes", flush=True)
    with ProcessPoolExecutor(args.jobs) as ex, store.open("a") as f:
        for j, r in zip(jobs, ex.map(compile_one, jobs)):
            r["requested"] = j[3]
            f.write(json.dumps(r) + "\n")
            f.flush()
            rows.append(r)
            status = r["error"] or (f"{r['registers']} regs, spills {r['spill_stores']}/{r['spill_loads']}, "
                                    f"{r['shared'] // 1024} KiB, {r['blocks_per_sm']} blocks/SM")
            print(f"  D={r['dims']} {r['mask']} {r['kernel']} {_cfg_str(r['kernel'], j[3])}: {status} "
                  f"({r['seconds']} s)", flush=True)
    cmd = "PYTHONPATH=. python experiments/cpu_aot_headdim.py" + (" --smoke" if args.smoke else "")
    md = out / ("headdim_configs_smoke.md" if args.smoke else "headdim_configs.md")
    md.write_text(table(rows, cmd, chosen))
    print(f"[aot] wrote {md}", flush=True)
    return 0


def candidates_by_dim() -> dict:
    """``(dims label, kernel) -> [(name, config)]``: the candidates the GPU check times against the
    defaults (``dense.HEADDIM_CANDIDATES``), compiled here for both masks."""
    from longca_triton.kernels.dense.op import headdim_candidates

    out = {}
    for label in DIMS:
        for kernel in KERNELS:
            out[(label, kernel)] = [(n, {k: c[k] for k in KEYS[kernel]})
                                    for n, c in headdim_candidates(*dims_of(label)).items() if n != "default"]
    return out


if __name__ == "__main__":
    sys.exit(main())

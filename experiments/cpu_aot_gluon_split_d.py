"""Issue 17 on a CPU: the Gluon forward with split head dims (``split_d``) compiled for sm_90a.

For each variant (head dims, config, full-only or with partial tiles, output dtype) it compiles
``attention_fwd.gluon_fwd_kernel`` through ``kernels.gluon.aot.compile_fwd`` (the launcher's own
constexprs) with Triton's ``ptxas`` and records: spill bytes, the register count ptxas reports (the
kernel's ``maxnreg``; the partitions' shares are the ``setmaxnreg`` targets), shared memory, and
what the consumer's main loop issues: ``wgmma.mma_async`` per step (with their shapes), commit
groups and the ``wgmma.wait_group`` counts. Padded variants (split off) are compiled next to the
split ones, and ``--regs`` finds per variant the smallest ``consumer_regs`` that compiles without
spills (a proxy for the consumers' live registers, which ptxas does not report per partition).

    PYTHONPATH=. python experiments/cpu_aot_gluon_split_d.py --out experiments/results/cpu-aot [--jobs 2] [--regs]

Rows are cached in ``<out>/gluon_split_d.jsonl`` (a rerun compiles only what is missing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["TRITON_INTERPRET"] = "0"

#: (name, D_qk, D_v, config, compile_fwd keywords). "causal" compiles the partial-tile path (the
#: superset: a causal or any masked plan), "full" the full-tiles-only kernel a full mask gets.
CAUSAL, FULL = dict(has_partial=True, num_iv=1), dict(has_partial=False, num_iv=1)
VARIANTS = [
    ("d128 padded (reference)", 128, 128, None, CAUSAL),
    ("d96 padded", 96, 96, None, CAUSAL),
    ("d96 padded full", 96, 96, None, FULL),
    ("d80 padded", 80, 80, None, CAUSAL),
    ("d96 split", 96, 96, dict(split_d=True), CAUSAL),
    ("d96 split full", 96, 96, dict(split_d=True), FULL),
    ("d96 split st4", 96, 96, dict(split_d=True, num_stages=4), CAUSAL),
    ("d96 split st4 full", 96, 96, dict(split_d=True, num_stages=4), FULL),
    ("d96 split st2", 96, 96, dict(split_d=True, num_stages=2), CAUSAL),
    ("d96 split n64 st4", 96, 96, dict(split_d=True, BLOCK_N=64, num_stages=4), CAUSAL),
    ("d96 split pingpong st2", 96, 96, dict(split_d=True, pingpong=True, num_stages=2), CAUSAL),
    ("d96 split fp32-out", 96, 96, dict(split_d=True), dict(CAUSAL, store_tma=False)),
    ("d80 split", 80, 80, dict(split_d=True), CAUSAL),
    ("d80 split full", 80, 80, dict(split_d=True), FULL),
    ("d80 split st4", 80, 80, dict(split_d=True, num_stages=4), CAUSAL),
    ("d80 split st5", 80, 80, dict(split_d=True, num_stages=5), CAUSAL),
    ("d80 split n64 st4", 80, 80, dict(split_d=True, BLOCK_N=64, num_stages=4), CAUSAL),
    ("d80 split fp32-out", 80, 80, dict(split_d=True), dict(CAUSAL, store_tma=False)),
    # one operand splits, the other is a power of two; the other splittable dims
    ("d96/128 split (QK only)", 96, 128, dict(split_d=True), CAUSAL),
    ("d128/96 split (PV only)", 128, 96, dict(split_d=True), CAUSAL),
    ("d192/128 split", 192, 128, dict(split_d=True), CAUSAL),
    ("d192/128 padded", 192, 128, None, CAUSAL),
    ("d160 split", 160, 160, dict(split_d=True), CAUSAL),
    ("d48 split", 48, 48, dict(split_d=True), CAUSAL),
]
#: the variants whose smallest spill-free ``consumer_regs`` ``--regs`` looks for
REG_VARIANTS = ("d128 padded (reference)", "d96 padded", "d96 split", "d80 split", "d96 split st4")
REG_STEPS = (240, 224, 208, 192, 176, 168)


def loop_profile(ptx: str) -> dict:
    """What one consumer's steady-state loop step issues, read off the PTX event sequence: the
    ``wgmma.mma_async`` between the previous wait and the loop's ``wait_group N`` (N >= 1: S_j done,
    the P V groups left in flight), their shapes, commit groups, and the waits of the step."""
    ev = []
    for ln in ptx.splitlines():
        t = re.sub(r"^@%p\d+\s+", "", ln.strip())
        if t.startswith("wgmma.mma_async"):
            ev.append(("mma", re.search(r"m\d+n\d+k\d+", t).group(0)))  # e.g. m64n128k16
        elif t.startswith("wgmma.commit_group"):
            ev.append(("commit", ""))
        elif t.startswith("wgmma.wait_group"):
            ev.append(("wait", int(re.search(r"aligned\s+(\d+)", t).group(1))))
    steps = []
    for i, (kind, val) in enumerate(ev):
        if kind != "wait" or val == 0:
            continue
        j = i - 1
        while j >= 0 and ev[j][0] != "wait":
            j -= 1
        seg = ev[j + 1:i]
        shapes: dict = {}
        for k, s in seg:
            if k == "mma":
                shapes[s] = shapes.get(s, 0) + 1
        nxt = next((v for k, v in ev[i + 1:] if k == "wait"), None)
        steps.append(dict(mma=sum(shapes.values()), shapes=shapes, commits=sum(k == "commit" for k, _ in seg),
                          waits=[val, nxt]))
    if not steps:
        return dict(loops=0)
    same = all(s == steps[0] for s in steps)
    return dict(loops=len(steps), loop_same=same, **{f"loop_{k}": v for k, v in steps[0].items()})


def compile_one(job: tuple) -> dict:
    name, d, dv, cfg, kw = job
    import torch

    from longca_triton.kernels.gluon.aot import compile_fwd, ptxas_info
    from longca_triton.kernels.gluon.op import resolve_config, smem_bytes

    c = compile_fwd(d, cfg, head_dim_v=dv, **kw)
    info = ptxas_info(c.ptx)
    r = resolve_config(d, torch.bfloat16, cfg, head_dim_v=dv)
    return dict(name=name, d=d, dv=dv, cfg=cfg or {}, kw=kw, BLOCK_N=r["BLOCK_N"], num_stages=r["num_stages"],
                split_d=r["split_d"], consumer_regs=r["consumer_regs"], pingpong=r["pingpong"],
                shared=c.shared, smem_host=smem_bytes(d, r["BLOCK_N"], r["num_stages"], head_dim_v=dv,
                                                      split_d=r["split_d"]),
                setmaxnreg=sorted(set(c.setmaxnreg())), registers=info["registers"],
                spill_stores=info["spill_stores"], spill_loads=info["spill_loads"],
                wgmma=c.count(r"wgmma\.mma_async"), wait_group=c.count(r"wgmma\.wait_group"),
                tma_store=c.count(r"cp\.async\.bulk\.tensor\.2d\.global\.shared"),
                tensormaps=c.count(r"tensormap\.replace"), **loop_profile(c.ptx))


def table(rows: list) -> str:
    head = ("| variant | BLOCK_N / stages | spills st/ld B | ptxas regs (setmaxnreg) | shared B (host bound) | "
            "wgmma total | loop step: wgmma (shapes), groups, waits | O store |")
    out = [head, "|" + " --- |" * 8]
    for r in rows:
        shapes = ", ".join(f"{n}x {s}" for s, n in r.get("loop_shapes", {}).items())
        loop = (f"{r['loop_mma']} ({shapes}), {r['loop_commits']} groups, wait {r['loop_waits'][0]} then "
                f"{r['loop_waits'][1]}" if r.get("loops") else "-")
        out.append(f"| {r['name']} | {r['BLOCK_N']} / {r['num_stages']}{' pp' if r['pingpong'] else ''} | "
                   f"{r['spill_stores']}/{r['spill_loads']} | {r['registers']} ({'/'.join(map(str, r['setmaxnreg']))}) | "
                   f"{r['shared']} ({r['smem_host']}) | {r['wgmma']} | {loop} | "
                   f"{'TMA' if r['tma_store'] else 'pointer'} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="experiments/results/cpu-aot")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--regs", action="store_true", help="also the smallest spill-free consumer_regs")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jl = out / "gluon_split_d.jsonl"
    have = {}
    if jl.exists():
        for ln in jl.read_text().splitlines():
            r = json.loads(ln)
            have[(r["name"], r["consumer_regs"])] = r
    jobs = [v for v in VARIANTS if (v[0], 240) not in have]
    if a.regs:
        for v in VARIANTS:
            if v[0] in REG_VARIANTS:
                jobs += [(v[0], v[1], v[2], dict(v[3] or {}, consumer_regs=rg), v[4]) for rg in REG_STEPS
                         if rg != 240 and (v[0], rg) not in have]
    with ProcessPoolExecutor(a.jobs) as ex:
        for r in ex.map(compile_one, jobs):
            have[(r["name"], r["consumer_regs"])] = r
            with jl.open("a") as f:
                f.write(json.dumps(r) + "\n")
            print(json.dumps(r), flush=True)
    rows = [have[(v[0], 240)] for v in VARIANTS if (v[0], 240) in have]
    print(table(rows))
    if a.regs:
        for name in REG_VARIANTS:
            ok = [rg for rg in REG_STEPS if (name, rg) in have and have[(name, rg)]["spill_stores"] == 0
                  and have[(name, rg)]["spill_loads"] == 0]
            print(f"{name}: spill-free at consumer_regs {ok}")


if __name__ == "__main__":
    main()

"""Issue 12 on a CPU: what the Gluon backward kernels compile to for sm_90a, per loop iteration.

For each variant (the split design's dQ and dK/dV kernels, the fused kernel with each ``fused_dq``
mode: ``atomic``, ``writer``, ``writer_keys``, and 64-row query tiles at D = 128) at D = 64 and 128,
full and causal, it records the *real* launch (the launchers
``attention.gluon_bwd`` / ``attention.gluon_bwd_fused`` on CPU tensors of the H100 problem:
S = 16K, GQA 64:8, bf16), so every constexpr and every argument specialisation (pointer and int
divisibility by 16, ints equal to 1) is what Triton would see on the GPU (``kernels.aot.specialize``;
``gluon.aot.compile_bwd`` passes no divisibility, which changes the atomics' vector width). Each is
compiled for sm_90a; ``ptxas -v`` gives registers and spills, ``cuobjdump -sass`` the machine code,
and the consumer's main loop (the innermost backward branch around the HGMMAs; one copy per consumer
warpgroup) is read: HGMMA count and shape, ``WARPGROUP.DEPBAR`` (wgmma waits), ``BAR.SYNC``,
mbarrier waits and arrivals, global loads, global atomics / reductions (and their vector width),
shared-memory traffic, and the order of those events (``timeline``). The dQ-writer partition's
loop (the loop with global reductions and no HGMMA) is read the same way.

    PYTHONPATH=. python experiments/cpu_aot_fused_bwd.py --out experiments/results/cpu-aot [--jobs 2]

Rows go to ``<out>/gluon_fused_bwd.jsonl`` (a rerun compiles only what is missing; ``--force``
recompiles); ``--dump DIR`` keeps each variant's PTX and SASS. Static counts: instructions of both
paths of the loop body (the masked partial-tile path included), not dynamic ones.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["TRITON_INTERPRET"] = "0"

S, HQ, HKV = 16384, 64, 8

#: (label, kernel, cfg overlay, head dims or None for all): kernel "dq" / "dkdv" (split design) or
#: "fused"; the 64-row query tiles at D = 128 show what the dQ^T accumulator's registers cost
VARIANTS = [
    ("split-dq", "dq", {}, None),
    ("split-dkdv", "dkdv", {}, None),
    ("fused-atomic", "fused", dict(bwd_design="fused"), None),
    ("fused-writer", "fused", dict(bwd_design="fused", fused_dq="writer"), None),
    ("fused-writer-keys", "fused", dict(bwd_design="fused", fused_dq="writer_keys"), (128,)),
    ("fused-atomic-mq64", "fused", dict(bwd_design="fused", fused_block_mq=64), (128,)),
    ("fused-writer-mq64", "fused", dict(bwd_design="fused", fused_dq="writer", fused_block_mq=64), (128,)),
]


def _record(kernel: str, d: int, mask_name: str, cfg_over: dict):
    """``(jit function, bound args, launch options)`` of ``kernel`` as the launcher calls it."""
    import torch

    from longca_triton.kernels.core import aot
    from longca_triton.kernels.dense import op as dense
    from longca_triton.kernels.gluon import op as G
    from longca_triton.kernels.gluon import bwd as AB
    from longca_triton.kernels.gluon import bwd_fused as AF
    from longca_triton.masks import make_mask

    cfg = G.resolve_config(d, torch.bfloat16, cfg_over or None)
    mask = make_mask(mask_name, S)
    bf = torch.bfloat16
    q = torch.empty(1, S, HQ, d, dtype=bf)
    k = torch.empty(1, S, HKV, d, dtype=bf)
    out = torch.empty(1, S, HQ, d, dtype=bf)
    lse = torch.empty(1, HQ, S, dtype=torch.float32)
    sink: list = []

    class Rec:  # a launch recorder that also keeps ``maxnreg`` (``aot._Recorder`` binds it as an arg)
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kw):
                opts = {o: kw.pop(o) for o in ("num_warps", "num_stages", "maxnreg") if o in kw}
                bound = self.fn.signature.bind(*args, **kw)
                bound.apply_defaults()
                sink.append((self.fn, grid, dict(bound.arguments), opts))
            return launch

    patches = [(AB, "gluon_bwd_dq_kernel"), (AB, "gluon_bwd_dkdv_kernel"), (AF, "gluon_bwd_fused_kernel"),
               (AF, "gluon_bwd_fused_writer_kernel"), (AF, "dq_accum_cast_kernel"),
               (dense, "dense_bwd_preprocess_kernel")]
    saved = [(m, n, getattr(m, n)) for m, n in patches]
    try:
        for m, n, fn in saved:
            setattr(m, n, Rec(fn))
        _, bwd_a, bwd_b = G.plans_for_gluon(mask, cfg, {}, "cpu")
        if kernel == "fused":
            G.gluon_bwd_fused(out, q, k, k, out, lse, bwd_a, 0.088, cfg)
        else:
            G.gluon_bwd(out, q, k, k, out, lse, bwd_a, bwd_b, 0.088, cfg)
    finally:
        for m, n, fn in saved:
            setattr(m, n, fn)
    names = {"dq": ("gluon_bwd_dq_kernel",), "dkdv": ("gluon_bwd_dkdv_kernel",),
             "fused": ("gluon_bwd_fused_kernel", "gluon_bwd_fused_writer_kernel")}[kernel]
    fn, grid, args, opts = next(r for r in sink if r[0].fn.__name__ in names)
    return fn, aot.Launch(fn, tuple(grid), args, opts.get("num_warps", 4), opts.get("num_stages", 3)), opts


def _tool(name: str) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    return os.path.join(os.path.dirname(get_ptxas(90).path), name)


def compile_variant(label: str, kernel: str, d: int, mask_name: str, cfg_over: dict, dump: str | None = None) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from longca_triton.kernels.core import aot

    fn, launch, opts = _record(kernel, d, mask_name, cfg_over)
    sig, consts, attrs = aot.specialize(launch)
    k = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": launch.num_warps, "maxnreg": opts.get("maxnreg")})
    ptx = k.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        Path(src).write_text(ptx)
        log = subprocess.run([_tool("ptxas"), "-arch=sm_90a", "-v", src, "-o", cubin], capture_output=True,
                             text=True, check=True)
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    info = log.stderr + log.stdout
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    if dump:
        base = Path(dump) / f"{label}-d{d}-{mask_name}"
        base.parent.mkdir(parents=True, exist_ok=True)
        base.with_suffix(".ptx").write_text(ptx)
        base.with_suffix(".sass").write_text(sass)
    consts_named = {p.name: launch.args[p.name] for p in fn.params if p.is_constexpr}
    return dict(label=label, kernel=kernel, d=d, mask=mask_name, config=cfg_over,
                constexprs={n: v for n, v in consts_named.items() if isinstance(v, (int, bool))},
                registers=int(re.search(r"Used (\d+) registers", info).group(1)),
                # e.g. C7515 "wgmma.mma_async instructions are serialized due to ..."
                ptxas_warnings=sorted({w.strip() for w in re.findall(r"Potential Performance Loss:([^\n]*)", info)}),
                spill_stores=int(spill.group(1)), spill_loads=int(spill.group(2)),
                shared=int(k.metadata.shared),
                setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                ptx_counts={"wgmma.mma_async": len(re.findall(r"wgmma\.mma_async", ptx)),
                            "wgmma.wait_group": len(re.findall(r"wgmma\.wait_group", ptx)),
                            "atom.global": len(re.findall(r"\batom\.global", ptx)),
                            "red.global": len(re.findall(r"\bred\.global", ptx))},
                loops=sass_loops(sass))


# ----------------------------------------------------------------------------------------------
# SASS reading
# ----------------------------------------------------------------------------------------------

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def _parse(sass: str) -> list[tuple[int, str, str]]:
    """``(pc, opcode, text)`` per instruction; the opcode without its predicate."""
    out = []
    for m in _LINE.finditer(sass):
        text = m.group(2).strip()
        op = text.split()[1] if text.startswith("@") else text.split()[0]
        out.append((int(m.group(1), 16), op, text))
    return out


def _kind(op: str, text: str) -> str | None:
    """The event an instruction stands for in a loop's timeline (None: not one we track)."""
    if op.startswith("HGMMA"):
        # the A operand (second) is a register (RS) or a shared-memory descriptor (SS)
        a_operand = text.split(op, 1)[1].split(",")[1].strip()
        return f"HGMMA.{op.split('.')[1]}.{'RS' if a_operand.startswith('R') else 'SS'}"
    if op == "WARPGROUP.DEPBAR.LE":
        return "WGMMA_WAIT(" + str(int(text.split(",")[-1].strip(), 16)) + ")"
    if op == "WARPGROUP.ARRIVE":
        return None
    if op.startswith("BAR.SYNC"):
        return "BAR.SYNC"
    if op.startswith("SYNCS.PHASECHK"):
        return "MBAR_WAIT"
    if op.startswith("SYNCS.ARRIVE"):
        return "MBAR_ARRIVE"
    if op.startswith(("ATOMG", "REDG", "RED.", "ATOM.")):
        width = re.search(r"F32x(\d)", op)
        return f"{op.split('.')[0]}.F32x{width.group(1) if width else 1}"
    if op.startswith("LDG"):
        return "LDG"
    if op.startswith(("STS", "STSM")):
        return op.split(".")[0] + (".128" if ".128" in op else ".64" if ".64" in op else "")
    if op.startswith(("LDS", "LDSM")):
        return op.split(".")[0] + (".128" if ".128" in op else ".64" if ".64" in op else "")
    if op.startswith("MUFU.EX2"):
        return "MUFU.EX2"
    if op.startswith(("UTMALDG", "UTMASTG")):
        return op.split(".")[0]
    if op.startswith(("STL", "LDL")):  # register spills (local memory)
        return op.split(".")[0]
    return None


def _timeline(events: list[str]) -> str:
    """Run-length compressed sequence: ``HGMMA.64x32x16.SS x8 | WGMMA_WAIT(0) | LDG x16 | ...``."""
    out: list[list] = []
    for e in events:
        if out and out[-1][0] == e:
            out[-1][1] += 1
        else:
            out.append([e, 1])
    return " | ".join(e if n == 1 else f"{e} x{n}" for e, n in out)


def sass_loops(sass: str) -> list[dict]:
    """The innermost loops with HGMMA (consumer main loops) or with global reductions and no HGMMA
    (the dQ writer's): per loop, static instruction counts and the event timeline."""
    ins = _parse(sass)
    pcs = [p for p, _, _ in ins]
    regions = []
    for i, (pc, op, text) in enumerate(ins):
        # a loop's back edge is a conditional backward branch (the mbarrier retry stubs jump back
        # unconditionally, the warp-specialize dispatch loop too)
        if op == "BRA" and text.startswith("@"):
            target = int(text.split()[-1], 16)
            if target < pc:
                lo = pcs.index(target) if target in pcs else None
                if lo is not None:
                    regions.append((lo, i))
    def has(lo, hi, pred):
        return any(pred(ins[j][1]) for j in range(lo, hi + 1))
    mma = [r for r in regions if has(*r, lambda o: o.startswith("HGMMA"))]
    red = [r for r in regions if not has(*r, lambda o: o.startswith("HGMMA"))
           and has(*r, lambda o: o.startswith(("REDG", "ATOMG")))]
    loops = []
    for role, rs in (("consumer", mma), ("dq_writer", red)):
        inner = [r for r in rs if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in rs)]
        for lo, hi in inner:
            events = [k for _, op, t in ins[lo:hi + 1] if (k := _kind(op, t))]
            counts: dict[str, int] = {}
            for e in events:
                counts[e] = counts.get(e, 0) + 1
            loops.append(dict(role=role, pc=f"{ins[lo][0]:#x}-{ins[hi][0]:#x}", instructions=hi - lo + 1,
                              counts=counts, timeline=_timeline(events)))
    return loops


def _fmt_counts(c: dict, keys) -> str:
    return ", ".join(f"{k} {c[k]}" for k in keys if c.get(k))


def table(rows: list[dict]) -> str:
    """Markdown: per variant, the compile facts and the first consumer warpgroup's loop (the second
    one's is the same code) and the dQ writer's loop, counts per loop iteration (static)."""
    head = ("| variant | D | mask | setmaxnreg | spill st/ld B | smem B | loop instr | HGMMA | wgmma waits "
            "| BAR.SYNC | mbar wait/arrive | LDG | global atomics | smem stores | spill instr in loop |")
    out = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        if r.get("error"):
            out.append(f"| {r['label']} | {r['d']} | {r['mask']} | error: {r['error'][:80]} |")
            continue
        warn = " (wgmma serialized!)" if r.get("ptxas_warnings") else ""
        loops = [lp for lp in r["loops"] if lp["role"] == "consumer"][:1] + [lp for lp in r["loops"]
                                                                             if lp["role"] == "dq_writer"]
        for lp in loops:
            c = lp["counts"]
            hg = _fmt_counts(c, sorted(k for k in c if k.startswith("HGMMA")))
            waits = _fmt_counts(c, sorted(k for k in c if k.startswith("WGMMA_WAIT")))
            atom = _fmt_counts(c, sorted(k for k in c if k.startswith(("ATOMG", "REDG"))))
            sts = _fmt_counts(c, sorted(k for k in c if k.startswith(("STS", "STSM"))))
            name = r["label"] + (" / writer" if lp["role"] == "dq_writer" else "")
            spills = f"{r['spill_stores']}/{r['spill_loads']}{warn}"
            out.append(f"| {name} | {r['d']} | {r['mask']} | {r['setmaxnreg']} | {spills} | {r['shared']} |"
                       f" {lp['instructions']} | {hg} | {waits} | {c.get('BAR.SYNC', 0)} "
                       f"| {c.get('MBAR_WAIT', 0)}/{c.get('MBAR_ARRIVE', 0)} | {c.get('LDG', 0)} | {atom} | {sts} "
                       f"| {c.get('STL', 0) + c.get('LDL', 0)} |")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------

def _job(job):
    label, kernel, d, mask_name, cfg_over, dump = job
    t0 = time.time()
    try:
        row = compile_variant(label, kernel, d, mask_name, cfg_over, dump)
        row["error"] = ""
    except Exception as e:  # noqa: BLE001 - a variant the compiler rejects is a result too
        row = dict(label=label, kernel=kernel, d=d, mask=mask_name, config=cfg_over,
                   error=f"{type(e).__name__}: {str(e)[:2000]}")
    row["seconds"] = round(time.time() - t0, 1)
    return row


def _key(label, d, mask_name) -> str:
    return f"{label}|{d}|{mask_name}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="experiments/results/cpu-aot")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--dump", default=None, help="write <DUMP>/<variant>.ptx and .sass")
    ap.add_argument("--only", default=None, help="comma-separated variant labels")
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--masks", default="full,causal")
    ap.add_argument("--force", action="store_true", help="recompile rows already in the jsonl")
    ap.add_argument("--table", action="store_true", help="print the markdown table of the jsonl and stop")
    ap.add_argument("--timelines", action="store_true", help="print each loop's event timeline and stop")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jl = out / "gluon_fused_bwd.jsonl"
    rows = {}
    if jl.exists():
        for ln in jl.read_text().splitlines():
            r = json.loads(ln)
            rows[_key(r["label"], r["d"], r["mask"])] = r
    if a.table or a.timelines:
        order = {v[0]: i for i, v in enumerate(VARIANTS)}
        rs = sorted(rows.values(), key=lambda r: (-r["d"], r["mask"] != "full", order.get(r["label"], 99)))
        if a.table:
            print(table(rs))
        else:
            for r in rs:
                for lp in r.get("loops", []):
                    print(f"{r['label']} D={r['d']} {r['mask']} {lp['role']} {lp['pc']}: {lp['timeline']}")
        return
    only = set(a.only.split(",")) if a.only else None
    jobs = [(label, kernel, int(d), m, cfg, a.dump) for label, kernel, cfg, dims in VARIANTS
            if only is None or label in only for d in a.dims.split(",") if dims is None or int(d) in dims
            for m in a.masks.split(",")]
    jobs = [j for j in jobs if a.force or _key(j[0], j[2], j[3]) not in rows or rows[_key(j[0], j[2], j[3])]["error"]]
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        for row in ex.map(_job, jobs):
            rows[_key(row["label"], row["d"], row["mask"])] = row
            brief = {k: row.get(k) for k in ("label", "d", "mask", "registers", "spill_stores", "shared", "error")}
            print(json.dumps(brief)[:400], flush=True)
            jl.write_text("".join(json.dumps(r) + "\n" for r in rows.values()))


if __name__ == "__main__":
    main()

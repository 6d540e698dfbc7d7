"""Compile the dense backward's dQ / dK/dV launches for sm_90a on a CPU (no GPU): registers, spills, shared
memory, and each loop's SASS (instruction count, the order of its HGMMA / wgmma waits / MUFU events).

The launches are the real ones (``dense.dense_bwd`` on CPU tensors of the real shapes with its kernels swapped for
recorders: ``kernels.aot``), so every constexpr is what a GPU run would pass.

    PYTHONPATH=. python experiments/aot_stats.py --masks full,causal --passes dq \\
        --configs '{"default": {}, "skew": {"dq_skew": true}}' [--dump DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import subprocess
import re
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


KERNELS = {"dq": "dense_bwd_dq_kernel", "dkdv": "dense_bwd_dkdv_kernel"}



def _tool(name: str) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    return os.path.join(os.path.dirname(get_ptxas(90).path), name)




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




def compile_sass(launch, dump: str | None = None):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from longca_triton.kernels.core import aot

    sig, consts, attrs = aot.specialize(launch)
    k = triton.compile(ASTSource(launch.kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        Path(src).write_text(k.asm["ptx"])
        log = subprocess.run([_tool("ptxas"), "-arch=sm_90a", "-v", src, "-o", cubin], capture_output=True,
                             text=True, check=True)
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    if dump:
        for ext, text in (("sass", sass), ("ptx", k.asm["ptx"]), ("ttgir", k.asm["ttgir"])):
            Path(f"{dump}.{ext}").write_text(text)
    info = aot.ptxas_log_info(log.stderr + log.stdout)
    loops = sass_loops(sass)
    ops = _parse(sass)
    hist = {}
    for lp in loops[:1]:
        lo, hi = (int(x, 16) for x in lp["pc"].split("-"))
        for pc, op, _ in ops:
            if lo <= pc <= hi:
                key = op.split(".")[0]
                hist[key] = hist.get(key, 0) + 1
    # per loop: float arithmetic issued after its last HGMMA (work that overlaps the step's last, asynchronous
    # GEMM; dq_skew exists to put dS there)
    after, mufu = [], []
    for lp in loops:
        lo, hi = (int(x, 16) for x in lp["pc"].split("-"))
        body = [op.split(".")[0] for pc, op, _ in ops if lo <= pc <= hi]
        last = max((i for i, op in enumerate(body) if op == "HGMMA"), default=len(body))
        after.append(sum(op in ("FMUL", "FADD", "FFMA", "F2FP") for op in body[last + 1:]))
        mufu.append(sum(op == "MUFU" for op in body))
    return dict(opcodes=dict(sorted(hist.items(), key=lambda kv: -kv[1])), timeline=[lp.get("timeline") for lp in loops],
                float_ops_after_last_hgmma=after, loop_mufu=mufu,
                registers=info["registers"], spills=info["spill_stores"] + info["spill_loads"],
                shared=int(k.metadata.shared), loop_instr=[lp.get("instructions") for lp in loops],
                wgmma=k.asm["ptx"].count("wgmma.mma_async"))


def common_args(ap: argparse.ArgumentParser, passes: str) -> None:
    """The command-line options: problem size, heads, head dim, configs, passes, dump folder."""
    ap.add_argument("--S", type=int, default=32768)
    ap.add_argument("--heads", default="64:8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--configs", default='{"default": {}}')
    ap.add_argument("--passes", default=passes)
    ap.add_argument("--dump", default=None, metavar="DIR", help="keep each launch's SASS / PTX / TTGIR there")


def report(launches, label: str, dump: str | None, **extra) -> None:
    """Compile each recorded launch (``compile_sass``) and print one JSON line: ``extra``, the config ``label``,
    the kernel, its launch keys and what it compiled to; ``dump``: a folder for ``<label>-<n>.sass`` etc."""
    for n, ln in enumerate(launches):
        path = None
        if dump:
            Path(dump).mkdir(parents=True, exist_ok=True)
            path = str(Path(dump) / f"{label}-{n}")
        r = compile_sass(ln, path)
        keys = {k: ln.args[k] for k in ("BLOCK_M", "BLOCK_N", "HEADS", "LIST_CHUNK", "PACKED", "SWEEP", "SKEW")
                if k in ln.args}
        print(json.dumps(dict(**extra, config=label, kernel=ln.name, grid=ln.grid, warps=ln.num_warps,
                              stages=ln.num_stages, **keys, **r)), flush=True)


def record(mask, cfg_over: dict, hq: int, hkv: int, d: int, passes=("dq",)):
    """The dense backward's launches of ``passes`` for ``mask`` under ``cfg_over``, recorded (never run)."""
    from longca_triton.kernels.core import aot
    from longca_triton.kernels.dense import op as dense

    dense._interpreting = lambda: False
    S = int(mask.seqlen_q)
    q = torch.empty(1, S, hq, d, dtype=torch.bfloat16)
    k = torch.empty(1, S, hkv, d, dtype=torch.bfloat16)
    v = torch.empty(1, S, hkv, d, dtype=torch.bfloat16)
    cfg = dense.resolve_config(d, q.dtype, cfg_over, q=q, k=k, v=v, mask=mask)
    _, dkdv_plan, dq_plan = dense.plans_for(mask, cfg, "cpu")
    out, dout = torch.empty_like(q), torch.empty_like(q)
    lse = torch.empty(1, hq, S, dtype=torch.float32)
    with aot.recorded_launches(dense, tuple(KERNELS.values())) as rec, \
            aot.recorded_launches(dense, ("bwd_preprocess_kernel",)):
        dense.dense_bwd(dout, q, k, v, out, lse, dkdv_plan, dq_plan, d ** -0.5, {**cfg, "bwd_streams": False})
    return cfg, [ln for ln in rec if ln.name in {KERNELS[p] for p in passes}]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--masks", default="full,causal")
    common_args(ap, "dq")
    ap.set_defaults(S=16384)
    args = ap.parse_args(argv)
    from longca_triton.masks import make_mask

    hq, hkv = (int(x) for x in args.heads.split(":"))
    for mname in args.masks.split(","):
        mask = make_mask(mname, args.S, seed=0)
        for name, over in json.loads(args.configs).items():
            _, launches = record(mask, over, hq, hkv, args.head_dim, tuple(args.passes.split(",")))
            report(launches, f"{mname}-{name}", args.dump, mask=mname)


if __name__ == "__main__":
    main()

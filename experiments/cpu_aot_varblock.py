"""Compile the block-sparse backward's launches for sm_90a on a CPU (no GPU): registers, spills, shared
memory and the innermost loop's SASS instruction count per config, for variable or uniform blocks.

The launches are the real ones (``block_sparse.block_sparse_bwd`` on CPU tensors of the real shapes, its
kernels swapped for recorders: ``kernels.aot``), so every constexpr is what a GPU run would pass.

    PYTHONPATH=. python experiments/cpu_aot_varblock.py --mask varblock256 --S 32768 \\
        --configs '{"default": {}, "k128": {"DKDV_BLOCK_N": 128, "dkdv_num_warps": 8}}' [--dump DIR]

``--dump DIR`` keeps each compiled launch's SASS, PTX and TTGIR (``<config>-<n>.sass`` ...) for reading.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))

import torch  # noqa: E402

from cpu_aot_fused_bwd import _parse, _tool, sass_loops  # noqa: E402


def record(mask, cfg_over: dict, hq: int, hkv: int, d: int, passes=("dkdv", "dq")):
    """The backward's dK/dV and dQ launches for ``mask`` under config ``cfg_over``, recorded (never run)."""
    from longca_triton.kernels.core import aot
    from longca_triton.kernels.block_sparse import op as BS
    from longca_triton.kernels.dense import op as dense

    # the Hopper configs, not the interpreter's (this process compiles; it never interprets)
    BS._interpreting = lambda: False
    S = int(mask.q_block_bounds[-1])
    q = torch.empty(1, S, hq, d, dtype=torch.bfloat16)
    k = torch.empty(1, S, hkv, d, dtype=torch.bfloat16)
    v = torch.empty(1, S, hkv, d, dtype=torch.bfloat16)
    cfg = BS.resolve_config(mask, d, cfg_over, q=q, k=k)
    tables = BS.tables_for(mask, cfg, "cpu")
    out, dout = torch.empty_like(q), torch.empty_like(q)
    lse = torch.empty(1, hq, S, dtype=torch.float32)
    names = ("block_sparse_bwd_dkdv_kernel", "block_sparse_bwd_dkdv_merged_kernel", "block_sparse_bwd_dq_kernel")
    with aot.recorded_launches(BS, names) as rec, aot.recorded_launches(dense, ("dense_bwd_preprocess_kernel",)):
        BS.block_sparse_bwd(dout, q, k, v, out, lse, mask, tables, d ** -0.5, cfg, passes=passes)
    return cfg, list(rec)


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
    """The options this script shares with ``cpu_aot_dense_bwd.py``."""
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mask", default="varblock256")
    ap.add_argument("--density", type=float, default=0.3)
    common_args(ap, "dkdv")
    args = ap.parse_args(argv)
    from bwd_variants import SPARSE_MASKS

    from longca_triton.masks import make_mask

    hq, hkv = (int(x) for x in args.heads.split(":"))
    kind, block, extra = SPARSE_MASKS[args.mask]
    extra = extra(args.S) if callable(extra) else extra
    mask = make_mask(kind, args.S, block=block, density=args.density, patterns=hkv, seed=0, **extra)
    for name, over in json.loads(args.configs).items():
        _, launches = record(mask, over, hq, hkv, args.head_dim, tuple(args.passes.split(",")))
        report(launches, name, args.dump)


if __name__ == "__main__":
    main()

"""Issue 17 on a CPU: does this Triton's Gluon take the wgmma shapes FlashAttention-3 uses at D = 96?

FA3 issues ``P V`` as one ``HGMMA.64x96x16`` and ``S`` as ``HGMMA.64x144x16`` (session 28's Nsight pages); a Gluon
kernel would need a ``[64, 96]`` (or ``[64, 144]``) accumulator in an ``NVMMADistributedLayout`` with that N. This
compiles one ``gl.zeros([64, N])`` accumulator per N for sm_90a (no GPU needed) and prints, per N, whether the
frontend takes it or the error it raises. Run it in any environment with Triton installed (the project pins 3.6;
a separate venv holds another version):

    python experiments/cpu_gluon_shape_probe.py [--n 64,96,128,144]
"""

from __future__ import annotations

import argparse
import os
import traceback

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402


@gluon.jit
def accumulator_probe_kernel(C, N: gl.constexpr):
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    acc = gl.zeros([64, N], gl.float32, acc_l)  # [64, N]: one warpgroup's wgmma accumulator
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
    gl.store(C + rows, gl.sum(acc, axis=1))


def probe(n: int) -> str:
    """``"accepted"`` or the error the frontend raises for a ``[64, n]`` accumulator."""
    try:
        triton.compile(GluonASTSource(accumulator_probe_kernel, {"C": "*fp32", "N": "constexpr"}, constexprs={"N": n}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        return "accepted"
    except Exception:  # noqa: BLE001 - the message is the result
        lines = traceback.format_exc().strip().splitlines()
        # the root cause (the frontend's ValueError), not the CompilationError that wraps it
        return "refused: " + next((ln.strip() for ln in lines if ln.startswith("ValueError")),
                                  next((ln.strip() for ln in reversed(lines) if "Error:" in ln), lines[-1].strip()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="64,96,128,144", help="accumulator widths to try")
    args = ap.parse_args(argv)
    print(f"triton {triton.__version__}")
    for n in (int(x) for x in args.n.split(",")):
        print(f"[64, {n}] accumulator: {probe(n)}")


if __name__ == "__main__":
    main()

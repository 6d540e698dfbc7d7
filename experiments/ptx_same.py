"""Does a refactor leave the compiled kernels alone? On a CPU (no GPU): the sm_90a PTX, debug info dropped,
of the default backward kernels of two package trees, compared kernel by kernel.

    rm -rf /tmp/base && mkdir /tmp/base && git archive <commit> longca_triton | tar -x -C /tmp/base
    PYTHONPATH=. python experiments/ptx_same.py /tmp/base .     (the venv's python: it needs torch)

Prints one line per kernel and case: ``same code`` or the number of differing PTX lines; exits 1 if any
differ. The cases: dense dK/dV and dQ, causal and full (D = 128, GQA 64:8, S = 4K, the mask's default config),
block-sparse (block 128, density 0.3, a pattern per KV head) and variable blocks (mean 256, min 128,
density 0.3: the dK/dV main and tail launches, the dQ main launch). Each tree is compiled in its own
subprocess. Either tree may have the package layout (``kernels/dense/op.py``, ``kernels/core/aot.py``) or
the older flat one (``kernels/dense.py``, ``kernels/aot.py``): the child imports whichever exists.
"""

from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path

_CHILD = r'''
import os, sys, json
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, sys.argv[1])
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib

def first(*names):
    """The first of the modules that imports: the package layout first, then the flat one."""
    for n in names:
        try:
            return importlib.import_module(n)
        except ModuleNotFoundError as e:
            if not n.startswith(e.name or ""):
                raise
    raise ModuleNotFoundError(names[-1])

D = first("longca_triton.kernels.dense.op", "longca_triton.kernels.dense")
BS = first("longca_triton.kernels.block_sparse.op", "longca_triton.kernels.block_sparse")
aot = first("longca_triton.kernels.core.aot", "longca_triton.kernels.aot")
# the launchers look their kernels up in the module that defines them: record there
D_LAUNCH = sys.modules[D.dense_bwd.__module__]
BS_LAUNCH = sys.modules[BS.block_sparse_bwd.__module__]
from longca_triton.masks import make_mask

def code(launch):
    sig, consts, attrs = aot.specialize(launch)
    k = triton.compile(ASTSource(launch.kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    out = []
    for line in k.asm["ptx"].splitlines():
        if "debug" in line or line.startswith((".b8", ".b32", ".b64")):
            break  # the DWARF sections: file paths and line numbers, not code
        # .loc / .file and the $L__tmp labels around inlined calls are debug info too
        if not line.lstrip().startswith((".loc", ".file", "//", "$L__tmp")):
            out.append(line)
    return out

S, bf = 4096, torch.bfloat16
q, out, do = (torch.empty(1, S, 64, 128, dtype=bf) for _ in range(3))
k, v = (torch.empty(1, S, 8, 128, dtype=bf) for _ in range(2))
lse = torch.empty(1, 64, S)
res = {}
for name in ("causal", "full"):
    mask = make_mask(name, S)
    cfg = D.resolve_config(128, bf, mask=mask)
    _, kp, qp = D.plans_for(mask, cfg, "cpu")
    names = [n for n in ("dense_bwd_dkdv_kernel", "dense_bwd_dq_kernel", "bwd_preprocess_kernel")
             if hasattr(D_LAUNCH, n)]
    with aot.recorded_launches(D_LAUNCH, names) as rec:
        D.dense_bwd(do, q, k, v, out, lse, kp, qp, 0.088, cfg)
    res[f"dense dK/dV {name}"] = code(next(r for r in rec if r.name == "dense_bwd_dkdv_kernel"))
    res[f"dense dQ {name}"] = code(next(r for r in rec if r.name == "dense_bwd_dq_kernel"))
# (delta, and with lse the stats rows the dK/dV steps read by TMA boxes: dkdv_stats_tma)
BS_LAUNCH.launch_bwd_preprocess = lambda out, dout, dlse=None, lse=None: (
    torch.empty(1, 64, S) if lse is None else (torch.empty(1, 64, S), torch.empty(1, 64, S, 4)))
mask = make_mask("block_sparse", S, block=128, density=0.3, patterns=8, seed=0)
cfg = BS.resolve_config(mask, 128)
with aot.recorded_launches(BS_LAUNCH, ("block_sparse_bwd_dkdv_kernel", "block_sparse_bwd_dq_kernel")) as rec:
    BS.block_sparse_bwd(do, q, k, v, out, lse, mask, BS.tables_for(mask, cfg, "cpu"), 0.088, cfg, passes=("dkdv",))
res["block-sparse dK/dV"] = code(next(r for r in rec if r.name == "block_sparse_bwd_dkdv_kernel"))
# variable blocks (mean 256, min 128): the dK/dV main and tail launches, the dQ main launch
mask = make_mask("varblock_sparse", S, block=256, min_block=128, density=0.3, patterns=8, seed=0)
cfg = BS.resolve_config(mask, 128, q=q, k=k)
with aot.recorded_launches(BS_LAUNCH, ("block_sparse_bwd_dkdv_kernel", "block_sparse_bwd_dq_kernel")) as rec:
    BS.block_sparse_bwd(do, q, k, v, out, lse, mask, BS.tables_for(mask, cfg, "cpu"), 0.088, cfg)
for i, r in enumerate(x for x in rec if x.name == "block_sparse_bwd_dkdv_kernel"):
    res[f"variable-block dK/dV {('main', 'tail')[i]}"] = code(r)
res["variable-block dQ"] = code(next(r for r in rec if r.name == "block_sparse_bwd_dq_kernel"))
print(json.dumps(res))
'''


def compiled(root: str) -> dict:
    import json

    r = subprocess.run([sys.executable, "-c", _CHILD, str(Path(root).resolve())], capture_output=True, text=True,
                       check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    a, b = compiled(argv[0]), compiled(argv[1])
    same = True
    for case in a:
        diff = [x for x in difflib.unified_diff(a[case], b[case], lineterm="", n=0) if x[:1] in "+-"
                and not x.startswith(("+++", "---"))]
        same &= not diff
        print(f"{case}: {'same code' if not diff else f'{len(diff)} PTX lines differ'} ({len(b[case])} lines)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Ahead-of-time compilation of the Gluon kernels for sm_90a, on any machine (no GPU needed).

Tests use it on the CPU to check that every variant compiles, what the compiler made of it
(async wgmma, ``setmaxnreg`` per partition, TMA) and that ``ptxas`` reports no spills; people
reading the kernel can dump its TTGIR / PTX the same way::

    python -m longca_triton.kernels.gluon.aot --head-dim 128 --dump /tmp/fwd
    python -m longca_triton.kernels.gluon.aot --kernel fwd --head-dim 192 --head-dim-v 128
    python -m longca_triton.kernels.gluon.aot --head-dim 96 --split-d --stages 4
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

from longca_triton.kernels.core.aot import ptxas_info

__all__ = ["Compiled", "compile_fwd", "compile_bwd", "ptxas_info"]


@dataclasses.dataclass
class Compiled:
    ttgir: str
    ptx: str
    shared: int  # bytes of shared memory the compiler allocated

    def count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.ptx))

    def setmaxnreg(self) -> list[int]:
        """Every ``setmaxnreg`` target in the PTX (increase and decrease)."""
        return [int(x) for x in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", self.ptx)]


def _signature(fn, consts: dict, dtype: str) -> dict:
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in ("Q", "K", "V", "DO", "DQ", "DK", "DV"):
            sig[a] = f"*{dtype}"
        elif a == "Out":
            sig[a] = f"*{dtype}" if consts.get("STORE_TMA", True) else "*fp32"
        elif a in ("Lse", "Delta", "DQA"):
            sig[a] = "*fp32"
        elif a.isupper():
            sig[a] = "*i32"  # plan tables
        elif a in ("qk_scale", "softmax_scale"):
            sig[a] = "fp32"
        else:
            sig[a] = "i32"
    return sig


def _compile(fn, consts: dict, dtype: str, maxnreg: int) -> Compiled:
    os.environ.setdefault("TRITON_INTERPRET", "0")
    if os.environ["TRITON_INTERPRET"] == "1":
        raise RuntimeError("compiling for sm_90a needs TRITON_INTERPRET unset (run it in a subprocess)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    src = GluonASTSource(fn, _signature(fn, consts, dtype), consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": maxnreg})
    return Compiled(ttgir=k.asm["ttgir"], ptx=k.asm["ptx"], shared=int(k.metadata.shared))


def compile_fwd(head_dim: int = 128, cfg: dict | None = None, *, num_iv: int = 2,
                has_partial: bool = True, store_tma: bool = True, dtype: str = "bf16",
                head_dim_v: int | None = None, merge: bool = False, mask_head: int = 0) -> Compiled:
    """Compile the forward kernel for sm_90a with launch config ``cfg`` (``attention.CONFIG_KEYS``)
    at D_qk = ``head_dim`` and D_v = ``head_dim_v`` (default D_qk). ``store_tma`` as the launcher
    sets it: only where O's tiles fit in Q's buffers (``attention_fwd.o_fits_q``: ``BLOCK_DV <=
    BLOCK_DQK``, piece by piece with ``split_d``)."""
    import torch

    from longca_triton.kernels.core.runtime import head_dim_meta
    from longca_triton.kernels.gluon.op import _regs, resolve_config
    from longca_triton.kernels.gluon.fwd import gluon_fwd_kernel, o_fits_q

    dv = head_dim if head_dim_v is None else head_dim_v
    c = resolve_config(head_dim, torch.bfloat16, cfg, head_dim_v=dv)
    producer, maxnreg = _regs(c["consumer_regs"], c["consumers"])
    dims = head_dim_meta(head_dim, dv)
    o_own = store_tma and c["o_own"]
    o_in_p = store_tma and c["o_in_p"]
    store_tma = store_tma and (o_own or o_in_p or o_fits_q(head_dim, dv, dims["BLOCK_DQK"], dims["BLOCK_DV"], c["split_d"]))
    consts = dict(**dims, BLOCK_N=c["BLOCK_N"], NUM_IV=num_iv, NUM_STAGES=c["num_stages"],
                  HAS_PARTIAL_TILES=has_partial, PINGPONG=c["pingpong"], STORE_TMA=store_tma,
                  CONSUMER_REGS=c["consumer_regs"], PRODUCER_REGS=producer, SPLIT_D=c["split_d"],
                  CONSUMERS=c["consumers"], P_SMEM=c["p_smem"], O_OWN=o_own,
                  PERSISTENT=c["persistent"], O_IN_P=o_in_p, SNAKE=c["snake"],
                  POLY_EXP=c["poly_exp"], MERGE=merge, MASK_HEAD=int(mask_head),
                  ROWSUM_MMA=c["rowsum_mma"], PV_SYNC=c["pv_sync"])
    return _compile(gluon_fwd_kernel, consts, dtype, maxnreg)


def compile_bwd(kind: str, head_dim: int = 128, cfg: dict | None = None, *, num_iv: int = 2,
                has_partial: bool = True, dtype: str = "bf16", mask_head: int = 0) -> Compiled:
    """Compile the backward's ``"dq"``, ``"dkdv"`` or ``"fused"`` kernel for sm_90a
    (``attention.CONFIG_KEYS``; the fused one reads the ``fused_*`` keys)."""
    import torch

    from longca_triton.kernels.gluon.op import _regs, fused_split_d, resolve_config
    from longca_triton.kernels.gluon.bwd import gluon_bwd_dkdv_kernel, gluon_bwd_dq_kernel
    from longca_triton.kernels.gluon.bwd_fused import gluon_bwd_fused_kernel

    c = resolve_config(head_dim, torch.bfloat16, cfg)
    producer, maxnreg = _regs(c["bwd_consumer_regs"])
    common = dict(HEAD_DIM=head_dim, NUM_IV=num_iv, HAS_PARTIAL_TILES=has_partial,
                  CONSUMER_REGS=c["bwd_consumer_regs"], PRODUCER_REGS=producer)
    if kind == "dq":
        return _compile(gluon_bwd_dq_kernel, dict(common, BLOCK_N=c["dq_block_n"], NUM_STAGES=c["dq_stages"],
                                                  MASK_HEAD=int(mask_head)),
                        dtype, maxnreg)
    if kind == "dkdv":
        return _compile(gluon_bwd_dkdv_kernel, dict(common, BLOCK_MQ=c["dkdv_block_mq"], NUM_STAGES=c["dkdv_stages"],
                                                        SKEW=c["dkdv_skew"]),
                        dtype, maxnreg)
    if kind == "fused":
        return _compile(gluon_bwd_fused_kernel, dict(common, BLOCK_MQ=c["fused_block_mq"],
                                                     NUM_STAGES=c["fused_stages"],
                                                     DQ_SPLIT_D=fused_split_d(head_dim)),
                        dtype, maxnreg)
    raise ValueError(f"kind must be 'dq', 'dkdv' or 'fused', got {kind!r}")


#: per kernel, the config keys of its tile and of its ring (what --tile / --stages set)
_KNOBS = {"fwd": ("BLOCK_N", "num_stages"), "dq": ("dq_block_n", "dq_stages"),
          "dkdv": ("dkdv_block_mq", "dkdv_stages"), "fused": ("fused_block_mq", "fused_stages")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=tuple(_KNOBS), default="fwd")
    ap.add_argument("--head-dim", type=int, default=128, help="D_qk (and D_v unless --head-dim-v)")
    ap.add_argument("--head-dim-v", type=int, default=None, help="D_v when it differs (forward only)")
    ap.add_argument("--tile", type=int, default=None,
                    help="the kernel's tile key: BLOCK_N (fwd), dq_block_n, dkdv_block_mq, fused_block_mq")
    ap.add_argument("--stages", type=int, default=None, help="the kernel's ring depth")
    ap.add_argument("--pingpong", action=argparse.BooleanOptionalAction, default=None, help="forward only")
    ap.add_argument("--split-d", action=argparse.BooleanOptionalAction, default=None,
                    help="forward only: a non-power-of-two head dim as two exact pieces (config split_d)")
    ap.add_argument("--dump", help="write <DUMP>.ttgir and <DUMP>.ptx")
    a = ap.parse_args(argv)
    tile_key, stages_key = _KNOBS[a.kernel]
    cfg = {k: v for k, v in ((tile_key, a.tile), (stages_key, a.stages), ("pingpong", a.pingpong),
                             ("split_d", a.split_d)) if v is not None}
    if a.kernel == "fwd":
        c = compile_fwd(a.head_dim, cfg or None, head_dim_v=a.head_dim_v)
    else:
        c = compile_bwd(a.kernel, a.head_dim, cfg or None)
    info = ptxas_info(c.ptx)
    import torch

    from longca_triton.kernels.gluon.op import resolve_config

    r = resolve_config(a.head_dim, torch.bfloat16, cfg or None, head_dim_v=a.head_dim_v)
    print(f"{a.kernel} D={a.head_dim}" + (f"/{a.head_dim_v}" if a.head_dim_v else "")
          + f" {tile_key}={r[tile_key]} {stages_key}={r[stages_key]}"
          + (" split_d" if a.kernel == "fwd" and r["split_d"] else "") + ": "
          f"shared {c.shared} B, setmaxnreg {sorted(set(c.setmaxnreg()))}, "
          f"wgmma {c.count('wgmma.mma_async')}, wait_group {c.count('wgmma.wait_group')}, "
          f"registers {info['registers']}, "
          f"spills {info['spill_stores']}/{info['spill_loads']} B")
    if a.dump:
        for ext, text in (("ttgir", c.ttgir), ("ptx", c.ptx)):
            with open(f"{a.dump}.{ext}", "w") as f:
                f.write(text)


if __name__ == "__main__":
    main()

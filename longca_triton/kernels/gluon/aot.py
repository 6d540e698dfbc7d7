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
    """Compile the forward kernel for sm_90a with launch config ``cfg`` (``config.CONFIG_KEYS``)
    at D_qk = ``head_dim`` and D_v = ``head_dim_v`` (default D_qk). ``store_tma`` as the launcher
    sets it: only where O's tiles fit in Q's buffers (``fwd_parts.o_fits_q``) or in its own."""
    import torch

    from longca_triton.kernels.core.runtime import head_dim_meta
    from longca_triton.kernels.gluon.config import consumer_regs, regs, resolve_config
    from longca_triton.kernels.gluon.fwd import gluon_fwd_kernel
    from longca_triton.kernels.gluon.fwd_parts import o_fits_q

    dv = head_dim if head_dim_v is None else head_dim_v
    c = resolve_config(head_dim, torch.bfloat16, cfg, head_dim_v=dv)
    cregs = consumer_regs(c["consumers"])
    producer, maxnreg = regs(cregs, c["consumers"])
    dims = head_dim_meta(head_dim, dv)
    o_own = store_tma and c["o_own"]
    store_tma = store_tma and (o_own or o_fits_q(head_dim, dv, dims["BLOCK_DQK"], dims["BLOCK_DV"], c["split_d"]))
    consts = dict(**dims, BLOCK_N=c["BLOCK_N"], NUM_IV=num_iv, NUM_STAGES=c["num_stages"],
                  HAS_PARTIAL_TILES=has_partial, PINGPONG=c["pingpong"], STORE_TMA=store_tma,
                  CONSUMER_REGS=cregs, PRODUCER_REGS=producer, SPLIT_D=c["split_d"],
                  CONSUMERS=c["consumers"], P_SMEM=c["p_smem"], O_OWN=o_own,
                  PERSISTENT=c["persistent"], SNAKE=c["persistent"], MERGE=merge, MASK_HEAD=int(mask_head),
                  ROWSUM_MMA=c["rowsum_mma"], PV_SYNC=c["pv_sync"])
    return _compile(gluon_fwd_kernel, consts, dtype, maxnreg)


def compile_bwd(kind: str, head_dim: int = 128, cfg: dict | None = None, *, num_iv: int = 2,
                has_partial: bool = True, dtype: str = "bf16", mask_head: int = 0) -> Compiled:
    """Compile the backward's ``"dq"`` or ``"dkdv"`` kernel for sm_90a (``config.bwd_tiles``, and
    ``cfg``'s ``dkdv_block_mq``)."""
    import torch

    from longca_triton.kernels.gluon.bwd import gluon_bwd_dkdv_kernel, gluon_bwd_dq_kernel
    from longca_triton.kernels.gluon.config import bwd_tiles, regs, resolve_config

    c = resolve_config(head_dim, torch.bfloat16, cfg)
    t = bwd_tiles(head_dim)
    producer, maxnreg = regs(t["bwd_consumer_regs"])
    common = dict(HEAD_DIM=head_dim, NUM_IV=num_iv, HAS_PARTIAL_TILES=has_partial,
                  CONSUMER_REGS=t["bwd_consumer_regs"], PRODUCER_REGS=producer)
    if kind == "dq":
        return _compile(gluon_bwd_dq_kernel, dict(common, BLOCK_N=t["dq_block_n"], NUM_STAGES=t["dq_stages"],
                                                  MASK_HEAD=int(mask_head)), dtype, maxnreg)
    if kind == "dkdv":
        return _compile(gluon_bwd_dkdv_kernel, dict(common, BLOCK_MQ=c["dkdv_block_mq"], NUM_STAGES=t["dkdv_stages"]),
                        dtype, maxnreg)
    raise ValueError(f"kind must be 'dq' or 'dkdv', got {kind!r}")


#: per kernel, the config keys of its tile and of its ring (what --tile / --stages set)
_KNOBS = {"fwd": ("BLOCK_N", "num_stages"), "dkdv": ("dkdv_block_mq", None), "dq": (None, None)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=tuple(_KNOBS), default="fwd")
    ap.add_argument("--head-dim", type=int, default=128, help="D_qk (and D_v unless --head-dim-v)")
    ap.add_argument("--head-dim-v", type=int, default=None, help="D_v when it differs (forward only)")
    ap.add_argument("--tile", type=int, default=None, help="the kernel's tile key: BLOCK_N (fwd), dkdv_block_mq")
    ap.add_argument("--stages", type=int, default=None, help="the forward's ring depth")
    ap.add_argument("--pingpong", action=argparse.BooleanOptionalAction, default=None, help="forward only")
    ap.add_argument("--split-d", action=argparse.BooleanOptionalAction, default=None,
                    help="forward only: a non-power-of-two head dim as two exact pieces (config split_d)")
    ap.add_argument("--dump", help="write <DUMP>.ttgir and <DUMP>.ptx")
    a = ap.parse_args(argv)
    tile_key, stages_key = _KNOBS[a.kernel]
    cfg = {k: v for k, v in ((tile_key, a.tile), (stages_key, a.stages), ("pingpong", a.pingpong),
                             ("split_d", a.split_d)) if v is not None and k is not None}
    if a.kernel == "fwd":
        c = compile_fwd(a.head_dim, cfg or None, head_dim_v=a.head_dim_v)
    else:
        c = compile_bwd(a.kernel, a.head_dim, cfg or None)
    info = ptxas_info(c.ptx)
    import torch

    from longca_triton.kernels.gluon.config import bwd_tiles, resolve_config

    r = dict(resolve_config(a.head_dim, torch.bfloat16, cfg or None, head_dim_v=a.head_dim_v), **bwd_tiles(a.head_dim))
    tile_key = tile_key or "dq_block_n"
    stages_key = stages_key or f"{a.kernel}_stages"
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

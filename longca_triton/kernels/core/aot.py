"""Ahead-of-time compilation of our plain ``@triton.jit`` kernels for sm_90a, on any machine.

The launches are the real ones: a launcher (``dense.dense_fwd``, ``dense.dense_bwd``, ...) runs on
CPU tensors of the real shapes with its kernels swapped for recorders (:func:`recorded_launches`),
so every constexpr, ``num_warps`` / ``num_stages`` and argument specialisation (an int equal to 1
becomes a constant, pointers and ints divisible by 16 get ``tt.divisibility``) is what the
launcher would hand Triton on a GPU. Each recorded launch is then compiled with
``triton.compile(..., target=GPUTarget("cuda", 90, 32))`` and its PTX fed to the bundled ``ptxas
-v`` (:func:`ptxas_info`): registers, spill bytes, shared memory, and the occupancy that follows.

Needs ``TRITON_INTERPRET`` unset or ``0`` in the compiling process (the interpreter replaces
``triton.compile``'s front end); run it in a subprocess from tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile

__all__ = ["Launch", "AotResult", "recorded_launches", "specialize", "compile_launch", "ptxas_info", "occupancy",
           "H100_SMEM_PER_SM", "H100_SMEM_PER_BLOCK", "ptxas_log_info"]

#: Hopper per-SM limits (CUDA occupancy calculator, cc 9.0)
H100_REGS_PER_SM = 65536
H100_SMEM_PER_SM = 233472  # 228 KiB
H100_SMEM_PER_BLOCK = 232448  # 227 KiB opt-in maximum for one block
_SMEM_RESERVED_PER_BLOCK = 1024
_MAX_WARPS_PER_SM = 64
_MAX_BLOCKS_PER_SM = 32


@dataclasses.dataclass
class Launch:
    """One recorded kernel launch: the jit function, its bound arguments and launch options."""

    kernel: object  # triton JITFunction
    grid: tuple
    args: dict  # argument name -> value (tensors, ints, floats, constexprs)
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


class _Recorder:
    def __init__(self, kernel, sink: list):
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid):
        def launch(*args, num_warps=4, num_stages=3, **kwargs):
            bound = self.kernel.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            self.sink.append(Launch(self.kernel, tuple(grid) if not callable(grid) else grid, dict(bound.arguments),
                                    int(num_warps), int(num_stages)))
        return launch


@contextlib.contextmanager
def recorded_launches(module, names: tuple):
    """Inside the block, ``module.<name>[grid](...)`` records a :class:`Launch` into the yielded list
    instead of launching (for each of ``names``, the module's kernel globals)."""
    sink: list[Launch] = []
    saved = {n: getattr(module, n) for n in names}
    try:
        for n, k in saved.items():
            setattr(module, n, _Recorder(k, sink))
        yield sink
    finally:
        for n, k in saved.items():
            setattr(module, n, k)


def specialize(launch: Launch):
    """``(signature, constexprs, attrs)`` as ``JITFunction.run`` would build them for these values."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(launch.kernel.params):
        val = launch.args[p.name]
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[(i,)] = val
            continue
        ty, key = native_specialize_impl(BaseBackend, val, p.is_const, not p.do_not_specialize,
                                         not p.do_not_specialize_on_alignment)
        signature[p.name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = key
        elif isinstance(key, str):
            attrs[(i,)] = BaseBackend.parse_attr(key)
    return signature, constexprs, attrs


@dataclasses.dataclass
class AotResult:
    name: str
    num_warps: int
    num_stages: int
    registers: int
    spill_stores: int
    spill_loads: int
    shared: int  # bytes of shared memory the compiler allocated (per block)
    wgmma: int  # wgmma.mma_async instructions in the PTX
    constexprs: dict

    @property
    def spills(self) -> int:
        return max(self.spill_stores, 0) + max(self.spill_loads, 0)

    @property
    def blocks_per_sm(self) -> int:
        return occupancy(self.registers, self.num_warps, self.shared)


def compile_launch(launch: Launch, arch: int = 90) -> AotResult:
    """Compile one recorded launch for ``sm_<arch>a`` and read ``ptxas -v``."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compiling for sm_90a needs TRITON_INTERPRET unset or 0 (run it in a subprocess)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, consts, attrs = specialize(launch)
    k = triton.compile(ASTSource(launch.kernel, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    ptx = k.asm["ptx"]
    info = ptxas_info(ptx, arch)
    names = [p.name for p in launch.kernel.params if p.is_constexpr]
    return AotResult(name=launch.name, num_warps=launch.num_warps, num_stages=launch.num_stages,
                     registers=info["registers"], spill_stores=info["spill_stores"], spill_loads=info["spill_loads"],
                     shared=int(k.metadata.shared), wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                     constexprs={n: launch.args[n] for n in names})


def ptxas_info(ptx: str, arch: int = 90) -> dict:
    """``ptxas -v`` on ``ptx`` for ``sm_<arch>a``: ``{"registers", "spill_stores", "spill_loads"}``
    (-1 where ptxas printed nothing)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True)
    return ptxas_log_info(res.stderr + res.stdout)


def ptxas_log_info(log: str) -> dict:
    """``ptxas -v`` output read: ``{"registers", "spill_stores", "spill_loads"}`` (-1 where absent)."""
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"registers": int(regs.group(1)) if regs else -1,
            "spill_stores": int(spill.group(1)) if spill else -1,
            "spill_loads": int(spill.group(2)) if spill else -1}


def occupancy(registers: int, num_warps: int, shared: int) -> int:
    """Blocks per SM on an H100 (registers per warp rounded up to 256, 1 KiB reserved shared memory
    per block); 0 when one block does not fit."""
    if registers <= 0 or shared > H100_SMEM_PER_BLOCK:
        return 0
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_regs = H100_REGS_PER_SM // (regs_per_warp * num_warps)
    by_smem = H100_SMEM_PER_SM // (shared + _SMEM_RESERVED_PER_BLOCK)
    by_warps = _MAX_WARPS_PER_SM // num_warps
    return max(0, min(by_regs, by_smem, by_warps, _MAX_BLOCKS_PER_SM))

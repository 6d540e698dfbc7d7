"""Do the softmax's bf16 packs share the XU with its exponentials? (issue 17, session 25: the two consumer
warpgroups' softmaxes at D = 96 do not overlap each other, with the XU at ~44 % by Nsight Compute's count of MUFU
instructions; a D = 96 step converts 64 probabilities a thread to bf16 by 32 ``cvt.rn.bf16x2.f32``, i.e. ``F2FP``.)

One CTA an SM, ``WARPS`` warps, ``ILP`` independent pairs ``(a, b)`` a thread, ``ITERS`` rounds of one of:

* ``exp``:  ``a, b <- exp2(a) - 1, exp2(b) - 1``                        (2 MUFU.EX2, 2 FADD)
* ``pack``: ``p = cvt.rn.bf16x2.f32(b, a)``; ``a, b <- lo(p), hi(p)`` scaled (1 F2FP, 2 integer ops, 2 FFMA)
* ``ctrl``: ``pack`` with the conversion replaced by integer ops on the bits (no F2FP)
* ``both``: ``exp`` then ``pack``

Prints operations per SM per clock (NVML's clock after the run). If ``both`` takes about ``exp`` plus ``pack`` less
``ctrl``'s arithmetic, the packs queue on the exponentials' unit; if about ``exp`` alone, they do not.

    python experiments/gpu/pack_rate.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mufu_rate import _sm_clock_mhz


@triton.jit
def _pack(a, b, CONVERT: tl.constexpr):
    if CONVERT:
        p = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", [b, a], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:
        # the same integer work without the conversion: a's high half into the low half, b's high half kept
        p = ((a.to(tl.int32, bitcast=True) >> 16) & 0xFFFF) | (b.to(tl.int32, bitcast=True) & -65536)
    lo = (p << 16).to(tl.float32, bitcast=True)
    hi = (p & -65536).to(tl.float32, bitcast=True)
    return lo * 0.5 - 0.25, hi * 0.5 - 0.25


@triton.jit
def rate_kernel(A, B, ITERS: tl.constexpr, ILP: tl.constexpr, WARPS: tl.constexpr, EXP: tl.constexpr,
                PACK: tl.constexpr, CONVERT: tl.constexpr):
    offs = tl.program_id(0) * (32 * WARPS * ILP) + tl.arange(0, 32 * WARPS * ILP)
    a = tl.load(A + offs)
    b = tl.load(B + offs)
    for _ in range(ITERS):
        if EXP:
            a = tl.math.exp2(a) - 1.0
            b = tl.math.exp2(b) - 1.0
        if PACK:
            a, b = _pack(a, b, CONVERT)
    tl.store(A + offs, a)
    tl.store(B + offs, b)


MODES = {"exp": (True, False, False), "pack": (False, True, True), "ctrl": (False, True, False),
         "both": (True, True, True)}


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    iters, ilp = 2048, 8
    print(torch.cuda.get_device_name(0), "triton", triton.__version__)
    for warps in (4, 8):
        n = sms * 32 * warps * ilp
        for mode, (e, p, c) in MODES.items():
            a = -torch.rand(n, device="cuda") * 0.5
            b = -torch.rand(n, device="cuda") * 0.5
            kw = dict(ITERS=iters, ILP=ilp, WARPS=warps, EXP=e, PACK=p, CONVERT=c, num_warps=warps)
            rate_kernel[(sms,)](a, b, **kw)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                rate_kernel[(sms,)](a, b, **kw)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / 5
            clk = _sm_clock_mhz() or 0
            pairs_per_clk = 32 * warps * ilp * iters / (ms * 1e6) / (clk / 1e3) if clk else float("nan")
            print(f"warps {warps:2d} {mode:4s}: {ms:.3f} ms, {pairs_per_clk:.2f} pairs a clock an SM at {clk} MHz "
                  f"({1 / pairs_per_clk:.3f} clocks a pair)", flush=True)


if __name__ == "__main__":
    main()

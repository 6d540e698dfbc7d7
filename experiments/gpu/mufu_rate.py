"""How fast can one warp run exponentials on an H100? (issue 17: a consumer warpgroup's softmax runs at under half
the XU's rate: session 24, call 6.)

Each warp keeps ``ILP`` independent values a thread and applies ``x <- exp2(x) - 1`` ``ITERS`` times (one
``MUFU.EX2`` and one ``FADD`` an element; values stay in [-1, 0]), on one CTA per SM with 4, 8 or 16 warps (warp w
runs on scheduler w % 4, so 4 warps put one warp on each scheduler, 8 put two). Prints exponentials per SM per
nanosecond and per clock at the clock NVML reads after the run: if one warp a scheduler reaches the rate two do,
a single warp can keep the XU busy.

    python experiments/gpu/mufu_rate.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def mufu_kernel(X, ITERS: tl.constexpr, ILP: tl.constexpr, WARPS: tl.constexpr):
    offs = tl.program_id(0) * (32 * WARPS * ILP) + tl.arange(0, 32 * WARPS * ILP)
    x = tl.load(X + offs)
    for _ in range(ITERS):
        x = tl.math.exp2(x) - 1.0
    tl.store(X + offs, x)


def _sm_clock_mhz():
    """The SM clock NVML reads now (None without NVML)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetClockInfo(pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.NVML_CLOCK_SM)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001
        return None


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    iters = 4096
    for ilp in (8, 16):
        for warps in (4, 8, 16):
            x = -torch.rand(sms * 32 * warps * ilp, device="cuda") * 0.5
            mufu_kernel[(sms,)](x, ITERS=iters, ILP=ilp, WARPS=warps, num_warps=warps)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                mufu_kernel[(sms,)](x, ITERS=iters, ILP=ilp, WARPS=warps, num_warps=warps)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / 5
            clk = _sm_clock_mhz()
            per_sm_ns = 32 * warps * ilp * iters / (ms * 1e6)
            print(f"ILP {ilp:2d} warps {warps:2d} (a scheduler {warps // 4}): {ms:.3f} ms, "
                  f"{per_sm_ns:.2f} exp a ns an SM" + (f", {per_sm_ns / clk * 1e3:.2f} a clock at {clk} MHz" if clk else ""),
                  flush=True)


if __name__ == "__main__":
    main()

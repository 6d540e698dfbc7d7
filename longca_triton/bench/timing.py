"""Timing and memory measurement.

``time_fn(fn, warmup_ms, rep, flush_l2=True)``: on CUDA, CUDA events around each call only, with
an L2 flush (writing a 256 MB buffer, more than any current L2) before every repetition, after
``warmup_ms`` of warm-up calls (at least one, which absorbs compilation); returns the median and
the 20th / 80th percentiles in milliseconds. On the CPU the host clock is used and no flush is
done. ``max_ms`` caps the timed repetitions of slow functions (at least ``min_rep`` still run).

Over ranks (context parallelism): ``time_fn(fn, rep=..., warmup_calls=n, ranks=True)`` on every rank
of a ``torch.distributed`` group (``ranks`` = the group, or True for the default one): ``n`` warm-up
calls (0: the caller warmed up), a barrier before every repetition, each repetition timed alone (CUDA events or the host
clock) and counted as its slowest rank (max all-reduce); ``rank_median_ms`` is this rank's own.
``warmup_calls`` without ``ranks``: the same on one device (fixed warm-up, each call timed alone).

``peak_memory(fn)``: peak bytes allocated during one call, absolute and above what was allocated
before it (``torch.cuda.reset_peak_memory_stats`` then ``max_memory_allocated``).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

__all__ = ["L2_FLUSH_BYTES", "barrier", "peak_memory", "time_fn"]

L2_FLUSH_BYTES = 256 * 2**20


def _summary(samples: list[float]) -> dict:
    a = np.asarray(samples, dtype=np.float64)
    return {
        "median_ms": float(np.median(a)),
        "p20_ms": float(np.percentile(a, 20)),
        "p80_ms": float(np.percentile(a, 80)),
        "min_ms": float(a.min()),
        "reps": int(a.size),
    }


def time_fn(
    fn: Callable[[], object],
    warmup_ms: float = 25.0,
    rep: int = 20,
    flush_l2: bool = True,
    *,
    max_ms: float | None = None,
    min_rep: int = 3,
    device: str | torch.device | None = None,
    warmup_calls: int | None = None,
    ranks=None,
) -> dict:
    """Median / p20 / p80 milliseconds of ``fn()`` (see module doc). ``rep`` >= 1."""
    if rep < 1:
        raise ValueError(f"rep must be >= 1, got {rep}")
    dev = torch.device(device) if device is not None else (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if ranks is not None and ranks is not False:
        if warmup_calls is None or max_ms is not None:
            raise ValueError("timing over ranks needs warmup_calls (a count every rank agrees on) and no max_ms")
        return _time_each(fn, warmup_calls, rep, flush_l2, dev, True, None if ranks is True else ranks)
    if warmup_calls is not None:  # a fixed warm-up count, each repetition timed alone
        if max_ms is not None:
            raise ValueError("warmup_calls and max_ms do not go together")
        return _time_each(fn, warmup_calls, rep, flush_l2, dev, False, None)
    if dev.type != "cuda":
        return _time_host(fn, warmup_ms, rep, max_ms, min_rep)

    sync = torch.cuda.synchronize
    # first call: compilation / autotuning / lazy init, never timed
    fn()
    sync()
    # estimate one call
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    sync()
    est = max(s.elapsed_time(e), 1e-3)
    n_warm = max(1, int(warmup_ms / est))
    for _ in range(n_warm):
        fn()
    n_rep = rep
    if max_ms is not None:
        n_rep = max(min(rep, min_rep), min(rep, int(max_ms / est)))
    buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=dev) if flush_l2 else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    sync()
    for i in range(n_rep):
        if buf is not None:
            buf.fill_(i & 0xFF)  # write the whole buffer: evicts the inputs from L2
        starts[i].record()
        fn()
        ends[i].record()
    sync()
    del buf
    return _summary([a.elapsed_time(b) for a, b in zip(starts, ends)])


def barrier(device: torch.device, group=None) -> None:
    """``torch.distributed`` barrier (on the device's stream with NCCL)."""
    import torch.distributed as dist

    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index if device.index is not None else torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


def _time_each(fn, warmup_calls, rep, flush_l2, dev, reduce, group) -> dict:
    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    for _ in range(warmup_calls):  # 0: the caller warmed up
        fn()
    sync()
    buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=dev) if (flush_l2 and cuda) else None
    times = []
    for i in range(rep):
        if reduce:
            barrier(dev, group)
        if buf is not None:
            buf.fill_(i & 0xFF)
        sync()
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            sync()
            times.append(s.elapsed_time(e))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    del buf
    if not reduce:
        return _summary(times)
    import torch.distributed as dist

    t = torch.tensor(times, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    out = _summary(t.cpu().tolist())
    out["rank_median_ms"] = float(np.median(np.asarray(times)))
    return out


def _time_host(fn, warmup_ms, rep, max_ms, min_rep) -> dict:
    t0 = time.perf_counter()
    fn()
    est = (time.perf_counter() - t0) * 1e3
    t_end = time.perf_counter() + warmup_ms / 1e3
    while time.perf_counter() < t_end:
        fn()
    n_rep = rep
    if max_ms is not None:
        n_rep = max(min(rep, min_rep), min(rep, int(max_ms / max(est, 1e-3))))
    samples = []
    for _ in range(n_rep):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e3)
    return _summary(samples)


def peak_memory(fn: Callable[[], object], device=None) -> dict:
    """``{"peak_bytes", "above_bytes", "base_bytes"}`` of one ``fn()`` call (CUDA), else Nones."""
    dev = torch.device(device) if device is not None else (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if dev.type != "cuda":  # no allocator statistics on the host: nothing to measure, nothing run
        return {"peak_bytes": None, "above_bytes": None, "base_bytes": None}
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    res = fn()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    del res
    return {"peak_bytes": int(peak), "above_bytes": int(peak - base), "base_bytes": int(base)}

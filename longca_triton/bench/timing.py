"""Timing and memory measurement.

``time_fn(fn, warmup_ms, rep, flush_l2=True)``: on CUDA, CUDA events around each call only, with
an L2 flush (writing a 256 MB buffer, more than any current L2) before every repetition, after
a first call (compilation, never timed), one estimating call and ``warmup_ms`` of warm-up calls
(none for a call that alone lasts that long), each start event behind a
GPU sleep longer than the host's cost of issuing the call (the events time the GPU's work, not a
Python launcher the GPU waits for); returns the median and
the 20th / 80th percentiles in milliseconds. On the CPU the host clock is used and no flush is
done. ``max_ms`` caps the timed repetitions of slow functions (at least ``min_rep`` still run).

Over ranks (context parallelism): ``time_fn(fn, rep=..., warmup_calls=n, ranks=True)`` on every rank
of a ``torch.distributed`` group (``ranks`` = the group, or True for the default one): ``n`` warm-up
calls (0: the caller warmed up), a barrier before every repetition, each repetition timed alone (CUDA events or the host
clock) and counted as its slowest rank (max all-reduce); ``rank_median_ms`` is this rank's own.
``warmup_calls`` without ``ranks``: the same on one device (fixed warm-up, each call timed alone).

``time_interleaved(fns, warmup_ms, rep, ...)``: several functions (the backends of one problem)
timed together, repetition by repetition: round ``r`` times each function once (L2 flush before
each) in an order drawn afresh for the round (a fixed seed), so every backend sees the same stretch of
the GPU's clock and power state and none always follows the same one (a kernel run right after a
power-hungry one starts on a lower clock: with a fixed rotation two runs of the same kernel read 4-8 %
apart at 64K). Why: under an attention backward's load an H100 draws 600-700 W and its SM clock
moves between 1470 and 1980 MHz; timing all of A's repetitions and then all of B's measured the
same kernels up to 7-9 % apart, more than several of the ratios a comparison judges. Each function keeps its own repetition count (``max_ms``
caps slow ones); a function with fewer repetitions drops out of the later rounds.

``ClockSampler(device)``: a context manager sampling the GPU's SM clock and power draw every
``period_s`` in a background thread while the timed repetitions run (NVML through ``pynvml`` where
it is installed, else ``nvidia-smi``; nothing on a CPU or without either); ``summary()`` gives the
median / min / max SM clock in MHz and the median power in W, which the sweep stores per point.

``peak_memory(fn)``: peak bytes allocated during one call, absolute and above what was allocated
before it (``torch.cuda.reset_peak_memory_stats`` then ``max_memory_allocated``).
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from typing import Callable, Sequence

import numpy as np
import torch

__all__ = ["L2_FLUSH_BYTES", "ClockSampler", "barrier", "peak_memory", "time_fn", "time_interleaved"]

L2_FLUSH_BYTES = 256 * 2**20
#: clock the head start's sleep is sized at (Hopper's top boost; at a lower clock it only lasts longer)
_SLEEP_HZ = 2.0e9
_MAX_HEAD_START_S = 0.02


def _host_ms(fn) -> float:
    """Milliseconds the host spends issuing one call (no synchronisation: the launches only queue)."""
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def warm_up_calls(est_ms: float, warmup_ms: float) -> int:
    """Warm-up calls after the first (compiling) call and the estimating one: ``warmup_ms`` worth,
    none for a call that alone lasts that long (the two calls before it warmed it up)."""
    return int(warmup_ms / max(est_ms, 1e-3))


def warm_up(fn, est_ms: float, warmup_ms: float, est_host_ms: float = 0.0) -> float:
    """Run ``fn``'s warm-up calls (``warm_up_calls``) and return the host's cost of issuing one
    call: the most of the estimating call's and the first three warm-up calls' (the launches only
    queue, so this is the launcher's Python time; reading it from the warm-up calls costs no extra
    GPU work)."""
    host = est_host_ms
    for i in range(warm_up_calls(est_ms, warmup_ms)):
        h = _host_ms(fn)
        if i < 3:
            host = max(host, h)
    return host


def _head_start(host_ms: float) -> None:
    """Queue a GPU sleep longer than the host's cost of issuing the next call, so the call's kernels
    are queued before the GPU reaches its start event: the events then time the GPU's work alone,
    not the GPU waiting for a Python launcher (at 4K a launcher's host cost is of the order of the
    kernel; without this the measured time depends on which call ran before)."""
    torch.cuda._sleep(int(min(1.5 * host_ms * 1e-3 + 50e-6, _MAX_HEAD_START_S) * _SLEEP_HZ))


def _summary(samples: list[float]) -> dict:
    a = np.asarray(samples, dtype=np.float64)
    return {
        "median_ms": float(np.median(a)),
        "p20_ms": float(np.percentile(a, 20)),
        "p80_ms": float(np.percentile(a, 80)),
        "min_ms": float(a.min()),
        "reps": int(a.size),
    }


def _device(device) -> torch.device:
    """The given device, else CUDA where there is one, else the CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


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
    dev = _device(device)
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
    # estimate one call (its host cost too)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    est_host = _host_ms(fn)
    e.record()
    sync()
    est = max(s.elapsed_time(e), 1e-3)
    host = warm_up(fn, est, warmup_ms, est_host)
    n_rep = _rep_count(rep, min_rep, max_ms, est)
    buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=dev) if flush_l2 else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    sync()
    for i in range(n_rep):
        if buf is not None:
            buf.fill_(i & 0xFF)  # write the whole buffer: evicts the inputs from L2
        _head_start(host)
        starts[i].record()
        fn()
        ends[i].record()
    sync()
    del buf
    return _summary([a.elapsed_time(b) for a, b in zip(starts, ends)])


def _rep_count(rep: int, min_rep: int, max_ms: float | None, est: float) -> int:
    if max_ms is None:
        return rep
    return max(min(rep, min_rep), min(rep, int(max_ms / est)))


def time_interleaved(fns: Sequence[Callable[[], object]], warmup_ms: float = 25.0, rep: int = 20, flush_l2: bool = True,
                     *, max_ms: float | None = None, min_rep: int = 3,
                     device: str | torch.device | None = None) -> list[dict]:
    """``time_fn``'s summary for each of ``fns``, their repetitions interleaved (module doc).

    Every function is called once first (compilation), then once more to estimate its time; the
    warm-up runs in rounds too (``warmup_ms`` worth of each). The host clock on a CPU."""
    if rep < 1:
        raise ValueError(f"rep must be >= 1, got {rep}")
    if not fns:
        return []
    dev = _device(device)
    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def one(fn) -> float:
        return _one_call_ms(fn, cuda, sync)

    n = len(fns)
    for fn in fns:  # compilation / autotuning / lazy init, never timed
        fn()
    sync()
    est = [max(one(fn), 1e-3) for fn in fns]
    n_warm = [warm_up_calls(x, warmup_ms) for x in est]
    # the host's cost of issuing each call: the most of its first warm-up calls (queued, not waited for)
    host = [0.0] * n
    for r in range(max(n_warm, default=0)):
        for i, fn in enumerate(fns):
            if r < n_warm[i]:
                h = _host_ms(fn)
                if r < 3:
                    host[i] = max(host[i], h)
    for i, fn in enumerate(fns):  # no warm-up call to read it from (a long call): one more, queued
        if cuda and not n_warm[i]:
            host[i] = _host_ms(fn)
    n_rep = [_rep_count(rep, min_rep, max_ms, x) for x in est]
    buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=dev) if (flush_l2 and cuda) else None
    times: list[list[float]] = [[] for _ in fns]
    events = []
    sync()
    order = np.random.default_rng(0)
    for r in range(max(n_rep)):
        for off, i in enumerate(order.permutation(n).tolist()):
            if r >= n_rep[i]:
                continue
            if buf is not None:
                buf.fill_((r * n + off) & 0xFF)  # write the whole buffer: evicts the inputs from L2
            if cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                _head_start(host[i])
                s.record()
                fns[i]()
                e.record()
                events.append((i, s, e))
            else:
                times[i].append(one(fns[i]))
    sync()
    for i, s, e in events:
        times[i].append(s.elapsed_time(e))
    del buf
    return [_summary(t) for t in times]


class ClockSampler:
    """SM clock (MHz) and power (W) of a CUDA device, sampled in a background thread (module doc).

    ``with ClockSampler(dev) as c: ...; c.summary()`` -> ``{"sm_clock_mhz", "sm_clock_min_mhz",
    "sm_clock_max_mhz", "power_w", "power_limit_w", "clock_samples", "clock_source"}``, or ``{}`` when
    nothing could be sampled (a CPU, no NVML and no nvidia-smi, or the run was too short for one
    sample). ``power_limit_w`` is the board's power limit (absent where it cannot be read): a long
    attention kernel on an H100 can draw up to it and run well below the maximum clock (the limit
    is not the only thing that sets the clock)."""

    def __init__(self, device=None, period_s: float = 0.02):
        self.device = torch.device(device) if device is not None else None
        self.period_s = period_s
        self.clock: list[float] = []
        self.power: list[float] = []
        self.power_limit: float | None = None
        self.source: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc = None

    # -- how to read the device: NVML by the device's UUID, else nvidia-smi -i <UUID>
    def _uuid(self) -> str | None:
        try:
            idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
            u = str(torch.cuda.get_device_properties(idx).uuid)
        except Exception:  # noqa: BLE001 - no uuid: no sampling
            return None
        return u if u.startswith("GPU-") else f"GPU-{u}"

    def _nvml_reader(self, uuid: str):
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByUUID(uuid)

            def read():
                return (float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                        pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0)
            read()
            try:
                self.power_limit = pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0
            except Exception:  # noqa: BLE001 - no limit reported: summary() leaves it out
                self.power_limit = None
            return read
        except Exception:  # noqa: BLE001 - NVML present but unusable here
            return None

    def _poll(self, read) -> None:
        while not self._stop.is_set():
            try:
                c, p = read()
            except Exception:  # noqa: BLE001
                return
            self.clock.append(c)
            self.power.append(p)
            self._stop.wait(self.period_s)

    def _smi(self, uuid: str) -> None:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return
        try:
            self._proc = subprocess.Popen(
                [exe, "-i", uuid, "--query-gpu=clocks.sm,power.draw,power.limit",
                 "--format=csv,noheader,nounits",
                 "-lms", str(max(10, int(self.period_s * 1000)))],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return
        self.source = "nvidia-smi"

        def pump():
            for line in self._proc.stdout:
                parts = [x.strip() for x in line.split(",")]
                try:
                    c, p = float(parts[0]), float(parts[1])
                except (ValueError, IndexError):
                    continue
                self.clock.append(c)
                self.power.append(p)
                try:
                    self.power_limit = float(parts[2])
                except (ValueError, IndexError):
                    pass

        self._thread = threading.Thread(target=pump, daemon=True)
        self._thread.start()

    def __enter__(self):
        if self.device is None or self.device.type != "cuda":
            return self
        uuid = self._uuid()
        if uuid is None:
            return self
        read = self._nvml_reader(uuid)
        if read is not None:
            self.source = "nvml"
            self._thread = threading.Thread(target=self._poll, args=(read,), daemon=True)
            self._thread.start()
        else:
            self._smi(uuid)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.source == "nvml" and self._thread is not None:
            self._thread.join(timeout=2)
            try:
                import pynvml

                pynvml.nvmlShutdown()  # balances the nvmlInit of __enter__ (NVML counts them)
            except Exception:  # noqa: BLE001
                pass
            self._thread = None
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:  # pragma: no cover
                self._proc.kill()
        if self._thread is not None:
            self._thread.join(timeout=2)
        return False

    def summary(self) -> dict:
        if not self.clock:
            return {}
        c = np.asarray(self.clock)
        out = {"sm_clock_mhz": float(np.median(c)), "sm_clock_min_mhz": float(c.min()),
               "sm_clock_max_mhz": float(c.max()), "power_w": float(np.median(np.asarray(self.power))),
               "clock_samples": int(c.size), "clock_source": self.source}
        if self.power_limit is not None:
            out["power_limit_w"] = float(self.power_limit)
        return out


def barrier(device: torch.device, group=None) -> None:
    """``torch.distributed`` barrier (on the device's stream with NCCL)."""
    import torch.distributed as dist

    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index if device.index is not None else torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


def _one_call_ms(fn, cuda: bool, sync) -> float:
    """One call of ``fn`` in ms: between two CUDA events on a GPU (then synchronised), by the host clock
    elsewhere."""
    if cuda:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        sync()
        return s.elapsed_time(e)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


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
        times.append(_one_call_ms(fn, cuda, sync))
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
    n_rep = _rep_count(rep, min_rep, max_ms, max(est, 1e-3))
    samples = []
    for _ in range(n_rep):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e3)
    return _summary(samples)


def peak_memory(fn: Callable[[], object], device=None) -> dict:
    """``{"peak_bytes", "above_bytes", "base_bytes"}`` of one ``fn()`` call (CUDA), else Nones."""
    dev = _device(device)
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

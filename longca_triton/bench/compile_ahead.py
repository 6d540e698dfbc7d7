"""Compile a search's candidates ahead, in worker processes, while the GPU times the ones already built.

Why: on a fresh machine most of an autotune run is Triton compiling candidates one after the other
in the timing process while the GPU waits (a Gluon forward takes seconds to build). Worker
processes (not threads: Triton's code generator is Python and would starve the timing thread of
the GIL) each run a candidate's call once with every kernel launch turned into a compile request
(``JITFunction.run(..., warmup=True)``: the kernel is built into Triton's on-disk cache, nothing
runs on the GPU but a few small PyTorch ops). The timing process's own first call of the candidate
then loads the built kernel from that cache. :meth:`CompileAhead.wait` lets the search wait for a
candidate's compile (rather than build it a second time) just before timing it; a candidate whose
compile failed in a worker fails again, with its error, when the search runs it.
:meth:`CompileAhead.close` (the end of the search, the budget, Ctrl-C) drops the compiles not begun.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

__all__ = ["CompileAhead", "default_workers"]


def default_workers() -> int:
    """Compile processes: the host's cores less two (the timing process, the system), 1 to 16
    (each holds a CUDA context, about 0.5 GB of GPU memory, and a Python with torch imported)."""
    return max(1, min(16, (os.cpu_count() or 3) - 2))


class CompileAhead:
    """``with CompileAhead(workers) as ahead: ahead.submit(key, tunable_name, case, config, mode)``;
    before timing that candidate, ``ahead.wait(key)`` (module doc). ``workers=0``: nothing is compiled
    ahead (``submit`` and ``wait`` do nothing), the search compiles as it goes."""

    def __init__(self, workers: int | None = None):
        self.workers = default_workers() if workers is None else int(workers)
        self.submitted = 0
        self.failed: list[str] = []  # compiles that failed or could not be handed to a worker
        self._pool: ProcessPoolExecutor | None = None
        self._futures: dict = {}

    def __enter__(self) -> "CompileAhead":
        if self.workers > 0:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_compile_only_worker)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, key, tunable: str, case, config: dict, mode: str, device: str = "cuda") -> None:
        """Build the kernels of ``tunable``'s call of ``config`` on ``case`` (``mode`` fwd: the forward;
        bwd: forward and backward) on ``device`` in a worker; ``key`` names it for :meth:`wait`."""
        if self._pool is None or key in self._futures:
            return
        try:
            self._futures[key] = self._pool.submit(_compile_job, tunable, _portable(case), dict(config), mode,
                                                 str(device))
            self.submitted += 1
        except Exception as e:  # a broken pool (a worker died): the search compiles as it goes
            self.failed.append(f"{key}: {type(e).__name__}: {e}")
            self.close()

    def wait(self, key, timeout: float = 300.0) -> None:
        """Until the compile named ``key`` (if one was submitted) is done; its failure is the search's
        to meet when it runs the candidate."""
        future = self._futures.pop(key, None)
        if future is None:
            return
        try:
            error = future.result(timeout=timeout)
        except Exception as e:  # a timeout, a dead worker, a cancelled job: the search compiles it
            error = f"{type(e).__name__}: {e}"
        if error:
            self.failed.append(f"{key}: {error}")

    def close(self) -> None:
        """Stop compiling ahead: compiles not begun are dropped, those under way finish in their workers."""
        if self._pool is None:
            return
        for f in self._futures.values():
            f.cancel()
        self._futures.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None


def _portable(case):
    """The case without what must not travel to a worker: its GPU inputs and the mask's memoised
    per-call values (the lowerings, plain arrays, travel)."""
    mask = case.mask.__class__.__new__(case.mask.__class__)
    mask.__dict__.update({k: v for k, v in case.mask.__dict__.items() if k != "_call_memo"})
    return dataclasses.replace(case, mask=mask, _inputs=None)


def _compile_only_worker() -> None:
    """A worker's start: every kernel launch compiles (into Triton's cache) and returns at once."""
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = compile_only


_CASES: dict = {}


def _compile_job(tunable: str, case, config: dict, mode: str, device: str = "cuda") -> str:
    """One candidate's call in a worker: '' when its kernels compiled, else the error."""
    from longca_triton.bench.autotune import TUNABLES
    from longca_triton.bench.autotune_run import call_once

    # one case's inputs at a time are kept (the next case's replace them)
    held = _CASES.get(case.label)
    if held is None:
        _CASES.clear()
        _CASES[case.label] = held = case
    try:
        call_once(TUNABLES[tunable], held, config, mode, device)
    except Exception as e:  # the search meets it again when it times this candidate
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
    return ""

"""Compile a search's candidates ahead, in parallel, while the GPU times the ones already built.

Why: on a fresh machine most of an autotune run is Triton compiling candidates one after the other
in the timing thread while the GPU waits (a Gluon forward takes seconds to build). Triton 3.6 can
hand its compiles to an executor (``triton.runtime._async_compile.AsyncCompileMode``; the front end,
the MLIR passes and ``ptxas`` release the GIL for most of a compile, so threads scale across
cores). :class:`CompileAhead` opens such a mode over a thread pool; :meth:`CompileAhead.submit`
runs a candidate's launches with every kernel launch turned into a compile request (``warmup``:
nothing runs on the GPU, so the timing thread is not disturbed beyond a few small PyTorch ops);
the timing thread's real call of a candidate later waits for its compile if it is still under way,
else launches the kernel built ahead. A candidate that fails to compile raises at that call, as
it would have without the pool. :meth:`CompileAhead.close` (the end of the search, the budget,
Ctrl-C) drops the compiles not begun; kernels built by then stay in Triton's cache.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

__all__ = ["CompileAhead", "default_workers"]


def default_workers() -> int:
    """Compile threads: the host's cores less one for the timing thread (at least one)."""
    return max(1, (os.cpu_count() or 2) - 1)


class CompileAhead:
    """``with CompileAhead(workers) as ahead: ahead.submit(fn); ...`` (module doc). ``workers=0``:
    nothing is compiled ahead (``submit`` does nothing), the search compiles as it goes."""

    def __init__(self, workers: int | None = None):
        self.workers = default_workers() if workers is None else int(workers)
        self.submitted = 0
        self.failed: list[str] = []  # candidates whose launches raised while being submitted
        self._pool: ThreadPoolExecutor | None = None
        self._mode = None
        self._token = None
        self._lock = threading.Lock()

    def __enter__(self) -> "CompileAhead":
        if self.workers > 0:
            from triton.runtime import _async_compile

            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="compile-ahead")
            self._mode = _async_compile.AsyncCompileMode(self._pool, ignore_errors=True)
            self._token = _async_compile.active_mode.set(self._mode)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, fn: Callable[[], object], label: str = "") -> None:
        """Run ``fn`` (a candidate's call, forward or forward and backward) with its kernel launches
        turned into compile requests for the pool. An error in ``fn``'s own host code (a config its
        launcher refuses) is kept in :attr:`failed` and not raised: the search meets it again when it
        times the candidate."""
        if self._pool is None:
            return
        with self._lock, _launches_compile_only():
            try:
                fn()
            except Exception as e:  # the search reports it when it times this candidate
                self.failed.append(f"{label}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}")
            self.submitted += 1

    def close(self) -> None:
        """Stop compiling ahead: compiles not begun are dropped, those under way finish in the
        background; later launches compile as they come."""
        if self._pool is None:
            return
        from triton.runtime import _async_compile

        _async_compile.active_mode.reset(self._token)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._mode = self._token = None


@contextlib.contextmanager
def _launches_compile_only():
    """Inside the block every ``kernel[grid](...)`` compiles (or finds) the kernel and returns without
    launching it."""
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = compile_only
    try:
        yield
    finally:
        JITFunction.run = run

"""The sweep: expand an experiment into points, run each, append one row per point.

For every problem (mask × S × heads × head dim × dtype) the inputs are drawn once (standard
normal, never zeros, from the experiment's seed) and shared by every backend and mode; then for
each backend and mode:

1. ``backend.check(problem)``: not available / not supported -> ``unsupported: <reason>``;
2. ``backend.prepare(problem, q, k, v)``: all lowering and planning, outside any timer;
3. the correctness check (``check.py``) on the real problem: a wrong backend is reported
   ``error: wrong result (...)`` and not timed;
4. peak memory of one call, absolute and above what was allocated before it;
5. timing: ``fwd`` times the call under ``no_grad``; ``bwd`` times ``torch.autograd.grad`` of the
   output only (graph retained, forward outside the timer); ``fwd_bwd`` times both; TFLOP/s from
   the mask's FLOP count (docs/masks.md §5). By default (``[timing] interleave = true``) the backends of
   one problem and mode are timed together, repetition by repetition (``timing.time_interleaved``),
   so each sees the same stretch of the GPU's clock; should that fail (one backend raising, their
   graphs not fitting together), each is timed on its own. ``interleave = false``: one point after
   the other (``timing.time_fn``). Rows say which (``timing``), and carry the SM clock and power
   sampled while they were timed (``sm_clock_mhz``, ``sm_clock_min_mhz``, ``sm_clock_max_mhz``,
   ``power_w``, ``power_limit_w``; ``timing.ClockSampler``), so a reader can tell a slow kernel from a slow clock
   (the report marks points timed at the board's power limit: ``report.at_power_limit``).

Failures never stop the sweep: ``unsupported: <reason> | oom | error: <message>``. Rows are
appended atomically as they finish (interleaved: a problem's backends of one mode when their
shared timing ends; a refused or failed point at once), so an interrupted sweep (Ctrl-C, a kill, a time budget)
resumes where it stopped: points whose key is already in the store are skipped, judged by the row
that stands for the point (``report.latest_rows``: the latest). One kind of row does not make a
point done for good: ``unsupported`` because of the machine (``store.environment_unsupported``: the
package is not installed, no GPU, the wrong architecture; rows written here say so with
``"unavailable": true``). Such a point is asked again (``backend.check``, no GPU work) and rerun when
the answer differs now (the backend became available, or refuses the case for another reason); the
new row supersedes the old one. Case-intrinsic ``unsupported`` rows (head dim, a mask the backend
cannot express, a length) stay done.
"""

from __future__ import annotations

import gc
import time
import traceback
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from longca_triton.adapters import (
    Backend,
    Problem,
    Unsupported,
    get_backend,
    list_backends,
)
from longca_triton.adapters.base import canonical_name, split_config_name
from longca_triton.masks import NotExpressible, make_mask

from .check import CheckResult, compare, reference_group
from .config import DTYPES, Experiment
from .params import parse_head_dim
from .presets import OPTIONAL_PRESET_BACKENDS
from .report import latest_rows
from .store import (
    ResultStore,
    collect_env,
    environment_unsupported,
    params_digest,
    row_key,
    status_kind,
)
from .store import jsonable as _jsonable
from .timing import ClockSampler, peak_memory, time_fn, time_interleaved

__all__ = ["SweepAborted", "SweepResult", "classify_exception", "plan_points", "run_experiment"]

REFERENCE_BACKENDS = {"reference", "reference-chunked"}
SCHEMA = 1
_FATAL_CUDA = ("illegal memory access", "unspecified launch failure", "device-side assert", "misaligned address",
               "an illegal instruction", "CUDA error: unknown error")


class SweepAborted(RuntimeError):
    """The CUDA context is unusable (e.g. an illegal memory access): rerun to resume."""


@dataclass
class Point:
    mask: str
    seqlen: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str
    mode: str
    backend: str
    variant: int = 0  # index into Experiment.variants(mask) (swept mask parameters)


@dataclass
class SweepResult:
    rows: list[dict] = field(default_factory=list)
    skipped: int = 0
    total: int = 0
    interrupted: bool = False
    budget_hit: bool = False
    aborted: str | None = None
    elapsed_s: float = 0.0

    @property
    def remaining(self) -> int:
        return self.total - self.skipped - len(self.rows)


def classify_exception(e: BaseException, caught_warnings: list | None = None) -> str:
    """The status string of a failed point: ``unsupported: ...``, ``oom`` or ``error: ...``."""
    msg = str(e).strip()
    first = msg.splitlines()[0] if msg else ""
    if isinstance(e, (Unsupported, NotExpressible)):
        return f"unsupported: {first}"
    if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in msg.lower() or "CUDA_ERROR_OUT_OF_MEMORY" in msg:
        return "oom"
    if "No available kernel" in msg:
        why = "; ".join(sorted({str(w.message).strip().splitlines()[0] for w in (caught_warnings or [])
                                if "sdp" in str(w.message).lower() or "attention" in str(w.message).lower()}))[:400]
        return f"unsupported: torch SDPA has no kernel for this case{f' ({why})' if why else ''}"
    text = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return f"error: {text[:400]}"


def allow_retained_backward() -> None:
    """The ``bwd`` timing calls ``torch.autograd.grad(..., retain_graph=True)`` repeatedly on one
    forward graph. AOTAutograd's donated buffers (on by default for compiled training graphs, e.g.
    FlexAttention's) forbid that ("compiled with non-empty donated buffers which requires ...
    retain_graph=False"), so the harness turns them off before anything is compiled. They only
    let the backward reuse saved-activation memory; kernels and their speed are unchanged."""
    try:
        import torch._functorch.config as cfg
    except ImportError:  # pragma: no cover
        return
    if hasattr(cfg, "donated_buffer"):
        cfg.donated_buffer = False


def _is_fatal(status: str) -> bool:
    return status.startswith("error") and any(s in status for s in _FATAL_CUDA)


def _free(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def plan_points(exp: Experiment):
    """``[(problem_key, [Point...])]`` in sweep order: sequence length outermost (in the order the
    experiment lists them, so a time-budgeted run covers every mask at the first S), then mask,
    mask variant (swept parameters), heads, head dim, dtype; backends and modes innermost, sharing
    the problem's inputs. A backend above its ``backend_max_seqlen`` is left out of that length.
    ``problem_key = (mask, S, Hq, Hkv, D, dtype, variant)`` with ``D`` a grid head-dim entry (``128``
    or ``"192/128"``)."""
    groups = []
    for S in exp.seqlens:
        for mname in exp.masks:
            for vi in range(len(exp.variants(mname))):
                for hq, hkv in exp.heads:
                    for D in exp.head_dims:
                        for dt in exp.dtypes:
                            pts = [Point(mname, S, hq, hkv, D, dt, mode, b, vi) for b in exp.backends
                                   if exp.runs(b, S) for mode in exp.modes]
                            if pts:
                                groups.append(((mname, S, hq, hkv, D, dt, vi), pts))
    return groups


def _by_mode(points: list) -> list[list]:
    """``points`` in buckets of one mode each, in the order the modes first appear."""
    buckets: dict[str, list] = {}
    for p in points:
        buckets.setdefault(p.mode, []).append(p)
    return list(buckets.values())


def _make_inputs(B, S, hq, hkv, D, dtype, device, seed, Dv=None):
    """q, k ``[.., D]``, v and dout ``[.., Dv]`` (``Dv`` defaults to ``D``)."""
    Dv = D if Dv is None else Dv
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, S, hq, D, generator=gen, device=device, dtype=dtype)
    k = torch.randn(B, S, hkv, D, generator=gen, device=device, dtype=dtype)
    v = torch.randn(B, S, hkv, Dv, generator=gen, device=device, dtype=dtype)
    dout = torch.randn(B, S, hq, Dv, generator=gen, device=device, dtype=dtype)
    return q, k, v, dout


def _tflops(flops: float, ms: float | None) -> float | None:
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


class _Group:
    """Inputs and the shared reference of one problem."""

    def __init__(self, mask, exp: Experiment, key, device, need_grads: bool):
        mname, S, hq, hkv, D, dt = key[:6]
        self.mask = mask
        self.dtype = DTYPES[dt]
        d_qk, d_v = parse_head_dim(D)
        # why d_qk alone in the seed when the dims are equal: the same inputs as before D_v existed
        seed = exp.seed * 1_000_003 + S * 31 + hq * 7 + hkv * 3 + d_qk + (0 if d_v == d_qk else 1_009 * d_v)
        self.q, self.k, self.v, self.dout = _make_inputs(exp.batch, S, hq, hkv, d_qk, self.dtype, device, seed, d_v)
        self.need_grads = need_grads
        self._ref = None
        self._ref_error: BaseException | None = None

    def reference(self, scale: float):
        if self._ref is None and self._ref_error is None:
            try:
                # computed on the device, kept on the host: no GPU memory of the harness's own
                # shows up in the backends' peak-memory numbers
                self._ref = reference_group(self.mask, self.q, self.k, self.v, self.dout, scale, self.need_grads).to("cpu")
            except BaseException as e:  # noqa: BLE001 - an OOM in the reference must not kill the sweep
                if isinstance(e, KeyboardInterrupt):
                    raise
                self._ref_error = e
        if self._ref_error is not None:
            raise RuntimeError(f"reference check failed to run: {classify_exception(self._ref_error)}")
        return self._ref

    def inputs_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v))


def _prepare_point(backend: Backend, problem: Problem, grp: _Group, exp: Experiment, base: dict):
    """Everything of a point before its timing: the capability check, ``prepare``, the correctness
    check and the peak memory of one call. Returns ``(row, prepared)``: ``prepared`` is None when the
    row is final (unsupported, an error, a wrong result), else a ``_Prepared`` whose ``build()`` makes
    the function to time."""
    row = dict(base)
    mode = problem.mode
    ok, why = backend.check(problem)
    if not ok:
        row["status"] = f"unsupported: {why}"
        if not backend.available()[0]:
            row["unavailable"] = True  # the machine lacks it: a resume retries it where it is available
        return row, None
    grad = mode != "fwd"
    q, k, v = grp.q, grp.k, grp.v
    if grad:
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    dout = grp.dout
    ins = (q, k, v)

    def make():
        with torch.set_grad_enabled(grad):
            if mode == "fwd":
                return fn
            if mode == "bwd":
                out = fn()[0]

                def timed():
                    return torch.autograd.grad(out, ins, dout, retain_graph=True)
                return timed

            def timed():
                return torch.autograd.grad(fn()[0], ins, dout)
            return timed

    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.set_grad_enabled(grad):
                fn = backend.prepare(problem, q, k, v)
                # ---- correctness (the first call also compiles / autotunes)
                if exp.check and backend.name not in REFERENCE_BACKENDS:
                    res = _check(backend, fn, grp, problem, q, k, v, dout)
                    row["check"] = res.as_row()
                    if not res.ok:
                        row["status"] = f"error: wrong result ({res.message})"
                        return row, None
                elif backend.name in REFERENCE_BACKENDS:
                    row["check"] = {"ok": True, "self": "reference"}
                # ---- memory: one call, with no other backend's graph of this problem alive (its own
                # graph is dropped again: an interleaved bucket rebuilds all of them for the timing,
                # so a bwd point runs its forward twice, both outside any timer)
                mem = peak_memory(make(), device=q.device)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - every failure becomes a status
        _fail(row, e, caught)
        return row, None
    row.update(peak_mem_bytes=mem["peak_bytes"], peak_mem_above_bytes=mem["above_bytes"])
    return row, _Prepared(make, _notes(backend, problem, q.device))


@dataclass
class _Prepared:
    """A point ready to be timed: ``build()`` makes the function to time (for ``bwd`` it runs the
    forward whose graph the timed backward reuses; warnings silenced, as the preparation recorded
    them already); ``notes`` says what exactly ran (``_notes``)."""

    make: Callable
    notes: dict

    def build(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.make()


def _fail(row: dict, e: BaseException, caught: list | None = None) -> None:
    row["status"] = classify_exception(e, caught)
    if row["status"] == "oom":
        row["detail"] = str(e).strip().splitlines()[0][:300] if str(e).strip() else None
    elif row["status"].startswith("error"):
        row["traceback"] = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-3:])[-1500:]


def _timed_row(row: dict, t: dict, clock: dict, timing: str, notes: dict) -> dict:
    row.update(
        status="ok",
        time_ms=t["median_ms"], p20_ms=t["p20_ms"], p80_ms=t["p80_ms"], min_ms=t["min_ms"], reps=t["reps"],
        tflops=_tflops(row["flops"], t["median_ms"]), timing=timing,
    )
    row.update(clock)
    if notes:
        row["notes"] = notes
    return row


def _time_one(row: dict, prep: _Prepared, exp: Experiment, device) -> dict:
    """Time one prepared point on its own (``time_fn``)."""
    try:
        timed = prep.build()
        with ClockSampler(device) as clock:
            t = time_fn(timed, exp.warmup_ms, exp.rep, flush_l2=True, max_ms=exp.max_ms, device=device)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001
        _fail(row, e)
        return row
    finally:
        timed = None  # noqa: F841 - release the retained graph
    return _timed_row(row, t, clock.summary(), "sequential", prep.notes)


def _time_together(prepared: list, exp: Experiment, device) -> list[dict]:
    """Time prepared points of one problem and mode together (``time_interleaved``). Should that
    fail (one backend's call raising, or the graphs of all of them not fitting the memory together),
    each is timed on its own instead, so one backend's failure stays its own row."""
    if len(prepared) < 2:
        return [_time_one(row, prep, exp, device) for row, prep in prepared]
    fns = []
    try:
        fns = [prep.build() for _, prep in prepared]
        with ClockSampler(device) as clock:
            ts = time_interleaved(fns, exp.warmup_ms, exp.rep, flush_l2=True, max_ms=exp.max_ms, device=device)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - fall back to one at a time
        fns = None
        _free(device)
        return [_time_one(row, prep, exp, device) for row, prep in prepared]
    finally:
        fns = None  # noqa: F841 - release the retained graphs
    c = clock.summary()
    return [_timed_row(row, t, c, "interleaved", prep.notes) for (row, prep), t in zip(prepared, ts)]


def _run_point(backend: Backend, problem: Problem, grp: _Group, exp: Experiment, base: dict) -> dict:
    """One point prepared and timed on its own."""
    row, prep = _prepare_point(backend, problem, grp, exp, base)
    if prep is None:
        return row
    return _time_one(row, prep, exp, grp.q.device)


def _notes(backend: Backend, problem: Problem, device) -> dict:
    """What exactly ran, where the adapter chose (e.g. SDPA's GQA path, our kernels' launch config:
    ``Backend.run_notes``)."""
    out = dict(backend.run_notes(problem))
    plan = None
    try:
        cache = problem.mask.__dict__.get("_adapter_cache", {})
        for key, val in cache.items():
            if key[0] == backend.name and key[1] == "plan" and key[-1] == problem.mode:
                plan = val
    except Exception:
        return out
    for attr in ("gqa", "form", "native_gqa"):
        if plan is not None and hasattr(plan, attr):
            out[attr] = getattr(plan, attr)
    return out


def _problem(p: Point, mask, exp: Experiment, device) -> Problem:
    d_qk, d_v = parse_head_dim(p.head_dim)
    return Problem(mask=mask, batch=exp.batch, heads_q=p.heads_q, heads_kv=p.heads_kv, head_dim=d_qk,
                   head_dim_v=None if d_v == d_qk else d_v, dtype=DTYPES[p.dtype], mode=p.mode,
                   device=torch.device(device).type)


def _ask_again(prev: dict, p: Point, mask, exp: Experiment, device) -> bool:
    """Whether a point with an earlier row is run again: only when that row says the machine lacked
    the backend and the backend's answer differs now (available, or refusing for another reason)."""
    if not environment_unsupported(prev):
        return False
    try:
        ok, why = get_backend(p.backend).check(_problem(p, mask, exp, device))
    except Exception:  # noqa: BLE001 - a check that fails is decided by running the point
        return True
    return ok or f"unsupported: {why}" != prev.get("status")


def _check(backend, fn, grp: _Group, problem: Problem, q, k, v, dout) -> CheckResult:
    out, lse = fn()
    grads = None
    if problem.mode != "fwd":
        grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = grp.reference(problem.scale)
    res = compare(ref, out.detach(), lse.detach() if lse is not None else None,
                  tuple(g.detach() for g in grads) if grads is not None else None, problem.dtype)
    del out, lse, grads
    return res


def run_experiment(
    exp: Experiment,
    store: ResultStore,
    *,
    device: str | None = None,
    retry: tuple[str, ...] = (),
    max_minutes: float | None = None,
    progress: Callable | None = None,
    on_row: Callable[[dict], None] | None = None,
    run_id: str | None = None,
) -> SweepResult:
    """Run every pending point of ``exp``, appending rows to ``store`` (see module doc).

    ``retry``: status kinds (e.g. ``("error", "oom")``) whose earlier rows do not count as done.
    ``progress(advance, description, total)`` is called before/after each point (the CLI draws a
    bar with it). ``KeyboardInterrupt`` stops the sweep between writes: the result says
    ``interrupted`` and the store holds every finished point.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    known = {b.name for b in list_backends()}
    backends = []
    for b in exp.backends:
        if b in known:
            backends.append(b)
        elif exp.preset and b in OPTIONAL_PRESET_BACKENDS:
            continue
        elif split_config_name(b)[0] in known:
            get_backend(b)  # one of ours with a launch config: ValueError naming what is wrong with it
            backends.append(canonical_name(b))
        else:
            raise ValueError(f"unknown backend {b!r}; valid backends: {', '.join(sorted(known))}")
    exp = exp.with_overrides()  # copy
    exp.backends = backends
    allow_retained_backward()
    env = collect_env()
    run_id = run_id or uuid.uuid4().hex[:12]
    interpreted = device == "cpu" and env.get("interpreted", False)

    groups = plan_points(exp)
    kinds = {"ok", "unsupported", "oom", "error"} - set(retry)
    done = {row_key(r): r for r in latest_rows(store.rows()) if status_kind(r) in kinds}
    result = SweepResult(total=sum(len(p) for _, p in groups))
    t0 = time.monotonic()
    deadline = t0 + max_minutes * 60 if max_minutes else None
    if progress:
        progress(0, "planning", result.total)
    def emit(row: dict) -> None:
        """A finished point: appended to the store at once (a resume skips it)."""
        row["time"] = collect_env()["time"]
        row["env"] = env
        store.append(row)
        result.rows.append(row)
        if on_row:
            on_row(row)
        if progress:
            progress(1, f"{row['backend']} {row['mask']} S={row['seqlen']} {row['mode']}: {row['status'][:40]}", None)
        if status_kind(row) in ("oom", "error"):
            _free(device)
        if _is_fatal(row["status"]):
            result.aborted = row["status"]
            raise SweepAborted(row["status"])

    try:
        for key, pts in groups:
            mname, S, hq, hkv, D, dt, vi = key
            d_qk, d_v = parse_head_dim(D)
            variant = {}
            try:
                variant = exp.variant_values(mname, vi, S, (hq, hkv))
                mask = make_mask(mname, S, seed=exp.seed, **exp.params_for(mname, S, (hq, hkv), vi))
            except (ValueError, TypeError) as e:  # validate() catches these first; never crash mid-sweep
                for p in pts:
                    row = {"schema": SCHEMA, "kind": exp.kind, "experiment": exp.name, "backend": p.backend, "mask": mname,
                           "mask_params": _jsonable(exp.variants(mname)[vi]), "seqlen": S, "batch": exp.batch, "heads_q": hq,
                           "heads_kv": hkv, "head_dim": d_qk, "d_qk": d_qk, "d_v": d_v, "dtype": dt, "mode": p.mode, "status": f"error: bad mask: {e}",
                           "env": env, "run_id": run_id, "time": collect_env()["time"]}
                    if exp.label_keys(mname):
                        row.update(variant=_jsonable(variant), mask_label=exp.variant_label(mname, vi))
                    store.append(row)
                    result.rows.append(row)
                    if progress:
                        progress(1, f"{mname} S={S}: bad mask", None)
                continue
            digest = params_digest(mask.params)
            base_common = {
                "schema": SCHEMA, "kind": exp.kind, "experiment": exp.name, "preset": exp.preset,
                "mask": mname, "mask_params": _jsonable(mask.params), "params_digest": digest, "seed": exp.seed,
                "seqlen": S, "seqlen_q": mask.seqlen_q, "seqlen_k": mask.seqlen_k, "batch": exp.batch,
                # head_dim keeps its old meaning (q's and k's, = v's in rows before d_v existed)
                "heads_q": hq, "heads_kv": hkv, "head_dim": d_qk, "d_qk": d_qk, "d_v": d_v, "dtype": dt,
                "density": mask.density, "device": device, "interpreted": interpreted, "gpu": env.get("gpu"),
                "warmup_ms": exp.warmup_ms, "rep": exp.rep, "run_id": run_id,
            }
            if variant:  # swept mask parameters: the plots and the report show one panel per variant
                base_common.update(variant=_jsonable(variant), mask_label=exp.variant_label(mname, vi))
            pending = []
            for p in pts:
                probe = dict(base_common, backend=p.backend, mode=p.mode)
                if row_key(probe) in done and not _ask_again(done[row_key(probe)], p, mask, exp, device):
                    result.skipped += 1
                    if progress:
                        progress(1, f"skip {p.backend} {mname} S={S} {p.mode}", None)
                else:
                    pending.append(p)
            if not pending:
                continue
            need_grads = exp.check and any(p.mode != "fwd" for p in pending)
            grp = _Group(mask, exp, key, device, need_grads)
            base_common["inputs_bytes"] = grp.inputs_bytes()
            try:
                # interleaved: the backends of one mode are prepared one by one, then timed together
                buckets = _by_mode(pending) if exp.interleave else [[p] for p in pending]
                for bucket in buckets:
                    prepared = []
                    for p in bucket:
                        if deadline is not None and time.monotonic() > deadline:
                            result.budget_hit = True
                            break
                        backend = get_backend(p.backend)
                        problem = _problem(p, mask, exp, device)
                        base = dict(base_common, backend=p.backend, backend_description=backend.description, mode=p.mode,
                                    flops=problem.flops(), status=None, time_ms=None, tflops=None)
                        if progress:
                            progress(0, f"{p.backend} {mname} S={S} {hq}:{hkv} {p.mode}", None)
                        row, prep = _prepare_point(backend, problem, grp, exp, base)
                        if prep is None:
                            emit(row)
                        else:
                            prepared.append((row, prep))
                    if prepared:
                        if progress and len(prepared) > 1:
                            progress(0, f"timing {len(prepared)} backends together: {mname} S={S} {prepared[0][0]['mode']}", None)
                        for row in _time_together(prepared, exp, grp.q.device):
                            emit(row)
                        prepared = None
                    if result.budget_hit:
                        return result
            finally:
                del grp
                mask.__dict__.pop("_adapter_cache", None)
                mask.__dict__.pop("_lowering_cache", None)
                _free(device)
    except KeyboardInterrupt:
        result.interrupted = True
    except SweepAborted:
        pass
    finally:
        result.elapsed_s = time.monotonic() - t0
    return result


"""The autotune search over a set of cases: what a tunable kernel provides (:class:`Tunable`), cases,
timing one config, successive halving per key group, and the winners written as rows of the
user's autotune cache.

The kernels that can be tuned (key groups, candidates) are registered in
:mod:`longca_triton.bench.autotune`; the cache's format and the lookup the kernels make are
:mod:`longca_triton.kernels.core.tuned`. A problem class
(kernel, head dims, dtype, GQA group, mask class, sequence bucket, block) is one cache row whose
``config`` is the tuned config, whose ``measured`` keeps the default's and the tuned config's TFLOP/s
per mode, the cases and the search, so the kernels pick the best block for a class and a warm rerun
prints what it found without timing anything.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from longca_triton.kernels.core.tuned import (
    cache_path,
    class_match,
    device_key,
    device_rows,
    problem_class,
    save_row,
)
from longca_triton.kernels.tuning import Row
from ..masks import Mask
from .search import geomean, halving_search, past, planned_measurements
from .timing import time_fn

__all__ = ["Tunable", "TuneCase", "measure", "call_once", "compile_key", "submit_compiles", "search_space", "class_default",
           "group_classes", "planned_work", "cached_row", "tune",
           "record_vendors", "screen_case", "vendors_cached", "build_cases", "cases_for", "vendor_tflops", "DEFAULT_MASKS", "DEFAULT_VENDORS",
           "DEFAULT_DENSITIES"]


@dataclass
class Tunable:
    """A kernel family with a launch config: how to enumerate candidates and how to run one."""

    name: str  # the backend name it runs under ("triton", "triton-sparse", ...)
    #: key groups tuned one at a time, e.g. {"fwd": [...], "dkdv": [...], "dq": [...]}
    groups: dict[str, str]  # group -> mode whose timing decides it ("fwd" or "bwd")
    candidates: Callable[[str, int, int], list[dict]]  # (group, block, head_dim) -> partial configs
    run: Callable  # (q, k, v, mask, config) -> out, differentiable
    #: (head_dim, dtype, mask, group) -> full default config (group: query heads per KV head)
    default: Callable[..., dict]
    accepts: Callable[[Mask], bool] = lambda mask: True
    #: its own tuning cases ``(block, seqlens, head_dims, dtypes, heads, densities, seed)`` ->
    #: ``[TuneCase]``; None: the command's ``--masks`` (filtered by ``accepts``)
    make_cases: Callable | None = None
    #: backends its summary compares against
    vendors: tuple[str, ...] = ("sdpa-cudnn", "fa4", "flex-fa4", "flex")
    #: what ``block`` means for it: "block" (tile = block) or "mean block" (variable blocks)
    block_meaning: str = "block"
    #: ``device_reason(torch.device) -> str``: why it cannot run on that device ("" if it can)
    device_reason: Callable | None = None
    #: its shipped tuning table's family (``kernels/tuning/<table>.toml``): the search looks there too
    table: str | None = None


@dataclass
class TuneCase:
    mask: Mask
    heads_q: int = 64
    heads_kv: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    batch: int = 1
    label: str = ""
    _inputs: tuple | None = field(default=None, repr=False)

    def inputs(self, device):
        if self._inputs is None:
            g = torch.Generator(device=device).manual_seed(0)
            S = self.mask.seqlen_q
            shape_q = (self.batch, S, self.heads_q, self.head_dim)
            shape_k = (self.batch, self.mask.seqlen_k, self.heads_kv, self.head_dim)
            q = torch.randn(shape_q, device=device, dtype=self.dtype, generator=g).requires_grad_()
            k = torch.randn(shape_k, device=device, dtype=self.dtype, generator=g).requires_grad_()
            v = torch.randn(shape_k, device=device, dtype=self.dtype, generator=g).requires_grad_()
            self._inputs = (q, k, v, torch.randn(shape_q, device=device, dtype=self.dtype, generator=g))
        return self._inputs

    def flops(self, mode: str) -> float:
        return self.batch * self.mask.flops(self.heads_q, self.head_dim, mode)


#: repetitions of one timing sized to the case: ``rep`` at most, about ``ms`` of them, ``min_rep`` at least
#: (the screen ranks candidates, the final round measures them)
SCREEN_TIMING = dict(warmup_ms=10, rep=30, max_ms=25, min_rep=3)
FINAL_TIMING = dict(warmup_ms=25, rep=50, max_ms=100, min_rep=6)


def _time(fn, device, quick: bool = False) -> float:
    """Median milliseconds of ``fn``: CUDA events behind a head start (``bench.timing``), as many
    repetitions as fit the screen's or the final round's time (a 1 ms backward gets 25 or 50, a
    20 ms one 5 or 10); wall clock in the interpreter."""
    if torch.device(device).type == "cuda":
        t = SCREEN_TIMING if quick else FINAL_TIMING
        return time_fn(fn, warmup_ms=t["warmup_ms"], rep=t["rep"], max_ms=t["max_ms"], min_rep=t["min_rep"])["median_ms"]
    return time_fn(fn, rep=1, flush_l2=False, device=device, warmup_calls=0)["median_ms"]  # one run, host clock


def call_once(tunable: Tunable, case: TuneCase, config: dict, mode: str, device) -> None:
    """One untimed call of a config on a case: the forward, and with ``mode`` bwd the backward."""
    q, k, v, do = case.inputs(device)
    if mode == "fwd":
        with torch.no_grad():
            tunable.run(q, k, v, case.mask, config)
    else:
        torch.autograd.grad(tunable.run(q, k, v, case.mask, config), (q, k, v), do)


def measure(tunable: Tunable, case: TuneCase, config: dict, mode: str, device, quick: bool = False) -> float:
    """TFLOP/s of one config on one case (``mode`` fwd: forward; bwd: backward alone)."""
    q, k, v, do = case.inputs(device)
    if mode == "fwd":
        with torch.no_grad():
            ms = _time(lambda: tunable.run(q, k, v, case.mask, config), device, quick)
    else:
        out = tunable.run(q, k, v, case.mask, config)
        ms = _time(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), device, quick)
    return case.flops(mode) / (ms * 1e-3) / 1e12


def search_space(tunable: Tunable, group: str, block: int, head_dim: int, switches: bool = False,
                 default: dict | None = None, exhaustive: bool = False) -> list[dict]:
    """The candidates searched for one key group.

    With ``default`` (the config a user gets on the class: the shipped table's row) and not
    ``exhaustive``: the candidate nearest the default (its centre), every candidate that differs from
    the centre in at most two keys (one knob, or two that move together such as a consumer count and
    where P lives), and each choice the shipped table's rows make for the group's keys applied to the
    centre; not the cross product of every knob (82 Gluon forward candidates at D = 128 against 16
    here). ``exhaustive`` or no ``default``: every candidate.

    ``switches=False`` leaves out ``warp_specialize=True``: on sm_90 with Triton 3.6 it changes
    nothing (the pass does not apply to these loops), no tuned class ever chose it, and some of its
    configs fail to compile. ``--search-switches`` puts them back."""
    cands = tunable.candidates(group, block, head_dim)
    cands = cands if switches else [c for c in cands if not c.get("warp_specialize")]
    if exhaustive or default is None or not cands:
        return cands

    def dist(a: dict, b: dict) -> int:
        return sum(a[k] != b.get(k) for k in a)

    centre = min(cands, key=lambda c: dist(c, default))  # the first of the nearest: the candidates' own order
    shipped = [dict(centre, **choice) for choice in _shipped_choices(tunable, tuple(centre))]
    return [c for c in cands if dist(c, centre) <= 2 or c in shipped]


def _shipped_choices(tunable: Tunable, keys: tuple) -> list[dict]:
    """What each row of the tunable's shipped table sets among ``keys`` (rows setting none left out)."""
    if tunable.table is None:
        return []
    from longca_triton.kernels.tuning import load_table

    rows = load_table(tunable.table).rows
    return [c for c in ({k: r.config[k] for k in keys if k in r.config} for r in rows) if c]



def _class_of(tunable: Tunable, case: TuneCase, block: int) -> str:
    return problem_class(tunable.name, case.head_dim, case.dtype, case.heads_q // case.heads_kv, case.mask, block)


def _match_of(case: TuneCase, block: int) -> dict:
    return class_match(case.head_dim, case.dtype, case.heads_q // case.heads_kv, case.mask, block)


def group_classes(tunable: Tunable, cases: list[TuneCase], block: int) -> dict[str, list[TuneCase]]:
    """The cases by problem class (what one cache row serves)."""
    by_class: dict[str, list[TuneCase]] = {}
    for c in cases:
        by_class.setdefault(_class_of(tunable, c, block), []).append(c)
    return by_class


def planned_work(tunable: Tunable, cases: list[TuneCase], block: int, exhaustive: bool = False,
                 switches: bool = False) -> int:
    """The most timed runs :func:`tune` makes for these cases (a progress bar's total; classes
    reused from the cache make fewer, and so does a default that reaches a final round or wins)."""
    total = 0
    for members in group_classes(tunable, cases, block).values():
        n, modes = len(members), len(set(tunable.groups.values()))
        total += 2 * modes * n  # the default before, the tuned combination after
        default = class_default(tunable, members)
        for group in tunable.groups:
            space = search_space(tunable, group, block, members[0].head_dim, switches, default, exhaustive)
            total += planned_measurements(len(space), n, exhaustive=exhaustive)
    return total


def screen_case(members: list[TuneCase]) -> TuneCase:
    """The class's heaviest case (the largest mask area, the first of equals): the search screens on
    it, the compiles ahead start with it, and the vendors are timed on it."""
    return max(members, key=lambda c: c.mask.area)


def class_default(tunable: Tunable, members: list[TuneCase]) -> dict:
    """The config a user gets on a class without tuning (its first case's)."""
    c = members[0]
    return tunable.default(c.head_dim, c.dtype, c.mask, group=c.heads_q // c.heads_kv)


def compile_key(tunable: Tunable, cls: str, group: str, cand: dict, case: TuneCase) -> tuple:
    """What names one candidate's compile ahead on one case: kernel, class, key group (or
    ``"default"`` and the mode), the candidate and the case."""
    return tunable.name, cls, group, json.dumps(cand, sort_keys=True, default=str), case.label


def submit_compiles(ahead, tunable: Tunable, cases: list[TuneCase], block: int, device, *, exhaustive: bool = False,
                    switches: bool = False, force: bool = False, budget_minutes: float | None = None) -> int:
    """Hand ``ahead`` (a :class:`~longca_triton.bench.compile_ahead.CompileAhead`) every kernel
    :func:`tune` will build for these cases, in the order it needs them: per class not in the
    cache, the default in each mode, then each key group's candidates on the screening case (the
    largest), then on the class's other cases (a mask may compile other variants of a kernel: its
    partial tiles, interval count), all over the default. Returns how many calls were submitted."""
    n = 0
    for cls, members in group_classes(tunable, cases, block).items():
        if not force and cached_row(tunable, members, block, device, budget_minutes) is not None:
            continue
        default = class_default(tunable, members)
        screen = screen_case(members)
        others = [c for c in members if c is not screen]
        for mode in sorted(set(tunable.groups.values()), reverse=True):  # fwd first
            for case in (screen, *others):
                ahead.submit(compile_key(tunable, cls, "default", {"mode": mode}, case), tunable.name, case, default,
                             mode, device)
                n += 1
        for round_cases in ([screen], others):
            for group, mode in tunable.groups.items():
                for cand in search_space(tunable, group, block, screen.head_dim, switches, default, exhaustive):
                    for case in round_cases:
                        ahead.submit(compile_key(tunable, cls, group, cand, case), tunable.name, case,
                                     {**default, **cand}, mode, device)
                        n += 1
    return n


def _row_of(tunable: Tunable, members: list[TuneCase], block: int, device) -> Row | None:
    """This class's cache row when it was tuned on exactly these cases on this GPU (finished or cut)."""
    match = _match_of(members[0], block)
    for row in device_rows(device_key(device), tunable.name):
        if row.match == match and row.measured.get("cases") == [c.label for c in members] and "search" in row.measured:
            return row
    return None


def cached_row(tunable: Tunable, members: list[TuneCase], block: int, device,
               budget_minutes: float | None = None) -> Row | None:
    """This class's cache row when a rerun reuses it: tuned on exactly these cases on this GPU, its
    search run to the end, or cut short under a budget (``--budget-minutes``) at least as large as
    ``budget_minutes`` (a rerun with the same budget would get no further; a larger one, or none,
    tunes it again). Else None."""
    row = _row_of(tunable, members, block, device)
    if row is None:
        return None
    search = row.measured["search"]
    if not search.get("stopped_by_deadline"):
        return row
    under = search.get("budget_minutes")
    return row if budget_minutes and under and budget_minutes <= under else None


def _summary(cls: str, row: Row, reused: bool, failures=()) -> dict:
    """What :func:`tune` returns per class, from the class's row."""
    m = row.measured
    return dict(problem_class=cls, cases=list(m["cases"]), default=dict(m.get("default", {})), tuned=dict(row.config),
                default_tflops={k: v["default"] for k, v in m["tflops"].items()},
                tuned_tflops={k: v["tuned"] for k, v in m["tflops"].items()}, failures=list(failures),
                per_case={k: dict(v) for k, v in m.get("per_case", {}).items()},
                reused=reused, search=dict(m["search"]), vendors=dict(m.get("vendors", {})),
                vendor_case=m.get("vendor_case"))


def _make_row(tunable: Tunable, members: list[TuneCase], block: int, tuned: dict, default: dict,
              default_cases: dict, tuned_cases: dict, search: dict) -> Row:
    """The cache row of one tuned class: ``results`` names the run (date and cache file), ``note``
    its TFLOP/s in a sentence, ``measured`` the numbers a warm rerun and the lookup read."""
    when = time.strftime("%Y-%m-%dT%H:%M:%S")
    default_scores = {m: geomean(list(v.values())) for m, v in default_cases.items()}
    tuned_scores = {m: geomean(list(v.values())) for m, v in tuned_cases.items()}
    modes = sorted(tuned_scores) or sorted(set(tunable.groups.values()))
    tf = ", ".join(f"{m} {tuned_scores[m]:.1f} vs {default_scores[m]:.1f}" for m in sorted(tuned_scores))
    note = (f"TFLOP/s tuned vs default: {tf or 'nothing measured'}; geometric mean over {len(members)} cases, "
            f"{search['method']}, {search['measurements']} timed runs in {search['seconds']} s")
    return Row(match=_match_of(members[0], block), config=dict(tuned),
               mode="fwd_bwd" if len(modes) > 1 else modes[0],
               results=f"autotune run of {when} into {cache_path()}", note=note,
               measured=dict(tflops={m: dict(default=default_scores[m], tuned=tuned_scores[m]) for m in tuned_scores},
                             per_case={m: {c: dict(default=default_cases[m][c], tuned=t) for c, t in v.items()}
                                       for m, v in tuned_cases.items()},
                             cases=[c.label for c in members], search=search, default=dict(default)))


def tune(
    tunable: Tunable,
    cases: list[TuneCase],
    block: int,
    device="cuda",
    groups: list[str] | None = None,
    *,
    exhaustive: bool = False,
    deadline: float | Callable[[], bool] | None = None,
    force: bool = False,
    switches: bool = False,
    on_measure: Callable | None = None,
    write: bool = True,
    ahead=None,
) -> list[dict]:
    """Tune every problem class the cases fall in; return one summary per class.

    Each key group (forward, dK/dV, dQ) is searched by successive halving (``bench/search.py``:
    every candidate screened on the heaviest case with a short timing, the best quarter timed on
    every case; ``exhaustive=True`` times all of them on all cases), candidates scored by the
    geometric mean of TFLOP/s over the class's cases; a candidate that fails to compile or run is
    recorded and skipped. A class already in the cache, tuned on the same cases on this GPU, is
    reused as it is (``force=True`` tunes it again). ``deadline`` (``time.monotonic()``, or a
    callable saying whether to stop) caps the search: past it the group being searched decides
    among what it measured, the class's groups not begun keep their defaults, the class is
    written (its row says the search was cut, so a rerun tunes it again), and classes not begun
    are left out of the summaries. ``switches``: search the kernels' on/off switches too
    (:func:`search_space`). ``write``: put each class's row in the cache. ``ahead``: the
    :class:`~longca_triton.bench.compile_ahead.CompileAhead` that :func:`submit_compiles` filled; each
    candidate waits for its compile there before it is timed.
    """
    waited = [0.0]  # seconds this class spent waiting for compiles ahead

    def wait(*key):
        if ahead is not None:
            t = time.monotonic()
            ahead.wait(compile_key(tunable, *key))
            waited[0] += time.monotonic() - t

    groups = groups or list(tunable.groups)
    summaries = []
    budget = getattr(deadline, "minutes", None)  # the command's --budget-minutes, which a cut row records
    classes = group_classes(tunable, cases, block)
    rows = {cls: None if force else cached_row(tunable, members, block, device, budget)
            for cls, members in classes.items()}
    left = sum(row is None for row in rows.values())
    for cls, members in classes.items():
        row = rows[cls]
        if row is not None:
            summaries.append(_summary(cls, row, reused=True))
            continue
        if past(deadline):  # the budget is spent (or Ctrl-C pressed): classes not begun are not tuned
            continue
        # an equal part of what is left of the budget for each class still to tune, so that a slow
        # class cannot leave the ones after it untuned (a class that finishes early passes its time on)
        class_deadline = deadline.share(left) if hasattr(deadline, "share") else deadline
        left -= 1
        t0, waited[0] = time.monotonic(), 0.0
        head_dim = members[0].head_dim
        default = class_default(tunable, members)
        tuned = dict(default)
        default_scores, tuned_scores, failures, measured, cut = {}, {}, [], 0, False
        default_cases, tuned_cases = {}, {}  # per mode, TFLOP/s per case label
        # the final round's timings of a whole config on a case: the default's, which a finalist
        # equal to it reuses instead of timing the same kernels again
        full_runs, reused = {}, 0

        def timed(cand, case, quick, mode, group):
            nonlocal reused
            config = {**tuned, **cand}
            key = (json.dumps(config, sort_keys=True, default=str), case.label, mode)
            if not quick and key in full_runs:
                reused += 1
                return full_runs[key]
            wait(cls, group, cand, case)
            return measure(tunable, case, config, mode, device, quick)

        def note(round_, cand, case, tf, err, cls=cls):
            if on_measure:
                on_measure(cls, round_, cand, case, tf, err)

        for group in groups:
            if default_scores and past(class_deadline):  # groups not begun keep their defaults
                cut = True
                break
            mode = tunable.groups[group]
            if mode not in default_scores:
                default_cases[mode] = {c.label: (wait(cls, "default", {"mode": mode}, c),
                                                 measure(tunable, c, default, mode, device))[1] for c in members}
                default_scores[mode] = geomean(list(default_cases[mode].values()))
                dkey = json.dumps(default, sort_keys=True, default=str)
                full_runs.update({(dkey, label, mode): tf for label, tf in default_cases[mode].items()})
                measured += len(members)
                for c in members:
                    note("default", {}, c, None, "")
            res = halving_search(
                search_space(tunable, group, block, head_dim, switches, default, exhaustive), members,
                lambda cand, case, quick, mode=mode, group=group: timed(cand, case, quick, mode, group),
                weight=lambda case: case.mask.area, exhaustive=exhaustive, deadline=class_deadline,
                on_measure=lambda rnd, cand, case, tf, err, group=group: note(f"{group} {rnd}", cand, case, tf, err))
            measured += res.measurements
            failures += res.failures
            cut |= res.stopped_by_deadline
            if res.best is not None:
                tuned.update(res.best)
                tuned_scores[mode] = res.score
        for mode in sorted(set(tunable.groups.values())):
            if mode not in tuned_scores:
                continue
            # re-measure the final combination (not the winner's own final-round timings, which picking the
            # best of several noisy ones biases upwards); where it does not beat the default, keep the default
            if tuned == default:
                tuned_cases[mode] = dict(default_cases[mode])
                continue
            tuned_cases[mode] = {c.label: measure(tunable, c, tuned, mode, device) for c in members}
            measured += len(members)
            if geomean(list(tuned_cases[mode].values())) <= default_scores[mode]:
                for group, m in tunable.groups.items():
                    if m == mode:
                        for key in tunable.candidates(group, block, head_dim)[0]:
                            tuned[key] = default[key]
                tuned_cases[mode] = dict(default_cases[mode])
        search = dict(method="exhaustive" if exhaustive else "successive halving", measurements=measured - reused,
                      seconds=round(time.monotonic() - t0, 1), compile_wait_seconds=round(waited[0], 1),
                      stopped_by_deadline=cut, budget_minutes=budget)
        row = _make_row(tunable, members, block, tuned, default, default_cases, tuned_cases, search)
        summaries.append(_summary(cls, row, reused=False, failures=failures))
        if write:  # keyed by the device: interpreter timings never serve a GPU
            save_row(device_key(device), tunable.name, row)
    return summaries


def record_vendors(tunable: Tunable, summary: dict, cases: list[TuneCase], block: int, case_label: str,
                   vendors: dict, device, write: bool = True) -> None:
    """Keep a class's vendor numbers (timed on its case ``case_label``) in its summary and
    (``write``) its cache row, so that a warm rerun prints them without timing."""
    summary["vendors"], summary["vendor_case"] = vendors, case_label
    row = _row_of(tunable, cases, block, device) if write else None
    if row is not None:
        save_row(device_key(device), tunable.name,
                 dataclasses.replace(row, measured={**row.measured, "vendors": vendors, "vendor_case": case_label}))


def vendors_cached(tunable: Tunable, members: list[TuneCase], block: int, vendors, device) -> bool:
    """Whether the cache already holds this class, tuned on these cases, with every vendor's number
    in every mode (a warm rerun then times no vendor)."""
    row = _row_of(tunable, members, block, device)
    have = (row.measured.get("vendors") or {}) if row is not None else {}
    return row is not None and all(v in have.get(m, {}) for m in set(tunable.groups.values()) for v in vendors)


# ---------------------------------------------------------------------------- the command's cases
DEFAULT_MASKS = ("full", "causal", "causal_document", "share_question", "sliding_window_causal")
DEFAULT_VENDORS = ("sdpa-cudnn", "fa4", "flex-fa4", "flex")
DEFAULT_DENSITIES = (0.2, 0.5, 0.8)


def build_cases(masks, seqlens, head_dims, dtypes, heads, seed=0) -> list[TuneCase]:
    from ..masks import make_mask

    hq, hkv = heads
    return [
        TuneCase(make_mask(m, S, seed=seed), hq, hkv, D, dt, label=f"{m} S={S} D={D} {str(dt).replace('torch.', '')}")
        for m, S, D, dt in itertools.product(masks, seqlens, head_dims, dtypes)
    ]


def cases_for(tunable: Tunable, block: int, masks, seqlens, head_dims, dtypes, heads, densities=DEFAULT_DENSITIES,
              seed=0) -> list[TuneCase]:
    """The cases ``tunable`` is tuned on: its own (block-sparse kernels: masks at ``block`` and
    each density, one pattern per KV head), or the range masks ``masks`` it accepts."""
    if tunable.make_cases is not None:
        return tunable.make_cases(block, seqlens, head_dims, dtypes, heads, densities, seed)
    return [c for c in build_cases(masks, seqlens, head_dims, dtypes, heads, seed) if tunable.accepts(c.mask)]


def vendor_tflops(cases: list[TuneCase], mode: str, vendors, device, memo: dict | None = None) -> dict[str, float | str]:
    """Each vendor backend on the same cases: the geometric mean of its TFLOP/s, or why not
    (``unsupported: ...`` when it cannot run one of them, ``error: ...`` when it failed). ``memo``
    keeps each (vendor, case, mode) measured in this run: kernels tuned on the same cases share them."""
    from ..adapters import get_backend

    memo = {} if memo is None else memo
    out: dict[str, float | str] = {}
    for name in vendors:
        try:
            backend = get_backend(name)
        except ValueError as e:
            out[name] = f"unknown: {e}"
            continue
        scores = []
        for case in cases:
            key = (name, case.label, mode)
            if key not in memo:
                memo[key] = _vendor_on(backend, case, mode, device)
            got = memo[key]
            if isinstance(got, str):
                out[name] = got
                break
            scores.append(got)
        else:
            out[name] = geomean(scores)
    return out


def _vendor_on(backend, case: TuneCase, mode: str, device) -> float | str:
    """One vendor on one case: TFLOP/s, or why not."""
    from ..adapters import Problem

    q, k, v, do = case.inputs(device)
    problem = Problem(mask=case.mask, batch=case.batch, heads_q=case.heads_q, heads_kv=case.heads_kv,
                      head_dim=case.head_dim, dtype=case.dtype, mode=mode, device=torch.device(device).type)
    ok, why = backend.check(problem)
    if not ok:
        return f"unsupported: {why}"
    try:
        fn = backend.prepare(problem, q, k, v)
        if mode == "fwd":
            with torch.no_grad():
                ms = _time(fn, device)
        else:
            res = fn()[0]
            ms = _time(lambda: torch.autograd.grad(res, (q, k, v), do, retain_graph=True), device)
    except Exception as e:  # a vendor failing here is reported, not fatal
        return f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]}"
    return case.flops(mode) / (ms * 1e-3) / 1e12

"""What ``longca-triton autotune`` says: when it stops (its budget, Ctrl-C), the closing table, and the
summary in words it prints last on every run (a terminal, a pipe or a file alike).

The summary names, per problem class, its cases, the default's and the tuned config's TFLOP/s per
mode (geometric means over the cases) and, on the class's heaviest case, both of them and every
vendor timed there, how the class was settled (tuned now, reused from
the cache, cut short by the budget or Ctrl-C), and what was skipped and why.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager

__all__ = ["Stop", "plural", "fmt_cfg", "summary_rows", "summary_lines", "SUMMARY_COLUMNS", "SUMMARY_HEADERS"]


def plural(n: int, one: str, many: str | None = None) -> str:
    """``1 case``, ``5 cases`` (``many`` where adding an s is wrong: ``classes``)."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


class Stop:
    """When the command stops searching: its budget spent (``minutes`` after ``start``; ``None``:
    no budget) or Ctrl-C pressed. Called, it says whether to stop now (the search's ``deadline``)."""

    def __init__(self, minutes: float | None, start: float | None = None):
        self.minutes = minutes
        self.deadline = (start if start is not None else time.monotonic()) + minutes * 60 if minutes else None
        self.interrupted = False  # Ctrl-C pressed
        self.at_once = False  # pressed twice: stopped in the middle of a measurement
        self.share_spent = False  # some kernel's share of the budget ran out

    def __call__(self) -> bool:
        return self.interrupted or (self.deadline is not None and time.monotonic() > self.deadline)

    def share(self, kernels_left: int) -> "Share":
        """The next kernel's deadline: an equal share of the budget left among the ``kernels_left``
        still to tune (time a kernel leaves unused goes to those after it), so that every kernel
        gets tuned some instead of the first ones taking the whole budget. Called, it says whether
        to stop that kernel's search; Ctrl-C and the whole budget stop it too."""
        return Share(self, self.deadline).share(kernels_left)

    @property
    def why(self) -> str:
        """What stopped the command, in words ('' when nothing did)."""
        if self.interrupted:
            return "Ctrl-C"
        if self():
            return f"the {self.minutes:g}-minute budget"
        return f"the {self.minutes:g}-minute budget (each kernel's and class's share of it)" if self.share_spent else ""

    @contextmanager
    def on_ctrl_c(self):
        """Inside: the first Ctrl-C (SIGINT) asks the command to stop after the measurement under way;
        a second one stops it at once (``KeyboardInterrupt``)."""

        def handler(signum, frame):
            if self.interrupted:
                self.at_once = True
                raise KeyboardInterrupt
            self.interrupted = True

        if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
            yield self
            return
        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


class Share:
    """A part of a :class:`Stop`'s budget ending at ``end`` (``time.monotonic()``; ``None``: no
    budget). Called, it says whether to stop (the part spent, the whole budget spent, or Ctrl-C);
    :meth:`share` splits what is left of it again (a kernel's part among its problem classes)."""

    def __init__(self, stop: Stop, end: float | None):
        self.stop, self.end = stop, end

    @property
    def minutes(self) -> float | None:
        """The whole command's budget (what a cache row records it was tuned under)."""
        return self.stop.minutes

    def __call__(self) -> bool:
        if self.stop():
            return True
        if self.end is not None and time.monotonic() > self.end:
            self.stop.share_spent = True
            return True
        return False

    def share(self, parts_left: int) -> "Share":
        """An equal part of what is left of this one among ``parts_left`` (time a part leaves unused
        goes to the parts after it)."""
        if self.end is None:
            return Share(self.stop, None)
        return Share(self.stop, time.monotonic() + max(0.0, self.end - time.monotonic()) / max(1, parts_left))


def fmt_cfg(cfg: dict) -> str:
    """A launch config as ``KEY=value`` words."""
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in cfg.items())


def _class_words(cls: str, cases: list[str]) -> dict:
    """``triton|D=128|bfloat16|G=8|masked|S<=16K|block=64`` in words, with the masks it covers."""
    kernel, d, dtype, g, mclass, bucket, block = cls.split("|")
    names = sorted({c.split(" S=")[0] for c in cases})
    return dict(kernel=kernel, block=block.split("=")[1], S=bucket.replace("S<=", "S ≤ ").replace("S>", "S > "),
                masks=", ".join(names), head=f"{d} {dtype} {g}", problem_class=cls)


def _source(s: dict) -> str:
    if s.get("reused"):
        return "cache"
    return s["search"]["method"] + (", cut short" if s["search"].get("stopped_by_deadline") else "")


def summary_rows(summaries: list[dict], vendors: list[str]) -> list[dict]:
    """The closing table: one row per problem class and mode."""
    rows = []
    for s in summaries:
        words = _class_words(s["problem_class"], s["cases"])
        for mode, tuned in sorted(s["tuned_tflops"].items()):
            default = s["default_tflops"][mode]
            row = dict(words, mode=mode, default=round(default, 1), tuned=round(tuned, 1),
                       x_default=round(tuned / default, 3) if default else None, source=_source(s),
                       cases="; ".join(s["cases"]),
                       tuned_config=fmt_cfg({k: v for k, v in s["tuned"].items()
                                             if s.get("default", {}).get(k) != v}) or "(= default)")
            on = s.get("vendor_case")
            there = s.get("per_case", {}).get(mode, {}).get(on) if on else None
            row["vendor_case"] = on or ""
            row["tuned_there"] = round(there["tuned"], 1) if there else None
            for v in vendors:
                got = s.get("vendors", {}).get(mode, {}).get(v)
                row[v] = round(got, 1) if isinstance(got, float) else _short(got or "not measured", 60)
            rows.append(row)
    return rows


SUMMARY_COLUMNS = ["kernel", "block", "S", "masks", "mode", "default", "tuned", "x_default", "vendor_case", "tuned_there"]
SUMMARY_HEADERS = {"x_default": "× default", "S": "sequences", "default": "default TFLOP/s", "tuned": "tuned TFLOP/s",
                   "vendor_case": "vendors timed on", "tuned_there": "tuned there"}
MODE_ORDER = ("fwd", "bwd", "fwd_bwd")


def _short(text: str, n: int = 100) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1].rsplit(" ", 1)[0] + " …"


def _class_lines(s: dict, vendors: list[str], why_no_vendors: str, modes=()) -> list[str]:
    """One problem class in words: what it covers, how it was settled, and per mode default vs
    tuned vs every vendor on the same cases."""
    w = _class_words(s["problem_class"], s["cases"])
    if s.get("reused"):
        how = "reused from the cache (tuned on these cases before)"
    elif s["search"].get("stopped_by_deadline"):
        budget = s["search"].get("budget_minutes")
        how = ("cut short: the best config measured so far, written; a rerun with a larger --budget-minutes "
               "(or --force) tunes it again" + (f" (it had a share of a {budget:g}-minute budget)" if budget else ""))
    else:
        waited = s["search"].get("compile_wait_seconds")
        how = (f"tuned now ({s['search']['method']}, {s['search']['measurements']} timed runs, {s['search']['seconds']:.0f} s"
               + (f", {waited:.0f} s of it waiting for compiles" if waited and waited >= 0.5 else "") + ")")
    lines = [f"  {w['kernel']} at block {w['block']}, {w['S']}, {w['masks']}: {how}",
             f"    cases: {'; '.join(s['cases'])}"]
    why = "not timed when it was tuned" if s.get("reused") else why_no_vendors
    for mode in sorted(s["tuned_tflops"], key=MODE_ORDER.index):
        d, t = s["default_tflops"][mode], s["tuned_tflops"][mode]
        text = f"    {mode}: default {d:.1f}, tuned {t:.1f} TFLOP/s" + (f" ({t / d:.2f}× default)" if d else "")
        got = s.get("vendors", {}).get(mode, {})
        said = [f"{v} {got[v]:.1f}" if isinstance(got.get(v), float)
                else f"{v} {_short(got.get(v) or why or 'not timed')}" for v in vendors]
        on = s.get("vendor_case")
        there = s.get("per_case", {}).get(mode, {}).get(on) if on else None
        if said and there:
            text += f"; on {on}: default {there['default']:.1f}, tuned {there['tuned']:.1f}, " + ", ".join(said)
        elif said:
            text += "; " + ", ".join(said)
        lines.append(text)
    for mode in sorted(set(modes) - set(s["tuned_tflops"]), key=MODE_ORDER.index):
        lines.append(f"    {mode}: not searched before the stop (the default config stays)")
    return lines


def summary_lines(runs: list[dict], skipped: list[tuple[str, str]], stop: Stop, seconds: dict,
                  device_name: str, cache: str | None) -> list[str]:
    """The closing summary. ``runs``: per kernel ``dict(summaries, vendors, why_no_vendors, modes,
    left)`` (``modes``: the modes it tunes; ``left``: its problem classes not begun, with their
    cases' labels); ``skipped``: ``(what, why)``; ``seconds``: ``search`` and ``vendors``;
    ``cache``: its path, None when not written (``--no-write``)."""
    total = sum(seconds.values())
    head = (f"autotune summary, {device_name}: {total:.0f} s (search {seconds.get('search', 0):.0f} s, "
            f"vendors {seconds.get('vendors', 0):.0f} s)")
    settled = [s for r in runs for s in r["summaries"]]
    cut = any(r["left"] for r in runs) or any(s["search"].get("stopped_by_deadline") and not s.get("reused")
                                              for s in settled)
    if stop.interrupted or (stop.why and cut):  # a budget that ran out after the search ended stopped nothing
        head += f"; stopped by {stop.why}" + (" in the middle of a measurement" if stop.at_once else "")
    lines = [head]
    skipped = list(skipped)
    for r in runs:
        for s in r["summaries"]:
            lines += _class_lines(s, r["vendors"], r["why_no_vendors"], r["modes"])
        for cls, cases in r["left"].items():
            w = _class_words(cls, cases)
            skipped.append((f"{w['kernel']} at block {w['block']}, {w['S']}, {w['masks']} ({'; '.join(cases)})",
                            f"{stop.why or 'the stop'} came before it began; a rerun tunes it"))
    for what, why in skipped:
        lines.append(f"  skipped: {what}: {why}")
    written = [s for s in settled if not s.get("reused")]
    if cache is None:
        lines.append("  cache: not written (--no-write)")
    else:
        lines.append(f"  cache: {cache}: {plural(len(written), 'class', 'classes')} written, "
                     f"{plural(len(settled) - len(written), 'class', 'classes')} reused; the kernels read it at run time")
    if not settled and not skipped:
        lines.append("  nothing tuned")
    return lines

"""Run the kernel ladder (``longca_triton/kernels/ladder/``): check every step, time it, tabulate, chart.

``longca-triton ladder`` is the command; :func:`run_ladder` is the library call behind it.

For each step of one mode (``fwd`` or ``bwd``):

1. **check** at a small size (``check_seqlen``, same mask kind, heads and head dim) against a
   float32 reference (``naive_attention``; autograd through it for the backward). The tolerance
   is a small multiple of *PyTorch's own* error in the same dtype (``naive_attention`` run in
   bf16 against the same fp32 reference), with a floor; a NaN fails.
2. **run at full size** once and compare with the production step's result there (catches bugs
   that only large sizes show, such as overflowing offsets); a NaN fails.
3. **time** it with ``bench.timing.time_fn`` (CUDA events, L2 flushed before every repetition,
   median and p20/p80) and measure its peak memory above the inputs.

Steps that would not fit or would take minutes at the size asked for are skipped with the reason
(e.g. the naive step's ``O(S²)`` memory). ``sdpa-cudnn`` is timed in the same run for the
"% of cuDNN" column. TFLOP/s count only allowed pairs (docs/masks.md §5).

Outputs (``--out DIR``): ``ladder.jsonl`` (one row per step, with the environment; rows of the
same problem are replaced on a re-run), ``ladder.md`` (the tables of every problem in the file) and
``ladder_<mode>.png`` (bar chart). On a machine without a GPU the Triton steps run in the
interpreter at a tiny size, for correctness only.
"""

from __future__ import annotations

import math
import time

import click

from .cli import heads_callback
from ..cli_values import SEQLEN
from ..output import format_option
from .ladder_report import TOL_MULT, VENDOR, print_records, print_table, render_markdown, write_outputs

__all__ = ["LadderProblem", "run_ladder", "ladder_command", "write_outputs", "render_markdown"]

#: tolerance = max(TOL_MULT x PyTorch's own error in this dtype, TOL_FLOOR[dtype]); TOL_MULT and the
#: VENDOR timed beside the steps live in .ladder_report (its tables and charts print them)
TOL_FLOOR = {"float32": 2e-4, "float16": 2e-3, "bfloat16": 1e-2}
#: seconds of timed repetitions per step (slow steps get at least 3 repetitions)
TIME_BUDGET_MS = 4000.0


class LadderProblem:
    """What the ladder runs on: mask kind, sizes, dtype (all steps share it)."""

    def __init__(self, mask="causal", seqlen=16384, mode="fwd", heads=(64, 8), head_dim=128,
                 batch=1, dtype="bfloat16", seed=0, check_seqlen=2048, device="cuda"):
        self.mask_name, self.seqlen, self.mode = mask, int(seqlen), mode
        self.heads_q, self.heads_kv = int(heads[0]), int(heads[1])
        self.head_dim, self.batch, self.dtype_name = int(head_dim), int(batch), dtype
        self.seed, self.check_seqlen, self.device = int(seed), int(check_seqlen), device

    @property
    def dtype(self):
        import torch

        return getattr(torch, self.dtype_name)

    def key(self) -> dict:
        return dict(mode=self.mode, mask=self.mask_name, seqlen=self.seqlen, batch=self.batch,
                    heads_q=self.heads_q, heads_kv=self.heads_kv, head_dim=self.head_dim,
                    dtype=self.dtype_name)

    def label(self) -> str:
        return (f"{self.mask_name}, S={self.seqlen}, {self.mode}, B={self.batch}, "
                f"Hq:Hkv={self.heads_q}:{self.heads_kv}, D={self.head_dim}, {self.dtype_name}")


def interpreter_problem(p: LadderProblem) -> LadderProblem:
    """The tiny version of ``p`` that the CPU interpreter can run in seconds (fp32, S <= 97)."""
    hq = min(p.heads_q, 4)
    hkv = max(1, hq * p.heads_kv // p.heads_q)
    while hq % hkv:
        hkv -= 1
    s = min(p.seqlen, 97)
    return LadderProblem(p.mask_name, s, p.mode, (hq, hkv), min(p.head_dim, 32), 1, "float32", p.seed, s, "cpu")


# ----------------------------------------------------------------------------------------------
# inputs, errors
# ----------------------------------------------------------------------------------------------
def _mask_for(name: str, seqlen: int, seed: int):
    from longca_triton.masks import make_mask

    return make_mask(name, seqlen, seed=seed)


def _inputs(p: LadderProblem, seqlen: int, device):
    import torch

    g = torch.Generator(device=device).manual_seed(p.seed)
    shape_q = (p.batch, seqlen, p.heads_q, p.head_dim)
    shape_k = (p.batch, seqlen, p.heads_kv, p.head_dim)
    q = torch.randn(shape_q, generator=g, device=device, dtype=p.dtype)
    k = torch.randn(shape_k, generator=g, device=device, dtype=p.dtype)
    v = torch.randn(shape_k, generator=g, device=device, dtype=p.dtype)
    do = torch.randn(shape_q, generator=g, device=device, dtype=p.dtype)
    return q, k, v, do


def rel_err(x, ref) -> float:
    """``max |x - ref| / max(1, max |ref|)``; ``nan`` when ``x`` has a NaN."""
    import torch

    if x.numel() == 0:
        return 0.0
    if torch.isnan(x).any():
        return float("nan")
    d = (x.double() - ref.double()).abs().max().item()
    return d / max(1.0, ref.double().abs().max().item())


def _max_err(xs, refs) -> float:
    errs = [rel_err(x, r) for x, r in zip(xs, refs)]
    return float("nan") if any(math.isnan(e) for e in errs) else max(errs)


class _Check:
    """Reference results at the check size, and PyTorch's own error in the run's dtype."""

    def __init__(self, p: LadderProblem, device):
        import torch

        from longca_triton.reference import naive_attention

        self.mask = _mask_for(p.mask_name, p.check_seqlen, p.seed)
        self.q, self.k, self.v, self.do = _inputs(p, p.check_seqlen, device)
        ref_dtype = torch.float64 if device == "cpu" else torch.float32
        leaves = [t.detach().to(ref_dtype).requires_grad_() for t in (self.q, self.k, self.v)]
        out, lse = naive_attention(*leaves, self.mask, return_lse=True)
        self.ref_out, self.ref_lse = out.detach(), lse.detach().float()
        self.out = self.ref_out.to(p.dtype)  # what a backward step is given as the forward's O
        torch_leaves = [t.detach().clone().requires_grad_() for t in (self.q, self.k, self.v)]
        torch_out = naive_attention(*torch_leaves, self.mask)
        if p.mode == "fwd":
            self.refs = [self.ref_out]
            self.torch_err = rel_err(torch_out.detach(), self.ref_out)
        else:
            self.refs = [g.detach() for g in torch.autograd.grad(out, leaves, self.do.to(ref_dtype))]
            torch_grads = torch.autograd.grad(torch_out, torch_leaves, self.do)
            self.torch_err = _max_err(torch_grads, self.refs)
        del out, torch_out
        self.tol = max(TOL_MULT * self.torch_err, TOL_FLOOR.get(p.dtype_name, 1e-2))

    def run(self, step, p: LadderProblem):
        if p.mode == "fwd":
            return [step.fn(self.q, self.k, self.v, self.mask)]
        return list(step.fn(self.q, self.k, self.v, self.mask, self.out, self.ref_lse, self.do))


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------
def _timing():
    from longca_triton.bench.timing import peak_memory, time_fn

    return time_fn, peak_memory


def _measure(fn, device) -> dict:
    time_fn, peak_memory = _timing()
    t = time_fn(fn, warmup_ms=25, rep=20, flush_l2=True, max_ms=TIME_BUDGET_MS, device=device)
    mem = peak_memory(fn, device=device)
    return {"median_ms": t["median_ms"], "p20_ms": t["p20_ms"], "p80_ms": t["p80_ms"], "reps": t.get("reps"),
            "peak_mib": None if mem["above_bytes"] is None else mem["above_bytes"] / 2**20}


def _vendor_row(p: LadderProblem, mask, q, k, v, do, flops) -> dict:
    """Time ``sdpa-cudnn`` on the same problem (or say why not)."""
    import torch

    from longca_triton.adapters import Problem, get_backend

    row = {"step": VENDOR, "kind": "vendor", "idea": "PyTorch SDPA, cuDNN backend (same run)"}
    try:
        backend = get_backend(VENDOR)
    except ValueError as e:
        return {**row, "status": "unsupported", "reason": str(e)}
    problem = Problem(mask=mask, batch=p.batch, heads_q=p.heads_q, heads_kv=p.heads_kv,
                      head_dim=p.head_dim, dtype=p.dtype, mode=p.mode, device="cuda")
    ok, why = backend.check(problem)
    if not ok:
        return {**row, "status": "unsupported", "reason": why}
    try:
        if p.mode == "fwd":
            fn0 = backend.prepare(problem, q, k, v)

            def fn():
                with torch.no_grad():
                    return fn0()
        else:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = backend.prepare(problem, *leaves)()[0]

            def fn():
                return torch.autograd.grad(out, leaves, do, retain_graph=True)

        m = _measure(fn, q.device)
    except torch.cuda.OutOfMemoryError:
        return {**row, "status": "oom"}
    except Exception as e:  # a vendor failing is a row, not the end of the ladder
        return {**row, "status": "error", "reason": f"{type(e).__name__}: {str(e)[:200]}"}
    return {**row, "status": "ok", **m, "tflops": flops / (m["median_ms"] * 1e-3) / 1e12}


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------
def run_ladder(p: LadderProblem, steps=None, log=print, timed: bool | None = None) -> list[dict]:
    """Check (and on a GPU time) every step of ``p.mode``; returns one dict per step (+ vendor).

    ``timed`` defaults to "on a GPU"; ``timed=True`` on the CPU runs the whole timing path through
    the interpreter (for tests of this module: such numbers mean nothing). Import-time note: call
    ``longca_triton.runtime.select_device()`` before this on a CPU host, so that Triton comes up in
    its interpreter.
    """
    import torch

    from longca_triton.kernels.ladder import steps_for

    gpu = p.device.startswith("cuda")
    timed = gpu if timed is None else timed
    all_steps = steps_for(p.mode)
    if steps:
        unknown = set(steps) - {s.name for s in all_steps}
        if unknown:
            raise ValueError(f"unknown {p.mode} steps {sorted(unknown)}; steps: {[s.name for s in all_steps]}")
        all_steps = [s for s in all_steps if s.name in steps]
    env = _env()
    base = {"kind": "ladder", **p.key(), "check_seqlen": p.check_seqlen, "device": env.get("gpu") or "cpu",
            "interpreted": not gpu, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "env": env}

    log(f"checking against the fp32 reference at S={p.check_seqlen} ({p.label()})")
    chk = _Check(p, p.device)
    log(f"PyTorch's own {p.dtype_name} error: {chk.torch_err:.2e} -> tolerance {chk.tol:.2e}")
    rows = []
    for step in all_steps:
        row = {**base, "step": step.name, "idea": step.idea, "file": step.file, "triton": step.triton,
               "torch_err": chk.torch_err, "check_tol": chk.tol}
        why = step.device_reason(torch.device(p.device)) if step.device_reason else ""
        if why:  # e.g. a Gluon step on a CPU or a non-Hopper GPU: said, not crashed
            row.update(check="skipped", status="skipped", reason=why)
            rows.append(row)
            log(f"  {step.name}: skipped ({why})")
            continue
        try:
            err = _max_err(chk.run(step, p), chk.refs)
            row["check_err"] = err
            row["check"] = "ok" if err <= chk.tol else ("NaN" if math.isnan(err) else "WRONG")
        except Exception as e:
            row.update(check="error", status="error", reason=f"{type(e).__name__}: {str(e)[:200]}")
        rows.append(row)
        log(f"  {step.name}: check {row['check']}" + (f" ({row['check_err']:.2e})" if "check_err" in row else ""))
    del chk
    if not timed:
        for row in rows:
            row.setdefault("status", "checked" if row["check"] == "ok" else "wrong")
            row.setdefault("reason", "interpreter: correctness only, speed needs a GPU")
        return rows

    # ---------------- full size: production result first (for the consistency check), then all
    mask = _mask_for(p.mask_name, p.seqlen, p.seed)
    q, k, v, do = _inputs(p, p.seqlen, p.device)
    flops = p.batch * mask.flops(p.heads_q, p.head_dim, p.mode)
    out = lse = None
    if p.mode == "bwd":
        from longca_triton.kernels.dense.op import dense_attention

        with torch.no_grad():
            out, lse = dense_attention(q, k, v, mask, return_lse=True)
    prod = None
    # the production step first: every other step is compared with its result at full size
    production = [s for s in all_steps if s.name.endswith("production")]
    order = production + [s for s in all_steps if s not in production]
    by_name = {r["step"]: r for r in rows}
    for step in order:
        row = by_name[step.name]
        if row.get("status") in ("error", "skipped"):
            continue
        why = step.limit(p.batch, p.heads_q, p.heads_kv, p.seqlen, p.seqlen, p.head_dim) if step.limit else None
        if why:
            row.update(status="skipped", reason=why)
            log(f"  {step.name}: skipped ({why})")
            continue
        try:
            if p.mode == "fwd":
                def fn(step=step):
                    with torch.no_grad():
                        return step.fn(q, k, v, mask)
            else:
                run = step.prepare_backward(q, k, v, mask, out, lse)

                def fn(run=run):
                    return run(do)

            res = fn()
            res = [res] if p.mode == "fwd" else list(res)
            if any(torch.isnan(t).any().item() for t in res):
                row.update(status="wrong", reason=f"NaN at S={p.seqlen}")
                continue
            if step in production:
                prod = res  # the reference for every other step at full size
                row["vs_production"] = 0.0
            elif prod is not None:
                row["vs_production"] = _max_err(res, prod)
            del res
            # Triton steps keep fp32 scores like production, so at full size they must agree with it
            # to within the check's tolerance (x2 for the longer rows); PyTorch steps round their
            # scores to the input dtype, so their distance is reported, not judged
            if step.triton and row.get("vs_production", 0.0) > 2 * row["check_tol"]:
                row.update(status="wrong", reason=f"differs from production at S={p.seqlen} "
                           f"({row['vs_production']:.1e} > {2 * row['check_tol']:.1e})")
                continue
            m = _measure(fn, q.device)
            row.update(status="ok" if row["check"] == "ok" else "wrong", **m,
                       tflops=flops / (m["median_ms"] * 1e-3) / 1e12)
            if step.notes and step.notes():
                row["notes"] = step.notes()
            log(f"  {step.name}: {m['median_ms']:.2f} ms, {row['tflops']:.1f} TFLOP/s")
        except torch.cuda.OutOfMemoryError:
            row.update(status="oom", reason=f"out of memory at S={p.seqlen}")
        except Exception as e:
            row.update(status="error", reason=f"{type(e).__name__}: {str(e)[:200]}")
        if gpu:
            torch.cuda.empty_cache()
    del prod

    if gpu:
        vendor = {**base, **_vendor_row(p, mask, q, k, v, do, flops)}
    else:
        vendor = {**base, "step": VENDOR, "kind": "vendor", "status": "unsupported", "reason": "needs a CUDA GPU"}
    # relative columns: x over the previous timed step, % of the vendor
    prev = None
    for i, row in enumerate(rows):
        if row.get("tflops"):
            if prev is not None:
                row["x_prev"] = row["tflops"] / prev["tflops"]
                row["prev_step"] = prev["step"]
                if prev is not rows[i - 1]:  # the step just before was not timed
                    row["notes"] = "; ".join(x for x in (row.get("notes"), f"× vs {prev['step']}") if x)
            if vendor.get("tflops"):
                row["pct_vendor"] = 100.0 * row["tflops"] / vendor["tflops"]
            prev = row
    return rows + [vendor]


def _env() -> dict:
    try:
        from longca_triton.bench.store import collect_env

        return dict(collect_env())
    except Exception:  # the harness's collector is optional here
        import platform

        import torch

        env = {"torch": torch.__version__, "python": platform.python_version()}
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name()
        return env


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
@click.command("ladder")
@format_option
@click.option("--mask", default="causal", show_default=True, help="a static mask of docs/masks.md (causal, causal_document, ...)")
@click.option("-S", "--seqlen", type=SEQLEN, default=16384, show_default=True, help="sequence length, e.g. 16384 or 16K")
@click.option("--mode", type=click.Choice(["fwd", "bwd", "all"]), default="fwd", show_default=True,
              help="forward steps, backward steps, or both (one table each)")
@click.option("--heads", default="64:8", show_default=True, callback=heads_callback, help="Hq:Hkv")
@click.option("--head-dim", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--dtype", type=click.Choice(["bfloat16", "float16"]), default="bfloat16", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--check-seqlen", type=SEQLEN, default=2048, show_default=True,
              help="sequence length of the correctness check against the fp32 reference")
@click.option("--steps", default=None, help="comma-separated step names to run (default: all of the mode)")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="directory for ladder.jsonl, ladder.md and ladder_<mode>.png")
def ladder_command(mask, seqlen, mode, heads, head_dim, batch, dtype, seed, check_seqlen, steps, out, fmt):
    """The kernel ladder: every step from the naive formula to our production kernel, checked and timed.

    Each step of longca_triton/kernels/ladder/ adds one idea (tiles, online softmax, mask-aware tile skipping,
    GQA, Hopper features). The table gives TFLOP/s, the speed-up over the previous step, % of
    sdpa-cudnn measured in the same run, and peak memory. Without a GPU the Triton steps run in
    the interpreter at a tiny size, for correctness only.

    \b
    Examples:
      longca-triton ladder --mask causal -S 16384 --mode fwd --out experiments/results/h100
      longca-triton ladder --mask causal -S 16384 --mode bwd --out experiments/results/h100
      longca-triton ladder --mode all --steps step3_online_softmax,step4_mask_skipping
    """
    import sys

    from ..runtime import INTERPRETER_BANNER, select_device

    device, _ = select_device()
    from rich.console import Console

    from ..masks import STATIC_MASK_NAMES

    console = Console(stderr=fmt != "table")  # json / csv: stdout holds the table alone, the log goes to stderr
    if mask not in STATIC_MASK_NAMES:
        raise click.BadParameter(f"the ladder's kernels take static masks: {', '.join(STATIC_MASK_NAMES)}",
                                 param_hint="--mask")
    from longca_triton.kernels.ladder import steps_for  # imports triton: after select_device

    modes = ["fwd", "bwd"] if mode == "all" else [mode]
    wanted = [s.strip() for s in steps.split(",") if s.strip()] if steps else None
    if wanted:
        known = {s.name for m in modes for s in steps_for(m)}
        unknown = [s for s in wanted if s not in known]
        if unknown:
            raise click.BadParameter(f"unknown steps {unknown} for --mode {mode}; known: {', '.join(sorted(known))}",
                                     param_hint="--steps")
    on_gpu = device.startswith("cuda")
    command = "longca-triton " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("longca-triton") else None
    failed = False
    tables = []  # json / csv: every mode's steps in one table
    for m in modes:
        mine = [s.name for s in steps_for(m) if not wanted or s.name in wanted]
        if not mine:
            continue
        p = LadderProblem(mask, seqlen, m, heads, head_dim, batch, dtype, seed, min(check_seqlen, seqlen), device)
        if not on_gpu:
            console.print(f"[bold yellow]{INTERPRETER_BANNER}[/bold yellow]")
            p = interpreter_problem(p)
        rows = run_ladder(p, steps=mine, log=lambda s: console.log(s))
        title = f"kernel ladder — {p.label()}" + ("" if on_gpu else " [INTERPRETER: correctness only]")
        if fmt == "table":
            print_table(rows, title, console)
        else:
            tables.append((m, rows))
        failed |= any(r.get("status") in ("wrong", "error") for r in rows if r.get("kind") == "ladder")
        if out:
            for path in write_outputs(rows, out, command):
                console.print(f"wrote {path}")
    if tables:
        print_records(tables, fmt)
    if not on_gpu:
        console.print("[bold]Speed needs a GPU:[/bold] run this command on a CUDA host for TFLOP/s.")
    if failed:
        raise SystemExit(1)

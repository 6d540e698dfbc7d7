"""``longca-triton autotune``: the command over :mod:`longca_triton.bench.autotune`.

On a GPU a user sees one line per kernel saying what is tuned and where the cache is, a progress
bar (timed runs done / planned, elapsed, ETA), the closing table, then a summary in words
(:mod:`.autotune_summary`) on a terminal, into a pipe or a file alike: per problem class its cases,
default vs tuned on them, every vendor against both on the class's heaviest case, how it was
settled, and what was skipped and why. The vendors are timed first, while worker processes build
our candidates (their compiles would otherwise hold up the search). ``-v``
adds a line per timed candidate. A class already in the cache (same GPU, Triton, cases, its search
finished, or cut short under a budget at least as large) is reused and said so; ``--force`` tunes it
again. ``--budget-minutes`` (1.7 by default; each problem class gets an equal part of its kernel's
share) and Ctrl-C stop the search cleanly: the group being searched keeps the best config measured so
far, the class under way is written, classes not begun are skipped and said so, and the summary
prints; after Ctrl-C the command exits 130 (a second Ctrl-C stops in the middle of a measurement).

On a CPU there is no GPU to time: the command says so and what it does instead, checks each key
group's first candidate through the Triton interpreter against an fp64 reference, writes no cache,
and ends on a line counting the checks.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

import click
import torch

from ..cli_values import SEQLENS
from ..output import emit, format_option
from .compile_ahead import CompileAhead
from .autotune_summary import SUMMARY_COLUMNS, SUMMARY_HEADERS, Stop, fmt_cfg, plural, summary_lines, summary_rows
from .cli import heads_callback


def csv_option(kind):
    """A click callback: a comma-separated list of ``kind``, with a clear error."""

    def parse(ctx, param, value):
        if value is None:
            return None
        items = [x.strip() for x in value.split(",") if x.strip()]
        try:
            return [kind(x) for x in items]
        except ValueError:
            raise click.BadParameter(f"expected a comma-separated list of {kind.__name__}, got {value!r}") from None

    return parse


#: the interpreter's cases on a CPU: small enough to run in seconds
CPU_CASES = dict(seqlen=160, head_dim=32, dtype=torch.float16, heads=(4, 2))
#: the largest block (and mean block) checked on a CPU: 160-token sequences then span several blocks
CPU_BLOCK, CPU_MEAN_BLOCK = 32, 64


@click.command()
@click.option("--block", type=click.Choice(["16", "32", "64", "128", "256"]), default="64", show_default=True,
              help="inner-loop tile / uniform sparse block size to tune for (triton, triton-sparse)")
@click.option("--varblock", is_flag=True,
              help="tune the variable-block kernel (triton-varblock) at --mean-block instead of triton + triton-sparse")
@click.option("--mean-block", type=click.IntRange(min=16), default=256, show_default=True,
              help="mean block of the variable-block masks triton-varblock is tuned on")
@click.option("--kernel", "kernels", default=None, callback=csv_option(str),
              help="comma-separated tunable kernels (default: triton,triton-sparse, plus triton-gluon on an sm_90 GPU; with --varblock: triton-varblock)")
@click.option("--masks", default=None, callback=csv_option(str),
              help="comma-separated masks for the dense kernel (default: a mix of full, causal, documents, window)")
@click.option("--densities", default="0.2,0.5,0.8", show_default=True, callback=csv_option(float),
              help="kept-block fractions of the block-sparse tuning masks")
@click.option("--seqlens", type=SEQLENS, default="4096,16384", show_default=True, help="e.g. 4K,16K")
@click.option("--head-dims", default="128", show_default=True, callback=csv_option(int))
@click.option("--dtypes", default="bfloat16", show_default=True, callback=csv_option(str))
@click.option("--heads", default="64:8", show_default=True, callback=heads_callback, help="Hq:Hkv")
@click.option("--vendors", default=None, callback=csv_option(str),
              help="backends measured on the same cases (default: per kernel, e.g. sdpa-cudnn, fa4, flex-fa4, flex "
                   "for the dense one; 'none' for none)")
@click.option("--budget-minutes", type=click.FloatRange(min=0), default=1.7, show_default=True,
              help="stop after this long (from the start; 0: no budget), shared equally among the vendors' timing and "
                   "each kernel's search, and a kernel's part among its problem classes (time one leaves unused goes "
                   "to the next): the group under way keeps the best config so far and the class is written; a rerun "
                   "with the same budget reuses it, a larger one tunes it again")
@click.option("--exhaustive", is_flag=True, help="time every candidate on every case (the slow search halving replaced)")
@click.option("--search-switches", "switches", is_flag=True,
              help="also search warp_specialize=True (a no-op on sm_90 with Triton 3.6, some configs fail to compile)")
@click.option("--compile-workers", type=click.IntRange(min=0), default=None,
              help="processes compiling candidates ahead while the GPU times (default: the host's cores less two, "
                   "at most 16; 0: compile each candidate when it is first timed)")
@click.option("--force", is_flag=True, help="tune classes the cache already holds for these cases again")
@click.option("--dry-run", is_flag=True, help="list the problem classes and candidate configs, run nothing")
@click.option("--no-write", is_flag=True, help="do not update the config cache")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="also append the summaries as JSON lines")
@click.option("-v", "--verbose", is_flag=True, help="a line per timed candidate")
@format_option
def autotune(block, varblock, mean_block, kernels, masks, densities, seqlens, head_dims, dtypes, heads, vendors,
             budget_minutes, exhaustive, switches, compile_workers, force, dry_run, no_write, out, verbose, fmt):
    """Tune our kernels' launch configs for one tile/block size and cache the winners.

    `--block N` tunes the dense kernel (triton: inner tile N) and the uniform block-sparse kernel
    (triton-sparse: masks of block N, one pattern per KV head, at each of --densities);
    `--varblock` tunes triton-varblock on variable-block masks of mean block --mean-block.
    Each key group (forward, dK/dV, dQ) searches the shipped default, its neighbours (one or two
    knobs changed) and the shipped table's other choices by successive halving: every candidate
    timed briefly on the heaviest case, the best quarter on every case (--exhaustive: every
    candidate of the full cross product on every case). Candidates compile on the host's cores
    while the GPU times the vendors, then those already built. Prints, per problem class and
    mode, default vs tuned, and each vendor against both on the class's heaviest case. The cache
    (LONGCA_TRITON_AUTOTUNE_CACHE, default ~/.cache/longca-triton/autotune.json) holds one
    tuning-table row per problem class, which the kernels read at run time before their shipped
    tables; a rerun reuses what the cache holds for the same cases unless --force, which also
    rebuilds a cache of an older format. The search stops after --budget-minutes (0: no budget)
    or at Ctrl-C (then exit 130), keeping the best config measured so far and writing what it
    finished; a summary in words ends every run. On a CPU there is no GPU to time: it checks each
    key group's first candidate in the Triton interpreter on small cases and writes no cache.

    \b
    Examples:
      longca-triton autotune --block 64
      longca-triton autotune --block 64 --budget-minutes 0 --format json   # no budget
      longca-triton autotune --block 128 --masks causal,causal_document --seqlens 16384
      longca-triton autotune --block 128 --kernel triton-sparse --densities 0.2,0.5
      longca-triton autotune --varblock --mean-block 256
      longca-triton autotune --block 64 --dry-run
    """
    from ..runtime import INTERPRETER_BANNER, select_device

    t_start = time.monotonic()
    # before anything imports triton: without a GPU this switches it to its interpreter
    device, interpreted = select_device()
    from longca_triton.kernels.core import tuned

    from ..masks import MASK_NAMES
    from ..output import console as make_console
    from . import autotune as at
    from . import autotune_run as run

    con = make_console(sys.stderr if fmt != "table" else None)  # json / csv: stdout holds the table alone
    block = int(block)
    if not kernels:
        kernels = ["triton-varblock"] if varblock else ["triton", "triton-sparse"]
        # the Gluon forward joins by default where it runs (sm_90); elsewhere it is not asked for
        gluon = at.TUNABLES["triton-gluon"]
        if not varblock and not interpreted and not gluon.device_reason(torch.device(device)):
            kernels.append("triton-gluon")
    for name in kernels:
        if name not in at.TUNABLES:
            raise click.BadParameter(f"unknown kernel {name!r}; tunable: {', '.join(at.TUNABLES)}", param_hint="--kernel")
    masks = masks or list(run.DEFAULT_MASKS)
    for m in masks:
        if m not in MASK_NAMES:
            raise click.BadParameter(f"unknown mask {m!r}; valid masks: {', '.join(MASK_NAMES)}", param_hint="--masks")
    if any(not 0 < d <= 1 for d in densities):
        raise click.BadParameter(f"densities must lie in (0, 1], got {densities}", param_hint="--densities")
    dts = []
    for d in dtypes:
        if d not in ("bfloat16", "float16"):
            raise click.BadParameter(f"dtype must be bfloat16 or float16, got {d!r}", param_hint="--dtypes")
        dts.append(getattr(torch, d))
    check = interpreted and not dry_run
    if check:
        con.print(f"[bold yellow]{INTERPRETER_BANNER}[/bold yellow]")
        asked = block, mean_block
        c = CPU_CASES
        seqlens, head_dims, dts, heads = [c["seqlen"]], [c["head_dim"]], [c["dtype"]], c["heads"]
        block, mean_block, densities = min(block, CPU_BLOCK), min(mean_block, CPU_MEAN_BLOCK), densities[:1]
        for line in _cpu_plan(kernels, asked, block, mean_block):
            con.print(line, markup=False, highlight=False)
    stop = Stop(budget_minutes or None, t_start)

    # what runs: (kernel, its block, its cases), each kernel that cannot run skipped with the reason
    plan, skipped = [], []
    for name in kernels:
        tunable = at.TUNABLES[name]
        tblock = mean_block if tunable.block_meaning == "mean block" else block
        mine = run.cases_for(tunable, tblock, masks, seqlens, head_dims, dts, heads, densities)
        why = "" if mine else f"none of the masks {', '.join(masks)} runs on it"
        if not why and tunable.device_reason and not dry_run:
            why = tunable.device_reason(torch.device(device))
        if why:
            con.print(f"[yellow]{name}: skipped ({why})[/yellow]")
            skipped.append((name, why))
        else:
            plan.append((tunable, tblock, mine))

    # one table (one JSON array) for every kernel: what the command prints before its summary
    table = dict(rows=[], columns=[], title="", headers={})
    runs, seconds, current = [], dict(search=0.0, vendors=0.0), None
    checks = dict(planned=sum(len(m) * len(t.groups) for t, _, m in plan), run=0, wrong=0)
    tuned_kernels = []  # per kernel tuned: what its vendors, rows and summary need
    vendor_done, vendor_memo = {}, {}  # (kernel, class) -> (case label, {mode: {vendor: value}}); per case
    try:
        with stop.on_ctrl_c() if not dry_run else contextlib.nullcontext():
            # every candidate's kernels compile on the host's cores while the GPU times those built
            # (on a GPU: elsewhere nothing compiles for a device)
            ahead_workers = compile_workers if torch.device(device).type == "cuda" and not (dry_run or check) else 0
            with CompileAhead(ahead_workers) as ahead:
                for tunable, tblock, mine in plan if ahead.workers else ():
                    run.submit_compiles(ahead, tunable, mine, tblock, device, exhaustive=exhaustive, switches=switches,
                                        force=force, budget_minutes=stop.minutes)
                if not (dry_run or check):
                    # the vendors first, on one share of the budget: the GPU times them while the
                    # workers build our candidates, which the search would otherwise wait for
                    t0, vendor_stop = time.monotonic(), stop.share(len(plan) + 1)
                    for tunable, tblock, mine in plan:
                        current = tunable.name
                        vendor_done.update(_measure_vendors(con, tunable, tblock, mine, _vendor_names(tunable, vendors),
                                                            device, vendor_stop, force, vendor_memo))
                    current = None
                    seconds["vendors"] += time.monotonic() - t0
                for n_done, (tunable, tblock, mine) in enumerate(plan):
                    name = current = tunable.name
                    if dry_run:
                        con.print(f"{name} at {tunable.block_meaning} {tblock}: {plural(len(mine), 'case')}")
                        _dry_run_rows(table, tunable, mine, tblock, exhaustive, verbose or fmt != "table", switches)
                        continue
                    if check:
                        con.print(f"checking {name} at {tunable.block_meaning} {tblock}: {plural(len(mine), 'case')} × "
                                  f"{plural(len(tunable.groups), 'key group')}")
                        _interpreter_rows(table, tunable, mine, tblock, stop, checks)
                        continue
                    con.print(f"tuning [bold]{name}[/bold] at {tunable.block_meaning} {tblock} on "
                              f"{_device_name(device)} ({plural(len(mine), 'case')}) -> {tuned.cache_path()}")
                    t0 = time.monotonic()
                    summaries = _tune_with_progress(con, tunable, mine, tblock, device, exhaustive,
                                                    stop.share(len(plan) - n_done), force, no_write, verbose,
                                                    switches, ahead)
                    seconds["search"] += time.monotonic() - t0
                    classes = run.group_classes(tunable, mine, tblock)
                    for s in summaries:
                        got = vendor_done.get((name, s["problem_class"]))
                        if got is not None:
                            run.record_vendors(tunable, s, classes[s["problem_class"]], tblock, *got, device,
                                               write=not no_write)
                    reused = [s for s in summaries if s.get("reused")]
                    if reused:
                        con.print(f"reused the cache for {len(reused)} of {plural(len(summaries), 'problem class', 'problem classes')} "
                                  f"(tuned on these cases before; --force tunes them again)")
                    tuned_kernels.append((tunable, tblock, mine, summaries))
                    current = None
    except KeyboardInterrupt:  # a second Ctrl-C: the kernel under way is cut where it stood
        if current and not check:
            skipped.append((current, "stopped at once by a second Ctrl-C; the classes it finished are in the cache"))
    for tunable, tblock, mine, summaries in tuned_kernels:
        vendor_names = _vendor_names(tunable, vendors)
        settled = {s["problem_class"] for s in summaries}
        runs.append(dict(summaries=summaries, vendors=vendor_names, modes=set(tunable.groups.values()),
                         why_no_vendors="not timed (Ctrl-C)" if stop.interrupted else "not timed (the budget)",
                         left={c: [m.label for m in ms] for c, ms in run.group_classes(tunable, mine, tblock).items()
                               if c not in settled}))
        table["rows"] += summary_rows(summaries, vendor_names)
        table["columns"] = list(dict.fromkeys(table["columns"] + SUMMARY_COLUMNS + vendor_names
                                              + ["source", "tuned_config"]))
        table["headers"], table["title"] = SUMMARY_HEADERS, ("autotune: TFLOP/s (docs/masks.md §5), default vs "
                                                             "tuned (geometric means over a class's cases), vendors on its heaviest case")
        if out:
            with open(out, "a") as f:
                for s in summaries:
                    f.write(json.dumps(s, default=str) + "\n")
    if table["rows"]:
        emit(table["rows"], table["columns"], fmt=fmt, title=table["title"], headers=table["headers"])
    if dry_run:
        return
    elapsed = time.monotonic() - t_start
    if check:
        lines = [_cpu_summary(checks, [t.name for t, _, _ in plan], stop, elapsed)]
    else:
        lines = summary_lines(runs, skipped, stop, seconds, _device_name(device),
                              None if no_write else str(tuned.cache_path()))
    for line in lines:
        con.print(line, markup=False, highlight=False, soft_wrap=True)
    if stop.interrupted:
        sys.exit(130)
    if check and checks["wrong"]:
        sys.exit(1)  # a kernel disagreed with the fp64 reference: the run failed, whatever else it printed


def _vendor_names(tunable, vendors) -> list[str]:
    """The vendors a kernel is compared with: ``--vendors`` (``none``: none), else the kernel's own list."""
    return [] if vendors == ["none"] else (vendors or list(tunable.vendors))


def _device_name(device) -> str:
    """The GPU's name, or ``CPU``."""
    return torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "CPU"


def _cpu_plan(kernels, asked: tuple[int, int], block: int, mean_block: int) -> list[str]:
    """What a run on a CPU does instead of tuning, in words: the cases, the block, the candidates, the cache."""
    c = CPU_CASES
    lines = [f"On a CPU autotune checks our kernels instead of tuning them, on small cases the interpreter runs "
             f"in seconds (S = {c['seqlen']}, D = {c['head_dim']}, float16, heads {c['heads'][0]}:{c['heads'][1]}, "
             f"one density):"]
    from . import autotune as at

    meanings = {at.TUNABLES[k].block_meaning for k in kernels}
    if "block" in meanings and block != asked[0]:
        lines.append(f"  block {block} instead of {asked[0]}: a {c['seqlen']}-token sequence then spans "
                     f"{c['seqlen'] / block:g} blocks, so the kernels' block loops run over several blocks")
    if "mean block" in meanings and mean_block != asked[1]:
        lines.append(f"  mean block {mean_block} instead of {asked[1]}: a {c['seqlen']}-token sequence then spans "
                     f"several variable blocks")
    lines.append("  candidates: each key group's first one (the config the GPU search screens first), over the "
                 "kernel's default config, on every case, against an fp64 reference; the other candidates are not run")
    lines.append("  no autotune cache is written: it holds the configs a GPU measured fastest, and the interpreter's "
                 "timings say nothing about a GPU's speed")
    return lines


def _cpu_summary(checks: dict, kernels: list[str], stop: Stop, seconds: float) -> str:
    """The closing line of a run on a CPU: how many checks ran and passed, what was not done."""
    ran, planned, wrong = checks["run"], checks["planned"], checks["wrong"]
    text = (f"autotune on a CPU: {ran} of {plural(planned, 'check')} ran ({', '.join(kernels) or 'no kernel'}, "
            f"each key group's first candidate), {ran - wrong} ok, {wrong} wrong; nothing timed, no cache written; "
            f"{seconds:.0f} s")
    return text + (f"; stopped by {stop.why}" if stop.why and ran < planned else "")


def _tune_with_progress(con, tunable, cases, block, device, exhaustive, stop, force, no_write, verbose,
                        switches, ahead=None):
    from . import autotune_run as run
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    todo = {cls: m for cls, m in run.group_classes(tunable, cases, block).items()
            if force or run.cached_row(tunable, m, block, device, getattr(stop, "minutes", None)) is None}
    total = sum(run.planned_work(tunable, m, block, exhaustive, switches) for m in todo.values())
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("timed runs"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=con, transient=False, disable=total == 0) as bar:
        task = bar.add_task(f"{tunable.name}", total=max(total, 1))

        def on_measure(cls, round_, cand, case, tf, err):
            bar.update(task, advance=1, description=f"{tunable.name} {cls.split('|', 5)[-1]} {round_}")
            if verbose and cand:
                result = f"{tf:.1f} TFLOP/s" if tf is not None else err
                bar.console.print(f"  {round_:<14} {case.label:<40} {fmt_cfg(cand)} -> {result}")

        summaries = run.tune(tunable, cases, block, device, exhaustive=exhaustive, deadline=stop, force=force,
                             switches=switches, on_measure=on_measure, write=not no_write, ahead=ahead)
        if not stop() and not any(s["search"].get("stopped_by_deadline") for s in summaries):
            # the total counts the most timed runs; the default's timings reused make fewer
            bar.update(task, completed=max(total, 1))
        return summaries


def _measure_vendors(con, tunable, block, cases, vendor_names, device, stop, force, memo) -> dict:
    """Every vendor on each class's heaviest case (``run.screen_case``), in each mode the kernel
    tunes; classes whose cache row already holds them or that this run reuses from the cache are
    left out (unless ``force``), and nothing
    more is timed once ``stop`` says so. Returns ``{(kernel, class): (case label, {mode: {vendor:
    TFLOP/s or why not}})}``; ``memo`` shares a case's numbers among kernels tuned on it."""
    from . import autotune_run as run

    out = {}
    if not vendor_names:
        return out
    for cls, members in run.group_classes(tunable, cases, block).items():
        # a class this run reuses from the cache keeps the vendor numbers its tuning run timed
        if not force and (run.vendors_cached(tunable, members, block, vendor_names, device)
                          or run.cached_row(tunable, members, block, device, getattr(stop, "minutes", None)) is not None):
            continue
        case = run.screen_case(members)
        modes = sorted(set(tunable.groups.values()), reverse=True)
        if stop() and not all((v, case.label, m) in memo for v in vendor_names for m in modes):
            continue  # past the vendors' share: only what another kernel's cases already measured
        with con.status(f"timing {', '.join(vendor_names)} on {case.label} while our candidates compile"):
            got = {mode: run.vendor_tflops([case], mode, vendor_names, device, memo) for mode in modes}
        out[(tunable.name, cls)] = (case.label, got)
    return out


def _dry_run_rows(table, tunable, cases, block, exhaustive, with_configs, switches):
    from . import autotune_run as run
    from .search import planned_measurements

    for cls, members in run.group_classes(tunable, cases, block).items():
        for group, mode in tunable.groups.items():
            cands = run.search_space(tunable, group, block, members[0].head_dim, switches,
                                     run.class_default(tunable, members), exhaustive)
            table["rows"].append(dict(
                problem_class=cls, cases="; ".join(c.label for c in members), group=group, timed_on=mode,
                candidates=len(cands), timed_runs=planned_measurements(len(cands), len(members), exhaustive=exhaustive),
                configs=" | ".join(fmt_cfg(c) for c in cands)))
    table["columns"] = ["problem_class", "cases", "group", "timed_on", "candidates", "timed_runs"] + (
        ["configs"] if with_configs else [])
    table["title"] = "what autotune would tune (dry run; -v lists every candidate config)"


def _interpreter_rows(table, tunable, cases, block, stop, checks):
    """On a CPU: each key group's first candidate must compute the reference's answer (``checks``
    counts the checks run and wrong; ``stop``: Ctrl-C or the budget ends them between two checks)."""
    from ..reference import naive_attention

    rows = table["rows"]
    table["columns"] = ["kernel", "case", "group", "config", "max_err", "status"]
    table["headers"] = {"max_err": "max |err| vs fp64"}
    table["title"] = "autotune on a CPU [INTERPRETER: correctness of each key group's first candidate, no speed]"
    for case in cases:
        q, k, v, do = case.inputs("cpu")
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = naive_attention(q64, k64, v64, case.mask)
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
        for group, mode in tunable.groups.items():
            if stop():
                return
            cand = tunable.candidates(group, block, case.head_dim)[0]
            cfg = {**tunable.default(case.head_dim, case.dtype, case.mask, group=case.heads_q // case.heads_kv), **cand}
            out = tunable.run(q, k, v, case.mask, cfg)
            if mode == "fwd":
                err = (out.double() - ref).abs().max().item()
            else:  # the backward groups are checked on the gradients they compute
                grads = torch.autograd.grad(out, (q, k, v), do)
                err = max((g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads))
            ok = err < 2e-2
            checks["run"] += 1
            checks["wrong"] += not ok
            rows.append(dict(kernel=tunable.name, case=case.label, group=group, config=fmt_cfg(cand), max_err=f"{err:.2e}",
                             status="ok" if ok else "WRONG"))

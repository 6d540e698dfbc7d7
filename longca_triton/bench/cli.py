"""The ``bench``, ``plot``, ``report`` and ``doctor`` commands (thin: the library does the work).

The project's console script adds them with ``main.add_command(...)`` (see ``COMMANDS``); this
module also runs on its own: ``python -m longca_triton.bench.cli bench dense --preset smoke``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sys
from pathlib import Path

import click

from ..cli_errors import OneLineErrors
from ..output import emit, format_option

__all__ = ["COMMANDS", "bench", "doctor", "heads_callback", "plot", "report"]


def heads_callback(ctx, param, value):
    """click callback of a ``--heads Hq:Hkv`` option: ``(Hq, Hkv)``, Hq a positive multiple of Hkv."""
    try:
        hq, hkv = (int(x) for x in value.split(":"))
    except ValueError:
        raise click.BadParameter(f"expected Hq:Hkv such as 64:8, got {value!r}") from None
    if hq < 1 or hkv < 1 or hq % hkv:
        raise click.BadParameter(f"query heads must be a positive multiple of KV heads, got {value!r}")
    return hq, hkv


def _console(err: bool = False):
    """The console of the messages: stdout, or stderr (``err``) where stdout holds json or csv."""
    from rich.console import Console

    stream = sys.stderr if err else sys.stdout
    return Console(stderr=err, highlight=False, width=None if stream.isatty() else 160)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "unknown"


# ---------------------------------------------------------------------------- bench
@click.group("bench")
def bench():
    """Run benchmark sweeps (results are appended to a resumable JSONL store).

    \b
    Example:
      longca-triton bench dense --config experiments/dense_quick.toml
      longca-triton bench dense --preset smoke          # tiny CPU grid
      longca-triton bench sparse --config experiments/sparse.toml --dry-run
      longca-triton bench varblock --config experiments/varblock.toml
    """


def _grid_options(kind: str, example_config: str):
    """The options every grid command shares (dense, sparse, varblock)."""
    opts = [
        click.option("--config", "config", type=click.Path(dir_okay=False, path_type=Path), help=f"TOML experiment file (e.g. {example_config})."),
        click.option("--preset", type=click.Choice(["smoke"]), help="A built-in grid instead of a file; 'smoke' = tiny CPU-friendly sizes."),
        click.option("--masks", help="Comma-separated mask names (override), e.g. full,causal,causal_document."),
        click.option("--param", "params", multiple=True, metavar="[MASK.]KEY=V1[,V2...]",
                     help="Mask parameter override, repeatable; several values sweep it (e.g. --param block=64,128 --param density=0.5). "
                          "Without MASK. it applies to every mask of the grid that has KEY."),
        click.option("--seqlens", help="Comma-separated sequence lengths, e.g. 4K,16K or 4096,16384."),
        click.option("--backends", help="Comma-separated backend names (see `longca-triton doctor`); one of ours may carry "
                                        "a launch config over its defaults, compared like a backend: "
                                        "'triton-varblock,triton-varblock{\"ragged_bwd\":false}'."),
        click.option("--mode", "modes", help="Comma-separated modes: fwd, bwd, fwd_bwd."),
        click.option("--heads", help="Comma-separated query:kv head counts, e.g. 64:8 or 64:8,64:64."),
        click.option("--head-dim", "head_dims", help="Comma-separated head dims, D or D_qk/D_v, e.g. 64,96,128,192/128."),
        click.option("--dtype", "dtypes", help="Comma-separated dtypes: bfloat16 (bf16), float16 (fp16), float32 (fp32)."),
        click.option("--batch", type=click.IntRange(min=1), help="Batch size."),
        click.option("--seed", type=int, help="Seed of masks and inputs."),
        click.option("--warmup-ms", type=click.FloatRange(min=0), help="Warm-up time per point (ms)."),
        click.option("--rep", type=click.IntRange(min=1), help="Timed repetitions per point (at most)."),
        click.option("--max-ms", type=click.FloatRange(min=0), help="Cap on the timed repetitions' total time per point (ms)."),
        click.option("--check/--no-check", "check", default=None,
                     help="Check each backend against the float32 reference before timing it, or skip the check. "
                          "Default: the experiment's [timing] check."),
        click.option("--interleave/--sequential", "interleave", default=None,
                     help="Time a problem's backends together, repetition by repetition (the default: each sees the "
                          "same GPU clock), or one after the other. Default: the experiment's [timing] interleave."),
        click.option("--out", type=click.Path(file_okay=False, path_type=Path), help="Output directory (results.jsonl, plots/, report.md). Default: results/<experiment>-<gpu>."),
        click.option("--retry-errors", is_flag=True, help="Re-run points whose earlier row is an error or oom."),
        click.option("--max-minutes", type=click.FloatRange(min=0), help="Stop (cleanly, resumable) after this many minutes."),
        click.option("--no-plots", is_flag=True, help="Write results and the report, no plots."),
        click.option("--dry-run", is_flag=True, help="Print the resolved grid (every point group) and exit; runs nothing, on any machine."),
    ]

    def deco(f):
        for o in reversed(opts):
            f = o(f)
        return format_option(f)  # the closing table of this run (the results file is JSONL either way)

    return deco


@bench.command("dense")
@_grid_options("dense", "experiments/dense.toml")
def bench_dense(**opts):
    """Dense-kernel sweep: masks × S × heads × head dim × dtype × mode × backends.

    Every point is checked against the reference, timed (CUDA events, L2 flush, median and
    p20/p80), its peak memory recorded, and appended to OUT/results.jsonl; rerunning the same
    command resumes. Without a GPU the 'smoke' preset runs instead (reference backends and the
    Triton interpreter), and says so.

    \b
    Examples:
      longca-triton bench dense --config experiments/dense.toml
      longca-triton bench dense --config experiments/dense_quick.toml --backends sdpa-cudnn,flex --seqlens 16K
      longca-triton bench dense --config experiments/dense.toml --masks causal --heads 64:8 --mode bwd
      longca-triton bench dense --preset smoke --out /tmp/smoke
    """
    _run_bench("dense", **opts)


@bench.command("sparse")
@_grid_options("sparse", "experiments/sparse.toml")
def bench_sparse(**opts):
    """Uniform block-sparse sweep: block size × density (swept mask parameters) × S × heads ×
    head dim × dtype × mode × backends, on the block_sparse mask (docs/masks.md §3 #13).

    List-valued mask parameters in the file are swept (`block = [64, 128]`), and "Hkv" / "Hq"
    stand for the point's head counts (`patterns = "Hkv"`: one pattern per KV head). TFLOP/s
    count the kept blocks only (docs/masks.md §5). Plots get a panel per (block, density). Without a
    GPU the 'smoke' preset runs instead (tiny sizes, the Triton interpreter); --dry-run always
    shows the file's grid.

    \b
    Examples:
      longca-triton bench sparse --config experiments/sparse.toml --dry-run
      longca-triton bench sparse --config experiments/sparse.toml --out experiments/results/h100/sparse
      longca-triton bench sparse --config experiments/sparse.toml --param block=128 --param density=0.5 --mode fwd
      longca-triton bench sparse --preset smoke --out /tmp/sparse-smoke
    """
    _run_bench("sparse", **opts)


@bench.command("varblock")
@_grid_options("varblock", "experiments/varblock.toml")
def bench_varblock(**opts):
    """Variable-block sparse sweep: mean block × density (swept) × S × heads × head dim × dtype ×
    mode × backends, on the varblock_sparse mask (docs/masks.md §3 #14).

    Parameters may refer to each other (`min_block = "block/2"`) and to the heads
    (`patterns = "Hkv"`). Without a GPU the 'smoke' preset runs instead; --dry-run always shows
    the file's grid.

    \b
    Examples:
      longca-triton bench varblock --config experiments/varblock.toml --dry-run
      longca-triton bench varblock --config experiments/varblock.toml --out experiments/results/h100/varblock
      longca-triton bench varblock --preset smoke --out /tmp/varblock-smoke
      longca-triton bench varblock --config experiments/varblock.toml --param block=256 --mode bwd \\
          --backends 'triton-varblock,triton-varblock{"ragged_bwd":false}'   # a launch config beside the default
    """
    _run_bench("varblock", **opts)


def _run_bench(kind, config, preset, masks, params, seqlens, backends, modes, heads, head_dims, dtypes, batch, seed,
               warmup_ms, rep, max_ms, check, interleave, out, retry_errors, max_minutes, no_plots, dry_run, fmt="table"):
    import torch

    con = _console(err=fmt != "table" and not dry_run)  # a run's json / csv table alone on stdout
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported
    from longca_triton.adapters import canonical_name, list_backends
    from longca_triton.adapters.base import split_config_name

    from .config import ConfigError, load_experiment
    from .config import preset as get_preset
    from .presets import OPTIONAL_PRESET_BACKENDS, SMOKE_PRESET

    if config is None and preset is None:
        raise click.UsageError(f"give --config FILE (e.g. experiments/{kind}.toml) or --preset smoke")
    overrides = dict(masks=masks, seqlens=seqlens, backends=backends, modes=modes, heads=heads, head_dims=head_dims,
                     dtypes=dtypes, batch=batch, seed=seed, warmup_ms=warmup_ms, rep=rep, max_ms=max_ms,
                     params=list(params))
    known = {b.name for b in list_backends()}

    def prepared(exp, source):
        """``exp`` with the command line's overrides, its unregistered backends dropped (said), validated."""
        exp = exp.with_overrides(**overrides)
        if check is not None:
            exp.check = check
        if interleave is not None:
            exp.interleave = interleave
        if exp.preset and not backends:
            missing = [b for b in exp.backends if b not in known and b in OPTIONAL_PRESET_BACKENDS]
            if missing:
                con.print(f"[dim]not registered in this build, skipped: {', '.join(missing)}[/]")
            exp.backends = [b for b in exp.backends if b in known]
        elif source is not None and not backends:
            missing = [b for b in exp.backends if split_config_name(canonical_name(b))[0] not in known]
            if missing:
                con.print(f"[yellow]backends listed in {source} but not registered here, skipped: {', '.join(missing)}[/]")
                exp.backends = [b for b in exp.backends if split_config_name(canonical_name(b))[0] in known]
        try:
            return exp.validate(known_backends=known)
        except ConfigError as e:
            if source is None or str(source) in str(e):
                raise
            given = any(v not in (None, []) for v in overrides.values()) or check is not None or interleave is not None
            raise ConfigError(f"{source}{' with the options given' if given else ''}: {e}") from None

    try:
        exp = None
        if config is not None:  # read and checked on every machine, before anything runs
            exp = load_experiment(config)
            if exp.kind != kind:
                raise ConfigError(f"{config} is a {exp.kind!r} experiment ([experiment] kind); run it with "
                                  f"`longca-triton bench {exp.kind}`")
            exp = prepared(exp, config)
        if preset or (not on_gpu and not dry_run):
            if preset is None:
                con.print(f"[bold yellow]No CUDA GPU here:[/] {config} is valid; running the [bold]smoke[/] preset "
                          f"(tiny sizes, reference backends, Triton interpreter) instead. Timings are not performance "
                          f"numbers.")
            exp = prepared(get_preset(SMOKE_PRESET[kind] if preset in (None, "smoke") else preset), None)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None

    from .store import ResultStore, collect_env

    env = collect_env()
    if out is None:
        out = Path("results") / f"{_slug(exp.name)}-{_slug(env.get('gpu') or 'cpu')}"
    store = ResultStore(out / "results.jsonl")

    device = "cuda" if on_gpu else "cpu"
    con.print(f"[bold]{exp.name}[/] ({exp.kind}): {exp.grid_summary()} on "
              f"[bold]{env.get('gpu') or 'CPU'}[/]" + (" [yellow](Triton interpreter)[/]" if env.get("interpreted") else ""))
    con.print(f"results: {store.path}" + (f" (resuming: {len(store.rows())} rows already there)" if store.path.exists() else ""))
    if dry_run:
        con.print_json(json.dumps(exp.to_dict()))
        _print_points(con, exp)
        return
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "commands.txt", "a") as f:
        f.write(shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) + "\n")
    with open(out / "experiment.json", "w") as f:
        json.dump(exp.to_dict(), f, indent=1)

    signal.signal(signal.SIGTERM, _terminate)  # a kill (timeout, scheduler) stops cleanly like Ctrl-C
    # why explicit: a process started in the background by a non-interactive shell inherits SIGINT
    # as ignored, and Python then never installs its KeyboardInterrupt handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    result = _run_with_progress(con, exp, store, device, retry_errors, max_minutes)
    _summary_table(con, result.rows, fmt)
    if result.interrupted:
        con.print(f"[bold red]Interrupted[/]: {len(result.rows)} points written this run, {result.remaining} left. "
                  f"Rerun the same command to resume; finished points are not redone.")
        sys.exit(130)
    if result.aborted:
        con.print(f"[bold red]Sweep stopped[/]: the CUDA context is unusable after `{result.aborted[:200]}`. "
                  "Rerun the same command to resume from the next point.")
    elif result.budget_hit:
        con.print(f"[yellow]Time budget reached[/]: {result.remaining} points left; rerun to resume.")
    _write_outputs(con, store, out, no_plots)
    if result.aborted:
        sys.exit(3)


def _print_points(con, exp):
    """The grid in sweep order, one line per problem (mask variant × S × heads × D × dtype) with
    its resolved mask parameters; modes × backends run on each."""
    from rich.markup import escape

    from .runner import plan_points

    groups = plan_points(exp)
    con.print(f"[bold]{len(groups)} problems[/] × {len(exp.modes)} modes ({', '.join(exp.modes)}) × "
              f"{len(exp.backends)} backends ({', '.join(exp.backends)}) = {exp.num_points()} points, in sweep order:")
    for i, ((mname, S, hq, hkv, D, dt, vi), pts) in enumerate(groups, 1):
        params = exp.params_for(mname, S, (hq, hkv), vi)
        shown = ", ".join(f"{k}={v}" for k, v in params.items() if not isinstance(v, (list, tuple, dict)))
        con.print(f"  {i:4d}  S={S:<7d} {escape(exp.variant_label(mname, vi)):<40s} heads {hq}:{hkv}  D={D} {dt}"
                  + (f"  ({shown})" if shown else "") + f"  {len(pts)} points", soft_wrap=True)


def _terminate(signum, frame):
    raise KeyboardInterrupt


def _run_with_progress(con, exp, store, device, retry_errors, max_minutes):
    from rich.markup import escape
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from .report import mask_label, short_status
    from .runner import run_experiment
    from .store import on_cpu

    with Progress(TextColumn("[progress.description]{task.description}", table_column=None), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=con, transient=False) as bar:
        task = bar.add_task("starting", total=None)

        def progress(advance, description, total):
            if total is not None:
                bar.update(task, total=total)
            bar.update(task, advance=advance, description=description[:70].ljust(70))

        done = [0]

        def on_row(row):  # without a terminal (logs, CI) the bar is not drawn: one line per point instead
            done[0] += 1
            if not con.is_terminal:
                t = row.get("tflops")
                speed = (f" {row['time_ms']:.3f} ms {short_status(row)} TFLOP/s" + (" (CPU)" if on_cpu(row) else "")
                         if row.get("time_ms") is not None and t is not None else "")
                con.print(f"[{done[0]}] {row['backend']} {escape(mask_label(row))} S={row['seqlen']} {row['heads_q']}:{row['heads_kv']} "
                          f"{row['mode']}: {escape(row['status'][:160])}{speed}", soft_wrap=True)

        return run_experiment(exp, store, device=device, retry=("error", "oom") if retry_errors else (),
                              max_minutes=max_minutes, progress=progress, on_row=on_row)


def _summary_table(con, rows, fmt="table"):
    if not rows:
        con.print("[dim]nothing new was run (every point was already in the results file)[/]")
        return
    from rich.markup import escape

    from .report import mask_label, short_status
    from .store import CPU_CAVEAT, CPU_TAG, on_cpu, status_kind

    backends = []
    for r in rows:
        if r["backend"] not in backends:
            backends.append(r["backend"])
    cells, order = {}, []
    for r in rows:
        k = (mask_label(r), r["seqlen"], f"{r['heads_q']}:{r['heads_kv']}", r["mode"])
        if k not in cells:
            cells[k] = dict(mask=k[0], S=k[1], heads=k[2], mode=k[3])
            order.append(k)
        cells[k][r["backend"]] = short_status(r)
    cpu = any(on_cpu(r) for r in rows)
    emit([cells[k] for k in order], ["mask", "S", "heads", "mode", *backends], fmt=fmt,
         title="this run: TFLOP/s (or status)" + (f" [{CPU_TAG}]" if cpu else ""))
    if cpu:
        con.print(f"[yellow]{CPU_CAVEAT}[/yellow]")
    errors = [r for r in rows if status_kind(r) == "error"]
    for r in errors[:10]:
        con.print(f"[red]{r['backend']} {escape(mask_label(r))} S={r['seqlen']} {r['mode']}[/]: {escape(r['status'][:300])}")


def _write_outputs(con, store, out: Path, no_plots: bool):
    from .plot import make_plots
    from .report import markdown_report

    rows = store.rows()
    if store.skipped_lines:
        con.print(f"[yellow]{store.skipped_lines} truncated/garbled line(s) in {store.path} ignored[/]")
    (out / "report.md").write_text(markdown_report(rows, source=str(store.path)))
    con.print(f"report: {out / 'report.md'}")
    if not no_plots and rows:
        files = make_plots(rows, out / "plots")
        con.print(f"plots: {len(files)} files in {out / 'plots'}")


# ---------------------------------------------------------------------------- plot / report / doctor
@click.command("plot")
@click.argument("results", type=click.Path(exists=True, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Directory for the PNG files.")
def plot(results, out):
    """Plot a results file (.jsonl or .jsonl.gz, or a folder holding results.jsonl or
    results.jsonl.gz): TFLOP/s and peak memory against S (a panel per mask, a line per backend,
    fwd and bwd separately) and a backend × mask heat map of support and speed.

    \b
    Example:
      longca-triton plot results/dense-h100/results.jsonl --out results/dense-h100/plots
    """
    from .plot import make_plots
    from .report import load_rows

    try:
        rows = load_rows(results)
    except (FileNotFoundError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    files = make_plots(rows, out)
    con = _console()
    for f in files:
        con.print(str(f))


@click.command("report")
@click.argument("results", type=click.Path(exists=True, path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write the report here instead of stdout.")
@click.option("--title", help="Report title (markdown).")
@format_option
def report(results, out, title, fmt):
    """Report of a results file (.jsonl or .jsonl.gz, or a folder holding results.jsonl or
    results.jsonl.gz). As a table (the default): markdown with the environment, a TFLOP/s table per
    mode and head layout (backends as columns), why points were not measured, and every
    measurement. As json or csv: one record per point (its latest row), for scripts.

    \b
    Examples:
      longca-triton report results/dense-h100/results.jsonl > report.md
      longca-triton report results/dense-h100 --format csv > points.csv
    """
    from .report import REPORT_COLUMNS, load_rows, markdown_report, report_rows

    try:
        rows = load_rows(results)
    except (FileNotFoundError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    if fmt == "table":
        text = markdown_report(rows, title=title, source=str(results))
    else:
        from ..output import render

        text = render(report_rows(rows), REPORT_COLUMNS, fmt=fmt)
    if out:
        out.write_text(text)
        click.echo(f"wrote {out}", err=fmt != "table")
    else:
        click.echo(text, nl=False)


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (everything doctor knows).")
@format_option
def doctor(as_json, fmt):
    """Show the GPU, driver, CUDA, torch, Triton, cuDNN and vendor versions, and every backend:
    available or why not.

    \b
    Examples:
      longca-triton doctor
      longca-triton doctor --format csv      # the backends table, for scripts
    """
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .doctor import doctor_info, env_rows

    info = doctor_info()
    if as_json:
        click.echo(json.dumps(info, indent=1, default=str))
        return
    if fmt == "table":
        emit(env_rows(info["env"]), ["what", "value"], title="environment")
    rows = [{"backend": b["name"], "available": "yes" if b["available"] else "no", "modes": ",".join(b["modes"]),
             "lse": "yes" if b["returns_lse"] else "no",
             "why_not_or_what": b["reason"] if not b["available"] else b["description"]} for b in info["backends"]]
    emit(rows, ["backend", "available", "modes", "lse", "why_not_or_what"], fmt=fmt, title="backends",
         headers={"why_not_or_what": "why not / what"})


COMMANDS = [bench, plot, report, doctor]


@click.group(cls=OneLineErrors)
def cli():
    """Stand-alone entry for the benchmark commands (the package's `longca-triton` adds them too)."""


for _c in COMMANDS:
    cli.add_command(_c)

if __name__ == "__main__":
    cli()

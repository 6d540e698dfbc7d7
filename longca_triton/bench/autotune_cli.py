"""``longca-triton autotune``: the command over :mod:`longca_triton.bench.autotune`.

What a user sees: one line saying what is tuned and where the cache is, a progress bar (timed runs
done / planned, elapsed, ETA), then one summary row per problem class and mode, in words (kernel,
block, sequence range, masks or densities, mode), with the default and tuned TFLOP/s and every
vendor measured on the same cases. ``-v`` adds a line per timed candidate. A class already in the
cache (same GPU, Triton, cases) is reused and said so; ``--force`` tunes it again.
"""

from __future__ import annotations

import json
import sys
import time

import click
import torch

from ..cli_values import SEQLENS
from ..output import emit, format_option
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


def _fmt_cfg(cfg: dict) -> str:
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in cfg.items())


def _class_words(cls: str, cases: list[str]) -> dict:
    """``triton|D=128|bfloat16|G=8|masked|S<=16K|block=64`` in words, with the masks it covers."""
    kernel, d, dtype, g, mclass, bucket, block = cls.split("|")
    names = sorted({c.split(" S=")[0] for c in cases})
    return dict(kernel=kernel, block=block.split("=")[1], S=bucket.replace("S<=", "S ≤ ").replace("S>", "S > "),
                masks=", ".join(names), head=f"{d} {dtype} {g}", problem_class=cls)


def summary_rows(summaries: list[dict], vendors: list[str]) -> list[dict]:
    rows = []
    for s in summaries:
        words = _class_words(s["problem_class"], s["cases"])
        for mode, tuned in sorted(s["tuned_tflops"].items()):
            default = s["default_tflops"][mode]
            row = dict(words, mode=mode, default=round(default, 1), tuned=round(tuned, 1),
                       x_default=round(tuned / default, 3) if default else None,
                       source="cache" if s.get("reused") else s["search"]["method"],
                       cases="; ".join(s["cases"]),
                       tuned_config=_fmt_cfg({k: v for k, v in s["tuned"].items()
                                              if s.get("default", {}).get(k) != v}) or "(= default)")
            for v in vendors:
                got = s.get("vendors", {}).get(mode, {}).get(v)
                row[v] = round(got, 1) if isinstance(got, float) else (got or "not measured")
            rows.append(row)
    return rows


SUMMARY_COLUMNS = ["kernel", "block", "S", "masks", "mode", "default", "tuned", "x_default"]
SUMMARY_HEADERS = {"x_default": "× default", "S": "sequences", "default": "default TFLOP/s", "tuned": "tuned TFLOP/s"}


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
@click.option("--budget-minutes", type=click.FloatRange(min=0, min_open=True), default=None,
              help="stop searching after this long; every key group then decides among what it measured")
@click.option("--exhaustive", is_flag=True, help="time every candidate on every case (the slow search halving replaced)")
@click.option("--search-switches", "switches", is_flag=True,
              help="also search warp_specialize=True (a no-op on sm_90 with Triton 3.6, some configs fail to compile)")
@click.option("--force", is_flag=True, help="tune classes the cache already holds for these cases again")
@click.option("--dry-run", is_flag=True, help="list the problem classes and candidate configs, run nothing")
@click.option("--no-write", is_flag=True, help="do not update the config cache")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="also append the summaries as JSON lines")
@click.option("-v", "--verbose", is_flag=True, help="a line per timed candidate")
@format_option
def autotune(block, varblock, mean_block, kernels, masks, densities, seqlens, head_dims, dtypes, heads, vendors,
             budget_minutes, exhaustive, switches, force, dry_run, no_write, out, verbose, fmt):
    """Tune our kernels' launch configs for one tile/block size and cache the winners.

    `--block N` tunes the dense kernel (triton: inner tile N) and the uniform block-sparse kernel
    (triton-sparse: masks of block N, one pattern per KV head, at each of --densities);
    `--varblock` tunes triton-varblock on variable-block masks of mean block --mean-block.
    Each key group (forward, dK/dV, dQ) is searched by successive halving: every candidate timed
    briefly on the heaviest case, the best quarter on every case. Prints, per problem class and
    mode, default vs tuned vs each vendor on the same cases. The cache
    (LONGCA_TRITON_AUTOTUNE_CACHE, default ~/.cache/longca-triton/autotune.json) holds one
    tuning-table row per problem class, which the kernels read at run time before their shipped
    tables; a rerun reuses what the cache holds for the same cases unless --force, which also
    rebuilds a cache of an older format.

    \b
    Examples:
      longca-triton autotune --block 64
      longca-triton autotune --block 64 --budget-minutes 2 --format json
      longca-triton autotune --block 128 --masks causal,causal_document --seqlens 16384
      longca-triton autotune --block 128 --kernel triton-sparse --densities 0.2,0.5
      longca-triton autotune --varblock --mean-block 256
      longca-triton autotune --block 64 --dry-run
    """
    from ..runtime import INTERPRETER_BANNER, select_device

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
    if interpreted and not dry_run:
        con.print(f"[bold yellow]{INTERPRETER_BANNER}[/bold yellow]")
        seqlens, head_dims, dts, heads = [160], [32], [torch.float16], (4, 2)
        block, mean_block, densities = min(block, 32), min(mean_block, 64), densities[:1]
    deadline = time.monotonic() + budget_minutes * 60 if budget_minutes else None
    t_start = time.monotonic()
    # one table (one JSON array) for every kernel tuned: what the command prints last
    table = dict(rows=[], columns=[], title="", headers={})
    for name in kernels:
        tunable = at.TUNABLES[name]
        tblock = mean_block if tunable.block_meaning == "mean block" else block
        mine = run.cases_for(tunable, tblock, masks, seqlens, head_dims, dts, heads, densities)
        if not mine:
            con.print(f"[yellow]{name}: none of the masks {', '.join(masks)} runs on it; skipped[/yellow]")
            continue
        why = tunable.device_reason(torch.device(device)) if tunable.device_reason and not dry_run else ""
        if why:
            con.print(f"[yellow]{name}: skipped ({why})[/yellow]")
            continue
        if dry_run or interpreted:
            con.print(f"{name} at {tunable.block_meaning} {tblock}: {len(mine)} cases")
        if dry_run:
            _dry_run_rows(table, tunable, mine, tblock, exhaustive, verbose or fmt != "table", switches)
            continue
        if interpreted:
            _interpreter_rows(table, tunable, mine, tblock)
            continue
        vendor_names = [] if vendors == ["none"] else (vendors or list(tunable.vendors))
        con.print(f"tuning [bold]{name}[/bold] at {tunable.block_meaning} {tblock} on {torch.cuda.get_device_name()} "
                  f"({len(mine)} cases) -> {tuned.cache_path()}")
        t0 = time.monotonic()
        summaries = _tune_with_progress(con, tunable, mine, tblock, device, exhaustive, deadline, force,
                                        no_write, verbose, switches)
        t_search = time.monotonic() - t0
        reused = [s for s in summaries if s.get("reused")]
        if reused:
            con.print(f"reused the cache for {len(reused)} of {len(summaries)} problem classes "
                      f"(tuned on these cases before; --force tunes them again)")
        t0 = time.monotonic()
        _measure_vendors(con, tunable, tblock, summaries, mine, vendor_names, device, write=not no_write)
        con.print(f"{name}: search {t_search:.0f} s, vendors {time.monotonic() - t0:.0f} s")
        table["rows"] += summary_rows(summaries, vendor_names)
        table["columns"] = list(dict.fromkeys(table["columns"] + SUMMARY_COLUMNS + vendor_names
                                              + ["source", "tuned_config"]))
        table["headers"], table["title"] = SUMMARY_HEADERS, ("autotune: TFLOP/s (docs/masks.md §5), default vs tuned, "
                                                             "vendors on the same cases")
        if out:
            with open(out, "a") as f:
                for s in summaries:
                    f.write(json.dumps(s, default=str) + "\n")
    if table["rows"]:
        emit(table["rows"], table["columns"], fmt=fmt, title=table["title"], headers=table["headers"])
    if not dry_run and not interpreted:
        con.print(f"autotune done in {time.monotonic() - t_start:.0f} s")


def _tune_with_progress(con, tunable, cases, block, device, exhaustive, deadline, force, no_write, verbose,
                        switches):
    from . import autotune_run as run
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    todo = {cls: m for cls, m in run.group_classes(tunable, cases, block).items()
            if force or run.cached_row(tunable, m, block, device) is None}
    total = sum(run.planned_work(tunable, m, block, exhaustive, switches) for m in todo.values())
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("timed runs"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=con, transient=False, disable=total == 0) as bar:
        task = bar.add_task(f"{tunable.name}", total=max(total, 1))

        def on_measure(cls, round_, cand, case, tf, err):
            bar.update(task, advance=1, description=f"{tunable.name} {cls.split('|', 5)[-1]} {round_}")
            if verbose and cand:
                result = f"{tf:.1f} TFLOP/s" if tf is not None else err
                bar.console.print(f"  {round_:<14} {case.label:<40} {_fmt_cfg(cand)} -> {result}")

        return run.tune(tunable, cases, block, device, exhaustive=exhaustive, deadline=deadline, force=force,
                       switches=switches, on_measure=on_measure, write=not no_write)


def _measure_vendors(con, tunable, block, summaries, cases, vendor_names, device, write=True):
    """Every vendor on every case of each class (reused classes keep the numbers the cache holds)."""
    from . import autotune_run as run

    if not vendor_names:
        return
    by_label = {c.label: c for c in cases}
    for s in summaries:
        have = s.get("vendors") or {}
        if s.get("reused") and all(v in have.get(m, {}) for m in s["tuned_tflops"] for v in vendor_names):
            continue
        members = [by_label[label] for label in s["cases"]]
        with con.status(f"measuring {', '.join(vendor_names)} on {len(members)} cases of {s['problem_class']}"):
            got = {mode: run.vendor_tflops(members, mode, vendor_names, device) for mode in s["tuned_tflops"]}
        run.record_vendors(tunable, s, members, block, got, device, write=write)


def _dry_run_rows(table, tunable, cases, block, exhaustive, with_configs, switches):
    from . import autotune_run as run
    from .search import planned_measurements

    for cls, members in run.group_classes(tunable, cases, block).items():
        for group, mode in tunable.groups.items():
            cands = run.search_space(tunable, group, block, members[0].head_dim, switches)
            table["rows"].append(dict(
                problem_class=cls, cases="; ".join(c.label for c in members), group=group, timed_on=mode,
                candidates=len(cands), timed_runs=planned_measurements(len(cands), len(members), exhaustive=exhaustive),
                configs=" | ".join(_fmt_cfg(c) for c in cands)))
    table["columns"] = ["problem_class", "cases", "group", "timed_on", "candidates", "timed_runs"] + (
        ["configs"] if with_configs else [])
    table["title"] = "what autotune would tune (dry run; -v lists every candidate config)"


def _interpreter_rows(table, tunable, cases, block):
    """CPU fallback: every group's first candidate must compute the reference's answer."""
    from ..reference import naive_attention

    rows = table["rows"]
    for case in cases:
        q, k, v, do = case.inputs("cpu")
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = naive_attention(q64, k64, v64, case.mask)
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
        for group, mode in tunable.groups.items():
            cand = tunable.candidates(group, block, case.head_dim)[0]
            cfg = {**tunable.default(case.head_dim, case.dtype, case.mask, group=case.heads_q // case.heads_kv), **cand}
            out = tunable.run(q, k, v, case.mask, cfg)
            if mode == "fwd":
                err = (out.double() - ref).abs().max().item()
            else:  # the backward groups are checked on the gradients they compute
                grads = torch.autograd.grad(out, (q, k, v), do)
                err = max((g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads))
            rows.append(dict(kernel=tunable.name, case=case.label, group=group, config=_fmt_cfg(cand), max_err=f"{err:.2e}",
                             status="ok" if err < 2e-2 else "WRONG"))
    table["columns"] = ["kernel", "case", "group", "config", "max_err", "status"]
    table["headers"] = {"max_err": "max |err| vs fp64"}
    table["title"] = "autotune [INTERPRETER: correctness of each group's first candidate, no speed]"

"""The ``longca-triton`` command line: a thin click layer over the library."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .cli_errors import OneLineErrors
from .cli_values import SEQLEN
from .masks import MASK_NAMES, MASK_PARAMETERS, MASK_SPECS
from .output import emit, format_option


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="longca-triton")
def main():
    """longca-triton: Triton attention kernels, vendor adapters, context parallelism and benchmarks.

    \b
    Examples:
      longca-triton masks list
      longca-triton masks show causal_document -S 8192 --out mask.png
    """


def _parse_params(items: tuple[str, ...]) -> dict:
    """``key=value`` pairs; values parsed as JSON where they parse (numbers, lists), else strings."""
    params = {}
    for item in items:
        if "=" not in item:
            raise click.BadParameter(f"expected key=value, got {item!r}", param_hint="--param")
        key, value = item.split("=", 1)
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


@main.group()
def masks():
    """List the 14 masks of docs/masks.md and show any of them."""


@masks.command("list")
@format_option
def masks_list(fmt):
    """List every mask with its kind and default parameters, then what each parameter means (json and
    csv: a ``parameter_help`` field per mask).

    \b
    Examples:
      longca-triton masks list
      longca-triton masks list --format json
      longca-triton masks show sliding_window_causal -S 4096 -p window=256
    """
    rows = []
    for n, name in enumerate(MASK_NAMES, 1):
        spec = MASK_SPECS[name]
        shown = {**spec.defaults, "docs": "hist|long"} if "docs" in spec.defaults else spec.defaults
        params = ", ".join(k if v is None else f"{k}={v}" for k, v in shown.items()) or "—"
        help_ = "; ".join(f"{k}: {MASK_PARAMETERS[k]}" for k in spec.defaults)
        rows.append({"#": n, "name": name, "kind": spec.kind, "parameters": params, "allowed": spec.summary,
                     "parameter_help": help_})
    columns = ["#", "name", "kind", "parameters", "allowed"]
    if fmt != "table":
        emit(rows, columns + ["parameter_help"], fmt=fmt)
        return
    emit(rows, columns, fmt=fmt, title="masks (docs/masks.md §3)",
         headers={"parameters": "parameters (=default)", "allowed": "allowed(i, j)"})
    used = {p: [n for n in MASK_NAMES if p in MASK_SPECS[n].defaults] for p in MASK_PARAMETERS}
    emit([{"parameter": p, "meaning": text, "masks": ", ".join(used[p])} for p, text in MASK_PARAMETERS.items()],
         ["parameter", "meaning", "masks"], fmt=fmt, title="parameters (make_mask(name, S, seed=..., **params), "
         "masks show -p KEY=VALUE)")


@masks.command("show")
@click.argument("name", type=click.Choice(MASK_NAMES))
@click.option("-S", "--seqlen", type=SEQLEN, default=8192, show_default=True, help="sequence length, e.g. 8192 or 8K")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("-p", "--param", "params", multiple=True, metavar="KEY=VALUE", help="mask parameter, e.g. -p window=512")
@click.option("--tile", type=click.IntRange(min=1), default=128, show_default=True, help="tile size for the full/partial tile counts")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="write a picture of the mask (PNG)")
@format_option
def masks_show(name, seqlen, seed, params, tile, out, fmt):
    """Statistics of one mask (area, density, slices, documents, tiles) and optionally a picture.

    \b
    Example:
      longca-triton masks show causal_document -S 8192 --seed 1 --out mask.png
    """
    from .masks.show import mask_stats, plot_mask

    try:
        mask = _make(name, seqlen, seed, _parse_params(params))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    stats = mask_stats(mask, tile)
    emit([{"statistic": k, "value": v} for k, v in stats.items()], ["statistic", "value"], fmt=fmt,
         title=f"{name}, S = {seqlen}, seed {seed}")
    if out:
        plot_mask(mask, out)
        click.echo(f"wrote {out}", err=fmt != "table")


@main.command("recommend")
@click.option("--mask", required=True, type=click.Choice(MASK_NAMES), help="the mask of docs/masks.md")
@click.option("--seqlen", "-S", type=SEQLEN, required=True, help="sequence length, e.g. 131072 or 128K or 1M")
@click.option("--gpus", type=click.IntRange(min=1), default=1, show_default=True, help="GPUs the sequence is spread over")
@click.option("--heads", default="64:8", show_default=True, help="Hq:Hkv")
@click.option("--head-dim", default="128", show_default=True, help="D, or D_qk/D_v such as 192/128")
@click.option("--mode", type=click.Choice(["fwd", "bwd", "fwd_bwd"]), default="fwd_bwd", show_default=True)
@click.option("--dtype", type=click.Choice(["bfloat16", "float16"]), default="bfloat16", show_default=True)
@click.option("--param", "params", multiple=True, metavar="KEY=VALUE",
              help="a mask generator parameter (repeatable; docs/masks.md), e.g. window=4096 or doc_lens=[8192,8192]")
@click.option("--results", "results", multiple=True, type=click.Path(dir_okay=False),
              help="results JSONL files, plain or .jsonl.gz (repeatable; default: experiments/results/**/results.jsonl "
                   "and results.jsonl.gz of this checkout, the plain one where a folder has both; outside a checkout "
                   "the study summary shipped with the package)")
@format_option
def recommend_command(mask, seqlen, gpus, heads, head_dim, mode, dtype, params, results, fmt):
    """The best kernel and context-parallel scheme for a mask, a length and a GPU count, from the
    measured results; says when it extrapolates (another length, another GPU count) or models
    (comm bytes plus measured kernel time) instead of measuring, and when nothing supports the case.

    \b
    Examples:
      longca-triton recommend --mask causal_document --seqlen 128K --gpus 8
      longca-triton recommend --mask full -S 16K --gpus 2 --mode fwd --format json
      longca-triton recommend --mask share_question -S 1M --gpus 64 --results my/results.jsonl
      longca-triton recommend --mask causal -S 16K --head-dim 192/128 --mode fwd
      longca-triton recommend --mask sliding_window_causal -S 128K --gpus 8 --param window=4096
    """
    from dataclasses import asdict

    from .bench.cli import heads_callback
    from .bench.params import ConfigError, parse_head_dim
    from .study.recommend import default_results, load_rows, recommend

    hq_hkv = heads_callback(None, None, heads)
    try:
        parse_head_dim(head_dim)
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="--head-dim") from None
    from .study.summary import packaged_rows, summary_path

    paths = list(results) or default_results()
    rows = load_rows(paths) if paths else packaged_rows()
    if not rows:
        raise click.UsageError("no results: pass --results FILE (a bench results.jsonl or .jsonl.gz), or run from a checkout "
                               "with experiments/results/")
    given = {}
    for p in params:
        key, eq, value = p.partition("=")
        if not eq or not key:
            raise click.BadParameter(f"{p!r} is not KEY=VALUE", param_hint="--param")
        try:
            given[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            given[key.strip()] = value
    try:
        rec = recommend(rows, mask, seqlen, gpus, heads=hq_hkv, head_dim=head_dim, mode=mode, dtype=dtype,
                        params=given)
    except (ValueError, TypeError) as e:
        raise click.BadParameter(str(e), param_hint="--param") from None
    if not paths:
        rec.notes.append(f"answered from the study summary shipped with the package ({summary_path().name}: "
                         f"{len(rows)} points of the committed results); --results FILE answers from your own")
    if fmt == "table":
        click.echo("\n".join(rec.lines()))
    elif fmt == "json":
        click.echo(json.dumps(asdict(rec), indent=1, default=str))
    else:  # csv: the two rankings, best first
        rows = [dict(choice="kernel", name=b, score=round(t, 1), unit="TFLOP/s") for b, t in rec.kernel_ranking]
        rows += [dict(choice="cp", name=n, score=round(e, 3), unit="efficiency") for n, e in rec.cp_ranking]
        emit(rows, ["choice", "name", "score", "unit"], fmt="csv")


@main.command("findings")
@click.argument("results", nargs=-1, type=click.Path(path_type=str))
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="the main page to write")
@click.option("--appendix", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="the appendix page (default: <out stem>-appendix.md next to --out)")
@click.option("--plots-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="where the PNGs go (default: a folder named after --out, next to it)")
@click.option("--mode", type=click.Choice(["fwd", "bwd", "fwd_bwd"]), default=None, help="only this mode (default: all)")
@click.option("--no-plots", is_flag=True, help="the markdown only")
def findings_command(results, out, appendix, plots_dir, mode, no_plots):
    """Generate the study's findings from result rows: a main page (five conclusions with their
    numbers, the paper's key findings against ours, the winner map, ours against the best other
    backend per mask, memory walls, block-sparse) and an appendix with everything else (sources,
    coverage, per mask the winner at each length and its margin, crossovers, where our kernels
    lose, the support matrix, block-sparse TFLOP/s against density, CP efficiency); with plots.
    RESULTS are JSONL files (plain or gzipped, .jsonl.gz) or folders (searched for *.jsonl and
    *.jsonl.gz); none given: the committed experiments/results/**/results.jsonl and
    results.jsonl.gz. Where a search finds both X.jsonl and X.jsonl.gz, X.jsonl is read (a bench
    appends to it) and a warning names the .gz left unread.

    \b
    Examples:
      longca-triton findings --out docs/findings.md
      longca-triton findings experiments/results/h100/dense-16k experiments/results/h200x2 --out /tmp/f.md
      longca-triton findings results/dense-h100/results.jsonl --out f.md --mode bwd --no-plots
    """
    import shlex

    from .study.findings import collect_paths, compute, load_results
    from .study.findings_headline import headline
    from .study.findings_main import render_pages
    from .study.recommend import default_results

    paths = collect_paths(results) if results else default_results()
    if not paths:
        raise click.UsageError("no results: give RESULTS (JSONL files or folders), or run from a checkout with "
                               "experiments/results/")
    rows, files = load_results(paths)
    if not rows:
        cpu = sum(i["cpu"] for i in files.values())
        raise click.UsageError(f"no bench result rows in {', '.join(str(p) for p in paths)[:300]}"
                               + (f" but {cpu} measured on a CPU, which findings leave out (not performance numbers)"
                                  if cpu else ""))
    f = compute(rows, files, mode=mode)
    if not f.rows:
        raise click.UsageError(f"no rows of mode {mode} in the results")
    default_appendix = out.with_name(f"{out.stem}-appendix.md")
    appendix = appendix or default_appendix
    written, h = {}, headline(f)
    if not no_plots:
        from .study.findings_plots import make_findings_plots

        pdir = plots_dir or out.with_suffix("")
        written = make_findings_plots(f, pdir, h)
    argv = list(results) + ["--out", str(out)] + (["--appendix", str(appendix)] if appendix != default_appendix else []) \
        + (["--plots-dir", str(plots_dir)] if plots_dir else []) + (["--mode", mode] if mode else []) \
        + (["--no-plots"] if no_plots else [])
    for page, text in render_pages(f, "longca-triton findings " + shlex.join(argv), out, appendix, written, h=h).items():
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(text)
    n = sum(len(v) for v in written.values())
    click.echo(f"wrote {out} and {appendix}" + (f" and {n} plots in {pdir}" if n else "")
               + f" from {len(f.rows)} rows of {len(paths)} files")


def _make(name, seqlen, seed, params):
    from .masks import make_mask

    return make_mask(name, seqlen, seed=seed, **params)


# the other commands live beside the library code they drive
from .bench.autotune_cli import autotune  # noqa: E402
from .bench.cli import bench, doctor, plot, report  # noqa: E402
from .bench.ladder import ladder_command  # noqa: E402
from .bench.plot import register_plotter  # noqa: E402
from .cp.cli import comm_command, cp_bench_command  # noqa: E402
from .cp.plot import make_cp_plots  # noqa: E402

bench.add_command(cp_bench_command)  # `bench cp`: the CP bench lives beside the CP layer
register_plotter("cp", make_cp_plots)  # CP rows in a results file get the CP views

for _command in (bench, plot, report, doctor, comm_command, ladder_command, autotune):
    main.add_command(_command)


if __name__ == "__main__":
    main()

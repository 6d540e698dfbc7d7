"""The ``longca-triton`` command line: a thin click layer over the library."""

from __future__ import annotations

import json

import click
import torch

from .bench.cli import heads_callback
from .masks import MASK_NAMES, MASK_SPECS


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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
    """List the 14 masks of MASKS.md and show any of them."""


@masks.command("list")
def masks_list():
    """List every mask with its kind and default parameters.

    \b
    Example:
      longca-triton masks list
    """
    from rich.console import Console
    from rich.table import Table

    table = Table(title="masks (MASKS.md §3)")
    for col in ("#", "name", "kind", "parameters (defaults)", "allowed(i, j)"):
        table.add_column(col)
    for n, name in enumerate(MASK_NAMES, 1):
        spec = MASK_SPECS[name]
        params = ", ".join(f"{k}={v}" for k, v in spec.defaults.items() if v is not None and k != "docs") or "—"
        if "docs" in spec.defaults:
            params = ("docs=hist|long, " + params).rstrip(", —")
        table.add_row(str(n), name, spec.kind, params, spec.summary)
    Console().print(table)


@masks.command("show")
@click.argument("name", type=click.Choice(MASK_NAMES))
@click.option("-S", "--seqlen", type=click.IntRange(min=1), default=8192, show_default=True, help="sequence length")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("-p", "--param", "params", multiple=True, metavar="KEY=VALUE", help="mask parameter, e.g. -p window=512")
@click.option("--tile", type=click.IntRange(min=1), default=128, show_default=True, help="tile size for the full/partial tile counts")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="write a picture of the mask (PNG)")
def masks_show(name, seqlen, seed, params, tile, out):
    """Statistics of one mask (area, density, slices, documents, tiles) and optionally a picture.

    \b
    Example:
      longca-triton masks show causal_document -S 8192 --seed 1 --out mask.png
    """
    from rich.console import Console

    from .masks.show import mask_stats, plot_mask

    try:
        mask = _make(name, seqlen, seed, _parse_params(params))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    console = Console()
    for key, value in mask_stats(mask, tile).items():
        console.print(f"[bold]{key}[/bold]: {value}")
    if out:
        plot_mask(mask, out)
        console.print(f"wrote {out}")


def _csv(kind):
    def parse(ctx, param, value):
        if value is None:
            return None
        items = [x.strip() for x in value.split(",") if x.strip()]
        try:
            return [kind(x) for x in items]
        except ValueError:
            raise click.BadParameter(f"expected a comma-separated list of {kind.__name__}, got {value!r}") from None

    return parse


@main.command()
@click.option("--block", type=click.Choice(["16", "32", "64", "128", "256"]), default="64", show_default=True,
              help="inner-loop tile / uniform sparse block size to tune for (triton, triton-sparse)")
@click.option("--varblock", is_flag=True,
              help="tune the variable-block kernel (triton-varblock) at --mean-block instead of triton + triton-sparse")
@click.option("--mean-block", type=click.IntRange(min=16), default=256, show_default=True,
              help="mean block of the variable-block masks triton-varblock is tuned on")
@click.option("--kernel", "kernels", default=None, callback=_csv(str),
              help="comma-separated tunable kernels (default: triton,triton-sparse; with --varblock: triton-varblock)")
@click.option("--masks", default=None, callback=_csv(str), help="comma-separated masks for the dense kernel (default: a mix of full, causal, documents, window)")
@click.option("--densities", default="0.2,0.5,0.8", show_default=True, callback=_csv(float),
              help="kept-block fractions of the block-sparse tuning masks")
@click.option("--seqlens", default="4096,16384", show_default=True, callback=_csv(int))
@click.option("--head-dims", default="128", show_default=True, callback=_csv(int))
@click.option("--dtypes", default="bfloat16", show_default=True, callback=_csv(str))
@click.option("--heads", default="64:8", show_default=True, callback=heads_callback, help="Hq:Hkv")
@click.option("--vendors", default=None, callback=_csv(str), help="backends to compare against (default: per kernel, e.g. sdpa-cudnn, fa4, flex-fa4, flex for the dense one)")
@click.option("--dry-run", is_flag=True, help="list the problem classes and candidate configs, run nothing")
@click.option("--no-write", is_flag=True, help="do not update the config cache")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="also write the summary as JSON")
def autotune(block, varblock, mean_block, kernels, masks, densities, seqlens, head_dims, dtypes, heads, vendors, dry_run,
             no_write, out):
    """Tune our kernels' launch configs for one tile/block size and cache the winners.

    `--block N` tunes the dense kernel (triton: inner tile N) and the uniform block-sparse kernel
    (triton-sparse: masks of block N, one pattern per KV head, at each of --densities);
    `--varblock` tunes triton-varblock on variable-block masks of mean block --mean-block.
    Prints, per problem class, the default config, the tuned config and the best vendor kernel
    side by side. The kernels read the cache (see `autotune.cache_path`) at run time; the
    block-sparse backends take the entry of the mask's own block, at the nearest tuned sequence
    bucket when theirs was not tuned (so 4K/16K tuning serves the 32K-128K sparse study).

    \b
    Examples:
      longca-triton autotune --block 64
      longca-triton autotune --block 128 --masks causal,causal_document --seqlens 16384
      longca-triton autotune --block 128 --kernel triton-sparse --densities 0.2,0.5
      longca-triton autotune --varblock --mean-block 256
      longca-triton autotune --block 64 --dry-run
    """
    from .runtime import INTERPRETER_BANNER, select_device

    device, interpreted = select_device()
    from rich.console import Console

    from .bench import autotune as at
    from .kernels import tuned
    from .masks import MASK_NAMES

    console = Console()
    block = int(block)
    kernels = kernels or (["triton-varblock"] if varblock else ["triton", "triton-sparse"])
    for name in kernels:
        if name not in at.TUNABLES:
            raise click.BadParameter(f"unknown kernel {name!r}; tunable: {', '.join(at.TUNABLES)}", param_hint="--kernel")
    masks = masks or list(at.DEFAULT_MASKS)
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
    if any(s < 1 for s in seqlens):
        raise click.BadParameter("sequence lengths must be positive", param_hint="--seqlens")
    if interpreted and not dry_run:
        console.print(f"[bold yellow]{INTERPRETER_BANNER}[/bold yellow]")
        seqlens, head_dims, dts, heads = [160], [32], [torch.float16], (4, 2)
        block, mean_block, densities = min(block, 32), min(mean_block, 64), densities[:1]
    for name in kernels:
        tunable = at.TUNABLES[name]
        tblock = mean_block if tunable.block_meaning == "mean block" else block
        mine = at.cases_for(tunable, tblock, masks, seqlens, head_dims, dts, heads, densities)
        if not mine:
            console.print(f"[yellow]{name}: none of the masks {', '.join(masks)} runs on it; skipped[/yellow]")
            continue
        if dry_run:
            _print_dry_run(console, tunable, mine, tblock)
            continue
        if interpreted:
            _interpreter_check(console, tunable, mine, tblock)
            continue
        console.print(f"tuning {name} at {tunable.block_meaning} {tblock} on {torch.cuda.get_device_name()} -> {tuned.cache_path()}")
        summaries = at.tune(tunable, mine, tblock, device, write=not no_write, progress=lambda s: console.log(s))
        _print_summary(console, summaries, mine, vendors or list(tunable.vendors), device)
        if out:
            import json as _json

            with open(out, "a") as f:
                for s in summaries:
                    f.write(_json.dumps(s, default=str) + "\n")


def _fmt_cfg(cfg: dict) -> str:
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in cfg.items())


def _print_dry_run(console, tunable, cases, block):
    from .kernels import tuned

    console.print(f"[bold]{tunable.name}[/bold] at {tunable.block_meaning} {block}: {len(cases)} cases")
    classes = {}
    for c in cases:
        cls = tuned.problem_class(tunable.name, c.head_dim, c.dtype, c.heads_q // c.heads_kv, c.mask, block)
        classes.setdefault(cls, []).append(c.label)
    for cls, labels in classes.items():
        console.print(f"[bold]{cls}[/bold]  cases: {', '.join(labels)}")
    for group, mode in tunable.groups.items():
        cands = tunable.candidates(group, block, cases[0].head_dim if cases else 128)
        console.print(f"  group {group} (timed on {mode}): {len(cands)} candidates")
        for cand in cands:
            console.print(f"    {_fmt_cfg(cand)}")


def _interpreter_check(console, tunable, cases, block):
    """CPU fallback: every candidate's first few configs must compute the reference's answer."""
    from rich.table import Table

    from .reference import naive_attention

    table = Table(title=f"{tunable.name} @ {tunable.block_meaning} {block} [INTERPRETER: correctness only, no speed]")
    for col in ("case", "group", "config", "max |err| vs fp64 reference", "status"):
        table.add_column(col)
    for case in cases:
        q, k, v, do = case.inputs("cpu")
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = naive_attention(q64, k64, v64, case.mask)
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
        for group, mode in tunable.groups.items():
            cand = tunable.candidates(group, block, case.head_dim)[0]
            cfg = {**tunable.default(case.head_dim, case.dtype, case.mask), **cand}
            out = tunable.run(q, k, v, case.mask, cfg)
            if mode == "fwd":
                err = (out.double() - ref).abs().max().item()
            else:  # the backward groups are checked on the gradients they compute
                grads = torch.autograd.grad(out, (q, k, v), do)
                err = max((g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads))
            table.add_row(case.label, group, _fmt_cfg(cand), f"{err:.2e}", "ok" if err < 2e-2 else "WRONG")
    console.print(table)


def _print_summary(console, summaries, cases, vendors, device):
    from rich.table import Table

    from .bench import autotune as at

    by_label = {c.label: c for c in cases}
    table = Table(title="autotune: default vs tuned vs best vendor (TFLOP/s, MASKS.md §5)")
    for col in ("problem class", "mode", "default", "tuned", "× default", "best vendor", "tuned config"):
        table.add_column(col)
    for s in summaries:
        first = by_label[s["cases"][0]]
        for mode, tuned in sorted(s["tuned_tflops"].items()):
            default = s["default_tflops"][mode]
            vendor, vt = at.best_vendor(first, mode, vendors, device)
            table.add_row(s["problem_class"], mode, f"{default:.0f}", f"{tuned:.0f}", f"{tuned / default:.2f}",
                          f"{vendor} {vt:.0f}" + (" (first case)" if len(s["cases"]) > 1 else ""),
                          _fmt_cfg({k: v for k, v in s["tuned"].items() if s["default"].get(k) != v}) or "(= default)")
    console.print(table)


def _make(name, seqlen, seed, params):
    from .masks import make_mask

    return make_mask(name, seqlen, seed=seed, **params)


# the other commands live beside the library code they drive
from .bench.cli import bench, doctor, plot, report  # noqa: E402
from .bench.ladder import ladder_command  # noqa: E402
from .bench.plot import register_plotter  # noqa: E402
from .cp.cli import comm_command, cp_bench_command  # noqa: E402
from .cp.plot import make_cp_plots  # noqa: E402

bench.add_command(cp_bench_command)  # `bench cp`: the CP bench lives beside the CP layer
register_plotter("cp", make_cp_plots)  # CP rows in a results file get the CP views

for _command in (bench, plot, report, doctor, comm_command, ladder_command):
    main.add_command(_command)


if __name__ == "__main__":
    main()

"""The ``longca-triton`` command line: a thin click layer over the library."""

from __future__ import annotations

import json

import click

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


def _make(name, seqlen, seed, params):
    from .masks import make_mask

    return make_mask(name, seqlen, seed=seed, **params)


if __name__ == "__main__":
    main()

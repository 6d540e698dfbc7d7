"""Tables as every command prints them: never a cut identifier, and json / csv for scripts.

``emit(rows, columns, fmt=...)`` is the one way a command prints a table:

* ``table`` on a terminal: a rich table whose cells fold (a long name wraps onto the next line,
  it is never replaced by ``…``);
* ``table`` into a pipe or a file: space-separated columns as wide as their content, so ``grep``
  finds every name whole and verbatim whatever ``COLUMNS`` says;
* ``json``: a list of objects (one per row, keys = column names), for scripts;
* ``csv``: a header line and one line per row.

Commands take ``@format_option`` for ``--format table|json|csv``.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from typing import Any, Iterable, Sequence

import click

__all__ = ["FORMATS", "format_option", "emit", "render", "console"]

FORMATS = ("table", "json", "csv")


def format_option(f):
    """``--format table|json|csv`` (default table) as the ``fmt`` argument."""
    return click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
                        help="table for people; json or csv for scripts (every value whole)")(f)


def console(file=None):
    """A rich console that never cuts: terminal width on a TTY, unbounded width elsewhere."""
    from rich.console import Console

    file = file or sys.stdout
    if file.isatty():
        return Console(file=file)
    # why: rich sizes a console that is not a terminal from COLUMNS (or 80) and shortens cells
    # to fit; a file or a pipe has no width, so give it one no table reaches
    return Console(file=file, width=100_000, no_color=True, highlight=False, soft_wrap=True)


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"
    return str(v)


def render(rows: Sequence[dict], columns: Sequence[str], *, title: str | None = None,
           headers: dict[str, str] | None = None, fmt: str = "table", file=None) -> str:
    """The text ``emit`` would print (tables rendered for ``file``'s kind: terminal or not)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    if fmt == "json":
        return json.dumps([{c: r.get(c) for c in columns} for r in rows], indent=1, default=str) + "\n"
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c) for c in columns})
        return buf.getvalue()
    from rich.table import Table

    from rich import box

    headers = headers or {}
    target = file or sys.stdout
    # into a pipe or a file: columns separated by spaces, no rules inside cells, so every value
    # stands verbatim on its line (grep, awk); on a terminal: boxes
    table = Table(title=title, box=box.HEAVY_HEAD if target.isatty() else box.SIMPLE_HEAD)
    for c in columns:
        # fold: a cell too long for its column continues on the next line, whole
        table.add_column(headers.get(c, c), overflow="fold")
    for r in rows:
        table.add_row(*(_cell(r.get(c)) for c in columns))
    con = console(target)
    with con.capture() as cap:
        con.print(table)
    text = cap.get()
    if not target.isatty():  # no padding lines or trailing blanks in a file
        text = "".join(line.rstrip() + "\n" for line in text.splitlines() if line.strip())
    return text


def emit(rows: Iterable[dict], columns: Sequence[str] | None = None, *, title: str | None = None,
         headers: dict[str, str] | None = None, fmt: str = "table", file=None) -> None:
    """Print ``rows`` (dicts) as a table, json or csv; ``columns`` default to the first row's keys."""
    rows = list(rows)
    if columns is None:
        columns = list(rows[0]) if rows else []
    file = file or sys.stdout
    file.write(render(rows, columns, title=title, headers=headers, fmt=fmt, file=file))
    file.flush()

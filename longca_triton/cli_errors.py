"""One line per mistake: the CLI's groups print ``error: <what is wrong>`` and exit non-zero.

Click's own way prints the usage, a hint and the message over three lines; a library error
(``ValueError`` from a mask that does not fit, a malformed config, a missing file) would print a
traceback. Both become one line naming the problem (the messages name the valid alternatives).
``LONGCA_TRITON_TRACEBACK=1`` re-raises instead, for whoever debugs the library. A warning the
library raises (its categories live in ``longca_triton``, e.g. ``bench.store.BothResultsWarning``)
prints as one line too, ``warning: <what>``, on stderr; other packages' warnings print as Python
prints them.
"""

from __future__ import annotations

import os
import sys
import warnings

import click

__all__ = ["OneLineErrors", "USER_ERRORS"]

#: exceptions that mean "the input is wrong", not "the program is wrong"
USER_ERRORS = (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


class OneLineErrors(click.Group):
    """A click group whose errors are one line on stderr (exit 2 for usage, 1 otherwise)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode or os.environ.get("LONGCA_TRITON_TRACEBACK") == "1":
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            with warnings.catch_warnings():
                warnings.showwarning = _show_warning
                rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.Abort:
            click.echo("aborted", err=True)
            sys.exit(1)
        except click.ClickException as e:
            click.echo(f"error: {_one_line(e.format_message())}", err=True)
            sys.exit(e.exit_code)
        except USER_ERRORS as e:
            click.echo(f"error: {_one_line(str(e)) or type(e).__name__}", err=True)
            sys.exit(2)
        sys.exit(rv if isinstance(rv, int) else 0)


_python_show_warning = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """The library's warnings as ``warning: <what>`` (one line, stderr); others as Python shows them."""
    if category.__module__.split(".")[0] == "longca_triton":
        click.echo(f"warning: {_one_line(str(message))}", err=True)
    else:
        _python_show_warning(message, category, filename, lineno, file, line)


def _one_line(msg: str) -> str:
    return " ".join(part.strip() for part in str(msg).splitlines() if part.strip())

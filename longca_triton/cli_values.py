"""Click parameter types the commands share, so that every command reads a value the same way.

``SEQLEN`` / ``SEQLENS``: one sequence length, or a comma-separated list of them, as ``65536``,
``64K``, ``128k`` or ``1M`` (``bench.params.parse_seqlen``, which experiment files use too).
"""

from __future__ import annotations

import click

__all__ = ["SEQLEN", "SEQLENS"]


class _SeqLen(click.ParamType):
    """A positive sequence length: ``65536``, ``64K``, ``128k``, ``1M``."""

    name = "LENGTH"

    def convert(self, value, param, ctx):
        from .bench.params import ConfigError, parse_seqlen

        try:
            return parse_seqlen(value)
        except ConfigError as e:
            self.fail(str(e), param, ctx)


class _SeqLens(click.ParamType):
    """Comma-separated sequence lengths: ``4K,16K`` or ``4096,16384``."""

    name = "LENGTHS"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        items = [x for x in str(value).split(",") if x.strip()]
        if not items:
            self.fail(f"expected comma-separated sequence lengths such as 4K,16K, got {value!r}", param, ctx)
        return [SEQLEN.convert(x, param, ctx) for x in items]


SEQLEN = _SeqLen()
SEQLENS = _SeqLens()

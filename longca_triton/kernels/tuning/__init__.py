"""Shipped tuning tables: measured launch configs as data.

Each kernel family ships ``tuning/<family>.toml``: a ``[defaults]`` table with every key of the
family's config (the conservative fallback, also what the CPU interpreter is pinned to unless the
family says otherwise) and ``[[row]]`` entries, each a partial config applied when its ``match``
holds, with the results file that measured it::

    [defaults]
    BLOCK_M = 64
    num_warps = 4

    [[row]]
    match = { arch = "sm90", head_dim = 128, mask = ["full"] }
    mode = "bwd"                       # which pass the row's keys drive: fwd, bwd or fwd_bwd
    config = { DKDV_BLOCK_M = 64, dkdv_num_warps = 8 }
    results = "experiments/results/h100/dense-headdim/README.md"
    note = "one sentence: what it is and why"

A family's ``resolve_config`` is: explicit config > the user's autotune cache > the matching rows
of its table, overlaid in file order on ``defaults`` > validation. :func:`table_config` does the
table part; match fields a row leaves out match anything.

A row may also carry ``measured``, a table of what the run that chose it measured (TFLOP/s per
mode, the cases, the search); the autotune cache (``kernels/core/tuned.py``) writes its rows in
this format through :func:`parse_rows`, with ``measured`` filled in and ``block`` in ``match``.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["MATCH_FIELDS", "MODES", "ROW_FIELDS", "Problem", "Row", "Table", "load_table", "parse_rows",
           "parse_table", "table_config", "table_path"]

#: what a row may match on: ``arch`` (``"sm90"``, ``"cpu"`` for the interpreter), ``head_dim`` /
#: ``head_dim_v`` (the padded dims the family tiles by), ``mask`` (the family's mask classes),
#: ``dtype`` (``"bfloat16"``...), ``group`` / ``density`` / ``seqlen`` as ``[lo, hi]`` (inclusive lo,
#: exclusive hi; ``hi`` may be omitted: ``[2]`` is 2 and up), ``block`` (the inner tile or sparse
#: block a row was tuned at), ``exact_dims`` (bool: the true head dims fill the padded tile, as 64
#: and 128 do and 96 does not), ``partial_share`` as ``[lo, hi]`` (the share of partial tiles among
#: the 128 x 128 tiles the mask touches)
MATCH_FIELDS = ("arch", "head_dim", "head_dim_v", "mask", "dtype", "group", "density", "seqlen", "block",
                "exact_dims", "partial_share")
ROW_FIELDS = ("match", "config", "mode", "results", "note", "measured")
_RANGE_FIELDS = ("group", "density", "seqlen", "partial_share")
MODES = ("fwd", "bwd", "fwd_bwd")


@dataclass(frozen=True)
class Problem:
    """What a row is matched against (``None``: unknown, matched only by rows that leave it out)."""

    arch: Optional[str] = None
    head_dim: Optional[int] = None
    head_dim_v: Optional[int] = None
    mask: Optional[str] = None
    dtype: Optional[str] = None
    group: Optional[int] = None
    density: Optional[float] = None
    seqlen: Optional[int] = None
    block: Optional[int] = None
    exact_dims: Optional[bool] = None
    partial_share: Optional[float] = None


@dataclass(frozen=True)
class Row:
    match: dict
    config: dict
    mode: str
    results: str
    note: str = ""
    measured: dict = field(default_factory=dict)

    def matches(self, problem: Problem) -> bool:
        for key, want in self.match.items():
            have = getattr(problem, key)
            if have is None:
                return False
            if key in _RANGE_FIELDS:
                lo = want[0]
                hi = want[1] if len(want) > 1 else None
                if have < lo or (hi is not None and have >= hi):
                    return False
            elif isinstance(want, list):
                if have not in want:
                    return False
            elif have != want:
                return False
        return True


@dataclass(frozen=True)
class Table:
    family: str
    defaults: dict
    rows: tuple = field(default_factory=tuple)
    path: str = ""

    def matching(self, problem: Problem) -> list:
        return [r for r in self.rows if r.matches(problem)]


def table_path(family: str) -> Path:
    return Path(__file__).with_name(f"{family}.toml")


def _bad(where: str, msg: str) -> ValueError:
    return ValueError(f"tuning table {where}: {msg}")


def parse_table(data: dict, family: str, where: str, keys: Optional[tuple] = None) -> Table:
    """A table from parsed TOML; every problem named in one ``ValueError`` line. ``keys``: the
    family's config keys (rows and defaults may only set those)."""
    if not isinstance(data.get("defaults"), dict):
        raise _bad(where, "needs a [defaults] table with every config key")
    defaults = dict(data["defaults"])
    if keys is not None:
        missing, unknown = set(keys) - set(defaults), set(defaults) - set(keys)
        if missing or unknown:
            raise _bad(where, f"[defaults] must set exactly the {family} keys; missing {sorted(missing)}, "
                              f"unknown {sorted(unknown)}")
    rows = parse_rows(data.get("row", []), family, where, keys)
    return Table(family=family, defaults=defaults, rows=rows, path=where)


def parse_rows(raw_rows: list, family: str, where: str, keys: Optional[tuple] = None) -> tuple:
    """``[[row]]`` entries as :class:`Row` s, every problem named in one ``ValueError`` line (shared by
    the shipped tables and the autotune cache). ``keys``: the config keys rows may set (None: any)."""
    rows = []
    for i, raw in enumerate(raw_rows):
        at = f"{where} row {i + 1}"
        if not isinstance(raw, dict):
            raise _bad(at, f"a row is a table, got {raw!r}")
        extra = set(raw) - set(ROW_FIELDS)
        if extra:
            raise _bad(at, f"unknown fields {sorted(extra)}")
        match, config = raw.get("match", {}), raw.get("config")
        if not isinstance(match, dict) or set(match) - set(MATCH_FIELDS):
            raise _bad(at, f"match fields must be among {MATCH_FIELDS}, got {match!r}")
        for key in _RANGE_FIELDS:
            if key in match and not (isinstance(match[key], list) and 1 <= len(match[key]) <= 2):
                raise _bad(at, f"match.{key} must be [lo] or [lo, hi], got {match[key]!r}")
        if not isinstance(config, dict) or not config:
            raise _bad(at, "needs a non-empty config")
        if keys is not None and set(config) - set(keys):
            raise _bad(at, f"unknown {family} config keys {sorted(set(config) - set(keys))}")
        if raw.get("mode") not in MODES:
            raise _bad(at, f"mode must be one of {MODES}, got {raw.get('mode')!r}")
        if not isinstance(raw.get("results"), str) or not raw["results"]:
            raise _bad(at, "needs results = the file that measured it")
        if not isinstance(raw.get("measured", {}), dict):
            raise _bad(at, f"measured must be a table, got {raw['measured']!r}")
        rows.append(Row(match=dict(match), config=dict(config), mode=raw["mode"], results=raw["results"],
                        note=str(raw.get("note", "")), measured=dict(raw.get("measured", {}))))
    return tuple(rows)


@functools.lru_cache(maxsize=None)
def load_table(family: str, keys: Optional[tuple] = None) -> Table:
    """The shipped table of ``family`` (read and checked once per process)."""
    path = table_path(family)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"no shipped tuning table for {family!r} ({path})") from None
    except tomllib.TOMLDecodeError as e:
        raise _bad(str(path), f"malformed TOML: {e}") from None
    return parse_table(data, family, str(path), keys)


def table_config(family: str, problem: Problem, keys: Optional[tuple] = None) -> dict:
    """``defaults`` overlaid with every row matching ``problem``, in file order."""
    table = load_table(family, keys)
    cfg = dict(table.defaults)
    for row in table.matching(problem):
        cfg.update(row.config)
    return cfg

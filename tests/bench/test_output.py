"""Tables printed into a pipe keep every identifier whole; json and csv parse."""

import csv
import io
import json

import pytest

from longca_triton.output import FORMATS, emit, render

LONG = ["sliding_window_causal", "global_sliding_window", "block_causal_document", "x" * 150]
ROWS = [{"name": n, "kind": "range", "tflops": 123.456} for n in LONG]


class _Pipe(io.StringIO):
    def isatty(self):
        return False


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_pipe_keeps_names_whole_at_80_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = _Pipe()
    emit(ROWS, ["name", "kind", "tflops"], title="masks", file=out)
    text = out.getvalue()
    for n in LONG:
        assert any(n in line.split() for line in text.splitlines()), n
    assert "…" not in text


def test_terminal_folds_instead_of_cutting(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    text = render(ROWS, ["name", "kind"], file=_Tty())
    assert "…" not in text
    # the 150-character name is folded over lines: every character is there
    assert text.count("x") >= 150


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_has_every_value(fmt):
    text = render(ROWS, ["name", "kind", "tflops"], fmt=fmt, file=_Pipe())
    if fmt == "json":
        assert json.loads(text) == ROWS
    elif fmt == "csv":
        got = list(csv.DictReader(io.StringIO(text)))
        assert [r["name"] for r in got] == LONG and float(got[0]["tflops"]) == 123.456
    else:
        assert all(n in text for n in LONG)


def test_unknown_format_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown format 'yaml'; use one of table, json, csv"):
        render(ROWS, ["name"], fmt="yaml")

"""CLI mistakes are one line on stderr, never a traceback."""

import click
import pytest
from click.testing import CliRunner

from longca_triton.cli_errors import OneLineErrors


@click.group(cls=OneLineErrors)
def cli():
    pass


@cli.command()
@click.option("--block", type=click.Choice(["64", "128"]))
@click.option("--mask", default="causal")
def run(block, mask):
    if mask not in ("causal", "full"):
        raise ValueError(f"unknown mask {mask!r}; valid masks: causal, full")
    if mask == "full":
        raise FileNotFoundError("config experiments/nope.toml not found")
    click.echo("ran")


@cli.command()
def crash():
    raise RuntimeError("a bug")


@pytest.mark.parametrize("args,needle,code", [
    (["run", "--block", "48"], "'48' is not one of '64', '128'", 2),
    (["run", "--mask", "causl"], "unknown mask 'causl'; valid masks: causal, full", 2),
    (["run", "--mask", "full"], "config experiments/nope.toml not found", 2),
    (["nope"], "No such command 'nope'", 2),
    (["run", "--bogus"], "No such option '--bogus'", 2),
])
def test_one_line(args, needle, code):
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == code, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.output
    assert "Traceback" not in r.output


def test_ok_and_bugs_still_surface():
    r = CliRunner().invoke(cli, ["run"])
    assert r.exit_code == 0 and r.output == "ran\n"
    r = CliRunner().invoke(cli, ["crash"])
    assert r.exit_code == 1 and isinstance(r.exception, RuntimeError)  # a bug is not dressed up as user error


def test_traceback_switch(monkeypatch):
    monkeypatch.setenv("LONGCA_TRITON_TRACEBACK", "1")
    r = CliRunner().invoke(cli, ["run", "--mask", "causl"])
    assert isinstance(r.exception, ValueError)

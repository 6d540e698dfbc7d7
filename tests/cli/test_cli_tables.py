"""Tables printed into a pipe keep every identifier whole at 80 columns, every table
command has --format json|csv that parses, and a mistake on the command line is one line."""

import csv
import io
import json

import pytest
from click.testing import CliRunner

from longca_triton.cli import main
from longca_triton.masks import MASK_NAMES

NARROW = {"COLUMNS": "80", "TRITON_INTERPRET": "1"}

TABLE_COMMANDS = {
    "masks list": (["masks", "list"], [*MASK_NAMES, "global_tokens", "doc_lens", "block_bounds"]),
    "masks show": (["masks", "show", "block_causal_document", "-S", "1024"], ["block_causal_document(Sq=1024,", "max key intervals per row"]),
    "comm": (["comm", "--scheme", "loongtrain", "--world", "8", "--window", "2", "-S", "65536"],
             ["p2p_inner", "p2p_outer", "dkv"]),
    "doctor": (["doctor"], ["reference-chunked", "triton-flashmask", "flashinfer-varblock", "sliding"]),
    "autotune dry run": (["autotune", "--block", "64", "--dry-run"],
                         ["triton|D=128|bfloat16|G=8|masked|S<=16K|block=64",
                          "triton-sparse|D=128|bfloat16|G=8|uniform-sparse|S<=16K|block=64"]),
}


@pytest.fixture
def runner():
    return CliRunner()


@pytest.mark.parametrize("name", [n for n in TABLE_COMMANDS if n != "doctor"])
def test_piped_table_keeps_identifiers(runner, name):
    args, needles = TABLE_COMMANDS[name]
    r = runner.invoke(main, args, env=NARROW)
    assert r.exit_code == 0, r.output
    for n in needles:  # whole, on one line (a cut or folded name would not be)
        assert any(n in line for line in r.stdout.splitlines()), f"{n!r} not whole in {' '.join(args)}:\n{r.stdout}"
    assert "…" not in r.stdout


def test_doctor_piped_keeps_backend_names(runner):
    r = runner.invoke(main, ["doctor"], env=NARROW)
    assert r.exit_code == 0, r.output
    first_words = {line.split()[0] for line in r.stdout.splitlines() if line.split()}
    for name in ("reference-chunked", "triton-flashmask", "flashinfer-varblock", "triton-varblock", "sdpa-efficient"):
        assert name in first_words, name
    assert "…" not in r.stdout


@pytest.mark.parametrize("name", list(TABLE_COMMANDS))
@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_machine_formats_parse(runner, name, fmt):
    args, _ = TABLE_COMMANDS[name]
    r = runner.invoke(main, [*args, "--format", fmt], env=NARROW)
    assert r.exit_code == 0, r.output
    if fmt == "json":
        rows = json.loads(r.stdout)
    else:
        rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert rows and all(isinstance(row, dict) for row in rows)
    if name == "masks list":
        assert [row["name"] for row in rows] == list(MASK_NAMES)
        window = rows[MASK_NAMES.index("sliding_window")]
        assert window["parameter_help"].startswith("window: window w: keys within w positions"), window
    if name == "comm" and fmt == "json":
        assert all(isinstance(row["sent"], int) for row in rows)  # bytes as integers for scripts


BAD = [
    (["masks", "show", "causal_doc"], "'causal_doc' is not one of"),
    (["autotune", "--block", "48", "--dry-run"], "'48' is not one of '16', '32', '64', '128', '256'"),
    (["autotune", "--masks", "causal,nope", "--dry-run"], "unknown mask 'nope'; valid masks: full"),
    (["autotune", "--kernel", "triton-dense", "--dry-run"], "unknown kernel 'triton-dense'; tunable: triton"),
    (["autotune", "--seqlens", "4K,4x", "--dry-run"], "sequence length '4x' is not a positive integer"),
    (["comm", "--scheme", "ring_p2p", "--world", "8", "--seqlen", "64Q"], "sequence length '64Q'"),
    (["recommend", "--mask", "causal", "--seqlen", "0"], "sequence length '0' must be positive"),
    (["bench", "dense", "--preset", "smoke", "--backends", "nope", "--dry-run"], "unknown backend 'nope'; valid backends"),
    (["bench", "dense", "--preset", "smoke", "--masks", "causl", "--dry-run"], "unknown mask 'causl'; valid masks"),
    (["bench", "dense", "--config", "no/such/file.toml", "--dry-run"], "no/such/file.toml"),
    (["comm", "--scheme", "usp", "--world", "8", "--ulysses", "3"], "3"),
    (["masks", "show", "causal", "-S", "0"], "0"),
    (["nope"], "No such command 'nope'"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_mistakes_are_one_line(runner, args, needle):
    r = runner.invoke(main, args, env=NARROW)
    assert r.exit_code != 0
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1, r.output
    assert lines[0].startswith("error: ") and needle in lines[0], r.output
    assert "Traceback" not in r.output


def test_malformed_config_is_one_line(runner, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[grid\nmasks = [causal\n")
    r = runner.invoke(main, ["bench", "dense", "--config", str(bad), "--dry-run"], env=NARROW)
    assert r.exit_code != 0
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "bad.toml" in lines[0], r.output


@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_ladder_machine_formats_hold_the_table_alone(runner, fmt):
    """ladder --format json|csv: stdout parses as one table over both modes; the banner and log go to stderr."""
    r = runner.invoke(main, ["ladder", "--mode", "all", "--steps", "step0_naive,bwd1_naive", "--format", fmt], env=NARROW)
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout) if fmt == "json" else list(csv.DictReader(io.StringIO(r.stdout)))
    assert [(row["mode"], row["step"]) for row in rows] == [("fwd", "step0_naive"), ("bwd", "bwd1_naive")]
    assert all(row["check"].startswith("ok") for row in rows)
    assert "interpreter" in r.stderr and "checking against" in r.stderr


@pytest.mark.parametrize("length", ["65536", "64K", "64k"])
def test_every_command_reads_lengths_alike(runner, length):
    """One parser of sequence lengths: comm, masks show, autotune and recommend take 64K as 65536."""
    comm = runner.invoke(main, ["comm", "--scheme", "ring_p2p", "--world", "8", "--seqlen", length, "--format", "json"])
    assert comm.exit_code == 0, comm.output
    assert comm.stdout == runner.invoke(main, ["comm", "--scheme", "ring_p2p", "--world", "8", "--format", "json"]).stdout
    show = runner.invoke(main, ["masks", "show", "causal", "-S", length, "--format", "json"])
    assert show.exit_code == 0, show.output
    area = {r["statistic"]: r["value"] for r in json.loads(show.stdout)}["area"]
    assert area == 65536 * 65537 // 2
    dry = runner.invoke(main, ["autotune", "--kernel", "triton", "--masks", "causal", "--seqlens", f"4K,{length}",
                               "--dry-run", "--format", "json"])
    assert dry.exit_code == 0, dry.output
    assert {r["cases"] for r in json.loads(dry.stdout)} >= {"causal S=4096 D=128 bfloat16", "causal S=65536 D=128 bfloat16"}


def test_autotune_calls_nothing_click_9_removes(runner):
    """The command runs with Click's deprecation warnings as errors, and the package bounds click below 9."""
    import tomllib
    import warnings
    from pathlib import Path

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        r = runner.invoke(main, ["autotune", "--kernel", "triton", "--dry-run", "--format", "json"], env=NARROW)
    assert r.exit_code == 0, r.output
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "click>=8.1,<9" in pyproject["project"]["dependencies"]

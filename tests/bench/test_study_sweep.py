"""The full-breadth study's grids (issue 14): per-backend length limits in the experiment schema
(`[backend_max_seqlen]`), dense.toml planning >= 7 lengths for every backend and 128K for ours,
flex, flex-fa4, cudnn and fa4, and the device script's argument check."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from longca_triton.adapters import list_backends
from longca_triton.bench.config import ConfigError, Experiment, load_experiment
from longca_triton.bench.runner import plan_points
from longca_triton.masks import STATIC_MASK_NAMES

REPO = Path(__file__).resolve().parents[2]
KNOWN = {b.name for b in list_backends()}


def _planned(exp) -> dict:
    """backend -> set of lengths it has points at."""
    out: dict = {}
    for _, pts in plan_points(exp):
        for p in pts:
            out.setdefault(p.backend, set()).add(p.seqlen)
    return out


def test_backend_max_seqlen_leaves_points_out(tmp_path):
    cfg = tmp_path / "e.toml"
    cfg.write_text('[grid]\nmasks = ["causal"]\nseqlens = ["1K", "4K", "16K"]\nmodes = ["fwd"]\n'
                   'backends = ["triton", "reference", "flashmask-triton"]\n'
                   '[backend_max_seqlen]\nreference = "4K"\nflashmask-triton = 1024\n')
    e = load_experiment(cfg).validate(known_backends=KNOWN)
    assert e.backend_max_seqlen == {"reference": 4096, "triton-flashmask": 1024}  # old name made canonical
    planned = _planned(e)
    assert planned == {"triton": {1024, 4096, 16384}, "reference": {1024, 4096}, "triton-flashmask": {1024}}
    assert e.num_points() == sum(len(p) for _, p in plan_points(e)) == 3 + 2 + 1
    assert "3 (S, backend) pairs above the backend's max_seqlen left out" in e.grid_summary()
    # a problem no backend runs at is not planned at all
    e2 = Experiment(masks=["causal"], seqlens=[1024, 4096], modes=["fwd"], backends=["reference"],
                    backend_max_seqlen={"reference": 1024}).validate(known_backends=KNOWN)
    assert [k[1] for k, _ in plan_points(e2)] == [1024]


@pytest.mark.parametrize("table, needle", [
    ('[backend_max_seqlen]\nnope = "4K"\n', "unknown backend 'nope'"),
    ('[backend_max_seqlen]\nreference = "four"\n', "[backend_max_seqlen] reference"),
    ('[backend_max_seqlen]\nreference = 0\n', "must be positive"),
])
def test_backend_max_seqlen_errors(tmp_path, table, needle):
    cfg = tmp_path / "e.toml"
    cfg.write_text('[grid]\nmasks = ["causal"]\nbackends = ["reference"]\n' + table)
    with pytest.raises(ConfigError) as e:
        load_experiment(cfg).validate(known_backends=KNOWN)
    assert needle in str(e.value)


def test_dense_toml_is_the_full_breadth_study():
    e = load_experiment(REPO / "experiments" / "dense.toml").validate(known_backends=KNOWN)
    assert sorted(e.masks) == sorted(STATIC_MASK_NAMES)
    assert (64, 64) in e.heads and (64, 8) in e.heads and 64 in e.head_dims and 128 in e.head_dims
    planned = _planned(e)
    assert set(planned) == set(e.backends)
    for b, lengths in planned.items():
        assert len(lengths) >= 7, (b, sorted(lengths))
    for b in ("triton", "triton-flashmask", "flex", "flex-fa4", "cudnn", "fa4"):
        assert {65536, 131072} <= planned[b], b
    for b in ("sdpa-cudnn", "sdpa-math", "reference"):
        assert 65536 not in planned[b], b


def test_study_sweep_script_checks_its_study():
    script = REPO / "experiments" / "gpu" / "study_sweep.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True).returncode == 0
    r = subprocess.run(["bash", str(script)], check=False, env={"STUDY": "nope", "PATH": "/usr/bin:/bin"}, capture_output=True,
                       text=True, cwd=REPO)
    assert r.returncode == 2 and "STUDY must be dense, sparse or varblock" in r.stderr


def test_study_sweep_resumes_from_the_committed_gz_and_returns_one(tmp_path):
    """The device script on the CPU, its GPU steps stubbed: it gunzips the committed
    results.jsonl.gz into $OUT/results.jsonl, the bench appends there, and at the end
    $OUT/results.jsonl.gz holds every row; a .gz that cannot be read whole stops the call before
    the bench; a plain results.jsonl beside the .gz is the one resumed (with a warning)."""
    import gzip
    import json
    import shutil
    import sys

    repo, out, bin_ = tmp_path / "repo", tmp_path / "out", tmp_path / "bin"
    (repo / "experiments" / "gpu").mkdir(parents=True)
    for name in ("study_sweep.sh", "bench_check.sh"):
        shutil.copy(REPO / "experiments" / "gpu" / name, repo / "experiments" / "gpu" / name)
    (repo / "experiments" / "gpu" / "wheels.sh").write_text("true\n")  # no wheels here
    (repo / "experiments" / "dense.toml").write_text("")
    study = repo / "experiments" / "results" / "h100" / "study" / "dense"
    study.mkdir(parents=True)
    committed = [{"status": "ok", "seqlen": 1024, "i": i} for i in range(3)]
    (study / "results.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in committed).encode()))
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text("#!/bin/sh\necho no-gpu\n")
    # python3: the bench appends one row to --out's results.jsonl; doctor, pip, report, plot do nothing
    (bin_ / "python3").write_text(f"""#!/bin/bash
case "$1 $2 $3" in
  "-m longca_triton.cli bench") while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done
    echo '{{"status":"ok","seqlen":2048}}' >> "$out/results.jsonl"; exit 0 ;;
  "-m longca_triton.cli "*|"-m pip install") exit 0 ;;
esac
exec {sys.executable} "$@"
""")
    for f in bin_.iterdir():
        f.chmod(0o755)

    def sweep():
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        return subprocess.run(["bash", "experiments/gpu/study_sweep.sh"], cwd=repo, capture_output=True, text=True,
                              env={"STUDY": "dense", "OUT": str(out), "PATH": f"{bin_}:/usr/bin:/bin",
                                   "STUDY_LAST": str(last)})

    last = tmp_path / "machine_tmp" / "last.jsonl.gz"
    last.parent.mkdir()
    r = sweep()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resuming from 3 rows of experiments/results/h100/study/dense/results.jsonl.gz" in r.stdout
    rows = [json.loads(x) for x in gzip.decompress((out / "results.jsonl.gz").read_bytes()).splitlines()]
    assert rows == committed + [{"status": "ok", "seqlen": 2048}]
    # the call left its rows on the machine: the next call (warm) resumes from them, not the commit
    assert last.read_bytes() == (out / "results.jsonl.gz").read_bytes()
    r = sweep()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resuming from this machine's last call" in r.stdout and "resuming from 4 rows" in r.stdout
    rows = [json.loads(x) for x in gzip.decompress((out / "results.jsonl.gz").read_bytes()).splitlines()]
    assert rows == committed + [{"status": "ok", "seqlen": 2048}] * 2
    last.unlink()  # a fresh machine: back to the committed file
    assert (out / "results.jsonl").read_bytes() == gzip.decompress((out / "results.jsonl.gz").read_bytes())
    assert len(list(out.iterdir())) <= 8  # the run tool returns at most 8 files
    # a plain results.jsonl next to the .gz: resumed from, with a warning
    (study / "results.jsonl").write_text(json.dumps(committed[0]) + "\n")
    r = sweep()
    assert r.returncode == 0 and "warning: both" in r.stderr and "resuming from 1 rows of" in r.stdout
    (study / "results.jsonl").unlink()
    # a .gz cut short: the call stops before the bench (its rows would lack the committed ones)
    data = (study / "results.jsonl.gz").read_bytes()
    (study / "results.jsonl.gz").write_bytes(data[: len(data) - 12])
    r = sweep()
    assert r.returncode != 0 and "could not read" in r.stderr and "setup:" not in r.stdout
    assert not (out / "results.jsonl").exists() and not (out / "results.jsonl.gz").exists()


def test_wheels_pack_lays_out_folders_that_travel(tmp_path):
    """`wheels.sh pack NAME GROUP...`: wheels vendor-wheels.sh split at its size are re-joined, re-split
    at PART_MIB, and first-fit into folders of at most FOLDER_MIB; joining the parts gives the wheel back."""
    import os

    big = bytes(range(256)) * (10 * 1024)  # 2.5 MiB
    fake = tmp_path / "vendor-wheels.sh"
    # stands in for ../shared/scripts/vendor-wheels.sh GROUP DEST: GROUP a has a wheel split in two
    # parts (as the real script leaves one over its limit), GROUP b a small wheel
    fake.write_text(
        "set -e\nmkdir -p \"$2/$1/1\"\n"
        "if [ \"$1\" = a ]; then python3 -c \"import sys; d=bytes(range(256))*(10*1024); "
        "open(sys.argv[1]+'.part-aa','wb').write(d[:1500000]); open(sys.argv[1]+'.part-ab','wb').write(d[1500000:])\" "
        "\"$2/$1/1/big-1.0-py3-none-any.whl\"; fi\n"
        "if [ \"$1\" = b ]; then head -c 300000 /dev/zero > \"$2/$1/1/small-1.0-py3-none-any.whl\"; fi\n")
    work = tmp_path / "repo"
    work.mkdir()
    env = {**os.environ, "VENDOR_WHEELS": str(fake), "PART_MIB": "1", "FOLDER_MIB": "1.5"}
    res = subprocess.run(["bash", str(REPO / "experiments" / "gpu" / "wheels.sh"), "pack", "x", "a", "b"], cwd=work,
                         env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    folders = sorted((work / ".whl" / "x").iterdir())
    assert len(folders) >= 2
    for d in folders:
        assert sum(f.stat().st_size for f in d.iterdir()) <= 1.5 * 2**20, d
    files = {f.name: f for d in folders for f in d.iterdir()}
    parts = sorted(n for n in files if n.startswith("big-1.0-py3-none-any.whl.part-"))
    assert parts == ["big-1.0-py3-none-any.whl.part-aa", "big-1.0-py3-none-any.whl.part-ab",
                     "big-1.0-py3-none-any.whl.part-ac"]
    assert b"".join(files[n].read_bytes() for n in parts) == big
    assert files["small-1.0-py3-none-any.whl"].stat().st_size == 300000
    bad = subprocess.run(["bash", str(REPO / "experiments" / "gpu" / "wheels.sh"), "pack", "x"], cwd=work, env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr

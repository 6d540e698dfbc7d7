"""``bench cp``: the CP sweep (scheme x plan x mask x world size), one ``torchrun`` job per world size.

Launcher (:func:`launch`): resolves the TOML config (plus command-line overrides) into
``OUT/cp_config.json``, then for every world size that fits the visible GPUs runs
``python -m torch.distributed.run --standalone --nproc_per_node N -m longca_triton.cp.bench OUT/cp_config.json``
(or, when already launched by torchrun, runs the worker in place).

Worker (:func:`.bench_worker.worker`; report: :mod:`.bench_report`), per mask and mode: the single-GPU time ``T1`` of the same step kernel on
the whole sequence (rank 0; row ``scheme="single", world_size=1``), then every scheme x plan:
local inputs, warm-up, ``rep`` timed repetitions each started together (barrier + synchronize) and
timed with CUDA events on every rank; the point's time is the median over repetitions of the
slowest rank. Per-GPU TFLOP/s = docs/masks.md §5 work of the whole mask / N / time; efficiency =
``T1 / (N * time)`` (= per-GPU TFLOP/s over single-GPU TFLOP/s); peak memory is the largest over
ranks. A failing point becomes a status row (``unsupported: ...``, ``oom``, ``error: ...``).

Peer: yunchang's USP (``LongContextAttention``, ring ``basic_pytorch``, PyTorch SDPA flash
kernel) on the masks it can express (full, causal), forward only: yunchang 0.6.4 has no backward
for its PyTorch-attention path, and its SDPA call has no GQA, so K/V heads are replicated to Hq
before it (noted in the row).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .bench_report import write_report
from .bench_worker import worker

__all__ = ["load_config", "launch", "torchrun", "worker", "write_report", "SMOKE"]

DEFAULTS = dict(
    name="cp", tokens_per_gpu=8192, world_sizes=[2, 4, 8], heads="64:8", head_dim=128, dtype="bfloat16", batch=1,
    seed=0, backend="triton", modes=["fwd_bwd"], masks=["full", "causal"], schemes=["ring_p2p"], plans=["zigzag"],
    warmup=3, rep=10, scheme={}, params={}, peer={"yunchang": False, "masks": ["full", "causal"]}, timeout_s=600,
)

#: a CPU-sized grid (gloo, reference kernel) to exercise the whole path without a GPU
SMOKE = dict(
    name="cp-smoke", tokens_per_gpu=64, world_sizes=[2], heads="4:2", head_dim=16, dtype="float32", batch=1,
    backend="reference", modes=["fwd", "fwd_bwd"], masks=["causal", "causal_document"],
    schemes=["ulysses", "ring_p2p", "ring_allgather", "usp", "loongtrain", "group_cast"], plans=["zigzag", "balanced"],
    warmup=1, rep=2, peer={"yunchang": True, "masks": ["full", "causal"]},
)

DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "float32": "float32", "fp32": "float32", "float64": "float64"}


def _csv(v):
    if isinstance(v, str):
        return [x.strip() for x in v.split(",") if x.strip()]
    return list(v)


def load_config(path: str | None, overrides: dict | None = None) -> dict:
    """The TOML file (or ``"smoke"``) merged over the defaults, with overrides (strings: comma lists)."""
    cfg = json.loads(json.dumps(DEFAULTS))
    if path == "smoke":
        cfg.update(json.loads(json.dumps(SMOKE)))
    elif path:
        import tomllib

        with open(path, "rb") as f:
            cfg.update(tomllib.load(f))
    for key, val in (overrides or {}).items():
        if key == "world_sizes":
            cfg[key] = [int(x) for x in _csv(val)]
        elif key in ("masks", "schemes", "plans", "modes"):
            cfg[key] = _csv(val)
        else:
            cfg[key] = val
    cfg["dtype"] = DTYPES.get(cfg["dtype"], cfg["dtype"])
    from .comm import SCHEMES
    from .plan import PLAN_KINDS

    for s in cfg["schemes"]:
        if s not in SCHEMES:
            raise ValueError(f"unknown scheme {s!r} in the config; valid: {', '.join(SCHEMES)}")
    for p in cfg["plans"]:
        if p not in PLAN_KINDS:
            raise ValueError(f"unknown plan {p!r} in the config; valid: {', '.join(PLAN_KINDS)}")
    for m in cfg["modes"]:
        if m not in ("fwd", "fwd_bwd"):
            raise ValueError(f"unknown mode {m!r}; bench cp measures fwd and fwd_bwd")
    return cfg


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _default_out(cfg) -> Path:
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:
        gpu = "cpu"
    slug = "".join(c if c.isalnum() else "-" for c in gpu.lower()).strip("-")
    return Path("results") / f"{cfg['name']}-{slug}"


def torchrun(args: list[str], nproc: int) -> int:
    """``python -m torch.distributed.run --standalone --nproc_per_node=NPROC ARGS`` with the repository
    on ``PYTHONPATH`` and unbuffered output (the command printed first); returns its exit code. The
    CP sweep's launcher, and the experiment scripts' way to rerun themselves on every GPU."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_repo_root())] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env).returncode


def script_parser(description: str, out: str, masks: str, points: str, points_help: str):
    """The arguments every CP experiment script takes (``--out``, ``--masks``, ``--points``,
    ``--tokens-per-gpu`` and the hidden ``--worker`` its torchrun relaunch passes)."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=os.environ.get("OUT", out))
    p.add_argument("--masks", default=masks)
    p.add_argument("--points", default=points, help=points_help)
    p.add_argument("--tokens-per-gpu", type=int, default=8192)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def local_gpus() -> int:
    """The CUDA devices of this host (0 without any)."""
    import torch

    return torch.cuda.device_count()


def run_script(args, script: str, worker, nproc) -> int:
    """A CP experiment script after parsing ``args``: a ``--worker`` runs ``worker(args)``; otherwise
    ``--out`` is made and the script reruns on ``nproc()`` ranks under torchrun with the same arguments."""
    if args.worker:
        return worker(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return torchrun([script, "--worker", *sys.argv[1:]], nproc())


def end_worker() -> int:
    """Wait for every rank, then leave the process group: the end of a worker process of the CP scripts."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return 0


def launch(config: str | None, overrides: dict | None = None, out: str | None = None, peer: bool = True,
           dry_run: bool = False) -> int:
    """Run the sweep: in place under torchrun, else one torchrun job per world size. Returns an exit code."""
    import torch

    cfg = load_config(config, overrides)
    if not peer:
        cfg["peer"] = dict(cfg.get("peer", {}), yunchang=False)
    out_dir = Path(out) if out else _default_out(cfg)
    cfg["out"] = str(out_dir)
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        return worker(cfg)
    ngpu = torch.cuda.device_count()
    cpu = ngpu == 0
    if cpu and cfg["backend"] not in ("reference", "reference-chunked"):
        print(f"bench cp: no CUDA GPU here; backend {cfg['backend']!r} needs one "
              "(use --config smoke for a CPU run of the reference kernel)")
        return 1
    worlds = cfg["world_sizes"] if cpu else [w for w in cfg["world_sizes"] if w <= ngpu]
    skipped = [w for w in cfg["world_sizes"] if w not in worlds]
    print(f"bench cp: {cfg['name']}: worlds {worlds} (skipped, too few GPUs: {skipped}), masks {cfg['masks']}, "
          f"schemes {cfg['schemes']}, plans {cfg['plans']}, modes {cfg['modes']}, backend {cfg['backend']}, out {out_dir}")
    if dry_run or not worlds:
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = out_dir / "cp_config.json"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    rc = 0
    for w in worlds:
        rc = torchrun(["-m", "longca_triton.cp.bench", str(cfg_path)], w) or rc
    if (out_dir / "results.jsonl").exists():
        text = write_report(out_dir)
        print(text.split("\n## ")[1] if "\n## " in text else text, flush=True)
        try:
            from .plot import make_cp_plots

            rows = [json.loads(x) for x in (out_dir / "results.jsonl").read_text().splitlines() if x.strip()]
            for f in make_cp_plots(rows, out_dir / "plots"):
                print("plot:", f)
        except Exception as e:  # a plotting problem never loses the measured rows
            print(f"bench cp: plots failed: {type(e).__name__}: {e}")
    return rc


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        rc = worker(json.load(f))
    # why os._exit: the rows are on disk and the process group is destroyed; skipping interpreter
    # teardown avoids a gloo worker thread being destroyed while joinable ("terminate called
    # without an active exception", seen once on a loaded 2-core CI machine)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)

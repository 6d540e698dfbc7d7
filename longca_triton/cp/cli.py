"""The ``comm`` command and the ``cp`` subcommand of ``bench``.

``longca-triton comm --scheme usp --world 8 --ulysses 2 --seqlen 65536 --heads 64:8 --head-dim 128 --mask causal``
prints the closed-form per-device bytes of every collective (``comm.comm_model``).

``longca-triton bench cp --config experiments/cp.toml`` measures every scheme x plan x mask x world
size (``bench.py``), launching itself under ``torchrun`` once per world size.
"""

from __future__ import annotations

import click

from longca_triton.cli_values import SEQLEN
from longca_triton.output import emit, format_option

from .comm import SCHEMES

__all__ = ["comm_command", "cp_bench_command"]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _heads(value: str) -> tuple[int, int]:
    try:
        hq, _, hkv = value.partition(":")
        hq, hkv = int(hq), int(hkv or hq)
    except ValueError:
        raise click.BadParameter(f"expected Hq:Hkv such as 64:8, got {value!r}") from None
    if hq < 1 or hkv < 1 or hq % hkv:
        raise click.BadParameter(f"Hq must be a positive multiple of Hkv, got {value!r}")
    return hq, hkv


DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4, "fp32": 4, "float64": 8}


@click.command("comm")
@click.option("--scheme", type=click.Choice(SCHEMES), required=True, help="CP scheme")
@click.option("--world", type=click.IntRange(min=1), required=True, help="number of devices N")
@click.option("--ulysses", "ulysses", type=click.IntRange(min=1), default=None, help="Ulysses degree U (usp, loongtrain)")
@click.option("--window", type=click.IntRange(min=1), default=None, help="loongtrain: inner ring (window) size W")
@click.option("--seqlen", "-S", type=SEQLEN, default=65536, show_default=True, help="global sequence length T, e.g. 65536 or 64K")
@click.option("--heads", default="64:8", show_default=True, help="Hq:Hkv")
@click.option("--head-dim", default="128", show_default=True, help="D, or D_qk/D_v when v has its own (e.g. 192/128)")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), default="bfloat16", show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--mask", default=None, help="mask name (docs/masks.md); adds the fraction of ring transfers some pair uses (group_cast: required)")
@click.option("--plan", type=click.Choice(["contiguous", "zigzag", "balanced"]), default="zigzag", show_default=True)
@click.option("--rank", type=click.IntRange(min=0), default=None, help="group_cast: the device to show (default: the busiest)")
@click.option("--return-lse", is_flag=True, help="count the lse all-to-all of the Ulysses schemes")
@format_option
def comm_command(scheme, world, ulysses, window, seqlen, heads, head_dim, dtype, batch, mask, plan, rank, return_lse, fmt):
    """Per-device bytes sent / received per collective, forward and backward (closed form).

    \b
    Examples:
      longca-triton comm --scheme ring_p2p --world 8 --seqlen 65536 --heads 64:8 --head-dim 128
      longca-triton comm --scheme usp --world 8 --ulysses 2 --seqlen 65536 --heads 64:8 --mask causal
      longca-triton comm --scheme loongtrain --world 16 --window 4 --seqlen 131072
      longca-triton comm --scheme ring_p2p --world 8 --head-dim 192/128   # K at 192, V at 128
      longca-triton comm --scheme ring_p2p --world 8 --format csv     # bytes as integers
      longca-triton comm --scheme group_cast --world 8 --mask causal_document --plan balanced
    """
    from rich.console import Console

    from longca_triton.bench.params import parse_head_dim

    from .comm import comm_model
    from .mesh import resolve_dims

    hq, hkv = _heads(heads)
    try:
        d_qk, d_v = parse_head_dim(head_dim)
        U, W, O = resolve_dims(scheme, world, hq, ulysses, window)
        m = None
        if mask:
            from longca_triton.masks import make_mask

            m = make_mask(mask, seqlen)
        if scheme == "group_cast" and m is None:
            raise ValueError("group_cast moves what the mask needs: give --mask")
        if m is not None and scheme in ("group_cast", "ring_allgather"):
            from .plan import make_plan

            plan = make_plan(m, world, plan)  # one plan for both lines below
        rows = comm_model(scheme, world, ulysses, seqlen, (hq, hkv), d_qk, DTYPE_BYTES[dtype], m, plan=plan,
                          batch=batch, window=window, return_lse=return_lse, rank=rank, head_dim_v=d_v)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    con = Console()
    title = (f"{scheme}: N={world} (U={U} x ring {W * O}" + (f" = {O} windows x {W}" if O > 1 else "") + f"), "
             f"T={seqlen}, heads {hq}:{hkv}, D={head_dim}, {dtype}, B={batch}")
    # a table shows sizes in words; json / csv keep the integers
    size = _fmt_bytes if fmt == "table" else int
    out, tot = [], {"fwd": [0, 0], "bwd": [0, 0]}
    for r in rows:
        out.append(dict(phase=r.phase, collective=r.collective, tensor=r.tensor, calls=r.calls,
                        sent=size(r.bytes_sent), received=size(r.bytes_received)))
        tot[r.phase][0] += r.bytes_sent
        tot[r.phase][1] += r.bytes_received
    for phase, (sent, rcv) in tot.items():
        out.append(dict(phase=f"{phase} total", collective="", tensor="", calls="", sent=size(sent), received=size(rcv)))
    emit(out, ["phase", "collective", "tensor", "calls", "sent", "received"], fmt=fmt, title=title,
         headers={"sent": "sent / device", "received": "received / device"})
    if fmt != "table":
        return
    if scheme == "group_cast":
        from .need import need_layout

        lay = need_layout(plan)
        ag = comm_model("ring_allgather", world, None, seqlen, (hq, hkv), d_qk, DTYPE_BYTES[dtype], m, plan=plan, batch=batch,
                        head_dim_v=d_v)
        ag_total = sum(r.bytes_sent + r.bytes_received for r in ag)
        per = [sum(r.bytes_sent + r.bytes_received for r in comm_model(
            scheme, world, None, seqlen, (hq, hkv), d_qk, DTYPE_BYTES[dtype], m, plan=plan, batch=batch, rank=k,
            head_dim_v=d_v))
            for k in range(world)]
        shown = rank if rank is not None else max(range(world), key=lambda k: per[k])
        con.print(f"mask {mask}: plan {plan.describe()}; device {shown} ({'chosen' if rank is not None else 'the busiest'}). "
                  f"fwd+bwd bytes per device vs ring_allgather ({_fmt_bytes(ag_total)} sent + received): "
                  + ", ".join(f"rank {k} {per[k] / ag_total:.1%}" for k in range(world))
                  + f"; all devices together {sum(per) / (world * ag_total):.1%}. Tokens received per rank: "
                  f"{lay.counts.sum(1).tolist()} (an all-gather: {plan.local_len * (world - 1)} each)")
        return
    if m is not None and scheme != "ulysses":
        from .plan import CPPlan, make_plan

        p = plan if isinstance(plan, CPPlan) else make_plan(m, world, plan)
        frac = _useful_fraction(p, scheme, U, W, O)
        con.print(f"mask {mask}: plan {p.describe()}; {frac:.1%} of the (query shard, key shard) pairs the ring "
                  f"moves are used by the mask (the rest is communicated but skipped in compute)")


def _useful_fraction(plan, scheme, U, W, O) -> float:
    R = W * O
    shards = [tuple(range(p * U, (p + 1) * U)) for p in range(R)]
    if scheme == "ring_allgather":
        shards = [(r,) for r in range(plan.world_size)]
    used = sum(plan.pair_mask(a, b) is not None for a in shards for b in shards if a != b)
    total = len(shards) * (len(shards) - 1)
    return used / total if total else 1.0


@click.command("cp")
@click.option("--config", "config", type=click.Path(dir_okay=False, exists=True), default=None,
              help="TOML experiment (default: experiments/cp.toml)")
@click.option("--preset", type=click.Choice(["smoke"]), default=None, help="built-in grid instead of a file; 'smoke': tiny, CPU (gloo, reference kernel)")
@click.option("--world", "worlds", default=None, help="comma-separated world sizes (default: those of the config that fit the GPUs)")
@click.option("--masks", default=None, help="comma-separated masks (override)")
@click.option("--schemes", default=None, help="comma-separated schemes (override)")
@click.option("--plans", default=None, help="comma-separated plans (override)")
@click.option("--modes", default=None, help="comma-separated modes: fwd, fwd_bwd (override)")
@click.option("--backend", default=None, help="step kernel backend (override; default from the config: triton)")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="output directory (results.jsonl); default results/cp-<gpu>")
@click.option("--no-peer", is_flag=True, help="skip the yunchang peer rows")
@click.option("--max-minutes", type=click.FloatRange(min=0), default=None, help="stop starting new points after this many minutes (resumable)")
@click.option("--dry-run", is_flag=True, help="print the resolved grid and exit")
def cp_bench_command(config, preset, worlds, masks, schemes, plans, modes, backend, out, no_peer, max_minutes, dry_run):
    """Context-parallel sweep: scheme x plan x mask x world size (launches torchrun per world size).

    Per point: the max-rank time (median over repetitions of the slowest rank), per-GPU TFLOP/s
    (docs/masks.md §5 work of the whole mask / N / time), peak memory (max over ranks), and efficiency
    against the single-GPU time of the same backend on the whole sequence divided by N. Rows go to
    OUT/results.jsonl through the bench results store (resumable).

    \b
    Examples:
      longca-triton bench cp --config experiments/cp.toml
      longca-triton bench cp --config experiments/cp.toml --world 2 --masks causal --schemes ring_p2p
      longca-triton bench cp --preset smoke --out /tmp/cp-smoke          # CPU, 2 gloo processes
    """
    from .bench import launch

    overrides = {k: v for k, v in dict(world_sizes=worlds, masks=masks, schemes=schemes, plans=plans, modes=modes,
                                        backend=backend).items() if v}
    if max_minutes is not None:
        import time

        overrides["deadline"] = time.time() + 60 * max_minutes
    if preset and config:
        raise click.UsageError("give --config or --preset, not both")
    rc = launch(preset or config or "experiments/cp.toml", overrides, out, peer=not no_peer, dry_run=dry_run)
    if rc:
        raise SystemExit(rc)


if __name__ == "__main__":  # python -m longca_triton.cp.cli [bench cp options] (no install needed)
    cp_bench_command()

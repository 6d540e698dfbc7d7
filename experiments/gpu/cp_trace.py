"""Where the time of one CP call goes, op by op, on every rank: a GPU timeline per call.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python experiments/gpu/cp_trace.py --out $OUT [--masks causal_document] \
        [--points group_cast/balanced,group_cast@dkv_after_dq/balanced,ring_allgather/balanced]

``cp_profile.py`` sums device time per op over three calls; it cannot say what overlaps what, nor
where the GPU sits idle. This script records two calls per point with the torch profiler (each call
preceded by a device synchronize and a barrier, so that calls do not overlap) and writes, per rank,
``OUT/timeline_r<rank>.txt``: for the second call, every GPU op (kernel, copy, NCCL) with its stream,
start and end in microseconds from the call's first host op, then the moments no op runs and a
summary row (``OUT/trace.jsonl`` on rank 0: the bench's time of the point ``cp_ms``, and the traced
call's wall, idle and NCCL-alone time).

Variants (``scheme@variant``), without changing the library:

``--high-priority`` puts NCCL's kernels on high-priority CUDA streams (``ProcessGroupNCCL.Options``).

* ``group_cast@dkv_after_dq``: the backward's dK/dV partials leave *after* the dQ kernel instead of
  during it (a step-kernel wrapper that calls ``after_dkdv`` once the whole backward returned) --
  measures what the overlap costs the dQ kernel (the NCCL kernel takes SMs while dQ runs) against
  the transfer it hides.

On a CPU (``--device cpu``: gloo, the reference step kernel, a few hundred tokens) it runs as a smoke
test of the script itself; the timeline then lists CPU ops.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from longca_triton.cp.kernels import StepKernel, then_dkdv  # noqa: E402 - after the path above


class _AfterDQ(StepKernel):
    """A step kernel whose backward hands dK/dV to ``after_dkdv`` only once dQ is done too."""

    def __init__(self, inner: StepKernel):
        self.inner, self.name = inner, inner.name + "@dkv_after_dq"

    def forward(self, *a, **kw):
        return self.inner.forward(*a, **kw)

    def backward(self, *a, after_dkdv=None, **kw):
        return then_dkdv(after_dkdv, *self.inner.backward(*a, **kw))

    def single_device(self):
        return self.inner.single_device()


def _gpu_events(trace: dict, cuda: bool) -> list[dict]:
    cats = {"kernel", "gpu_memcpy", "gpu_memset"} if cuda else {"cpu_op"}
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in cats]


def _timeline(trace: dict, cuda: bool) -> tuple[list[str], dict]:
    """The second recorded call's ops relative to its first host op, and its summary."""
    marks = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace["traceEvents"]
                   if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"].startswith("cp_call"))
    t0, t1 = marks[-1][0], marks[-1][1]
    evs = sorted((e for e in _gpu_events(trace, cuda) if e["ts"] >= t0), key=lambda e: e["ts"])
    if not cuda:
        evs = [e for e in evs if e["ts"] <= t1 and not e["name"].startswith("aten::")]
    lines, busy, comm_only = [], [], 0.0
    for e in evs:
        st = e.get("args", {}).get("stream", e.get("tid"))
        s, d = e["ts"] - t0, e["dur"]
        lines.append(f"{s:9.1f} {s + d:9.1f} {d:8.1f}  s{st!s:>3}  {e['name'][:90]}")
        busy.append((s, s + d, "nccl" in e["name"].lower()))
    end = max((b for _, b, _ in busy), default=0.0)
    # idle: moments when no op runs on any stream; nccl-only: moments when only NCCL runs
    pts = sorted({0.0, end} | {a for a, _, _ in busy} | {b for _, b, _ in busy})
    idle = 0.0
    gaps = []
    for a, b in zip(pts, pts[1:]):
        mid = (a + b) / 2
        running = [n for s, e, n in busy if s <= mid < e]
        if not running:
            idle += b - a
            if b - a >= 5:
                gaps.append((a, b))
        elif all(running):
            comm_only += b - a
    summary = dict(wall_us=end, idle_us=idle, nccl_only_us=comm_only, compute_us=end - idle - comm_only,
                   host_span_us=t1 - t0, gaps_over_5us=[(round(a, 1), round(b, 1)) for a, b in gaps])
    return lines, summary


def main() -> int:
    """Parse the arguments, then trace as a worker or relaunch on every rank (``--world`` processes on a CPU)."""
    from longca_triton.cp.bench import local_gpus, run_script, script_parser

    p = script_parser(__doc__.splitlines()[0], "results/cp-trace", "causal_document",
                      "group_cast/balanced,group_cast@dkv_after_dq/balanced,ring_allgather/balanced",
                      "scheme[@variant]/plan, comma-separated (variant: dkv_after_dq)")
    p.add_argument("--heads-q", type=int, default=64)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--high-priority", action="store_true", help="NCCL on high-priority CUDA streams")
    p.add_argument("--world", type=int, default=None, help="processes (default: the GPUs; 2 on CPU)")
    a = p.parse_args()
    return run_script(a, __file__, worker, lambda: a.world or (local_gpus() if a.device == "cuda" else 2))


def worker(a) -> int:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from longca_triton import cp
    from longca_triton.cp.bench import end_worker
    from longca_triton.cp.kernels import get_step_kernel
    from longca_triton.masks import make_mask

    cuda = a.device == "cuda"
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local)
    if cuda and a.high_priority:
        # NCCL's kernels on high-priority streams: their blocks are scheduled ahead of a running
        # kernel's pending ones (otherwise the dK/dV transfer posted during the dQ kernel waits for
        # its last wave, as a trace of it showed)
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = True
        dist.init_process_group("nccl", pg_options=opts)
    else:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, N = dist.get_rank(), dist.get_world_size()
    S, Hq, Hkv, D = a.tokens_per_gpu * N, a.heads_q, a.heads_kv, a.head_dim
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    out = Path(a.out)
    base = get_step_kernel("triton" if cuda else "reference")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    log = open(out / f"timeline_r{rank}.txt", "a")

    def sync():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    for mname in [m for m in a.masks.split(",") if m]:
        kw = dict(block=1024) if mname == "block_causal_document" else {}
        mask = make_mask(mname, S, seed=0, **kw)
        for spec in a.points.split(","):
            scheme, kind = spec.split("/")
            scheme, _, variant = scheme.partition("@")
            kern = _AfterDQ(base) if variant == "dkv_after_dq" else base
            plan = cp.make_plan(mask, N, kind)
            L = plan.local_len
            g = torch.Generator(device=dev).manual_seed(100 + rank)
            q = torch.randn(1, L, Hq, D, device=dev, dtype=dtype, generator=g).requires_grad_()
            k = torch.randn(1, L, Hkv, D, device=dev, dtype=dtype, generator=g).requires_grad_()
            v = torch.randn(1, L, Hkv, D, device=dev, dtype=dtype, generator=g).requires_grad_()
            do = torch.randn_like(q)

            def call():
                o = cp.attention(q, k, v, plan, scheme, None, kern)
                return torch.autograd.grad(o, (q, k, v), do)
            for _ in range(3):
                call()
            from longca_triton.bench.timing import time_fn

            # the bench's timing of the same point (slowest rank per call, L2 flushed, median of 10)
            cp_ms = time_fn(call, rep=10, warmup_calls=0, ranks=True)["median_ms"] if cuda else None
            sync()
            with profile(activities=acts) as prof:
                for i in range(2):
                    sync()
                    with record_function(f"cp_call{i}"):
                        call()
                    sync()
            path = out / f"trace_{mname}_{scheme}{'@' + variant if variant else ''}_{kind}_r{rank}.json"
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
            with gzip.open(str(path) + ".gz", "wt") as f:
                json.dump(trace, f)
            path.unlink()
            lines, summ = _timeline(trace, cuda)
            row = dict(mask=mname, point=spec, rank=rank, N=N, S=S, cp_ms=cp_ms, **summ)
            print(f"\n==== {mname} {spec} rank {rank}: " + json.dumps({k2: v2 for k2, v2 in row.items() if k2 != "gaps_over_5us"})
                  + f"\n idle gaps >= 5 us: {summ['gaps_over_5us']}\n    start       end      dur  stream  op\n"
                  + "\n".join(lines), file=log, flush=True)
            rows = [None] * N
            dist.all_gather_object(rows, row)
            if rank == 0:
                with open(out / "trace.jsonl", "a") as f:
                    for r in rows:
                        f.write(json.dumps(r) + "\n")
                for r in rows:
                    print(json.dumps({k2: (round(v2, 1) if isinstance(v2, float) else v2) for k2, v2 in r.items()
                                      if k2 != "gaps_over_5us"}), flush=True)
            if cuda:
                torch.cuda.empty_cache()
    return end_worker()


if __name__ == "__main__":
    sys.exit(main())

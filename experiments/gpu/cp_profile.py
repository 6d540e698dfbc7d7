"""Where a CP scheme's time goes beyond half the single-GPU time on 2+ GPUs.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python experiments/gpu/cp_profile.py --out $OUT [--masks causal_document,full] [--nccl-probe]

For each mask x (scheme, plan) (8K tokens per GPU, GQA 64:8, D = 128, bf16, fwd+bwd, our Triton step
kernel), every rank reports, into ``OUT/profile_r<rank>.txt`` and one JSON row per point in
``OUT/profile.jsonl`` (rank 0):

* ``cp_ms``: one CP call (fwd+bwd), timed as ``bench cp`` times it (``time_fn`` over ranks: L2 flushed,
  a barrier before each of 10 calls, each counted as its slowest rank; ``*_max`` that, ``rank0_*`` rank 0's
  own median; rows written before 2026-11-23's review took the max of the ranks' medians, unflushed);
* ``kernel_ms``: the same rank's step-kernel calls alone, without any collective, merge, cast or copy
  (group_cast: the one call over own + received keys, or with ``+split`` the local + remote calls;
  ring_allgather: the one call against the gathered keys) -- the compute floor of the scheme on that rank;
* ``single_ms``: the whole mask on one GPU (the benchmark's baseline);
* a torch.profiler table (the top device-time ops of three calls) and the device-busy fraction
  (kernel time / wall time of those calls: below ~0.95 the GPU waits on the host).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def _time(fn) -> dict:
    """The CP benchmark's timing (``time_fn`` over ranks: a barrier before each of 10 calls, each
    counted as its slowest rank): ``median_ms`` the slowest rank's, ``rank_median_ms`` this rank's."""
    from longca_triton.bench.timing import time_fn

    return time_fn(fn, rep=10, warmup_calls=0, ranks=True)


def _nccl_probe(out: Path, rank: int, N: int, dev) -> None:
    """What the collectives the CP schemes use reach here: all_gather, all_to_all (even splits) and
    reduce_scatter of 1-64 MiB per rank, bf16, median of 10 (CUDA events). Rows ``kind: nccl``
    in profile.jsonl: algorithm bandwidth (bytes per rank / time) and bus bandwidth (NCCL's
    convention, x (N - 1) / N)."""
    import torch
    import torch.distributed as dist

    for mib in (1, 4, 16, 32, 64):
        n = mib * 2**20 // 2
        x = torch.randn(n, device=dev, dtype=torch.bfloat16)
        big = torch.empty(n * N, device=dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        ops = {"all_gather": lambda: dist.all_gather_into_tensor(big, x),
               "all_to_all": lambda: dist.all_to_all_single(y, x),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(x, big)}
        for name, fn in ops.items():
            fn()
            ms = _time(fn)["median_ms"]
            per_rank = n * 2 * (N if name != "all_to_all" else 1)  # bytes each rank contributes / receives
            row = dict(kind="nccl", op=name, MiB=mib, N=N, ms=ms, algbw_GBps=per_rank / ms / 1e6,
                       busbw_GBps=per_rank / ms / 1e6 * (N - 1) / N)
            if rank == 0:
                with open(out / "profile.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)


def worker(a) -> int:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from longca_triton import cp
    from longca_triton.cp.kernels import TritonStep
    from longca_triton.cp.bench import end_worker
    from longca_triton.cp.need import need_layout
    from longca_triton.masks import make_mask

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, N = dist.get_rank(), dist.get_world_size()
    S, Hq, Hkv, D = a.tokens_per_gpu * N, 64, 8, 128
    out = Path(a.out)
    log = open(out / f"profile_r{rank}.txt", "a")
    kern = TritonStep()
    scale = D ** -0.5
    dev = torch.device("cuda", local)
    if a.nccl_probe:
        _nccl_probe(out, rank, N, dev)
    for mname in [m for m in a.masks.split(",") if m]:
        kw = dict(block=1024) if mname == "block_causal_document" else {}
        mask = make_mask(mname, S, seed=0, **kw)
        # the single-GPU baseline, every rank on its own GPU (rank 0's is reported)
        g = torch.Generator(device=dev).manual_seed(1)
        qs = torch.randn(1, S, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
        ks, vs = (torch.randn(1, S, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
        whole = kern.single_device()

        def one():
            o, lse = whole.forward(qs, ks, vs, mask, scale)
            whole.backward(torch.ones_like(o), qs, ks, vs, o, lse, mask, scale)
        one()
        single = _time(one)
        single_ms = single["rank_median_ms"]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                one()
            torch.cuda.synchronize()
        print(f"\n==== {mname} single GPU (whole mask) rank {rank}: {single_ms:.3f} ms\n"
              f"{prof.key_averages().table(sort_by='self_device_time_total', row_limit=10, max_name_column_width=60)}",
              file=log, flush=True)
        for spec in a.points.split(","):
            scheme, kind = spec.split("/")
            scheme, _, mode = scheme.partition("+")  # group_cast+split: the split mode
            kw = dict(joint=mode != "split") if scheme == "group_cast" else {}
            plan = cp.make_plan(mask, N, kind)
            L = plan.local_len
            g = torch.Generator(device=dev).manual_seed(100 + rank)
            q = torch.randn(1, L, Hq, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
            k = torch.randn(1, L, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
            v = torch.randn(1, L, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
            do = torch.randn_like(q)

            def call():
                o = cp.attention(q, k, v, plan, scheme, None, kern, **kw)
                return torch.autograd.grad(o, (q, k, v), do)
            for _ in range(3):
                call()
            cp_t = _time(call)
            cp_ms = cp_t["rank_median_ms"]
            # the same rank's kernel calls alone
            calls = []
            if scheme == "group_cast" and kw["joint"]:
                lay = need_layout(plan)
                jm = lay.joint_mask(rank)
                kj = torch.randn(1, L + sum(lay.recv_splits(rank)), Hkv, D, device=dev, dtype=torch.bfloat16)
                if jm is not None:
                    calls.append((kj, kj, jm, False))
            elif scheme == "group_cast":
                lay = need_layout(plan)
                lm, rm = plan.pair_mask((rank,), (rank,)), lay.remote_mask(rank)
                n_r = sum(lay.recv_splits(rank))
                kr = torch.randn(1, max(n_r, 1), Hkv, D, device=dev, dtype=torch.bfloat16)
                if lm is not None:
                    calls.append((k.detach(), v.detach(), lm, True))
                if rm is not None:
                    calls.append((kr, kr, rm, True))
            else:
                kall = torch.randn(1, N * L, Hkv, D, device=dev, dtype=torch.bfloat16)
                m = plan.pair_mask((rank,), tuple(range(N)))
                if m is not None:
                    calls.append((kall, kall, m, False))
            qd = q.detach()

            def kernels_only():
                for kk, vv, m, part in calls:
                    o, lse = kern.forward(qd, kk, vv, m, scale, partial=part)
                    kern.backward(do, qd, kk, vv, o, lse, m, scale, partial=part)
            kernels_only()
            kern_t = _time(kernels_only)
            kernel_ms = kern_t["rank_median_ms"]
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
            ev = prof.key_averages()
            dev_total = sum(e.self_device_time_total for e in ev if e.device_type.name == "CUDA") / 1e3
            table = ev.table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=60)
            print(f"\n==== {mname} {spec} rank {rank}: cp {cp_ms:.3f} ms, kernels alone {kernel_ms:.3f} ms, "
                  f"single {single_ms:.3f} ms, device time in 3 calls {dev_total:.3f} ms\n{table}", file=log, flush=True)
            if rank == 0:
                cp_max, kern_max, single_max = cp_t["median_ms"], kern_t["median_ms"], single["median_ms"]
                row = dict(mask=mname, scheme=scheme + ("+split" if mode == "split" else ""), plan=kind, N=N, S=S,
                           cp_ms_max=cp_max, kernel_ms_max=kern_max, single_ms=single_max, rank0_cp_ms=cp_ms,
                           rank0_kernel_ms=kernel_ms, rank0_device_ms_per_call=dev_total / 3,
                           efficiency=single_max / (N * cp_max), kernel_ceiling=single_max / (N * kern_max))
                with open(out / "profile.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    return end_worker()


def main() -> int:
    from longca_triton.cp.bench import local_gpus, run_script, script_parser

    p = script_parser(__doc__.splitlines()[0], "results/cp-profile", "causal_document,full",
                      "group_cast/balanced,group_cast+split/balanced,ring_allgather/balanced",
                      "scheme[+split]/plan, comma-separated (group_cast+split: its split mode)")
    p.add_argument("--nccl-probe", action="store_true", help="first time all_gather / all_to_all / reduce_scatter, 1-64 MiB")
    a = p.parse_args()
    return run_script(a, __file__, worker, local_gpus)


if __name__ == "__main__":
    sys.exit(main())

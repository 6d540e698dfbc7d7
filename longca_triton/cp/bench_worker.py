"""``bench cp`` worker: one rank of a ``torchrun`` job; times every point of the sweep (see :mod:`.bench`)."""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

__all__ = ["worker"]


def _status(e: BaseException) -> str:
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower():
        return "oom"
    if isinstance(e, (ValueError, NotImplementedError)):
        return f"unsupported: {str(e).splitlines()[0][:300]}"
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _measure(fn, warmup: int, rep: int, device) -> dict:
    """Max-rank median time (the harness's timer over ranks) and the largest peak memory over ranks."""
    import torch
    import torch.distributed as dist

    from longca_triton.bench.timing import time_fn

    cuda = device.type == "cuda"
    for _ in range(max(1, warmup)):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    res = time_fn(fn, rep=rep, flush_l2=False, device=device, warmup_calls=0, ranks=True)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    mem = torch.tensor([float(peak or 0), float((peak or 0) - (base if cuda else 0))], dtype=torch.float64, device=device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    res["peak_mem_bytes"] = int(mem[0].item()) if peak is not None else None
    res["peak_mem_above_bytes"] = int(mem[1].item()) if peak is not None else None
    return res


def _timed_if_agreed(fn, ok: bool, res: dict, cfg, device) -> dict:
    """``res`` with the timing of ``fn`` if its first call worked on every rank, else a status saying which failed."""
    if not _agree(ok, device):
        res.setdefault("status", "error: failed on another rank")
        return res
    try:
        res.update(_measure(fn, int(cfg["warmup"]), int(cfg["rep"]), device))
        res["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - may leave other ranks waiting; the timeout ends them
        res["status"] = _status(e)
    return res


def _agree(ok: bool, device) -> bool:
    """True on every rank iff ``ok`` on every rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() == 0.0


def worker(cfg: dict) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from longca_triton import cp
    from longca_triton.masks import make_mask

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=int(cfg.get("timeout_s", 600))))
    rank, N = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    from longca_triton.bench.store import (
        ResultStore,
        collect_env,
        environment_unsupported,
        row_key,
        status_kind,
    )
    from longca_triton.bench.store import jsonable as _jsonable

    out = Path(cfg["out"])
    store = ResultStore(out / "results.jsonl")
    done = set()
    if rank == 0:
        # finished: measured, or judged unsupported for the case itself; a row saying only that this
        # machine lacked something (not installed, no GPU) is retried, as the dense bench does
        done = {row_key(r) for r in store.rows()
                if status_kind(r) == "ok" or (status_kind(r) == "unsupported" and not environment_unsupported(r))}
    obj = [done]
    dist.broadcast_object_list(obj, src=0)
    done = obj[0]
    env = collect_env() if rank == 0 else {}
    hq, _, hkv = str(cfg["heads"]).partition(":")
    Hq, Hkv = int(hq), int(hkv or hq)
    D, B = int(cfg["head_dim"]), int(cfg["batch"])
    dtype = getattr(torch, cfg["dtype"])
    S = int(cfg["tokens_per_gpu"]) * N
    kernel = cp.get_step_kernel(cfg["backend"])
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    say(f"[cp bench] world {N}, S={S}, heads {Hq}:{Hkv}, D={D}, {cfg['dtype']}, kernel {getattr(kernel, 'name', kernel)}")
    n_rows = 0
    masks = {m: make_mask(m, S, seed=int(cfg["seed"]), **cfg.get("params", {}).get(m, {})) for m in cfg["masks"]}
    for mode in cfg["modes"]:  # modes outermost: a budget cut keeps whole modes for every mask
        for mname, mask in masks.items():
            common = {
                "schema": 1, "kind": "cp", "experiment": cfg["name"], "mask": mname, "mask_params": _jsonable(mask.params),
                "seqlen": S, "tokens_per_gpu": int(cfg["tokens_per_gpu"]), "batch": B, "heads_q": Hq, "heads_kv": Hkv,
                "head_dim": D, "dtype": cfg["dtype"], "density": mask.density, "backend": cfg["backend"],
                "device": device.type, "gpu": env.get("gpu"),
            }
            flops = B * mask.flops(Hq, D, mode)
            # ---- single-GPU baseline (rank 0), broadcast
            base_row = dict(common, scheme="single", plan="none", world_size=1, mode=mode, flops=flops)
            t1 = torch.tensor([float("nan")], dtype=torch.float64, device=device)
            if rank == 0:
                base_row.update(_single_gpu(kernel, mask, B, Hq, Hkv, D, dtype, device, mode, cfg))
                if base_row.get("median_ms"):
                    t1[0] = base_row["median_ms"]
                    base_row["tflops"] = base_row["tflops_per_gpu"] = flops / (base_row["median_ms"] * 1e-3) / 1e12
                base_row["efficiency"] = 1.0 if base_row.get("median_ms") else None
                if row_key(base_row) not in done:
                    _stamp(base_row, env)
                    store.append(base_row)
                say(f"  {mname:22s} {mode:7s} single GPU: {base_row.get('median_ms') or base_row['status']}")
            _barrier(device)
            dist.broadcast(t1, src=0)
            T1 = t1.item()
            # ---- CP points
            for scheme in cfg["schemes"]:
                sopt = dict(cfg.get("scheme", {}).get(scheme, {}))
                plans = sopt.pop("plans", cfg["plans"])
                for kind in plans:
                    row = dict(common, scheme=scheme, plan=kind, world_size=N, mode=mode, flops=flops,
                               ulysses_degree=sopt.get("ulysses_degree"), window=sopt.get("window"))
                    if row_key(row) in done:
                        continue
                    if _expired(cfg, device):
                        say("[cp bench] time budget spent: stopping (rerun the same command to resume)")
                        return _finish(out, n_rows, say, device)
                    row.update(_cp_point(cp, kernel, mask, scheme, kind, sopt, B, Hq, Hkv, D, dtype, device, mode, cfg))
                    if row.get("median_ms"):
                        row["tflops_per_gpu"] = flops / N / (row["median_ms"] * 1e-3) / 1e12
                        row["tflops"] = row["tflops_per_gpu"]
                        row["time_ms"] = row["median_ms"]
                        row["efficiency"] = T1 / (N * row["median_ms"]) if T1 == T1 else None
                    if rank == 0:
                        _stamp(row, env)
                        store.append(row)
                        n_rows += 1
                        eff = f"{row['efficiency']:.3f}" if row.get("efficiency") else "-"
                        say(f"  {mname:22s} {mode:7s} {scheme:14s} {kind:10s} "
                            f"{row.get('median_ms') or 0:9.3f} ms  {row.get('tflops_per_gpu') or 0:7.1f} TF/GPU  eff {eff}  {row['status']}")
            # ---- peer
            if cfg.get("peer", {}).get("yunchang"):
                for U in _peer_degrees(N, Hq, cfg):
                    row = dict(common, scheme="usp", plan="contiguous", world_size=N, mode=mode, flops=flops,
                               backend=f"yunchang-usp[sdpa-flash,U={U}]", ulysses_degree=U,
                               backend_description="yunchang 0.6.4 LongContextAttention, ring basic_pytorch, PyTorch SDPA flash")
                    if row_key(row) in done:
                        continue
                    row.update(_peer_point(mname, mask, mode, U, B, Hq, Hkv, D, dtype, device, cfg))
                    if row.get("median_ms"):
                        row["tflops_per_gpu"] = row["tflops"] = flops / N / (row["median_ms"] * 1e-3) / 1e12
                        row["time_ms"] = row["median_ms"]
                        row["efficiency"] = T1 / (N * row["median_ms"]) if T1 == T1 else None
                    if rank == 0:
                        _stamp(row, env)
                        store.append(row)
                        say(f"  {mname:22s} {mode:7s} yunchang U={U:<2d}      contiguous "
                            f"{row.get('median_ms') or 0:9.3f} ms  {row.get('tflops_per_gpu') or 0:7.1f} TF/GPU  {row['status'][:80]}")
    return _finish(out, n_rows, say, device)


def _barrier(device) -> None:
    from longca_triton.bench.timing import barrier

    barrier(device)


def _finish(out, n_rows, say, device) -> int:
    import torch.distributed as dist

    _barrier(device)
    say(f"[cp bench] world {dist.get_world_size()}: {n_rows} rows -> {out / 'results.jsonl'}")
    dist.destroy_process_group()
    return 0


def _expired(cfg, device) -> bool:
    """Rank 0's clock decides, so that every rank stops at the same point."""
    import torch
    import torch.distributed as dist

    if cfg.get("deadline") is None:
        return False
    flag = torch.tensor([1.0 if (dist.get_rank() == 0 and time.time() > float(cfg["deadline"])) else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def _stamp(row: dict, env: dict) -> None:
    row["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    row["env"] = env
    if row.get("peak_mem_bytes") is not None:
        row["peak_mem_gb"] = row["peak_mem_bytes"] / 1e9
    row.setdefault("status", "ok")


def _inputs(shape_q, shape_kv, dtype, device, seed, grad):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    mk = lambda s: torch.randn(*s, generator=gen, device=device, dtype=torch.float32).to(dtype)  # noqa: E731
    q, k, v, do = mk(shape_q), mk(shape_kv), mk(shape_kv), mk(shape_q)
    if grad:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    return q, k, v, do


def _single_gpu(kernel, mask, B, Hq, Hkv, D, dtype, device, mode, cfg) -> dict:
    """Time of the step kernel on the whole sequence, one device (forward, or forward + backward)."""
    import torch

    from longca_triton.bench.timing import time_fn

    from .kernels import default_scale

    S = mask.seqlen_q
    kernel = kernel.single_device()
    try:
        q, k, v, do = _inputs((B, S, Hq, D), (B, S, Hkv, D), dtype, device, 1, False)
        scale = default_scale(D, None)

        def fn():
            out, lse = kernel.forward(q, k, v, mask, scale)
            if mode == "fwd_bwd":
                kernel.backward(do, q, k, v, out, lse, mask, scale)

        for _ in range(max(1, int(cfg["warmup"]))):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        res = {"status": "ok", **time_fn(fn, rep=int(cfg["rep"]), flush_l2=False, device=device, warmup_calls=0)}
        if device.type == "cuda":
            res["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated(device))
        return res
    except Exception as e:  # noqa: BLE001
        return {"status": _status(e)}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _cp_point(cp, kernel, mask, scheme, kind, sopt, B, Hq, Hkv, D, dtype, device, mode, cfg) -> dict:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    res: dict = {}
    ok = True
    fn = None
    mine = 0.0
    try:
        plan = cp.make_plan(mask, dist.get_world_size(), kind, chunks_per_rank=sopt.get("chunks_per_rank"))
        res.update(chunk_size=plan.chunk_size, chunks_per_rank=len(plan.chunks[0]), imbalance=plan.imbalance, padding=plan.padding)
        L = plan.local_len
        q, k, v, do = _inputs((B, L, Hq, D), (B, L, Hkv, D), dtype, device, 100 + rank, mode == "fwd_bwd")
        kw = dict(ulysses_degree=sopt.get("ulysses_degree"), window=sopt.get("window"))
        U, W, O = cp.resolve_dims(scheme, dist.get_world_size(), Hq, kw["ulysses_degree"], kw["window"])
        res.update(ulysses_degree=U, ring_inner=W, ring_outer=O)
        if scheme == "group_cast":  # [scheme.group_cast] joint = false: the split mode (group_cast.py)
            kw["joint"] = bool(sopt.get("joint", True))
            res["joint"] = kw["joint"]

        if mode == "fwd":
            def fn():
                with torch.no_grad():
                    return cp.attention(q, k, v, plan, scheme, None, kernel, **kw)
        else:
            def fn():
                out = cp.attention(q, k, v, plan, scheme, None, kernel, **kw)
                return torch.autograd.grad(out, (q, k, v), do)
        cp.COUNTER.reset()
        fn()  # first call: plans, groups, compilation; its bytes are the point's bytes
        mine = float(sum(s + r for s, r in cp.COUNTER.totals().values()))
    except Exception as e:  # noqa: BLE001
        ok = False
        res["status"] = _status(e)
        if res["status"].startswith("error"):
            res["traceback"] = traceback.format_exc()[-1500:]
    ok = _agree(ok, device)  # the byte reduction below is a collective: only when every rank got here
    if ok:
        res.update(_counted_bytes(mine, device))
    try:
        return _timed_if_agreed(fn, ok, res, cfg, device)
    finally:
        fn = None
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _counted_bytes(mine: float, device) -> dict:
    """Bytes the layer moved in one call (sent + received, every collective; ``mine`` this rank's):
    the busiest rank's and all ranks' together."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([mine, mine], dtype=torch.float64, device=device)
    mx, tot = t[:1].clone(), t[1:].clone()
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    dist.all_reduce(tot, op=dist.ReduceOp.SUM)
    return {"comm_bytes_max": int(mx.item()), "comm_bytes_total": int(tot.item())}


# ------------------------------------------------------------------------------------- peer
def _peer_degrees(N: int, Hq: int, cfg) -> list[int]:
    from .mesh import resolve_dims

    degrees = []
    for U in (resolve_dims("usp", N, Hq, cfg.get("scheme", {}).get("usp", {}).get("ulysses_degree"))[0], N):
        if Hq % U == 0 and U not in degrees:
            degrees.append(U)
    return degrees


_YUNCHANG_PG: dict = {}


def _peer_point(mname, mask, mode, U, B, Hq, Hkv, D, dtype, device, cfg) -> dict:
    """yunchang USP over PyTorch SDPA (flash): full / causal, forward only."""
    import torch
    import torch.distributed as dist

    if mname not in ("full", "causal") or mname not in cfg.get("peer", {}).get("masks", ["full", "causal"]):
        return {"status": f"unsupported: yunchang's attention takes a causal flag only, not the {mname} mask"}
    if mode != "fwd":
        return {"status": "unsupported: yunchang 0.6.4 has no backward for PyTorch-SDPA attention (pytorch_attn_backward raises)"}
    try:
        from yunchang import LongContextAttention, set_seq_parallel_pg
        from yunchang.kernels import AttnType
    except Exception as e:  # noqa: BLE001
        return {"status": f"unsupported: yunchang not importable ({type(e).__name__}: {e})"}
    from .plan import make_plan

    N, rank = dist.get_world_size(), dist.get_rank()
    res = {"notes": {"kv_heads_replicated": f"{Hkv}->{Hq}", "ring": "basic (contiguous shards)"}}
    ok, fn = True, None
    try:
        from yunchang.globals import PROCESS_GROUP

        if (U, N) not in _YUNCHANG_PG:  # new groups: a collective, once per degree
            set_seq_parallel_pg(U, N // U, rank, N)
            _YUNCHANG_PG[(U, N)] = (PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG)
        PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = _YUNCHANG_PG[(U, N)]
        attn = LongContextAttention(ring_impl_type="basic_pytorch",
                                    attn_type=AttnType.TORCH_FLASH if device.type == "cuda" else AttnType.TORCH_EFFICIENT)
        plan = make_plan(mask, N, "contiguous")
        L = plan.local_len
        q, k, v, _ = _inputs((B, L, Hq, D), (B, L, Hkv, D), dtype, device, 100 + rank, False)
        k, v = k.repeat_interleave(Hq // Hkv, dim=2), v.repeat_interleave(Hq // Hkv, dim=2)
        causal = mname == "causal"

        def fn():
            with torch.no_grad():
                return attn(q, k, v, causal=causal)

        fn()
    except Exception as e:  # noqa: BLE001
        ok = False
        res["status"] = _status(e) if not isinstance(e, ValueError) else f"error: {e}"
        res["traceback"] = traceback.format_exc()[-1500:]
    return _timed_if_agreed(fn, ok, res, cfg, device)

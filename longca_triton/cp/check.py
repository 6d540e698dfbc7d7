"""Correctness harness for the CP layer, shared by the CPU tests and the GPU check.

Every rank builds the same global ``q, k, v`` (seeded), computes the single-process result
(``reference="naive"``: the naive PyTorch reference under autograd; ``"kernel"``: the step kernel
itself on the whole sequence, i.e. the single-GPU run), then runs each case through
``cp.attention`` on its shards and compares ``out, lse, dq, dk, dv`` on its real (non-padding)
positions. The loss is ``sum(out * gout) + sum(lse * glse)`` over rows that attend something,
so the lse gradient path is exercised too. Optionally the bytes counted during the case are
compared with :func:`comm_model`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .attention import attention
from .comm import COUNTER, comm_model, model_snapshot
from .kernels import default_scale, get_step_kernel
from .plan import CPPlan, dispatch

__all__ = ["Case", "Problem", "make_problem", "run_case", "spawn"]


@dataclass
class Case:
    scheme: str
    plan: CPPlan
    backend: object = "reference"
    ulysses_degree: int | None = None
    window: int | None = None
    count_bytes: bool = False
    joint: bool | None = None  # group_cast's mode (None: its default)
    label: str = ""


@dataclass
class Problem:
    mask: object
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gout: torch.Tensor
    glse: torch.Tensor
    ref: dict = field(default_factory=dict)


def _finite(lse):
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def make_problem(mask, batch, heads, head_dim, dtype, device, seed=0, reference="naive", backend="reference",
                 head_dim_v: int | None = None) -> Problem:
    """Global tensors (identical on every rank) and the single-process result; ``v`` (and the
    output) have ``head_dim_v`` when given, else ``head_dim``."""
    Hq, Hkv = heads
    S = mask.seqlen_q
    d_v = head_dim if head_dim_v is None else head_dim_v
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)  # the same numbers on every rank (same seed, same device type)
    mk = lambda *shape: torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)  # noqa: E731
    q, k, v = mk(batch, S, Hq, head_dim), mk(batch, S, Hkv, head_dim), mk(batch, S, Hkv, d_v)
    gout = mk(batch, S, Hq, d_v)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    glse = torch.randn(batch, Hq, S, generator=gen, device=dev, dtype=torch.float32).to(acc)
    p = Problem(mask, q, k, v, gout, glse)
    scale = default_scale(head_dim, None)
    if reference == "naive":
        from longca_triton.reference import naive_attention

        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        out, lse = naive_attention(qq, kk, vv, mask, scale, return_lse=True)
        loss = (out * gout).sum() + (_finite(lse.to(acc)) * glse).sum()
        loss.backward()
        p.ref = dict(out=out.detach(), lse=lse.detach().to(acc), dq=qq.grad, dk=kk.grad, dv=vv.grad)
    else:
        kern = get_step_kernel(backend).single_device()
        out, lse = kern.forward(q, k, v, mask, scale)
        dlse = torch.where(torch.isfinite(lse), glse.to(lse.dtype), torch.zeros_like(lse))
        dq, dk, dv = kern.backward(gout, q, k, v, out.to(q.dtype), lse, mask, scale, dlse)
        # what a single-GPU user gets: results in the inputs' dtype (a step kernel may hand back
        # float32 partials for merging; the CP layer rounds its final results the same way)
        p.ref = dict(out=out.to(q.dtype), lse=lse.to(acc), dq=dq.to(q.dtype), dk=dk.to(k.dtype), dv=dv.to(v.dtype))
    return p


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(|b|) (1 when b is all zero and a is not)."""
    a, b = a.double(), b.double()
    den = b.abs().max().item() if b.numel() else 0.0
    num = (a - b).abs().max().item() if b.numel() else 0.0
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def run_case(case: Case, prob: Problem, group=None, tol: float = 1e-9, keep: bool = False) -> dict:
    """Run one case on this rank; returns ``{label, ok, errors..., bytes_ok, seconds}`` (with
    ``keep``, also ``_got``: this rank's out, lse, dq, dk, dv and ``_valid``, its real positions)."""
    rank = dist.get_rank(group)
    plan = case.plan
    valid = torch.as_tensor(plan.positions(rank) < plan.seqlen, device=prob.q.device)
    ql, kl, vl = (dispatch(t, plan, rank).detach().requires_grad_(True) for t in (prob.q, prob.k, prob.v))
    gout_l = dispatch(prob.gout, plan, rank)
    glse_l = dispatch(prob.glse, plan, rank, dim=2)
    COUNTER.reset()
    t0 = time.perf_counter()
    out, lse = attention(ql, kl, vl, plan, case.scheme, group, case.backend, return_lse=True,
                         ulysses_degree=case.ulysses_degree, window=case.window, joint=case.joint)
    loss = (out * gout_l).sum() + (_finite(lse) * glse_l.to(lse.dtype)).sum()
    loss.backward()
    seconds = time.perf_counter() - t0
    res = {"label": case.label, "seconds": seconds}
    ref = {name: dispatch(t, plan, rank, dim=2 if name == "lse" else 1) for name, t in prob.ref.items()}
    got = dict(out=out.detach(), lse=lse.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad)
    ok = True
    for name in ("out", "lse", "dq", "dk", "dv"):
        a, b = got[name], ref[name]
        if name == "lse":
            a, b = a[:, :, valid], b[:, :, valid]
            if not torch.equal(torch.isneginf(a), torch.isneginf(b)):
                res["lse_inf_mismatch"] = True
                ok = False
            fin = torch.isfinite(b)
            a, b = a[fin], b[fin]
        else:
            a, b = a[:, valid], b[:, valid]
            if torch.isnan(a).any():
                res[f"{name}_nan"] = True
                ok = False
        err = _rel_err(a, b)
        res[f"err_{name}"] = err
        ok &= err <= tol
    # padding rows: zero output, -inf lse
    if (~valid).any():
        pad_ok = bool((out.detach()[:, ~valid] == 0).all()) and bool(torch.isneginf(lse.detach()[:, :, ~valid]).all())
        res["padding_ok"] = pad_ok
        ok &= pad_ok
    if case.count_bytes:
        B, _, Hq, D = prob.q.shape
        model = model_snapshot(comm_model(
            case.scheme, plan.world_size, case.ulysses_degree, plan.seqlen, (Hq, prob.k.shape[2]), D,
            prob.q.element_size(), prob.mask, plan=plan, batch=B, window=case.window, return_lse=True, rank=rank,
            head_dim_v=prob.v.shape[3],
        ))
        counted = COUNTER.snapshot()
        res["bytes_ok"] = counted == model
        if not res["bytes_ok"]:
            res["bytes_counted"] = {"/".join(k): v for k, v in counted.items()}
            res["bytes_model"] = {"/".join(k): v for k, v in model.items()}
        ok &= res["bytes_ok"]
    res["ok"] = bool(ok)
    if keep:
        res["_got"], res["_valid"] = got, valid
    return res


def _spawn_entry(rank, world, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        # why: a rank tearing its process group down while a peer still has transfers in flight with it
        # can abort in gloo's teardown ("terminate called without an active exception", seen once on a
        # loaded 2-core CI machine); all ranks leave together
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world: int, *args):
    """Run ``fn(rank, world, *args)`` on ``world`` CPU processes joined by gloo."""
    import torch.multiprocessing as mp

    mp.spawn(_spawn_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)

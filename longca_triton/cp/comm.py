"""Communication: counted wrappers over ``torch.distributed`` and the closed-form model.

Every collective the CP layer issues goes through :class:`Comm`, which records, per process, the
bytes this device sends and receives, keyed by ``(phase, collective, tensor)``. Per-device
volumes of collectives are those of the bandwidth-optimal algorithms (what must leave / arrive at
the device whatever the library does inside):

* point-to-point: the message, on the sender and on the receiver;
* ``all_gather`` of ``m`` bytes per rank over ``n`` ranks: ``(n - 1) m`` sent and received;
* ``reduce_scatter`` of ``n m`` bytes to ``m`` per rank: ``(n - 1) m`` sent and received;
* ``all_to_all`` of ``M`` bytes: the ``(n - 1) / n`` part addressed to the other ranks.

:func:`comm_model` gives the same numbers in closed form (docs/cp.md has the formulas next to the
paper's); ``tests/test_cp.py`` checks the counted bytes against it for every scheme.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .mesh import SCHEMES, resolve_dims

__all__ = ["CommCounter", "COUNTER", "Comm", "comm_model", "CommRow", "SCHEMES"]



class CommCounter:
    """Bytes sent/received by this process, per ``(phase, collective, tensor)``."""

    def __init__(self):
        self.enabled = True
        self.reset()

    def reset(self):
        self.records: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0])

    def add(self, phase: str, collective: str, what: str, sent: int, recv: int, calls: int = 1):
        if self.enabled:
            r = self.records[(phase, collective, what)]
            r[0] += calls
            r[1] += int(sent)
            r[2] += int(recv)

    def snapshot(self) -> dict[tuple[str, str, str], tuple[int, int, int]]:
        """``{(phase, collective, tensor): (calls, bytes_sent, bytes_received)}``."""
        return {k: tuple(v) for k, v in self.records.items() if v[1] or v[2]}

    def totals(self) -> dict[str, tuple[int, int]]:
        out = defaultdict(lambda: [0, 0])
        for (phase, _, _), (_, s, r) in self.snapshot().items():
            out[phase][0] += s
            out[phase][1] += r
        return {k: tuple(v) for k, v in out.items()}


COUNTER = CommCounter()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _all_gather_flat(out, t, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, t, group=group)


def _reduce_scatter_flat(out, t, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, t, group=group)


class Comm:
    """Counted collectives on one process group (``None``: the default group)."""

    def __init__(self, group=None, counter: CommCounter | None = None):
        self.group = group
        self.counter = counter or COUNTER
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # -- point to point: one batch of sends and receives (asynchronous)
    def p2p(self, sends, recvs, phase: str, collective: str, what: str):
        """``sends``/``recvs``: lists of ``(tensor, peer group rank)``. Returns the works to wait on."""
        ops = []
        for t, peer in sends:
            ops.append(dist.P2POp(dist.isend, t, self.global_rank(peer), self.group))
        for t, peer in recvs:
            ops.append(dist.P2POp(dist.irecv, t, self.global_rank(peer), self.group))
        if not ops:
            return []
        self.counter.add(phase, collective, what, sum(_nbytes(t) for t, _ in sends), sum(_nbytes(t) for t, _ in recvs))
        return dist.batch_isend_irecv(ops)

    def all_gather(self, t: torch.Tensor, phase: str, what: str) -> torch.Tensor:
        """``t [...]`` -> ``[n, ...]``."""
        shape = t.shape
        t = t.contiguous().view(-1)
        out = t.new_empty(self.size * t.numel())
        _all_gather_flat(out, t, self.group)
        out = out.view((self.size,) + tuple(shape))
        m = _nbytes(t)
        self.counter.add(phase, "all_gather", what, (self.size - 1) * m, (self.size - 1) * m)
        return out

    def reduce_scatter(self, t: torch.Tensor, phase: str, what: str) -> torch.Tensor:
        """``t [n, ...]`` -> the sum over ranks of ``t[rank]``."""
        shape = tuple(t.shape[1:])
        t = t.contiguous().view(-1)
        out = t.new_empty(t.numel() // self.size)
        _reduce_scatter_flat(out, t, self.group)
        out = out.view(shape)
        m = _nbytes(out)
        self.counter.add(phase, "reduce_scatter", what, (self.size - 1) * m, (self.size - 1) * m)
        return out

    def all_to_all_v(self, t: torch.Tensor, send_splits, recv_splits, phase: str, what: str, async_op: bool = False):
        """All-to-all with variable splits along dim 0: rows ``[sum(send_splits[:i]), ...)`` of ``t`` go to
        rank ``i``; returns ``(received [sum(recv_splits), ...], work)`` (``work`` is ``None`` unless
        ``async_op``; wait on it before reading the result). Only rows addressed to other ranks count."""
        t = t.contiguous()
        out = t.new_empty((sum(recv_splits),) + tuple(t.shape[1:]))
        work = dist.all_to_all_single(out, t, list(recv_splits), list(send_splits), group=self.group, async_op=async_op)
        row = t[0].numel() * t.element_size() if t.shape[0] else out[0].numel() * out.element_size() if out.shape[0] else 0
        me = self.rank
        self.counter.add(phase, "all_to_all_v", what, sum(n for i, n in enumerate(send_splits) if i != me) * row,
                         sum(n for i, n in enumerate(recv_splits) if i != me) * row)
        return out, work

    def all_to_all(self, t: torch.Tensor, phase: str, what: str) -> torch.Tensor:
        """``t [n, ...]``: slice ``i`` goes to rank ``i``; returns ``[n, ...]`` with slice ``i`` from rank ``i``."""
        t = t.contiguous()
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=self.group)
        m = _nbytes(t) // self.size
        self.counter.add(phase, "all_to_all", what, (self.size - 1) * m, (self.size - 1) * m)
        return out


# ---------------------------------------------------------------------------------- model
@dataclass(frozen=True)
class CommRow:
    phase: str
    collective: str
    tensor: str
    calls: int
    bytes_sent: int
    bytes_received: int


def _mesh_dims(scheme: str, world: int, ulysses_degree: int | None, window: int | None, heads_q: int) -> tuple[int, int, int]:
    return resolve_dims(scheme, world, heads_q, ulysses_degree, window)


def comm_model(scheme: str, world: int, ulysses_degree: int | None = None, seqlen: int = 8192, heads=(64, 8),
               head_dim: int = 128, dtype_bytes: int = 2, mask=None, *, plan: str = "zigzag", batch: int = 1,
               window: int | None = None, return_lse: bool = False, grad_bytes: int | None = None,
               chunks_per_rank: int | None = None, align: int = 1, rank: int | None = None,
               head_dim_v: int | None = None) -> list[CommRow]:
    """Per-device bytes each collective moves, forward and backward, in closed form.

    ``seqlen`` is the global sequence (padded as the plan pads it: ``L`` = local tokens per rank);
    ``plan`` is a plan kind or a ready :class:`~.plan.CPPlan` (then ``mask`` defaults to its mask);
    ``heads`` = ``(Hq, Hkv)``; gradients of K/V travel (and are reduced) in ``grad_bytes`` per
    element (default ``max(dtype_bytes, 4)``: float32 accumulation). With ``U`` the Ulysses degree,
    ``Hkv' = lcm(Hkv, U)`` (KV heads replicated when ``Hkv`` does not divide), ring of ``R = N / U``
    members split as ``O`` outer x ``W`` inner (``O = 1`` except loongtrain). With ``head_dim_v``
    (``D_v``, default ``head_dim`` = ``D``) K counts ``D`` and V, out, dout ``D_v``. Let
    ``q = B L Hq D b``, ``kv = B L Hkv' (D + D_v) b``, ``dkv = B L Hkv' (D + D_v) g``:

    * ``ring_p2p`` (``U = 1, W = N``): fwd ``(N-1) kv``; bwd ``(N-1) kv + (N-1) dkv``;
    * ``ring_allgather``: fwd all_gather ``(N-1) kv``; bwd reduce_scatter ``(N-1) dkv``;
    * ``ulysses`` (``U = N``): fwd all_to_all ``(U-1)/U (q + kv + out)``; bwd ``(U-1)/U (dout + dq + dkv_b)``
      (``dkv_b``: K/V gradients in the activation dtype);
    * ``usp``: the Ulysses terms over ``U`` plus the ring terms over ``R``;
    * ``loongtrain``: the Ulysses terms plus a double ring: ``O (W-1)`` inner and ``O - 1`` outer hops
      of ``kv`` forward, and of ``kv`` and ``dkv`` backward.

    * ``group_cast`` (needs ``mask``): with ``n_in`` the tokens this rank's queries need from the other
      ranks and ``n_out`` the tokens of this rank the others need (``need.py``, from the mask and
      plan), fwd all_to_all_v ``B Hkv (D + D_v) b`` x (``n_out`` sent, ``n_in`` received); bwd the reverse
      all_to_all_v of dK/dV in ``g`` bytes (``n_in`` sent, ``n_out`` received). Per rank, so
      ``rank`` picks the device; ``None`` = the busiest device (largest fwd + bwd total).

    ``return_lse`` adds the all_to_all of lse (forward) and of its gradient (backward, when the loss
    uses lse) for the Ulysses schemes. Bytes of the other schemes do not depend on the mask (the KV
    ring flows in full; empty pairs only skip compute).
    """
    from .plan import CPPlan, make_plan

    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; valid schemes: {', '.join(SCHEMES)}")
    Hq, Hkv = heads
    N = int(world)
    U, W, O = _mesh_dims(scheme, N, ulysses_degree, window, Hq)
    if isinstance(plan, CPPlan):
        if plan.world_size != N:
            raise ValueError(f"the plan is for {plan.world_size} ranks, not {N}")
        mask = plan.mask if mask is None else mask
    if scheme == "group_cast":
        if mask is None:
            raise ValueError("group_cast moves what the mask needs: its bytes need the mask (pass mask=...)")
        from .need import need_layout

        p = plan if isinstance(plan, CPPlan) else make_plan(mask, N, plan, chunks_per_rank=chunks_per_rank, align=align)
        lay = need_layout(p)
        b = dtype_bytes
        g = grad_bytes if grad_bytes is not None else max(b, 4)
        row = batch * Hkv * (head_dim + (head_dim if head_dim_v is None else head_dim_v))
        n_in, n_out = lay.counts.sum(axis=1), lay.counts.sum(axis=0)
        if rank is None:
            rank = int(((n_in + n_out) * row * (b + g)).argmax())
        if not 0 <= rank < N:
            raise ValueError(f"rank {rank} is not in a world of {N}")
        calls = 1 if lay.any_traffic else 0
        out = []
        for phase, what, sent, recv, bb in (("fwd", "kv", n_out[rank], n_in[rank], b), ("bwd", "dkv", n_in[rank], n_out[rank], g)):
            if calls and (sent or recv):
                out.append(CommRow(phase, "all_to_all_v", what, calls, int(sent) * row * bb, int(recv) * row * bb))
        return out
    if isinstance(plan, CPPlan):
        L = plan.local_len
    elif mask is not None:
        L = make_plan(mask, N, plan, chunks_per_rank=chunks_per_rank, align=align).local_len
    else:
        per_rank = {"contiguous": 1, "zigzag": 2}.get(plan) or int(chunks_per_rank or 8)
        chunk = math.ceil(math.ceil(seqlen / (per_rank * N)) / align) * align
        L = chunk * per_rank
    b = dtype_bytes
    g = grad_bytes if grad_bytes is not None else max(b, 4)
    B, D = batch, head_dim
    Dv = head_dim if head_dim_v is None else head_dim_v
    rows: list[CommRow] = []

    def add(phase, coll, what, calls, sent, recv=None):
        if calls and (sent or (recv or 0)):
            rows.append(CommRow(phase, coll, what, calls, int(sent), int(sent if recv is None else recv)))

    if scheme == "ring_allgather":
        kv = B * L * Hkv * (D + Dv)
        add("fwd", "all_gather", "kv", 1 if N > 1 else 0, (N - 1) * kv * b)
        add("bwd", "reduce_scatter", "dkv", 1 if N > 1 else 0, (N - 1) * kv * g)
        return rows
    hkv = math.lcm(Hkv, U) if U > 1 else Hkv
    if U > 1:
        frac = lambda m: (U - 1) * (m // U)  # noqa: E731
        # elements per tensor: query-side ones have Hq heads, key-side ones hkv; v, out, dout,
        # dv are D_v wide, the others D
        heads_of = {"q": Hq, "out": Hq, "dout": Hq, "dq": Hq, "k": hkv, "v": hkv, "dk": hkv, "dv": hkv}
        width_of = {"q": D, "dq": D, "k": D, "dk": D, "v": Dv, "dv": Dv, "out": Dv, "dout": Dv}
        # forward: q, k, v in, out back; backward: dout in, dq, dk, dv back (lse / dlse with them)
        for phase, tensors, lse in (("fwd", ("q", "k", "v", "out"), "lse"), ("bwd", ("dout", "dq", "dk", "dv"), "dlse")):
            for name in tensors:
                add(phase, "all_to_all", name, 1, frac(B * L * heads_of[name] * width_of[name] * b))
            if return_lse:
                add(phase, "all_to_all", lse, 1, frac(B * L * Hq * g))
    # ring over super-shards of U L tokens with hkv / U heads: the same bytes as L tokens, hkv heads
    kv = B * L * hkv * (D + Dv)
    inner, outer = O * (W - 1), O - 1
    label_in, label_out = ("p2p", "p2p") if O == 1 else ("p2p_inner", "p2p_outer")
    add("fwd", label_in, "kv", inner, inner * kv * b)
    add("fwd", label_out, "kv", outer, outer * kv * b)
    add("bwd", label_in, "kv", inner, inner * kv * b)
    add("bwd", label_out, "kv", outer, outer * kv * b)
    add("bwd", label_in, "dkv", inner, inner * kv * g)
    add("bwd", label_out, "dkv", outer, outer * kv * g)
    return rows


def model_snapshot(rows: list[CommRow]) -> dict[tuple[str, str, str], tuple[int, int, int]]:
    """The model in :meth:`CommCounter.snapshot` form (rows with the same key summed)."""
    out: dict = {}
    for r in rows:
        c, s, v = out.get((r.phase, r.collective, r.tensor), (0, 0, 0))
        out[(r.phase, r.collective, r.tensor)] = (c + r.calls, s + r.bytes_sent, v + r.bytes_received)
    return out

"""The six CP schemes as autograd functions over any step kernel (see ``kernels.py``).

One engine covers four of them. Ranks form an ``[O, W, U]`` mesh (``mesh.py``): an optional
Ulysses all-to-all over ``U`` ranks turns ``[B, L, Hq, D]`` shards into ``[B, U L, Hq / U, D]``
super-shards, then a double ring over the ``O x W`` super-shards passes K/V: ``W`` inner steps per
outer step, the next outer block travelling between windows during the whole inner round.

* ``ulysses``    ``U = N``: no ring, one local call over the whole (permuted) sequence;
* ``ring_p2p``   ``W = N``: the KV ring;
* ``usp``        ``U x W``: Ulysses inside, ring outside (2-D mesh);
* ``loongtrain`` ``U x W x O``: Ulysses (optional) and LoongTrain's double ring.

``ring_allgather`` gathers K/V once, runs one call against the whole sequence and reduce-scatters
dK/dV in the backward. ``group_cast`` (``group_cast.py``) moves only the key ranges each rank's
queries attend, by one all-to-all with variable splits, and sends dK/dV partials back to their owners.

Forward of the ring: every step's ``(out_i, lse_i)`` is merged into float32 accumulators
(``out = sum_i exp(lse_i - lse) out_i``, ``lse = logsumexp_i lse_i``; rows that attend nothing stay
zero / ``-inf``). Backward (FlashAttention style, no recomputation): the K/V ring runs again and
each step calls the kernel's backward with the *merged* ``out`` and ``lse``, which yields exactly
that block's share of dQ, dK, dV; dQ accumulates locally, dK/dV (float32) travel around the ring
back to their owner. The owner keeps the share of its own block, so dK/dV need ``N - 1`` hops like
K/V. Pairs whose local mask is empty are skipped; the ring still moves every block.

Head dims: ``v`` may have its own head dim (``D_v != D_qk``, e.g. 192/128). A K/V pair (and a
dK/dV pair) travels as one buffer: stacked ``[2, B, L, H, D]`` when the dims match, concatenated on
the head dim ``[B, L, H, D_qk + D_v]`` when they do not (``_pack`` / ``_split``); either way the
bytes are K's at ``D_qk`` plus V's at ``D_v``, as ``comm.comm_model`` counts them. The output and its
merge have ``D_v``.

Overlap: each step posts its transfers (``batch_isend_irecv``) before computing, into a second
buffer (double buffering), and waits after computing. With NCCL the transfers run on the process
group's own CUDA stream, so they overlap the kernels of the compute stream; with gloo they run on
gloo's threads.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .comm import SCHEMES, Comm
from .group_cast import GroupCastAttention
from .kernels import StepKernel, acc_dtype, default_scale, get_step_kernel
from .mesh import CPMesh, get_mesh, resolve_dims
from .merge import merge_, merge_into, use_fused
from .plan import CPPlan, layout_mask

__all__ = ["attention", "merge_", "SCHEMES"]


# ---------------------------------------------------------------------------------- K/V pairs
def _pack(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One buffer for a K/V (or dK/dV) pair that travels together: ``[2, ...]`` stacked when the
    shapes match, else concatenated on the head dim (``[..., D_qk + D_v]``)."""
    return torch.stack([a, b]) if a.shape == b.shape else torch.cat([a, b], dim=-1)


def _split(buf, d_qk: int) -> tuple:
    """The ``(K, V)`` views of a ``_pack``-ed buffer (or of a ``(k, v)`` tuple) whose K has ``d_qk``."""
    if isinstance(buf, (tuple, list)):
        return buf[0], buf[1]
    if buf.dim() == 4:  # [B, L, H, D_qk + D_v]
        return buf[..., :d_qk], buf[..., d_qk:]
    return buf[0], buf[1]  # [2, B, L, H, D]


def _pair_zeros(k: torch.Tensor, v: torch.Tensor, dtype) -> torch.Tensor:
    """A zero buffer laid out as ``_pack(k, v)``, in ``dtype``."""
    shape = (2,) + tuple(k.shape) if k.shape == v.shape else tuple(k.shape[:-1]) + (k.shape[-1] + v.shape[-1],)
    return torch.zeros(shape, dtype=dtype, device=k.device)


# ---------------------------------------------------------------------------------- ring engine
class _Ring:
    """Everything a ring call needs that is not a tensor."""

    def __init__(self, plan: CPPlan, mesh: CPMesh, kernel: StepKernel, scale: float):
        self.plan, self.mesh, self.kernel, self.scale = plan, mesh, kernel, scale
        self.inner = Comm(mesh.inner_group) if mesh.W > 1 else None
        self.outer = Comm(mesh.outer_group) if mesh.O > 1 else None
        self.label_in, self.label_out = ("p2p", "p2p") if mesh.O == 1 else ("p2p_inner", "p2p_outer")
        self.q_ranks = mesh.shard_ranks(mesh.o, mesh.w)
        m = mesh
        #: local mask of every (outer step, inner step), None where the pair is empty
        self.masks = [[plan.pair_mask(self.q_ranks, m.shard_ranks((m.o - to) % m.O, (m.w - ti) % m.W)) for ti in range(m.W)]
                      for to in range(m.O)]
        self.n_steps = sum(x is not None for row in self.masks for x in row)

    def _hop(self, comm, buf, phase, label, what):
        """Post send(buf -> next), recv(prev -> new buffer); returns (new buffer, works)."""
        if comm is None:
            return None, []
        recv = torch.empty_like(buf)
        me = comm.rank
        works = comm.p2p([(buf, (me + 1) % comm.size)], [(recv, (me - 1) % comm.size)], phase, label, what)
        return recv, works

    @staticmethod
    def _wait(works):
        for w in works:
            w.wait()

    def _land(self, works, recv, own, d_qk):
        """A travelling dK/dV partial arrived home (``works`` done): ``recv`` plus this rank's ``own``."""
        self._wait(works)
        return _add_into(recv, own, d_qk)

    def forward(self, q, k, v):
        m, acc = self.mesh, acc_dtype(q.dtype)
        B, Lq, H, _ = q.shape
        d_qk = k.shape[-1]
        out = lse = None  # the first partial is taken as is; later ones merge in float32
        fused = use_fused(q)  # the last merge writes q's dtype
        done = 0
        comm = m.W > 1 or m.O > 1
        outer_buf = _pack(k, v) if comm else (k, v)
        for to in range(m.O):
            outer_next, outer_works = self._hop(self.outer if to < m.O - 1 else None, outer_buf, "fwd", self.label_out, "kv")
            cur = outer_buf
            for ti in range(m.W):
                nxt, works = self._hop(self.inner if ti < m.W - 1 else None, cur, "fwd", self.label_in, "kv")
                mask = self.masks[to][ti]
                if mask is not None:
                    o_i, l_i = self.kernel.forward(q, *_split(cur, d_qk), mask, self.scale)  # o_i [B, L, H, D_v]
                    done += 1
                    if out is None:
                        out, lse = o_i, l_i.to(acc)
                    elif fused:
                        last = done == self.n_steps
                        dst = out if out.dtype == acc and not last else torch.empty(out.shape, device=q.device,
                                                                                  dtype=q.dtype if last else acc)
                        merge_into(out, lse, o_i, l_i.to(acc), dst, lse)
                        out = dst
                    else:
                        if out.dtype != acc:
                            out = out.to(acc)
                        merge_(out, lse, o_i, l_i)
                self._wait(works)
                cur = nxt
            self._wait(outer_works)
            outer_buf = outer_next
        if out is None:
            out = q.new_zeros((B, Lq, H, v.shape[-1]))
            lse = torch.full((B, H, Lq), float("-inf"), dtype=acc, device=q.device)
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, dlse):
        m, acc = self.mesh, acc_dtype(q.dtype)
        comm = m.W > 1 or m.O > 1
        d_qk = k.shape[-1]
        zeros = lambda: _pair_zeros(k, v, acc)  # noqa: E731
        dq = None
        done = 0
        outer_buf = _pack(k, v) if comm else (k, v)
        outer_own = None  # this rank's share of its own block, then all windows' shares
        otrav_recv, otrav_works = None, []
        for to in range(m.O):
            outer_next, outer_works = self._hop(self.outer if to < m.O - 1 else None, outer_buf, "bwd", self.label_out, "kv")
            cur = outer_buf
            own = None
            trav_recv, trav_works = None, []
            for ti in range(m.W):
                nxt, works = self._hop(self.inner if ti < m.W - 1 else None, cur, "bwd", self.label_in, "kv")
                mask = self.masks[to][ti]
                contrib = None
                if mask is not None:
                    dq_i, dk_i, dv_i = self.kernel.backward(dout, q, *_split(cur, d_qk), out, lse, mask, self.scale,
                                                            dlse)
                    done += 1
                    if dq is None:
                        dq = dq_i
                    elif done == 2 and self.n_steps == 2:
                        dq = dq + dq_i  # one rounding of the exact sum: the same as accumulating in float32
                    else:
                        if dq.dtype != acc:
                            dq = dq.to(acc)
                        dq.add_(dq_i)
                    contrib = (dk_i, dv_i)
                if ti == 0:
                    own = contrib
                else:
                    self._wait(trav_works)
                    if trav_recv is not None:
                        buf = _add_into(trav_recv, contrib, d_qk)
                    elif contrib is not None:
                        buf = _pack(*contrib).to(acc)
                    else:
                        buf = zeros()
                    # pass the block's partial dK/dV on; its owner is the last to add
                    trav_recv, trav_works = self._hop(self.inner, buf, "bwd", self.label_in, "dkv")
                self._wait(works)
                cur = nxt
            if m.W > 1:
                own = self._land(trav_works, trav_recv, own, d_qk)
            if to == 0:
                outer_own = own
            else:
                self._wait(otrav_works)
                obuf = otrav_recv if otrav_recv is not None else zeros()
                _add_into(obuf, own, d_qk)
                otrav_recv, otrav_works = self._hop(self.outer, obuf, "bwd", self.label_out, "dkv")
            self._wait(outer_works)
            outer_buf = outer_next
        if m.O > 1:
            outer_own = self._land(otrav_works, otrav_recv, outer_own, d_qk)
        if dq is None:
            dq = torch.zeros_like(q)
        if outer_own is None:
            return dq.to(q.dtype), torch.zeros_like(k), torch.zeros_like(v)
        dk, dv = _split(outer_own, d_qk)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _add_into(dst: torch.Tensor, src, d_qk: int):
    """``dst += src`` for a ``_pack``-ed dK/dV buffer, where ``src`` is ``None``, a ``(dk, dv)`` pair
    or a buffer of the same layout."""
    if src is not None:
        dk, dv = _split(dst, d_qk)
        sk, sv = _split(src, d_qk)
        dk.add_(sk)
        dv.add_(sv)
    return dst


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        out, lse = ring.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = ctx.ring.backward(dout.contiguous(), q, k, v, out, lse, dlse)
        return dq, dk, dv, None


# ---------------------------------------------------------------------------------- all-gather ring
def _global_runs(plan: CPPlan) -> list[tuple[int, int, int, int]]:
    """The padded sequence in global order as runs of one rank's local keys:
    ``(global_start, rank, local_start, local_end)``, consecutive chunks of one rank merged."""
    if "global_runs" not in plan._cache:
        c, owner = plan.chunk_size, {}
        for r, chs in enumerate(plan.chunks):
            for i, ch in enumerate(chs):
                owner[ch] = (r, i * c)
        runs = []
        for ch in range(plan.num_chunks):
            r, a = owner[ch]
            if runs and runs[-1][1] == r and runs[-1][3] == a:
                runs[-1] = (runs[-1][0], r, runs[-1][2], a + c)
            else:
                runs.append((ch * c, r, a, a + c))
        plan._cache["global_runs"] = runs
    return plan._cache["global_runs"]


def _rank_major_runs(plan: CPPlan) -> list[tuple[int, int, int]]:
    """:func:`_global_runs` as ``(global_start, local_start, local_end)`` in rank-major order (rank
    0's keys, then rank 1's ...): the gathered layout the reduce-scatter expects."""
    if "rank_major_runs" not in plan._cache:
        plan._cache["rank_major_runs"] = [(p, a, b) for p, _, a, b in sorted(_global_runs(plan), key=lambda t: t[1:3])]
    return plan._cache["rank_major_runs"]


def _global_rows_mask(plan: CPPlan, rank: int):
    """Mask between ``rank``'s local queries and the whole (padded) sequence in global order."""
    key = ("global_rows", rank)
    if key not in plan._cache:
        plan._cache[key] = layout_mask(plan.mask, plan.segments((rank,)), [(0, plan.padded_len, 0)], plan.local_len,
                                       plan.padded_len, name=f"{plan.mask.name}@{plan.kind}[{rank}]x(all)")
    return plan._cache[key]


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: CPPlan, comm: Comm, kernel: StepKernel, scale: float):
        # why concatenated on the head dim (not stacked): K and V may have different head dims;
        # one [B, L, Hkv, D_qk + D_v] buffer gathers both in one collective either way
        B, L, Hkv, d_qk = k.shape
        N = comm.size
        kv = torch.cat([k, v], dim=-1)  # [B, L, Hkv, D_qk + D_v]
        g = comm.all_gather(kv, "fwd", "kv") if N > 1 else kv[None]  # [N, B, L, Hkv, D_qk + D_v]
        # the gathered keys in global order (one copy): a row's keys stay one interval where the
        # mask has one, so the kernel sees the single-GPU tile structure (rank-major order split
        # causal rows in two and cost 5-20 % of kernel time on the document masks)
        runs = _global_runs(plan)
        kv_all = torch.cat([g[r][:, a:b] for _, r, a, b in runs], dim=1)  # [B, padded S, Hkv, D_qk + D_v]
        mask = _global_rows_mask(plan, comm.rank)
        acc = acc_dtype(q.dtype)
        if mask is not None:
            # one step: no merge, the output in q's dtype straight from the kernel
            out, lse = kernel.forward(q, kv_all[..., :d_qk], kv_all[..., d_qk:], mask, scale, partial=False)
            out, lse = out.to(q.dtype), lse.to(acc)
        else:
            out = q.new_zeros((B, q.shape[1], q.shape[2], v.shape[-1]))
            lse = torch.full((B, q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
        ctx.save_for_backward(q, kv_all, out, lse)
        ctx.info = (mask, comm, kernel, scale, d_qk, plan)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, kv_all, out, lse = ctx.saved_tensors
        mask, comm, kernel, scale, d_qk, _ = ctx.info
        acc = acc_dtype(q.dtype)
        B, NL, Hkv, D2 = kv_all.shape
        N = comm.size
        if dout is None:
            dout = torch.zeros_like(out)
        if mask is not None:
            dq, dk, dv = kernel.backward(dout.contiguous(), q, kv_all[..., :d_qk], kv_all[..., d_qk:], out, lse, mask,
                                         scale, dlse, partial=False)
            dkv = torch.cat([dk, dv], dim=-1).to(acc)  # [B, N L, Hkv, D_qk + D_v]
        else:
            dq = torch.zeros_like(q)
            dkv = torch.zeros(kv_all.shape, dtype=acc, device=q.device)
        # back to rank-major order for the reduce-scatter
        dkv = torch.cat([dkv[:, p:p + (b - a)] for p, a, b in _rank_major_runs(ctx.info[5])], dim=1)
        dkv = dkv.view(B, N, NL // N, Hkv, D2).transpose(0, 1)  # [N, B, L, Hkv, D_qk + D_v]
        mine = comm.reduce_scatter(dkv, "bwd", "dkv") if N > 1 else dkv[0]
        return (dq.to(q.dtype), mine[..., :d_qk].to(kv_all.dtype), mine[..., d_qk:].to(kv_all.dtype),
                None, None, None, None)


# ---------------------------------------------------------------------------------- ulysses
def _seq_to_head(x, comm: Comm, phase, what):
    """``[B, L, H, D]`` (sequence shard) -> ``[B, U L, H / U, D]`` (head shard)."""
    B, L, H, D = x.shape
    U = comm.size
    t = x.reshape(B, L, U, H // U, D).permute(2, 0, 1, 3, 4)
    r = comm.all_to_all(t, phase, what)
    return r.permute(1, 0, 2, 3, 4).reshape(B, U * L, H // U, D)


def _head_to_seq(x, comm: Comm, phase, what):
    """``[B, U L, h, D]`` -> ``[B, L, U h, D]``."""
    B, UL, h, D = x.shape
    U = comm.size
    L = UL // U
    t = x.reshape(B, U, L, h, D).permute(1, 0, 2, 3, 4)
    r = comm.all_to_all(t, phase, what)
    return r.permute(1, 2, 0, 3, 4).reshape(B, L, U * h, D)


def _lse_head_to_seq(x, comm: Comm, phase, what):
    """lse ``[B, h, U L]`` -> ``[B, U h, L]``."""
    B, h, UL = x.shape
    U = comm.size
    t = x.reshape(B, h, U, UL // U).permute(2, 0, 1, 3)
    r = comm.all_to_all(t, phase, what)
    return r.permute(1, 0, 2, 3).reshape(B, U * h, UL // U)


def _lse_seq_to_head(x, comm: Comm, phase, what):
    """lse ``[B, H, L]`` -> ``[B, H / U, U L]``."""
    B, H, L = x.shape
    U = comm.size
    t = x.reshape(B, U, H // U, L).permute(1, 0, 2, 3)
    r = comm.all_to_all(t, phase, what)
    return r.permute(1, 2, 0, 3).reshape(B, H // U, U * L)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, what):
        ctx.comm, ctx.what = comm, what
        return _seq_to_head(x, comm, "fwd", what)

    @staticmethod
    def backward(ctx, g):
        return _head_to_seq(g.contiguous(), ctx.comm, "bwd", "d" + ctx.what), None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, what, grad_what):
        ctx.comm, ctx.grad_what = comm, grad_what
        return _head_to_seq(x, comm, "fwd", what)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_head(g.contiguous(), ctx.comm, "bwd", ctx.grad_what), None, None, None


class _LseHeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _lse_head_to_seq(x, comm, "fwd", "lse")

    @staticmethod
    def backward(ctx, g):
        return _lse_seq_to_head(g.contiguous(), ctx.comm, "bwd", "dlse"), None


def _expand_kv(k: torch.Tensor, U: int) -> torch.Tensor:
    """Replicate KV heads to ``lcm(Hkv, U)`` so that every Ulysses rank gets whole KV heads (GQA)."""
    Hkv = k.shape[2]
    f = math.lcm(Hkv, U) // Hkv
    return k if f == 1 else k.repeat_interleave(f, dim=2)


# ---------------------------------------------------------------------------------- public entry
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan, scheme: str = "ring_p2p", group=None,
              backend="triton", return_lse: bool = False, *, softmax_scale: float | None = None,
              ulysses_degree: int | None = None, window: int | None = None, joint: bool | None = None):
    """Context-parallel attention of this rank's shards (``q [B, L, Hq, D_qk]``, ``k [B, L, Hkv, D_qk]``,
    ``v [B, L, Hkv, D_v]`` from :func:`dispatch`). Returns this rank's ``out [B, L, Hq, D_v]`` and, with ``return_lse``,
    ``lse [B, Hq, L]`` (float32; float64 for float64 inputs). Differentiable in q, k, v (and
    through lse).

    ``scheme``: ulysses | ring_p2p | ring_allgather | usp | loongtrain | group_cast. ``ulysses_degree`` (usp,
    loongtrain) and ``window`` (loongtrain's inner ring) shape the mesh (``mesh.py`` for defaults).
    ``joint`` (group_cast only): one kernel call over the own and the received keys (default), or
    with ``False`` a local call that overlaps the transfer, a remote call and a merge (``group_cast.py``).
    ``backend``: a backend name (``triton``, ``reference``, any registered backend returning lse)
    or a :class:`~longca_triton.cp.kernels.StepKernel`. Every rank of ``group`` must call this
    with the same arguments.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; valid schemes: {', '.join(SCHEMES)}")
    if joint is not None and scheme != "group_cast":
        raise ValueError(f"joint applies to the group_cast scheme only, not {scheme!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, local_len, heads, head_dim], got shape {tuple(t.shape)}")
        if t.shape[1] != plan.local_len:
            raise ValueError(f"{name} has {t.shape[1]} local positions, the plan gives each rank {plan.local_len}")
    if k.shape[:3] != v.shape[:3] or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         f"(q and k share D_qk; v may have its own head dim)")
    Hq, Hkv = q.shape[2], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}) for GQA")
    N = dist.get_world_size(group)
    if N != plan.world_size:
        raise ValueError(f"the plan is for {plan.world_size} ranks but the group has {N}")
    kernel = get_step_kernel(backend)
    scale = default_scale(q.shape[-1], softmax_scale)
    U, W, O = resolve_dims(scheme, N, Hq, ulysses_degree, window)

    if scheme == "ring_allgather":
        out, lse = _AllGatherAttention.apply(q, k, v, plan, Comm(group), kernel, scale)
        return (out, lse) if return_lse else out
    if scheme == "group_cast":
        out, lse = GroupCastAttention.apply(q, k, v, plan, Comm(group), kernel, scale, True if joint is None else bool(joint))
        return (out, lse) if return_lse else out

    mesh = get_mesh(group, U, W, O)
    ring = _Ring(plan, mesh, kernel, scale)
    if U > 1:
        uc = Comm(mesh.ulysses_group)
        k, v = _expand_kv(k, U), _expand_kv(v, U)
        q = _SeqToHead.apply(q, uc, "q")
        k = _SeqToHead.apply(k, uc, "k")
        v = _SeqToHead.apply(v, uc, "v")
    out, lse = _RingAttention.apply(q, k, v, ring)
    if U > 1:
        out = _HeadToSeq.apply(out, uc, "out", "dout")
        if return_lse:
            lse = _LseHeadToSeq.apply(lse, uc)
    return (out, lse) if return_lse else out

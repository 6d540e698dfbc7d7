"""``group_cast``: move only the keys the mask needs (MagiAttention's GroupCast / GroupReduce idea).

Two modes. **Joint** (the default, ``joint=True``), on rank ``r``:

1. every rank gathers, for every other rank, the K/V rows of its local keys that rank's queries
   attend (KV heads only: with GQA the query heads never move) and exchanges them by **one
   all-to-all with variable splits**;
2. one kernel call of ``r``'s queries against its own and the received K/V interleaved in global
   order (``NeedLayout.joint_pieces``: a row's keys stay one interval where the mask has one, so
   the kernel sees the single-GPU tile structure) under the joint mask: no merge, the output
   straight in the inputs' dtype;
3. backward: one kernel call; as soon as its dK/dV are written (before its dQ kernel runs) the
   received keys' dK/dV partials (float32) go back to their owners by the **reverse all-to-all**,
   overlapping the dQ kernel, and each owner adds them into its dK/dV (``index_add_``).

Why joint by default: the split mode's two calls per query tile run each query tile's prologue,
epilogue and float32 partial twice, then a merge and a dQ sum, which costs more kernel time than
the forward transfer it hides.

**Split** (``joint=False``), forward, on rank ``r``:

1. every rank gathers, for every other rank, the K/V rows of its local keys that rank's queries
   attend (KV heads only: with GQA the query heads never move) and posts **one all-to-all with
   variable splits** (asynchronous);
2. while it flies, ``r`` computes its queries against its own keys (the local pair mask);
3. then one call of its queries against the concatenation of everything received, under the
   remote mask (the global mask remapped to the received key coordinates), and the two partials
   are merged by their lse (``merge.py``; the fused Triton merge on CUDA).

Split backward (no recomputation, FlashAttention style with the merged ``out`` / ``lse``): the remote
part first, so that its dK/dV partials (float32) can go back to their owners by the **reverse
all-to-all** (the same splits, transposed) while the local part's backward runs; each owner then
adds what comes back into its dK/dV by the gathered positions (``index_add_``, so a key needed by
several ranks sums all of their shares). The received K/V are kept from the forward for it.

A rank whose queries need nothing remote skips the remote call; a rank that owns nothing others
need sends nothing; when no rank needs anything remote, no collective is issued. Bytes go through
:class:`~.comm.Comm` (counted; ``comm_model`` gives the same numbers from the mask and plan).
"""

from __future__ import annotations

import torch

from .comm import Comm
from .kernels import StepKernel, acc_dtype
from .merge import merge_, merge_into, use_fused
from .need import need_layout
from .plan import CPPlan

__all__ = ["GroupCastAttention"]


def _index(plan: CPPlan, rank: int, device) -> torch.Tensor:
    key = ("group_cast_index", rank, str(device))
    if key not in plan._cache:
        plan._cache[key] = torch.as_tensor(need_layout(plan).send_index(rank), device=device)
    return plan._cache[key]


def _take_rows(k: torch.Tensor, v: torch.Tensor, runs) -> torch.Tensor:
    """Keys ``runs`` (``(start, end)`` along dim 1) of ``k [B, L, H, D_qk]`` and ``v [B, L, H, D_v]`` as
    all-to-all rows ``[n, B, H, D_qk + D_v]`` (K then V on the last dim, so ``D_v != D_qk`` travels
    too), copied straight into place: one copy per run and tensor (a cat per tensor and a stack
    cost one more pass over the rows and ~3x the host ops, which sit before the forward kernel on
    the GPU's critical path)."""
    n, dk = sum(b - a for a, b in runs), k.shape[-1]
    rows = k.new_empty((n,) + tuple(k.shape[:1]) + tuple(k.shape[2:3]) + (dk + v.shape[-1],))
    o = 0
    for a, b in runs:
        rows[o:o + b - a, ..., :dk].copy_(k[:, a:b].transpose(0, 1))
        rows[o:o + b - a, ..., dk:].copy_(v[:, a:b].transpose(0, 1))
        o += b - a
    return rows


def _parts(rows: torch.Tensor, dk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V halves of all-to-all rows ``[n, B, H, D_qk + D_v]`` (views)."""
    return rows[..., :dk], rows[..., dk:]


def _unrows(rows: torch.Tensor, dk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[n, B, H, D_qk + D_v]`` -> ``k [B, n, H, D_qk]``, ``v [B, n, H, D_v]`` contiguous."""
    return tuple(t.transpose(0, 1).contiguous() for t in _parts(rows, dk))


class GroupCastAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: CPPlan, comm: Comm, kernel: StepKernel, scale: float, joint: bool = True):
        me = comm.rank
        lay = need_layout(plan)
        acc = acc_dtype(q.dtype)
        work = recv = None
        if lay.any_traffic:
            # gather only what leaves, [n_send, B, Hkv, D_qk + D_v]: runs of consecutive keys copied
            # in place (an indexed gather cost ~0.6 ms of host time per call on the H200s, profile_split/)
            runs = lay.send_ranges(me)
            send = _take_rows(k, v, runs)
            recv, work = comm.all_to_all_v(send, lay.send_splits(me), lay.recv_splits(me), "fwd", "kv", async_op=True)
        if joint:
            return _joint_forward(ctx, q, k, v, lay, comm, kernel, scale, recv, work)
        local_mask = plan.pair_mask((me,), (me,))
        parts = []
        if local_mask is not None:
            parts.append(kernel.forward(q, k, v, local_mask, scale))  # overlaps the transfer
        if work is not None:
            work.wait()
        remote_mask = lay.remote_mask(me)
        kv_r = _unrows(recv, k.shape[-1]) if recv is not None and recv.shape[0] else None
        if remote_mask is not None:
            parts.append(kernel.forward(q, kv_r[0], kv_r[1], remote_mask, scale))
        if not parts:
            out, lse = _empty(q, v, acc)
        elif len(parts) == 1:
            out, lse = parts[0][0].to(q.dtype), parts[0][1].to(acc)
        else:
            (o1, l1), (o2, l2) = parts
            l1, l2 = l1.to(acc).contiguous(), l2.to(acc).contiguous()
            if use_fused(q):
                out = torch.empty_like(q)
                lse = torch.empty_like(l1)
                merge_into(o1, l1, o2, l2, out, lse)
            else:
                out, lse = o1.to(acc), l1.clone()
                merge_(out, lse, o2, l2)
                out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, *(kv_r if kv_r is not None else (torch.empty(0), torch.empty(0))), out, lse)
        ctx.info = (plan, comm, kernel, scale, local_mask, remote_mask, False)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if ctx.info[-1]:
            return _joint_backward(ctx, dout, dlse)
        q, k, v, k_r, v_r, out, lse = ctx.saved_tensors
        plan, comm, kernel, scale, local_mask, remote_mask, _ = ctx.info
        me = comm.rank
        lay = need_layout(plan)
        acc = acc_dtype(q.dtype)
        if dout is None:
            dout = torch.zeros_like(out)
        dout = dout.contiguous()
        dq = None
        work = back = None
        if lay.any_traffic:
            n_recv = sum(lay.recv_splits(me))
            if remote_mask is not None:
                dq, dk_r, dv_r = kernel.backward(dout, q, k_r, v_r, out, lse, remote_mask, scale, dlse)
                dkv_r = _take_rows(dk_r.to(acc), dv_r.to(acc), [(0, dk_r.shape[1])])
                dq = dq.to(acc)
            else:  # received keys that no query attends (cannot happen for a need; kept for safety)
                dkv_r = torch.zeros((n_recv, k.shape[0], k.shape[2], k.shape[3] + v.shape[3]), dtype=acc, device=k.device)
            # partial dK/dV of the received keys go back to their owners while the local part runs
            back, work = comm.all_to_all_v(dkv_r, lay.recv_splits(me), lay.send_splits(me), "bwd", "dkv", async_op=True)
        if local_mask is not None:
            dq_l, dk, dv = kernel.backward(dout, q, k, v, out, lse, local_mask, scale, dlse)
            dq = dq_l.to(acc) if dq is None else dq.add_(dq_l)
            dk, dv = dk.to(acc), dv.to(acc)
        else:
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        _add_returned(plan, me, dk, dv, back, work)
        if dq is None:
            dq = torch.zeros_like(q)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _empty(q, v, acc):
    """Output and lse of queries that attend nothing: zeros and ``-inf``."""
    B, L, H = q.shape[:3]
    return q.new_zeros((B, L, H, v.shape[-1])), torch.full((B, H, L), float("-inf"), dtype=acc, device=q.device)


def _add_returned(plan, me, dk, dv, back, work):
    """Wait for the dK/dV partials other ranks computed for this rank's keys and add them in."""
    if work is None:
        return
    work.wait()
    if back.shape[0]:
        idx = _index(plan, me, dk.device)
        back_k, back_v = _parts(back, dk.shape[-1])
        dk.index_add_(1, idx, back_k.transpose(0, 1))
        dv.index_add_(1, idx, back_v.transpose(0, 1))


def _source_runs(lay, me: int, source: int) -> list[tuple[int, int]]:
    """Joint-buffer runs ``(start, end)`` of one source (0 own, 1 received) in that source's order."""
    key = ("joint_runs", me, source)
    if key not in lay._cache:
        lay._cache[key] = [(j0, j1) for _, j0, j1 in sorted((a, j0, j1) for j0, j1, s, a in lay.joint_pieces(me) if s == source)]
    return lay._cache[key]


def _joint_forward(ctx, q, k, v, lay, comm, kernel, scale, recv, work):
    me = comm.rank
    acc = acc_dtype(q.dtype)
    mask = lay.joint_mask(me)  # host work while the transfer flies
    pieces = lay.joint_pieces(me)
    if work is not None:
        work.wait()
    if len(pieces) == 1 and pieces[0][2] == 0:  # nothing received: the own keys, already in order
        kj, vj = k, v
    else:
        # own and received keys interleaved in global order (rows keep the mask's intervals), each
        # of K and V by one cat of views: received rows [n, B, Hkv, D_qk + D_v] are read in place
        def joint(own, got):
            return torch.cat([own[:, a:a + (j1 - j0)] if s == 0 else got[a:a + (j1 - j0)].transpose(0, 1)
                              for j0, j1, s, a in pieces], dim=1)
        got_k, got_v = _parts(recv, k.shape[-1])
        kj, vj = joint(k, got_k), joint(v, got_v)
    if mask is None:
        out, lse = _empty(q, v, acc)
    else:
        # one call, no merge: the output in q's dtype straight from the kernel
        out, lse = kernel.forward(q, kj, vj, mask, scale, partial=False)
        out, lse = out.to(q.dtype), lse.to(acc)
    ctx.save_for_backward(q, kj, vj, out, lse)
    ctx.info = (lay.plan, comm, kernel, scale, mask, k.shape[1], k.dtype, v.dtype, True)
    ctx.set_materialize_grads(False)
    return out, lse


def _joint_backward(ctx, dout, dlse):
    q, kj, vj, out, lse = ctx.saved_tensors
    plan, comm, kernel, scale, mask, L, k_dtype, v_dtype, _ = ctx.info
    me = comm.rank
    lay = need_layout(plan)
    acc = acc_dtype(q.dtype)
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    got = {}

    def split(dkj, dvj):
        # the joint buffer's dK/dV back into own (local order) and received (received order) rows,
        # each by one cat of views; the received keys' partials go home while the dQ kernel runs
        dkj, dvj = dkj.to(acc), dvj.to(acc)  # [B, L + n, Hkv, D]; no copy when already float32
        own = _source_runs(lay, me, 0)
        got["dk"] = torch.cat([dkj[:, a:b] for a, b in own], dim=1)  # [B, L, Hkv, D]
        got["dv"] = torch.cat([dvj[:, a:b] for a, b in own], dim=1)
        if lay.any_traffic:
            dkv_r = _take_rows(dkj, dvj, _source_runs(lay, me, 1))  # [n_recv, B, Hkv, D_qk + D_v]
            got["back"], got["work"] = comm.all_to_all_v(dkv_r, lay.recv_splits(me), lay.send_splits(me), "bwd", "dkv",
                                                         async_op=True)

    if mask is not None:
        dq, _, _ = kernel.backward(dout, q, kj, vj, out, lse, mask, scale, dlse, partial=False, after_dkdv=split)
    else:
        dq = torch.zeros_like(q)
        split(torch.zeros(kj.shape, dtype=acc, device=q.device), torch.zeros(vj.shape, dtype=acc, device=q.device))
    dk, dv = got["dk"], got["dv"]
    _add_returned(plan, me, dk, dv, got.get("back"), got.get("work"))
    return dq.to(q.dtype), dk.to(k_dtype), dv.to(v_dtype), None, None, None, None, None

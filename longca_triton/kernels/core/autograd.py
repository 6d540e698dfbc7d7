"""The autograd glue the three kernels share: an ``autograd.Function`` over launchers, and the
``torch.library`` fake and autograd registrations of their ``*_fwd`` / ``*_bwd`` custom ops.

Both follow one pattern: the forward returns ``(out, lse)`` and saves ``q, k, v, out, lse``; the
backward turns a missing ``dout`` (only ``lse`` was used) into zeros and feeds ``dlse`` to the
launchers' delta preprocess; every non-tensor argument gets a ``None`` gradient.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["attention_function", "fake_fwd", "fake_bwd", "register_op_autograd"]


def attention_function(name: str, fwd: Callable, bwd: Callable, doc: str) -> type:
    """An ``autograd.Function`` ``(q, k, v, *args) -> (out, lse)``.

    ``fwd(q, k, v, *args) -> (out, lse)``; ``bwd(dout, dlse, q, k, v, out, lse, *args) -> (dq, dk,
    dv)``; ``args`` (plans, tables, scale, config) ride along as non-tensor arguments.
    """

    def forward(ctx, q, k, v, *args):
        out, lse = fwd(q, k, v, *args)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = args
        return out, lse

    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = bwd(dout, dlse, q, k, v, out, lse, *ctx.args)
        return (dq, dk, dv) + (None,) * len(ctx.args)

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward), "__doc__": doc})


def fake_fwd(q: torch.Tensor, v: torch.Tensor | None = None):
    """The forward op's outputs for tracing: ``out [B, Sq, Hq, D_v]`` (v's head dim; q's when ``v``
    is not given), ``lse [B, Hq, Sq]`` float32."""
    b, sq, hq, d = q.shape
    d_v = d if v is None else v.shape[-1]
    return q.new_empty((b, sq, hq, d_v)), q.new_empty((b, hq, sq), dtype=torch.float32)


def fake_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    # the real op returns contiguous tensors whatever the inputs' strides
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def register_op_autograd(fwd_op_name: str, bwd_op: Callable, list_len: int) -> None:
    """Autograd for a forward op ``(q, k, v, fwd_lists, lists_a, lists_b, *scalars)`` whose
    backward op is ``bwd_op(dout, dlse, q, k, v, out, lse, lists_a, lists_b, *scalars)``.

    ``lists_a, lists_b`` (the backward's plans / tables, ``list_len`` int32 tensors each) are
    saved for the backward; ``fwd_lists`` is not.
    """

    def setup_context(ctx, inputs, output):
        q, k, v, _fwd_lists, lists_a, lists_b, *scalars = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, *lists_a, *lists_b)
        ctx.scalars = scalars

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *lists = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = bwd_op(dout, dlse, q, k, v, out, lse, list(lists[:list_len]),
                            list(lists[list_len:]), *ctx.scalars)
        # the gradient's structure must mirror the inputs': one None per list tensor
        none = [None] * list_len
        return (dq, dk, dv, list(none), list(none), list(none)) + (None,) * len(ctx.scalars)

    torch.library.register_autograd(fwd_op_name, backward, setup_context=setup_context)

"""Host-side plumbing shared by our Triton kernels: interpreter fix-up, TMA allocator, layouts.

Nothing here probes hardware at import; the interpreter patch applies only under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch
import triton


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def patch_interpreter_scalars() -> None:
    """Let the CPU interpreter use loaded scalars as loop bounds under NumPy >= 2.4.

    Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into loop bounds
    through ``tl.tensor.__index__ = lambda self: int(self.handle.data)``, which NumPy 2.4 rejects
    ("only 0-dimensional arrays..."). Its lang patch (``_patch_lang_tensor``) is wrapped so that
    ``__index__`` accepts 1-element arrays.

    Why not give the interpreter module an ``int`` of our own: the interpreter copies its module
    globals into every kernel's module when it rewrites a kernel, so that ``int`` would replace the
    builtin in our kernel modules' host code too, and TorchDynamo cannot trace a call to it (the
    ``torch.compile`` path of ``block_sparse_attention_op``). That override is only the fallback for
    a Triton without ``_patch_lang_tensor``.
    """
    import builtins

    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter, "_longca_int_patch", False):
        return

    def to_int(x):
        if isinstance(x, np.ndarray) and x.size == 1:
            x = x.reshape(())
        return builtins.int(x)

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is not None:
        def _patch_lang_tensor(tensor, scope):
            original(tensor, scope)
            # recorded by the scope like the original's, so its restore() undoes both in order
            scope.set_attr(tensor, "__index__", lambda self: to_int(self.handle.data))

        interpreter._patch_lang_tensor = _patch_lang_tensor
        interpreter._longca_int_patch = True
        return

    class _IntMeta(type):
        # isinstance(x, int) inside the interpreter must keep meaning the builtin int
        def __instancecheck__(cls, obj):
            return isinstance(obj, builtins.int)

        def __subclasscheck__(cls, sub):
            return issubclass(sub, builtins.int)

    class _Int(builtins.int, metaclass=_IntMeta):
        def __new__(cls, x=0, *args):
            if isinstance(x, np.ndarray) and x.size == 1 and not args:
                x = x.reshape(())
            return builtins.int(x, *args)

    interpreter.int = _Int
    interpreter._longca_int_patch = True


if interpreting():
    patch_interpreter_scalars()


def ensure_allocator(device: torch.device) -> None:
    """In-kernel tensor descriptors need a scratch allocator on the GPU.

    Triton keeps the allocator in a ``ContextVar``, so it is per thread: autograd runs the
    backward on its own worker thread, which starts with none. Set ours wherever none is set yet
    (a caller's own allocator is left alone). Call it before every launch.
    """
    if device.type != "cuda":
        return
    try:
        from triton.runtime import _allocation

        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # other Triton layout: set it unconditionally
        pass

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, device=device, dtype=torch.int8)

    triton.set_allocator(alloc)


def compile_disabled(fn):
    """``torch.compiler.disable(fn)`` (``torch.compile`` runs ``fn`` eagerly, as a graph break),
    applied on the first call rather than at import: ``torch.compiler.disable`` imports
    ``torch._dynamo``, seconds of imports that a program which never compiles (the CLI) should not
    pay. Where ``torch._dynamo`` is already imported it is applied at once."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.disable(fn)
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return call


_SIDE_STREAMS: dict = {}


@contextlib.contextmanager
def side_stream(device: torch.device, enabled: bool):
    """``with side_stream(dev, on) as beside:`` then ``with beside(): <launches>``: those launches go
    to a second CUDA stream that starts after everything queued so far on the current one, so they
    run concurrently with what the current stream runs meanwhile; at exit the current stream waits
    for the side stream (later work, and the tensors' reuse by the caching allocator, come after
    both). Off, or off CUDA (the interpreter), ``beside()`` does nothing and launches stay in order.

    Why (the backward's config key ``bwd_streams``): a dK/dV kernel of ~2000 programs runs ~15.5
    waves on 132 SMs; its last wave leaves SMs idle that the dQ kernel, queued behind it on one
    stream, cannot take. On a second stream the dQ kernel's programs fill them. The kernels and
    their bits are the same either way (no atomics, disjoint outputs)."""
    device = torch.device(device)
    if not enabled or device.type != "cuda":
        yield contextlib.nullcontext
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    main = torch.cuda.current_stream(index)
    side = _SIDE_STREAMS.get(index)
    if side is None:  # one per device, made on first use (never at import)
        side = _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    side.wait_stream(main)
    try:
        yield lambda: torch.cuda.stream(side)
    finally:
        main.wait_stream(side)


def descriptor_ready(t: torch.Tensor) -> torch.Tensor:
    """TMA wants a unit last stride and 16-byte aligned base and row strides; copy otherwise."""
    es = t.element_size()
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in t.stride()[:-1])
    return t if ok else t.contiguous()


#: head dims our kernels take: every multiple of 8 from 8 to 256, for q.k and for v separately.
#: why multiples of 8: a tensor descriptor (TMA) needs 16-byte aligned row strides and head
#: offsets, which is 8 elements in fp16 / bf16. Tiles are padded to a power of two on the head-dim
#: axis (``block_head_dim``); the padding is zero-filled on load and dropped on store.
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 256


def head_dim_reason(d: int, which: str = "head dim") -> str:
    """Why our kernels cannot take head dim ``d`` (empty when they can)."""
    if d < HEAD_DIM_MULTIPLE or d > MAX_HEAD_DIM or d % HEAD_DIM_MULTIPLE:
        return (f"{which} {d} not supported; our kernels take multiples of {HEAD_DIM_MULTIPLE} from "
                f"{HEAD_DIM_MULTIPLE} to {MAX_HEAD_DIM} (16-byte rows for the tensor descriptors)")
    return ""


def public_head_dim_reason(d: int, which: str = "head dim") -> str:
    """Why a public call cannot take head dim ``d`` (empty when it can): any ``1 <= d <= 256``, since
    a dim that is no multiple of 8 is padded with zeros first (``padded_call``), as FlashAttention does."""
    if d < 1 or d > MAX_HEAD_DIM:
        return f"{which} {d} not supported; our kernels take 1 to {MAX_HEAD_DIM}"
    return ""


def padded_head_dim(d: int) -> int:
    """``d`` rounded up to the next multiple of ``HEAD_DIM_MULTIPLE`` (the kernels' descriptor rule)."""
    return -(-int(d) // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE


def padded_call(run, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``run(q, k, v)`` with head dims padded by zeros to multiples of 8 and the output cut back to
    ``D_v``. Zero columns add nothing to ``q kᵀ`` and give zero output columns, so the math is the
    unpadded one when the caller fixed the softmax scale from the true ``D_qk``; autograd drops the
    padded gradient columns. Dims already a multiple of 8 call ``run`` on the tensors as they are."""
    d, dv = q.shape[-1], v.shape[-1]
    pd, pdv = padded_head_dim(d), padded_head_dim(dv)
    if (pd, pdv) == (d, dv):
        return run(q, k, v)
    pad = torch.nn.functional.pad
    res = run(pad(q, (0, pd - d)), pad(k, (0, pd - d)), pad(v, (0, pdv - dv)))
    if isinstance(res, tuple):
        return (res[0][..., :dv],) + tuple(res[1:])
    return res[..., :dv]


def block_head_dim(d: int) -> int:
    """The padded (power-of-two, >= 16 for ``tl.dot``) head-dim tile for a true head dim ``d``."""
    return max(16, triton.next_power_of_2(int(d)))


def head_dim_meta(d_qk: int, d_v: int) -> dict:
    """The head-dim constexprs every kernel of ours takes: the true dims and their padded tiles.

    A kernel whose ``BLOCK_D* == HEAD_DIM_*`` compiles exactly as before head dims were padded
    (descriptor shape and block shape agree; pointer loads skip the head-dim mask)."""
    return {"HEAD_DIM_QK": int(d_qk), "HEAD_DIM_V": int(d_v), "BLOCK_DQK": block_head_dim(d_qk),
            "BLOCK_DV": block_head_dim(d_v)}


def config_head_dim(d_qk: int, d_v: int) -> int:
    """The head dim launch configs are chosen by: the larger padded tile (registers and shared
    memory follow the padded tiles, not the true dims)."""
    return max(block_head_dim(d_qk), block_head_dim(d_v))


def head_dim_label(d_qk: int, d_v: int | None = None) -> str:
    """``"128"``, or ``"192/128"`` when the value head dim differs (``D_qk/D_v``)."""
    return str(d_qk) if d_v is None or int(d_v) == int(d_qk) else f"{int(d_qk)}/{int(d_v)}"


def check_qkv(q, k, v, what: str) -> None:
    """Shapes ``q [B, Sq, Hq, D_qk]``, ``k [B, Sk, Hkv, D_qk]``, ``v [B, Sk, Hkv, D_v]`` (``v`` may
    have its own head dim), head dims, GQA, dtype and device checks shared by our launchers
    (``what`` names the kernel in the device error). Raises ``ValueError`` before any launch."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, S, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    b, sq, hq, d = q.shape
    bk, sk, hkv, dk = k.shape
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"k and v must agree on [B, Sk, Hkv] (only their head dims may differ); got "
                         f"{tuple(k.shape)} vs {tuple(v.shape)}")
    if bk != b:
        raise ValueError(f"batch mismatch: q has {b}, k/v have {bk}")
    if dk != d:
        raise ValueError(f"head dim mismatch: q has {d}, k has {dk} (q and k share D_qk; v may differ)")
    for which, dim in (("head dim of q/k", d), ("head dim of v", v.shape[3])):
        why = head_dim_reason(dim, which)
        if why:
            raise ValueError(why)
    if hkv == 0 or hq % hkv:
        raise ValueError(f"GQA needs Hq % Hkv == 0; got Hq={hq}, Hkv={hkv}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if interpreting() else ())
    if q.dtype not in allowed:
        raise ValueError(f"dtype {q.dtype} not supported; use one of {allowed}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(f"{what} runs on CUDA (or on the CPU with TRITON_INTERPRET=1)")


def resolve_scale(softmax_scale, head_dim: int) -> float:
    """``softmax_scale`` as a float, ``1 / sqrt(head_dim)`` when None; it must be positive and finite."""
    import math

    scale = float(1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale)
    if not scale > 0 or math.isinf(scale):
        raise ValueError(f"softmax_scale must be a positive finite number, got {scale}")
    return scale


def bsh_strides(*tensors: torch.Tensor) -> tuple:
    """The batch, sequence and head strides of ``[B, S, H, D]`` tensors, flattened in order: what
    every launcher passes before its tables (the head-dim stride is 1, checked by
    ``descriptor_ready``)."""
    return tuple(s for t in tensors for s in t.stride()[:3])

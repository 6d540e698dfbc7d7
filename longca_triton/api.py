"""The public entry point ``longca_triton.attention``."""

from __future__ import annotations

import functools

import torch

from .masks import BlockSparseMask, Mask, RangeMask, block_diagonal

#: the backend of range masks where the shipped table (``kernels/tuning/default.toml``) has no row
DEFAULT_BACKEND = "triton"
#: the tiles whose partial share the default rule reads: the Gluon forward's query and key tiles
FEATURE_TILE = 128


def plan_features(mask: Mask, head_dim: int, head_dim_v: int | None = None) -> dict:
    """What the default rule reads of a call: the padded head dims, the mask's density and lengths,
    and its 128 x 128 tiles (full, partial, the partial share among those touched). Cached with the
    mask's block tables, so a repeated call pays a dict lookup."""
    from longca_triton.kernels.core.runtime import padded_head_dim

    dv = head_dim if head_dim_v is None else head_dim_v
    bt = mask.block_tables(FEATURE_TILE, FEATURE_TILE)
    touched = bt.num_full + bt.num_partial
    return {"head_dim": padded_head_dim(head_dim), "head_dim_v": padded_head_dim(dv), "density": float(mask.density),
            "seqlen_q": int(mask.seqlen_q), "seqlen_k": int(mask.seqlen_k), "full_tiles": int(bt.num_full),
            "partial_tiles": int(bt.num_partial), "partial_share": bt.num_partial / touched if touched else 0.0}


def default_backend(mask: Mask, q: torch.Tensor | None = None, k: torch.Tensor | None = None,
                    v: torch.Tensor | None = None, mode: str | None = None) -> str:
    """The backend ``attention`` uses when none is named.

    Block-sparse masks: ``triton-sparse`` (uniform power-of-two blocks) or ``triton-varblock``.
    Range masks on a GPU: the rows of ``kernels/tuning/default.toml`` that match the GPU's arch, the
    call's :func:`plan_features` and what the call runs (``fwd`` without autograd, ``fwd_bwd`` with:
    each row names the results that measured it), unless the user's autotune cache measured both
    ``triton`` and ``triton-gluon`` on this problem class, when the faster of the two runs. A backend
    that cannot run the call is never picked: ``triton`` then runs. On a CPU (the interpreter):
    ``triton``. The choice is memoised on the mask per shape, dtype, device and mode. ``mode``
    (``"fwd"`` or ``"fwd_bwd"``) overrides what the autograd state says: a custom op runs outside
    autograd and is told by its caller whether a backward follows.
    """
    if mode not in (None, "fwd", "fwd_bwd"):
        raise ValueError(f"mode must be 'fwd' or 'fwd_bwd', got {mode!r}")
    if isinstance(mask, BlockSparseMask):
        return "triton-sparse" if mask.uniform_block else "triton-varblock"
    if q is None or k is None or q.device.type != "cuda":
        return DEFAULT_BACKEND
    from longca_triton.kernels.core.plan_cache import mask_memo
    from longca_triton.kernels.core.tuned import generation

    v = k if v is None else v
    if mode is None:
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        mode = "fwd_bwd" if grad else "fwd"
    key = ("default", q.shape[0], q.shape[2], k.shape[2], q.shape[-1], v.shape[-1], q.dtype, str(q.device), mode,
           generation())
    return mask_memo(mask, key, lambda: _choose(mask, q, k, v, mode))


def _choose(mask: Mask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str) -> str:
    choice = _measured_choice(mask, q, k, v, mode) or _table_choice(mask, q, v, mode)
    if choice != DEFAULT_BACKEND:
        from .adapters import Problem, get_backend

        ok, _ = get_backend(choice).check(Problem.from_tensors(q, k, v, mask))
        if not ok:
            return DEFAULT_BACKEND
    return choice


def _table_choice(mask: Mask, q: torch.Tensor, v: torch.Tensor, mode: str = "fwd") -> str:
    """The backend of the table's last row that matches this call and ``mode``, else its default."""
    from longca_triton.kernels.tuning import Problem, load_table

    major, minor = torch.cuda.get_device_capability(q.device)
    f = plan_features(mask, q.shape[-1], v.shape[-1])
    problem = Problem(arch=f"sm{major}{minor}", head_dim=f["head_dim"], head_dim_v=f["head_dim_v"],
                      density=f["density"], seqlen=max(f["seqlen_q"], f["seqlen_k"]),
                      partial_share=f["partial_share"], dtype=str(q.dtype).replace("torch.", ""))
    table = load_table("default", ("backend",))
    backend = table.defaults["backend"]
    for row in table.matching(problem):
        if row.mode == mode:
            backend = row.config["backend"]
    return backend


def _measured_choice(mask: Mask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str = "fwd") -> str | None:
    """``triton-gluon`` or ``triton`` where the user's autotune cache measured both on this problem
    class (the faster forward, or with autograd the faster backward), else None."""
    from longca_triton.kernels.core.tuned import measured_tflops

    which = "bwd" if mode == "fwd_bwd" else "fwd"
    gluon = measured_tflops("triton-gluon", q, k, mask, v, mode=which)
    plain = measured_tflops("triton", q, k, mask, v, mode=which)
    if gluon is None or plain is None:
        return None
    return "triton-gluon" if gluon > plain else DEFAULT_BACKEND


def validate_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> None:
    """Check shapes, dtypes, devices, head divisibility and mask size; raise ``ValueError`` naming the problem."""
    validate_tensors(q, k, v)
    Sq, Hq = q.shape[1], q.shape[2]
    if not isinstance(mask, Mask):
        raise ValueError(f"mask must be a RangeMask or BlockSparseMask (see longca_triton.make_mask), or a list of "
                         f"one RangeMask per batch element, got {type(mask).__name__}")
    if mask.seqlen_q != Sq or mask.seqlen_k != k.shape[1]:
        raise ValueError(
            f"mask is {mask.seqlen_q}x{mask.seqlen_k} (Sq x Sk) but q has {Sq} positions and k/v have {k.shape[1]}"
        )
    if isinstance(mask, BlockSparseMask) and Hq % mask.num_patterns:
        raise ValueError(f"the mask's {mask.num_patterns} patterns do not divide {Hq} query heads")


def validate_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Check ``q, k, v`` alone (4-D, floating point, one dtype and device, GQA); ``ValueError`` naming the problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, seqlen, heads, head_dim], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on [batch, seqlen, heads] (v may have its own head dim), got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    B, _, Hq, D = q.shape
    if k.shape[0] != B:
        raise ValueError(f"batch sizes differ: q has {B}, k/v have {k.shape[0]}")
    if k.shape[3] != D:
        raise ValueError(f"head dims of q and k differ: q has {D}, k has {k.shape[3]} (they share D_qk; v may differ)")
    if v.shape[3] < 1:
        raise ValueError(f"v has head dim {v.shape[3]}; it must be positive")
    Hkv = k.shape[2]
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}) for GQA")


def attention(q, k, v, mask: Mask | list, *, softmax_scale: float | None = None, backend: str | None = None,
              return_lse: bool = False, deterministic: bool = False):
    """Masked attention. ``q [B, Sq, Hq, D_qk]``, ``k [B, Sk, Hkv, D_qk]``, ``v [B, Sk, Hkv, D_v]``
    (``Hq % Hkv == 0`` is GQA; ``v`` may have its own head dim, e.g. 192/128).

    ``mask`` is one mask for the whole batch, or a list of ``B`` ``RangeMask``s, one per batch
    element (a packed batch whose rows hold different documents): the batch then runs as one kernel
    call on the sequence ``[1, B * Sq]`` under the block-diagonal union of the masks.

    Returns ``out [B, Sq, Hq, D_v]`` and, with ``return_lse``, ``lse [B, Hq, Sq]`` (float32, natural
    log, ``-inf`` for rows that attend nothing). Differentiable. The default scale is
    ``1/sqrt(D_qk)``. ``backend`` names an entry of the registry (``longca-triton doctor`` lists
    them); one that cannot run these head dims raises ``ValueError`` with its reason.

    ``deterministic=True``: gradients bitwise identical run to run (what FlashAttention users ask
    for). Our ``triton``, ``triton-flashmask``, ``triton-sparse`` and ``triton-varblock`` backends
    honour it at no cost (their backward has no atomics); ``fa2`` / ``fa3`` pass it to FlashAttention where the installed
    build takes it; ``triton-gluon`` honours it too (no atomics in its backward); every other
    backend raises ``ValueError`` naming itself.
    """
    from .adapters import Problem, get_backend

    if isinstance(mask, (list, tuple)):
        return _attention_per_element(q, k, v, mask, softmax_scale=softmax_scale, backend=backend,
                                      return_lse=return_lse, deterministic=deterministic)
    # the backend-independent check (shapes, GQA, the mask fitting); our kernels' public entries add
    # their own (head dims, dtypes, devices), since users call them directly too
    validate_inputs(q, k, v, mask)
    impl = get_backend(backend or default_backend(mask, q, k, v))
    problem = Problem.from_tensors(q, k, v, mask, softmax_scale)  # problem.scale: the resolved scale
    ok, why = impl.check(problem)
    if not ok:
        raise ValueError(f"backend {impl.name!r} cannot run this case: {why}")
    if return_lse and not impl.returns_lse:
        raise ValueError(f"backend {impl.name!r} does not return the log-sum-exp")
    if deterministic:  # the keyword only when asked: a Backend subclass of before still takes the call
        return impl.call(problem, q, k, v, return_lse=return_lse, deterministic=True)
    return impl.call(problem, q, k, v, return_lse=return_lse)


@functools.lru_cache(maxsize=16)
def _packed_mask(masks: tuple) -> RangeMask:
    """The block-diagonal mask of a batch's masks, kept while the same masks come back (every layer of a
    model), so the kernels' plans cached on it are reused."""
    return block_diagonal(masks)


def _attention_per_element(q, k, v, masks, **kwargs):
    """``attention`` with one ``RangeMask`` per batch element: the batch packed into one sequence."""
    validate_tensors(q, k, v)
    B, Sq, Hq, _ = q.shape
    Sk = k.shape[1]
    if len(masks) != B:
        raise ValueError(f"a list of masks needs one mask per batch element: got {len(masks)} masks for batch {B}")
    for n, m in enumerate(masks):
        if not isinstance(m, RangeMask):
            raise ValueError(f"masks[{n}] is a {type(m).__name__}; a list of per-element masks takes RangeMasks only "
                             "(a block-sparse mask is one mask for the whole batch)")
        if (m.seqlen_q, m.seqlen_k) != (Sq, Sk):
            raise ValueError(f"masks[{n}] is {m.seqlen_q}x{m.seqlen_k} (Sq x Sk) but q has {Sq} positions and k/v have {Sk}")
    packed = _packed_mask(tuple(masks))

    def flat(t):
        return t.reshape(1, B * t.shape[1], *t.shape[2:])

    res = attention(flat(q), flat(k), flat(v), packed, **kwargs)
    out, lse = res if kwargs["return_lse"] else (res, None)
    out = out.reshape(B, Sq, Hq, out.shape[-1])
    if lse is None:
        return out
    return out, lse.reshape(Hq, B, Sq).transpose(0, 1).contiguous()

"""``attn_implementation="longca_triton"`` for HuggingFace transformers models.

``register()`` adds two entries under one name: an attention function to transformers'
``AttentionInterface`` and a mask function to its ``AttentionMaskInterface``. The mask function
hands the attention function the 2-D padding mask as it is (like FlashAttention's), or for a
cache whose queries do not end at the last key (a static cache) transformers' dense SDPA mask.

The attention function maps what a transformers layer passes to per-row key intervals, built
with tensor ops (no host reads, so a compiled model keeps one graph), and runs our kernels
through the ``longca_triton::attention`` op on the batch laid end to end (``[1, B * S, H, D]``,
one block of the mask per sequence):

* causal (``module.is_causal`` / ``is_causal``), or bidirectional attention over the sequence;
* a 2-D padding mask ``[B, Sk]`` (left or right padding: each sequence's tokens one run);
* packed sequences, when no padding mask is given (as transformers' FlashAttention path does):
  documents from ``cu_seq_lens_q`` (a data collator's document bounds), else a position that does
  not follow the one before it by 1 starts one (transformers' packed-sequence rule);
* sliding-window layers (``sliding_window`` / ``module.sliding_window``): a query sees its last
  ``sliding_window`` keys, itself included;
* GQA: the key/value heads go in as they are (no repeat);
* a 4-D mask ``[B, 1 or H, Sq, Sk]`` (bool, or float of 0 and -inf) whose rows each allow one run
  of keys (outside ``torch.compile``).

Everything else falls back to transformers' own SDPA function with the reason logged once (Python
``logging``, logger ``longca_triton.integrations.transformers``): dropout while training, a float
bias, padding with gaps inside a sequence, a dtype, device or head dim our kernels do not take.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Optional

import torch

from longca_triton.adapters.triton_base import TritonBackend, interpreting, runs_here
from longca_triton.kernels.core.runtime import public_head_dim_reason

from .ops import BACKENDS, _version, compiled_attention

__all__ = ["NAME", "attention_forward", "padding_mask", "register", "row_intervals"]

#: the ``attn_implementation`` name ``register`` uses
NAME = "longca_triton"

logger = logging.getLogger(__name__)
_LOGGED: set = set()


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("the transformers integration needs transformers: pip install 'longca-triton[transformers]'") from e
    return transformers


def register(name: str = NAME, *, backend: Optional[str] = None) -> str:
    """Register ``attn_implementation=name`` with transformers (attention and mask functions) and return
    ``name``; ``backend`` is one of ``integrations.ops.BACKENDS``: ``"default"`` (``None``: what
    ``longca_triton.attention`` runs, the Gluon kernels on Hopper), ``"triton"``, ``"triton-gluon"`` or
    ``"reference"``. Then
    ``AutoModelForCausalLM.from_pretrained(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)``."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    _transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, functools.partial(attention_forward, backend=backend))
    AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                 mask_function=None, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """transformers' mask function for this implementation: the 2-D padding mask over the last
    ``kv_length`` keys (None without one); where the queries do not end at the last key (a static
    cache) or keys start past the first position, transformers' 4-D boolean SDPA mask."""
    if isinstance(q_offset, torch.Tensor) or kv_offset != 0 or q_offset + q_length != kv_length:
        from transformers.masking_utils import causal_mask_function, sdpa_mask

        kwargs.pop("allow_is_causal_skip", None)
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
                         attention_mask=attention_mask, allow_is_causal_skip=False, **kwargs)
    return None if attention_mask is None else attention_mask[:, -kv_length:]


# ------------------------------------------------------------------------------------------------
# Row intervals from transformers' inputs
# ------------------------------------------------------------------------------------------------

def _segments(batch: int, seqlen: int, position_ids, cu_seqlens, device):
    """Per token ``[B, S]`` the first and last index of its document, from ``cu_seqlens`` (over the
    batch laid end to end) or from positions that do not follow the one before by 1."""
    i = torch.arange(seqlen, device=device)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        flat = torch.arange(batch * seqlen, device=device)
        doc = torch.searchsorted(cu, flat, right=True) - 1
        base = (flat // seqlen) * seqlen
        first = (cu[doc] - base).clamp(0, seqlen - 1).view(batch, seqlen)
        last = (cu[doc + 1] - 1 - base).clamp(0, seqlen - 1).view(batch, seqlen)
        return first, last
    pos = position_ids.to(device).expand(batch, seqlen)
    starts = torch.ones(batch, seqlen, dtype=torch.bool, device=device)
    starts[:, 1:] = (pos[:, 1:] - pos[:, :-1]) != 1
    first = torch.where(starts, i, torch.zeros_like(i)).cummax(-1).values
    ends = torch.ones_like(starts)
    ends[:, :-1] = starts[:, 1:]
    last = torch.where(ends, i, torch.full_like(i, seqlen - 1)).flip(-1).cummin(-1).values.flip(-1)
    return first, last


def row_intervals(batch: int, seqlen_q: int, seqlen_k: int, *, causal: bool = True, window: Optional[int] = None,
                  padding: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                  cu_seqlens: Optional[torch.Tensor] = None, device=None) -> torch.Tensor:
    """int64 ``[B * Sq, 2]``: for each query of the batch laid end to end the inclusive interval
    ``(lo, hi)`` of keys it attends (``hi < lo``: none), on ``B * Sk`` keys.

    Queries are the last ``Sq`` of ``Sk`` positions. ``causal``: keys up to the query's own position;
    ``window``: its last ``window`` keys only (causal); ``padding`` ``[B, Sk]`` bool (True = token): keys
    inside the sequence's run of tokens (one run per sequence); ``cu_seqlens`` (over the batch laid end
    to end) or ``position_ids`` ``[B or 1, S]`` (a position that does not follow the one before by 1
    starts a document): keys of the query's own document (with ``Sq == Sk``)."""
    device = device if device is not None else (padding.device if padding is not None else "cpu")
    p = torch.arange(seqlen_q, device=device) + (seqlen_k - seqlen_q)  # each query's key position
    lo = torch.zeros(batch, seqlen_q, dtype=torch.int64, device=device)
    hi = (p if causal else torch.full_like(p, seqlen_k - 1)).expand(batch, seqlen_q)
    if (cu_seqlens is not None or position_ids is not None) and seqlen_q == seqlen_k:
        first, last = _segments(batch, seqlen_q, position_ids, cu_seqlens, device)
        lo = torch.maximum(lo, first)
        hi = torch.minimum(hi, last)
    if window is not None:
        lo = torch.maximum(lo, p - (int(window) - 1))
    if padding is not None:
        tok = padding.to(device=device, dtype=torch.bool)
        first_tok = tok.int().argmax(-1, keepdim=True)
        last_tok = seqlen_k - 1 - tok.flip(-1).int().argmax(-1, keepdim=True)
        lo = torch.maximum(lo, first_tok)
        hi = torch.where(tok.any(-1, keepdim=True), torch.minimum(hi, last_tok), -1)
    offset = torch.arange(batch, device=device)[:, None] * seqlen_k
    return torch.stack((lo + offset, hi + offset), dim=-1).reshape(batch * seqlen_q, 2)


def _rows_of_4d(mask: torch.Tensor, batch: int, seqlen_q: int, seqlen_k: int):
    """``(rows, "")`` for a 4-D mask whose rows each allow one run of keys, else ``(None, reason)``."""
    if mask.dim() != 4 or mask.shape[-2:] != (seqlen_q, seqlen_k) or mask.shape[0] not in (1, batch):
        return None, f"a {mask.dim()}-D mask of shape {tuple(mask.shape)}"
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask == 0
        blocked = torch.isneginf(mask) | (mask <= torch.finfo(mask.dtype).min / 2)
        if not bool((allowed | blocked).all()):
            return None, "a float attention bias (values other than 0 and -inf)"
    else:
        return None, f"a {mask.dtype} attention mask"
    if allowed.shape[1] > 1 and not bool((allowed == allowed[:, :1]).all()):
        return None, "a 4-D mask that differs between heads"
    allowed = allowed[:, 0].expand(batch, seqlen_q, seqlen_k)
    count = allowed.sum(-1)
    first = allowed.int().argmax(-1)
    last = seqlen_k - 1 - allowed.flip(-1).int().argmax(-1)
    if bool(((count > 0) & (count != last - first + 1)).any()):
        return None, "a 4-D mask whose rows allow more than one run of keys"
    offset = torch.arange(batch, device=mask.device)[:, None] * seqlen_k
    rows = torch.stack((first + offset, torch.where(count > 0, last, -1) + offset), dim=-1)
    return rows.reshape(batch * seqlen_q, 2).to(torch.int64), ""


def _has_gaps(padding: torch.Tensor) -> bool:
    """Whether some sequence's tokens in a 2-D padding mask are not one run."""
    tok = padding.to(torch.bool)
    first = tok.int().argmax(-1)
    last = tok.shape[-1] - 1 - tok.flip(-1).int().argmax(-1)
    return bool((tok.any(-1) & (tok.sum(-1) != last - first + 1)).any())


# ------------------------------------------------------------------------------------------------
# The attention function
# ------------------------------------------------------------------------------------------------

class _LayerMemo:
    """The last few ``_rows_for`` answers, keyed by the very tensors they were built from: every layer
    of one forward gets the same rows tensor, so the op reads it to the host once, not once per layer."""

    def __init__(self, size: int = 8):
        self.size = size
        self._entries: list = []

    def get(self, sources: tuple, key: tuple, build):
        stamp = tuple(None if t is None else (id(t), _version(t)) for t in sources)
        for refs, old_stamp, old_key, value in self._entries:
            if old_key == key and old_stamp == stamp and all(r is None or r() is t for r, t in zip(refs, sources)):
                return value
        value = build()
        if all(t is None or stamp_t[1] is not None for t, stamp_t in zip(sources, stamp)):
            refs = tuple(None if t is None else weakref.ref(t) for t in sources)
            self._entries = [*self._entries[-(self.size - 1):], (refs, stamp, key, value)]
        return value


_MEMO = _LayerMemo()


def _rows_for(attention_mask, batch, seqlen_q, seqlen_k, causal, window, device, kwargs):
    """``(rows, "")``: the call's row intervals, or ``(None, reason)`` where its mask has none (built once
    per set of source tensors outside ``torch.compile``)."""
    args = (attention_mask, batch, seqlen_q, seqlen_k, causal, window, device, kwargs)
    if torch.compiler.is_compiling():
        return _build_rows(*args)
    sources = (attention_mask, kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"))
    return _MEMO.get(sources, (batch, seqlen_q, seqlen_k, causal, window, str(device)), lambda: _build_rows(*args))


def _build_rows(attention_mask, batch, seqlen_q, seqlen_k, causal, window, device, kwargs):
    if attention_mask is not None and attention_mask.dim() == 4:
        if torch.compiler.is_compiling():
            return None, "a prepared 4-D mask under torch.compile"
        return _rows_of_4d(attention_mask, batch, seqlen_q, seqlen_k)
    if attention_mask is not None and attention_mask.dim() != 2:
        return None, f"a {attention_mask.dim()}-D attention mask"
    if attention_mask is not None and not torch.compiler.is_compiling() and _has_gaps(attention_mask):
        return None, "a padding mask with gaps inside a sequence"
    # documents only without a padding mask, as transformers' FlashAttention path does
    cu = kwargs.get("cu_seq_lens_q") if attention_mask is None else None  # self-attention: the same as _k
    positions = kwargs.get("position_ids") if attention_mask is None else None
    return row_intervals(batch, seqlen_q, seqlen_k, causal=causal, window=window, padding=attention_mask,
                         position_ids=positions, cu_seqlens=cu, device=device), ""


def _kernel_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, backend: str) -> str:
    """Why ``backend`` cannot take these tensors (empty when it can)."""
    if key.shape[1] < 1 or query.shape[1] % key.shape[1]:
        return f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} key/value heads"
    if backend == "reference":
        return ""
    ok, why = runs_here(query.device.type)
    if not ok:
        return why
    dtypes = TritonBackend.dtypes + ((torch.float32,) if interpreting() else ())
    if query.dtype not in dtypes:
        return f"dtype {query.dtype} (our kernels take {', '.join(str(d).replace('torch.', '') for d in dtypes)})"
    return (public_head_dim_reason(query.shape[-1], "head dim")
            or public_head_dim_reason(value.shape[-1], "head dim of v"))


def _static_reason(query, key, value, dropout: float, causal: bool, window, backend: str, kwargs) -> str:
    """Why our kernels cannot run the call, from shapes, dtypes and arguments alone (empty when they can)."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        what = "logit softcapping" if kwargs.get("softcap") is not None else "attention sinks (s_aux)"
        raise ValueError(f"attn_implementation {NAME!r} does not take {what} (nor does SDPA); use 'eager'")
    if dropout:
        return "attention dropout (dropout > 0 while training)"
    if kwargs.get("position_bias") is not None:
        return "an additive position bias"
    if window is not None and not causal:
        return "a bidirectional sliding window"
    if query.shape[2] > key.shape[2]:
        return f"more queries ({query.shape[2]}) than keys ({key.shape[2]})"
    return _kernel_reason(query, key, value, backend)


def _log_once(reason: str) -> None:
    if reason not in _LOGGED and not torch.compiler.is_compiling():
        _LOGGED.add(reason)
        logger.warning("longca_triton attention falls back to SDPA: %s", reason)


def _sdpa_mask(rows, attention_mask, batch, seqlen_q, seqlen_k, causal, window, device):
    """A boolean ``[B, 1, Sq, Sk]`` mask for SDPA: from the row intervals, else the 4-D mask as given,
    else from the padding mask (rows that attend nothing attend every key, so SDPA gives no NaN)."""
    if rows is None and attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    j = torch.arange(seqlen_k, device=device)
    if rows is not None:
        local = rows.view(batch, seqlen_q, 2) - (torch.arange(batch, device=device) * seqlen_k)[:, None, None]
        allowed = (j >= local[..., :1]) & (j <= local[..., 1:])
    else:
        p = (torch.arange(seqlen_q, device=device) + (seqlen_k - seqlen_q))[:, None]
        allowed = attention_mask.to(device=device, dtype=torch.bool)[:, None, :].expand(batch, seqlen_q, seqlen_k)
        allowed = allowed & (j <= p) if causal else allowed
        allowed = allowed & (j > p - window) if window is not None else allowed
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    return allowed[:, None]


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                      sliding_window: Optional[int] = None, *, backend: Optional[str] = None, **kwargs):
    """transformers' attention-function contract: ``query [B, H, Sq, D]``, ``key`` / ``value [B, Hkv,
    Sk, D]``, ``attention_mask`` as ``padding_mask`` returns it (or a 4-D mask the caller prepared);
    returns ``(attn_output [B, Sq, H, D_v], None)``. The module docstring lists what runs on our
    kernels and what falls back to SDPA."""
    backend = backend or "default"
    batch, heads, seqlen_q, head_dim = query.shape
    seqlen_k = key.shape[2]
    is_causal = kwargs.pop("is_causal", None)
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    window = None if window is None or window >= seqlen_k else int(window)
    reason = _static_reason(query, key, value, dropout, causal, window, backend, kwargs)
    rows, mask_reason = _rows_for(attention_mask, batch, seqlen_q, seqlen_k, causal, window, query.device, kwargs)
    reason = reason or mask_reason
    if reason:
        _log_once(reason)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        mask = _sdpa_mask(rows, attention_mask, batch, seqlen_q, seqlen_k, causal, window, query.device)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    q = query.transpose(1, 2).reshape(1, batch * seqlen_q, heads, head_dim)
    k = key.transpose(1, 2).reshape(1, batch * seqlen_k, key.shape[1], head_dim)
    v = value.transpose(1, 2).reshape(1, batch * seqlen_k, value.shape[1], value.shape[-1])
    out = compiled_attention(q, k, v, rows, softmax_scale=scaling, backend=backend)
    return out.view(batch, seqlen_q, heads, value.shape[-1]), None

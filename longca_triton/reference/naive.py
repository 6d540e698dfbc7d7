"""The naive reference: materialise the scores, mask them, softmax, multiply.

    S = scale · Q Kᵀ            [B, Hq, Sq, Sk]   (masked-out pairs set to -inf)
    lse = logsumexp_j S          [B, Hq, Sq]       (-inf for a fully masked row)
    O = exp(S - lse) V           [B, Hq, Sq, D_v]  (zeros for a fully masked row)

Plain PyTorch ops, so autograd gives the gradients. Run it in float32 or float64; memory is
``O(B · H · Sq · Sk)``, so it is for checking, not for long sequences (see ``chunked.py``).
GQA: query head ``h`` reads KV head ``h // (Hq / Hkv)``. ``v`` may have its own head dim ``D_v``
(q and k share ``D_qk``, which sets the default scale ``1/sqrt(D_qk)``). Block-sparse masks: head ``h`` uses pattern
``mask.pattern_of_head(Hq)[h]``.
"""

from __future__ import annotations

import math

import torch

from longca_triton.masks import BlockSparseMask, Mask


def dense_head_mask(mask: Mask, num_heads_q: int, device) -> torch.Tensor:
    """bool ``[Hq or 1, Sq, Sk]`` mask, one slice per query head for block-sparse masks."""
    dense = mask.to_dense().to(device)
    if isinstance(mask, BlockSparseMask):
        return dense[torch.as_tensor(mask.pattern_of_head(num_heads_q), device=device)]
    return dense[None]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, softmax_scale: float | None = None, return_lse: bool = False):
    """``q [B, Sq, Hq, D_qk]``, ``k [B, Sk, Hkv, D_qk]``, ``v [B, Sk, Hkv, D_v]`` -> ``out [B, Sq, Hq, D_v]``
    (and ``lse [B, Hq, Sq]``)."""
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    group = Hq // Hkv
    qh = q.transpose(1, 2)  # [B, Hq, Sq, D]
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)  # [B, Hq, Sk, D]
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # [B, Hq, Sq, Sk]
    allowed = dense_head_mask(mask, Hq, q.device)[None]  # [1, Hq or 1, Sq, Sk]
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, Sq]
    # a fully masked row has lse = -inf; subtracting 0 instead keeps exp(-inf) = 0 and no NaN
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(scores - safe_lse[..., None])
    out = torch.matmul(p, vh).transpose(1, 2)  # [B, Sq, Hq, D_v]
    return (out, lse) if return_lse else out

r"""Step 0 — the formula, in PyTorch, with the scores materialised.

What it is
----------
Attention exactly as written on the blackboard, for query head ``h`` (KV head ``h // G``)::

    S = scale · Q Kᵀ                 [Sq, Sk]   every score, stored in memory
    S[i, j] = -inf where not allowed(i, j)
    P = softmax(S, dim=-1)           [Sq, Sk]   stored again
    O = P V                          [Sq, D]

Four library calls (matmul, masked_fill, softmax, matmul), each a separate kernel that reads and
writes an ``Sq x Sk`` tensor in global memory. The mask is a dense ``Sq x Sk`` boolean (built once
per mask on the device from the IR's row intervals).

Why it is slow
--------------
The matmuls run on tensor cores at full speed, but between them the ``S x S`` scores make several
round trips through HBM: at ``S = 16K`` one head's scores are 16K² x 2 bytes = 512 MiB, and every
elementwise pass (scale, mask, max, exp, sum, divide) streams them. The work is memory-bound and
the memory is ``O(S²)`` per head: 64 heads at 16K would need 32 GiB for one copy of the scores.
So this step processes a few heads at a time (``MEMORY_BUDGET``): still the naive algorithm,
just not all heads at once. Masked-out pairs are computed and thrown away.

Rows that allow nothing would give ``softmax([-inf, ...]) = NaN``; they are set to zero, which is
the convention of every kernel here.

Measured (H100, causal, S=16K)
------------------------------
22.7 TFLOP/s (194.1 ms): the ladder's baseline, 4% of sdpa-cudnn (589.2 TFLOP/s in the same
run); peak 4,368 MiB above the inputs with two heads per chunk. TFLOP/s count allowed pairs only,
so the masked upper triangle that this step computes and throws away already halves the figure.
(B=1, Hq:Hkv=64:8, D=128, bf16; H100 80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0;
``experiments/results/h100/ladder/ladder.md``, chart ``ladder_fwd.png`` next to it.)
"""

from __future__ import annotations

import torch

from ._common import check_shapes, dense_mask_on, softmax_scale_or_default

#: bytes of ``Sq x Sk`` intermediates one chunk of query heads may hold
MEMORY_BUDGET = 6 << 30


def _bytes_per_head(batch: int, seqlen_q: int, seqlen_k: int) -> int:
    return 3 * batch * seqlen_q * seqlen_k * 4  # scores, masked scores, probabilities (<= fp32)


def limit(batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int, head_dim: int) -> str | None:
    """Why this step cannot run at this size (``None`` when it can)."""
    need = _bytes_per_head(batch, seqlen_q, seqlen_k)
    if need > 4 * MEMORY_BUDGET:
        return f"O(S²) memory: one head's scores need {need / 2**30:.0f} GiB"
    return None


def forward(q, k, v, mask, softmax_scale=None):
    """``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``, a ``RangeMask`` -> ``out [B, Sq, Hq, D]``."""
    check_shapes(q, k, v, mask)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = softmax_scale_or_default(softmax_scale, D)
    allowed = dense_mask_on(mask, q.device)  # [Sq, Sk]
    out = torch.empty_like(q)
    step = max(1, MEMORY_BUDGET // _bytes_per_head(B, Sq, Sk))  # query heads per chunk
    for h0 in range(0, Hq, step):
        h1 = min(Hq, h0 + step)
        kv = torch.arange(h0, h1, device=q.device) // G  # GQA: KV head of each query head
        qh = q[:, :, h0:h1].transpose(1, 2)  # [B, h, Sq, D]
        kh = k.index_select(2, kv).transpose(1, 2)  # [B, h, Sk, D]
        vh = v.index_select(2, kv).transpose(1, 2)
        s = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # [B, h, Sq, Sk]
        s = s.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(s, dim=-1)  # [B, h, Sq, Sk]
        # why: a row that allows nothing is all -inf, and softmax of it is 0/0 = NaN
        p = p.nan_to_num(0.0)
        out[:, :, h0:h1] = torch.matmul(p, vh).transpose(1, 2)
    return out

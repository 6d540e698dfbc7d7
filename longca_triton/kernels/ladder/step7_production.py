r"""Step 7 — the production kernel: ``longca_triton.kernels.dense.op.dense_attention`` itself.

This step is not a copy. It imports and calls the kernel behind the ``triton`` backend
(``longca_triton/kernels/dense/op.py``, ``dense_fwd.py``, ``dense_tables.py``), with the launch config the
``triton`` backend would use (the autotune cache's entry for this problem class, else the
kernel's defaults), so its row in the ladder is the production number.

What it does beyond step 6
--------------------------
* **Runs instead of tile lists.** ``dense_tables.py`` turns each CSR list of key tiles into
  contiguous runs ``[start, end)`` (causal: one run per query tile). A loop over a run has an
  affine address, so the pipeliner prefetches without an indirect index load.
* **Heaviest tiles first.** Query tiles are launched in order of decreasing work (longest-
  processing-time-first), so the long rows of causal or document masks do not leave a tail of
  one busy SM at the end of the grid.
* **GQA by launch order, not packing.** One program per (query tile, query head), with the head
  the fastest-varying grid index: the ``G`` heads of a group run at the same time and read the
  same K/V tiles from L2. Step 5 packed the group into one tile instead; on this problem the two
  tie (step 5 measured 1.00x step 4), and one head per tile keeps Q and O rectangular for TMA.
* **TMA everywhere**: Q and O go through tensor descriptors too (possible because a tile is one
  head's rectangle again), and it returns the log-sum-exp that the backward needs.
* **Tuned configs**: ``BLOCK_M/BLOCK_N/num_warps/num_stages`` from ``longca-triton autotune``.

Measured (H100, causal, S=16K)
------------------------------
492.9 TFLOP/s (8.92 ms): 1.07× step 6, 84% of sdpa-cudnn (589.2 TFLOP/s in the same run); peak
264 MiB above the inputs (the output plus the fp32 lse and the run tables). ``longca_triton/kernels/dense/op.py``'s
docstring says where most of the remaining gap to cuDNN goes on sm_90 with Triton 3.6.
(B=1, Hq:Hkv=64:8, D=128, bf16; H100 80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0;
``experiments/results/h100/ladder/ladder.md``, chart ``ladder_fwd.png`` next to it.)
"""

from __future__ import annotations

from longca_triton.kernels.dense.op import dense_attention


def production_config(q, k, mask, backend: str = "triton"):
    """The config ``backend`` would pick (its autotune cache entry), or ``None`` for defaults."""
    try:
        from longca_triton.kernels.core.tuned import lookup

        return lookup(backend, q, k, mask)
    except Exception:  # no cache, or an unreadable one: the kernel's defaults
        return None


def forward(q, k, v, mask, softmax_scale=None):
    """``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``, a ``RangeMask`` -> ``out [B, Sq, Hq, D]``."""
    return dense_attention(q, k, v, mask, softmax_scale=softmax_scale, config=production_config(q, k, mask))

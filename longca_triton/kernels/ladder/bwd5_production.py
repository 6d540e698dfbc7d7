r"""Backward step 5 — the production backward: ``dense_attention``'s autograd, not a copy.

The forward runs once, outside the timed region, through
``longca_triton.kernels.dense.op.dense_attention`` (with the config the ``triton`` backend would use);
the timed call is ``torch.autograd.grad(out, (q, k, v), dO)``, i.e. exactly the backward a
training step runs: ``kernels/dense/bwd.py``'s three launches.

What it does beyond backward step 4
-----------------------------------
* **TMA tensor descriptors** for every tile load and store (zero-filled edges, no bounds masks).
* **Software pipelining**: its launch configs use ``num_stages > 1`` (tuned by
  ``longca-triton autotune`` when a cache entry exists), where steps 2–4 use one stage.
* **Runs instead of tile lists** and **heaviest tiles first**, as in forward step 7.
* **A row-major sweep of the GQA group** in the dK/dV program on masks whose programs have
  unequal work (causal): per query tile every head of the group, tiles descending, on a 64x64
  tile (the ``uneven`` row of ``kernels/tuning/dense.toml``).
* The same structure as step 4 otherwise: ``delta`` preprocess, key-major dK/dV looping over the
  ``G`` heads of its group (no atomics, no partial buffers), query-major dQ. It also accepts a
  gradient on ``lse`` (``delta -= dlse``), which context parallelism needs.

Measured (H100, causal, S=16K)
------------------------------
397.8 TFLOP/s (27.6 ms): 1.36× bwd4, 75% of sdpa-cudnn (529.8 TFLOP/s in the same run); peak
333 MiB above the inputs. With default configs its tiles are bwd4's (``_common.tile_config``
takes the production defaults: dK/dV 32 x 64, dQ 128 x 64), so the gain is the list above:
TMA, 3-stage pipelining, runs and heavy-first order.
(B=1, Hq:Hkv=64:8, D=128, bf16; H100 80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0;
``experiments/results/h100/ladder/ladder.md``, chart ``ladder_bwd.png`` next to it.)
With the row-major sweep (``experiments/results/h100/ladder/bwd-row-major/``): 426.6
TFLOP/s (25.77 ms), 1.45x bwd4 (293.7 in that run), 79 % of sdpa-cudnn (537.9).
"""

from __future__ import annotations

import torch

from longca_triton.kernels.dense.op import dense_attention

from .step7_production import production_config


def prepare_backward(q, k, v, mask, out=None, lse=None, softmax_scale=None):
    """Run the production forward with autograd on and return ``fn(dout) -> (dq, dk, dv)``.

    ``out`` and ``lse`` are accepted for the common signature and not used: autograd needs the
    graph of its own forward (same kernel, so the same values).
    """
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        o = dense_attention(*leaves, mask, softmax_scale=softmax_scale,
                            config=production_config(q, k, mask))

    def run(dout):
        return torch.autograd.grad(o, leaves, dout, retain_graph=True)

    return run


def backward(q, k, v, mask, out, lse, dout, softmax_scale=None):
    """-> ``dq [B, Sq, Hq, D], dk, dv [B, Sk, Hkv, D]`` through the production kernels."""
    return prepare_backward(q, k, v, mask, out, lse, softmax_scale)(dout)

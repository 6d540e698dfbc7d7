"""FlashAttention's test matrix (``tests/flash_matrix.py``) over every attention kernel of ours.

On a GPU (``-m gpu``): every (head dim, (Sq, Sk), mask kind) of the matrix, each through ``triton``,
``triton-flashmask``, ``triton-gluon`` and the default backend (``lt.attention`` with none named),
against one float32 reference and one PyTorch low-precision run per case. ``LONGCA_MATRIX_LOG=path``
appends one JSON line per (case, backend) with every error and bound; ``LONGCA_MATRIX_HEAD_DIMS=96,128``
runs those head dims only.

On a CPU the interpreter runs ``triton`` over the same axes at small sizes (batch 1, 4 query heads): the head dims up to 128,
lengths under 260 with the same shapes of mismatch (Sq = 1, Sq < Sk, Sq > Sk, off by one), every mask
kind with every length pair, float16.
"""

import json
import os

import pytest
import torch
from flash_matrix import HEAD_DIMS, MASK_KINDS, SEQLENS, Case, compare, draw_case, failures, grads, inputs, references
from utils import DEVICE, needs_triton

import longca_triton as lt

GPU_BACKENDS = ("triton", "triton-flashmask", "triton-gluon", None)

CPU_HEAD_DIMS = tuple(d for d in HEAD_DIMS if d <= 128)
CPU_SEQLENS = ((1, 239), (3, 199), (127, 256), (127, 257), (113, 203), (128, 217), (113, 211), (108, 256),
               (256, 128), (240, 64), (255, 256), (256, 255))
#: each length pair with each mask kind once, the head dims cycling through them
CPU_CASES = [(CPU_HEAD_DIMS[i % len(CPU_HEAD_DIMS)], *CPU_SEQLENS[i % len(CPU_SEQLENS)],
              MASK_KINDS[i // len(CPU_SEQLENS)]) for i in range(len(CPU_SEQLENS) * len(MASK_KINDS))]


def run_backend(backend, case, q, k, v, dout):
    mask = case.mask()
    return grads(lambda q, k, v: lt.attention(q, k, v, mask, backend=backend, return_lse=True), q, k, v, dout)


def _log(case, backend, result):
    path = os.environ.get("LONGCA_MATRIX_LOG")
    if path:
        line = json.dumps({"case": case.id, "backend": backend or "default", "ok": all(r["ok"] for r in result.values()),
                           **{n: {k: (None if v == float("inf") else v) for k, v in r.items()} for n, r in result.items()}})
        with open(path, "a") as f:
            f.write(line + "\n")


@needs_triton
@pytest.mark.parametrize("d,sq,sk,kind", CPU_CASES, ids=lambda x: str(x))
def test_matrix_triton_interpreter(d, sq, sk, kind):
    case = draw_case(d, sq, sk, kind, dtypes=(torch.float16,), batch=1, small_heads=True)
    q, k, v, dout = inputs(case, DEVICE)
    ref, low = references(case, q, k, v, dout)
    result = compare(run_backend("triton", case, q, k, v, dout), ref, low)
    assert not failures(result), (case.id, failures(result))


def _gpu_params():
    # LONGCA_MATRIX_HEAD_DIMS=96,128 runs those head dims only (a rerun of part of the matrix)
    only = os.environ.get("LONGCA_MATRIX_HEAD_DIMS")
    for d in HEAD_DIMS if not only else [int(x) for x in only.split(",")]:
        for sq, sk in SEQLENS:
            for kind in MASK_KINDS:
                case = draw_case(d, sq, sk, kind)
                yield pytest.param(case, id=case.id, marks=pytest.mark.xdist_group(f"D={d}-{kind}"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(_gpu_params()))
def test_matrix_gpu(case):
    q, k, v, dout = inputs(case, "cuda")
    ref, low = references(case, q, k, v, dout)
    bad = {}
    for backend in GPU_BACKENDS:
        try:
            result = compare(run_backend(backend, case, q, k, v, dout), ref, low)
        except Exception as e:  # noqa: BLE001 - an internal error is a failure of that backend, reported with the rest
            bad[backend or "default"] = [f"{type(e).__name__}: {e}"]
            _log(case, backend, {})
            continue
        _log(case, backend, result)
        if failures(result):
            bad[backend or "default"] = failures(result)
    assert not bad, bad


@pytest.mark.gpu
def test_gluon_sq1_window_gqa_dq():
    """A single query row under a window that leaves both key tiles partial, GQA 6:2, D = 128, bf16:
    the Gluon dQ once came out wrong here (max error 0.297 against PyTorch's 0.0039)."""
    case = Case(128, 1, 239, "local", "gqa", torch.bfloat16, (157, 145))
    q, k, v, dout = inputs(case, "cuda")
    ref, low = references(case, q, k, v, dout)
    result = compare(run_backend("triton-gluon", case, q, k, v, dout), ref, low)
    assert not failures(result), failures(result)


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk,layout", [(1024, 1023, "mqa"), (113, 211, "gqa"), (127, 513, "mha")],
                         ids=lambda x: str(x))
def test_gluon_full_mask_unequal_lengths(sq, sk, layout):
    """A full mask with Sq != Sk at D = 128 once raised an internal error in the Gluon dQ plan."""
    case = Case(128, sq, sk, "full", layout, torch.bfloat16, (-1, -1))
    q, k, v, dout = inputs(case, "cuda")
    ref, low = references(case, q, k, v, dout)
    result = compare(run_backend("triton-gluon", case, q, k, v, dout), ref, low)
    assert not failures(result), failures(result)


#: every multiple of 8 the kernels tile (other dims arrive padded to one), and pairs with D_v != D_qk
GLUON_DIM_PAIRS = [(d, d) for d in range(8, 257, 8)] + [(192, 128), (128, 64), (64, 128), (96, 64), (256, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", GLUON_DIM_PAIRS, ids=lambda x: str(x))
def test_gluon_kernel_every_head_dim(d, dv):
    """The Gluon kernels themselves (no fallback) at every head-dim pair, on a windowed causal mask
    with Sq != Sk and GQA, against the matrix's bar: what ``GPU_CHECKED_HEAD_DIMS`` is read from."""
    from longca_triton.kernels.gluon.op import gluon_attention

    case = Case(d, 300, 517, "local_causal", "gqa", torch.bfloat16, (200, 0))
    q, k, v, dout = inputs(case, "cuda")
    v = torch.randn(*v.shape[:3], dv, device="cuda", dtype=v.dtype)
    dout = torch.randn(*dout.shape[:3], dv, device="cuda", dtype=dout.dtype)
    ref, low = references(case, q, k, v, dout)
    mask = case.mask()
    result = compare(grads(lambda q, k, v: gluon_attention(q, k, v, mask, return_lse=True), q, k, v, dout), ref, low)
    _log(case, f"gluon-kernel-{d}/{dv}", result)
    assert not failures(result), failures(result)

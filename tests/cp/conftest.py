"""Fixtures of the CP tests: gloo ranks spawned on the CPU, and the skip for Triton step kernels."""

import json
import os

import pytest
import torch


@pytest.fixture
def spawn_ranks(tmp_path):
    """``run(worker, world)``: ``worker(rank, world, outdir)`` on ``world`` gloo processes, then the
    rows every rank wrote to ``outdir/rank<k>.json``, rank 0's first."""
    from longca_triton.cp.check import spawn

    def run(worker, world):
        spawn(worker, world, str(tmp_path))
        return [r for k in range(world) for r in json.loads((tmp_path / f"rank{k}.json").read_text())]

    return run


@pytest.fixture
def triton_runs():
    """Skip a test whose step kernel is our Triton one where it cannot run (no GPU, no interpreter)."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or the Triton interpreter")

"""Test configuration: Triton kernels run through the interpreter on CPU machines.

TRITON_INTERPRET must be set before anything imports triton, so it is set here, at collection.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the shared helpers (utils.py, mask_definitions.py) sit here, beside the unit folders
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def autotune_cache(tmp_path, monkeypatch):
    """The user's autotune cache pointed at a fresh file of this test (its path)."""
    from longca_triton.kernels.core import tuned

    path = tmp_path / "autotune.json"
    monkeypatch.setenv(tuned.CACHE_ENV, str(path))
    tuned.reload()
    yield path
    tuned.reload()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

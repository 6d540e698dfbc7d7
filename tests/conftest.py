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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

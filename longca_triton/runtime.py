"""Where kernels will run: a CUDA GPU, or the Triton interpreter on a CPU-only machine.

Nothing probes hardware at import time; commands call ``select_device()`` when they start.
"""

from __future__ import annotations

import os
import sys

import torch


def select_device(device: str | None = None) -> tuple[str, bool]:
    """``(device, interpreted)``. Without a GPU, switch Triton to its interpreter (before triton is
    imported, which is the only time the switch takes effect) and say so."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        return device, False
    if "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return device, os.environ.get("TRITON_INTERPRET") == "1"


INTERPRETER_BANNER = (
    "No CUDA GPU here: running a small case through the Triton interpreter on the CPU. "
    "This checks correctness only; its timings say nothing about GPU speed."
)

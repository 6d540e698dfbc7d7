"""Backend registry (see ``base.py``). Adapters register themselves when their module is imported;
importing an adapter never imports its vendor package (that happens in ``available()``)."""

from __future__ import annotations

import importlib

from .base import ALIASES, BACKENDS, Backend, Problem, Unsupported, canonical_name, get_backend, list_backends, register

__all__ = ["ALIASES", "BACKENDS", "Backend", "Problem", "Unsupported", "canonical_name", "get_backend", "list_backends",
           "register"]

#: adapter modules, imported on first use of the registry
ADAPTER_MODULES = ["reference", "triton_dense", "sdpa", "varlen", "flex", "cudnn", "flash", "te", "flashmask", "triton_flashmask", "triton_sparse", "triton_gluon", "vsa",
                  "flashinfer"]

_loaded = False


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in ADAPTER_MODULES:
        importlib.import_module(f"{__name__}.{mod}")

"""Backend registry (see ``base.py``). Adapters register themselves when their module is imported;
importing an adapter never imports its vendor package (that happens in ``available()``)."""

from __future__ import annotations

from .base import (ADAPTER_MODULES, ALIASES, BACKENDS, Backend, Problem, Unsupported, canonical_name, get_backend,
                   list_backends, register)

__all__ = ["ADAPTER_MODULES", "ALIASES", "BACKENDS", "Backend", "Problem", "Unsupported", "canonical_name",
           "get_backend", "list_backends", "register"]

"""The benchmark harness: experiment grids, timing, correctness checks, the results store,
plots and reports (see ``runner.py`` for the sweep, ``store.py`` for the row format)."""

from .config import ConfigError, Experiment, load_experiment, parse_heads, parse_seqlen
from .store import ResultStore, collect_env, params_digest, row_key, status_kind
from .timing import peak_memory, time_fn

__all__ = [
    "ConfigError",
    "Experiment",
    "ResultStore",
    "collect_env",
    "load_experiment",
    "params_digest",
    "parse_heads",
    "parse_seqlen",
    "peak_memory",
    "row_key",
    "status_kind",
    "time_fn",
]

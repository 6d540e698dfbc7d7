"""The user's autotune cache: tuning-table rows the kernels read before the shipped tables.

``longca-triton autotune`` (``longca_triton.bench.autotune``, the search) writes the cache; the kernels'
``resolve_config`` reads it through :func:`lookup`, and a config found there wins over the shipped
table (``kernels/tuning``). The file is read once per process (and again only after :func:`reload`,
which the tuner calls after writing), so a launch never stats the file. No hardware is probed at
import; :func:`device_key` asks the GPU's name once per device.

The file (``$LONGCA_TRITON_AUTOTUNE_CACHE``, default ``~/.cache/longca-triton/autotune.json``) is JSON,
one section per device and kernel, each holding rows in the shipped tables' format
(:func:`longca_triton.kernels.tuning.parse_rows`)::

    {"format": 2,
     "sections": [{"device": "NVIDIA H100 80GB HBM3|triton-3.6.0", "kernel": "triton",
                   "rows": [{"match": {"head_dim": 128, "head_dim_v": 128, "dtype": "bfloat16",
                                       "group": [8, 9], "mask": "masked", "seqlen": [4097, 16385],
                                       "block": 64},
                             "mode": "fwd_bwd", "config": {...the full tuned config...},
                             "results": "autotune run of 2025-06-01T12:00:00 into /home/me/.cache/...",
                             "note": "TFLOP/s tuned vs default: fwd 512.3 vs 480.1; ...",
                             "measured": {"tflops": {"fwd": {"default": 480.1, "tuned": 512.3}},
                                          "cases": [...], "search": {...}, "default": {...},
                                          "vendors": {...}}}]}]}

A row's ``match`` is its *problem class*: exact head dims, dtype, GQA group, mask class
(:func:`mask_class`), sequence bucket (:data:`SEQ_BUCKETS` as a ``seqlen`` range) and the block it
was tuned at. A file without ``"format": 2`` (the older keyed layout) is read as no entry, with
one logged warning saying to rerun ``longca-triton autotune --force``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import torch

from longca_triton.kernels.tuning import Problem, Row, parse_rows
from longca_triton.masks import BlockSparseMask, Mask

__all__ = [
    "CACHE_ENV", "CACHE_FORMAT", "SEQ_BUCKETS", "cache_path", "device_key", "mask_class", "seq_bucket",
    "sparse_block", "problem_class", "class_match", "load_cache", "device_rows", "save_row", "reload", "lookup",
    "best_row", "row_score", "uniform_pow2", "measured_tflops",
]

CACHE_ENV = "LONGCA_TRITON_AUTOTUNE_CACHE"
#: the cache file's layout version (rows in the shipped tables' format)
CACHE_FORMAT = 2
_log = logging.getLogger(__name__)


def cache_path() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "longca-triton" / "autotune.json"


def device_key(device: torch.device | str) -> str:
    """``GPU name|triton-<version>`` (asked once per device and process)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _device_key(str(device))


@functools.lru_cache(maxsize=None)
def _device_key(device: str) -> str:
    import triton

    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu-interpreter"
    return f"{name}|triton-{triton.__version__}"


def uniform_pow2(mask: BlockSparseMask) -> int | None:
    """The uniform block when it is a power of two >= 16 (what triton-sparse takes), else None."""
    ub = mask.uniform_block
    return int(ub) if ub and ub >= 16 and ub & (ub - 1) == 0 else None


def mask_class(mask: Mask) -> str:
    if isinstance(mask, BlockSparseMask):
        return "uniform-sparse" if uniform_pow2(mask) else "varblock-sparse"
    return "full" if mask.area == mask.seqlen_q * mask.seqlen_k else "masked"


def uneven_key_work(mask: Mask, block_n: int = 64, tol: float = 0.25) -> float:
    """The share of a range mask's non-empty key tiles (``block_n`` keys) whose attended area differs
    from the median tile's by more than ``tol`` of it: 0 for full and sliding windows (every dK/dV
    program sweeps as many query rows), 0.75 for causal, 0.9 for the document masks; from the
    mask's (cached) ``key_tile_areas``. 0.0 for block-sparse masks (their tiles are the blocks)."""
    if isinstance(mask, BlockSparseMask):
        return 0.0
    work = mask.key_tile_areas(block_n)
    work = work[work > 0]
    if work.size == 0:
        return 0.0
    med = float(np.median(work))
    return float(np.mean(np.abs(work - med) > tol * med))


SEQ_BUCKETS = ("S<=4K", "S<=16K", "S<=64K", "S>64K")
#: each bucket as a row's ``seqlen`` range (inclusive lo, exclusive hi)
_BUCKET_RANGES = ([1, 4097], [4097, 16385], [16385, 65537], [65537])


def seq_bucket(seqlen: int) -> str:
    for limit in (4096, 16384, 65536):
        if seqlen <= limit:
            return f"S<={limit // 1024}K"
    return "S>64K"


def sparse_block(mask: Mask) -> int | None:
    """The block a block-sparse mask is tuned under: its uniform block, or for variable blocks the
    power of two nearest (in log scale) to its mean query block. None for range masks."""
    if not isinstance(mask, BlockSparseMask):
        return None
    if uniform_pow2(mask):
        return uniform_pow2(mask)
    mean = mask.seqlen_q / max(1, len(mask.q_block_bounds) - 1)
    return 1 << max(0, round(math.log2(max(mean, 1.0))))


def problem_class(kernel: str, head_dim: int, dtype: torch.dtype, group: int, mask: Mask, block: int,
                  head_dim_v: int | None = None) -> str:
    """``kernel|D|dtype|G|mask class|S bucket|block``. For block-sparse masks ``block`` is the
    mask's own (``sparse_block``): a config is only ever looked up for the block it was tuned at.
    ``D`` is ``head_dim``, or ``head_dim/head_dim_v`` when the value head dim differs."""
    from longca_triton.kernels.core.runtime import head_dim_label

    dt = str(dtype).replace("torch.", "")
    block = sparse_block(mask) or block
    d = head_dim_label(head_dim, head_dim_v)
    return f"{kernel}|D={d}|{dt}|G={group}|{mask_class(mask)}|{seq_bucket(mask.seqlen_q)}|block={block}"


def class_match(head_dim: int, dtype: torch.dtype, group: int, mask: Mask, block: int,
                head_dim_v: int | None = None) -> dict:
    """A cache row's ``match``: the problem class of (head dims, dtype, group, mask, block), the
    block being the mask's own for block-sparse masks (``sparse_block``)."""
    return dict(head_dim=int(head_dim), head_dim_v=int(head_dim_v or head_dim), dtype=str(dtype).replace("torch.", ""),
                group=[int(group), int(group) + 1], mask=mask_class(mask),
                seqlen=list(_BUCKET_RANGES[SEQ_BUCKETS.index(seq_bucket(mask.seqlen_q))]),
                block=int(sparse_block(mask) or block))


def _call_problem(head_dim: int, dtype: torch.dtype, group: int, mask: Mask, head_dim_v: int | None) -> Problem:
    return Problem(head_dim=int(head_dim), head_dim_v=int(head_dim_v or head_dim),
                   dtype=str(dtype).replace("torch.", ""), group=int(group), mask=mask_class(mask),
                   seqlen=int(mask.seqlen_q), block=sparse_block(mask))


_LOADED: dict[str, dict] = {}


def _read_sections(path: Path) -> list:
    """The file's sections (``[]`` when missing; when unreadable or of another format, with one
    logged warning)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, json.JSONDecodeError) as e:
        _log.warning("autotune cache %s is unreadable (%s); its entries are ignored: rerun "
                     "`longca-triton autotune --force` to rebuild it", path, e)
        return []
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
        _log.warning("autotune cache %s is in an older format (not {\"format\": %d, \"sections\": [...]}); its "
                     "entries are ignored: rerun `longca-triton autotune --force` to rebuild it", path, CACHE_FORMAT)
        return []
    return [s for s in data.get("sections", []) if isinstance(s, dict)]


def load_cache(path: Path | None = None) -> dict:
    """``{(device key, kernel): (Row, ...)}`` of the cache file, read once per process and path; a
    section whose rows do not parse is left out with a logged warning."""
    path = Path(path or cache_path())
    key = str(path)
    if key not in _LOADED:
        out = {}
        for sec in _read_sections(path):
            where = f"{path} [{sec.get('device')} / {sec.get('kernel')}]"
            try:
                out[(str(sec["device"]), str(sec["kernel"]))] = parse_rows(sec.get("rows", []), str(sec["kernel"]),
                                                                           where)
            except (KeyError, TypeError, ValueError) as e:
                _log.warning("autotune cache %s: section left out (%s); rerun `longca-triton autotune --force`", where, e)
        _LOADED[key] = out
    return _LOADED[key]


def device_rows(device: str, kernel: str, path: Path | None = None) -> tuple:
    """The cache's rows of ``kernel`` on the device keyed ``device`` (``device_key``)."""
    return load_cache(path).get((device, kernel), ())


#: bumped whenever what was read is forgotten, so that configs memoised from the cache are too
_GENERATION = [0]


def generation() -> tuple:
    """What a config memoised from the cache depends on: how often what was read has been forgotten
    since the process started, and the variables that name the cache file (cheaper than the path)."""
    return _GENERATION[0], os.environ.get(CACHE_ENV), os.environ.get("XDG_CACHE_HOME")


def reload(path: Path | None = None) -> None:
    """Forget what was read (the tuner calls this after writing; tests after pointing elsewhere)."""
    _GENERATION[0] += 1
    if path is None:
        _LOADED.clear()
    else:
        _LOADED.pop(str(path), None)


def save_row(device: str, kernel: str, row: Row, path: Path | None = None) -> None:
    """Put ``row`` in the cache file, in place of the row of the same ``match`` in its section.

    Sections of an older format are dropped (their entries were already ignored)."""
    path = Path(path or cache_path())
    sections = _read_sections(path)
    sec = next((s for s in sections if s.get("device") == device and s.get("kernel") == kernel), None)
    if sec is None:
        sec = dict(device=device, kernel=kernel, rows=[])
        sections.append(sec)
    sec["rows"] = [r for r in sec.get("rows", []) if r.get("match") != row.match] + [dataclasses.asdict(row)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(format=CACHE_FORMAT, sections=sections), indent=1, sort_keys=True))
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    reload(path)


def row_score(row: Row) -> float:
    """The geometric mean over modes of the TFLOP/s a row's tuned config measured (0 when none)."""
    tf = [v.get("tuned", 0.0) for v in row.measured.get("tflops", {}).values()]
    tf = [float(x) for x in tf if isinstance(x, (int, float)) and x > 0]
    return math.exp(sum(math.log(x) for x in tf) / len(tf)) if tf else 0.0


def best_row(rows, head_dim: int, dtype: torch.dtype, group: int, mask: Mask,
             head_dim_v: int | None = None) -> Row | None:
    """The row whose config ``lookup`` returns among one kernel's rows on one device, or None.

    Range masks: the best-scoring row over the tuned blocks. Block-sparse masks: a row tuned at the
    mask's own block only (``sparse_block``), at its sequence bucket or else at the nearest tuned one
    (the longer on a tie): block-sparse tiles see the same block structure at every S, and the
    sparse study (32K-128K) is too slow to tune at full length."""
    problem = _call_problem(head_dim, dtype, group, mask, head_dim_v)
    if isinstance(mask, BlockSparseMask):
        exact = [r for r in rows if r.matches(problem)]
        if exact:
            return exact[-1]
        target = SEQ_BUCKETS.index(seq_bucket(mask.seqlen_q))
        near = []
        for r in rows:
            lo = r.match.get("seqlen", [None])[0]
            if lo is not None and r.matches(dataclasses.replace(problem, seqlen=lo)):
                i = SEQ_BUCKETS.index(seq_bucket(lo))
                near.append((abs(i - target), -i, r))
        return min(near, key=lambda t: t[:2])[2] if near else None
    best = None
    for r in rows:
        if r.matches(dataclasses.replace(problem, block=r.match.get("block"))) and (
                best is None or row_score(r) > row_score(best)):
            best = r
    return best


def _call_row(kernel: str, q: torch.Tensor, k: torch.Tensor, mask: Mask, v: torch.Tensor | None) -> Row | None:
    if q.device.type != "cuda":
        return None
    rows = device_rows(device_key(q.device), kernel)
    if not rows:
        return None
    return best_row(rows, q.shape[-1], q.dtype, q.shape[2] // k.shape[2], mask, None if v is None else v.shape[-1])


def lookup(kernel: str, q: torch.Tensor, k: torch.Tensor, mask: Mask, v: torch.Tensor | None = None) -> dict | None:
    """The tuned config for this call's problem class (a copy, see :func:`best_row`), or None: the
    kernel's shipped table then decides."""
    row = _call_row(kernel, q, k, mask, v)
    return dict(row.config) if row else None


def measured_tflops(kernel: str, q: torch.Tensor, k: torch.Tensor, mask: Mask, v: torch.Tensor | None = None,
                    mode: str = "fwd") -> float | None:
    """The TFLOP/s the cache recorded in ``mode`` for the config ``lookup`` would give ``kernel``
    on this call, or None when it was never tuned here."""
    row = _call_row(kernel, q, k, mask, v)
    tf = (row.measured.get("tflops", {}).get(mode, {}) if row else {}).get("tuned")
    return float(tf) if isinstance(tf, (int, float)) and tf > 0 else None

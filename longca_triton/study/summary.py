"""The committed study in compact form, shipped with the package: ``recommend`` answers from it where
there is no checkout (a pip-installed copy run from any folder).

``compact(rows)`` keeps one row per measurement point (``bench.report.latest_rows``), measured on a
GPU, with the fields ``recommend`` reads (the point's identity, its status, GPU, FLOPs, time,
TFLOP/s, CP efficiency) and the results file it came from (``source``). ``write_summary`` writes
them as gzipped JSON lines; ``experiments/study_summary.py`` rebuilds the shipped file from
``experiments/results/`` after a study run. ``packaged_rows()`` reads the shipped file back, each
row naming its source file as ``recommend`` names a results file.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

__all__ = ["FIELDS", "SUMMARY_FILE", "compact", "packaged_rows", "summary_path", "write_summary"]

SUMMARY_FILE = "study_summary.jsonl.gz"
#: what a summary row keeps: the point's identity (``bench.store.KEY_FIELDS`` and the optional
#: ones), what ``recommend`` ranks and reports, and when it was measured (the latest row wins)
FIELDS = ("kind", "backend", "mask", "mask_label", "params_digest", "seqlen", "batch", "heads_q", "heads_kv",
          "head_dim", "d_v", "dtype", "mode", "world_size", "scheme", "plan", "tokens_per_gpu", "status", "gpu",
          "flops", "time_ms", "tflops", "efficiency", "time")


def summary_path() -> Path:
    """Where the shipped summary lives inside the installed package."""
    return Path(str(resources.files("longca_triton.data") / SUMMARY_FILE))


def compact(rows: list[dict]) -> list[dict]:
    """One row per point (the latest), GPU rows only, ``FIELDS`` and ``source`` (the row's results
    file, as ``recommend.load_rows`` recorded it) kept."""
    from longca_triton.bench.report import latest_rows
    from longca_triton.bench.store import on_cpu, params_digest

    out = []
    for r in latest_rows(r for r in rows if not on_cpu(r)):
        row = {k: r[k] for k in FIELDS if r.get(k) is not None}
        row.setdefault("params_digest", params_digest(r.get("mask_params")))
        row["source"] = r.get("_file", "")
        out.append(row)
    return out


def write_summary(paths, out) -> int:
    """Compact the rows of the results files ``paths`` into the gzipped JSON lines ``out`` (written
    whole, then moved into place); returns how many rows it holds."""
    from .recommend import load_rows

    rows = compact(load_rows(paths))
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    text = "".join(json.dumps(r, separators=(",", ":"), sort_keys=True) + "\n" for r in rows)
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:  # the same rows, the same bytes
        f.write(text.encode())
    tmp.replace(out)
    return len(rows)


def packaged_rows(path: Path | None = None) -> list[dict]:
    """The shipped summary's rows (``path``: another summary file), each with ``_file`` naming its
    source results file and the summary it was read from."""
    path = Path(path) if path is not None else summary_path()
    if not path.exists():
        return []
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for r in rows:
        r["_file"] = f"{r.get('source') or 'unknown'} (via the packaged study summary)"
    return rows

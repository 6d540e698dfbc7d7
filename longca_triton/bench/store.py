"""The results store: one JSON object per line, appended atomically, resumable.

``ResultStore(path)``:

* ``append(row)``: serialises the row to one line and writes it with a single ``os.write`` on an
  ``O_APPEND`` descriptor (under an exclusive ``flock`` where the platform has one), then
  ``fsync``. A process killed mid-sweep leaves at worst one truncated last line; a later
  ``append`` first terminates such a line so the new row starts on a line of its own.
* ``rows()``: every parseable row; a truncated or garbled line (only ever the result of a kill
  during a write) is skipped, and counted in ``skipped_lines``.
* ``done_keys(statuses=None)``: ``row_key`` of every row (optionally only rows whose status kind,
  ``ok | unsupported | oom | error``, is in ``statuses``).

Compressed results: a results file may be committed gzipped (``results.jsonl.gz``, stdlib ``gzip``;
a big study's rows, so that they travel to the GPU machine within its size limit). Every reader
takes it as it takes the plain file: ``ResultStore(path).rows()``, ``read_lines``, the report, the
plots, ``findings``, ``recommend``. Writing stays plain: ``append`` / ``rewrite`` on a ``.gz`` path
raise, and a bench run appends to ``results.jsonl``. A ``.gz`` cut short (a copy killed mid-write)
reads like a plain file cut short: the rows before the cut, the cut line skipped. Where results
files are *found* (a folder searched, the committed ``experiments/results/**`` glob, a folder given
to ``report`` / ``plot``) and both ``X.jsonl`` and ``X.jsonl.gz`` sit in one folder, the plain file
wins and a ``BothResultsWarning`` names the ``.gz`` left unread (``prefer_plain``): the plain file is
the one a bench appends to, so it is the newer whenever the two differ (a ``.gz`` beside it is a
snapshot of it, as ``experiments/gpu/study_sweep.sh`` leaves in ``$OUT``); delete the one you do
not mean. Files named one by one are read as named.

``environment_unsupported(row)``: whether an ``unsupported`` row says the *machine* lacks the backend
(package not installed, no GPU, wrong architecture, a torch without the feature) rather than that the
*case* is outside what the backend can do (head dim, mask kind, length). Such a row is not an answer
about the point: a resumed sweep retries it when the backend is available (``run_experiment``), and
it never supersedes a row that ran or judged the case (``report.latest_rows``, used by the report,
the plots, ``findings`` and ``recommend``).

``row_key(row)`` identifies a measurement point: backend, mask, digest of the mask parameters,
seqlen, batch, heads_q, heads_kv, head_dim, dtype, mode, plus ``world_size`` / ``scheme`` /
``plan`` for context-parallel rows, and ``d_v`` where v's head dim differs from ``head_dim`` (so rows
with one head dim keep the keys they had before ``d_v`` was recorded). ``collect_env()`` is the environment stamped on every row.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import hashlib
import importlib.metadata as md
import json
import math
import os
import platform
import re
import socket
import subprocess
import warnings
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator

__all__ = [
    "KEY_FIELDS",
    "RESULTS_PATTERNS",
    "VENDOR_DISTS",
    "CPU_CAVEAT",
    "CPU_TAG",
    "BothResultsWarning",
    "ResultStore",
    "collect_env",
    "environment_unsupported",
    "is_result_row",
    "measured_on",
    "on_cpu",
    "jsonable",
    "params_digest",
    "prefer_plain",
    "read_lines",
    "result_rows",
    "results_in",
    "row_key",
    "status_kind",
]

#: fields of ``row_key``, in order; the optional ones are appended only when present in the row
KEY_FIELDS = ("backend", "mask", "params_digest", "seqlen", "batch", "heads_q", "heads_kv", "head_dim", "dtype", "mode")
OPTIONAL_KEY_FIELDS = ("world_size", "scheme", "plan")

#: vendor distributions whose versions are stamped on every row (importlib.metadata names)
VENDOR_DISTS = (
    "nvidia-cudnn-frontend",
    "flash-attn",
    "flash-attn-3",
    "fa3-fwd",
    "flash-attn-4",
    "nvidia-cutlass-dsl",
    "quack-kernels",
    "transformer-engine",
    "transformer-engine-torch",
    "flashinfer-python",
    "apache-tvm-ffi",
    "fastvideo-kernel",
    "paddlepaddle-gpu",
    "yunchang",
    "nvidia-cudnn-cu12",
    "nvidia-cudnn-cu13",
)


def _canonical(obj: Any) -> Any:
    """JSON-able canonical form (numpy scalars/arrays and tuples to plain lists and numbers)."""
    if isinstance(obj, dict):
        return {str(k): _canonical(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    if hasattr(obj, "tolist"):
        return _canonical(obj.tolist())
    if isinstance(obj, float) and obj.is_integer():
        return int(obj)
    return obj


def params_digest(params: dict | None) -> str:
    """12 hex digits of SHA-1 over the canonical JSON of the mask parameters (drawn values included)."""
    text = json.dumps(_canonical(params or {}), sort_keys=True, separators=(",", ":"))
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def row_key(row: dict) -> tuple:
    """Identity of a measurement point (see module doc). Rows without ``params_digest`` get it from
    ``mask_params``; ``seqlen`` falls back to ``seqlen_q``."""
    vals = []
    for f in KEY_FIELDS:
        if f == "params_digest":
            v = row.get("params_digest") or params_digest(row.get("mask_params"))
        elif f == "seqlen":
            v = row.get("seqlen", row.get("seqlen_q"))
        else:
            v = row.get(f)
        vals.append(v)
    for f in OPTIONAL_KEY_FIELDS:
        if row.get(f) is not None:
            vals.append((f, json.dumps(_canonical(row[f]), sort_keys=True)))
    if row.get("d_v") is not None and row.get("d_v") != row.get("head_dim"):
        vals.append(("d_v", row["d_v"]))
    return tuple(vals)


def status_kind(row_or_status: dict | str) -> str:
    """``ok | unsupported | oom | error`` from a row or its ``status`` string (``"error: ..."``)."""
    s = row_or_status.get("status", "") if isinstance(row_or_status, dict) else row_or_status
    return str(s).split(":", 1)[0].strip()


#: reasons (adapters' ``available()`` and the device checks of ``supports()``) that depend on the
#: machine: rows written before ``run_experiment`` marked them (``"unavailable": true``) are told by these
ENVIRONMENT_REASONS = re.compile(
    r"is not installed|cannot import|no module named|only paddle's flashmask is installed|"
    r"needs a cuda gpu|needs a cuda device|need a cuda device|runs on cuda only|none visible|"
    r"needs an? sm_?\d+|needs hopper|compute capability|built for sm_|this gpu is sm_|gpu has \d|"
    r"cuda extension does not load|its cuda extension has no|built without cudnn|has no usable|"
    r"\btorch \d[\w.+]*(?::|'s| has no)|this torch's|on the cpu|cpu interpreter",
    re.IGNORECASE)


def environment_unsupported(row: dict) -> bool:
    """An ``unsupported`` row whose reason is the machine's, not the case's (see module doc)."""
    if status_kind(row) != "unsupported":
        return False
    return bool(row.get("unavailable")) or bool(ENVIRONMENT_REASONS.search(str(row.get("status", ""))))


#: names a results file may have: plain JSONL, and gzipped JSONL (read only; see module doc)
RESULTS_PATTERNS = ("*.jsonl", "*.jsonl.gz")


class BothResultsWarning(UserWarning):
    """``X.jsonl`` and ``X.jsonl.gz`` found in one folder: the plain one is read (see module doc)."""


def _gzipped(path: Path) -> bool:
    return path.name.endswith(".gz")


def read_lines(path: str | os.PathLike) -> Iterator[bytes]:
    """The raw lines (bytes, each with its ``\\n``; a last line cut short without one) of a results
    file, plain or gzipped (``.gz``). A gzip stream that ends early yields what it held, its cut
    last line without ``\\n``, as a plain file cut mid-write does; a file that is not gzip at all is
    a ``ValueError`` naming it."""
    p = Path(path)
    if not _gzipped(p):
        with open(p, "rb") as f:
            yield from f
        return
    with gzip.open(p, "rb") as f:
        rest = b""
        while True:
            try:
                chunk = f.read1(1 << 16)  # read1: nothing decompressed is lost when the stream is cut
            except EOFError:  # "Compressed file ended before the end-of-stream marker was reached"
                chunk = b""
            except (OSError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
                raise ValueError(f"{p}: not a readable gzip file ({e})") from None
            if not chunk:
                break
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
                yield line + b"\n"
        if rest:
            yield rest


def prefer_plain(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """``paths`` (found by a search), less every ``X.jsonl.gz`` whose ``X.jsonl`` is among them or
    next to it on disk: the plain file wins, and a ``BothResultsWarning`` says which ``.gz`` was
    left unread (see module doc). Order kept."""
    paths = [Path(p) for p in paths]
    listed = set(paths)
    out = []
    for p in paths:
        plain = p.with_name(p.name[: -len(".gz")]) if _gzipped(p) else None
        if plain is not None and (plain in listed or plain.exists()):
            warnings.warn(f"both {plain} and {p.name} next to it: reading {plain.name}, not {p.name} (the plain file "
                          f"is the one a bench appends to; delete the one you do not mean)", BothResultsWarning,
                          stacklevel=2)
            if plain not in listed:
                out.append(plain)
                listed.add(plain)
            continue
        out.append(p)
    return list(dict.fromkeys(out))


def results_in(folder: str | os.PathLike) -> Path:
    """The results file of a folder: ``results.jsonl``, else ``results.jsonl.gz`` (both there: the
    plain one, with a ``BothResultsWarning``). ``FileNotFoundError`` when neither is there."""
    d = Path(folder)
    plain, gz = d / "results.jsonl", d / "results.jsonl.gz"
    if plain.exists() or gz.exists():
        return prefer_plain([gz if gz.exists() else plain])[0]
    raise FileNotFoundError(f"no results file at {plain} (nor {gz.name})")


#: what every row of a results file carries, bench and CP rows alike
RESULT_FIELDS = ("backend", "mask", "seqlen", "mode", "status")


def is_result_row(row) -> bool:
    """Whether ``row`` is a measurement row of a results file (``RESULT_FIELDS`` all set), not other JSON."""
    return isinstance(row, dict) and all(row.get(k) not in (None, "") for k in RESULT_FIELDS)


#: what a table of rows measured on a CPU says under it, and a plot in its title
CPU_CAVEAT = "Measured on a CPU: these timings check that the harness works; they are not performance numbers."
CPU_TAG = "CPU run: not performance numbers"


def on_cpu(row: dict) -> bool:
    """Whether ``row`` was measured on a CPU (the Triton interpreter, or PyTorch on the CPU)."""
    return row.get("device") == "cpu" or bool(row.get("interpreted"))


def measured_on(row: dict) -> str:
    """Where ``row`` was measured, in words: its GPU, or ``cpu`` / ``cpu (Triton interpreter)``."""
    if on_cpu(row):
        return "cpu (Triton interpreter)" if row.get("interpreted") else "cpu"
    return str(row.get("gpu") or (row.get("env") or {}).get("gpu") or row.get("device") or "unknown")


def result_rows(path: str | os.PathLike) -> list[dict]:
    """The measurement rows of one results file (plain or ``.gz``); a ``ValueError`` naming the file
    when it holds none: empty, not JSON lines, or JSON of another kind."""
    store = ResultStore(path)
    rows = store.rows()
    mine = [r for r in rows if is_result_row(r)]
    if not mine:
        if rows:
            why = f"no row has all of {', '.join(RESULT_FIELDS)} ({len(rows)} JSON rows read)"
        elif store.skipped_lines:
            why = f"none of its {store.skipped_lines} lines is a JSON object"
        else:
            why = "it is empty"
        raise ValueError(f"{path} is not a results file: {why} (a results file is the results.jsonl that "
                         f"`longca-triton bench` writes)")
    return mine


class ResultStore:
    """Append-only JSONL results file (see module doc); a ``.gz`` one is read only."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.skipped_lines = 0

    def _writable(self) -> None:
        if _gzipped(self.path):
            raise ValueError(f"{self.path} is gzipped: results are read from it, never written to it (a bench "
                             f"appends to a plain results.jsonl; gzip that for the repository)")

    def append(self, row: dict) -> None:
        self._writable()
        line = json.dumps(row, default=_json_default, separators=(",", ":"), allow_nan=True)
        if "\n" in line:  # json.dumps never emits raw newlines, but be explicit
            raise ValueError("row serialises to more than one line")
        data = (line + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            _lock(fd)
            try:
                if _ends_without_newline(self.path):
                    data = b"\n" + data  # terminate a truncated last line left by a killed writer
                n = os.write(fd, data)
                if n != len(data):  # a short write on a regular file means the disk is full
                    raise OSError(f"short write to {self.path}: {n} of {len(data)} bytes")
                os.fsync(fd)
            finally:
                _unlock(fd)
        finally:
            os.close(fd)

    def extend(self, rows: Iterable[dict]) -> None:
        for r in rows:
            self.append(r)

    def rewrite(self, rows: Iterable[dict]) -> None:
        """Replace the whole file by ``rows`` atomically (a temporary file renamed over it)."""
        self._writable()
        lines = [json.dumps(r, default=_json_default, separators=(",", ":"), allow_nan=True) + "\n" for r in rows]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def rows(self) -> list[dict]:
        self.skipped_lines = 0
        if not self.path.exists():
            return []
        out = []
        for raw in read_lines(self.path):
            if not raw.endswith(b"\n"):  # truncated last line
                if raw.strip():
                    self.skipped_lines += 1
                continue
            text = raw.strip()
            if not text:
                continue
            try:
                obj = json.loads(text)
            except (json.JSONDecodeError, UnicodeDecodeError):
                self.skipped_lines += 1
                continue
            if isinstance(obj, dict):
                out.append(obj)
            else:
                self.skipped_lines += 1
        return out

    def done_keys(self, statuses: Iterable[str] | None = None) -> set:
        wanted = set(statuses) if statuses is not None else None
        return {row_key(r) for r in self.rows() if wanted is None or status_kind(r) in wanted}

    def __len__(self) -> int:
        return len(self.rows())

    def __repr__(self) -> str:
        return f"ResultStore({str(self.path)!r})"


def _json_default(obj):
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def _ends_without_newline(path: Path) -> bool:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if size == 0:
        return False
    with open(path, "rb") as f:
        f.seek(size - 1)
        return f.read(1) != b"\n"


try:  # POSIX advisory lock: concurrent writers (e.g. CP ranks) never interleave
    import fcntl

    def _lock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX)

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)

except ImportError:  # pragma: no cover - Windows

    def _lock(fd: int) -> None:
        pass

    def _unlock(fd: int) -> None:
        pass


# ---------------------------------------------------------------------------- environment
def _run(cmd: list[str], cwd: str | None = None, timeout: float = 5.0) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _git_info() -> dict:
    commit = os.environ.get("LONGCA_GIT_COMMIT")
    repo = str(Path(__file__).resolve().parents[2])
    dirty = None
    if not commit:
        commit = _run(["git", "rev-parse", "HEAD"], cwd=repo)
        if commit:
            status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo)
            dirty = bool(status) if status is not None else None
    return {"git_commit": commit, "git_dirty": dirty}


def _driver_version() -> str | None:
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        pass
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def _versions(dists: Iterable[str]) -> dict:
    out = {}
    for d in dists:
        try:
            out[d] = md.version(d)
        except md.PackageNotFoundError:
            continue
    return out


_ENV_CACHE: dict | None = None


def collect_env(refresh: bool = False) -> dict:
    """GPU, driver, CUDA, torch, triton, cuDNN, vendor package versions, git commit, host, time.

    Everything but ``time`` is computed once per process (``refresh=True`` recomputes)."""
    global _ENV_CACHE
    if _ENV_CACHE is None or refresh:
        import torch

        env: dict[str, Any] = {
            "hostname": socket.gethostname(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": None,
            "gpu": None,
            "gpu_capability": None,
            "gpu_memory_gib": None,
            "gpu_count": 0,
            "driver": None,
            "interpreted": os.environ.get("TRITON_INTERPRET", "0") == "1",
        }
        try:
            import triton

            env["triton"] = triton.__version__
        except Exception:
            env["triton"] = None
        try:
            env["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        except Exception:
            pass
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env.update(
                gpu=p.name,
                gpu_capability=f"{p.major}.{p.minor}",
                gpu_memory_gib=round(p.total_memory / 2**30, 1),
                gpu_count=torch.cuda.device_count(),
                driver=_driver_version(),
            )
        env["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        env["vendors"] = _versions(VENDOR_DISTS)
        env.update(_git_info())
        _ENV_CACHE = env
    out = dict(_ENV_CACHE)
    out["time"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return out


def jsonable(obj):
    """``obj`` with dict keys as strings, tuples and arrays as lists, NaN/inf floats as strings (a row value)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return str(obj)
    return obj

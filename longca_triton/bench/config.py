"""Experiment grids: TOML files, presets, CLI overrides, validation.

A TOML experiment (see ``experiments/dense.toml``)::

    [experiment]
    name = "dense"
    description = "..."

    [grid]
    masks = ["full", "causal", "causal_document"]
    seqlens = ["1K", "4K", 16384]          # ints or "<n>K" / "<n>M"
    heads = ["64:8", "64:64"]              # "query:kv"
    head_dim = [128]
    dtype = ["bfloat16"]
    modes = ["fwd", "bwd"]                 # fwd | bwd | fwd_bwd
    backends = ["sdpa-cudnn", "flex"]
    batch = 1
    seed = 0

    [timing]
    warmup_ms = 25
    rep = 30
    max_ms = 1500          # cap on timed repetitions per point
    check = true           # correctness check against the reference before timing

    [mask_params.sliding_window_causal]
    window = 1024
    [mask_params.prefix_lm_causal]
    prefix = "S/3"         # arithmetic in S (the sequence length) is allowed

Every value is validated before anything runs; errors name the offending key and the valid choices.
"""

from __future__ import annotations

import ast
import copy
import operator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from longca_triton.masks import MASK_NAMES, MASK_SPECS

__all__ = [
    "DTYPES",
    "MODES",
    "PRESETS",
    "ConfigError",
    "Experiment",
    "load_experiment",
    "parse_dtype",
    "parse_heads",
    "parse_seqlen",
    "resolve_param",
]

MODES = ("fwd", "bwd", "fwd_bwd")
DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}
DTYPE_CANON = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class ConfigError(ValueError):
    """A bad experiment file or override (the message says which value and what is valid)."""


# ---------------------------------------------------------------------------- value parsers
def parse_seqlen(v: Any) -> int:
    """``4096``, ``"4096"``, ``"4K"`` (= 4096), ``"1M"``; must be a positive integer."""
    if isinstance(v, bool):
        raise ConfigError(f"sequence length {v!r} is not a positive integer")
    if isinstance(v, int):
        n = v
    else:
        s = str(v).strip().upper().replace("_", "")
        mult = 1
        if s.endswith("K"):
            mult, s = 1024, s[:-1]
        elif s.endswith("M"):
            mult, s = 1024 * 1024, s[:-1]
        try:
            n = int(float(s) * mult) if "." in s else int(s) * mult
        except ValueError:
            raise ConfigError(f"sequence length {v!r} is not a positive integer (examples: 4096, 4K, 16K)") from None
    if n < 1:
        raise ConfigError(f"sequence length {v!r} must be positive")
    return n


def parse_heads(v: Any) -> tuple[int, int]:
    """``"64:8"`` -> ``(64, 8)`` (query heads : key/value heads); ``"64"`` or ``64`` means MHA."""
    s = str(v).strip()
    parts = s.split(":")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(f"heads {v!r} must look like 64:8 (query heads : key/value heads)") from None
    if len(nums) == 1:
        nums = nums * 2
    if len(nums) != 2 or min(nums) < 1:
        raise ConfigError(f"heads {v!r} must look like 64:8 with positive counts")
    hq, hkv = nums
    if hq % hkv:
        raise ConfigError(f"heads {v!r}: query heads {hq} must be a multiple of key/value heads {hkv}")
    return hq, hkv


def parse_dtype(v: Any) -> torch.dtype:
    if isinstance(v, torch.dtype) and v in DTYPE_CANON:
        return v
    key = str(v).strip().lower().replace("torch.", "")
    if key not in DTYPES:
        raise ConfigError(f"dtype {v!r} unknown; valid: bfloat16 (bf16), float16 (fp16), float32 (fp32)")
    return DTYPES[key]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg}


def resolve_param(value: Any, seqlen: int) -> Any:
    """A mask parameter: strings with ``S`` are arithmetic in the sequence length (``"S/3"``,
    ``"S//16"``), rounded down to an int; everything else is returned unchanged."""
    if isinstance(value, (list, tuple)):
        return [resolve_param(v, seqlen) for v in value]
    if not isinstance(value, str) or "S" not in value:
        return value

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.Name) and node.id == "S":
            return seqlen
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ConfigError(f"mask parameter {value!r}: only numbers, S and + - * / // % are allowed")

    try:
        tree = ast.parse(value, mode="eval")
    except SyntaxError:
        raise ConfigError(f"mask parameter {value!r} is not an arithmetic expression in S") from None
    return int(ev(tree))


def _as_list(v: Any) -> list:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return list(v)
    if isinstance(v, str):
        return [x.strip() for x in v.split(",") if x.strip()]
    return [v]


# ---------------------------------------------------------------------------- the experiment
@dataclass
class Experiment:
    name: str = "dense"
    description: str = ""
    masks: list[str] = field(default_factory=lambda: ["full", "causal"])
    seqlens: list[int] = field(default_factory=lambda: [4096])
    heads: list[tuple[int, int]] = field(default_factory=lambda: [(64, 8)])
    head_dims: list[int] = field(default_factory=lambda: [128])
    dtypes: list[str] = field(default_factory=lambda: ["bfloat16"])
    modes: list[str] = field(default_factory=lambda: ["fwd", "bwd"])
    backends: list[str] = field(default_factory=lambda: ["reference"])
    batch: int = 1
    seed: int = 0
    mask_params: dict[str, dict] = field(default_factory=dict)
    warmup_ms: float = 25.0
    rep: int = 30
    max_ms: float | None = 1500.0
    check: bool = True
    #: "tiny sizes for a machine without a GPU" and the like; shown in the output and the rows
    preset: str | None = None
    source: str | None = None

    # -- validation
    def validate(self, known_backends: Iterable[str] | None = None) -> "Experiment":
        if not self.masks:
            raise ConfigError("no masks given")
        for m in self.masks:
            if m not in MASK_SPECS:
                raise ConfigError(f"unknown mask {m!r}; valid masks: {', '.join(MASK_NAMES)}")
        for m, params in self.mask_params.items():
            if m not in MASK_SPECS:
                raise ConfigError(f"[mask_params.{m}]: unknown mask; valid masks: {', '.join(MASK_NAMES)}")
            valid = set(MASK_SPECS[m].defaults)
            bad = sorted(set(params) - valid)
            if bad:
                raise ConfigError(f"[mask_params.{m}]: unknown parameter(s) {', '.join(bad)}; valid: {', '.join(sorted(valid)) or 'none'}")
        if not self.seqlens:
            raise ConfigError("no sequence lengths given")
        self.seqlens = [parse_seqlen(s) for s in self.seqlens]
        self.heads = [parse_heads(h if not isinstance(h, tuple) else f"{h[0]}:{h[1]}") for h in self.heads]
        if not self.heads:
            raise ConfigError("no heads given")
        for d in self.head_dims:
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise ConfigError(f"head_dim {d!r} must be a positive integer")
        self.dtypes = [DTYPE_CANON[parse_dtype(d)] for d in self.dtypes]
        for m in self.modes:
            if m not in MODES:
                raise ConfigError(f"unknown mode {m!r}; valid modes: {', '.join(MODES)}")
        if not self.modes:
            raise ConfigError("no modes given")
        if not self.backends:
            raise ConfigError("no backends given")
        if known_backends is not None:
            known = set(known_backends)
            for b in self.backends:
                if b not in known:
                    raise ConfigError(f"unknown backend {b!r}; valid backends: {', '.join(sorted(known))}")
        from longca_triton.masks import make_mask

        for m in self.masks:  # every mask must build at every S before anything runs
            for S in self.seqlens:
                try:
                    make_mask(m, S, seed=self.seed, **self.params_for(m, S))
                except (ValueError, TypeError) as e:
                    raise ConfigError(f"mask {m!r} at S={S}: {e}") from None
        for name, v, lo in (("batch", self.batch, 1), ("rep", self.rep, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
        if self.warmup_ms < 0:
            raise ConfigError(f"warmup_ms must be >= 0, got {self.warmup_ms}")
        return self

    def params_for(self, mask: str, seqlen: int) -> dict:
        return {k: resolve_param(v, seqlen) for k, v in self.mask_params.get(mask, {}).items()}

    def num_points(self) -> int:
        return (len(self.masks) * len(self.seqlens) * len(self.heads) * len(self.head_dims) * len(self.dtypes)
                * len(self.modes) * len(self.backends))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["heads"] = [f"{a}:{b}" for a, b in self.heads]
        return d

    def with_overrides(self, **over: Any) -> "Experiment":
        """A copy with the non-``None`` overrides applied (lists may be comma-separated strings)."""
        e = copy.deepcopy(self)
        listy = {"masks": "masks", "seqlens": "seqlens", "heads": "heads", "head_dims": "head_dims",
                 "dtypes": "dtypes", "modes": "modes", "backends": "backends"}
        for k, v in over.items():
            if v is None or (isinstance(v, (list, tuple)) and not v):
                continue
            if k in listy:
                vals = []
                for item in _as_list(v):
                    vals.extend(_as_list(item))
                if k == "head_dims":
                    try:
                        vals = [int(x) for x in vals]
                    except ValueError:
                        raise ConfigError(f"head dim {v!r} must be a positive integer") from None
                setattr(e, listy[k], vals)
            elif hasattr(e, k):
                setattr(e, k, v)
            else:
                raise ConfigError(f"unknown setting {k!r}")
        return e


# ---------------------------------------------------------------------------- presets
PRESETS: dict[str, dict] = {
    # tiny sizes: runs on a CPU through the reference and the Triton interpreter in well under 2 min
    "smoke": dict(
        name="smoke",
        description="CPU smoke grid: tiny sizes, reference backends and (when registered) our Triton kernel, interpreted",
        masks=["full", "causal", "causal_document", "sliding_window_causal", "share_question"],
        seqlens=[160],
        heads=[(4, 2)],
        head_dims=[32],
        dtypes=["float32"],
        modes=["fwd", "bwd"],
        backends=["reference", "reference-chunked", "sdpa-math", "flex", "triton"],
        batch=1,
        seed=0,
        mask_params={"sliding_window_causal": {"window": "S//4"},
                     "causal_document": {"doc_lens": ["S//3", "S//4", "S - S//3 - S//4"]},
                     "share_question": {"doc_lens": ["S//4", "S//3", "S - S//4 - S//3"]}},
        warmup_ms=0.0,
        rep=3,
        max_ms=500.0,
        check=True,
    ),
}

#: backends a preset lists that may not be registered in every build (silently dropped if absent)
OPTIONAL_PRESET_BACKENDS = {"triton"}


def preset(name: str) -> Experiment:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
    e = Experiment(**copy.deepcopy(PRESETS[name]))
    e.preset = name
    return e


def _load_toml(path: Path) -> dict:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigError("reading TOML needs Python >= 3.11 or the 'tomli' package") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"experiment file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML ({e})") from None


def load_experiment(path: str | Path) -> Experiment:
    """Read a TOML experiment (unknown keys are errors, so typos never pass silently)."""
    path = Path(path)
    data = _load_toml(path)
    allowed_top = {"experiment", "grid", "timing", "mask_params"}
    bad = sorted(set(data) - allowed_top)
    if bad:
        raise ConfigError(f"{path}: unknown table(s) {', '.join(bad)}; valid: {', '.join(sorted(allowed_top))}")
    exp = data.get("experiment", {})
    grid = data.get("grid", {})
    timing = data.get("timing", {})
    for table, keys, got in (
        ("experiment", {"name", "description", "kind"}, exp),
        ("grid", {"masks", "seqlens", "heads", "head_dim", "dtype", "modes", "backends", "batch", "seed"}, grid),
        ("timing", {"warmup_ms", "rep", "max_ms", "check"}, timing),
    ):
        extra = sorted(set(got) - keys)
        if extra:
            raise ConfigError(f"{path}: unknown key(s) {', '.join(extra)} in [{table}]; valid: {', '.join(sorted(keys))}")
    e = Experiment(
        name=exp.get("name", path.stem),
        description=exp.get("description", ""),
        masks=_as_list(grid.get("masks", ["full", "causal"])),
        seqlens=_as_list(grid.get("seqlens", [4096])),
        heads=_as_list(grid.get("heads", ["64:8"])),
        head_dims=[int(x) for x in _as_list(grid.get("head_dim", [128]))],
        dtypes=_as_list(grid.get("dtype", ["bfloat16"])),
        modes=_as_list(grid.get("modes", ["fwd", "bwd"])),
        backends=_as_list(grid.get("backends", ["reference"])),
        batch=grid.get("batch", 1),
        seed=grid.get("seed", 0),
        mask_params={k: dict(v) for k, v in data.get("mask_params", {}).items()},
        warmup_ms=float(timing.get("warmup_ms", 25.0)),
        rep=timing.get("rep", 30),
        max_ms=None if timing.get("max_ms", 1500.0) in (None, 0) else float(timing.get("max_ms", 1500.0)),
        check=bool(timing.get("check", True)),
        source=str(path),
    )
    return e

"""Experiment grids: TOML files, presets, CLI overrides, validation.

A TOML experiment (see ``experiments/dense.toml``)::

    [experiment]
    name = "dense"
    description = "..."

    [grid]
    masks = ["full", "causal", "causal_document"]
    seqlens = ["1K", "4K", 16384]          # ints or "<n>K" / "<n>M"
    heads = ["64:8", "64:64"]              # "query:kv"
    head_dim = ["64", "96", "128", "192/128"]  # D, or "D_qk/D_v" when v has its own (ints work too)
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
    interleave = true      # time a problem's backends together, repetition by repetition

    [mask_params.sliding_window_causal]
    window = 1024
    [mask_params.prefix_lm_causal]
    prefix = "S/3"         # arithmetic in S (the sequence length) is allowed

Per-backend length limits (``[backend_max_seqlen]``): points of a backend above its limit are
left out of the plan (not run, no row; the findings list them as not measured), so one grid can
extend S for the backends that fit::

    [backend_max_seqlen]
    sdpa-math = "8K"       # materialises the S x S scores
    sdpa-cudnn = "48K"

Mask parameters (``[mask_params.<mask>]``):

* a string naming ``S`` (sequence length), ``Hq`` / ``Hkv`` (the point's query / key-value heads)
  or another numeric parameter of the same mask is arithmetic (``+ - * / // %``), rounded down to
  an int: ``prefix = "S/3"``, ``patterns = "Hkv"`` (one block-sparse pattern per KV head),
  ``min_block = "block/2"``; any other string is passed on unchanged (``docs = "long"``);
* a list is a **sweep**: the grid is crossed with every value (``block = [64, 128]`` and
  ``density = [0.2, 0.5, 0.8]`` make six mask variants). Parameters whose value is itself a list
  (``doc_lens``, ``doc_bounds``, ``block_bounds``) sweep only as a list of lists.

``[experiment] kind`` says which ``bench`` command the file is for (``dense`` by default,
``sparse``, ``varblock``). Every value is validated before anything runs; errors name the
offending key and the valid choices.
"""

from __future__ import annotations

import copy
import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from longca_triton.masks import MASK_NAMES, MASK_SPECS

from .params import (DTYPE_CANON, DTYPES, KINDS, LIST_VALUED_PARAMS, MODES, ConfigError, _as_list, _fmt_value,
                     _is_sweep, normalize_head_dim, parse_dtype, parse_heads, parse_seqlen, resolve_param, resolve_params)
from .presets import PRESETS

__all__ = [
    "DTYPES",
    "KINDS",
    "MODES",
    "PRESETS",
    "ConfigError",
    "Experiment",
    "load_experiment",
    "parse_dtype",
    "parse_heads",
    "parse_seqlen",
    "resolve_param",
    "resolve_params",
]


# ---------------------------------------------------------------------------- the experiment
@dataclass
class Experiment:
    name: str = "dense"
    description: str = ""
    #: which bench command the grid is for (``KINDS``); stamped on every row
    kind: str = "dense"
    masks: list[str] = field(default_factory=lambda: ["full", "causal"])
    seqlens: list[int] = field(default_factory=lambda: [4096])
    heads: list[tuple[int, int]] = field(default_factory=lambda: [(64, 8)])
    #: ints (q, k, v share the dim) or ``"D_qk/D_v"`` strings, canonical after ``validate``
    #: (``params.normalize_head_dim``)
    head_dims: list[int | str] = field(default_factory=lambda: [128])
    dtypes: list[str] = field(default_factory=lambda: ["bfloat16"])
    modes: list[str] = field(default_factory=lambda: ["fwd", "bwd"])
    backends: list[str] = field(default_factory=lambda: ["reference"])
    batch: int = 1
    seed: int = 0
    mask_params: dict[str, dict] = field(default_factory=dict)
    #: backend -> the largest S it runs in this experiment (points above are not planned)
    backend_max_seqlen: dict[str, int] = field(default_factory=dict)
    warmup_ms: float = 25.0
    rep: int = 30
    max_ms: float | None = 1500.0
    check: bool = True
    #: time the backends of one problem and mode together, round by round (``timing.time_interleaved``)
    interleave: bool = True
    #: "tiny sizes for a machine without a GPU" and the like; shown in the output and the rows
    preset: str | None = None
    source: str | None = None

    # -- mask variants (list-valued parameters are swept)
    def swept(self, mask: str) -> list[str]:
        """The parameters of ``mask`` that are swept (list-valued in the grid), in file order."""
        return [k for k, v in self.mask_params.get(mask, {}).items() if _is_sweep(k, v)]

    def variants(self, mask: str) -> list[dict]:
        """Unresolved parameter dicts of ``mask``, one per combination of the swept values."""
        params = self.mask_params.get(mask, {})
        keys = self.swept(mask)
        if not keys:
            return [dict(params)]
        out = []
        for combo in itertools.product(*[list(params[k]) for k in keys]):
            d = dict(params)
            d.update(zip(keys, combo))
            out.append(d)
        return out

    def label_keys(self, mask: str) -> list[str]:
        """The parameters that name a variant: the swept ones, and for block-sparse masks always
        ``block`` and ``density`` (so rows of runs with other blocks or densities never share a
        plot panel or a report row)."""
        keys = [k for k in ("block", "density") if MASK_SPECS[mask].kind == "dynamic" and k in MASK_SPECS[mask].defaults]
        return keys + [k for k in self.swept(mask) if k not in keys]

    def variant_values(self, mask: str, variant: int = 0, seqlen: int | None = None,
                       heads: tuple[int, int] | None = None) -> dict:
        """The values of one variant's ``label_keys`` (resolved when ``seqlen`` is given)."""
        keys = self.label_keys(mask)
        if not keys:
            return {}
        v = {**MASK_SPECS[mask].defaults, **self.variants(mask)[variant]}
        if seqlen is not None:
            v = resolve_params(v, seqlen, heads)
        return {k: v[k] for k in keys}

    def variant_label(self, mask: str, variant: int = 0) -> str:
        """``mask`` itself, or ``block_sparse[block=64,density=0.2]`` for a variant of a swept or
        block-sparse mask."""
        vals = self.variant_values(mask, variant)
        if not vals:
            return mask
        return f"{mask}[{','.join(f'{k}={_fmt_value(v)}' for k, v in vals.items())}]"

    def params_for(self, mask: str, seqlen: int, heads: tuple[int, int] | None = None, variant: int = 0) -> dict:
        """The resolved parameters of ``mask`` (variant ``variant``) at sequence length ``seqlen``
        and, where they use ``Hq`` / ``Hkv``, at ``heads = (Hq, Hkv)``."""
        return resolve_params(self.variants(mask)[variant], seqlen, heads)

    def runs(self, backend: str, seqlen: int) -> bool:
        """Whether ``backend`` runs at ``seqlen`` in this experiment (``backend_max_seqlen``)."""
        limit = self.backend_max_seqlen.get(backend)
        return limit is None or seqlen <= limit

    # -- validation
    def validate(self, known_backends: Iterable[str] | None = None) -> "Experiment":
        if self.kind not in KINDS:
            raise ConfigError(f"unknown experiment kind {self.kind!r}; valid kinds: {', '.join(KINDS)}")
        if not self.masks:
            raise ConfigError("no masks given")
        for m in self.masks:
            if m not in MASK_SPECS:
                raise ConfigError(f"unknown mask {m!r}; valid masks: {', '.join(MASK_NAMES)}")
            if self.kind != "dense" and MASK_SPECS[m].kind != "dynamic":
                dyn = ", ".join(n for n in MASK_NAMES if MASK_SPECS[n].kind == "dynamic")
                raise ConfigError(f"a {self.kind} experiment takes block-sparse masks ({dyn}), not {m!r} "
                                  f"(static masks run under `bench dense`)")
        for m, params in self.mask_params.items():
            if m not in MASK_SPECS:
                raise ConfigError(f"[mask_params.{m}]: unknown mask; valid masks: {', '.join(MASK_NAMES)}")
            valid = set(MASK_SPECS[m].defaults)
            bad = sorted(set(params) - valid)
            if bad:
                raise ConfigError(f"[mask_params.{m}]: unknown parameter(s) {', '.join(bad)}; valid: {', '.join(sorted(valid)) or 'none'}")
            for k, v in params.items():
                if isinstance(v, (list, tuple)) and not v:
                    raise ConfigError(f"[mask_params.{m}] {k}: an empty list sweeps nothing")
        if not self.seqlens:
            raise ConfigError("no sequence lengths given")
        self.seqlens = [parse_seqlen(s) for s in self.seqlens]
        self.heads = [parse_heads(h if not isinstance(h, tuple) else f"{h[0]}:{h[1]}") for h in self.heads]
        if not self.heads:
            raise ConfigError("no heads given")
        if not self.head_dims:
            raise ConfigError("no head dims given")
        self.head_dims = list(dict.fromkeys(normalize_head_dim(d) for d in self.head_dims))
        self.dtypes = [DTYPE_CANON[parse_dtype(d)] for d in self.dtypes]
        for m in self.modes:
            if m not in MODES:
                raise ConfigError(f"unknown mode {m!r}; valid modes: {', '.join(MODES)}")
        if not self.modes:
            raise ConfigError("no modes given")
        if not self.backends:
            raise ConfigError("no backends given")
        # renamed backends (adapters.ALIASES) run, and are recorded, under their current name
        from longca_triton.adapters.base import canonical_name, get_backend, split_config_name

        self.backends = list(dict.fromkeys(canonical_name(b) for b in self.backends))
        limits = {}
        for b, v in self.backend_max_seqlen.items():
            try:
                limits[canonical_name(b)] = parse_seqlen(v)
            except ConfigError as e:
                raise ConfigError(f"[backend_max_seqlen] {b}: {e}") from None
        self.backend_max_seqlen = limits
        if known_backends is not None:
            known = set(known_backends)
            for b in [*self.backends, *limits]:
                base, config = split_config_name(b)
                if base not in known:
                    raise ConfigError(f"unknown backend {base!r}; valid backends: {', '.join(sorted(known))}")
                if config is not None:  # one of ours with a launch config: checked now, before anything runs
                    try:
                        get_backend(b)
                    except ValueError as e:
                        raise ConfigError(str(e)) from None
        built = set()
        for m in self.masks:  # every mask variant must build at every S (and heads) before anything runs
            for vi in range(len(self.variants(m))):
                for S in self.seqlens:
                    for hq, hkv in self.heads:
                        where = f"mask {self.variant_label(m, vi)!r} at S={S}, heads {hq}:{hkv}"
                        try:
                            params = self.params_for(m, S, (hq, hkv), vi)
                        except ConfigError as e:
                            raise ConfigError(f"{where}: {e}") from None
                        self._check_builds(m, S, hq, params, where, built)
        for name, v, lo in (("batch", self.batch, 1), ("rep", self.rep, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
        if self.warmup_ms < 0:
            raise ConfigError(f"warmup_ms must be >= 0, got {self.warmup_ms}")
        return self

    def _check_builds(self, mask: str, S: int, hq: int, params: dict, where: str, seen: set) -> None:
        """Build the mask to validate its parameters. Block-sparse masks are checked on a small
        instance (one pattern; S at most 8K unless block bounds are given) after their pattern
        count is checked against the heads: at 128K a full draw takes seconds, and it happens
        anyway when the point runs."""
        from longca_triton.masks import make_mask

        p = dict(params)
        n = S
        if MASK_SPECS[mask].kind == "dynamic":
            P = p.get("patterns", MASK_SPECS[mask].defaults.get("patterns", 1))
            if isinstance(P, bool) or not isinstance(P, int) or P < 1:
                raise ConfigError(f"{where}: patterns must be a positive integer, got {P!r}")
            if hq % P:
                raise ConfigError(f"{where}: {P} patterns do not divide {hq} query heads")
            if "patterns" in MASK_SPECS[mask].defaults:
                p["patterns"] = 1
            if not any(p.get(k) is not None for k in LIST_VALUED_PARAMS):
                n = min(S, 8192)
        key = (mask, n, json.dumps(p, sort_keys=True, default=str))
        if key in seen:
            return
        try:
            make_mask(mask, n, seed=self.seed, **p)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{where}: {e}") from None
        seen.add(key)

    def num_points(self) -> int:
        """Points of the plan: every combination, less those above a backend's ``backend_max_seqlen``."""
        pairs = sum(self.runs(b, S) for S in self.seqlens for b in self.backends)
        return (sum(len(self.variants(m)) for m in self.masks) * pairs * len(self.heads)
                * len(self.head_dims) * len(self.dtypes) * len(self.modes))

    def grid_summary(self) -> str:
        """``504 points (6 mask variants × 3 S × ...)``."""
        nv = sum(len(self.variants(m)) for m in self.masks)
        what = f"{len(self.masks)} masks" if nv == len(self.masks) else f"{nv} mask variants"
        left = sum(not self.runs(b, S) for S in self.seqlens for b in self.backends)
        return (f"{self.num_points()} points ({what} × {len(self.seqlens)} S × {len(self.heads)} heads × "
                f"{len(self.head_dims)} D × {len(self.dtypes)} dtypes × {len(self.modes)} modes × "
                f"{len(self.backends)} backends" + (f"; {left} (S, backend) pairs above the backend's "
                                                   f"max_seqlen left out" if left else "") + ")")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["heads"] = [f"{a}:{b}" for a, b in self.heads]
        return d

    def with_overrides(self, **over: Any) -> "Experiment":
        """A copy with the non-``None`` overrides applied (lists may be comma-separated strings)."""
        from longca_triton.adapters.base import split_backend_list

        e = copy.deepcopy(self)
        listy = {"masks": "masks", "seqlens": "seqlens", "heads": "heads", "head_dims": "head_dims",
                 "dtypes": "dtypes", "modes": "modes", "backends": "backends"}
        params = over.pop("params", None)
        for k, v in over.items():
            if v is None or (isinstance(v, (list, tuple)) and not v):
                continue
            if k in listy:
                vals = []
                for item in [v] if isinstance(v, str) else _as_list(v):
                    # backend names may carry a launch config whose JSON has commas of its own
                    names = k == "backends" and isinstance(item, str)
                    vals.extend(split_backend_list(item) if names else _as_list(item))
                if k == "head_dims":
                    vals = [normalize_head_dim(x) for x in vals]
                setattr(e, listy[k], vals)
            elif hasattr(e, k):
                setattr(e, k, v)
            else:
                raise ConfigError(f"unknown setting {k!r}")
        for item in params or ():
            e._set_param(item)
        return e

    def _set_param(self, item: str) -> None:
        """``KEY=VALUE[,VALUE...]`` or ``MASK.KEY=...`` (several values: a sweep). Without a mask
        name it applies to every mask of the grid that has the parameter."""
        if "=" not in item:
            raise ConfigError(f"mask parameter override {item!r} must look like key=value or mask.key=v1,v2")
        lhs, rhs = item.split("=", 1)
        mask, _, key = lhs.strip().rpartition(".")
        targets = [mask] if mask else [m for m in self.masks if m in MASK_SPECS and key in MASK_SPECS[m].defaults]
        if not targets:
            raise ConfigError(f"no mask of the grid ({', '.join(self.masks)}) has a parameter {key!r}")
        for m in targets:
            if m not in MASK_SPECS:
                raise ConfigError(f"--param {item!r}: unknown mask {m!r}; valid masks: {', '.join(MASK_NAMES)}")
            if key not in MASK_SPECS[m].defaults:
                raise ConfigError(f"--param {item!r}: mask {m!r} has no parameter {key!r}; valid: "
                                  f"{', '.join(sorted(MASK_SPECS[m].defaults)) or 'none'}")
        vals = []
        for x in (p.strip() for p in rhs.split(",")):
            if not x:
                continue
            try:
                vals.append(json.loads(x))
            except json.JSONDecodeError:
                vals.append(x)
        if not vals:
            raise ConfigError(f"--param {item!r}: no value")
        value = vals[0] if len(vals) == 1 else vals
        for m in targets:
            self.mask_params.setdefault(m, {})[key] = value


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


def _bool(v, path: Path, key: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{path}: [timing] {key} must be true or false, got {v!r}")
    return v


def _limits(table: dict, path: Path) -> dict[str, int]:
    """``[backend_max_seqlen]``: backend -> S (ints or "48K")."""
    out = {}
    for b, v in table.items():
        try:
            out[b] = parse_seqlen(v)
        except ConfigError as e:
            raise ConfigError(f"{path}: [backend_max_seqlen] {b}: {e}") from None
    return out


def load_experiment(path: str | Path) -> Experiment:
    """Read a TOML experiment (unknown keys are errors, so typos never pass silently)."""
    path = Path(path)
    data = _load_toml(path)
    allowed_top = {"experiment", "grid", "timing", "mask_params", "backend_max_seqlen"}
    bad = sorted(set(data) - allowed_top)
    if bad:
        raise ConfigError(f"{path}: unknown table(s) {', '.join(bad)}; valid: {', '.join(sorted(allowed_top))}")
    exp = data.get("experiment", {})
    grid = data.get("grid", {})
    timing = data.get("timing", {})
    for table, keys, got in (
        ("experiment", {"name", "description", "kind"}, exp),
        ("grid", {"masks", "seqlens", "heads", "head_dim", "dtype", "modes", "backends", "batch", "seed"}, grid),
        ("timing", {"warmup_ms", "rep", "max_ms", "check", "interleave"}, timing),
    ):
        extra = sorted(set(got) - keys)
        if extra:
            raise ConfigError(f"{path}: unknown key(s) {', '.join(extra)} in [{table}]; valid: {', '.join(sorted(keys))}")
    e = Experiment(
        name=exp.get("name", path.stem),
        description=exp.get("description", ""),
        kind=exp.get("kind", "dense"),
        masks=_as_list(grid.get("masks", ["full", "causal"])),
        seqlens=_as_list(grid.get("seqlens", [4096])),
        heads=_as_list(grid.get("heads", ["64:8"])),
        head_dims=_as_list(grid.get("head_dim", [128])),  # ints or "D_qk/D_v"; validate() normalises
        dtypes=_as_list(grid.get("dtype", ["bfloat16"])),
        modes=_as_list(grid.get("modes", ["fwd", "bwd"])),
        backends=_as_list(grid.get("backends", ["reference"])),
        batch=grid.get("batch", 1),
        seed=grid.get("seed", 0),
        mask_params={k: dict(v) for k, v in data.get("mask_params", {}).items()},
        backend_max_seqlen=_limits(data.get("backend_max_seqlen", {}), path),
        warmup_ms=float(timing.get("warmup_ms", 25.0)),
        rep=timing.get("rep", 30),
        max_ms=None if timing.get("max_ms", 1500.0) in (None, 0) else float(timing.get("max_ms", 1500.0)),
        check=bool(timing.get("check", True)),
        interleave=_bool(timing.get("interleave", True), path, "interleave"),
        source=str(path),
    )
    return e

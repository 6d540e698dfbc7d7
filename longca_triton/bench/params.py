"""Experiment values: parsers (sequence lengths, heads, head dims, dtypes) and mask-parameter arithmetic
(``"S/3"``, ``"Hkv"``, ``"block/2"``) and sweeps; see :mod:`.config` for the TOML format."""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

import torch

__all__ = ["DTYPES", "KINDS", "MODES", "ConfigError", "format_head_dim", "normalize_head_dim", "parse_dtype",
           "parse_head_dim", "parse_heads", "parse_seqlen", "resolve_param", "resolve_params", "row_head_dim"]

MODES = ("fwd", "bwd", "fwd_bwd")
#: experiment kinds, one per ``bench`` command; sparse and varblock grids take block-sparse masks
KINDS = ("dense", "sparse", "varblock")
#: mask parameters whose value is a list (a sweep over them is a list of lists)
LIST_VALUED_PARAMS = frozenset({"doc_bounds", "doc_lens", "block_bounds", "q_block_bounds", "k_block_bounds"})
#: names an expression may use besides the mask's own numeric parameters
HEAD_VARS = ("Hq", "Hkv")
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


def _parse_pair(v: Any, sep: str, what: str) -> tuple[int, int]:
    """``"a<sep>b"`` -> ``(a, b)``; a single ``"a"`` (or int) means ``(a, a)``; positive integers,
    else ``ConfigError`` saying ``what`` it must look like."""
    if isinstance(v, bool):
        raise ConfigError(f"{v!r} must look like {what}")
    parts = list(v) if isinstance(v, (tuple, list)) else str(v).strip().split(sep)
    try:
        nums = [int(str(p).strip()) for p in parts]
    except ValueError:
        raise ConfigError(f"{v!r} must look like {what}") from None
    if len(nums) == 1:
        nums = nums * 2
    if len(nums) != 2 or min(nums) < 1:
        raise ConfigError(f"{v!r} must look like {what} with positive numbers")
    return nums[0], nums[1]


def parse_heads(v: Any) -> tuple[int, int]:
    """``"64:8"`` -> ``(64, 8)`` (query heads : key/value heads); ``"64"`` or ``64`` means MHA."""
    hq, hkv = _parse_pair(v, ":", "heads 64:8 (query heads : key/value heads)")
    if hq % hkv:
        raise ConfigError(f"heads {v!r}: query heads {hq} must be a multiple of key/value heads {hkv}")
    return hq, hkv


def parse_head_dim(v: Any) -> tuple[int, int]:
    """A head dim: ``128`` or ``"128"`` -> ``(128, 128)``; ``"192/128"`` -> ``(192, 128)``, the head
    dim of q and k, then v's (``D_qk/D_v``, as in multi-head latent attention)."""
    return _parse_pair(v, "/", "a head dim 128 or D_qk/D_v 192/128")


def format_head_dim(d_qk: int, d_v: int | None = None) -> str:
    """``"128"``, or ``"192/128"`` when v's head dim differs (the form ``parse_head_dim`` reads)."""
    return str(d_qk) if d_v is None or int(d_v) == int(d_qk) else f"{int(d_qk)}/{int(d_v)}"


def normalize_head_dim(v: Any) -> int | str:
    """A grid's head-dim entry in canonical form: an int when q, k and v share it (``"96"`` -> 96,
    as old grids wrote it), else ``"D_qk/D_v"``."""
    d_qk, d_v = parse_head_dim(v)
    return d_qk if d_qk == d_v else f"{d_qk}/{d_v}"


def row_head_dim(row: dict) -> str:
    """A result row's head dim as ``format_head_dim`` writes it: its ``head_dim`` (``D_qk``, the
    only field of rows written before ``d_v`` existed) and its ``d_v`` when present."""
    return format_head_dim(row.get("head_dim"), row.get("d_v")) if row.get("head_dim") is not None else "?"


def parse_dtype(v: Any) -> torch.dtype:
    if isinstance(v, torch.dtype) and v in DTYPE_CANON:
        return v
    key = str(v).strip().lower().replace("torch.", "")
    if key not in DTYPES:
        raise ConfigError(f"dtype {v!r} unknown; valid: bfloat16 (bf16), float16 (fp16), float32 (fp32)")
    return DTYPES[key]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg}


_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


def _eval_expr(value: str, scope: dict) -> int:
    """``value`` (arithmetic over the names in ``scope``) rounded down to an int."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in scope:
                raise ConfigError(f"mask parameter {value!r}: unknown name {node.id!r} (known: {', '.join(sorted(scope))})")
            v = scope[node.id]
            if v is None:
                raise ConfigError(f"mask parameter {value!r}: {node.id} is not known here (the point's heads are needed)")
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"mask parameter {value!r}: {node.id} = {v!r} is not a number")
            return v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ConfigError(f"mask parameter {value!r}: only numbers, {', '.join(sorted(scope))} and + - * / // % are allowed")

    try:
        tree = ast.parse(value, mode="eval")
    except SyntaxError:
        raise ConfigError(f"mask parameter {value!r} is not an arithmetic expression") from None
    try:
        return int(ev(tree))
    except ZeroDivisionError:
        raise ConfigError(f"mask parameter {value!r} divides by zero") from None


def _is_expr(value: Any, names) -> bool:
    return isinstance(value, str) and bool(set(_NAME.findall(value)) & set(names))


def resolve_param(value: Any, seqlen: int, env: dict | None = None) -> Any:
    """A mask parameter: strings naming ``S`` (or a name in ``env``, e.g. ``Hkv``) are arithmetic
    (``"S/3"``, ``"S//16"``), rounded down to an int; lists are resolved element-wise; anything
    else is returned unchanged."""
    if isinstance(value, (list, tuple)):
        return [resolve_param(v, seqlen, env) for v in value]
    scope = {"S": seqlen, **(env or {})}
    if not _is_expr(value, scope):
        return value
    return _eval_expr(value, scope)


def resolve_params(params: dict, seqlen: int, heads: tuple[int, int] | None = None) -> dict:
    """Resolve one mask variant's parameters at a point: ``S``, ``Hq``, ``Hkv`` and the variant's
    other numeric parameters (``min_block = "block/2"``) may appear in string expressions."""
    env = {"S": seqlen, "Hq": heads[0] if heads else None, "Hkv": heads[1] if heads else None}
    names = set(env) | set(params)
    out, pending = {}, {}
    for k, v in params.items():
        if isinstance(v, (list, tuple)):
            out[k] = [resolve_param(x, seqlen, env) for x in v]
        elif _is_expr(v, names):
            pending[k] = v
        else:
            out[k] = v
    while pending:
        progressed = False
        for k, v in list(pending.items()):
            refs = (set(_NAME.findall(v)) & set(params)) - set(env)
            if refs & set(pending):
                continue  # resolve what it refers to first
            out[k] = _eval_expr(v, {**env, **{r: out[r] for r in refs}})
            del pending[k]
            progressed = True
        if not progressed:
            raise ConfigError(f"mask parameters {', '.join(f'{k} = {v!r}' for k, v in pending.items())} refer to each other in a cycle")
    return {k: out[k] for k in params}


def _is_sweep(key: str, value: Any) -> bool:
    if not isinstance(value, (list, tuple)):
        return False
    if key in LIST_VALUED_PARAMS:
        return bool(value) and all(isinstance(x, (list, tuple)) for x in value)
    return True


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _as_list(v: Any) -> list:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return list(v)
    if isinstance(v, str):
        return [x.strip() for x in v.split(",") if x.strip()]
    return [v]

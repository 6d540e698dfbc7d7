"""``recommend``: which kernel and which context-parallel scheme for a mask, a length and a GPU count,
answered from measured results, and saying so whenever it extrapolates.

Kernel: among the result rows of this mask, heads, head dim and dtype, the measured sequence length
nearest to the request (in log scale) is taken and its backends ranked by TFLOP/s of the requested
mode (``fwd_bwd`` = forward and backward time added, or a measured ``fwd_bwd`` row). A different
length is an extrapolation and is said to be one; backends that could not run the case are listed
with their reason.

CP (more than one GPU): measured efficiency (``bench cp`` rows of this mask at this GPU count,
nearest tokens per GPU) when there is any. Otherwise a model: the kernel's measured time scaled to
the request (attention work grows with the mask's area; time per FLOP kept); per scheme the busiest
rank's share of that work under the scheme's plan (``cp.plan.make_plan``'s imbalance: zigzag over
the ranks sharing the sequence, GroupCast's balanced plan), plus each scheme's bytes from
``longca-triton comm`` (``cp.comm.comm_model``) over an assumed link bandwidth: ring hops hidden
behind all but one step's compute, all-to-alls, all-gathers and reduce-scatters not at all.
Schemes within half a percent are ordered by bytes moved, and the answer says so. It names the
model, its bandwidth and what it leaves out.
"""

from __future__ import annotations

import glob
import json
import math
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Recommendation", "load_rows", "recommend", "default_results", "why_not", "LINK_GBPS", "WHY_NOT"]

#: assumed per-GPU link bandwidth (GB/s, one direction) for the CP model: NVLink inside an 8-GPU
#: node, InfiniBand (one 400 Gb/s NIC per GPU) beyond it
LINK_GBPS = {"intra-node (NVLink)": 400.0, "inter-node (InfiniBand)": 50.0}
#: result kinds that time one kernel on one GPU (CP rows are kind "cp")
KERNEL_KINDS = ("dense", "sparse", "varblock", None)


@dataclass
class Recommendation:
    mask: str
    seqlen: int
    gpus: int
    mode: str
    head_dim: str = "128"  # "D", or "D_qk/D_v"
    params: dict = field(default_factory=dict)  # the mask generator's parameters given (docs/masks.md)
    kernel: dict | None = None  # backend, tflops, ms, measured_seqlen, extrapolated, gpu, file
    kernel_ranking: list = field(default_factory=list)  # [(backend, tflops)]
    cannot_run: dict = field(default_factory=dict)  # backend -> its row's whole status
    cp: dict | None = None  # scheme, plan, efficiency, source, ...
    cp_ranking: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def lines(self) -> list[str]:
        given = f" ({', '.join(f'{k}={v}' for k, v in self.params.items())})" if self.params else ""
        out = [f"{self.mask}{given}, S = {self.seqlen:,}, head dim {self.head_dim}, {self.gpus} "
               f"GPU{'s' if self.gpus > 1 else ''}, {self.mode}:"]
        if self.kernel is None:
            out.append("  kernel: nothing measured supports this case (no ok row for this mask, heads, head dim, dtype)")
        else:
            k = self.kernel
            where = (f"measured at S = {k['measured_seqlen']:,}" if not k["extrapolated"] else
                     f"nearest measured S = {k['measured_seqlen']:,} (requested {self.seqlen:,}: extrapolated, "
                     f"the ranking may change with length)")
            out.append(f"  kernel: {k['backend']} at {k['tflops']:.0f} TFLOP/s ({where}, {k['gpu']})")
            if len(self.kernel_ranking) > 1:
                out.append("    then: " + ", ".join(f"{b} {t:.0f}" for b, t in self.kernel_ranking[1:6]))
            by_why: dict[str, list[str]] = {}
            for b, status in sorted(self.cannot_run.items()):
                by_why.setdefault(why_not(status), []).append(b)
            for why in WHY_NOT:
                if why in by_why:
                    out.append(f"    {why}: " + "; ".join(
                        f"{b} ({_short(self.cannot_run[b])})" if why != NOT_INSTALLED else b for b in by_why[why]))
        if self.cp is not None:
            c = self.cp
            out.append(f"  context parallelism: {c['scheme']} ({c['plan']}) at efficiency {c['efficiency']:.2f} "
                       f"[{c['source']}]")
            if len(self.cp_ranking) > 1:
                out.append("    then: " + ", ".join(f"{s} {e:.2f}" for s, e in self.cp_ranking[1:6]))
        out += [f"  note: {n}" for n in self.notes]
        return out


NOT_INSTALLED = "not installed where measured"
#: why a backend has no number for a case, in the order the answer lists them: absent from the
#: machine that measured (it may well run the case elsewhere), cannot run this mask or shape, ran
#: out of memory, failed
WHY_NOT = (NOT_INSTALLED, "cannot run this case", "out of memory", "failed")
_ABSENT = re.compile(r"not installed|cannot import|has no flash_attn_func|is another package", re.IGNORECASE)


def why_not(status: str) -> str:
    """One of ``WHY_NOT`` for a row's status that is not ok."""
    if status.startswith("oom"):
        return "out of memory"
    if status.startswith("unsupported"):
        return NOT_INSTALLED if _ABSENT.search(status) else "cannot run this case"
    return "failed"


def _short(status: str, width: int = 100) -> str:
    """A status for the text answer: cut at a word boundary (marked) where longer than ``width``; the
    JSON answer keeps it whole."""
    return textwrap.shorten(status, width, placeholder=" [...]")


def default_results() -> list[Path]:
    """The committed results of a checkout (``experiments/results/**/results.jsonl`` and
    ``results.jsonl.gz``; both in one folder: the plain one, with a warning:
    ``bench.store.prefer_plain``), if here."""
    from longca_triton.bench.store import prefer_plain

    found = [p for name in ("results.jsonl", "results.jsonl.gz")
             for p in glob.glob(f"experiments/results/**/{name}", recursive=True)]
    return prefer_plain(sorted(found))


def load_rows(paths) -> list[dict]:
    """Every GPU measurement row of the JSONL files, plain or gzipped (``.jsonl.gz``; a cut last line
    is skipped); each row remembers its file. A file without one (empty, not JSON lines, JSON of
    another kind: ``bench.store.result_rows``; only rows measured on a CPU, which are no performance
    numbers) is a ``ValueError`` naming it."""
    from longca_triton.bench.store import is_result_row, on_cpu, read_lines, result_rows

    rows = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise FileNotFoundError(f"results file {p} not found")
        mine = []
        for line in read_lines(p):
            try:
                r = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):  # a garbled line
                continue
            if is_result_row(r):
                r["_file"] = str(p)
                mine.append(r)
        if not mine:
            result_rows(p)  # raises: not a results file, and why
        gpu = [r for r in mine if not on_cpu(r)]
        if not gpu:
            raise ValueError(f"{p}: all {len(mine)} rows were measured on a CPU (the Triton interpreter), whose "
                             f"timings are not performance numbers; recommend needs rows measured on a GPU")
        rows += gpu
    return rows


def _log_dist(a: float, b: float) -> float:
    return abs(math.log2(max(a, 1)) - math.log2(max(b, 1)))


def _same_problem(r: dict, mask, heads, head_dim, dtype) -> bool:
    """``head_dim``: ``(D_qk, D_v)``; a row without ``d_v`` (written before it existed) has ``D_v = head_dim``."""
    d_qk, d_v = head_dim
    return (r.get("mask") == mask and r.get("heads_q") == heads[0] and r.get("heads_kv") == heads[1]
            and r.get("head_dim") == d_qk and r.get("d_v", r.get("head_dim")) == d_v and r.get("dtype") == dtype)


def _label(r: dict) -> str:
    """The backend under its current name, with the mask variant when the row has one (block-sparse
    rows of several blocks / densities are told apart, not pooled)."""
    from longca_triton.adapters.base import canonical_name

    name = canonical_name(r["backend"])
    variant = r.get("mask_label")
    return f"{name} [{variant}]" if variant and variant != r.get("mask") else name


def _kernel_times(rows: list[dict], mode: str) -> dict[tuple, dict]:
    """``{(backend, seqlen): {tflops, ms, gpu, file}}`` for ok rows of the mode (fwd_bwd: fwd + bwd)."""
    by: dict[tuple, dict] = {}
    for r in rows:
        if r.get("status") != "ok" or not r.get("time_ms"):
            continue
        by.setdefault((_label(r), r["seqlen"]), {})[r["mode"]] = r
    out = {}
    for key, modes in by.items():
        if mode in modes:
            r = modes[mode]
            out[key] = dict(tflops=r["tflops"], ms=r["time_ms"], gpu=r.get("gpu"), file=r["_file"], flops=r["flops"])
        elif mode == "fwd_bwd" and "fwd" in modes and "bwd" in modes:
            f, b = modes["fwd"], modes["bwd"]
            ms = f["time_ms"] + b["time_ms"]
            flops = f["flops"] + b["flops"]
            out[key] = dict(tflops=flops / (ms * 1e-3) / 1e12, ms=ms, gpu=f.get("gpu"), file=f["_file"], flops=flops)
    return out


def recommend(rows: list[dict], mask: str, seqlen: int, gpus: int = 1, *, heads=(64, 8), head_dim: int | str = 128,
              mode: str = "fwd_bwd", dtype: str = "bfloat16", params: dict | None = None) -> Recommendation:
    """The best kernel and (for ``gpus > 1``) the best CP scheme x plan; see the module docstring.
    ``head_dim``: ``128``, ``"96"`` or ``"192/128"`` (``D_qk/D_v``), as ``bench.params.parse_head_dim``.
    ``params``: the mask generator's parameters (``window``, ``doc_lens``, ...; docs/masks.md): rows
    measured with them where there are any (else the study's, and the answer says so); the CP model
    and the length scaling build the mask with them. An unknown parameter is a ``ValueError``."""
    from longca_triton.bench.params import format_head_dim, parse_head_dim

    head_dim = parse_head_dim(head_dim)
    if mode not in ("fwd", "bwd", "fwd_bwd"):
        raise ValueError(f"unknown mode {mode!r}; use fwd, bwd or fwd_bwd")
    if seqlen < 1 or gpus < 1:
        raise ValueError(f"sequence length and GPU count must be positive, got S={seqlen}, gpus={gpus}")
    rec = Recommendation(mask=mask, seqlen=int(seqlen), gpus=int(gpus), mode=mode, head_dim=format_head_dim(*head_dim),
                         params=dict(params or {}))
    from longca_triton.bench.report import latest_rows

    _check_params(mask, rec.params, rec.seqlen)
    # one row per point, the latest (a "not installed" row never hides a measurement): as findings
    mine = [r for r in latest_rows(r for r in rows if r.get("kind") in KERNEL_KINDS)
            if _same_problem(r, mask, heads, head_dim, dtype)]
    mine = _one_variant(rec, mine)
    times = _kernel_times(mine, mode)
    if times:
        lengths = sorted({s for _, s in times})
        near = min(lengths, key=lambda s: (_log_dist(s, seqlen), -s))
        ranking = sorted(((b, t["tflops"]) for (b, s), t in times.items() if s == near), key=lambda x: -x[1])
        best = times[(ranking[0][0], near)]
        rec.kernel = dict(backend=ranking[0][0], tflops=ranking[0][1], ms=best["ms"], measured_seqlen=near,
                          extrapolated=near != seqlen, gpu=best["gpu"], file=best["file"], flops=best["flops"])
        rec.kernel_ranking = ranking
        rec.cannot_run = {_label(r): r["status"] for r in mine if r.get("seqlen") == near
                          and r.get("status") != "ok" and _label(r) not in dict(ranking)}
    if gpus > 1:
        _recommend_cp(rec, rows, heads, head_dim, dtype)
    return rec


def _check_params(mask: str, params: dict, seqlen: int) -> None:
    """The generator takes these parameters at the requested length: else its ``ValueError``."""
    if params:
        from longca_triton.masks import MASK_SPECS, make_mask

        if MASK_SPECS[mask].kind == "dynamic":
            raise ValueError(f"recommend takes mask parameters for the static masks; {mask} is told apart by its "
                             f"measured block and density instead")
        make_mask(mask, seqlen, **params)


def _one_variant(rec: Recommendation, mine: list[dict]) -> list[dict]:
    """The rows of one parameter set per (backend, length): those measured with ``rec.params`` where
    the study has any (said so), else at each point the variant the study measured most (said so
    when parameters were given). Several variants of one point are never mixed."""
    from collections import Counter

    from longca_triton.bench.store import params_digest
    from longca_triton.masks import MASK_SPECS

    if not mine or MASK_SPECS[rec.mask].kind == "dynamic":
        return mine

    def digest(r: dict) -> str:  # the point's parameter digest, as the store keys it (store.row_key)
        return r.get("params_digest") or params_digest(r.get("mask_params"))

    if rec.params:
        want = {S: _digest_at(rec.mask, S, rec.params) for S in {r["seqlen"] for r in mine}}
        chosen = [r for r in mine if digest(r) == want[r["seqlen"]]]
        if _kernel_times(chosen, rec.mode):
            rec.notes.append("measured with these mask parameters")
            return chosen
        rec.notes.append(f"nothing measured with {', '.join(f'{k}={v}' for k, v in rec.params.items())}: the kernel "
                         f"numbers are of the parameters the study used (the ranking may differ); the CP model "
                         f"builds the mask with the given ones")
    common = Counter(digest(r) for r in mine)
    best: dict[tuple, str] = {}
    for r in mine:
        k = (_label(r), r["seqlen"])
        if k not in best or common[digest(r)] > common[best[k]]:
            best[k] = digest(r)
    return [r for r in mine if best[(_label(r), r["seqlen"])] == digest(r)]


def _digest_at(mask: str, seqlen: int, params: dict) -> str | None:
    """The parameter digest rows of ``mask`` built with ``params`` at ``seqlen`` carry (None where the
    parameters do not fit that length, e.g. document lengths summing to another one)."""
    from longca_triton.bench.store import params_digest
    from longca_triton.masks import make_mask

    try:
        return params_digest(make_mask(mask, seqlen, seed=0, **params).params)
    except ValueError:
        return None


def _recommend_cp(rec: Recommendation, rows, heads, head_dim, dtype) -> None:
    cp_mode = "fwd" if rec.mode == "fwd" else "fwd_bwd"
    if rec.mode == "bwd":
        rec.notes.append("CP is measured and modelled for fwd_bwd; its answer stands for the backward")
    tokens = rec.seqlen / rec.gpus
    from longca_triton.bench.report import latest_rows

    cp_rows = [r for r in latest_rows(r for r in rows if r.get("kind") == "cp") if _same_problem(r, rec.mask, heads, head_dim, dtype)
               and r.get("world_size") == rec.gpus and r.get("mode") == cp_mode and r.get("status") == "ok"
               and r.get("scheme") not in ("single", None) and r.get("efficiency")]
    if cp_rows:
        near = min({r["tokens_per_gpu"] for r in cp_rows}, key=lambda t: (_log_dist(t, tokens), -t))
        at = sorted((r for r in cp_rows if r["tokens_per_gpu"] == near), key=lambda r: -r["efficiency"])
        best = at[0]
        src = (f"measured on {best.get('gpu')} x {rec.gpus}, {near:,} tokens per GPU"
               + ("" if near == tokens else f" (requested {tokens:,.0f}: extrapolated)"))
        rec.cp = dict(scheme=best["scheme"], plan=best["plan"], efficiency=best["efficiency"], source=src,
                      gpu=best.get("gpu"))
        rec.cp_ranking = [(f"{r['scheme']}/{r['plan']}", r["efficiency"]) for r in at]
        if rec.kernel is not None and best.get("gpu") != rec.kernel["gpu"]:
            rec.notes.append(f"the kernel figures come from {rec.kernel['gpu']}, the CP figures from {best.get('gpu')}: "
                             f"the two were measured on different GPUs")
        return
    if rec.kernel is None:
        rec.notes.append("no CP measurement and no kernel measurement for this case: no CP answer")
        return
    _model_cp(rec, heads, head_dim)


def _model_cp(rec: Recommendation, heads, head_dim) -> None:
    from longca_triton.cp.comm import comm_model
    from longca_triton.cp.mesh import SCHEMES
    from longca_triton.masks import MASK_SPECS, make_mask

    k = rec.kernel
    # the kernel's time per FLOP at its measured length, applied to the requested length's FLOPs
    # range masks: the ratio of their areas (from intervals, cheap at 1M tokens; default parameters);
    # block-sparse masks keep the measured block and density, so their area grows as S^2 (building
    # a million-token block map just to count it would take tens of seconds)
    if MASK_SPECS[rec.mask].kind == "dynamic":
        area_ratio = (rec.seqlen / k["measured_seqlen"]) ** 2
    else:
        try:
            measured = make_mask(rec.mask, k["measured_seqlen"], **rec.params)
        except ValueError:  # parameters of the requested length only (document lengths): the study's mask there
            measured = make_mask(rec.mask, k["measured_seqlen"])
        area_ratio = make_mask(rec.mask, rec.seqlen, **rec.params).area / measured.area
    total_ms = k["ms"] * area_ratio  # the whole request on one GPU of the measured kind
    link = "intra-node (NVLink)" if rec.gpus <= 8 else "inter-node (InfiniBand)"
    bw = LINK_GBPS[link] * 1e9
    phases = ("fwd",) if rec.mode == "fwd" else ("fwd", "bwd")
    big = None if MASK_SPECS[rec.mask].kind == "dynamic" else make_mask(rec.mask, rec.seqlen, **rec.params)
    ranking, skipped = [], []
    for scheme in SCHEMES:
        try:
            ranking.append(_scheme_cost(scheme, rec.gpus, heads, head_dim, rec.seqlen, big, total_ms, bw, phases))
        except ValueError as e:
            skipped.append(f"{scheme}: {e}")
    if not ranking:
        rec.notes.append("no CP scheme fits these sizes: " + "; ".join(skipped))
        return
    # best efficiency first; within half a percent the scheme moving fewer bytes, then the simpler one
    order = {s: i for i, s in enumerate(_SIMPLER)}
    ranking.sort(key=lambda c: (-round(c["efficiency"] / 0.005), c["bytes"], order[c["scheme"]]))
    best = ranking[0]
    rec.cp = dict(scheme=best["scheme"], plan=best["plan"], efficiency=best["efficiency"],
                  imbalance=best["imbalance"], exposed_ms=best["exposed_ms"],
                  source=(f"model, not measured: {k['backend']}'s measured time scaled to S = {rec.seqlen:,} "
                          f"(x{area_ratio:.3g} of the mask's area) over {rec.gpus} GPUs; the busiest rank's share "
                          f"of the work under the scheme's plan (imbalance {best['imbalance']:.3f}); "
                          f"{best['comm_ms']:.1f} ms of transfers at {LINK_GBPS[link]:.0f} GB/s {link}, "
                          f"{best['exposed_ms']:.1f} ms of them not hidden behind compute; ignores kernel "
                          f"efficiency at the shorter per-GPU blocks"))
    rec.cp_ranking = [(c["scheme"], c["efficiency"]) for c in ranking]
    if len(ranking) > 1 and round(ranking[1]["efficiency"] / 0.005) == round(best["efficiency"] / 0.005):
        rec.notes.append(f"{best['scheme']} and {ranking[1]['scheme']} are within half a percent of each other: "
                         f"{best['scheme']} is named for moving fewer bytes ({best['bytes'] / 1e9:.2f} GB per GPU "
                         f"against {ranking[1]['bytes'] / 1e9:.2f})"
                         if best["bytes"] < ranking[1]["bytes"] else
                         f"{best['scheme']} and {ranking[1]['scheme']} tie (efficiency and bytes moved): "
                         f"{best['scheme']} is named as the simpler one ({_SIMPLER_WHY[best['scheme']]})")
    rec.notes += [f"not applicable: {s}" for s in skipped]


#: the schemes from the simplest (fewest communicators and steps to set up and debug) to the most
#: involved: what a tie in efficiency and bytes is decided by
_SIMPLER = ("ring_p2p", "ulysses", "ring_allgather", "usp", "loongtrain", "group_cast")
_SIMPLER_WHY = {
    "ring_p2p": "one ring of point-to-point hops",
    "ulysses": "two all-to-alls around an unsplit attention",
    "ring_allgather": "one all-gather and one reduce-scatter",
    "usp": "a Ulysses group and a ring",
    "loongtrain": "a Ulysses group, an inner and an outer ring",
    "group_cast": "a plan-specific all-to-all of the needed keys",
}

#: the collectives of ``comm_model`` a ring hides behind its steps' compute (one hop per step);
#: the others (all-to-alls, all-gather, reduce-scatter) run before or after the attention
_RING_COLLECTIVES = ("p2p", "p2p_inner", "p2p_outer")


def _scheme_cost(scheme: str, gpus: int, heads, head_dim, seqlen: int, mask, total_ms: float, bw: float,
                 phases) -> dict:
    """One scheme's modelled efficiency: the single-GPU time over ``gpus`` against the busiest
    rank's compute (the mask's area under the scheme's plan: zigzag over its sequence-parallel ranks,
    GroupCast's balanced plan; heads split evenly) plus the transfers not hidden: ring hops beyond
    what ``R - 1`` of ``R`` steps' compute covers, every other collective in full."""
    from longca_triton.cp.comm import comm_model
    from longca_triton.cp.mesh import resolve_dims
    from longca_triton.cp.plan import make_plan

    U, W, O = resolve_dims(scheme, gpus, heads[0])
    R = W * O  # ranks sharing the sequence (the rest of the group shares the heads)
    kind = {"ulysses": "contiguous", "group_cast": "balanced"}.get(scheme, "zigzag")
    if scheme == "group_cast" and mask is None:
        raise ValueError("moves the key ranges of a range mask; block-sparse masks are not supported")
    plan = make_plan(mask, R, kind) if (mask is not None and R > 1) else None
    imbalance = plan.imbalance if plan is not None else 1.0
    # GroupCast's bytes come from its plan (built once: a balanced plan over 64 ranks takes seconds)
    rows = comm_model(scheme, gpus, None, seqlen, heads, head_dim[0], 2, mask if scheme == "group_cast" else None,
                      plan=plan if scheme == "group_cast" and plan is not None else "zigzag", head_dim_v=head_dim[1])
    ring = sum(r.bytes_sent for r in rows if r.phase in phases and r.collective in _RING_COLLECTIVES)
    other = sum(r.bytes_sent for r in rows if r.phase in phases and r.collective not in _RING_COLLECTIVES)
    compute = total_ms / gpus * imbalance
    ring_ms, other_ms = ring / bw * 1e3, other / bw * 1e3
    exposed = other_ms + max(0.0, ring_ms - compute * (R - 1) / R)
    return dict(scheme=scheme, plan=kind, efficiency=(total_ms / gpus) / (compute + exposed), imbalance=imbalance,
                comm_ms=ring_ms + other_ms, exposed_ms=exposed, bytes=ring + other)

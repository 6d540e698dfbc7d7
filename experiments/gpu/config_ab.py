"""Backward configs of our kernels timed interleaved on a GPU, next to Flex: by default the plain-Triton
backward with and without ``bwd_streams`` (the dQ launches on a second CUDA stream beside the
dK/dV ones, ``core.runtime.side_stream``); ``--configs`` names others (any kernel's config keys).

Run from the repository root on a CUDA machine (the package need not be installed):

    PYTHONUNBUFFERED=1 python experiments/gpu/config_ab.py --out $OUT --require-equal
    python experiments/gpu/config_ab.py --out $OUT --dense-masks '' --sparse uniform128:32768:0.3,varblock256:32768:0.3
    python experiments/gpu/config_ab.py --out $OUT --dense-masks '' --gluon-masks causal --no-flex \
        --configs '{"default": {}, "dq_mask_head": {"dq_mask_head": true}}'
    python experiments/gpu/config_ab.py --out $OUT --dense-masks '' --sparse varblock256:65536:0.3 --no-flex \
        --back-to-back --configs '{"default": {}, "dq8x16": {"DQ_BLOCK_M": 16, "DQ_HEADS": 8}}'

Per problem (dense masks as in ``dense_check.bench_mask`` at ``--S``, GQA 64:8, D = 128, bf16, for
``triton``, ``--gluon-masks`` for ``triton-gluon``, ``--flashmask-masks`` for ``triton-flashmask``;
block-sparse cases ``name:S:density`` of ``SPARSE_MASKS``, a pattern per KV head):

1. with ``--check``, each config's output, lse and gradients against float32 on one KV-head group
   (``bench.check``, the harness's check); each config's backward through autograd once: the gradients
   must be finite, and with ``--require-equal`` equal bit for bit across the configs (``bwd_streams``:
   same kernels, no atomics);
2. ``--rounds`` timings, each ``bench.timing.time_interleaved`` over every config and Flex (the
   backward of a kept graph; repetition r starts with variant r mod n, L2 flushed between calls), so a
   drifting SM clock weighs on every variant alike. The summary takes each variant's median over the
   rounds.
3. with ``--back-to-back``, each round also times every variant alone (``bench.timing.time_fn``, the harness's
   timer for a one-backend bucket), in the listed order in even rounds and reversed in odd ones; the table
   then has a second row per problem (``[back to back]``). Why: the two timers have disagreed by up to 5 % on
   one A/B (a dQ tile read +5.5 % interleaved and -1.5 % back to back), and targets are read through the
   harness, which times back to back.

Rows go to ``<out>/config_ab.jsonl`` as measured (``kind``: env / check / time); ``<out>/config_ab.md``
has the table. ``--smoke`` runs on the CPU interpreter at toy sizes (no Flex).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # a plain checkout runs without installing
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from longca_triton.bench.check import compare  # noqa: E402
from longca_triton.masks import STATIC_MASK_NAMES, aligned_block_bounds, make_mask  # noqa: E402

T0 = time.time()



SPARSE_MASKS = {  # name -> (make_mask name, block, extra parameters or a function of S giving them)
    "uniform128": ("block_sparse", 128, {}),
    "uniform64": ("block_sparse", 64, {}),
    "varblock256": ("varblock_sparse", 256, {"min_block": 128}),
    "varblock128": ("varblock_sparse", 128, {"min_block": 64}),
    "varblock512": ("varblock_sparse", 512, {"min_block": 256}),
    "varblock256x128": ("varblock_sparse", 256, aligned_block_bounds),
}


def flex_sparse_attn(p):
    from torch.nn.attention.flex_attention import flex_attention

    from longca_triton.adapters.flex import raise_recompile_limits
    from longca_triton.masks import flex_block_mask

    raise_recompile_limits()
    bm = flex_block_mask(p.mask, 128, device="cuda", num_heads=p.hq)
    flex = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: flex(*(t.transpose(1, 2).contiguous() for t in (q, k, v)), block_mask=bm,
                                enable_gqa=True).transpose(1, 2)


def check_autograd(emit, p, ref, attn, dtype, **row) -> bool:
    """``attn(q, k, v) -> (out, lse)`` run forward and backward on ``p``'s inputs and compared with
    ``ref`` (one KV group in float32); the check row emitted; False on a failure or an exception."""
    try:
        leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]
        out, lse = attn(*leaves)
        out.backward(p.dout)
        res = compare(ref, out.detach(), lse, [t.grad for t in leaves], dtype)
    except Exception as e:  # noqa: BLE001 - a variant that fails loses, the run goes on
        emit(dict(kind="check", **row, status=f"error: {e!r}"[:400]))
        return False
    emit(dict(kind="check", **row, **res.as_row(), message=res.message))
    return res.ok


def _len(S: int) -> str:
    return f"{S // 1024}K" if S % 1024 == 0 else str(S)


def _problem(mask, hq, hkv, d, dtype, dev):
    torch.manual_seed(0)
    S = mask.seqlen_q
    q, k, v, dout = (torch.randn(1, S, h, d, device=dev, dtype=dtype) for h in (hq, hkv, hkv, hq))
    return SimpleNamespace(mask=mask, q=q, k=k, v=v, dout=dout, hq=hq, hkv=hkv, d=d)


def _grads(p, attn):
    leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]
    out = attn(*leaves)
    return torch.autograd.grad(out, leaves, p.dout)


#: the default A/B: the plain-Triton backward with ``bwd_streams`` off and on
STREAMS = {"one-stream": {"bwd_streams": False}, "bwd_streams": {"bwd_streams": True}}


def _ours(kernel: str, p, configs: dict, lse: bool = False):
    """``{variant: attn(q, k, v) -> out}`` (``lse``: ``(out, lse)``), one per config of ``configs``."""
    from longca_triton.kernels.block_sparse.op import block_sparse_attention
    from longca_triton.kernels.dense.op import dense_attention
    from longca_triton.kernels.flashmask.op import flashmask_attention

    if kernel == "gluon":
        from longca_triton.kernels.gluon.op import gluon_attention as fn
    else:
        fn = {"dense": dense_attention, "sparse": block_sparse_attention, "flashmask": flashmask_attention}[kernel]
    return {name: (lambda q, k, v, c=cfg: fn(q, k, v, p.mask, config=c, return_lse=lse))
            for name, cfg in configs.items()}


def run_problem(emit, label: str, kernel: str, p, args, configs: dict, flex: bool) -> dict:
    from longca_triton.bench.timing import time_fn, time_interleaved

    if args.check:
        # each config against float32 on one KV-head group, as the harness checks a backend

        from longca_triton.bench.check import reference_group

        ref = reference_group(p.mask, p.q, p.k, p.v, p.dout, p.d ** -0.5, True)
        oks = [check_autograd(emit, p, ref, attn, p.q.dtype, problem=label, variant=n)
               for n, attn in _ours(kernel, p, configs, lse=True).items()]
        del ref
        if not all(oks):
            return dict(problem=label, status="check failed")
    variants = _ours(kernel, p, configs)
    grads = {n: _grads(p, a) for n, a in variants.items()}
    first = next(iter(grads.values()))
    equal = all(torch.equal(a, b) for gs in grads.values() for a, b in zip(first, gs))
    finite = all(bool(torch.isfinite(g).all()) for gs in grads.values() for g in gs)
    emit(dict(kind="check", problem=label, kernel=kernel, configs=configs, bitwise_equal=equal, finite=finite))
    if not finite or (args.require_equal and not equal):
        return dict(problem=label, status="check failed")
    if flex:

        variants["flex"] = flex_sparse_attn(p)
    del grads, first
    names = list(variants)
    times = {n: [] for n in names}
    b2b = {n: [] for n in names}
    bwd_flops = p.mask.flops(p.hq, p.d, "bwd")
    dev = p.q.device
    for r in range(args.rounds):
        # every variant's graph kept; its backward timed with the others' repetitions interleaved
        calls = []
        for n in names:
            leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]
            out = variants[n](*leaves)
            calls.append(lambda out=out, leaves=leaves: torch.autograd.grad(out, leaves, p.dout, retain_graph=True))
        stats = time_interleaved(calls, rep=args.rep, max_ms=args.ms, device=dev)
        for n, st in zip(names, stats):
            times[n].append(st["median_ms"])
            emit(dict(kind="time", problem=label, kernel=kernel, variant=n, round=r, ms=st["median_ms"],
                      reps=st.get("n", st.get("rep")), tflops=bwd_flops / st["median_ms"] * 1e-9))
        del calls
        if args.back_to_back:
            for n in (names if r % 2 == 0 else names[::-1]):
                leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]
                out = variants[n](*leaves)
                st = time_fn(lambda: torch.autograd.grad(out, leaves, p.dout, retain_graph=True), rep=args.rep,
                             max_ms=args.ms, device=dev)
                b2b[n].append(st["median_ms"])
                emit(dict(kind="time", timer="back_to_back", problem=label, kernel=kernel, variant=n, round=r,
                          ms=st["median_ms"], tflops=bwd_flops / st["median_ms"] * 1e-9))
                del out, leaves
    med = {n: statistics.median(t) for n, t in times.items()}
    row = dict(problem=label, ms=med, tflops={n: bwd_flops / m * 1e-9 for n, m in med.items()})
    if args.back_to_back:
        row["back_to_back"] = {n: bwd_flops / statistics.median(t) * 1e-9 for n, t in b2b.items()}
    return row


def table(rows: list, names: list) -> str:
    """TFLOP/s per variant, each later one against the first, and every one against Flex where it ran."""
    base = names[0]
    cols = names + [f"{n} / {base}" for n in names[1:]] + ["Flex"] + [f"{n} / Flex" for n in names]
    lines = ["| problem | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    f = lambda x: f"{x:.1f}" if x else "-"  # noqa: E731
    rat = lambda a, b: f"{a / b:.3f}" if a and b else "-"  # noqa: E731
    for r in rows:
        tf = r.get("tflops")
        if not tf:
            lines.append(f"| {r['problem']} | {r.get('status', '-')} |")
            continue
        for label, tf in ((r["problem"], tf), (f"{r['problem']} [back to back]", r.get("back_to_back"))):
            if tf is None:
                continue
            fx = tf.get("flex")
            cells = ([f(tf.get(n)) for n in names] + [rat(tf.get(n), tf.get(base)) for n in names[1:]] + [f(fx)]
                     + [rat(tf.get(n), fx) for n in names])
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--S", type=int, default=16384, help="dense sequence length")
    ap.add_argument("--dense-masks", default=",".join(STATIC_MASK_NAMES))
    ap.add_argument("--flashmask-masks", default="")
    ap.add_argument("--sparse", default="", help="comma-separated name:S:density (SPARSE_MASKS names)")
    ap.add_argument("--heads", default="64:8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--gluon-masks", default="", help="dense masks to run the Gluon tier (triton-gluon) on")
    ap.add_argument("--configs", default=None, metavar="JSON",
                    help='{"name": config, ...} of our kernels to compare (default: bwd_streams off / on)')
    ap.add_argument("--check", action="store_true",
                    help="check each config's output and gradients against float32 first (bench.check)")
    ap.add_argument("--require-equal", action="store_true",
                    help="skip the timing unless every config gives the same gradient bits (bwd_streams)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timings per problem")
    ap.add_argument("--rep", type=int, default=30, help="repetitions per variant per round (at most)")
    ap.add_argument("--ms", type=float, default=1500.0, help="timed ms per variant per round (at most)")
    ap.add_argument("--budget", type=float, default=560.0, help="wall-clock seconds; later problems are skipped")
    ap.add_argument("--back-to-back", action="store_true",
                    help="also time each variant alone every round (time_fn, the harness's timer)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, toy sizes, no Flex")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config_ab.jsonl"
    configs = json.loads(args.configs) if args.configs else dict(STREAMS)
    if not isinstance(configs, dict) or not configs:
        raise SystemExit(f"--configs must be a JSON object of name -> config, got {args.configs!r}")
    names = list(configs)

    def emit(row):
        row = {"elapsed_s": round(time.time() - T0, 1), **row}
        with open(path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        print(json.dumps(row, default=str), flush=True)

    if args.smoke:
        args.S, args.heads, args.head_dim, args.rounds, args.rep = 96, "4:2", 32, 2, 3
    dev = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    hq, hkv = (int(x) for x in args.heads.split(":"))
    flex = not (args.no_flex or args.smoke)
    if not args.smoke:
        emit(dict(kind="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=__import__("triton").__version__))
    import dense_check as DC

    jobs = []
    for m in filter(None, args.dense_masks.split(",")):
        jobs.append((f"dense {m} {_len(args.S)}", "dense", lambda m=m: DC.bench_mask(m, args.S)))
    for m in filter(None, args.gluon_masks.split(",")):
        jobs.append((f"gluon {m} {_len(args.S)}", "gluon", lambda m=m: DC.bench_mask(m, args.S)))
    for m in filter(None, args.flashmask_masks.split(",")):
        jobs.append((f"flashmask {m} {_len(args.S)}", "flashmask", lambda m=m: DC.bench_mask(m, args.S)))
    for spec in filter(None, args.sparse.split(",")):
        name, S, dens = spec.split(":")

        kind, block, extra = SPARSE_MASKS[name]
        extra = extra(int(S)) if callable(extra) else extra
        if args.smoke:  # toy blocks for the interpreter
            block, extra = 32, {"min_block": 16} if "min_block" in extra else {}
        jobs.append((f"{name} {_len(int(S))} d={dens}", "sparse",
                     lambda kind=kind, S=int(S), block=block, d=float(dens), extra=extra: make_mask(
                         kind, S, block=block, density=d, patterns=hkv, seed=0, **extra)))
    rows = []
    for label, kernel, mk in jobs:
        if time.time() - T0 > args.budget:
            emit(dict(kind="skipped", problem=label, reason="budget"))
            continue
        p = _problem(mk(), hq, hkv, args.head_dim, dtype, dev)
        rows.append(run_problem(emit, label, kernel, p, args, configs, flex))
        (out / "config_ab.md").write_text(table(rows, names) + "\n")
        del p
        if dev == "cuda":
            torch.cuda.empty_cache()
    print(table(rows, names))
    return rows


if __name__ == "__main__":
    main()

"""Issue 4's large-S checks of our dense kernels on a GPU: correctness at S = 32K and O(S) memory to 128K.

Run from the repository root on a CUDA machine after ``pip install -e .``:

    PYTHONUNBUFFERED=1 python3 experiments/gpu/dense_acceptance.py --out $OUT

1. correctness (bf16, GQA 64:8, D = 128, S = 32K, every static mask, each backend of
   ``--backends``): out, lse, dq, dk, dv against a float32 chunked reference (O(S·D) memory, TF32
   off); the bar is PyTorch's own bf16 attention on the same inputs (SDPA's memory-efficient
   kernel with the boolean mask, K/V heads expanded): ours must be within 2x its error.
2. memory: peak allocated memory *above* inputs and outputs (q, k, v, dout, out, lse, and dq, dk,
   dv for fwd+bwd) at S = 16K, 32K, 64K, 128K for full, causal and causal_document; O(S) means the
   extra bytes per token stay flat (128K / 64K ratio of the extra bytes <= 2.2).

Rows go to OUT/dense_acceptance.jsonl as they finish, a summary to OUT/dense_acceptance.md.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from longca_triton import attention
from longca_triton.bench.store import collect_env
from longca_triton.masks import STATIC_MASK_NAMES, make_mask
from longca_triton.reference import chunked_attention

T0 = time.time()
DEV = "cuda"  # --device cpu (with TRITON_INTERPRET=1) runs the correctness phase at toy sizes
HEADS = (64, 8, 128)  # Hq, Hkv, D
DTYPE = torch.bfloat16

#: ANCHORS.md's mask settings (as experiments/dense_16k.toml)
PARAMS = {"sliding_window": dict(window=1024), "sliding_window_causal": dict(window=1024),
          "global_sliding_window": dict(window=1024, global_tokens=1024), "prefix_lm_document": dict(prefix=512),
          "block_causal_document": dict(block=1024)}


def _mask(name, S):
    p = dict(PARAMS.get(name, {}))
    if name == "prefix_lm_causal":
        p["prefix"] = S // 3
    return make_mask(name, S, seed=0, **p)


def _rel(x, ref):
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _emit(out: Path, row: dict):
    row["t"] = round(time.time() - T0, 1)
    with open(out / "dense_acceptance.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def correctness(out: Path, backends, S, deadline):
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    Hq, Hkv, D = HEADS
    for name in STATIC_MASK_NAMES:
        if time.time() > deadline:
            print(f"correctness: out of time before {name}")
            break
        mask = _mask(name, S)
        torch.manual_seed(0)
        q, k, v, dout = (torch.randn(1, S, h, D, device=DEV, dtype=DTYPE) for h in (Hq, Hkv, Hkv, Hq))
        # float32 truth, chunked (O(S·D))
        q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
        o, lse_ref = chunked_attention(q32, k32, v32, mask, return_lse=True, chunk=2048)
        o.backward(dout.float())
        ref = dict(out=o.detach(), dq=q32.grad, dk=k32.grad, dv=v32.grad)
        del q32, k32, v32, o
        # PyTorch's own bf16 attention, same inputs
        g = Hq // Hkv
        qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
        allowed = mask.to_dense().to(DEV)
        bar_kind = "sdpa-efficient(bool mask)"
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                to = F.scaled_dot_product_attention(qb.transpose(1, 2), kb.repeat_interleave(g, 2).transpose(1, 2),
                                                    vb.repeat_interleave(g, 2).transpose(1, 2),
                                                    attn_mask=allowed).transpose(1, 2)
            to.backward(dout)
        except RuntimeError as e:  # no efficient kernel for this case: the chunked reference in bf16
            print(f"{name}: SDPA efficient failed ({str(e)[:80]}); bf16 chunked reference as the bar")
            bar_kind = "chunked reference in bf16"
            qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
            to = chunked_attention(qb, kb, vb, mask, chunk=2048)
            to.backward(dout)
        bar = dict(out=to.detach(), dq=qb.grad, dk=kb.grad, dv=vb.grad)
        del allowed, to, qb, kb, vb
        bar_err = {n: _rel(bar[n], ref[n]) for n in bar}
        del bar
        for backend in backends:
            qo, ko, vo = (t.clone().requires_grad_() for t in (q, k, v))
            row = dict(phase="correctness", backend=backend, mask=name, S=S, heads=f"{Hq}:{Hkv}", D=D, dtype=str(DTYPE)[6:],
                       bar=bar_kind)
            try:
                if DEV == "cuda":
                    torch.cuda.synchronize()
                    # poison freed blocks so an unwritten output element cannot pass
                    torch.empty(S * Hq * D, device=DEV, dtype=torch.float32).fill_(float("nan"))
                oo, ll = attention(qo, ko, vo, mask, backend=backend, return_lse=True)
                oo.backward(dout)
                got = dict(out=oo.detach(), dq=qo.grad, dk=ko.grad, dv=vo.grad)
                ok = True
                for n in got:
                    e = _rel(got[n], ref[n])
                    row[f"err_{n}"], row[f"torch_err_{n}"] = e, bar_err[n]
                    row[f"ratio_{n}"] = e / max(bar_err[n], 1e-12)
                    ok &= (not math.isnan(e)) and e <= 2 * bar_err[n]
                fin = torch.isfinite(lse_ref)
                row["lse_max_abs_err"] = (ll[fin] - lse_ref[fin]).abs().max().item() if fin.any() else 0.0
                row["lse_inf_match"] = bool(torch.equal(torch.isinf(ll), torch.isinf(lse_ref)))
                ok &= row["lse_inf_match"] and row["lse_max_abs_err"] < 5e-2
                row["pass"] = bool(ok)
                del got, oo, ll
            except Exception as e:  # noqa: BLE001 - report and go on
                row["pass"] = False
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            _emit(out, row)
            rows.append(row)
            del qo, ko, vo
        del q, k, v, dout, ref, lse_ref
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return rows


def memory(out: Path, backends, seqlens, deadline):
    rows = []
    Hq, Hkv, D = 64, 8, 128
    for backend in backends:
        for name in ("causal_document", "causal", "full"):
            for S in seqlens:
                if time.time() > deadline:
                    print(f"memory: out of time before {backend} {name} {S}")
                    return rows
                mask = _mask(name, S)
                torch.cuda.empty_cache()
                torch.manual_seed(0)
                q = torch.randn(1, S, Hq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                k = torch.randn(1, S, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                v = torch.randn(1, S, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                dout = torch.randn_like(q)
                row = dict(phase="memory", backend=backend, mask=name, S=S, heads="64:8", D=D, dtype="bf16")
                try:
                    # warm-up (compile, tile plans cached on the mask) outside the measurement
                    o = attention(q, k, v, mask, backend=backend)
                    o.backward(dout)
                    q.grad = k.grad = v.grad = None
                    del o
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    with torch.no_grad():
                        o, lse = attention(q, k, v, mask, backend=backend, return_lse=True)
                    torch.cuda.synchronize()
                    io_fwd = o.numel() * o.element_size() + lse.numel() * lse.element_size()
                    row["fwd_extra_bytes"] = torch.cuda.max_memory_allocated() - base - io_fwd
                    del o, lse
                    torch.cuda.empty_cache()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    o, lse = attention(q, k, v, mask, backend=backend, return_lse=True)
                    o.backward(dout)
                    torch.cuda.synchronize()
                    io = io_fwd + sum(t.numel() * t.element_size() for t in (q, k, v))  # + dq, dk, dv
                    row["fwd_bwd_extra_bytes"] = torch.cuda.max_memory_allocated() - base - io
                    row["fwd_extra_per_token"] = row["fwd_extra_bytes"] / S
                    row["fwd_bwd_extra_per_token"] = row["fwd_bwd_extra_bytes"] / S
                    del o, lse
                except torch.cuda.OutOfMemoryError as e:
                    row["error"] = f"oom: {str(e)[:200]}"
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                _emit(out, row)
                rows.append(row)
                del q, k, v, dout
    return rows


def summary(out: Path, crow, mrows, env):
    lines = [f"# Dense kernels: correctness at 32K and memory to 128K ({env.get('gpu')})", "",
             f"torch {env.get('torch')}, Triton {env.get('triton')}, CUDA {env.get('cuda')}, driver {env.get('driver')}, "
             f"commit {env.get('git_commit')}", "",
             "## Correctness (bf16, GQA 64:8, D = 128; error = relative L2 vs float32; bar = PyTorch bf16 error)", "",
             "| backend | mask | out | dq | dk | dv | worst ratio to PyTorch bf16 | lse max abs | pass |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in crow:
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['mask']} | error: {r['error'][:80]} | | | | | | NO |")
            continue
        worst = max(r[f"ratio_{n}"] for n in ("out", "dq", "dk", "dv"))
        lines.append(f"| {r['backend']} | {r['mask']} | " + " | ".join(f"{r['err_' + n]:.2e}" for n in ("out", "dq", "dk", "dv"))
                     + f" | {worst:.2f} | {r['lse_max_abs_err']:.1e} | {'yes' if r['pass'] else 'NO'} |")
    lines += ["", "## Peak memory above inputs and outputs", "",
              "| backend | mask | S | fwd extra MiB | fwd+bwd extra MiB | fwd+bwd extra bytes / token |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in mrows:
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['mask']} | {r['S']} | {r['error'][:60]} | | |")
        else:
            lines.append(f"| {r['backend']} | {r['mask']} | {r['S']} | {r['fwd_extra_bytes'] / 2**20:.1f} | "
                         f"{r['fwd_bwd_extra_bytes'] / 2**20:.1f} | {r['fwd_bwd_extra_per_token']:.0f} |")
    # O(S) verdict per (backend, mask): the extra bytes at the two largest S grow at most linearly
    verdicts = []
    for key in sorted({(r["backend"], r["mask"]) for r in mrows if "error" not in r}):
        pts = sorted((r["S"], r["fwd_bwd_extra_bytes"]) for r in mrows if (r["backend"], r["mask"]) == key and "error" not in r)
        if len(pts) >= 2:
            (s1, b1), (s2, b2) = pts[-2], pts[-1]
            ratio = b2 / max(b1, 1)
            lim = 1.1 * s2 / s1
            verdicts.append(f"- {key[0]} {key[1]}: extra bytes x{ratio:.2f} from S={s1} to S={s2} "
                            f"(linear would be x{s2 / s1:.0f}): {'O(S)' if ratio <= lim else 'GROWS FASTER THAN S'}")
    lines += [""] + verdicts
    (out / "dense_acceptance.md").write_text("\n".join(lines) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/dense-acceptance")
    p.add_argument("--backends", default="triton,triton-flashmask")
    p.add_argument("-S", "--seqlen", type=int, default=32768)
    p.add_argument("--mem-seqlens", default="16384,32768,65536,131072")
    p.add_argument("--max-minutes", type=float, default=6.0)
    p.add_argument("--skip", default="", help="phases to skip: correctness,memory")
    p.add_argument("--heads", default="64:8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--device", default="cuda", help="cpu: correctness only, float16, in the Triton interpreter")
    a = p.parse_args()
    global DEV, DTYPE, HEADS
    DEV = a.device
    DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16
    hq, _, hkv = a.heads.partition(":")
    HEADS = (int(hq), int(hkv or hq), a.head_dim)
    if DEV != "cuda":
        a.skip += ",memory"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from longca_triton.adapters import get_backend

    backends = []
    for b in a.backends.split(","):
        try:
            ok, why = get_backend(b).available()
        except Exception as e:  # noqa: BLE001
            ok, why = False, str(e)
        if ok:
            backends.append(b)
        else:
            print(f"skipping {b}: {why}")
    env = collect_env()
    deadline = T0 + a.max_minutes * 60
    crow = [] if "correctness" in a.skip else correctness(out, backends, a.seqlen, T0 + 0.6 * (deadline - T0))
    mrows = [] if "memory" in a.skip else memory(out, backends, [int(s) for s in a.mem_seqlens.split(",")], deadline)
    summary(out, crow, mrows, env)
    print((out / "dense_acceptance.md").read_text())


if __name__ == "__main__":
    main()

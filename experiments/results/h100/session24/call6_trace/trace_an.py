"""Session 24, call 6: read the per-step clock traces of the Gluon forward (patches/step_trace.patch: each
consumer of CTAs 0-15 stores seven SM clock reads per key-tile step 16..47 into the LO table's place).

    python experiments/results/h100/session24/call6_trace/trace_an.py experiments/results/h100/session24/call6_trace/trace_*.json

Per step: waiting for the ping-pong token, for K's tile, from K's arrival to S_j (Q K^T and P_{j-1} V_{j-1} issued,
S_j waited), the softmax, the P V wait, the rest (rescale, P conversion, the trace's own stores), the period.
"""
import json, sys, statistics as st
def u(x):  # int32 clock deltas, wrap-safe
    return x & 0xffffffff
for f in sys.argv[1:]:
    t = json.load(open(f))
    ncons = {"d96": 2, "d128_2c": 2, "d128": 3, "d64": 3}.get(t["name"]) or t["cfg"].get("consumers", 2)
    flat = [x for a in t["trace"] for b in a for c in b for x in c]
    tr = [[[flat[((cta * ncons + w) * 32 + j) * 8:((cta * ncons + w) * 32 + j) * 8 + 8] for j in range(32)]
           for w in range(ncons)] for cta in range(16)]
    stats = {k: [] for k in ("wait_tok", "wait_k", "S_ready", "softmax", "pv_wait", "tail", "period")}
    overlap = []
    for cta in range(16):
        for wg in range(ncons):
            rows = tr[cta][wg]
            for j in range(1, 32):
                c = rows[j]; p = rows[j - 1]
                if not any(c) or not any(p): continue
                stats["wait_tok"].append(u(c[1] - c[0])); stats["wait_k"].append(u(c[2] - c[1]))
                stats["S_ready"].append(u(c[3] - c[2])); stats["softmax"].append(u(c[4] - c[3]))
                stats["pv_wait"].append(u(c[5] - c[4])); stats["tail"].append(u(c[6] - c[5]))
                stats["period"].append(u(c[6] - p[6]))
        # overlap of WG0's softmax [c3,c4] with the other consumers' softmax windows, per step
        for j in range(1, 32):
            iv = [(tr[cta][w][j][3], tr[cta][w][j][4]) for w in range(ncons) if any(tr[cta][w][j])]
            if len(iv) < 2: continue
            a0, a1 = iv[0]
            for b0, b1 in iv[1:]:
                overlap.append(max(0, u(min(a1, b1) - max(a0, b0)) if min(a1, b1) > max(a0, b0) else 0))
    print(t["name"], t["cfg"], "consumers", ncons)
    for k, v in stats.items():
        print(f"  {k:9s} median {st.median(v):7.0f}  p10 {sorted(v)[len(v)//10]:7.0f}  p90 {sorted(v)[9*len(v)//10]:7.0f}")
    print(f"  softmax overlap with another consumer's softmax: median {st.median(overlap):.0f} clocks")
    # one CTA's timeline, steps 10..13, relative to WG0 step 10 c2
    cta = 3
    base = tr[cta][0][10][2]
    for j in range(10, 13):
        print("   step", j, " | ".join(f"WG{w}: k {u(tr[cta][w][j][2]-base):6d} S {u(tr[cta][w][j][3]-base):6d} sm {u(tr[cta][w][j][4]-base):6d} pv {u(tr[cta][w][j][5]-base):6d} end {u(tr[cta][w][j][6]-base):6d}" for w in range(ncons)))

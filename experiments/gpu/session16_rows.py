"""Print the rows of a ``bwd_variants.jsonl`` one per line: checks, times, and the passes timed alone."""
import json
import sys

for line in open(sys.argv[1]):
    r = json.loads(line)
    kind = r.get("kind")
    if kind == "check":
        print("check", r.get("variant"), r.get("ok"), r.get("status", ""), str(r.get("message", ""))[:100])
    elif kind == "bwd":
        print(f"{r.get('variant'):45s} {r.get('ms', 0):8.2f} ms {r.get('tflops', 0):6.1f} TFLOP/s", r.get("status", ""))
    elif kind == "split":
        print(f"{'  split ' + r.get('variant'):45s} dK/dV {r.get('dkdv_ms', 0):7.2f} ms  dQ {r.get('dq_ms', 0):7.2f} ms")

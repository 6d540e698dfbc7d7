import os, sys, json, torch
sys.path.insert(0, ".")
from longca_triton.kernels.gluon import attention as A
from longca_triton.kernels.gluon.attention import gluon_attention
from longca_triton.masks import make_mask
from longca_triton.bench.timing import time_fn
S = 16384
mask = make_mask("full", S, seed=0)
out = os.environ["OUT"]
for name, d, cfg in [("d96_rs", 96, {"consumers": 2, "pingpong": True, "num_stages": 2, "split_d": True}),
                     ("d96_ss", 96, {"consumers": 2, "pingpong": True, "num_stages": 2, "split_d": True, "p_smem": True}),
                     ("d128_rs", 128, {"consumers": 2, "pingpong": True, "num_stages": 2}),
                     ("d128_ss", 128, {"consumers": 2, "pingpong": True, "num_stages": 2, "p_smem": True})]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, S, 64, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, S, 8, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    with torch.no_grad():
        t = time_fn(lambda: gluon_attention(q, k, v, mask, config=cfg), max_ms=800)["median_ms"]
        gluon_attention(q, k, v, mask, config=cfg)
        torch.cuda.synchronize()
    buf = A.TRACE_BUF.view(16, 3, 32, 8).cpu().tolist()
    json.dump(dict(name=name, d=d, cfg=cfg, ms=t, trace=buf), open(f"{out}/trace_{name}.json", "w"))
    print(name, "ok", round(t, 3), "ms (traced build)", flush=True)

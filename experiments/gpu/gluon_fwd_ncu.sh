#!/usr/bin/env bash
# What limits the Gluon forward at a head dim (issue 17: D = 96 reaches 0.78-0.82 of D = 128 per
# counted FLOP): Nsight Compute on the forward kernel alone, full mask, 16K, GQA 64:8, bf16, the
# default config (one H100 call, ~2 minutes):
#   OUT=$OUT DIMS="96 128" bash experiments/gpu/gluon_fwd_ncu.sh
# -> $OUT/gfwd/d<D>.csv (the raw page: tensor-pipe, issue and stall metrics) and d<D>-src.csv (the
# source page: stall samples per SASS instruction; read with experiments/gpu/ncu_source_top.py).
#
# Other masks (session 17: what a partial tile costs): CASES="128:full 128:prefix_lm_causal:prefix=16383"
# (D:mask[:param=value,...]) -> $OUT/gfwd/<D>-<mask>[-<params>].csv, likewise.
set -u
DIR=$OUT/gfwd
mkdir -p "$DIR"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
CASES=${CASES:-$(for d in ${DIMS:-96 128}; do printf '%s:full ' "$d"; done)}
for case in $CASES; do
  d=${case%%:*}; rest=${case#*:}; name=${rest%%:*}; params=""
  [ "$rest" != "$name" ] && params=${rest#*:}
  tag=d$d; [ "$name" != full ] || [ -n "$params" ] && tag="d$d-$name${params:+-${params//[=,]/_}}"
  RUN=(python -c "
import sys, torch
sys.path.insert(0, '.')
from longca_triton.kernels.gluon.op import gluon_attention
from longca_triton.masks import make_mask
S, d = 16384, $d
params = dict(kv.split('=') for kv in '$params'.split(',') if kv)
g = torch.Generator(device='cuda').manual_seed(0)
q = torch.randn(1, S, 64, d, device='cuda', dtype=torch.bfloat16, generator=g)
k, v = (torch.randn(1, S, 8, d, device='cuda', dtype=torch.bfloat16, generator=g) for _ in range(2))
mask = make_mask('$name', S, **{k: int(v) for k, v in params.items()})
with torch.no_grad():
    for _ in range(3):
        gluon_attention(q, k, v, mask)
torch.cuda.synchronize()
")
  "$NCU" --clock-control none -k regex:gluon_fwd_kernel -s 2 -c 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters \
    --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
    --import-source no -f -o "$DIR/$tag" "${RUN[@]}" > "$DIR/$tag.log" 2>&1
  echo "$tag record rc=$?"
  "$NCU" --import "$DIR/$tag.ncu-rep" --csv --page raw > "$DIR/$tag.csv" 2> "$DIR/$tag.err"
  "$NCU" --import "$DIR/$tag.ncu-rep" --page source --print-source sass --csv > "$DIR/$tag-src.csv" 2>> "$DIR/$tag.err"
  gzip -f "$DIR/$tag-src.csv"
  echo "$tag rc=$? $(wc -l < "$DIR/$tag.csv") lines"
done
(cd "$OUT" && tar czf gfwd.tgz gfwd)

#!/usr/bin/env bash
# Nsight Compute profile of one kernel of ours: what limits it (tensor pipe, issue, stalls, memory).
# The workload is a forward of a named op (KIND: gluon | dense; the default config) on one mask at S,
# GQA 64:8, bf16; ncu records the kernel matching KERNEL (a regex) on its third launch.
#   OUT=$OUT DIMS="96 128" bash experiments/gpu/ncu_profile.sh              Gluon forward, full mask, D 96 / 128
#   OUT=$OUT KIND=dense KERNEL=dense_fwd_kernel CASES="128:causal" bash experiments/gpu/ncu_profile.sh
#   CASES="128:full 128:prefix_lm_causal:prefix=16383"   (D:mask[:param=value,...]) other masks
#   S=16384 (default)
# -> $OUT/ncu/<tag>.csv (the raw page), <tag>-src.csv.gz (the source page: stall samples per SASS
# instruction; read it with experiments/gpu/ncu_source_top.py), <tag>.ncu-rep, and $OUT/ncu.tgz.
set -u
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
DIR=$OUT/ncu
KIND=${KIND:-gluon}
KERNEL=${KERNEL:-$([ "$KIND" = gluon ] && echo gluon_fwd_kernel || echo dense_fwd_kernel)}
SEQ=${S:-16384}
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
if '$KIND' == 'gluon':
    from longca_triton.kernels.gluon.op import gluon_attention as attention
else:
    from longca_triton.kernels.dense.op import dense_attention as attention
from longca_triton.masks import make_mask
S, d = $SEQ, $d
params = dict(kv.split('=') for kv in '$params'.split(',') if kv)
g = torch.Generator(device='cuda').manual_seed(0)
q = torch.randn(1, S, 64, d, device='cuda', dtype=torch.bfloat16, generator=g)
k, v = (torch.randn(1, S, 8, d, device='cuda', dtype=torch.bfloat16, generator=g) for _ in range(2))
mask = make_mask('$name', S, **{k: int(v) for k, v in params.items()})
with torch.no_grad():
    for _ in range(3):
        attention(q, k, v, mask)
torch.cuda.synchronize()
")
  "$NCU" --clock-control none -k "regex:$KERNEL" -s 2 -c 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters \
    --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
    --import-source no -f -o "$DIR/$tag" "${RUN[@]}" > "$DIR/$tag.log" 2>&1
  echo "$tag record rc=$?"
  "$NCU" --import "$DIR/$tag.ncu-rep" --csv --page raw > "$DIR/$tag.csv" 2> "$DIR/$tag.err"
  "$NCU" --import "$DIR/$tag.ncu-rep" --page source --print-source sass --csv > "$DIR/$tag-src.csv" 2>> "$DIR/$tag.err"
  gzip -f "$DIR/$tag-src.csv"
  echo "$tag rc=$? $(wc -l < "$DIR/$tag.csv") lines"
done
(cd "$OUT" && tar czf ncu.tgz ncu)

#!/usr/bin/env bash
# Every case of experiments/gpu/ncu_bwd.py under Nsight Compute, one CSV each in $OUT/ncu/ (one H100
# call, ~3-4 minutes: each profiled kernel is replayed once per counter pass).
#
#   bash experiments/gpu/ncu_bwd.sh                 (run(timeout_s=600); CASES="a b" for a subset)
#
# --clock-control none: leave the GPU's clocks as they are (the device tool's METHOD.md).
set -u
OUT=${OUT:-/tmp/ncu_bwd}
mkdir -p "$OUT/ncu"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
CASES=${CASES:-dense-causal-hm32 dense-causal-hm64 dense-causal-sweep sparse-ours sparse-flex varblock-ours varblock-aligned varblock-big}
{ "$NCU" --version; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/ncu/env.txt" 2>&1
for c in $CASES; do
  # the backward's kernels run on autograd's device thread, out of reach of an NVTX range of the main
  # thread: pick them by name, skipping the first (compiling) pass's launches
  case $c in
    sparse-flex) FILTER=(-k regex:triton_tem -s 2 -c 2) ;;  # forward, backward of the second pass
    # varblock-big's dK/dV and dQ passes each launch twice (main tiles, then the tail tiles)
    varblock-big) FILTER=(-k regex:bwd_dkdv\|bwd_dq -s 4 -c 4) ;;
    *) FILTER=(-k regex:bwd_dkdv\|bwd_dq -s 2 -c 2) ;;
  esac
  "$NCU" --clock-control none "${FILTER[@]}" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
    --section WarpStateStats --section ComputeWorkloadAnalysis --csv --page details \
    python experiments/gpu/ncu_bwd.py --case "$c" > "$OUT/ncu/$c.csv" 2> "$OUT/ncu/$c.err"
  echo "$c rc=$? $(wc -l < "$OUT/ncu/$c.csv") lines"
done

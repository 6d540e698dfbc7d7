#!/usr/bin/env bash
# Warp stall reasons (ncu raw page of WarpStateStats / SchedulerStats) of the block-sparse backward,
# ours (dK/dV and dQ kernels) against Flex's one kernel, 32K / 0.3 / block 128 / GQA 64:8 / D = 128:
#   OUT=$OUT bash experiments/gpu/ncu_stalls.sh     (one H100 call, ~2-3 minutes)
set -u
mkdir -p "$OUT/st"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for c in sparse-ours sparse-flex; do
  case $c in
    # Flex's backward template kernel (not the delta reduction kernel whose name also matches
    # flex_attention_backward), second pass
    sparse-flex) FILTER=(-k regex:triton_tem_fused_flex_attention_backward -s 1 -c 1) ;;
    *) FILTER=(-k regex:bwd_dkdv\|bwd_dq -s 2 -c 2) ;;
  esac
  "$NCU" --clock-control none "${FILTER[@]}" --section WarpStateStats --section SchedulerStats --csv --page raw \
    python experiments/gpu/ncu_bwd.py --case "$c" > "$OUT/st/$c.csv" 2> "$OUT/st/$c.err"
  echo "$c rc=$? $(wc -l < "$OUT/st/$c.csv") lines"
done

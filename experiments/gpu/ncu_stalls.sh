#!/usr/bin/env bash
# Warp stall reasons of the block-sparse backward, ours (dK/dV and dQ kernels) against Flex's one
# kernel, 32K / 0.3 / block 128 / GQA 64:8 / D = 128 (one H100 call, ~2-3 minutes):
#   OUT=$OUT bash experiments/gpu/ncu_stalls.sh          the raw page of WarpStateStats / SchedulerStats
#                                                        -> $OUT/st/<case>.csv
#   OUT=$OUT bash experiments/gpu/ncu_stalls.sh source   per-SASS-instruction stall sampling (the source
#                                                        page) -> $OUT/src.tgz (<case>.csv, .ncu-rep);
#                                                        read it with experiments/gpu/ncu_source_top.py
#   CASES="sparse-ours varblock-big" KERNELS=bwd_dkdv SKIP=1 COUNT=1 ...   other cases (ncu_bwd.py), one kernel
set -u
MODE=${1:-raw}
DIR=$OUT/$([ "$MODE" = source ] && echo src || echo st)
mkdir -p "$DIR"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for c in ${CASES:-sparse-ours sparse-flex}; do
  case $c in
    # Flex's backward template kernel (not the delta reduction kernel whose name also matches
    # flex_attention_backward), second pass
    sparse-flex) FILTER=(-k regex:triton_tem_fused_flex_attention_backward -s 1 -c 1) ;;
    *) FILTER=(-k regex:${KERNELS:-bwd_dkdv\|bwd_dq} -s ${SKIP:-2} -c ${COUNT:-2}) ;;
  esac
  if [ "$MODE" = source ]; then
    "$NCU" --clock-control none "${FILTER[@]}" --section SourceCounters --section WarpStateStats \
      --import-source no -f -o "$DIR/$c" python experiments/gpu/ncu_bwd.py --case "$c" > "$DIR/$c.log" 2>&1
    echo "$c record rc=$?"
    "$NCU" --import "$DIR/$c.ncu-rep" --page source --print-source sass --csv > "$DIR/$c.csv" 2> "$DIR/$c.err"
  else
    "$NCU" --clock-control none "${FILTER[@]}" --section WarpStateStats --section SchedulerStats --csv --page raw \
      python experiments/gpu/ncu_bwd.py --case "$c" > "$DIR/$c.csv" 2> "$DIR/$c.err"
  fi
  echo "$c rc=$? $(wc -l < "$DIR/$c.csv") lines"
done
if [ "$MODE" = source ]; then (cd "$OUT" && tar czf src.tgz src && rm -rf src); fi

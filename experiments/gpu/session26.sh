#!/usr/bin/env bash
# Session 26's GPU calls (an H200; `nvidia-h200` is the only kind lent). One subcommand per call; everything lands
# under $OUT.
#   bash experiments/gpu/session26.sh parts   issue 13's variable blocks: the backward's launches timed apart beside
#                                             uniform block 128's (experiments/gpu/varblock_parts.py: dK/dV main and
#                                             tail launches, dQ, the backward without the dK/dV tails = the ceiling
#                                             of any change to the key blocks' remainders), and candidate configs
#                                             (dK/dV tails on 8 warps, dK/dV 32 query rows a step, dQ 8 heads x 16)
#                                             interleaved, then the same configs checked against float32 through
#                                             autograd (bwd_configs_ab.py --check, 32K / 0.3)
#   bash experiments/gpu/session26.sh order   the dK/dV tail launch's place (dkdv_tail_order 0 / 1 / 2) timed with the
#                                             launches apart, then Nsight Compute on the dK/dV launches (main and tails
#                                             of variable blocks, uniform block 128's): DRAM and L2 traffic
#   bash experiments/gpu/session26.sh order64 the GPU equal-bits tests of the new defaults, then dkdv_tail_order 2 against
#                                             0 at 64K (densities 0.3 / 0.5)
#   bash experiments/gpu/session26.sh varratio the dQ tile 8 x 16 against 4 x 32 at 64K, then the variable-block ratio
#                                             through the harness (uniform block 128 and variable blocks, 32K / 64K)
#   bash experiments/gpu/session26.sh timers  session 25's defaults, today's, and 4 x 32 with the tails first, under every
#                                             timer (timer_bias.py), 32K and 64K density 0.3
#   bash experiments/gpu/session26.sh steps   order_by_steps and in-launch remainder tiles (dkdv_tail_rows 0) under every
#                                             timer, 32K density 0.3 and 64K density 0.5
#   bash experiments/gpu/session26.sh final   issue 13 through the harness: the variable-block ratio, the dense backward
#   bash experiments/gpu/session26.sh weak    the two weakest variable-block cases under every timer: dQ 8 x 16, tails order 0
source experiments/gpu/session_env.sh
case "${1:-}" in
  parts)
    CONFIGS='{"tailw8": {"dkdv_tail_warps": 8}, "m32": {"DKDV_BLOCK_M": 32}, "m32_tailw8": {"DKDV_BLOCK_M": 32, "dkdv_tail_warps": 8}, "dq8x16": {"DQ_BLOCK_M": 16, "DQ_HEADS": 8}}'
    timeout 330 python experiments/gpu/varblock_parts.py --out "$OUT" --rounds 3 \
      --cases varblock256:32768:0.3,uniform128:32768:0.3,varblock256:32768:0.5 --configs "$CONFIGS" 2>&1 | tail -40
    timeout 200 python experiments/gpu/bwd_configs_ab.py --out "$OUT/ab" --check --no-flex --budget 190 --rounds 2 \
      --dense-masks '' --sparse varblock256:32768:0.3 \
      --configs "{\"default\": {}, ${CONFIGS:1}" > "$OUT/ab.log" 2>&1
    tail -3 "$OUT/ab.log"; cat "$OUT/ab/bwd_configs_ab.md"
    nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv
    ;;
  order)
    # where the dK/dV tail launch goes (dkdv_tail_order 1: first in the dQ chain on the side stream; 2: on the side
    # stream before the main dK/dV launch), beside the default (0: after the main dK/dV launch)
    timeout 300 python experiments/gpu/varblock_parts.py --out "$OUT" --rounds 3 \
      --cases varblock256:32768:0.3,varblock256:32768:0.5,uniform128:32768:0.3 \
      --configs '{"order1": {"dkdv_tail_order": 1}, "order2": {"dkdv_tail_order": 2}}' 2>&1 | tail -30
    # Nsight Compute: the dK/dV main and tail launches of variable blocks, uniform block 128's dK/dV (memory, L2)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    mkdir -p "$OUT/ncu"
    for c in varblock-ours sparse-ours; do
      case $c in varblock-ours) F=(-k regex:bwd_dkdv -s 2 -c 2) ;; *) F=(-k regex:bwd_dkdv -s 1 -c 1) ;; esac
      timeout 150 "$NCU" --clock-control none "${F[@]}" --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section LaunchStats --csv --page details \
        python experiments/gpu/ncu_bwd.py --case "$c" > "$OUT/ncu/$c.csv" 2> "$OUT/ncu/$c.err"
      echo "$c rc=$? $(wc -l < "$OUT/ncu/$c.csv") lines"
    done
    tar czf "$OUT/ncu.tgz" -C "$OUT" ncu && rm -rf "$OUT/ncu"
    ;;
  order64)
    # the new defaults' GPU tests (equal bits: the 8 x 16 dQ tile, every dK/dV tail order), then dkdv_tail_order 2
    # (the default since call 2) against 0 at 64K, whole backward, interleaved
    tests tests/test_streams_gpu.py "stacked or tail_order" gpu_tests.log 150
    timeout 330 python experiments/gpu/varblock_parts.py --out "$OUT" --rounds 3 --rep 10 --no-parts \
      --cases varblock256:65536:0.3,varblock256:65536:0.5 --configs '{"order0": {"dkdv_tail_order": 0}}' 2>&1 | tail -12
    ;;
  varratio)
    # the dQ tile 8 x 16 (default since call 1) against 4 x 32 at 64K, then issue 13's variable-block ratio through
    # the harness: uniform block 128 and variable blocks (mean 256), a pattern per KV head, 32K / 64K, 0.3 / 0.5
    timeout 200 python experiments/gpu/varblock_parts.py --out "$OUT" --rounds 3 --rep 10 --no-parts \
      --cases varblock256:65536:0.3,varblock256:65536:0.5 --configs '{"dq4x32": {"DQ_BLOCK_M": 32, "DQ_HEADS": 4}}' \
      2>&1 | tail -8
    varblock_ratio
    tar czf "$OUT/varratio.tgz" -C "$OUT" uni var && rm -rf "$OUT/uni" "$OUT/var"
    ;;
  timers)
    # the harness disagreed with the interleaved A/Bs (call 4): session 25's defaults (dQ 4 x 32, tails after the
    # main dK/dV launch), today's (8 x 16, tails first beside), and 4 x 32 with the tails first, under every timer
    # (timer_bias.py: time_fn = the harness's back-to-back timer, both orders, one process)
    C='{"s25": {"DQ_BLOCK_M": 32, "DQ_HEADS": 4, "dkdv_tail_order": 0}, "now": {}, "x32o2": {"DQ_BLOCK_M": 32, "DQ_HEADS": 4}}'
    timer_ab t32 varblock256:32768:0.3 20 200 "$C"
    timer_ab t64 varblock256:65536:0.3 8 330 "$C"
    summary t32 t64
    ;;
  steps)
    # the harness's timer (timer_bias.py) on: 4 x 32 with the tails first (the defaults after call 5), programs ordered
    # by their lists' steps (order_by_steps), the remainders in 128-key tiles of the main launch (dkdv_tail_rows 0,
    # which by steps keeps a block's tiles together), and both
    C='{"base": {}, "steps": {"order_by_steps": true}, "t0": {"dkdv_tail_rows": 0}, "t0steps": {"dkdv_tail_rows": 0, "order_by_steps": true}}'
    timer_ab t32 varblock256:32768:0.3 15 170 "$C"
    timer_ab t64 varblock256:65536:0.5 5 300 "$C"
    summary t32 t64
    ;;
  final)
    # issue 13 through the harness with order_by_steps the default (call 6): the variable-block ratio (uniform block
    # 128 and variable blocks, 32K / 64K, 0.3 / 0.5), then the dense backward against cuDNN and Flex (full, causal)
    varblock_ratio
    timeout 240 python -m longca_triton.cli bench dense --no-plots --config experiments/dense_16k.toml \
      --masks full,causal --backends triton,sdpa-cudnn,flex --mode bwd --out "$OUT/bwd16" 2>&1 | tail -8
    tar czf "$OUT/final.tgz" -C "$OUT" uni var bwd16 && rm -rf "$OUT/uni" "$OUT/var" "$OUT/bwd16"
    ;;
  weak)
    # the two cases furthest from 0.8 after call 7 (64K 0.3, 32K 0.5), under every timer: today's defaults against
    # the dQ tile 8 x 16 and the dK/dV tails after the main launch (dkdv_tail_order 0), both with order_by_steps
    C='{"now": {}, "dq8x16": {"DQ_BLOCK_M": 16, "DQ_HEADS": 8}, "order0": {"dkdv_tail_order": 0}}'
    timer_ab t64 varblock256:65536:0.3 5 200 "$C"
    timer_ab t32 varblock256:32768:0.5 10 150 "$C"
    summary t64 t32
    ;;
  *) echo "unknown subcommand: ${1:-}"; exit 2 ;;
esac

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
  *) echo "unknown subcommand: ${1:-}"; exit 2 ;;
esac

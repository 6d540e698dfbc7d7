#!/usr/bin/env bash
# Session 29's GPU calls (one subcommand per call; everything lands under $OUT):
#   bash experiments/gpu/session29.sh ratios   issue 13's variable-block ratio through the harness for whole entries
#                                              first (dkdv_full_first, dq_full_first, both: each a backend named with
#                                              its launch config, checked against float32, timed back to back) beside
#                                              the default and uniform block 128
#   bash experiments/gpu/session29.sh confirm  the GPU tests of the new paths (bf16 against float64), then the
#                                              default and $CONFIG (a launch config, JSON) in the other order
source experiments/gpu/session_env.sh
FULL='{"dkdv": {"dkdv_full_first": true}, "dq": {"dq_full_first": true}, "both": {"dkdv_full_first": true, "dq_full_first": true}}'
case "${1:-}" in
  ratios)
    config_ratios "$FULL" ratios.tgz
    ;;
  confirm)
    tests tests/test_full_first_gpu.py "" gpu_tests.log 200
    mapfile -t NAMES < <(config_names "{\"c\": $CONFIG}")
    sparse128 150 uni Hkv triton-sparse 2>&1 | tail -6
    varblock256 240 var "${NAMES[0]},${NAMES[1]}" --sequential 2>&1 | tail -6
    tar czf "$OUT/confirm.tgz" -C "$OUT" uni var && rm -rf "$OUT/uni" "$OUT/var"
    ratios_of "$OUT/confirm.tgz" "${NAMES[@]}"
    ;;
  *)
    sed -n '2,8p' "$0"
    exit 2
    ;;
esac

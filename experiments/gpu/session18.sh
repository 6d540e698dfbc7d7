#!/usr/bin/env bash
# Session 18's device calls (one H100 each; results under experiments/results/h100/session18/):
#
#   bash experiments/gpu/session18.sh merge     # the split launch's halves timed alone; the second
#                                               # launch's early O read against the previous commit
#                                               # (carry _base: git archive HEAD~ longca_triton)
set -u
case "${1:-}" in
  merge)
    timeout 240 python -m pytest -q -m gpu tests/test_gluon_gpu.py -rA -k "split_partial" 2>&1 | tail -25 > "$OUT/gpu_tests.txt"
    tail -3 "$OUT/gpu_tests.txt"
    for r in ${ROUNDS:-1 2}; do
      LONGCA_PACKAGE_ROOT=_base PYTHONUNBUFFERED=1 python experiments/gpu/split_cost.py --label base$r | tail -16
      PYTHONUNBUFFERED=1 python experiments/gpu/split_cost.py --label new$r | tail -16
    done
    ;;
  *)
    sed -n '2,8p' "$0"; exit 2 ;;
esac

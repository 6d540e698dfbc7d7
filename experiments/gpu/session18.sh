#!/usr/bin/env bash
# Session 18's device calls (one H100 each; results under experiments/results/h100/session18/):
#
#   bash experiments/gpu/session18.sh merge     # the split launch's halves timed alone; the second
#                                               # launch's early O read against the previous commit
#                                               # (carry _base: git archive HEAD~ longca_triton)
#   bash experiments/gpu/session18.sh bwdmix    # whole backwards (plain pair, Gluon dQ + plain dK/dV,
#                                               # Gluon pair) beside SDPA-cuDNN's, interleaved
#   bash experiments/gpu/session18.sh bwdtarget # the mixed default's GPU tests; issue 12's backward
#                                               # run (12 masks, triton / triton-gluon / cuDNN / Flex)
#   bash experiments/gpu/session18.sh head      # mask_head: its GPU tests, then timed interleaved against
#                                               # each mask's default (split launch / one launch)
set -u
export PYTHONPATH=.:${PYTHONPATH:-}
case "${1:-}" in
  merge)
    timeout 240 python -m pytest -q -m gpu tests/test_gluon_gpu.py -rA -k "split_partial" 2>&1 | tail -25 > "$OUT/gpu_tests.txt"
    tail -3 "$OUT/gpu_tests.txt"
    for r in ${ROUNDS:-1 2}; do
      LONGCA_PACKAGE_ROOT=_base PYTHONUNBUFFERED=1 python experiments/gpu/split_cost.py --label base$r | tail -16
      PYTHONUNBUFFERED=1 python experiments/gpu/split_cost.py --label new$r | tail -16
    done
    ;;
  bwdmix)
    PYTHONUNBUFFERED=1 python experiments/gpu/gluon_bwd_split.py --out "$OUT" --masks full,causal --interleave | grep -v '"kind": "env"'
    PYTHONUNBUFFERED=1 python experiments/gpu/gluon_bwd_split.py --out "$OUT" --masks full,causal --interleave --no-check | grep bwd_interleaved
    ;;
  bwdtarget)
    timeout 300 python -m pytest -q -m gpu tests/test_gluon_gpu.py -rA \
      -k "mixed or default or plain or deterministic" 2>&1 | tail -80 > "$OUT/gpu_tests.txt"
    tail -3 "$OUT/gpu_tests.txt"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
    PYTHONUNBUFFERED=1 python -m longca_triton.cli bench dense --no-plots --config experiments/dense_16k.toml \
      --backends triton,triton-gluon,sdpa-cudnn,flex --mode bwd --out "$OUT/bwd16" 2>&1 | tail -30
    ;;
  head)
    timeout 200 python -m pytest -q -m gpu tests/test_gluon_gpu.py -rA -k "mask_head" 2>&1 | tail -30 > "$OUT/gpu_tests.txt"
    tail -3 "$OUT/gpu_tests.txt"
    PYTHONUNBUFFERED=1 python experiments/gpu/partial_cost.py --more-masks causal_blockwise,full_document,sliding_window_causal \
      --config-json '[{"mask_head": true}, {"mask_head": true, "consumers": 2, "persistent": true, "o_own": true, "num_stages": 2, "snake": true}, {"split_partial": false}]' \
      | python3 -c "import sys, json; [print(r['mask'], r['config'], round(r['fwd_tflops'], 1), round(r['err_out'], 5)) for r in map(json.loads, sys.stdin)]"
    ;;
  *)
    sed -n '2,14p' "$0"; exit 2 ;;
esac

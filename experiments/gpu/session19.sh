#!/usr/bin/env bash
# Session 19's GPU calls (one subcommand per call; rows go straight into $OUT).
#   bash experiments/gpu/session19.sh head2   mask_head=2 (two branch-free masked steps): its GPU tests, then
#                                             every two-consumer static mask at 16K timed interleaved with
#                                             mask_head 0 / 1 / 2 and the default (partial_cost.py)
set -u
export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
rows() { python3 -c "import sys, json; [print(r['mask'], r['config'], round(r['fwd_tflops'], 1), round(r['err_out'], 5)) for r in map(json.loads, sys.stdin)]"; }
case "${1:-}" in
  head2)
    timeout 280 python -m pytest -q -m gpu tests/test_gluon_gpu.py -rA -k "mask_head" 2>&1 \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" > "$OUT/gpu_tests_head2.txt"
    tail -4 "$OUT/gpu_tests_head2.txt"
    PYTHONUNBUFFERED=1 python experiments/gpu/partial_cost.py --only --more-masks \
      causal,causal_blockwise,full_document,sliding_window_causal,global_sliding_window,causal_document,sliding_window,prefix_lm_document,share_question \
      --config-json '[{"mask_head": 0}, {"mask_head": 1}, {"mask_head": 2}]' | rows
    ;;
  *)
    sed -n '2,6p' "$0"; exit 2 ;;
esac

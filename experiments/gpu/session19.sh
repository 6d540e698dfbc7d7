#!/usr/bin/env bash
# Session 19's GPU calls (one subcommand per call; rows go straight into $OUT).
#   bash experiments/gpu/session19.sh head2   mask_head=2 (two branch-free masked steps): its GPU tests, then
#                                             every two-consumer static mask at 16K timed interleaved with
#                                             mask_head 0 / 1 / 2 and the default (partial_cost.py)
#   bash experiments/gpu/session19.sh rowsum  rowsum_mma (the row sums by one more wgmma against ones): its GPU
#                                             tests, then D = 96, 64, 128 on four masks at 16K, each mask's
#                                             default / default again / rowsum_mma timed interleaved
#   bash experiments/gpu/session19.sh rowsum64  D = 64's persistent launch with rowsum_mma: tests, every mask
#   bash experiments/gpu/session19.sh dims      mask_head 0 / 1 / 2 at D = 64 and 96 (tests of the combination
#                                             with rowsum_mma, then six masks at 16K interleaved)
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
  rowsum)
    # one pytest process per config: an illegal address in one cannot fail the others
    for k in "128-]" "p_smem" "persistent and 128" "split_partial" "96 and not persistent" "64-]" "96 and persistent"; do
      timeout 60 python -m pytest -q -m gpu tests/test_gluon_gpu.py -rA -k "rowsum and $k" 2>&1 \
        | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" >> "$OUT/gpu_tests_rowsum.txt"
      grep -E "passed|failed" "$OUT/gpu_tests_rowsum.txt" | tail -1
    done
    for d in 96 128 64; do
      PYTHONUNBUFFERED=1 python experiments/gpu/gluon_diag.py --out "$OUT/rowsum$d" --fwd-configs 16384 --head-dims $d \
        --interleave --masks full,causal,causal_document,sliding_window_causal \
        --config-json '[{"rowsum_mma": false}, {"rowsum_mma": true}]' 2>&1 | grep ROW | grep fwd_tflops \
        | python3 -c "import sys, json; [print(r['D'], r['mask'], r['config'], round(r['fwd_tflops'], 1), round(r['err_out'], 5)) for r in (json.loads(l[4:]) for l in sys.stdin)]"
    done
    ;;
  rowsum64)
    # D = 64's persistent launch (three consumers) with rowsum_mma: its GPU tests, then every mask at 16K
    timeout 120 python -m pytest -q -m gpu tests/test_gluon_gpu.py -rA -k "rowsum and 64" 2>&1 \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" > "$OUT/gpu_tests_rowsum64.txt"
    tail -1 "$OUT/gpu_tests_rowsum64.txt"
    PYTHONUNBUFFERED=1 python experiments/gpu/gluon_diag.py --out "$OUT/rowsum64all" --fwd-configs 16384 --head-dims 64 \
      --interleave --masks all --config-json '[{"rowsum_mma": false}, {"rowsum_mma": true}]' 2>&1 | grep ROW \
      | grep fwd_tflops | python3 -c "import sys, json; [print(r['D'], r['mask'], r['config'], round(r['fwd_tflops'], 1), round(r['err_out'], 5)) for r in (json.loads(l[4:]) for l in sys.stdin)]"
    ;;
  dims)
    # mask_head at D = 64 and 96 (the rule sets it at D = 128 only): the combined configs' tests, then
    # mask_head 0 / 1 / 2 on the masks with partial tiles, interleaved
    timeout 150 python -m pytest -q -m gpu tests/test_gluon_gpu.py -rA -k "mask_head2 and rowsum_mma" 2>&1 \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" > "$OUT/gpu_tests_dims.txt"
    tail -1 "$OUT/gpu_tests_dims.txt"
    for d in 64 96; do
      PYTHONUNBUFFERED=1 python experiments/gpu/gluon_diag.py --out "$OUT/dims$d" --fwd-configs 16384 --head-dims $d \
        --interleave --masks causal,causal_document,sliding_window_causal,full_document,causal_blockwise,sliding_window \
        --config-json '[{"mask_head": 0}, {"mask_head": 1}, {"mask_head": 2}]' 2>&1 | grep ROW | grep -E "fwd_tflops|error" \
        | python3 -c "import sys, json; [print(r['D'], r['mask'], r['config'], round(r.get('fwd_tflops', 0), 1), r.get('error', '')[-160:]) for r in (json.loads(l[4:]) for l in sys.stdin)]"
    done
    ;;
  *)
    sed -n '2,13p' "$0"; exit 2 ;;
esac

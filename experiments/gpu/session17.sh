#!/usr/bin/env bash
# Session 17's GPU calls (one subcommand per call; rows go straight into $OUT).
#   bash experiments/gpu/wheels.sh stage         (calls carrying .whl/fa4/1, then .whl/fa4/2), then
#   bash experiments/gpu/session17.sh target   (carrying .whl/fa4/3) issue 12's forward targets with the new defaults
#   bash experiments/gpu/session17.sh partial  what the forward pays for the mask path: full, prefix_lm_causal with
#                                              prefix S - 1 / 12288 / seed 0, causal; defaults and other configs
#   bash experiments/gpu/session17.sh split    the forward's full tiles in a loop without the mask code: GPU tests,
#                                              then partial_cost.py again
#   bash experiments/gpu/session17.sh ncu      Nsight Compute: the forward on full vs prefix_lm_causal prefix S - 1
#   bash experiments/gpu/session17.sh cols     the interval mask without the hoisted column registers: GPU tests, then
#                                              partial_cost.py
#   bash experiments/gpu/session17.sh splitlaunch  the split launch (split_partial): GPU tests, then partial_cost.py
#   bash experiments/gpu/session17.sh split3   the split launch with three consumers in its first launch (no mask path:
#                                              no spill) on the masks it lost on, and the two it wins
#   bash experiments/gpu/session17.sh trim     the split launch's second half over the tiles with partial tiles only
#   bash experiments/gpu/session17.sh poly     issues 17 / 12: one exponential in n of the forward's softmax by a
#                                              polynomial on the FMA pipe (poly_exp), D = 96 / 128 / 64, interleaved
#   bash experiments/gpu/session17.sh persist  issue 12: the Gluon forward's persistent launch with O staged in P's
#                                              buffers (three consumers) and the boustrophedon work list, against
#                                              the defaults, timed interleaved per mask; GPU tests of both first
set -u
export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
P3='"consumers": 3, "p_smem": true, "persistent": true'
SHOW='
import json, sys
for ln in sys.stdin:
    r = json.loads(ln[4:])
    if r.get("interleaved") or "error" in r:
        print(r["mask"], r["D"], json.dumps(r["config"]), r.get("fwd_tflops") and round(r["fwd_tflops"], 1),
              r.get("error", "")[:200])
'
diag() {  # diag OUTDIR D MASKS CONFIGS: interleaved forward timings, each config checked first
  PYTHONUNBUFFERED=1 python experiments/gpu/gluon_diag.py --out "$OUT/$1" --fwd-configs 16384 --interleave \
    --head-dims "$2" --masks "$3" --config-json "$4" 2>&1 | grep ROW | python -c "$SHOW"
}
case "${1:-}" in
  partial)
    PYTHONUNBUFFERED=1 python experiments/gpu/partial_cost.py --config-json \
      '[{"consumers": 3, "p_smem": true, "persistent": false}, {"consumers": 2, "p_smem": false, "persistent": true, "o_own": true, "num_stages": 2}, {"consumers": 2, "p_smem": false, "persistent": false}]'
    ;;
  split)
    timeout 300 python -m pytest -q -m gpu tests/test_gluon_gpu.py \
      -k "(static_masks_gqa and default) or persistent_forward or (random_overlapping and default) or three_consumers or equal_bits or split_head_dims_configs" \
      -rA 2>&1 | tail -30 > "$OUT/gpu_tests.txt"
    tail -3 "$OUT/gpu_tests.txt"
    PYTHONUNBUFFERED=1 python experiments/gpu/partial_cost.py --config-json \
      '[{"consumers": 3, "p_smem": true, "persistent": false}, {"consumers": 2, "p_smem": false, "persistent": true, "o_own": true, "num_stages": 2}]'
    ;;
  splitlaunch)
    timeout 240 python -m pytest -q -m gpu tests/test_gluon_gpu.py -rA -k "split_partial" 2>&1 | tail -25 > "$OUT/gpu_tests.txt"
    tail -3 "$OUT/gpu_tests.txt"
    PYTHONUNBUFFERED=1 python experiments/gpu/partial_cost.py --more-masks causal_blockwise,full_document --config-json \
      '[{"split_partial": true}, {"consumers": 2, "p_smem": false, "persistent": true, "o_own": true, "num_stages": 2, "split_partial": true}]'
    ;;
  trim)
    timeout 240 python -m pytest -q -m gpu tests/test_gluon_gpu.py -rA -k "split_partial" 2>&1 | tail -25 > "$OUT/gpu_tests.txt"
    tail -3 "$OUT/gpu_tests.txt"
    PYTHONUNBUFFERED=1 python experiments/gpu/partial_cost.py --config-json '[{"split_partial": false}]'
    ;;
  split3)
    PYTHONUNBUFFERED=1 python experiments/gpu/partial_cost.py --only \
      --more-masks causal_blockwise,full_document,global_sliding_window,causal,prefix_lm_causal --config-json \
      '[{"split_partial": true}, {"split_partial": true, "consumers": 3, "p_smem": true, "persistent": false},
        {"split_partial": true, "consumers": 3, "p_smem": true, "persistent": true}]'
    ;;
  cols)
    timeout 270 python -m pytest -q -m gpu tests/test_gluon_gpu.py -rA \
      -k "(static_masks_gqa and default) or (random_overlapping and default) or persistent_forward or (three_consumers and Sq=1)" \
      2>&1 | tail -30 > "$OUT/gpu_tests.txt"
    tail -3 "$OUT/gpu_tests.txt"
    PYTHONUNBUFFERED=1 python experiments/gpu/partial_cost.py --config-json \
      '[{"consumers": 2, "p_smem": false, "persistent": true, "o_own": true, "num_stages": 2}]'
    ;;
  ncu)
    OUT=$OUT CASES="128:full 128:prefix_lm_causal:prefix=16383 128:prefix_lm_causal:prefix=16256" \
      bash experiments/gpu/gluon_fwd_ncu.sh
    for f in "$OUT"/gfwd/*.log; do echo "== $f"; grep -E "Duration|Executed Ipc A|Registers Per|Theoretical Occ|Achieved Occ|Issue Slots Busy|L2 Hit|DRAM Through" "$f" | head -12; done
    ;;
  target)
    # issue 12's forward targets: session 15's command (bench dense, six backends, interleaved)
    bash experiments/gpu/session15.sh target
    ;;
  poly)
    timeout 230 python -m pytest -q -m gpu tests/test_gluon_gpu.py -k "poly_exp" -rA 2>&1 | tail -45 > "$OUT/gpu_tests.txt"
    tail -3 "$OUT/gpu_tests.txt"
    diag d96 96 full,causal,causal_document '[{"poly_exp": 2}, {"poly_exp": 4}, {"poly_exp": 8}]'
    diag d128 128 full,causal '[{"poly_exp": 4}, {"poly_exp": 8}, {"consumers": 2, "p_smem": false, "persistent": true, "o_own": true, "num_stages": 2, "snake": true}, {"consumers": 2, "p_smem": false, "persistent": true, "o_own": true, "num_stages": 2, "snake": true, "poly_exp": 4}]'
    diag d64 64 full,causal '[{"poly_exp": 2}, {"poly_exp": 4}, {"poly_exp": 8}]'
    ;;
  persist)
    timeout 240 python -m pytest -q -m gpu tests/test_gluon_gpu.py -k "o_in_p or snake or equal_bits" -rA \
      2>&1 | tail -40 > "$OUT/gpu_tests.txt"
    tail -3 "$OUT/gpu_tests.txt"
    PYTHONUNBUFFERED=1 python experiments/gpu/gluon_diag.py --out "$OUT/persist" --fwd-configs 16384 --interleave \
      --masks full,causal,prefix_lm_causal,causal_blockwise,full_document \
      --config-json "[{$P3}, {$P3, \"o_in_p\": true}, {$P3, \"o_in_p\": true, \"snake\": true},
                      {\"consumers\": 2, \"p_smem\": false, \"persistent\": true, \"o_own\": true, \"num_stages\": 2, \"snake\": true}]" \
      2>&1 | grep ROW | python -c "
import json, sys
for ln in sys.stdin:
    r = json.loads(ln[4:])
    if r.get('interleaved') or 'error' in r:
        print(r['mask'], json.dumps(r['config']), r.get('fwd_tflops') and round(r['fwd_tflops'], 1), r.get('error', '')[:200])
"
    ;;
  *)
    sed -n 2,5p "$0"; exit 2 ;;
esac

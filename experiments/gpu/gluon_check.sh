#!/usr/bin/env bash
# Issue 12's GPU run of the Gluon forward (sm_90 only; nothing here can run on a CPU).
#
# On the device, from the repository root (one call per PHASES value keeps each under 10 min):
#   PHASES="smoke"        bash experiments/gpu/gluon_check.sh   # compile + one numerics case (~2 min)
#   PHASES="tests bench"  bash experiments/gpu/gluon_check.sh   # all -m gpu numerics, then bench dense 16K
#   PHASES="configs"      bash experiments/gpu/gluon_check.sh   # ping-pong / stages / BLOCK_N at 16K
#   PHASES="accept"       bash experiments/gpu/gluon_check.sh   # 32K correctness + O(S) memory to 128K
# Everything lands in $OUT (logs, results.jsonl, summaries); commit it under
# experiments/results/h100/gluon/.
set -o pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia_smi.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || true
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }

for phase in ${PHASES:-smoke}; do
  case $phase in
    smoke)
      stamp "smoke: compile + one random mask, D=128"
      timeout 300 python3 -m pytest -m gpu -x -q tests/test_gluon_gpu.py -k "random and Sq=1000 and D=128" \
        2>&1 | tail -40 | tee "$OUT/smoke.txt" ;;
    tests)
      stamp "tests: every -m gpu numerics case"
      timeout 420 python3 -m pytest -m gpu -q -rA tests/test_gluon_gpu.py 2>&1 | tail -80 | tee "$OUT/test_gluon_gpu.txt" ;;
    bench)
      stamp "bench: dense 16K, ours (plain and Gluon) next to cuDNN and Flex, forward"
      timeout 420 python3 -m longca_triton.cli bench dense --config experiments/dense_16k.toml --mode fwd \
        --backends triton,triton-gluon,sdpa-cudnn,flex --out "$OUT/bench" --no-plots 2>&1 | tail -60 | tee "$OUT/bench.txt" ;;
    configs)
      stamp "configs: the Gluon forward's launch knobs at 16K"
      timeout 420 python3 experiments/gpu/gluon_configs.py --out "$OUT" 2>&1 | tail -40 ;;
    accept)
      stamp "accept: 32K correctness and memory"
      timeout 540 python3 experiments/gpu/dense_acceptance.py --backends triton-gluon --out "$OUT" 2>&1 | tail -40 ;;
  esac
done
stamp done

#!/usr/bin/env bash
# Session 25's GPU calls, the first on an H200 (the device tool lends only `nvidia-h200` now; every earlier number
# is an H100's). One subcommand per call; everything lands under $OUT, tarred where more than eight files.
#   bash experiments/gpu/session25.sh base13   (carry .whl/vsa/1) issue 13's targets on this GPU: dense backward
#                                              full / causal against cuDNN and Flex, block 128 against Flex (eight
#                                              cases), variable blocks (mean 256) beside uniform 128, block 64 vs VSA
#   bash experiments/gpu/session25.sh ahead [2]  the Gluon forward with S one key tile ahead (config s_ahead, which only
#                                              experiments/results/h200/session25/patches/s_ahead.patch adds: applied
#                                              here, reverted after) against the default at D = 96 / 64 / 128 (call 2)
#                                              or at D = 96 with the issue order and ping-pong varied (call 3, "2"),
#                                              full and causal, interleaved, each config checked against float32 first
#                                              (gluon_diag.py --fwd-configs)
#   bash experiments/gpu/session25.sh dims     issue 17's forward on this GPU: ours (triton-gluon) and cuDNN at D = 64, 96,
#                                              128, 192/128, 256, full and causal, 16K (the harness, which checks first)
#   bash experiments/gpu/session25.sh pack     experiments/gpu/pack_rate.py: do bf16 packs (F2FP) share the XU with exp2?
#   bash experiments/gpu/session25.sh maskp    variable blocks' dQ steps masked only on short entries (config
#                                              dq_mask_partial, in patches/dq_mask_partial.patch: applied here,
#                                              reverted after) against the default, checked, bits compared, 3 rounds
#   bash experiments/gpu/session25.sh dense2   the dense backward against cuDNN and Flex twice more (full, causal, 16K):
#                                              the run-to-run spread of the 0.8 target on this GPU
#   bash experiments/gpu/session25.sh ncu      Nsight Compute on the D = 96 forward (full, 16K): the default, ping-pong off,
#                                              and s_ahead 1 without ping-pong (the patch applied, reverted after)
#   bash experiments/gpu/session25.sh short    variable blocks' dQ with each list's short entries last in 32- / 16-key tiles
#                                              (config dq_short_keys) against it off ("default" in the rows: call 9 ran
#                                              before 32 became the default), checked, 3 rounds
#   bash experiments/gpu/session25.sh varratio issue 13's variable-block ratio through the harness with dq_short_keys the
#                                              default: uniform block 128 (a pattern per KV head) and variable blocks
source experiments/gpu/session_env.sh
case "${1:-}" in
  base13)
    python -m longca_triton.cli bench dense --no-plots --config experiments/dense_16k.toml --masks full,causal \
      --backends triton,sdpa-cudnn,flex --mode bwd --out "$OUT/bwd16" 2>&1 | tail -8
    accept_block_sparse
    bash experiments/gpu/wheels.sh stage && bash experiments/gpu/wheels.sh install > /dev/null 2>&1
    source experiments/gpu/wheels.sh env
    python -m longca_triton.cli bench sparse --no-plots --config experiments/sparse_64k.toml --param block=64 \
      --backends triton-sparse,vsa-triton,flex --mode bwd --out "$OUT/vsa64" 2>&1 | tail -5
    tar czf "$OUT/base13.tgz" -C "$OUT" bwd16 sparse var vsa64 && rm -rf "$OUT/bwd16" "$OUT/sparse" "$OUT/var" "$OUT/vsa64"
    ;;
  ahead)
    # the option lives in a patch (measured slower or equal: not in the package)
    git apply experiments/results/h200/session25/patches/s_ahead.patch || exit 1
    mkdir -p "$OUT/ahead"
    fwd() {  # $1: head dim, $2: configs (JSON list)
      timeout 240 python experiments/gpu/gluon_diag.py --out "$OUT/ahead/d$1" --fwd-configs 16384 --head-dims "$1" \
        --masks full,causal --interleave --config-json "$2" > "$OUT/ahead/log-d$1.txt" 2>&1 || tail -5 "$OUT/ahead/log-d$1.txt"
      grep ROW "$OUT/ahead/log-d$1.txt" | grep fwd_tflops | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l[4:]); print(r['D'], r['mask'], json.dumps(r['config']), round(r['fwd_tflops'], 1), round(r['err_out'], 5))"
    }
    if [ "${2:-}" = 2 ]; then  # call 3: the issue order and ping-pong at D = 96
      fwd 96 '[{"s_ahead": 2}, {"s_ahead": 1, "pingpong": false}, {"s_ahead": 2, "pingpong": false},
               {"s_ahead": 2, "p_smem": true}, {"pingpong": false}]'
    else  # call 2 (s_ahead was a bool then: true is 1 now)
      fwd 96 '[{"s_ahead": 1}, {"s_ahead": 1, "p_smem": true}]'
      fwd 64 '[{"s_ahead": 1, "consumers": 2, "pingpong": true}]'
      fwd 128 '[{"s_ahead": 1, "consumers": 2, "p_smem": true, "pingpong": true}]'
    fi
    nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv
    git apply -R experiments/results/h200/session25/patches/s_ahead.patch
    tar czf "$OUT/ahead.tgz" -C "$OUT" ahead && rm -rf "$OUT/ahead"
    ;;
  dims)
    python -m longca_triton.cli bench dense --no-plots --config experiments/dense_16k.toml --masks full,causal \
      --head-dim 64,96,128,192/128,256 --backends triton-gluon,sdpa-cudnn --mode fwd --out "$OUT/dims" 2>&1 | tail -24
    tar czf "$OUT/dims.tgz" -C "$OUT" dims && rm -rf "$OUT/dims"
    ;;
  pack)
    (cd experiments/gpu && python pack_rate.py) 2>&1 | tee "$OUT/pack_rate.txt"
    ;;
  maskp)
    git apply experiments/results/h200/session25/patches/dq_mask_partial.patch || exit 1
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/maskp" --check --require-equal --no-flex --budget 480 \
      --rounds 3 --dense-masks '' --sparse varblock256:32768:0.3,varblock256:65536:0.5 \
      --configs '{"default": {}, "maskp": {"dq_mask_partial": true}}' > "$OUT/maskp.log" 2>&1
    git apply -R experiments/results/h200/session25/patches/dq_mask_partial.patch
    tail -3 "$OUT/maskp.log"
    cat "$OUT/maskp/bwd_configs_ab.md"
    ;;
  dense2)
    for r in 1 2; do
      python -m longca_triton.cli bench dense --no-plots --config experiments/dense_16k.toml --masks full,causal \
        --backends triton,sdpa-cudnn,flex --mode bwd --out "$OUT/bwd16_r$r" 2>&1 | tail -4
    done
    tar czf "$OUT/dense2.tgz" -C "$OUT" bwd16_r1 bwd16_r2 && rm -rf "$OUT/bwd16_r1" "$OUT/bwd16_r2"
    ;;
  ncu)
    git apply experiments/results/h200/session25/patches/s_ahead.patch || exit 1
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    mkdir -p "$OUT/ncu"
    for tag in default nopp ahead; do
      case $tag in default) cfg='None' ;; nopp) cfg='{"pingpong": False}' ;; ahead) cfg='{"s_ahead": 1, "pingpong": False}' ;; esac
      "$NCU" --clock-control none -k regex:gluon_fwd_kernel -s 2 -c 1 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats \
        -f -o "$OUT/ncu/$tag" python -c "
import sys, torch
sys.path.insert(0, '.')
from longca_triton.kernels.gluon.op import gluon_attention
from longca_triton.masks import make_mask
S, d = 16384, 96
g = torch.Generator(device='cuda').manual_seed(0)
q = torch.randn(1, S, 64, d, device='cuda', dtype=torch.bfloat16, generator=g)
k, v = (torch.randn(1, S, 8, d, device='cuda', dtype=torch.bfloat16, generator=g) for _ in range(2))
with torch.no_grad():
    for _ in range(3):
        gluon_attention(q, k, v, make_mask('full', S), config=$cfg)
torch.cuda.synchronize()
" > "$OUT/ncu/$tag.log" 2>&1
      echo "$tag rc=$?"
      "$NCU" --import "$OUT/ncu/$tag.ncu-rep" --csv --page raw > "$OUT/ncu/$tag.csv" 2>> "$OUT/ncu/$tag.log"
      rm -f "$OUT/ncu/$tag.ncu-rep"
    done
    git apply -R experiments/results/h200/session25/patches/s_ahead.patch
    tar czf "$OUT/ncu.tgz" -C "$OUT" ncu && rm -rf "$OUT/ncu"
    ;;
  short)
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/short" --check --no-flex --budget 480 \
      --rounds 3 --dense-masks '' --sparse varblock256:32768:0.3,varblock256:65536:0.5 \
      --configs '{"default": {"dq_short_keys": 0}, "s32": {"dq_short_keys": 32}, "s16": {"dq_short_keys": 16}}' \
      > "$OUT/short.log" 2>&1
    tail -3 "$OUT/short.log"
    cat "$OUT/short/bwd_configs_ab.md"
    ;;
  varratio)
    varblock_ratio
    tar czf "$OUT/varratio.tgz" -C "$OUT" uni var && rm -rf "$OUT/uni" "$OUT/var"
    ;;
  *) echo "unknown subcommand ${1:-}"; exit 2 ;;
esac

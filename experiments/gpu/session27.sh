#!/usr/bin/env bash
# Sessions 27 and 28's GPU calls, written on a CPU (neither had device time: 27's earlier try had spent it, 28 was
# lent no machine) and left for the next session to run; experiments/gpu/NEXT.md gives the order. One subcommand per
# call; everything lands under $OUT.
#   bash experiments/gpu/session27.sh tails   issue 13's variable blocks: the GPU tests of the new paths (bf16 against
#                                             float64, equal bits of the tails apart and in the main launch), then the
#                                             backward's launches timed apart (varblock_parts.py) with the 64-key tails
#                                             query-major (dkdv_tail_cols): on their own 4 warps at 64 query rows a step
#                                             (t64w4, added in session 28), on 8 warps at 128 in their own launch
#                                             (order 2) and in the main one (order 3), 32K / 0.3
#   bash experiments/gpu/session27.sh timers  the same configs under every timer (timer_bias.py: time_fn is the
#                                             harness's), 32K / 0.3 and 64K / 0.3 (the weakest case)
#   bash experiments/gpu/session27.sh qmajor  query-major dK/dV scores (dkdv_qmajor) where a tile keeps one exponential
#                                             a score: the dense 64 x 64 / 4-warp dK/dV tile (full, causal,
#                                             causal_document at 16K), uniform block 64 and variable blocks' main
#                                             tile at 64 x 64 / 4 warps, interleaved, checked against float32
#   bash experiments/gpu/session27.sh ratios  issue 13's variable-block ratio through the harness (session 28): the
#                                             default and each tail config as a backend named with its launch config,
#                                             each timed back to back, against uniform block 128
#   bash experiments/gpu/session27.sh final   issue 13 through the harness: the variable-block ratio, the dense backward
#   bash experiments/gpu/session27.sh accept  issue 13's other targets through the harness, for the closing run with
#                                             `final` in one session (carry .whl/vsa/1: `bash experiments/gpu/wheels.sh
#                                             pack vsa vsa`): the dense backward on all 12 static masks at 16K against
#                                             Flex and cuDNN, block 128 against Flex (32K / 64K, densities 0.3 / 0.5, a
#                                             pattern per KV head and one for all), block 64 against VSA's Triton kernel
#   bash experiments/gpu/session27.sh dims    issue 17's closing run: forward and backward at D = 64, 96, 128, 192/128,
#                                             256 against cuDNN (full, causal, 16K), the targets printed
#   bash experiments/gpu/session27.sh fa3d96  issue 17: whether any kernel reaches D = 96 at 0.85x of its own D = 128
#                                             per FLOP: FlashAttention-3's forward (fa3-fwd, never run at D = 96 here)
#                                             beside ours and cuDNN at D = 96 / 128, full and causal, 16K, through the
#                                             harness, and ours on FA3's D = 96 shape (three consumer warpgroups, P
#                                             through shared memory: no spills on sm_90a, measured equal on an H100 in
#                                             session 14) (carry .whl/fa3fwd/1: `bash experiments/gpu/wheels.sh pack
#                                             fa3fwd fa3fwd` first, on the CPU host)
source experiments/gpu/session_env.sh
# t64w4 (session 28): the tails query-major on their own 4 warps, 64 query rows a step (sm_90a on the CPU: 527
# instructions a step against the default's 735, 208 bytes of spills against 264, 107 KB of shared memory: two CTAs
# an SM, as the default's; t128 takes 181 KB, one CTA an SM)
TAILS='{"t64w4": {"dkdv_tail_cols": 64}, "t128": {"dkdv_tail_cols": 128, "dkdv_tail_warps": 8}, "merged": {"dkdv_tail_cols": 128, "dkdv_tail_order": 3}}'
case "${1:-}" in
  tails)
    tests tests/test_dkdv_qmajor_gpu.py "" gpu_tests.log 240
    timeout 290 python experiments/gpu/varblock_parts.py --out "$OUT" --rounds 3 \
      --cases varblock256:32768:0.3,uniform128:32768:0.3 --configs "$TAILS" 2>&1 | tail -30
    ;;
  timers)
    C="{\"now\": {}, ${TAILS:1}"
    timer_ab t32 varblock256:32768:0.3 15 200 "$C"
    timer_ab t64 varblock256:65536:0.3 5 330 "$C"
    summary t32 t64
    python experiments/gpu/timer_verdict.py "$OUT/t32" "$OUT/t64" --baseline now | tee "$OUT/verdict.txt" | grep verdict
    ;;
  qmajor)
    Q='{"default": {}, "qm": {"DKDV_BLOCK_M": 64, "DKDV_BLOCK_N": 64, "dkdv_num_warps": 4, "dkdv_sweep": 0, "dkdv_qmajor": true}}'
    timeout 330 python experiments/gpu/bwd_configs_ab.py --out "$OUT/dense" --check --no-flex --budget 320 \
      --rounds 2 --dense-masks full,causal,causal_document --configs "$Q" > "$OUT/dense.log" 2>&1
    tail -3 "$OUT/dense.log"; cat "$OUT/dense/bwd_configs_ab.md"
    S='{"default": {}, "qm": {"dkdv_qmajor": true}, "v64qm": {"DKDV_BLOCK_N": 64, "dkdv_num_warps": 4, "dkdv_tail_rows": 0, "dkdv_qmajor": true}}'
    timeout 240 python experiments/gpu/bwd_configs_ab.py --out "$OUT/sparse" --check --no-flex --budget 230 \
      --rounds 2 --dense-masks '' --sparse uniform64:32768:0.3,varblock256:32768:0.3 --configs "$S" \
      > "$OUT/sparse.log" 2>&1
    tail -3 "$OUT/sparse.log"; cat "$OUT/sparse/bwd_configs_ab.md"
    ;;
  ratios)
    # issue 13's variable-block ratio through the harness for the default and each tail config (a backend named
    # with its launch config, session 28), each timed back to back (--sequential: the harness's time_fn)
    config_ratios "$TAILS" ratios.tgz
    ;;
  final)
    varblock_ratio
    timeout 240 python -m longca_triton.cli bench dense --no-plots --config experiments/dense_16k.toml \
      --masks full,causal --backends triton,sdpa-cudnn,flex --mode bwd --out "$OUT/bwd16" 2>&1 | tail -8
    tar czf "$OUT/final.tgz" -C "$OUT" uni var bwd16 && rm -rf "$OUT/uni" "$OUT/var" "$OUT/bwd16"
    ;;
  accept)
    bash experiments/gpu/wheels.sh stage && bash experiments/gpu/wheels.sh install > /dev/null 2>&1
    source experiments/gpu/wheels.sh env
    timeout 240 python -m longca_triton.cli bench dense --no-plots --config experiments/dense_16k.toml \
      --backends triton,sdpa-cudnn,flex --mode bwd --out "$OUT/bwd16all" 2>&1 | tail -16
    sparse128 230 sparse Hkv,1 triton-sparse,flex 2>&1 | tail -12
    timeout 240 python -m longca_triton.cli bench sparse --no-plots --config experiments/sparse_64k.toml --param block=64 \
      --backends triton-sparse,vsa-triton,flex --mode bwd --out "$OUT/vsa64" 2>&1 | tail -5
    tar czf "$OUT/accept.tgz" -C "$OUT" bwd16all sparse vsa64 && rm -rf "$OUT/bwd16all" "$OUT/sparse" "$OUT/vsa64"
    python experiments/gpu/issue13_targets.py "$OUT/accept.tgz" | tail -4
    ;;
  dims)
    # issue 17's closing run: the forward at every head dim against cuDNN, the backward beside it
    timeout 560 python -m longca_triton.cli bench dense --no-plots --config experiments/dense_16k.toml --masks full,causal \
      --head-dim 64,96,128,192/128,256 --backends triton-gluon,sdpa-cudnn --mode fwd,bwd --out "$OUT/dims" 2>&1 | tail -24
    tar czf "$OUT/dims.tgz" -C "$OUT" dims && rm -rf "$OUT/dims"
    python experiments/gpu/issue17_targets.py "$OUT/dims.tgz"
    ;;
  fa3d96)
    bash experiments/gpu/wheels.sh stage && bash experiments/gpu/wheels.sh install > /dev/null 2>&1
    source experiments/gpu/wheels.sh env
    python -c "import fa3_fwd_interface; print('fa3-fwd', fa3_fwd_interface.__file__)" || exit 1
    timeout 300 python -m longca_triton.cli bench dense --no-plots --config experiments/dense_16k.toml \
      --masks full,causal --head-dim 96,128 --mode fwd \
      --backends 'triton-gluon,triton-gluon{"consumers":3,"p_smem":true},sdpa-cudnn,fa3-fwd' \
      --out "$OUT/fa3d96" 2>&1 | tail -10
    python experiments/gpu/issue17_targets.py "$OUT/fa3d96" | grep "per FLOP"
    tar czf "$OUT/fa3d96.tgz" -C "$OUT" fa3d96 && rm -rf "$OUT/fa3d96"
    ;;
  *) echo "unknown subcommand: ${1:-}"; exit 2 ;;
esac

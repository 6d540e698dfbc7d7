#!/usr/bin/env bash
# Session 21's GPU calls (one subcommand per call; rows go straight into $OUT).
#   bash experiments/gpu/session21.sh vbdq   variable blocks' dQ pass: two query heads stacked in 128-row tiles of 64
#                                            rows each (no tail launch) against the default (128-row tiles of one head
#                                            plus a tail launch of 64-row / 4-warp tiles), checked, interleaved
# Calls 1-6 ran before the stacked dQ became the default: their "default" is one head's tiles with tails (rerun
# them today with '{"DQ_BLOCK_M": 128, "DQ_HEADS": 1, "dq_tail_rows": 64}' in its place). `split` (call 10) needs
# experiments/results/h100/session21/call10_split/dkdv_split_last.patch applied (reverted after the call).
source experiments/gpu/session_env.sh
git log --oneline -1 2>/dev/null
case "${1:-}" in
  vbdq)
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/vbdq" --check --budget 540 --rounds 3 --dense-masks '' \
      --sparse varblock256:32768:0.3,varblock256:65536:0.5 --configs '{"default": {},
        "stackdq": {"DQ_BLOCK_M": 64, "DQ_HEADS": 2, "dq_tail_rows": 0},
        "stackdq_pack": {"DQ_BLOCK_M": 64, "DQ_HEADS": 2, "dq_tail_rows": 0, "dq_pack_list": true},
        "stackdq_n128": {"DQ_BLOCK_M": 64, "DQ_HEADS": 2, "DQ_BLOCK_N": 128, "dq_num_stages": 2, "dq_tail_rows": 0}}' \
      > "$OUT/vbdq.log" 2>&1
    cat "$OUT/vbdq/bwd_configs_ab.md"
    ;;
  vbstack)
    # finer query tiles, more heads a tile (128 rows each): the row remainders of a block shrink with the tile
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/vbstack" --check --budget 540 --rounds 3 --dense-masks '' \
      --sparse varblock256:32768:0.3,varblock256:65536:0.5 --configs '{"default": {},
        "stack64x2": {"DQ_BLOCK_M": 64, "DQ_HEADS": 2, "dq_tail_rows": 0},
        "stack32x4": {"DQ_BLOCK_M": 32, "DQ_HEADS": 4, "dq_tail_rows": 0},
        "stack16x8": {"DQ_BLOCK_M": 16, "DQ_HEADS": 8, "dq_tail_rows": 0}}' \
      > "$OUT/vbstack.log" 2>&1
    cat "$OUT/vbstack/bwd_configs_ab.md"
    ;;
  vbsplit)
    # where the time goes: dK/dV and dQ alone, variable blocks (default, stacked dQ) against uniform block 128;
    # then the stacked dQ at mean blocks 128 and 512
    python experiments/gpu/bwd_variants.py --out "$OUT/split" --budget 200 --masks '' --no-vendors \
      --sparse-masks uniform128,varblock256 --sparse-variants two-kernels,dq32x64w8s3+dqheads4+dqtail0+dqchunk64 \
      > "$OUT/split.log" 2>&1
    python3 -c "import json, sys; [print(r['mask'], r['variant'], r.get('dkdv_ms'), r.get('dq_ms'), r.get('ms'))
      for r in map(json.loads, open(sys.argv[1])) if r['kind'] in ('split', 'sparse_bwd', 'bwd')]" "$OUT/split/bwd_variants.jsonl"
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/vbmeans" --check --budget 330 --rounds 2 --dense-masks '' \
      --sparse varblock128:32768:0.3,varblock512:32768:0.3,varblock256:32768:0.5 --configs '{"default": {},
        "stack64x2": {"DQ_BLOCK_M": 64, "DQ_HEADS": 2, "dq_tail_rows": 0},
        "stack32x4": {"DQ_BLOCK_M": 32, "DQ_HEADS": 4, "dq_tail_rows": 0}}' > "$OUT/vbmeans.log" 2>&1
    cat "$OUT/vbmeans/bwd_configs_ab.md"
    ;;
  vbstreams)
    # call 3's two tools disagree (bwd_variants: stacked = default; bwd_configs_ab: stacked +5-10 %): the same A/B
    # without Flex, with and without bwd_streams (the default's dQ chain is two launches on the side stream)
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/vbstreams" --no-flex --budget 300 --rounds 3 --dense-masks '' \
      --sparse varblock256:32768:0.3 --configs '{"default": {},
        "stack32x4": {"DQ_BLOCK_M": 32, "DQ_HEADS": 4, "dq_tail_rows": 0},
        "default_1s": {"bwd_streams": false},
        "stack32x4_1s": {"DQ_BLOCK_M": 32, "DQ_HEADS": 4, "dq_tail_rows": 0, "bwd_streams": false}}' > "$OUT/vbstreams.log" 2>&1
    cat "$OUT/vbstreams/bwd_configs_ab.md"
    python experiments/gpu/bwd_variants.py --out "$OUT/split" --budget 200 --masks '' --no-vendors \
      --sparse-masks varblock256 --sparse-variants dq32x64w8s3+dqheads4+dqtail0+dqchunk64,two-kernels \
      > "$OUT/split.log" 2>&1
    python3 -c "import json, sys; [print(r['mask'], r['variant'], r.get('dkdv_ms'), r.get('dq_ms'), r.get('ms'))
      for r in map(json.loads, open(sys.argv[1])) if r['kind'] in ('split', 'sparse_bwd', 'bwd')]" "$OUT/split/bwd_variants.jsonl"
    ;;
  vbtwins)
    # is bwd_configs_ab biased? each config twice under two names (equal configs must time equal), then the
    # harness's own timer on each alone (time_fn, one config after the other, both orders)
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/vbtwins" --no-flex --budget 300 --rounds 3 --dense-masks '' \
      --sparse varblock256:32768:0.3 --configs '{"default": {}, "default_b": {"bwd_streams": true},
        "stack32x4": {"DQ_BLOCK_M": 32, "DQ_HEADS": 4, "dq_tail_rows": 0},
        "stack32x4_b": {"DQ_BLOCK_M": 32, "DQ_HEADS": 4, "dq_tail_rows": 0, "bwd_streams": true}}' > "$OUT/vbtwins.log" 2>&1
    cat "$OUT/vbtwins/bwd_configs_ab.md"
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/vbpair" --no-flex --budget 200 --rounds 3 --dense-masks '' \
      --sparse varblock256:32768:0.3 --configs '{"default": {},
        "stack32x4": {"DQ_BLOCK_M": 32, "DQ_HEADS": 4, "dq_tail_rows": 0}}' > "$OUT/vbpair.log" 2>&1
    cat "$OUT/vbpair/bwd_configs_ab.md"
    ;;
  timer)
    # the two timers on the same two configs, one process (experiments/gpu/timer_bias.py)
    python experiments/gpu/timer_bias.py --out "$OUT" > "$OUT/timer.log" 2>&1; tail -24 "$OUT/timer.log"
    ;;
  accept)
    # issue 13's variable-block target through the harness with the stacked dQ default: variable blocks (mean
    # 256) against uniform block 128, densities 0.3 / 0.5, 32K / 64K, a pattern per KV head
    bench() { python -m longca_triton.cli bench "$@" --no-plots --seqlens 32K,64K --mode bwd; }
    bench varblock --config experiments/varblock.toml --param block=256 --param density=0.3,0.5 \
      --backends triton-varblock --out "$OUT/var" 2>&1 | tail -8
    bench sparse --config experiments/sparse_64k.toml --param block=128 --param density=0.3,0.5 \
      --param patterns=Hkv --backends triton-sparse --out "$OUT/sparse" 2>&1 | tail -8
    ;;
  dense)
    # issue 13's dense cuDNN targets once more (full sat at 0.791 / 0.797 in session 20): full and causal at 16K
    python -m longca_triton.cli bench dense --no-plots --config experiments/dense_16k.toml --masks full,causal \
      --backends triton,sdpa-cudnn,flex --mode bwd --out "$OUT/bwd16" 2>&1 | tail -8
    ;;
  fullring)
    # full / causal's dQ with a deeper ring or wider key steps (not measured on these masks before), checked
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/fullring" --check --budget 400 --rounds 3 \
      --dense-masks full,causal --configs '{"default": {},
        "dq_s4": {"DQ_BLOCK_M": 128, "DQ_BLOCK_N": 64, "dq_num_warps": 8, "dq_num_stages": 4},
        "dq_n128_s2": {"DQ_BLOCK_M": 128, "DQ_BLOCK_N": 128, "dq_num_warps": 8, "dq_num_stages": 2}}' \
      > "$OUT/fullring.log" 2>&1
    cat "$OUT/fullring/bwd_configs_ab.md"
    ;;
  split)
    # dkdv_split_last (a packed dK/dV list's last entry masked in a loop of its own, the rest unmasked: sm_90a
    # 649 instructions a step against 773), equal bits required, interleaved; then both timers on the pair
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/split" --check --require-equal --no-flex --budget 300 \
      --rounds 3 --dense-masks '' --sparse varblock256:32768:0.3,varblock256:65536:0.5 \
      --configs '{"default": {}, "split_last": {"dkdv_split_last": true}}' > "$OUT/split.log" 2>&1
    cat "$OUT/split/bwd_configs_ab.md"
    python experiments/gpu/timer_bias.py --out "$OUT" --configs '{"default": {}, "split_last": {"dkdv_split_last": true}}' \
      > "$OUT/timer.log" 2>&1; grep -v "^{\"timer\": \"time_interleaved\[one" "$OUT/timer.log" | tail -12
    ;;
  vbdkdv)
    # variable blocks' dK/dV tile once more with the stacked dQ (session 16 call 3 read 128-key tiles equal)
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/vbdkdv" --check --no-flex --budget 400 --rounds 3 \
      --dense-masks '' --sparse varblock256:32768:0.3,varblock256:65536:0.5 --configs '{"default": {},
        "k128t64s2": {"DKDV_BLOCK_N": 128, "dkdv_num_warps": 8, "dkdv_num_stages": 2, "dkdv_tail_rows": 64},
        "k128t64s3": {"DKDV_BLOCK_N": 128, "dkdv_num_warps": 8, "dkdv_num_stages": 3, "dkdv_tail_rows": 64},
        "k64s3": {"DKDV_BLOCK_N": 64, "dkdv_num_warps": 4, "dkdv_num_stages": 3}}' > "$OUT/vbdkdv.log" 2>&1
    cat "$OUT/vbdkdv/bwd_configs_ab.md"
    ;;
  gputests)
    # the GPU tests after the stacked dQ default (tests/test_streams_gpu.py: equal bits with streams, MHA's
    # fallback to one head's tiles and tails, the stacked tile against one head's), then D = 96 / MHA checked
    tests tests/test_streams_gpu.py "" gpu_tests_streams.txt 300
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/d96" --check --no-flex --budget 150 --rounds 1 --rep 3 \
      --dense-masks '' --head-dim 96 --sparse varblock256:16384:0.3 --configs '{"default": {},
        "one_head": {"DQ_BLOCK_M": 128, "DQ_HEADS": 1, "dq_tail_rows": 64}}' > "$OUT/d96.log" 2>&1
    cat "$OUT/d96/bwd_configs_ab.md"
    ;;
  *) echo "unknown subcommand: ${1:-}"; exit 2 ;;
esac

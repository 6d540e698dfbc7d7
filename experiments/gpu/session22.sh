#!/usr/bin/env bash
# Session 22's GPU calls (one subcommand per call; rows go straight into $OUT).
#   bash experiments/gpu/session22.sh vbdkdv  variable blocks' dK/dV in uniform block 128's structure (128-key tiles
#                                             on 8 warps, 64-key tails, head-major, lists in register chunks, a KV
#                                             head's own pattern order), packed and plain, against the default
#   bash experiments/gpu/session22.sh vbsplit each pass alone (dK/dV, dQ): uniform 128, variable blocks ragged and
#                                             128-aligned, the default and the 128-key head-major dK/dV
#   bash experiments/gpu/session22.sh parts   the dK/dV pass's main and tail launches apart; stats diagnostics
#   bash experiments/gpu/session22.sh statstma the dK/dV step's stats by TMA boxes (dkdv_stats_tma), checked and timed
#   bash experiments/gpu/session22.sh densetma the dense dK/dV stats by TMA boxes, checked, bit-compared and timed
#   bash experiments/gpu/session22.sh densek128 the dense dK/dV on 128-key / 8-warp tiles, with the stats by TMA
#   bash experiments/gpu/session22.sh accept   issue 13's block-sparse and variable-block targets through the harness
#   bash experiments/gpu/session22.sh gputests `pytest -m gpu` on the stats by TMA boxes and the streams
#   bash experiments/gpu/session22.sh dims     the stats boxes at D = 64 and 96 (block 128)
#   bash experiments/gpu/session22.sh block64  the stats boxes at block 64
source experiments/gpu/session_env.sh
git log --oneline -1 2>/dev/null
case "${1:-}" in
  vbdkdv)
    # session 21 call 11 tried 128-key tiles only with the default's row-major sweep (lists read entry by entry)
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/vbdkdv" --check --no-flex --budget 500 --rounds 3 \
      --dense-masks '' --sparse varblock256:32768:0.3,varblock256:65536:0.5 --configs '{"default": {},
        "k128hm_c64": {"DKDV_BLOCK_N": 128, "dkdv_num_warps": 8, "dkdv_num_stages": 3, "dkdv_tail_rows": 64,
                       "dkdv_sweep": 0, "dkdv_list_chunk": 64, "dkdv_pattern_order": true},
        "k128hm_c64_plain": {"DKDV_BLOCK_N": 128, "dkdv_num_warps": 8, "dkdv_num_stages": 3, "dkdv_tail_rows": 64,
                       "dkdv_sweep": 0, "dkdv_list_chunk": 64, "dkdv_pattern_order": true, "dkdv_pack_list": false},
        "k128hm_c0": {"DKDV_BLOCK_N": 128, "dkdv_num_warps": 8, "dkdv_num_stages": 3, "dkdv_tail_rows": 64,
                       "dkdv_sweep": 0, "dkdv_list_chunk": 0, "dkdv_pattern_order": true},
        "k64hm_c64": {"DKDV_BLOCK_N": 64, "dkdv_num_warps": 4, "dkdv_num_stages": 3, "dkdv_sweep": 0,
                       "dkdv_list_chunk": 64, "dkdv_pattern_order": true},
        "k128sw2_s4": {"DKDV_BLOCK_N": 128, "dkdv_num_warps": 8, "dkdv_num_stages": 4, "dkdv_tail_rows": 64}}' \
      > "$OUT/vbdkdv.log" 2>&1
    cat "$OUT/vbdkdv/bwd_configs_ab.md"
    ;;
  vbsplit)
    # where the time goes now: dK/dV and dQ alone, uniform block 128 and variable blocks (ragged and 128-aligned)
    # under the default and the 128-key head-major dK/dV (call 1's winner, 3 and 4 stages)
    python experiments/gpu/bwd_variants.py --out "$OUT/split" --budget 450 --masks '' --no-vendors \
      --sparse-masks uniform128,varblock256,varblock256x128 \
      --sparse-variants two-kernels,dkdv64x128w8s3+hm+dkdvtail64+porder,dkdv64x128w8s4+hm+dkdvtail64+porder \
      > "$OUT/split.log" 2>&1
    python3 -c "import json, sys; [print(r['mask'], r['variant'], r.get('dkdv_ms'), r.get('dq_ms'), r.get('ms'))
      for r in map(json.loads, open(sys.argv[1])) if r['kind'] in ('split', 'sparse_bwd', 'bwd')]" "$OUT/split/bwd_variants.jsonl"
    ;;
  parts)
    # the dK/dV pass in parts (main tiles' launch, tail tiles' launch) for ragged / 128-aligned variable blocks and
    # uniform 128; then the ragged case with the stats of an entry's missing rows read unmasked at its first row
    # (stats_unmasked.patch, exact) and without any stats (no_stats_DIAGNOSTIC.patch: wrong gradients, a bound)
    K128='"DKDV_BLOCK_N": 128, "dkdv_num_warps": 8, "dkdv_num_stages": 3, "dkdv_tail_rows": 64, "dkdv_sweep": 0,
          "dkdv_list_chunk": 0, "dkdv_pattern_order": true'
    PATCHES=experiments/results/h100/session22/patches
    python experiments/gpu/dkdv_parts.py --out "$OUT/parts/base" --configs "{\"default\": {}, \"k128\": {$K128}}" \
      --sparse varblock256:32768:0.3,varblock256x128:32768:0.3,uniform128:32768:0.3 > "$OUT/parts_base.log" 2>&1
    for p in stats_unmasked no_stats_DIAGNOSTIC; do
      patch -p1 < "$PATCHES/$p.patch" > /dev/null
      python experiments/gpu/dkdv_parts.py --out "$OUT/parts/$p" --configs "{\"k128\": {$K128}}" \
        --sparse varblock256:32768:0.3,varblock256x128:32768:0.3 > "$OUT/parts_$p.log" 2>&1
      patch -R -p1 < "$PATCHES/$p.patch" > /dev/null
    done
    cat "$OUT"/parts/*/dkdv_parts.jsonl
    ;;
  statstma)
    # dkdv_stats_tma: the dK/dV step's lse / delta by TMA boxes of a 1-D descriptor (checked against float32 first:
    # the CPU interpreter refuses box starts that are not 16-byte aligned, the hardware is the test)
    K128='"DKDV_BLOCK_N": 128, "dkdv_num_warps": 8, "dkdv_num_stages": 3, "dkdv_tail_rows": 64, "dkdv_sweep": 0,
          "dkdv_list_chunk": 0, "dkdv_pattern_order": true'
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/statstma" --check --no-flex --budget 420 --rounds 3 \
      --dense-masks '' --sparse uniform128:32768:0.3,varblock256:32768:0.3 --configs "{\"default\": {},
        \"tma\": {\"dkdv_stats_tma\": true}, \"k128\": {$K128}, \"k128_tma\": {$K128, \"dkdv_stats_tma\": true}}" \
      > "$OUT/statstma.log" 2>&1
    grep '"check"' "$OUT/statstma/bwd_configs_ab.jsonl" | cut -c1-300
    cat "$OUT/statstma/bwd_configs_ab.md"
    python experiments/gpu/dkdv_parts.py --out "$OUT/parts_tma" --configs "{\"default\": {}, \"tma\": {\"dkdv_stats_tma\": true},
      \"k128\": {$K128}, \"k128_tma\": {$K128, \"dkdv_stats_tma\": true}}" \
      --sparse varblock256:32768:0.3,uniform128:32768:0.3 > "$OUT/parts_tma.log" 2>&1
    cut -c1-400 "$OUT/parts_tma/dkdv_parts.jsonl"
    ;;
  densetma)
    # dkdv_stats_tma on the dense dK/dV kernel (stats rows of 16 bytes, one 3-d TMA box a step), checked against
    # float32, interleaved with the default; then uniform block 128 at 64K / 0.5 and one pattern for all heads
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/densetma" --check --require-equal --no-flex --budget 520 \
      --rounds 3 --dense-masks full,causal,causal_document,sliding_window,prefix_lm_causal \
      --sparse uniform128:65536:0.5 --configs '{"default": {}, "stats_tma": {"dkdv_stats_tma": true}}' \
      > "$OUT/densetma.log" 2>&1
    cat "$OUT/densetma/bwd_configs_ab.md"
    ;;
  densek128)
    # the dense dK/dV on the block-sparse uniform tile (128 keys a program, 8 warps, 3 stages), with and without
    # its stats by TMA boxes (session 16 call: 64x128/8/3 within 1 % of 64x64/4/2 on causal)
    K128='"DKDV_BLOCK_M": 64, "DKDV_BLOCK_N": 128, "dkdv_num_warps": 8, "dkdv_num_stages": 3, "dkdv_sweep": 0'
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/densek128" --check --no-flex --budget 400 --rounds 3 \
      --dense-masks full,causal,prefix_lm_causal --configs "{\"default\": {}, \"k128\": {$K128},
        \"k128_tma\": {$K128, \"dkdv_stats_tma\": true}, \"k128_tma_outer\": {$K128, \"dkdv_stats_tma\": true,
        \"dkdv_head_outer\": true}}" > "$OUT/densek128.log" 2>&1
    cat "$OUT/densek128/bwd_configs_ab.md"
    ;;
  accept)
    # issue 13 through the harness with the new defaults (variable blocks' 128-key dK/dV, uniform blocks' stats by
    # TMA boxes): block 128 against Flex (a pattern per KV head and one for all), variable blocks (mean 256)
    # against uniform block 128, densities 0.3 / 0.5, 32K / 64K
    accept_block_sparse
    ;;
  gputests)
    # the stats by TMA boxes give the pointer path's bits; variable blocks' new dK/dV against float64; the streams
    # tests once more (variable blocks' dK/dV chain now has a tail launch of its own)
    tests tests/test_stats_tma_gpu.py "" gpu_tests_stats_tma.txt 300
    tests tests/test_streams_gpu.py "" gpu_tests_streams.txt 200
    ;;
  dims)
    # the stats boxes (uniform blocks' new default at D <= 128) at D = 64 and 96, against the pointer loads
    for d in 64 96; do
      python experiments/gpu/bwd_configs_ab.py --out "$OUT/dims$d" --check --require-equal --no-flex --budget 250 \
        --rounds 3 --head-dim $d --dense-masks '' --sparse uniform128:32768:0.3 \
        --configs '{"pointers": {"dkdv_stats_tma": false}, "default": {}}' > "$OUT/dims$d.log" 2>&1
      cat "$OUT/dims$d/bwd_configs_ab.md"
    done
    ;;
  block64)
    # the stats boxes at block 64 (64 x 64 dK/dV tiles on 4 warps, q / dO by pointers; not its default yet)
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/block64" --check --require-equal --no-flex --budget 250 \
      --rounds 3 --dense-masks '' --sparse uniform64:32768:0.3,uniform64:32768:0.5 \
      --configs '{"default": {}, "stats_tma": {"dkdv_stats_tma": true}}' > "$OUT/block64.log" 2>&1
    cat "$OUT/block64/bwd_configs_ab.md"
    ;;
  *) echo "unknown subcommand: ${1:-}"; exit 2 ;;
esac

#!/usr/bin/env bash
# Session 20's GPU calls (one subcommand per call; rows go straight into $OUT).
#   bash experiments/gpu/session20.sh streams  bwd_streams' GPU tests (equal bits, a caller's stream) and the Gluon
#                                              dQ kernel's dq_mask_head tests; then the dense backward of `triton`
#                                              with bwd_streams off / on and Flex, interleaved, on five masks at 16K
#   bash experiments/gpu/session20.sh sparse   the same A/B on issue 13's block-sparse cases (a pattern per KV head)
#                                              and variable blocks; then dq_mask_head off / on (triton-gluon)
#   bash experiments/gpu/session20.sh merge    the dense backward's merged run walks (dkdv_merge_runs / dq_merge_runs)
#                                              against the default on seven masks at 16K, checked, Flex beside
#   bash experiments/gpu/session20.sh wintiles the sliding windows' dK/dV and dQ tiles against the default
#   bash experiments/gpu/session20.sh stages   4- and 5-stage rings of the default tiles on the even masks
#   bash experiments/gpu/session20.sh accept_dense|accept_sparse   issue 13's targets through the harness
#   bash experiments/gpu/session20.sh split    block-sparse dK/dV and dQ alone, a pattern per KV head vs one
#   bash experiments/gpu/session20.sh porder   dkdv_pattern_order against the default, block-sparse and varblock
#   bash experiments/gpu/session20.sh gluon    GPU tests (pattern order), then triton-gluon's mixed backward with
#                                              bwd_streams against its default
#   bash experiments/gpu/session20.sh gluon_bwd  triton-gluon's backward through the harness, cuDNN beside
#   bash experiments/gpu/session20.sh fulldq   smaller dQ CTAs on full / causal (to share an SM with dK/dV)
#   bash experiments/gpu/session20.sh block64  bwd_streams / dkdv_pattern_order at block 64
source experiments/gpu/session_env.sh
case "${1:-}" in
  streams)
    tests tests/test_streams_gpu.py "streams" gpu_tests_streams.txt 200
    tests tests/test_gluon_gpu.py "dq_mask_head" gpu_tests_dq_mask_head.txt 200
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/dense" --require-equal --budget 330 \
      --dense-masks sliding_window,sliding_window_causal,full,causal,causal_document > "$OUT/dense.log" 2>&1
    cat "$OUT/dense/bwd_configs_ab.md"
    ;;
  sparse)
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/sparse" --require-equal --budget 400 --dense-masks '' \
      --sparse uniform128:32768:0.3,uniform128:32768:0.5,uniform128:65536:0.5,varblock256:32768:0.3 \
      > "$OUT/sparse.log" 2>&1
    cat "$OUT/sparse/bwd_configs_ab.md"
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/dqhead" --budget 120 --dense-masks '' --no-flex \
      --gluon-masks causal,prefix_lm_causal --configs '{"default": {}, "dq_mask_head": {"dq_mask_head": true}}' \
      > "$OUT/dqhead.log" 2>&1
    cat "$OUT/dqhead/bwd_configs_ab.md"
    ;;
  merge)
    # dkdv_merge_runs / dq_merge_runs (one loop per tile, partial tiles masked behind a branch) against the
    # default (bwd_streams on the even masks), each checked against float32 first, Flex beside
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/merge" --check --budget 540 \
      --dense-masks sliding_window_causal,sliding_window,global_sliding_window,causal,causal_document,prefix_lm_causal,full_document \
      --configs '{"default": {}, "dkdv_merge": {"dkdv_merge_runs": true}, "dq_merge": {"dq_merge_runs": true}, "merge": {"dkdv_merge_runs": true, "dq_merge_runs": true}}' \
      > "$OUT/merge.log" 2>&1
    cat "$OUT/merge/bwd_configs_ab.md"
    ;;
  wintiles)
    # the two sliding windows' dK/dV and dQ tiles against the default (bwd_streams on), checked, Flex beside
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/wintiles" --check --budget 540 \
      --dense-masks sliding_window_causal,sliding_window --configs '{"default": {},
        "dkdv32x128w8s3": {"DKDV_BLOCK_M": 32, "DKDV_BLOCK_N": 128, "dkdv_num_warps": 8, "dkdv_num_stages": 3},
        "dkdv16x64w4s3": {"DKDV_BLOCK_M": 16, "DKDV_BLOCK_N": 64, "dkdv_num_warps": 4, "dkdv_num_stages": 3},
        "dkdv32x64w4s4": {"DKDV_BLOCK_M": 32, "DKDV_BLOCK_N": 64, "dkdv_num_warps": 4, "dkdv_num_stages": 4},
        "dq128x128w8s2": {"DQ_BLOCK_M": 128, "DQ_BLOCK_N": 128, "dq_num_warps": 8, "dq_num_stages": 2},
        "dq128x32w8s3": {"DQ_BLOCK_M": 128, "DQ_BLOCK_N": 32, "dq_num_warps": 8, "dq_num_stages": 3},
        "dq128x64w8s4": {"DQ_BLOCK_M": 128, "DQ_BLOCK_N": 64, "dq_num_warps": 8, "dq_num_stages": 4}}' \
      > "$OUT/wintiles.log" 2>&1
    cat "$OUT/wintiles/bwd_configs_ab.md"
    ;;
  stages)
    # deeper rings on the even masks (the two 4-stage winners of `wintiles`, alone and together, and dQ at 5)
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/stages" --check --budget 540 --rounds 3 \
      --dense-masks sliding_window_causal,sliding_window,global_sliding_window,full --configs '{"default": {},
        "dkdv_s4": {"DKDV_BLOCK_M": 32, "DKDV_BLOCK_N": 64, "dkdv_num_warps": 4, "dkdv_num_stages": 4},
        "dq_s4": {"DQ_BLOCK_M": 128, "DQ_BLOCK_N": 64, "dq_num_warps": 8, "dq_num_stages": 4},
        "both_s4": {"DKDV_BLOCK_M": 32, "DKDV_BLOCK_N": 64, "dkdv_num_warps": 4, "dkdv_num_stages": 4,
                    "DQ_BLOCK_M": 128, "DQ_BLOCK_N": 64, "dq_num_warps": 8, "dq_num_stages": 4},
        "dkdv_s4_dq_s5": {"DKDV_BLOCK_M": 32, "DKDV_BLOCK_N": 64, "dkdv_num_warps": 4, "dkdv_num_stages": 4,
                          "DQ_BLOCK_M": 128, "DQ_BLOCK_N": 64, "dq_num_warps": 8, "dq_num_stages": 5}}' \
      > "$OUT/stages.log" 2>&1
    cat "$OUT/stages/bwd_configs_ab.md"
    ;;
  accept_dense)
    # issue 13's dense targets with this session's defaults: ours, cuDNN and Flex on every static mask at 16K
    python -m longca_triton.cli bench dense --no-plots --config experiments/dense_16k.toml \
      --backends triton,sdpa-cudnn,flex --mode bwd --out "$OUT/bwd16" 2>&1 | tail -30
    ;;
  accept_sparse)
    # issue 13's block-sparse targets (block 128, densities 0.3 / 0.5, 32K / 64K, a pattern per KV head and one
    # for all heads, against Flex), then variable blocks (mean 256) against uniform block 128, a pattern per KV head
    accept_block_sparse
    ;;
  split)
    # where a pattern per KV head loses to one pattern for all heads (block 128, 32K, density 0.3): the dK/dV
    # and dQ kernels timed alone, with the KV head slowest in the dK/dV grid (default) and fastest (inner)
    for P in 0 1; do
      python experiments/gpu/bwd_variants.py --out "$OUT/split_p$P" --budget 200 --masks '' --sparse-masks uniform128 \
        --no-vendors --sparse-patterns $P --sparse-variants two-kernels,inner > "$OUT/split_p$P.log" 2>&1
      python3 -c "import json, sys; [print('patterns', sys.argv[1], r['variant'], r.get('dkdv_ms'), r.get('dq_ms'), r.get('ms'))
        for r in map(json.loads, open(sys.argv[2])) if r['kind'] in ('split', 'bwd')]" $P "$OUT/split_p$P/bwd_variants.jsonl"
    done
    ;;
  porder)
    # dkdv_pattern_order (a KV head's dK/dV programs heaviest first by its own pattern) against the default
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/porder" --require-equal --budget 500 --dense-masks '' \
      --rounds 3 --sparse uniform128:32768:0.3,uniform128:32768:0.5,uniform128:65536:0.3,uniform128:65536:0.5,varblock256:32768:0.3 \
      --configs '{"default": {}, "pattern_order": {"dkdv_pattern_order": true}}' > "$OUT/porder.log" 2>&1
    cat "$OUT/porder/bwd_configs_ab.md"
    ;;
  gluon)
    # the GPU tests written after call 9 (dkdv_pattern_order's equal bits), then the Gluon tier's mixed backward
    # with bwd_streams (plain-Triton dK/dV first, the Gluon dQ kernel beside it) against its default, checked
    tests tests/test_streams_gpu.py "streams or pattern_order" gpu_tests_streams2.txt 200
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/gstreams" --check --require-equal --budget 330 --no-flex \
      --dense-masks '' --gluon-masks sliding_window_causal,sliding_window,full,causal,causal_document,prefix_lm_causal \
      --configs '{"default": {}, "bwd_streams": {"bwd_streams": true}}' > "$OUT/gstreams.log" 2>&1
    cat "$OUT/gstreams/bwd_configs_ab.md"
    ;;
  gluon_bwd)
    # triton-gluon's backward through the harness with its new defaults (dq_mask_head, bwd_streams), cuDNN beside
    python -m longca_triton.cli bench dense --no-plots --config experiments/dense_16k.toml \
      --backends triton-gluon,sdpa-cudnn --mode bwd --out "$OUT/gbwd16" 2>&1 | tail -16
    ;;
  fulldq)
    # full's backward with bwd_streams: smaller dQ CTAs that fit beside a 64x64 dK/dV CTA (99 KB) on one SM
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/fulldq" --check --budget 300 --rounds 3 \
      --dense-masks full,causal --configs '{"default": {},
        "dq_s2": {"DQ_BLOCK_M": 128, "DQ_BLOCK_N": 64, "dq_num_warps": 8, "dq_num_stages": 2},
        "dq64": {"DQ_BLOCK_M": 64, "DQ_BLOCK_N": 64, "dq_num_warps": 4, "dq_num_stages": 2},
        "dq_s2_streams": {"DQ_BLOCK_M": 128, "DQ_BLOCK_N": 64, "dq_num_warps": 8, "dq_num_stages": 2,
                          "bwd_streams": true}}' > "$OUT/fulldq.log" 2>&1
    cat "$OUT/fulldq/bwd_configs_ab.md"
    ;;
  block64)
    # block 64 (64x64 tiles, not chunked): bwd_streams and dkdv_pattern_order, alone and together
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/block64" --require-equal --budget 520 --dense-masks '' \
      --sparse uniform64:32768:0.3,uniform64:65536:0.5 --configs '{"default": {}, "streams": {"bwd_streams": true},
        "pattern_order": {"dkdv_pattern_order": true}, "both": {"bwd_streams": true, "dkdv_pattern_order": true}}' \
      > "$OUT/block64.log" 2>&1
    cat "$OUT/block64/bwd_configs_ab.md"
    ;;
  *)
    echo "usage: $0 streams|sparse|merge|wintiles|stages|accept_dense|accept_sparse|split|porder|gluon|gluon_bwd|fulldq|block64" >&2
    exit 2 ;;
esac

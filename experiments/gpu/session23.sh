#!/usr/bin/env bash
# Session 23's GPU calls (one subcommand per call; rows go straight into $OUT).
#   bash experiments/gpu/session23.sh skew     dq_skew (each dQ step's dS K GEMM issued one step late, after the next
#                                              step's S and dP): dense and block-sparse, checked, bit-compared, timed
#   bash experiments/gpu/session23.sh full     dq_skew the default on full masks: full / causal against cuDNN and Flex
#                                              through the harness, then dq_skew at D = 64 / 96 / 128 on full (A/B)
#   bash experiments/gpu/session23.sh tails    variable blocks' dK/dV tail tiles over plain query lists (TMA boxes, no
#                                              gathers; patches/dkdv_tail_plain.patch) against packed: the pass in parts
#   bash experiments/gpu/session23.sh beside   variable blocks: the dK/dV tail launch at the head of the dQ chain (side
#                                              stream) against after the main dK/dV launch, checked, bit-compared, timed
#   bash experiments/gpu/session23.sh issue13  (carry .whl/vsa/1) issue 13's targets in one call with this session's code:
#                                              dense (12 masks against Flex, full / causal against cuDNN), block 128
#                                              against Flex, variable blocks against uniform, block 64 against VSA;
#                                              then a fourth dQ stage on variable / uniform blocks (A/B)
#   bash experiments/gpu/session23.sh sparse   (carry .whl/vsa/1) the block-sparse targets through the harness again with
#                                              variable blocks' fourth dQ stage (the default now), block 64 against VSA;
#                                              everything tarred into $OUT/sparse_all.tgz (more than 8 files)
#   bash experiments/gpu/session23.sh dqs4     (call 8) a fourth dQ stage on variable blocks, four cases, A/B (it also
#                                              reads lists entry by entry: bwd_configs_ab's overlay sets a dQ launch key)
#   bash experiments/gpu/session23.sh timerbias (calls 10-11) the same pairs under every timer (timer_bias.py)
#   bash experiments/gpu/session23.sh varaccept (call 12) the block-sparse targets through the harness, tarred
#   bash experiments/gpu/session23.sh recheck  choices older than the stacked dQ tile, re-measured: bwd_streams off, 32-key
#                                              dQ steps; uniform block 128's dQ entry by entry (chunk key named in each)
#   bash experiments/gpu/session23.sh accept   (carry .whl/vsa/1) issue 13's dense cuDNN targets once more and block 64
#                                              against VSA's Triton kernel (64K, density 0.5, a pattern per KV head)
source experiments/gpu/session_env.sh
git log --oneline -1 2>/dev/null
case "${1:-}" in
  skew)
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/skew" --check --require-equal --no-flex --budget 540 \
      --rounds 3 --dense-masks full,causal,causal_document,sliding_window \
      --sparse uniform128:32768:0.3,varblock256:32768:0.3,uniform64:32768:0.3 \
      --configs '{"default": {}, "skew": {"dq_skew": true}}' > "$OUT/skew.log" 2>&1
    tail -5 "$OUT/skew.log"
    cat "$OUT/skew/bwd_configs_ab.md"
    ;;
  full)
    python -m longca_triton.cli bench dense --no-plots --config experiments/dense_16k.toml --masks full,causal \
      --backends triton,sdpa-cudnn,flex --mode bwd --out "$OUT/bwd16" 2>&1 | tail -8
    for d in 128 96 64; do
      python experiments/gpu/bwd_configs_ab.py --out "$OUT/skew_d$d" --check --require-equal --no-flex --budget 150 \
        --rounds 3 --head-dim $d --dense-masks full --configs '{"noskew": {"dq_skew": false}, "skew": {"dq_skew": true}}' \
        > "$OUT/skew_d$d.log" 2>&1
      tail -3 "$OUT/skew_d$d/bwd_configs_ab.md"
    done
    ;;
  tails)
    P=experiments/results/h100/session23/patches/dkdv_tail_plain.patch
    python experiments/gpu/dkdv_parts.py --out "$OUT/parts_packed" --sparse varblock256:32768:0.3,varblock256:65536:0.5 \
      > "$OUT/parts_packed.log" 2>&1
    patch -p1 < "$P" > /dev/null
    python experiments/gpu/dkdv_parts.py --out "$OUT/parts_plain" --sparse varblock256:32768:0.3,varblock256:65536:0.5 \
      > "$OUT/parts_plain.log" 2>&1
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/plain_check" --check --no-flex --budget 120 --rounds 1 \
      --dense-masks '' --sparse varblock256:32768:0.3 > "$OUT/plain_check.log" 2>&1
    patch -R -p1 < "$P" > /dev/null
    cat "$OUT"/parts_*/dkdv_parts.jsonl
    grep '"kind": "check"' "$OUT/plain_check/bwd_configs_ab.jsonl"
    ;;
  beside)
    P=experiments/results/h100/session23/patches/dkdv_tail_beside.patch  # the option as measured (not kept)
    patch -p1 < "$P" > /dev/null
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/beside" --check --require-equal --no-flex --budget 500 \
      --rounds 3 --dense-masks '' --sparse varblock256:32768:0.3,varblock256:65536:0.5,varblock256:32768:0.5 \
      --configs '{"default": {}, "beside": {"dkdv_tail_beside": true}}' > "$OUT/beside.log" 2>&1
    patch -R -p1 < "$P" > /dev/null
    cat "$OUT/beside/bwd_configs_ab.md"
    ;;
  issue13)
    bash experiments/gpu/wheels.sh stage && bash experiments/gpu/wheels.sh install > /dev/null 2>&1
    source experiments/gpu/wheels.sh env
    python -m longca_triton.cli bench dense --no-plots --config experiments/dense_16k.toml \
      --backends triton,sdpa-cudnn,flex --mode bwd --out "$OUT/bwd16" 2>&1 | tail -16
    accept_block_sparse
    python -m longca_triton.cli bench sparse --no-plots --config experiments/sparse_64k.toml --param block=64 \
      --backends triton-sparse,vsa-triton --mode bwd --out "$OUT/vsa64" 2>&1 | tail -4
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/dqs4" --no-flex --budget 90 --rounds 2 --dense-masks '' \
      --sparse varblock256:32768:0.3,uniform128:32768:0.3 --configs '{"default": {}, "dqs4": {"dq_num_stages": 4}}' \
      > "$OUT/dqs4.log" 2>&1
    cat "$OUT/dqs4/bwd_configs_ab.md"
    ;;
  sparse)
    bash experiments/gpu/wheels.sh stage && bash experiments/gpu/wheels.sh install > /dev/null 2>&1
    source experiments/gpu/wheels.sh env
    accept_block_sparse
    python -m longca_triton.cli bench sparse --no-plots --config experiments/sparse_64k.toml --param block=64 \
      --backends triton-sparse,vsa-triton --mode bwd --out "$OUT/vsa64" 2>&1 | tail -4
    tar czf "$OUT/sparse_all.tgz" -C "$OUT" sparse var vsa64 && rm -rf "$OUT/sparse" "$OUT/var" "$OUT/vsa64"
    ;;
  dqs4)
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/dqs4b" --check --require-equal --no-flex --budget 400 \
      --rounds 3 --dense-masks '' --sparse varblock256:32768:0.3,varblock256:65536:0.5,varblock256:32768:0.5,varblock256:65536:0.3 \
      --configs '{"default": {}, "dqs4": {"dq_num_stages": 4}}' > "$OUT/dqs4b.log" 2>&1
    cat "$OUT/dqs4b/bwd_configs_ab.md"
    ;;
  timerbias)
    python experiments/gpu/timer_bias.py --out "$OUT/tb" --sparse varblock256:32768:0.3 \
      --configs '{"s3": {"dq_num_stages": 3}, "s4": {"dq_num_stages": 4}}' > "$OUT/tb.log" 2>&1
    python experiments/gpu/timer_bias.py --out "$OUT/tb2" --sparse varblock256:32768:0.3 \
      --configs '{"default": {}, "c0s3": {"dq_list_chunk": 0, "dq_num_stages": 3}}' > "$OUT/tb2.log" 2>&1
    ;;
  varaccept)
    accept_block_sparse
    tar czf "$OUT/sparse_all.tgz" -C "$OUT" sparse var && rm -rf "$OUT/sparse" "$OUT/var"
    ;;
  recheck)
    python experiments/gpu/bwd_configs_ab.py --out "$OUT/recheck" --check --no-flex --budget 420 \
      --rounds 3 --dense-masks '' --sparse varblock256:32768:0.3,uniform128:32768:0.3 --configs '{"default": {},
        "nostreams": {"bwd_streams": false}, "dq_entries": {"dq_list_chunk": 0},
        "dqn32": {"DQ_BLOCK_N": 32, "dq_num_stages": 4, "dq_list_chunk": 0}}' > "$OUT/recheck.log" 2>&1
    cat "$OUT/recheck/bwd_configs_ab.md"
    ;;
  accept)
    bash experiments/gpu/wheels.sh stage && bash experiments/gpu/wheels.sh install > /dev/null 2>&1
    source experiments/gpu/wheels.sh env
    python -m longca_triton.cli bench dense --no-plots --config experiments/dense_16k.toml --masks full,causal \
      --backends triton,sdpa-cudnn,flex --mode bwd --out "$OUT/bwd16" 2>&1 | tail -5
    python -m longca_triton.cli bench sparse --no-plots --config experiments/sparse_64k.toml --param block=64 \
      --backends triton-sparse,vsa-triton,flex --mode bwd --out "$OUT/vsa64" 2>&1 | tail -5
    ;;
  *) echo "unknown subcommand ${1:-}"; exit 2 ;;
esac

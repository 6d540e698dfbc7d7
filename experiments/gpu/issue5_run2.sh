#!/usr/bin/env bash
# Second device call for issues 4 and 5 (carry .whl/flashinfer):
#  p16: triton (with the HAS_PARTIAL_TILES switch) next to sdpa-cudnn, triton-flashmask and flex on full,
#       causal and full_document at 16K;
#  v64: resume varblock_64k (FlashInfer's variable-block forward and Flex rows);
#  tune: autotune --block 128 for triton-sparse at density 0.5, S = 16K (the cache serves 64K), then
#  s64t: sparse_64k's triton-sparse rows again with that cache.
# Everything is tarred into $OUT/all.tgz.
source experiments/gpu/parts.sh
part p16 dense experiments/dense_16k.toml 80 --masks full,causal,full_document --backends triton,triton-flashmask,sdpa-cudnn,flex --max-minutes 1.2
mkdir -p /tmp/b/v64 && cp experiments/results/h100/sparse_64k/v64/results.jsonl /tmp/b/v64/
part v64 varblock experiments/varblock_64k.toml 170 --max-minutes 2.7
mkdir -p /tmp/o/tune
export LONGCA_TRITON_AUTOTUNE_CACHE=/tmp/o/tune/autotune_cache.json
timeout 150 python3 -m longca_triton.cli autotune --block 128 --kernel triton-sparse --densities 0.5 --seqlens 16384 \
  --out /tmp/o/tune/summary.json 2>&1 | tee /tmp/o/tune/autotune.txt | tail -25
part s64t sparse experiments/sparse_64k.toml 100 --backends triton-sparse --max-minutes 1.5
tar czf "$FINAL/all.tgz" -C /tmp/o . && ls -la "$FINAL"

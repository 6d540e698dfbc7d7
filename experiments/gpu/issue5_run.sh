#!/usr/bin/env bash
# One device call: issue 5's sparse acceptance cases (sparse_64k, varblock_64k), our dense kernel's
# full mask at 64K (the denominator of the sparse targets), and a retry of dense_16k's flex-fa4
# points. Every part goes through bench_check.sh; all outputs are tarred into $OUT/all.tgz (only a
# few files may come back from a call). Carry the vendor wheels (vsa, flashinfer, fa4 staged first).
source experiments/gpu/parts.sh
part s64 sparse experiments/sparse_64k.toml 240 --max-minutes 3.9
part v64 varblock experiments/varblock_64k.toml 100 --max-minutes 1.5
part d64 dense experiments/dense_16k.toml 50 --masks full --seqlens 64K --backends triton --max-minutes 0.7
mkdir -p /tmp/b/d16 && cp experiments/results/h100/dense_16k/results.jsonl /tmp/b/d16/
part d16 dense experiments/dense_16k.toml 120 --backends flex-fa4 --retry-errors --max-minutes 1.9
tar czf "$FINAL/all.tgz" -C /tmp/o . && ls -la "$FINAL"

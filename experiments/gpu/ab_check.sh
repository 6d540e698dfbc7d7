#!/usr/bin/env bash
# A/B check of two trees on one GPU: the tree in .before/ (the base) and the working tree (the change)
# run the same benchmark configs interleaved (before, after, before, after) on the same GPU in one
# device call, so no comparison crosses machines; then the change's dense correctness check.
# Use it when a change must leave every kernel's time alone (within the rounds' noise).
#
# Here (once):  mkdir .before && git archive <REV> | tar -x -C .before --exclude=experiments/results
#               (.before/ is ignored through .git/info/exclude; pass it with the run tool's carry)
# On the device:
#   ROUNDS="1" PHASES="dense sparse accept" bash experiments/gpu/ab_check.sh
#   ROUNDS="2" PHASES="dense sparse" bash experiments/gpu/ab_check.sh   (a second call: noise)
# PHASES: dense (dense_16k.toml: full, causal, causal_document), sparse (sparse_64k.toml), varblock
# (varblock_64k.toml), accept (the change's tree only: experiments/gpu/dense_check.py's correctness phase).
# Each call prints and returns $OUT/compare.md (before vs after per point, over every round run so far:
# experiments/gpu/compare_runs.py) and $OUT/run_r<rounds>.tgz (rows and logs).
set -o pipefail
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
export PYTHONUNBUFFERED=1
REPO=$(pwd)
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,temperature.gpu --format=csv > "$OUT/nvidia_smi.txt" 2>&1
if [ ! -d /tmp/before/longca_triton ]; then
  # the earlier tree maps kernels/ and reference/ into the package: a plain (non-editable) install copies them
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/before "$REPO/.before" \
    > /tmp/pip_before.txt 2>&1 || { echo "installing the before tree failed"; cat /tmp/pip_before.txt; exit 1; }
fi
echo "setup: $(( $(date +%s) - T0 )) s"

bench() {  # bench LABEL ROUND KIND ARGS...: one tree's run; results in $OUT/<label>_<kind>_r<round>.jsonl
  local label=$1 round=$2 kind=$3; shift 3
  local tree pp
  if [ "$label" = before ]; then tree="$REPO/.before"; pp=/tmp/before; else tree="$REPO"; pp="$REPO"; fi
  local out="/tmp/r/${label}_${kind}_r${round}"
  rm -rf "$out"
  # run from /tmp so that the checkout in the working directory is not what python -m imports
  (cd /tmp && PYTHONPATH="$pp" LONGCA_TRITON_AUTOTUNE_CACHE=/tmp/no-autotune-cache.json \
     timeout 300 python3 -m longca_triton.cli bench "$kind" --config "$tree/$1" --out "$out" --no-plots "${@:2}") \
     > "/tmp/r/log_${label}_${kind}_r${round}.txt" 2>&1
  echo "$label $kind round $round: rc=$? at $(( $(date +%s) - T0 )) s"
  grep -E "^\[[0-9]+\]" "/tmp/r/log_${label}_${kind}_r${round}.txt"
  mkdir -p /tmp/r/res && cp "$out/results.jsonl" "/tmp/r/res/${label}_${kind}_r${round}.jsonl" 2>/dev/null
}

mkdir -p /tmp/r
for round in ${ROUNDS:-1}; do
  for phase in ${PHASES:-dense sparse accept}; do
    case $phase in
      dense)
        for label in before after; do
          bench $label "$round" dense experiments/dense_16k.toml --masks full,causal,causal_document \
            --backends triton,flashmask-triton
        done ;;
      sparse)
        for label in before after; do
          bench $label "$round" sparse experiments/sparse_64k.toml --backends triton-sparse
        done ;;
      varblock)
        for label in before after; do
          bench $label "$round" varblock experiments/varblock_64k.toml --backends triton-varblock
        done ;;
      accept)
        # the after tree only: correctness of every static mask against a float32 reference
        mkdir -p /tmp/r/accept
        (PYTHONPATH="$REPO" timeout 330 python3 experiments/gpu/dense_check.py --out /tmp/r/accept \
           --skip sweep,masks,flex --budget 300) > "$OUT/accept_log.txt" 2>&1
        echo "correctness rc=$? at $(( $(date +%s) - T0 )) s"
        cp /tmp/r/accept/dense_check.md "$OUT/" 2>/dev/null
        tail -n 40 /tmp/r/accept/dense_check.md ;;
    esac
  done
done
# at most 8 files come back: results and logs travel as one archive
python3 "$REPO/experiments/gpu/compare_runs.py" /tmp/r/res/*.jsonl | tee "$OUT/compare.md"
tar czf "$OUT/run_r$(echo ${ROUNDS:-1} | tr " " -).tgz" -C /tmp/r res $(cd /tmp/r && ls log_*.txt) $(cd /tmp/r && ls -d accept 2>/dev/null)
echo "done: $(( $(date +%s) - T0 )) s"

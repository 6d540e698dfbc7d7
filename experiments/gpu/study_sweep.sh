#!/usr/bin/env bash
# Issue 14's full-breadth study on one H100, one slice per device call (<= 9 minutes), resuming.
#
#   STUDY=dense|sparse|varblock [MINUTES=6.5] LONGCA_GIT_COMMIT=<commit> \
#     bash experiments/gpu/study_sweep.sh [bench overrides: --masks ... --seqlens ... --heads ... --head-dim ...]
#
# The study's results live in experiments/results/h100/study/<STUDY>/results.jsonl. This script copies
# that file (it travels with the working tree, committed or not) to the bench's output folder, so the
# sweep resumes where the last call stopped (finished points are skipped), runs
# experiments/gpu/bench_check.sh (carried vendor wheels, doctor, bench with --max-minutes, report) and
# leaves results.jsonl, report.md, the log and the plots in $OUT. After each call copy
# $OUT/results.jsonl over experiments/results/h100/study/<STUDY>/results.jsonl and call again; commit
# the folder when a study is complete, then `longca-triton findings --out docs/findings.md`.
# Carry the wheels as in bench_check.sh (.whl/cudnn, .whl/fa3fwd, .whl/fa4 for dense; .whl/vsa,
# .whl/flashinfer for sparse and varblock). The sweep goes S outermost, so a call that stops at its
# budget has covered every mask at the lengths before it. Without overrides a call takes the next
# points of the whole config; overrides (e.g. --seqlens 1K,2K,4K --heads 64:8) cut a slice.
#
# Plan (python3 experiments/gpu/study_plan.py, from the committed runs' timestamps: a point's wall
# time fitted as 0.33 s + 2.67 x its timed work; calls' times from the backends' measured TFLOP/s;
# +-40%, compile and reference-check growth with S not modelled):
#   dense.toml    12,576 points (12 masks x 9 S x 2 heads x 2 head dims x 2 modes x 17 backends, the
#                 (S, backend) pairs above [backend_max_seqlen] left out): ~405 min of bench time,
#                 most of it at 16K-128K (42 + 61 + 73 + 39 + 127 min) -> ~58 calls
#   sparse.toml      504 points: ~81 min (128K: 53 min) -> ~12 calls
#   varblock.toml    240 points: ~27 min -> ~4 calls
#   all: ~513 min of bench time, ~74 calls of 7 min + 90 s setup = ~624 device-minutes, ~25 sessions
#   of 30 device-minutes. Cheapest cuts, if that is too much: --no-check above 16K (the float32
#   reference), the MHA or head-dim-64 half for 64K-128K, or rep = 10 as sparse.toml has.
set -o pipefail
STUDY=${STUDY:-dense}
MINUTES=${MINUTES:-6.5}
case "$STUDY" in
  dense) KIND=dense ;;
  sparse) KIND=sparse ;;
  varblock) KIND=varblock ;;
  *) echo "error: STUDY must be dense, sparse or varblock, got '$STUDY'" >&2; exit 2 ;;
esac
CFG=experiments/$STUDY.toml
RES=experiments/results/h100/study/$STUDY/results.jsonl
WORK=/tmp/study/$STUDY
mkdir -p "$WORK"
if [ -f "$RES" ]; then
  cp "$RES" "$WORK/results.jsonl" && echo "resuming from $(wc -l < "$RES") rows of $RES"
else
  echo "starting $STUDY from scratch (no $RES)"
fi
TIMEOUT=$(awk -v m="$MINUTES" 'BEGIN { printf "%d", m * 60 + 60 }')
BENCH_OUT=$WORK BENCH_KIND=$KIND BENCH_TIMEOUT=$TIMEOUT \
  bash experiments/gpu/bench_check.sh "$CFG" --max-minutes "$MINUTES" "$@"
rc=$?
python3 - "$WORK/results.jsonl" <<'EOF'
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().endswith("}")]
kinds = collections.Counter(r.get("status", "?").split(":")[0] for r in rows)
print(f"{sys.argv[1]}: {len(rows)} rows ({dict(kinds)}); lengths done: {sorted({r['seqlen'] for r in rows})}")
EOF
exit $rc

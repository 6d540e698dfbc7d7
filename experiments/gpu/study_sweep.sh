#!/usr/bin/env bash
# Issue 14's full-breadth study on one H100, one slice per device call (<= 9 minutes), resuming.
#
#   STUDY=dense|sparse|varblock [MINUTES=6] LONGCA_GIT_COMMIT=<commit> \
#     bash experiments/gpu/study_sweep.sh [bench overrides: --masks ... --seqlens ... --heads ... --head-dim ...]
#
# The study's results live in experiments/results/h100/study/<STUDY>/results.jsonl.gz (gzipped:
# ~1.5 KB a row uncompressed, 18x smaller so, and the working tree that travels is limited to 64 MiB
# with the carried wheels). This script has experiments/gpu/bench_check.sh gunzip that file (it
# travels with the working tree, committed or not) into $OUT/results.jsonl and run the bench with
# --out $OUT, so the sweep resumes where the last call stopped (finished points are skipped; rows
# that only said a backend was not installed are retried when it is installed now) and every point
# is in $OUT/results.jsonl as soon as it finishes: a call killed at any moment still returns what it
# measured. At the end it writes $OUT/results.jsonl.gz (gzip -9 -n of $OUT/results.jsonl). $OUT
# ends with results.jsonl, results.jsonl.gz, report.md, bench_log.txt, env.txt (nvidia-smi,
# command, doctor), commands.txt, experiment.json, plots.tgz (8 files, no folders: the run tool's
# limit). After each call copy $OUT/results.jsonl.gz over
# experiments/results/h100/study/<STUDY>/results.jsonl.gz (and bench_log.txt, report.md next to it;
# never a plain results.jsonl into that folder: where both are there, readers take the plain one
# and warn) and call again; commit the folder after each call, then
# `longca-triton findings --out docs/findings.md`. A call killed before its end has no .gz: then
# `gzip -9 -n -c results.jsonl > .../results.jsonl.gz` from the returned results.jsonl. The run
# tool returns files of at most 16 MiB: once results.jsonl passes that (~11,000 rows) only the .gz
# comes back, so from then on a call must end on its own (MINUTES) for its rows to come back.
# A study folder with a plain results.jsonl (none yet) is resumed from that instead.
# Carry the wheels as in bench_check.sh (.whl/cudnn, .whl/fa3fwd, .whl/fa4 for dense; .whl/vsa,
# .whl/flashinfer for sparse and varblock): without them those backends' rows say `not installed`
# (the 1K-4K slice of 2026-11-23 ran so; a later call with the wheels retries exactly those points).
# The sweep goes S outermost, so a call that stops at its budget has covered every mask at the
# lengths before it. Without overrides a call takes the next points of the whole config; overrides
# (e.g. --seqlens 1K,2K,4K --heads 64:8) cut a slice.
# Time: the bench stops itself after MINUTES (between points; a point takes up to ~20 s at 48K+)
# and gets SIGTERM at MINUTES + 1 min; report and plots then take ~1 min, setup ~1.5 min before.
# Run it with the run tool's timeout_s = 600 (MINUTES=6: 90 s setup + <= 420 s bench + ~60 s report
# and plots) and do NOT wrap it in a shorter outer `timeout`: the 2026-11-23 call was wrapped in
# `timeout 450`, which killed the copy step at the end (results.jsonl now sits in $OUT from the
# start, so only report.md and plots.tgz would be lost).
#
# Plan (python3 experiments/gpu/study_plan.py, refit after session 6's two slices with the wheels:
# a point that runs costs 0.25 s + 2.22 x its timed work, a refused one 4 ms; calls' times from the
# backends' measured TFLOP/s at the nearest length; +-40 %, compile and reference-check growth with
# S not modelled). Done: 1K, 2K with every installed vendor kernel, 4K half. Left, roughly:
#   dense.toml    12,576 points (12 masks x 9 S x 2 heads x 2 head dims x 2 modes x 17 backends, the
#                 (S, backend) pairs above [backend_max_seqlen] left out): ~319 min of bench time,
#                 most of it at 16K-128K (35 + 45 + 60 + 30 + 108 min) -> ~54 calls
#   sparse.toml      504 points: ~75 min (128K: 50 min) -> ~13 calls
#   varblock.toml    240 points: ~21 min -> ~4 calls
#   all: ~415 min of bench time, ~70 calls of 6 min + 150 s (setup, start-up, report, plots) = ~590
#   device-minutes, ~24 sessions of 30 device-minutes. Cheapest cuts, if that is too much: --no-check
#   above 16K (the float32 reference), the MHA or head-dim-64 half for 64K-128K, or rep = 10 as
#   sparse.toml has.
set -o pipefail
STUDY=${STUDY:-dense}
MINUTES=${MINUTES:-6}
case "$STUDY" in
  dense) KIND=dense ;;
  sparse) KIND=sparse ;;
  varblock) KIND=varblock ;;
  *) echo "error: STUDY must be dense, sparse or varblock, got '$STUDY'" >&2; exit 2 ;;
esac
CFG=experiments/$STUDY.toml
RES=experiments/results/h100/study/$STUDY/results.jsonl.gz
if [ -f "${RES%.gz}" ]; then
  [ -f "$RES" ] && echo "warning: both ${RES%.gz} and $RES: resuming from the plain one (readers take it too)" >&2
  RES=${RES%.gz}
fi
# a warm machine keeps the last call's rows in /tmp (files outside the repo survive while calls follow
# within 30 s): resume from them when they hold more rows than the committed file, so consecutive
# calls chain without copying results back in between (STUDY_LAST: another path for that file)
LAST=${STUDY_LAST:-/tmp/study_$STUDY.last.jsonl.gz}
if [ -f "$LAST" ] && [ "$(gzip -dc "$LAST" | wc -l)" -gt "$(case "$RES" in *.gz) gzip -dc "$RES" ;; *) cat "$RES" ;; esac | wc -l)" ]; then
  echo "resuming from this machine's last call ($LAST) rather than $RES"
  RES=$LAST
fi
TIMEOUT=$(awk -v m="$MINUTES" 'BEGIN { printf "%d", m * 60 + 60 }')
BENCH_OUT=$OUT BENCH_RESUME=$RES BENCH_KIND=$KIND BENCH_TIMEOUT=$TIMEOUT \
  bash experiments/gpu/bench_check.sh "$CFG" --max-minutes "$MINUTES" "$@"
rc=$?
[ -f "$OUT/results.jsonl" ] && gzip -9 -n -c "$OUT/results.jsonl" > "$OUT/results.jsonl.gz.part" \
  && mv "$OUT/results.jsonl.gz.part" "$OUT/results.jsonl.gz" && ls -l "$OUT/results.jsonl.gz" \
  && cp "$OUT/results.jsonl.gz" "$LAST"
python3 - "$OUT/results.jsonl" <<'EOF'
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().endswith("}")]
kinds = collections.Counter(r.get("status", "?").split(":")[0] for r in rows)
print(f"{sys.argv[1]}: {len(rows)} rows ({dict(kinds)}); lengths done: {sorted({r['seqlen'] for r in rows})}")
EOF
exit $rc

#!/usr/bin/env bash
# The full-breadth study (experiments/dense.toml, sparse.toml or varblock.toml) on one GPU, one slice
# per device call (<= 9 minutes), each call resuming where the last one stopped.
#
#   STUDY=dense|sparse|varblock [GPU=h100] [MINUTES=6] LONGCA_GIT_COMMIT=<commit> \
#     bash experiments/gpu/study_sweep.sh [bench overrides: --masks ... --seqlens ... --heads ... --head-dim ...]
#
# The study's rows live in experiments/results/<GPU>/<STUDY>-study/results.jsonl.gz (gzipped: ~1.5 KB a
# row uncompressed, 18x smaller so; the working tree that travels is limited to 64 MiB with the carried
# wheels). experiments/gpu/bench.sh gunzips that file into $OUT/results.jsonl and runs the bench with
# --out $OUT: finished points are skipped, rows that only said a backend was not installed are retried
# where it is installed now, and every point is in $OUT/results.jsonl as soon as it finishes (a call
# killed at any moment still returns what it measured). At the end it writes $OUT/results.jsonl.gz.
# After each call copy $OUT/results.jsonl.gz (and bench_log.txt, report.md) over the study folder's,
# never a plain results.jsonl into it (where both exist, readers take the plain one and warn), commit
# the folder, then `longca-triton findings --out docs/findings.md`. A call killed before its end has
# no .gz: `gzip -9 -n -c results.jsonl > .../results.jsonl.gz` from the returned results.jsonl. The run
# tool returns files of at most 16 MiB: past that (~11,000 rows) only the .gz comes back, so a call
# must then end on its own (MINUTES) for its rows to come back.
# Carry the wheels as bench.sh says (.whl/cudnn, .whl/fa3fwd, .whl/fa4 for dense; .whl/vsa,
# .whl/flashinfer for sparse and varblock): without them those backends' rows say `not installed`.
# The sweep goes S outermost, so a call that stops at its budget has covered every mask at the
# lengths before it. Overrides (e.g. --seqlens 1K,2K,4K --heads 64:8) cut a slice.
# Time: the bench stops itself after MINUTES (between points; a point takes up to ~20 s at 48K+) and
# gets SIGTERM at MINUTES + 1 min; report and plots take ~1 min, setup ~1.5 min. Run it with the run
# tool's timeout_s = 600 (MINUTES=6) and do not wrap it in a shorter outer `timeout` (that kills the
# copy step at the end). How many calls a study takes: python3 experiments/gpu/study_plan.py.
set -o pipefail
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
STUDY=${STUDY:-dense}
MINUTES=${MINUTES:-6}
case "$STUDY" in
  dense) KIND=dense ;;
  sparse) KIND=sparse ;;
  varblock) KIND=varblock ;;
  *) echo "error: STUDY must be dense, sparse or varblock, got '$STUDY'" >&2; exit 2 ;;
esac
CFG=experiments/$STUDY.toml
RES=experiments/results/${GPU:-h100}/$STUDY-study/results.jsonl.gz
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
  bash experiments/gpu/bench.sh "$CFG" --max-minutes "$MINUTES" "$@"
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

#!/usr/bin/env bash
# Run a benchmark config on the GPU host in one device call: install the carried vendor wheels, then
# `longca-triton bench` writing straight into $OUT, so that every finished point is in $OUT/results.jsonl the moment
# it finishes (appended and fsynced row by row): a call killed at any moment still returns them.
#
# Here (once):  cd <repo> && env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null ../shared/scripts/vendor-wheels.sh cudnn
#               (and fa3fwd, fa4, ...) -> .whl/<group>/<n>/ (ignored; pass them with the run tool's `carry`;
#               a group over 64 MiB goes in two calls: the first only `bash experiments/gpu/wheels.sh stage`)
# On the device: [BENCH_KIND=dense|sparse|varblock] [BENCH_RESUME=path/results.jsonl[.gz]] \
#                  bash experiments/gpu/bench.sh [CONFIG] [EXTRA bench args...]
#   e.g. bash experiments/gpu/bench.sh experiments/dense_quick.toml --max-minutes 5
#        bash experiments/gpu/bench.sh experiments/dense_quick.toml --backends flex --retry-errors
# BENCH_RESUME: an earlier run's results.jsonl, or a gzipped results.jsonl.gz (in the working tree,
# committed or not), copied (gunzipped) to $OUT/results.jsonl first, so finished points are skipped
# (and rows that only said a backend was not installed are retried where it is installed now); if
# it cannot be read whole the call stops there (its $OUT/results.jsonl would lack rows and must not
# be copied back over the committed one). Set LONGCA_GIT_COMMIT to the commit the tree came from
# (no .git travels).
#
# $OUT holds at most 7 files, no folders (the run tool returns 8 files of <= 16 MiB, 2 folder
# levels; study_sweep.sh adds the 8th, results.jsonl.gz):
#   results.jsonl  every row, the resumed ones first      bench_log.txt  the bench's per-point log
#   report.md      markdown report of results.jsonl       env.txt        nvidia-smi, command, doctor
#   commands.txt, experiment.json  written by the bench   plots.tgz      the plots (tarred)
# Timing: the bench stops itself at --max-minutes (between points) and is sent SIGTERM at
# BENCH_TIMEOUT seconds (default 480; it stops cleanly at the next point); report and plots take
# <= 2 min more. Give the run tool's timeout_s >= setup (~90 s) + BENCH_TIMEOUT + 120 and do NOT
# wrap this script in a shorter outer `timeout`: that kills the report and plot steps (the rows
# in $OUT/results.jsonl survive, but report.md and plots.tgz are then missing or stale).
set -o pipefail
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
export PYTHONUNBUFFERED=1
CONFIG=${1:-experiments/dense_quick.toml}; shift || true
OUTDIR=${BENCH_OUT:-$OUT}  # BENCH_OUT elsewhere: copied to $OUT only at the end (a caller that collects several runs)
T0=$(date +%s)
mkdir -p "$OUTDIR"
if [ -n "${BENCH_RESUME:-}" ]; then
  if [ -f "$BENCH_RESUME" ]; then
    case "$BENCH_RESUME" in
      *.gz) gzip -dc "$BENCH_RESUME" > "$OUTDIR/results.jsonl" ;;
      *) cp "$BENCH_RESUME" "$OUTDIR/results.jsonl" ;;
    esac || { echo "error: could not read $BENCH_RESUME whole; stopping" >&2; rm -f "$OUTDIR/results.jsonl"; exit 1; }
    echo "resuming from $(wc -l < "$OUTDIR/results.jsonl") rows of $BENCH_RESUME"
  else
    echo "starting from scratch (no $BENCH_RESUME)"
  fi
fi
ENV_TXT=$OUT/env.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$ENV_TXT" 2>&1
# carried wheels (plus any staged by earlier calls: experiments/gpu/wheels.sh stage) into /tmp/site
bash experiments/gpu/wheels.sh stage && bash experiments/gpu/wheels.sh install
source experiments/gpu/wheels.sh env
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1 || { echo "pip install -e . failed"; cat /tmp/pip.txt; }
echo "setup: $(( $(date +%s) - T0 )) s"
CMD=(python3 -m longca_triton.cli bench "${BENCH_KIND:-dense}" --config "$CONFIG" --out "$OUTDIR" --no-plots "$@")
{ echo "command: ${CMD[*]}"; echo "--- doctor"; timeout 60 python3 -m longca_triton.cli doctor 2>&1; } >> "$ENV_TXT"
timeout -s TERM "${BENCH_TIMEOUT:-480}" "${CMD[@]}" 2>&1 | tee "$OUT/bench_log.txt"
echo "bench rc=$? at $(( $(date +%s) - T0 )) s"
python3 -m longca_triton.cli report "$OUTDIR/results.jsonl" --out "$OUTDIR/report.md"
PLOTS=$(mktemp -d)
timeout 90 python3 -m longca_triton.cli plot "$OUTDIR/results.jsonl" --out "$PLOTS/plots" > /dev/null \
  && tar czf "$OUT/plots.tgz" -C "$PLOTS" plots
# BENCH_OUT elsewhere (a caller that collects several runs): the results and report still come back, at the end only
[ "$OUTDIR" -ef "$OUT" ] || cp "$OUTDIR/results.jsonl" "$OUTDIR/report.md" "$OUT/"
echo "done: $(( $(date +%s) - T0 )) s"; ls -la "$OUT"

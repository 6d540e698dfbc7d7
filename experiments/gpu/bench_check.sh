#!/usr/bin/env bash
# One device call that installs the carried vendor wheels and runs a dense benchmark config,
# leaving results, report, plots and logs in $OUT (at most 8 files come back: plots are tarred).
#
# Here (once):  cd <repo> && env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null ../shared/scripts/vendor-wheels.sh cudnn
#               (and fa3fwd, fa4, ...) -> .whl/<group>/<n>/ (ignored; pass them with the run tool's `carry`;
#               a group over 64 MiB goes in two calls: the first only `bash experiments/gpu/wheels.sh stage`)
# On the device: [BENCH_KIND=dense|sparse|varblock] bash experiments/gpu/bench_check.sh [CONFIG] [EXTRA bench args...]
#   e.g. bash experiments/gpu/bench_check.sh experiments/dense_quick.toml --max-minutes 5
#        bash experiments/gpu/bench_check.sh experiments/dense_quick.toml --backends flex --retry-errors
# To resume an earlier run, copy its results.jsonl to /tmp/bench/results.jsonl first (finished
# points are skipped). Set LONGCA_GIT_COMMIT to the commit the tree came from (no .git travels).
set -o pipefail
export PYTHONUNBUFFERED=1
CONFIG=${1:-experiments/dense_quick.toml}; shift || true
OUTDIR=${BENCH_OUT:-/tmp/bench}
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia_smi.txt" 2>&1
# carried wheels (plus any staged by earlier calls: experiments/gpu/wheels.sh stage) into /tmp/site
bash experiments/gpu/wheels.sh stage && bash experiments/gpu/wheels.sh install
source experiments/gpu/wheels.sh env
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1 || { echo "pip install -e . failed"; cat /tmp/pip.txt; }
echo "setup: $(( $(date +%s) - T0 )) s"
timeout 60 python3 -m longca_triton.cli doctor > "$OUT/doctor.txt" 2>&1
CMD=(python3 -m longca_triton.cli bench "${BENCH_KIND:-dense}" --config "$CONFIG" --out "$OUTDIR" --no-plots "$@")
echo "${CMD[*]}" > "$OUT/command.txt"
timeout -s TERM "${BENCH_TIMEOUT:-480}" "${CMD[@]}" 2>&1 | tee "$OUT/bench_log.txt"
echo "bench rc=$? at $(( $(date +%s) - T0 )) s"
python3 -m longca_triton.cli report "$OUTDIR/results.jsonl" --out "$OUTDIR/report.md"
timeout 60 python3 -m longca_triton.cli plot "$OUTDIR/results.jsonl" --out "$OUTDIR/plots" > /dev/null
cp "$OUTDIR/results.jsonl" "$OUTDIR/report.md" "$OUT/"
tar czf "$OUT/plots_meta.tgz" -C "$OUTDIR" plots commands.txt experiment.json
echo "done: $(( $(date +%s) - T0 )) s"; ls -la "$OUT"

#!/usr/bin/env bash
# Sourced by the multi-part device scripts (issue5_run*.sh): `part NAME KIND CONFIG TIMEOUT [bench args]`
# runs one bench_check.sh into /tmp/o/NAME (results in /tmp/b/NAME) and prints its summary lines;
# the caller tars /tmp/o into the real $OUT (saved here as FINAL) at the end.
set -o pipefail
export PYTHONUNBUFFERED=1
FINAL=$OUT
mkdir -p /tmp/o /tmp/b
part() {  # name kind config timeout [bench args...]
  local name=$1 kind=$2 cfg=$3 to=$4; shift 4
  mkdir -p "/tmp/o/$name"
  OUT=/tmp/o/$name BENCH_OUT=/tmp/b/$name BENCH_KIND=$kind BENCH_TIMEOUT=$to \
    bash experiments/gpu/bench_check.sh "$cfg" "$@" 2>&1 | grep -E "^\[|rc=|setup|^done" | tail -40
}

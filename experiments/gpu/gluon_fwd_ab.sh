#!/usr/bin/env bash
# The Gluon forward of another version of the kernels (BASE, a directory holding a `longca_triton`
# package) against this checkout's, default configs, 16K, GQA 64:8, alternating rounds in one call
# (one H100, ~2 minutes):
#
#   rm -rf _base && mkdir _base && git archive HEAD longca_triton | tar -x -C _base
#   echo _base/ >> .git/info/exclude      # never committed; carry it: run(carry=["_base"])
#   bash experiments/gpu/gluon_fwd_ab.sh
#
# MASKS (D = 128) and MASKS64 (D = 64) pick the static masks, ROUNDS the rounds (base then new
# each). $OUT/<base|new><round>[-d64]/fwd_configs.jsonl: every point checked against float32
# first (gluon_diag.py --fwd-configs); the last lines print TFLOP/s per (mask, D) and run.
set -u
BASE=${BASE:-_base}
MASKS=${MASKS:-causal,causal_document,full_document,sliding_window,sliding_window_causal,prefix_lm_causal,block_causal_document}
MASKS64=${MASKS64:-causal,sliding_window,causal_document}
for r in $(seq 1 "${ROUNDS:-2}"); do
  for v in base new; do
    if [ "$v" = base ]; then export LONGCA_PACKAGE_ROOT=$BASE; else unset LONGCA_PACKAGE_ROOT; fi
    python experiments/gpu/gluon_diag.py --out "$OUT/$v$r" --fwd-configs 16384 --masks "$MASKS" > /dev/null 2>&1
    python experiments/gpu/gluon_diag.py --out "$OUT/$v$r-d64" --fwd-configs 16384 --head-dims 64 \
      --masks "$MASKS64" > /dev/null 2>&1
  done
done
python3 - <<'PY'
import glob, json, os

t = {}
for f in sorted(glob.glob(os.environ["OUT"] + "/*/fwd_configs.jsonl")):
    run = f.split("/")[-2]
    for line in open(f):
        r = json.loads(line)
        t.setdefault((r["mask"], r["D"]), {})[run] = "ERR" if "error" in r else round(r["fwd_tflops"], 1)
for key, runs in t.items():
    print(key, runs)
PY

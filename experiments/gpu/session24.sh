#!/usr/bin/env bash
# Session 24's GPU calls (one subcommand per call; rows go straight into $OUT).
#   bash experiments/gpu/session24.sh pin   the Gluon forward with its P V wait pinned after the softmax (LCT_HACK=12,
#                                           a throwaway switch: separate processes, separate Triton caches) against the
#                                           default, D = 96 / 128, full / causal, 16K, alternating rounds, checked
#   bash experiments/gpu/session24.sh tree  the forward's softmax row max / row sum as trees (LCT_TREE, LCT_TREE_SUM)
#   bash experiments/gpu/session24.sh pvlate  P V issued after S_j's wait, interleaved with the softmax (LCT_PVLATE)
source experiments/gpu/session_env.sh
summary() {  # $1: folder of <variant>-r<round>-d<D>/fwd_configs.jsonl
  python3 - "$1" <<'PY'
import glob, json, sys
t = {}
for f in sorted(glob.glob(sys.argv[1] + "/*/fwd_configs.jsonl")):
    run = f.split("/")[-2]
    var, rnd, d = run.split("-")
    for line in open(f):
        r = json.loads(line)
        key = (r["mask"], r["D"], json.dumps(r["config"]))
        t.setdefault(key, []).append((var, rnd, "ERR " + r["error"][:80] if "error" in r else
                                      (round(r["fwd_tflops"], 1), round(r["err_out"], 6))))
for key, v in sorted(t.items()):
    print(key, v)
PY
}
case "${1:-}" in
  pin)
    mkdir -p "$OUT/pin"
    for r in 1 2; do for v in 0 12; do for d in ${DIMS:-96 128}; do
      LCT_HACK=$v TRITON_CACHE_DIR=/tmp/tc$v python experiments/gpu/gluon_diag.py --out "$OUT/pin/h$v-r$r-d$d" \
        --fwd-configs 16384 --head-dims $d --masks ${MASKS:-full,causal} ${CONFIGS:+--config-json "$CONFIGS"} \
        > "$OUT/pin/log-h$v-r$r-d$d.txt" 2>&1 || tail -5 "$OUT/pin/log-h$v-r$r-d$d.txt"
    done; done; done
    summary "$OUT/pin"
    tar czf "$OUT/pin.tgz" -C "$OUT" pin && rm -rf "$OUT/pin"
    ;;
  tree)
    # the softmax's row max (and row sum) as trees of halvings instead of one dependent chain a row
    # (LCT_TREE / LCT_TREE_SUM: throwaway switches, patches/row_tree.patch); variants base, max, max+sum
    mkdir -p "$OUT/tree"
    for r in 1 2; do for v in 00 10 11; do for d in ${DIMS:-96 128}; do
      LCT_TREE=${v:0:1} LCT_TREE_SUM=${v:1:1} TRITON_CACHE_DIR=/tmp/tt$v python experiments/gpu/gluon_diag.py \
        --out "$OUT/tree/t$v-r$r-d$d" --fwd-configs 16384 --head-dims $d --masks ${MASKS:-full,causal} \
        > "$OUT/tree/log-t$v-r$r-d$d.txt" 2>&1 || tail -5 "$OUT/tree/log-t$v-r$r-d$d.txt"
    done; done; done
    summary "$OUT/tree"
    tar czf "$OUT/tree.tgz" -C "$OUT" tree && rm -rf "$OUT/tree"
    ;;
  pvlate)
    # the P V GEMM issued after S_j's wait (ptxas then interleaves its HGMMAs with the softmax) instead of
    # beside Q K^T before it (LCT_PVLATE: 0 as before; 2: the token passed after Q K^T; 3: and K's slot freed at
    # S_j's wait; patches/pv_late.patch)
    mkdir -p "$OUT/pvlate"
    for r in 1 2; do for v in ${VARIANTS:-0 2 3}; do for d in ${DIMS:-96 128}; do
      LCT_PVLATE=$v TRITON_CACHE_DIR=/tmp/tp$v python experiments/gpu/gluon_diag.py \
        --out "$OUT/pvlate/v$v-r$r-d$d" --fwd-configs 16384 --head-dims $d --masks ${MASKS:-full,causal} \
        > "$OUT/pvlate/log-v$v-r$r-d$d.txt" 2>&1 || tail -5 "$OUT/pvlate/log-v$v-r$r-d$d.txt"
    done; done; done
    summary "$OUT/pvlate"
    tar czf "$OUT/pvlate.tgz" -C "$OUT" pvlate && rm -rf "$OUT/pvlate"
    ;;
  *) echo "usage: $0 pin|tree|pvlate" >&2; exit 2 ;;
esac

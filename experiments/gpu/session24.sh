#!/usr/bin/env bash
# Session 24's GPU calls (one subcommand per call; rows go straight into $OUT).
# Each is an A/B of the Gluon forward (D = 96 / 128, full / causal, 16K, two alternating rounds, every point checked
# against float32 by gluon_diag.py) over variants of a throwaway switch that only its patch under
# experiments/results/h100/session24/patches/ reads: the subcommand applies the patch, runs each variant in a process
# and Triton cache of its own (the cache key does not see an environment switch), and reverts the patch.
#   bash experiments/gpu/session24.sh pin     the P V wait pinned after the softmax (LCT_HACK 0 / 12; pv_wait_pin_hacks)
#   bash experiments/gpu/session24.sh tree    the softmax's row max / row sum as trees of halvings (LCT_TREE,
#                                             LCT_TREE_SUM: base, max, max + sum; row_tree)
#   bash experiments/gpu/session24.sh pvlate  P V issued after S_j's wait, interleaved with the softmax by ptxas
#                                             (LCT_PVLATE 0 / 2: token passed after Q K^T / 3: and K freed; pv_late)
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
ab() {  # $1: name (folder, tarball), $2: patch name, then one variant per argument: "VAR=x [VAR2=y]"
  local name=$1 patch=experiments/results/h100/session24/patches/$2.patch
  shift 2
  git apply "$patch" || return 1
  mkdir -p "$OUT/$name"
  for r in 1 2; do for v in "$@"; do for d in ${DIMS:-96 128}; do
    local tag
    tag=v$(echo "$v" | tr -cd '0-9')
    # shellcheck disable=SC2086  # $v is one or more VAR=value words
    env $v TRITON_CACHE_DIR=/tmp/tc-$name-$tag python experiments/gpu/gluon_diag.py --out "$OUT/$name/$tag-r$r-d$d" \
      --fwd-configs 16384 --head-dims "$d" --masks "${MASKS:-full,causal}" \
      > "$OUT/$name/log-$tag-r$r-d$d.txt" 2>&1 || tail -5 "$OUT/$name/log-$tag-r$r-d$d.txt"
  done; done; done
  git apply -R "$patch"
  summary "$OUT/$name"
  tar czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "${OUT:?}/$name"
}
case "${1:-}" in
  pin) ab pin pv_wait_pin_hacks LCT_HACK=0 LCT_HACK=12 ;;
  tree) ab tree row_tree "LCT_TREE=0 LCT_TREE_SUM=0" "LCT_TREE=1 LCT_TREE_SUM=0" "LCT_TREE=1 LCT_TREE_SUM=1" ;;
  pvlate) ab pvlate pv_late LCT_PVLATE=0 LCT_PVLATE=2 LCT_PVLATE=3 ;;
  *) echo "usage: $0 pin|tree|pvlate" >&2; exit 2 ;;
esac

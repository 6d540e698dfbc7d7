# The preamble of the session scripts (`source experiments/gpu/session_env.sh` from the repository root on the
# device): environment, what the machine is, `tests FILE KEXPR LOG SECONDS`, a `-m gpu` pytest run whose
# PASSED / FAILED lines go to $OUT/LOG, `harness` / `sparse128` / `varblock256` (backward sweeps through the harness),
# `accept_block_sparse` (issue 13's block-sparse runs) and `varblock_ratio` (its variable-block ratio alone), `timer_ab` / `summary` (timer_bias.py's A/B of configs under every
# timer, and its TFLOP/s per timer and config).
set -u
export PYTHONPATH=.:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
tests() {  # $1: file, $2: -k expression, $3: log name, $4: seconds
  timeout "$4" python -m pytest -q -m gpu "$1" -rA -k "$2" 2>&1 \
    | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" > "$OUT/$3"
  tail -3 "$OUT/$3"
}
harness() {  # $1: seconds, then `bench` arguments: one backward sweep through the harness at 32K and 64K
  local seconds=$1
  shift
  timeout "$seconds" python -m longca_triton.cli bench "$@" --no-plots --seqlens 32K,64K --mode bwd
}
sparse128() {  # $1: seconds, $2: folder under $OUT, $3: patterns (Hkv, or Hkv,1), $4: backends: uniform block 128,
  # densities 0.3 / 0.5
  harness "$1" sparse --config experiments/sparse_64k.toml --param block=128 --param density=0.3,0.5 \
    --param patterns="$3" --backends "$4" --out "$OUT/$2"
}
varblock256() {  # $1: seconds, $2: folder under $OUT, $3: backends, then more `bench` arguments: variable blocks of
  # mean 256 (a pattern per KV head), densities 0.3 / 0.5
  local seconds=$1 dir=$2 backends=$3
  shift 3
  harness "$seconds" varblock --config experiments/varblock.toml --param block=256 --param density=0.3,0.5 \
    --backends "$backends" --out "$OUT/$dir" "$@"
}
accept_block_sparse() {  # issue 13's block-sparse targets into $OUT/sparse and $OUT/var: block 128 (a pattern per KV
  # head and one for all) against Flex, then variable blocks to compare with uniform block 128's rows
  sparse128 600 sparse Hkv,1 triton-sparse,flex 2>&1 | tail -12
  varblock256 600 var triton-varblock 2>&1 | tail -8
}
varblock_ratio() {  # issue 13's variable-block ratio into $OUT/uni and $OUT/var: uniform block 128 and variable
  # blocks, a pattern per KV head, our kernels only
  sparse128 600 uni Hkv triton-sparse 2>&1 | tail -6
  varblock256 600 var triton-varblock 2>&1 | tail -6
}
timer_ab() {  # $1: folder under $OUT, $2: case (name:S:density), $3: repetitions, $4: seconds, $5: configs (JSON)
  timeout "$4" python experiments/gpu/timer_bias.py --out "$OUT/$1" --sparse "$2" --rep "$3" --configs "$5" \
    > "$OUT/$1.log" 2>&1
}
summary() {  # TFLOP/s per (timer, config) of each timer_bias.py output folder under $OUT named in "$@"
  for f in "$@"; do python3 -c "
import json, collections
d = collections.defaultdict(list)
for l in open('$OUT/$f/timer_bias.jsonl'):
    r = json.loads(l); d[(r['timer'], r['variant'])].append(r['tflops'])
for (t, v), x in sorted(d.items()): print('$f', t, v, ' '.join(f'{y:.1f}' for y in x))"; done
}
config_names() {  # $1: launch configs (JSON, name -> config): the variable-block default's backend name, then each
  # config's (adapters.base.config_name), one a line
  python3 -c "import json, sys
from longca_triton.adapters.base import config_name
print('triton-varblock')
for c in json.loads(sys.argv[1]).values(): print(config_name('triton-varblock', c))" "$1"
}
ratios_of() {  # $1: a tarball of uni/ and var/, then backend names: each one's variable-vs-uniform-128 rows
  local tgz=$1
  shift
  for b in "$@"; do
    python experiments/gpu/issue13_targets.py "$tgz" --varblock "$b" | grep "variable vs" | sed "s|^|$b |"
  done
}
config_ratios() {  # $1: launch configs (JSON, name -> config), $2: tarball under $OUT: uniform block 128, then
  # variable blocks with the default and each config as a backend named with it, each checked against float32 and
  # timed back to back (--sequential: the harness's time_fn); prints each backend's variable-vs-uniform rows
  local names
  mapfile -t names < <(config_names "$1")
  sparse128 150 uni Hkv triton-sparse 2>&1 | tail -6
  # --check: every config against the float32 reference before its timing (varblock.toml skips the check)
  varblock256 420 var "$(IFS=,; echo "${names[*]}")" --sequential --check 2>&1 | tail -8
  tar czf "$OUT/$2" -C "$OUT" uni var && rm -rf "$OUT/uni" "$OUT/var"
  ratios_of "$OUT/$2" "${names[@]}"
}

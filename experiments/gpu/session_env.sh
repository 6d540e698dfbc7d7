# The preamble of the session scripts (`source experiments/gpu/session_env.sh` from the repository root on the
# device): environment, what the machine is, and `tests FILE KEXPR LOG SECONDS`, a `-m gpu` pytest run whose
# PASSED / FAILED lines go to $OUT/LOG.
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

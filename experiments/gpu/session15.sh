#!/usr/bin/env bash
# Session 15's GPU calls (one subcommand per call; rows go straight into $OUT).
#   bash experiments/gpu/session15.sh window   the Gluon forward's fixed cost per query tile: sliding_window_causal
#                                              at 16K with the window swept 256..8192 (triton-gluon, triton, flex),
#                                              then the dense 16K backward through the interleaved harness
set -u
export PYTHONPATH=.:${PYTHONPATH:-}
bench() { python -m longca_triton.cli bench dense --no-plots "$@"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv
python -c "import pynvml; print('pynvml', pynvml.__file__)" 2>&1 | tail -1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
case "${1:-}" in
  window)
    bench --config experiments/dense_16k.toml --masks sliding_window_causal --param window=256,512,1024,2048,4096,8192 \
      --backends triton-gluon,triton,flex --mode fwd --out "$OUT/window" 2>&1 | tail -30
    bench --config experiments/dense_16k.toml --masks full --backends triton-gluon,triton,flex --mode fwd --out "$OUT/window" 2>&1 | tail -8
    bench --config experiments/dense_16k.toml --backends triton,triton-gluon,sdpa-cudnn,flex --mode bwd --out "$OUT/bwd16" 2>&1 | tail -30
    ;;
  *) echo "usage: session15.sh window" >&2; exit 2 ;;
esac

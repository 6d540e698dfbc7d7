#!/usr/bin/env bash
# Session 15's GPU calls (one subcommand per call; rows go straight into $OUT).
#   bash experiments/gpu/session15.sh window   the Gluon forward's fixed cost per query tile: sliding_window_causal
#                                              at 16K with the window swept 256..8192 (triton-gluon, triton, flex),
#                                              then the dense 16K backward through the interleaved harness
#   bash experiments/gpu/session15.sh persist  the persistent Gluon forward: its GPU tests (and the whole Gluon
#                                              GPU file: the one-tile-a-CTA path changed too), then every static
#                                              mask at 16K, default vs persistent (O in Q's buffers / its own)
#   bash experiments/gpu/session15.sh ab       the default (one tile a CTA) forward against _base's (carry _base)
#   bash experiments/gpu/session15.sh tests    the Gluon GPU tests but the fused and split backward designs' (their
#                                              kernels did not change), then `ab` for full and causal, one round
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
  persist)
    python -m pytest -q -m gpu tests/test_gluon_gpu.py -k persistent -x 2>&1 | tail -15 | tee "$OUT/gpu_tests_persistent.txt"
    PYTHONUNBUFFERED=1 python experiments/gpu/gluon_diag.py --out "$OUT/persist" --fwd-configs 16384 --masks all \
      --config-json '[{"persistent": true}, {"persistent": true, "o_own": true, "num_stages": 2}]' 2>&1 | tail -40
    python -m pytest -q -m gpu tests/test_gluon_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests_all.txt"
    ;;
  ab)
    ROUNDS=2 MASKS=full,causal,sliding_window_causal,causal_document MASKS64=causal bash experiments/gpu/gluon_fwd_ab.sh
    ;;
  tests)
    timeout 450 python -m pytest -q -m gpu tests/test_gluon_gpu.py -k "not fused and not -split" 2>&1 | tail -25 \
      | tee "$OUT/gpu_tests.txt"
    ROUNDS=1 MASKS=full,causal MASKS64=causal bash experiments/gpu/gluon_fwd_ab.sh
    ;;
  target)
    # issue 12's forward targets next to cuDNN, Flex, Flex's FA4 backend and FA4 (wheels staged and installed
    # by the calls before: experiments/gpu/wheels.sh), interleaved timing; rows kept in /tmp across calls
    bash experiments/gpu/wheels.sh stage && bash experiments/gpu/wheels.sh install >/dev/null 2>&1
    source experiments/gpu/wheels.sh env
    export PYTHONPATH=.:$PYTHONPATH
    python -m longca_triton.cli bench dense --no-plots --config experiments/dense_16k.toml \
      --backends triton,triton-gluon,sdpa-cudnn,flex,flex-fa4,fa4 --mode fwd --out /tmp/fwd16 2>&1 | tail -22
    mkdir -p "$OUT/fwd16" && cp /tmp/fwd16/* "$OUT/fwd16/" 2>/dev/null
    ;;
  more)
    # what else the persistent launch buys: two consumers on the dense masks, ping-pong, three consumers with
    # 64-key tiles and O's own buffers; then D = 96 and D = 64 on four sparse masks
    PYTHONUNBUFFERED=1 python experiments/gpu/gluon_diag.py --out "$OUT/more128" --fwd-configs 16384 \
      --masks full,causal,prefix_lm_causal,causal_blockwise,full_document --config-json \
      '[{"consumers": 2, "persistent": true, "o_own": true, "num_stages": 2}, {"consumers": 2, "persistent": true, "o_own": true, "num_stages": 2, "pingpong": true}, {"consumers": 3, "p_smem": true, "persistent": true, "o_own": true, "BLOCK_N": 64}]' \
      2>&1 | grep ROW | cut -c1-200
    for d in 96 64; do
      PYTHONUNBUFFERED=1 python experiments/gpu/gluon_diag.py --out "$OUT/more$d" --fwd-configs 16384 --head-dims $d \
        --masks sliding_window_causal,causal_document,full_document,share_question \
        --config-json '[{"persistent": true}, {"persistent": true, "o_own": true}, {"persistent": true, "o_own": true, "num_stages": 2}]' \
        2>&1 | grep ROW | cut -c1-200
    done
    ;;
  final)
    # the final code's Gluon GPU tests on the forward paths whose defaults moved (persistent at 64 / 96 / 128 on
    # the sparser masks), then issue 13's block-sparse backward cases through the interleaved harness
    timeout 240 python -m pytest -q -m gpu tests/test_gluon_gpu.py -rA \
      -k "persistent or padded_head_dims or (static_masks_gqa and default) or (random_overlapping and default)" 2>&1 \
      | grep -E "PASSED|FAILED|ERROR|passed|failed" | tee "$OUT/gpu_tests_final.txt" | tail -3
    python -m longca_triton.cli bench sparse --no-plots --config experiments/sparse_64k.toml --param block=128 \
      --param density=0.3,0.5 --param patterns=Hkv,1 --seqlens 32K,64K --backends triton-sparse,flex --mode bwd \
      --max-minutes 5 --out "$OUT/sparse_bwd" 2>&1 | tail -14
    ;;
  *) echo "usage: session15.sh window|persist|ab|tests|target|more|final" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Session 16's GPU calls (one subcommand per call; rows go straight into $OUT).
#   bash experiments/gpu/session16.sh dq32   dQ over 32-key steps (less ragged waste on the key side)
#   bash experiments/gpu/session16.sh keytails dK/dV key remainders in 32-key tiles; ncu of ragged vs 128-aligned blocks
#   bash experiments/gpu/session16.sh windows the sliding windows' backward: tile / order variants next to Flex
#   bash experiments/gpu/session16.sh dense  issue 13's dense backward targets, a second interleaved run
#   bash experiments/gpu/session16.sh count  a packed entry's count from the loop index instead of a table load
#   bash experiments/gpu/session16.sh accept the variable-block defaults through the harness; 128-aligned variable blocks
#   bash experiments/gpu/session16.sh combo  the row-major dK/dV sweep with big dQ tiles, and dK/dV tiles beside it
#   bash experiments/gpu/session16.sh ncu    Nsight Compute stall sampling: uniform vs variable-block dK/dV; the row-major sweep
#   bash experiments/gpu/session16.sh chunks every per-entry list value read in register chunks (not only the start)
#   bash experiments/gpu/session16.sh tails  variable blocks with uniform 128's big tiles and the remainders in tail tiles
#   bash experiments/gpu/session16.sh stack  per-pass packing, heads stacked into 128-row tiles, each pass timed alone
#   bash experiments/gpu/session16.sh pack   issue 13's variable blocks: packed key / query lists (tiles crossing
#                                            from one run of kept blocks into the next) against the plain lists and
#                                            uniform block 128, 32K density 0.3 a pattern per KV head: each variant
#                                            checked in bf16 against float32 (one KV group), backward then forward
set -u
export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
BV=experiments/gpu/bwd_variants.py
T1=dkdv64x128w8s3+dkdvtail64+dq128x64w8s3+dqtail64+chunk64  # uniform block 128's backward tiles, tails of 64
T2=dkdv64x128w8s2+dkdvtail64+dq128x64w8s2+dqtail64          # the same, lists read entry by entry, two stages
case "${1:-}" in
  dq32)
    # call 13: dQ stepping over 32-key tiles (a run's ragged key tail wastes less) with the 128-row tiles and tails
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/vb_bwd" --budget 200 --masks '' --sparse-masks varblock256 --no-vendors \
      --sparse-variants "two-kernels,dq128x32w8s3+dqtail64+chunk64,dq128x32w8s4+dqtail64+chunk64,dq128x32w4s3+dqtail64+chunk64" \
      2>&1 | grep -A3 "^| mask | two"
    python experiments/gpu/session16_rows.py "$OUT/vb_bwd/bwd_variants.jsonl"
    ;;
  keytails)
    # call 12: dK/dV's key-side remainders in 32-key tail tiles; the defaults on ragged vs 128-aligned variable
    # blocks; then stall sampling of the dK/dV kernel on both (same config: packed + masked vs boxed + even)
    for m in varblock256 varblock256x128; do
      PYTHONUNBUFFERED=1 python $BV --out "$OUT/$m" --budget 200 --masks '' --sparse-masks $m --no-vendors \
        --sparse-variants "two-kernels,dkdvtail32" 2>&1 | grep -A3 "^| mask | two"
      python experiments/gpu/session16_rows.py "$OUT/$m/bwd_variants.jsonl"
    done
    for c in varblock-ours:1 varblock-aligned:1; do
      OUT=$OUT CASES=${c%%:*} KERNELS=bwd_dkdv SKIP=${c##*:} COUNT=1 bash experiments/gpu/ncu_stalls.sh source
      mv "$OUT/src.tgz" "$OUT/src_${c%%:*}.tgz"
      tar xzf "$OUT/src_${c%%:*}.tgz" -O "src/${c%%:*}.csv" > /tmp/${c%%:*}.csv
      python experiments/gpu/ncu_source_top.py /tmp/${c%%:*}.csv --top 14 | cut -c1-220 | tee "$OUT/top_${c%%:*}.txt"
    done
    ;;
  windows)
    # call 10: the two sliding windows (1.09-1.11x Flex in call 9): dK/dV tiles, grid order, sweep, one launch
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/win" --budget 420 --masks sliding_window,sliding_window_causal \
      --sparse-masks '' --no-split --variants \
      two-kernels,dkdv64x64w4s2,dkdv64x64w4s3,outer,sweep2,dkdv64x64w4s2+sweep2,dkdv32x64w4s2,dq64x64w4s3,one2w4s3 \
      2>&1 | grep -B2 -A6 "^| mask | two kernels | best one launch | fused" | head -12
    python experiments/gpu/session16_rows.py "$OUT/win/bwd_variants.jsonl" | grep -v "^check"
    ;;
  dense)
    # call 9: issue 13's dense backward targets once more, interleaved (session 15's call 1 met them, the two
    # sliding windows by 0.6 / 1.0 %): ours, cuDNN and Flex on every static mask at 16K
    python -m longca_triton.cli bench dense --no-plots --config experiments/dense_16k.toml \
      --backends triton,triton-gluon,sdpa-cudnn,flex --mode bwd --out "$OUT/bwd16" 2>&1 | tail -30
    ;;
  count)
    # call 8: a packed entry's count from the loop index (only a list's last entry may be short), not a load
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/un_bwd" --masks '' --sparse-masks uniform128 --no-vendors \
      --sparse-variants two-kernels 2>&1 | grep -A3 "^| mask | two"
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/vb_bwd" --budget 260 --masks '' --sparse-masks varblock256 --no-vendors \
      --sparse-variants "two-kernels,hm,hm+dkdv64x64w4s2+chunk64,dqpack,dkdv64x128w8s3+dkdvtail64,dkdv64x64w4s3" \
      2>&1 | grep -A3 "^| mask | two"
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/vb_fwd" --budget 80 --masks '' --sparse-masks varblock256 --no-vendors \
      --no-split --sparse-fwd --sparse-variants two-kernels,fwdpack 2>&1 | grep -A3 "^| mask | two"
    for f in "$OUT"/{un,vb}_bwd/bwd_variants.jsonl "$OUT"/vb_fwd/bwd_variants.jsonl; do echo "== $f"; python experiments/gpu/session16_rows.py "$f"; done
    ;;
  accept)
    # call 7 (and 11 with SEQLENS=32K,64K): the variable-block defaults through the harness (a varblock bucket and
    # a uniform bucket per density, a pattern per KV head), then blocks that are multiples of 128 (variable, not
    # ragged) run with uniform block 128's tiles: what the variable structure costs without ragged tiles
    bench() { python -m longca_triton.cli bench "$@" --no-plots --seqlens ${SEQLENS:-32K} --mode bwd; }
    bench varblock --config experiments/varblock.toml --param block=256 --param density=0.3,0.5 \
      --backends triton-varblock --out "$OUT/h_var" 2>&1 | tail -8
    bench sparse --config experiments/sparse_64k.toml --param block=128 --param density=0.3,0.5 --param patterns=Hkv \
      --backends triton-sparse --out "$OUT/h_uni" 2>&1 | tail -8
    [ -n "${SEQLENS:-}" ] && exit 0
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/al_bwd" --budget 200 --masks '' --sparse-masks varblock256x128 --no-vendors \
      --sparse-variants "two-kernels,dkdv64x128w8s3+dq128x64w8s3+chunk64" 2>&1 | grep -A3 "^| mask | two"
    python experiments/gpu/session16_rows.py "$OUT/al_bwd/bwd_variants.jsonl"
    ;;
  combo)
    # call 6: the row-major sweep for dK/dV with the big dQ tiles (+ tails, plain lists), and dK/dV tiles beside it
    DQB=dq128x64w8s3+dqtail64+dqnopack+chunk64
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/un_bwd" --masks '' --sparse-masks uniform128 --no-vendors \
      --sparse-variants two-kernels 2>&1 | grep -A3 "^| mask | two"
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/vb_bwd" --budget 300 --masks '' --sparse-masks varblock256 --no-vendors \
      --sparse-variants "two-kernels,sweep2+$DQB,sweep2+$DQB+dkdv64x128w8s2,sweep2+$DQB+dkdv32x64w4s3,sweep2+$DQB+dkdv32x64w4s2,sweep2+$DQB+dkdv64x64w4s3,sweep2" \
      2>&1 | grep -A3 "^| mask | two"
    for f in "$OUT"/{un,vb}_bwd/bwd_variants.jsonl; do echo "== $f"; python experiments/gpu/session16_rows.py "$f"; done
    ;;
  ncu)
    # call 5: where the variable-block dK/dV pass loses to uniform block 128's at the same tiles: per-SASS stall
    # sampling of the dK/dV kernel (second backward; the variable blocks' main launch, not its tail launch)
    for c in sparse-ours:1 varblock-big:2 varblock-ours:1; do
      OUT=$OUT CASES=${c%%:*} KERNELS=bwd_dkdv SKIP=${c##*:} COUNT=1 bash experiments/gpu/ncu_stalls.sh source
      mv "$OUT/src.tgz" "$OUT/src_${c%%:*}.tgz"
      tar xzf "$OUT/src_${c%%:*}.tgz" -O "src/${c%%:*}.csv" > /tmp/${c%%:*}.csv
      python experiments/gpu/ncu_source_top.py /tmp/${c%%:*}.csv --top 12 | cut -c1-220 | tee "$OUT/top_${c%%:*}.txt"
    done
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/vb_bwd" --budget 200 --masks '' --sparse-masks varblock256 --no-vendors \
      --sparse-variants "two-kernels,sweep2,sweep1,$T2+sweep2" 2>&1 | grep -A3 "^| mask | two"
    python experiments/gpu/session16_rows.py "$OUT/vb_bwd/bwd_variants.jsonl"
    ;;
  chunks)
    # call 4: every per-entry value of a list (end / next / count too) read in register chunks
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/un_bwd" --masks '' --sparse-masks uniform128 --no-vendors \
      --sparse-variants two-kernels 2>&1 | grep -A3 "^| mask | two"
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/vb_bwd" --budget 330 --masks '' --sparse-masks varblock256 --no-vendors \
      --sparse-variants "two-kernels,chunk64,dkdv64x64w4s3+chunk64,$T1,$T1+dqnopack,dkdv64x128w8s3+dkdvtail64+chunk64,nopack+chunk64" \
      2>&1 | grep -A3 "^| mask | two"
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/un_fwd" --masks '' --sparse-masks uniform128 --no-vendors --no-split \
      --sparse-fwd --sparse-variants two-kernels 2>&1 | grep -A3 "^| mask | two"
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/vb_fwd" --budget 120 --masks '' --sparse-masks varblock256 --no-vendors \
      --no-split --sparse-fwd --sparse-variants \
      two-kernels,fwd128x64w8s3+fwdtail64+chunk64,fwdpack,fwd128x128w8s3+fwdtail64+chunk64+fwdpack \
      2>&1 | grep -A3 "^| mask | two"
    for f in "$OUT"/{un,vb}_{bwd,fwd}/bwd_variants.jsonl; do echo "== $f"; python experiments/gpu/session16_rows.py "$f"; done
    ;;
  tails)
    # call 3: the big tiles of uniform blocks (128 rows / keys owned) with block remainders in 64-row tail tiles
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/un_bwd" --masks '' --sparse-masks uniform128 --no-vendors \
      --sparse-variants two-kernels 2>&1 | grep -A3 "^| mask | two"
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/vb_bwd" --budget 330 --masks '' --sparse-masks varblock256 --no-vendors \
      --sparse-variants "$T1,$T1+dqnopack,dkdv64x128w8s3+dkdvtail64+chunk64,$T2,$T2+dqnopack,two-kernels" \
      2>&1 | grep -A3 "^| mask | two"
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/un_fwd" --masks '' --sparse-masks uniform128 --no-vendors --no-split \
      --sparse-fwd --sparse-variants two-kernels 2>&1 | grep -A3 "^| mask | two"
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/vb_fwd" --budget 120 --masks '' --sparse-masks varblock256 --no-vendors \
      --no-split --sparse-fwd --sparse-variants \
      two-kernels,fwd128x64w8s3+fwdtail64+chunk64,fwd128x128w8s3+fwdtail64+chunk64,fwd128x64w8s2+fwdtail64 \
      2>&1 | grep -A3 "^| mask | two"
    for f in "$OUT"/{un,vb}_{bwd,fwd}/bwd_variants.jsonl; do echo "== $f"; python experiments/gpu/session16_rows.py "$f"; done
    ;;
  stack)
    # call 2: per-pass packing and heads stacked into 128-row tiles, with each pass timed alone (split rows)
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/un_bwd" --masks '' --sparse-masks uniform128 --no-vendors \
      --sparse-variants two-kernels 2>&1 | grep -A3 "^| mask | two"
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/vb_bwd" --budget 330 --masks '' --sparse-masks varblock256 --no-vendors \
      --sparse-variants two-kernels,nopack,dqnopack,dqheads2+dq64x64w8s2,dkdvheads2+dkdv64x64w8s2,dkdv64x64w8s2,dkdv64x64w4s3 \
      2>&1 | grep -A3 "^| mask | two"
    PYTHONUNBUFFERED=1 python $BV --out "$OUT/vb_fwd" --budget 100 --masks '' --sparse-masks varblock256 --no-vendors \
      --no-split --sparse-fwd --sparse-variants two-kernels,fwdpack,fwdheads2+fwd64x64w8s3+chunk64,fwdheads2+fwd64x64w8s2 \
      2>&1 | grep -A3 "^| mask | two"
    for f in "$OUT"/vb_bwd/bwd_variants.jsonl "$OUT"/vb_fwd/bwd_variants.jsonl; do python experiments/gpu/session16_rows.py "$f"; done
    ;;
  pack)
    for mode in bwd fwd; do
      F=$([ $mode = fwd ] && echo --sparse-fwd)
      V=$([ $mode = fwd ] && echo two-kernels,nopack,fwd64x128w8s2,fwd64x128w4s3+chunk64,fwd64x128w8s3+chunk64,fwd64x64w4s2 \
          || echo two-kernels,nopack,dq64x128w8s2,dq64x128w4s2,dkdv128x64w8s2+dq64x128w8s2,chunk64,dkdv64x64w4s3,nopack+dq64x128w8s2)
      PYTHONUNBUFFERED=1 python $BV --out "$OUT/un_$mode" --masks '' --sparse-masks uniform128 --no-vendors --no-split $F \
        --sparse-variants two-kernels 2>&1 | grep -A3 "^| mask | two"
      PYTHONUNBUFFERED=1 python $BV --out "$OUT/vb_$mode" --budget $([ $mode = fwd ] && echo 150 || echo 300) --masks '' \
        --sparse-masks varblock256 --no-vendors --no-split $F --sparse-variants $V 2>&1 | grep -A3 "^| mask | two"
      python experiments/gpu/session16_rows.py "$OUT/vb_$mode/bwd_variants.jsonl"
    done
    ;;
  *)
    sed -n 2,8p "$0"; exit 2
    ;;
esac

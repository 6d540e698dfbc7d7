#!/usr/bin/env bash
# Issue 13 on one H100, one device call: the backward of another version of the kernels (BASE, a
# directory holding a `longca_triton` package) against this checkout's, by the same script on the
# same inputs, then this checkout's dK/dV tile candidates, Flex and cuDNN.
#
#   rm -rf _base && mkdir _base && git archive HEAD longca_triton | tar -x -C _base
#   echo _base/ >> .git/info/exclude      # never committed; carry it: run(carry=["_base"])
#   BASE=_base bash experiments/gpu/bwd_ab.sh                       (timeout_s 600)
#
# $OUT: env.txt, base.log, new.log, base/bwd_variants.{jsonl,md}, new/bwd_variants.{jsonl,md}.
# Each row of bwd_variants.jsonl: a check against float32 (one KV group), a timing (`bwd`: the
# preprocess and both kernels), a `split` (dK/dV and dQ kernels alone), Flex / cuDNN timings.
# Wheels carried in .whl/ are staged on the way (experiments/gpu/wheels.sh), so that the next
# call can install them while the machine is warm.
set -u
OUT=${OUT:-/tmp/bwd_ab}
BASE=${BASE:-_base}
MASKS=${MASKS:-full,causal,causal_document,share_question}
VARIANTS=${VARIANTS:-two-kernels,dkdv32x128w8s3,dkdv32x128w8s2,dkdv32x64w4s2,dkdv64x128w8s3,dkdv64x64w4s2}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?') + working tree; base: $BASE"
  echo "masks $MASKS; variants $VARIANTS"
} > "$OUT/env.txt" 2>&1
[ -d .whl ] && bash experiments/gpu/wheels.sh stage
if [ -d "$BASE/longca_triton" ]; then
  LONGCA_PACKAGE_ROOT=$BASE python experiments/gpu/bwd_variants.py --out "$OUT/base" --budget "${BASE_BUDGET:-130}" \
    --masks "$MASKS" --variants two-kernels --sparse-masks uniform128 --sparse-variants two-kernels --no-vendors \
    > "$OUT/base.log" 2>&1
else
  echo "no $BASE/longca_triton: no base run" > "$OUT/base.log"
fi
python experiments/gpu/bwd_variants.py --out "$OUT/new" --budget "${NEW_BUDGET:-400}" --masks "$MASKS" \
  --variants "$VARIANTS" --sparse-masks uniform128 --sparse-variants two-kernels > "$OUT/new.log" 2>&1
tail -n 30 "$OUT/new/bwd_variants.md" "$OUT/base/bwd_variants.md" 2>/dev/null

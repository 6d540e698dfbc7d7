#!/usr/bin/env bash
# The group_cast CP scheme on 2+ GPUs, correctness then timing (device kind nvidia-h200-x2 or -x4):
#
#   bash experiments/gpu/cp_group_cast.sh          # from the repository root; files land in $OUT
#
# 1. correctness of group_cast (bf16, 8K tokens per GPU, GQA 64:8, D = 128, our Triton kernel): every
#    plan x the check's six masks against the single-GPU kernel and a float32 truth ($OUT/cp_check.md);
# 2. bench cp, fwd+bwd, all six schemes x every plan on full, causal and the four document masks at
#    8K tokens per GPU ($OUT/cp/results.jsonl, cp_report.md with the schemes' comparison table,
#    plots/), group_cast first so a cut budget keeps it; then the forward-only points while time is
#    left (the same results file; a rerun with the same $OUT resumes).
# Budget: ~9.5 minutes in all (the device's 10-minute limit per command).
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/../.."
OUT=${OUT:-results/cp-group-cast}
SCHEMES=group_cast,ring_allgather,ring_p2p,ulysses,usp,loongtrain
MASKS=full,causal,causal_document,full_document,share_question,block_causal_document
PY=${PYTHON:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.csv"
T0=$(date +%s)
# phase 1 + the fwd+bwd benchmark (cp_check gives its check at most 45% of the budget)
"$PY" experiments/gpu/cp_check.py --out "$OUT" --schemes group_cast --max-minutes 7.5 \
  --bench-masks "$MASKS" --bench-modes fwd_bwd 2>&1 | tee "$OUT/log_fwd_bwd.txt" || true
# the benchmark's scheme list comes from --schemes: run the other schemes' fwd+bwd points next
LEFT=$(( (570 - ($(date +%s) - T0)) ))
if [ "$LEFT" -gt 60 ]; then
  "$PY" -m longca_triton.cp.cli --config experiments/cp.toml --out "$OUT/cp" --world "${WORLD:-$(nvidia-smi -L | wc -l)}" \
    --schemes "$SCHEMES" --masks "$MASKS" --modes fwd_bwd,fwd --max-minutes "$(( (LEFT - 30) / 60 ))" \
    2>&1 | tee "$OUT/log_bench.txt" || true
fi
echo "[cp_group_cast] done after $(( $(date +%s) - T0 )) s; report: $OUT/cp/cp_report.md"

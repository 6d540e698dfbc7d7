#!/usr/bin/env bash
# Issue 17: why FlashAttention-3 runs D = 96 at 0.91-0.93 of its D = 128 per FLOP on an H200 (session 28, fa3d96:
# 629 / 676 TFLOP/s full) where ours runs 0.78 (516 / 662): Nsight Compute on one forward launch of each, full mask,
# 16K, GQA 64:8, bf16 (the fa3-fwd wheel installed: `bash experiments/gpu/wheels.sh stage && ... install`, carry
# .whl/fa3fwd/1).
#   OUT=$OUT bash experiments/gpu/ncu_d96.sh        -> $OUT/ncu96/<tag>.csv (raw page), <tag>-src.csv.gz (source page)
# Tags: fa3-d96, fa3-d128, ours-d96, ours-d128. The same sections as gluon_fwd_ncu.sh.
set -u
DIR=$OUT/ncu96
mkdir -p "$DIR"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for case in fa3-fwd:96:FlashAttnFwd fa3-fwd:128:FlashAttnFwd triton-gluon:96:gluon_fwd_kernel triton-gluon:128:gluon_fwd_kernel; do
  IFS=: read -r backend d kernel <<< "$case"
  tag=${backend%%-*}-d$d; [ "$backend" = triton-gluon ] && tag=ours-d$d
  RUN=(python -c "
import sys, torch
sys.path.insert(0, '.')
from longca_triton.adapters import get_backend
from longca_triton.masks import make_mask
S, d = 16384, $d
g = torch.Generator(device='cuda').manual_seed(0)
q = torch.randn(1, S, 64, d, device='cuda', dtype=torch.bfloat16, generator=g)
k, v = (torch.randn(1, S, 8, d, device='cuda', dtype=torch.bfloat16, generator=g) for _ in range(2))
b, mask = get_backend('$backend'), make_mask('full', S)
with torch.no_grad():
    for _ in range(3):
        b.attention(q, k, v, mask)
torch.cuda.synchronize()
")
  "$NCU" --clock-control none --kernel-name-base demangled -k "regex:$kernel" -s 2 -c 1 --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats \
    --section SourceCounters --section LaunchStats --section Occupancy \
    --import-source no -f -o "$DIR/$tag" "${RUN[@]}" > "$DIR/$tag.log" 2>&1
  echo "$tag record rc=$?"
  "$NCU" --import "$DIR/$tag.ncu-rep" --csv --page raw > "$DIR/$tag.csv" 2> "$DIR/$tag.err"
  "$NCU" --import "$DIR/$tag.ncu-rep" --page source --print-source sass --csv 2>> "$DIR/$tag.err" | gzip > "$DIR/$tag-src.csv.gz"
  echo "$tag $(wc -l < "$DIR/$tag.csv") lines"
done
python3 - "$DIR" <<'PY'
import csv, sys
from pathlib import Path
want = ["gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
        "smsp__issue_active.avg.pct_of_peak_sustained_active", "smsp__warps_eligible.avg.per_cycle_active",
        "smsp__warps_active.avg.per_cycle_active", "smsp__inst_executed.sum", "launch__registers_per_thread",
        "launch__block_size", "launch__grid_size", "sm__warps_active.avg.pct_of_peak_sustained_active"]
for f in sorted(Path(sys.argv[1]).glob("*.csv")):
    rows = list(csv.reader(open(f)))
    if len(rows) < 3:
        print(f.name, "no data"); continue
    head, data = rows[0], rows[2]
    vals = {h: v for h, v in zip(head, data)}
    stall = sorted(((float(v.replace(",", "")), h) for h, v in vals.items()
                    if h.startswith("smsp__average_warp_latency_issue_stalled_") and h.endswith(".ratio")
                    and v.replace(",", "").replace(".", "", 1).isdigit()), reverse=True)[:6]
    print(f.stem, {w.split("__")[1][:40]: vals.get(w) for w in want if w in vals})
    print("  stalls per issue:", ", ".join(f"{h.split('stalled_')[1].split('.')[0]} {x:.2f}" for x, h in stall))
PY
(cd "$OUT" && tar czf ncu96.tgz ncu96 && rm -rf ncu96)

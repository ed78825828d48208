#!/usr/bin/env bash
# What limits lookups (benchmarks/lookup_limits.py) on a lent GPU machine, from the repository
# root: random-read ceilings, launches and cache hints, host page size; then Nsight Compute's
# DRAM bytes of one launch of each kind. Files in $OUT: env.txt limits.{log,json,md} ncu.{csv,err}
# Usage: ENGRAM_COMMIT=<sha> bash benchmarks/gpu_limits.sh [lookup_limits.py options]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
t0=$SECONDS
timeout 330 python3 benchmarks/lookup_limits.py --json "$OUT/limits.json" --md "$OUT/limits.md" \
    "$@" > "$OUT/limits.log" 2>&1
echo "limits rc=$? in $((SECONDS - t0)) s"
t0=$SECONDS
METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
timeout 200 ncu --clock-control none --profile-from-start off --csv --metrics "$METRICS" \
    python3 benchmarks/lookup_limits.py --ncu > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
echo "ncu rc=$? in $((SECONDS - t0)) s"; tail -3 "$OUT/ncu.err"
grep -E "Kernel|_engram|_gather" "$OUT/ncu.csv" | cut -c1-60 | head -3
cat "$OUT/limits.md"

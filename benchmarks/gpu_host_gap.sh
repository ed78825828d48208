#!/usr/bin/env bash
# benchmarks/host_gap_study.py on a lent GPU machine (the `run` device tool), from the
# repository root, carrying `.vllm_ref` (see gpu_model_lookup.sh). Lands in $OUT: env.txt,
# host_gap.{json,log}.
# Usage: ENGRAM_COMMIT=<sha> bash benchmarks/gpu_host_gap.sh [study options]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
t0=$SECONDS
timeout ${STUDY_TIMEOUT_S:-420} python3 benchmarks/host_gap_study.py --json "$OUT/host_gap.json" "$@" \
    > "$OUT/host_gap.log" 2>&1
echo "study rc=$? in $((SECONDS - t0)) s"
tail -20 "$OUT/host_gap.log"

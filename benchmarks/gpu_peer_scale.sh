#!/usr/bin/env bash
# Peer groups of 4 and 8 GPUs at real size (issue 8) on a lent multi-GPU machine (the `run`
# device tool), from the repository root: installs the checkout (gpu_env.sh) and runs
# benchmarks/bench_peer_scale.py from /tmp (spawned members started inside the checkout would
# import the source tree instead of the installed package). Files land in $OUT: env.txt
# scale.log peer_scale/latest.md peer_scale/history.jsonl (copy both over
# benchmarks/results/peer_scale/).
# Usage: ENGRAM_COMMIT=<sha> bash benchmarks/gpu_peer_scale.sh [SIZES] [extra bench args]
#   SIZES: comma-separated group sizes, default 4,8 (each <= the machine's GPUs)
#   e.g.   bash benchmarks/gpu_peer_scale.sh 2 --small   (a quick check on 2 GPUs)
set -uo pipefail
SIZES=${1:-4,8}
shift || true
REPO=$(cd "$(dirname "$0")/.." && pwd)
source "$REPO/benchmarks/gpu_env.sh"
[ $# -gt 0 ] || set -- --model deepseek-v4.1-flash
t0=$SECONDS
(cd /tmp && timeout ${SCALE_LIMIT_S:-560} python3 "$REPO/benchmarks/bench_peer_scale.py" \
    --sizes "$SIZES" "$@" --results "$(results_copy peer_scale)") \
    > "$OUT/scale.log" 2>&1
echo "bench rc=$? in $((SECONDS - t0)) s"
grep -v "fill layer" "$OUT/scale.log" | tail -80

#!/usr/bin/env bash
# Peer-group tables on a lent 2-GPU machine (the `run` device tool), from the repository root:
# installs the checkout, runs `engram-ray doctor`, tests/gpu/test_peer_cuda.py and the peer
# benchmark (bench_peer.py gpu). Files land in $OUT: env.txt doctor.txt pytest.log bench.log
# peer_gpu/latest.md peer_gpu/history.jsonl (copy both over benchmarks/results/peer_gpu/).
# Usage: ENGRAM_COMMIT=<sha> bash benchmarks/gpu_peer.sh [quick|full]
#   quick: doctor + tests + the benchmark on a small layout (2M vocab, ~12 GiB per GPU)
#   full:  doctor + tests + the benchmark on DeepSeek-V4.1-Flash at real size (~94 GiB per GPU)
set -uo pipefail
MODE=${1:-quick}
source "$(dirname "$0")/gpu_env.sh"

t0=$SECONDS
timeout 120 engram-ray doctor > "$OUT/doctor.txt" 2>&1
echo "doctor rc=$? in $((SECONDS - t0)) s"; cat "$OUT/doctor.txt"

t0=$SECONDS
timeout 240 python3 -m pytest tests/gpu/test_peer_cuda.py -m "gpu or multi_gpu" -q \
    -p no:cacheprovider -rfEs > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? in $((SECONDS - t0)) s"; grep -v "fill layer" "$OUT/pytest.log" | tail -25
if [ "$MODE" = quick ]; then
    BENCH=(--small --budget-s 0.2); LIMIT=150
else
    BENCH=(--model deepseek-v4.1-flash --budget-s 0.4); LIMIT=400
fi
t0=$SECONDS
timeout $LIMIT python3 benchmarks/bench_peer.py gpu "${BENCH[@]}" \
    --results "$(results_copy peer_gpu)" > "$OUT/bench.log" 2>&1
echo "bench rc=$? in $((SECONDS - t0)) s"
grep -v "fill layer" "$OUT/bench.log" | tail -60

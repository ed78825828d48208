#!/usr/bin/env bash
# Slice holders on a lent GPU machine (the `run` device tool), from the repository root: the
# exporter of a CUDA slice killed while another process reads it, then a new process
# re-attaching it from its holder (tests/gpu/test_slice_failover.py; two-GPU case where two
# GPUs exist); a group of two meeting through its holders, no pidfd_getfd
# (tests/gpu/test_peer_exchange.py); the cuda backend's group tests (test_peer_cuda.py,
# test_deepseek_session.py: two-GPU cases where two GPUs exist). Files land in $OUT: env.txt
# pytest.log (summarize them in benchmarks/results/slice_failover/latest.md and a line of its
# history.jsonl: commit, device, date, command, outcome; the logs stay out of the tree).
# Usage: ENGRAM_COMMIT=<sha> bash benchmarks/gpu_failover.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
t0=$SECONDS
timeout ${PYTEST_TIMEOUT_S:-400} python3 -m pytest tests/gpu/test_slice_failover.py \
    tests/gpu/test_peer_exchange.py tests/gpu/test_peer_cuda.py tests/gpu/test_deepseek_session.py \
    -m "gpu or multi_gpu" -q -s -p no:cacheprovider -rfEs > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? in $((SECONDS - t0)) s"; grep -v "fill layer" "$OUT/pytest.log" | tail -30

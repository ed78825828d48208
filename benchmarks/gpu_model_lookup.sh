#!/usr/bin/env bash
# The lookup as vLLM's model calls it, on a lent GPU machine (the `run` device tool), from the
# repository root, carrying `.vllm_ref` (vLLM 0.33.0's engram.py, never committed; here:
#   pip download --no-deps vllm==0.33.0 -d .tmp/vllm033
#   unzip -o -j .tmp/vllm033/vllm-0.33.0*.whl 'vllm/models/deepseek_v41/common/engram.py' -d .vllm_ref/
# with /.vllm_ref/ in .git/info/exclude). Runs the model-lookup GPU tests, a quick pass of the
# kernel's tests (no regression; skip: TESTS=0), benchmarks/lookup_order_study.py (skip:
# STUDY_TIMEOUT_S=0), benchmarks/lookup_host_layout_study.py first if LAYOUT_STUDY_TIMEOUT_S
# is set (its verdict picks the bench's host table layout)
# and benchmarks/bench_model_lookup.py. Lands in $OUT: env.txt pytest.log order.{log,json,md}
# layout.{log,json,md} bench.{log,json,md}.
# Usage: ENGRAM_COMMIT=<sha> bash benchmarks/gpu_model_lookup.sh [--quick]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"

if [ "${LAYOUT_STUDY_TIMEOUT_S:-0}" != 0 ]; then
    t0=$SECONDS
    timeout ${LAYOUT_STUDY_TIMEOUT_S} python3 benchmarks/lookup_host_layout_study.py \
        --json "$OUT/layout.json" --md "$OUT/layout.md" --commit "${ENGRAM_COMMIT:-unknown}" \
        > "$OUT/layout.log" 2>&1
    echo "layout study rc=$? in $((SECONDS - t0)) s"
    # the host layout the bench's patch gets: the policy's, unless the study just measured
    # it slower than packed rows (benchmarks/lookup_host_layout_study.py --decide)
    HOST_LAYOUT=$(python3 benchmarks/lookup_host_layout_study.py --decide "$OUT/layout.json")
    echo "host table layout for the bench: $HOST_LAYOUT"
fi

if [ "${TESTS:-1}" != 0 ]; then
    t0=$SECONDS
    timeout 180 python3 -m pytest tests/gpu/test_model_lookup.py -q -p no:cacheprovider -x -rfEs \
        > "$OUT/pytest.log" 2>&1
    echo "model lookup tests rc=$? in $((SECONDS - t0)) s: $(tail -1 "$OUT/pytest.log")"
    t0=$SECONDS
    timeout 70 python3 -m pytest tests/gpu/test_lookup.py -q -p no:cacheprovider -rfEs \
        -k "test_hbm or narrow" >> "$OUT/pytest.log" 2>&1
    echo "kernel tests rc=$? in $((SECONDS - t0)) s: $(tail -1 "$OUT/pytest.log")"
fi

if [ "${STUDY_TIMEOUT_S:-150}" != 0 ]; then
    t0=$SECONDS
    timeout ${STUDY_TIMEOUT_S:-150} python3 benchmarks/lookup_order_study.py \
        --json "$OUT/order.json" --md "$OUT/order.md" --commit "${ENGRAM_COMMIT:-unknown}" \
        > "$OUT/order.log" 2>&1
    echo "order study rc=$? in $((SECONDS - t0)) s"
    tail -12 "$OUT/order.log"
fi

t0=$SECONDS
timeout ${BENCH_TIMEOUT_S:-300} python3 benchmarks/bench_model_lookup.py --json "$OUT/bench.json" \
    --md "$OUT/bench.md" --commit "${ENGRAM_COMMIT:-unknown}" \
    ${HOST_LAYOUT:+--host-table-layout $HOST_LAYOUT} "$@" > "$OUT/bench.log" 2>&1
echo "bench rc=$? in $((SECONDS - t0)) s"
tail -6 "$OUT/bench.log"

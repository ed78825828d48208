#!/usr/bin/env bash
# The lookup as vLLM's model calls it, on a lent GPU machine (the `run` device tool), from the
# repository root, carrying `.vllm_ref` (each supported vLLM release's engram.py, never
# committed; here, for V in 0.33 and 0.34:
#   pip download --no-deps vllm==$V.0 -d .tmp/vllm-wheels
#   unzip -o -j .tmp/vllm-wheels/vllm-$V.0-*.whl 'vllm/models/deepseek_v41/common/engram.py' -d .vllm_ref/$V/
# with /.vllm_ref/ in .git/info/exclude). Runs the model-lookup GPU tests, a quick pass of the
# kernel's tests (no regression; skip: TESTS=0) and benchmarks/bench_model_lookup.py. Lands in
# $OUT: env.txt pytest.log bench.{log,json,md} and model_lookup/latest.md +
# model_lookup/history.jsonl (copy both over benchmarks/results/model_lookup/).
# The whole run took 330 s at 63637e3 (32 + 8 GiB host tables); `--placements host` or
# `--placements hbm peer` split it over two calls.
# Usage: ENGRAM_COMMIT=<sha> bash benchmarks/gpu_model_lookup.sh [--vllm 0.33|0.34] [--quick]
#        [--placements ...]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"

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

t0=$SECONDS
timeout ${BENCH_TIMEOUT_S:-560} python3 benchmarks/bench_model_lookup.py --json "$OUT/bench.json" \
    --md "$OUT/bench.md" --results "$(results_copy model_lookup)" "$@" > "$OUT/bench.log" 2>&1
echo "bench rc=$? in $((SECONDS - t0)) s"
tail -6 "$OUT/bench.log"

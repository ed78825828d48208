#!/usr/bin/env bash
# Pipelined lookups (TileConfig.num_stages, cp.async) on a lent GPU machine, from the repository
# root: the pipelined-load tests of tests/gpu/test_lookup*.py (TESTS=all: both files; none
# with TESTS=none), then benchmarks/lookup_pipeline.py --parts ${PARTS:-sweep sizes host}, and
# on 2 GPUs with PEER=1 bench_peer.py gpu --small (its sweep has the pipelined launches).
# Files in $OUT: pytest.log pipeline.{md,json} [peer_gpu.{md,json}].
# Usage: ENGRAM_COMMIT=<sha> bash benchmarks/gpu_pipeline.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
R=$PWD
t0=$SECONDS
K=(-k pipelined); [ "${TESTS:-pipelined}" = all ] && K=()
[ "${TESTS:-pipelined}" = none ] || (cd /tmp && timeout ${TEST_TIMEOUT:-150} python3 -m pytest \
    "$R/tests/gpu/test_lookup.py" "$R/tests/gpu/test_lookup_launches.py" \
    -m "gpu or multi_gpu" "${K[@]}" -q -p no:cacheprovider \
    -rfEs -x --rootdir "$R" -c "$R/pyproject.toml") > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? in $((SECONDS - t0)) s: $(tail -1 "$OUT/pytest.log")"
t0=$SECONDS
timeout ${PIPELINE_TIMEOUT:-420} python3 benchmarks/lookup_pipeline.py \
    --parts ${PARTS:-sweep sizes host} ${PIPELINE_ARGS:-} \
    --json "$OUT/pipeline.json" --md "$OUT/pipeline.md" > /tmp/pipeline.log 2>&1
echo "pipeline rc=$? in $((SECONDS - t0)) s"; cp /tmp/pipeline.log "$OUT/"; grep -v '^{' /tmp/pipeline.log | tail -5
cat "$OUT/pipeline.md" 2>/dev/null
if [ "${PEER:-0}" = 1 ]; then
    t0=$SECONDS
    timeout 300 python3 benchmarks/bench_peer.py gpu --small --budget-s 0.2 \
        --md "$OUT/peer_gpu.md" --json "$OUT/peer_gpu.json" > /tmp/bench.log 2>&1
    echo "peer rc=$? in $((SECONDS - t0)) s"; grep -v "fill layer" /tmp/bench.log | tail -3
    cat "$OUT/peer_gpu.md"
fi

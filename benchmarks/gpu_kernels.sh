#!/usr/bin/env bash
# Lookup kernels on a lent GPU machine (the `run` device tool), from the repository root:
# installs the checkout, runs the lookup kernel's GPU tests and the benchmark. Everything lands
# in $OUT (at most 8 files): env.txt pytest.log bench.log [sweep.json] and lookup/latest.md +
# lookup/history.jsonl (copy both over benchmarks/results/lookup/).
# Usage: ENGRAM_COMMIT=<sha> bash benchmarks/gpu_kernels.sh [final|tune|quick]
#   final: the committed tile policy; tune: measure the policy first (sweep.json) and use it;
#   quick: tune with fewer sizes and a smaller budget.
set -uo pipefail
MODE=${1:-final}
source "$(dirname "$0")/gpu_env.sh"

t0=$SECONDS
timeout 330 python3 -m pytest tests/gpu/test_lookup.py tests/gpu/test_lookup_launches.py \
    -m "gpu or multi_gpu" -q -p no:cacheprovider \
    -rfEs --timeout 150 -s > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? in $((SECONDS - t0)) s: $(tail -1 "$OUT/pytest.log")"

t0=$SECONDS
case "$MODE" in
    quick) BENCH=(--budget-s 0.15 --tokens 43 683 2731 43691 65536 --sweep "$OUT/sweep.json") ;;
    tune) BENCH=(--budget-s 0.3 --sweep "$OUT/sweep.json") ;;
    *) BENCH=(--budget-s 0.3 --no-tune) ;;
esac
timeout 420 python3 benchmarks/bench_lookup.py --results "$(results_copy lookup)" \
    "${BENCH[@]}" > "$OUT/bench.log" 2>&1
echo "bench rc=$? in $((SECONDS - t0)) s"
grep -v '^{' "$OUT/bench.log" | grep -v "^hbm\|^peer\|^host" | tail -20
grep -E "policy|r16 |r128 |sorted" "$OUT/bench.log" | grep -E " (1048584|1572864|65544) " | tail -60

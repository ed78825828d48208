#!/usr/bin/env bash
# Cut row loads and the L2 fetch granularity on a lent 2-GPU machine, from the repository root.
# Part `a`: tests/gpu/test_lookup*.py (all; only the cut-load tests with SPLIT_ONLY=1; none with
# SKIP_TESTS=1), then lookup_limits.py --parts ${LIMITS_PARTS:-fetch peer} (L2 fetch
# granularity; SM reads over NVLink, whole and cut). Part `b`: bench_peer.py gpu --small (launch
# sweep incl. cut loads) and Nsight Compute's DRAM bytes at the default and a 32-byte L2 fetch
# granularity (NCU_FETCH= skips it). Files in $OUT (both parts in one call: at most 8).
# Usage: ENGRAM_COMMIT=<sha> bash benchmarks/gpu_sectors.sh a|b
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
R=$PWD
if [ "${1:-a}" = a ]; then
    t0=$SECONDS
    K=(); [ "${SPLIT_ONLY:-0}" = 1 ] && K=(-k split)
    [ "${SKIP_TESTS:-0}" = 1 ] || (cd /tmp && timeout 300 python3 -m pytest \
        "$R/tests/gpu/test_lookup.py" "$R/tests/gpu/test_lookup_launches.py" \
        -m "gpu or multi_gpu" "${K[@]}" -q -p no:cacheprovider \
        -rfEs --rootdir "$R" -c "$R/pyproject.toml") > "$OUT/pytest.log" 2>&1
    echo "pytest rc=$? in $((SECONDS - t0)) s: $(tail -1 "$OUT/pytest.log")"
    t0=$SECONDS
    timeout 280 python3 benchmarks/lookup_limits.py --parts ${LIMITS_PARTS:-fetch peer} \
        --budget-s 0.2 \
        --json "$OUT/limits.json" --md "$OUT/limits.md" > /tmp/limits.log 2>&1
    echo "limits rc=$? in $((SECONDS - t0)) s"; tail -5 /tmp/limits.log; cat "$OUT/limits.md"
else
    t0=$SECONDS
    timeout 330 python3 benchmarks/bench_peer.py gpu --small --budget-s 0.2 \
        --md "$OUT/peer_gpu.md" --json "$OUT/peer_gpu.json" > /tmp/bench.log 2>&1
    echo "bench rc=$? in $((SECONDS - t0)) s"; grep -v "fill layer" /tmp/bench.log | tail -5
    cat "$OUT/peer_gpu.md"
    t0=$SECONDS
    METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
    for f in ${NCU_FETCH-default 32}; do
        A=(); [ $f != default ] && A=(--l2-fetch $f)
        timeout 100 ncu --clock-control none --profile-from-start off --csv --metrics "$METRICS" \
            python3 benchmarks/lookup_limits.py --ncu "${A[@]}" > "$OUT/ncu_$f.csv" 2>> "$OUT/ncu.err"
        echo "ncu $f rc=$?"; tail -2 "$OUT/ncu.err"
    done
    echo "ncu in $((SECONDS - t0)) s"
fi

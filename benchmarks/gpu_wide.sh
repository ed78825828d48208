#!/usr/bin/env bash
# 16-byte loads (TileConfig.wide_loads) on a lent GPU machine, from the repository root: the
# wide-load tests of tests/gpu/test_lookup_launches.py (TESTS=all: every lookup test; none
# with TESTS=none), then benchmarks/lookup_wide.py --parts ${PARTS:-sweep host}, and on 2 GPUs
# with PEER=1 bench_peer.py gpu --small (its sweep has 16-byte-load launches); with NCU=1
# Nsight Compute's DRAM and L2 counts of lookup_wide.py --ncu (committed, wide 1, wide 2).
# Files in $OUT: env.txt pytest.log wide.{md,json} wide.log [peer_gpu.{md,json}] [ncu.csv].
# Usage: ENGRAM_COMMIT=<sha> bash benchmarks/gpu_wide.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
R=$PWD
t0=$SECONDS
K=(-k wide); [ "${TESTS:-wide}" = all ] && K=()
[ "${TESTS:-wide}" = none ] || (cd /tmp && timeout ${TEST_TIMEOUT:-200} python3 -m pytest \
    "$R/tests/gpu/test_lookup.py" "$R/tests/gpu/test_lookup_launches.py" \
    -m "gpu or multi_gpu" "${K[@]}" -q -p no:cacheprovider \
    -rfEs -x --rootdir "$R" -c "$R/pyproject.toml") > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? in $((SECONDS - t0)) s: $(tail -1 "$OUT/pytest.log")"
if [ "${PARTS:-sweep host}" != none ]; then
    t0=$SECONDS
    timeout ${WIDE_TIMEOUT:-330} python3 benchmarks/lookup_wide.py --parts ${PARTS:-sweep host} \
        ${WIDE_ARGS:-} --json "$OUT/wide.json" --md "$OUT/wide.md" > /tmp/wide.log 2>&1
    echo "wide rc=$? in $((SECONDS - t0)) s"; cp /tmp/wide.log "$OUT/"; grep -v '^{' /tmp/wide.log | tail -5
    cat "$OUT/wide.md" 2>/dev/null
fi
if [ "${PEER:-0}" = 1 ]; then
    t0=$SECONDS
    timeout ${PEER_TIMEOUT:-240} python3 benchmarks/bench_peer.py gpu --small --budget-s 0.2 \
        --md "$OUT/peer_gpu.md" --json "$OUT/peer_gpu.json" > /tmp/bench.log 2>&1
    echo "peer rc=$? in $((SECONDS - t0)) s"; grep -v "fill layer" /tmp/bench.log | tail -3
    cat "$OUT/peer_gpu.md"
fi
if [ "${NCU:-0}" = 1 ]; then
    t0=$SECONDS
    M1=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
    M2=lts__t_sectors_op_write.sum,lts__t_requests_srcunit_tex_op_write.sum,smsp__inst_executed.sum,lts__t_sectors_op_read.sum
    for M in $M1 $M2; do
        timeout 100 ncu --clock-control none --profile-from-start off --csv --metrics "$M" \
            python3 benchmarks/lookup_wide.py --ncu >> "$OUT/ncu.csv" 2>> /tmp/ncu.err
        echo "ncu rc=$?"; tail -2 /tmp/ncu.err
    done
    echo "ncu in $((SECONDS - t0)) s"
    grep -E "dram__bytes|duration|lts__t_sectors_op_write|inst_executed" "$OUT/ncu.csv" | awk -F'","' '{print $1, $13, $15}' | tr -d '"'
fi

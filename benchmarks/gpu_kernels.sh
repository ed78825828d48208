#!/usr/bin/env bash
# Lookup kernels on a lent GPU machine (the `run` device tool), from the repository root:
# installs the checkout, runs tests/gpu, dumps PTX/SASS evidence and runs the benchmark.
# Everything lands in $OUT (at most 8 files): env.txt pytest.log asm.txt bench.log bench.json
# bench.md [sweep.json].
# Usage: ENGRAM_COMMIT=<sha> bash benchmarks/gpu_kernels.sh [final|tune|quick]
#   final: the committed tile policy; tune: measure the policy first (sweep.json) and use it;
#   quick: tune with fewer sizes and a smaller budget.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
MODE=${1:-final}
OUT=${OUT:-/tmp/engram_out}
mkdir -p "$OUT"
{
    date -u; echo "commit ${ENGRAM_COMMIT:-unknown}"; nvidia-smi; nvidia-smi topo -m
    cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
    python3 -m pip install -q --no-deps --no-build-isolation -e . && echo "installed"
} > "$OUT/env.txt" 2>&1
tail -3 "$OUT/env.txt"

t0=$SECONDS
timeout 330 python3 -m pytest tests/gpu/test_lookup.py -m "gpu or multi_gpu" -q -p no:cacheprovider \
    -rfEs --timeout 150 -s > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? in $((SECONDS - t0)) s: $(tail -1 "$OUT/pytest.log")"

t0=$SECONDS
timeout 90 python3 benchmarks/lookup_asm.py --out "$OUT/asm.txt" > /dev/null 2>&1
echo "asm rc=$? in $((SECONDS - t0)) s"; grep -E "^lookup_r(16|128)_(packed|bf16)(_prefetch)? " "$OUT/asm.txt" | cut -c1-220

t0=$SECONDS
case "$MODE" in
    quick) BENCH=(--budget-s 0.15 --tokens 43 683 2731 43691 65536 --sweep "$OUT/sweep.json") ;;
    tune) BENCH=(--budget-s 0.3 --sweep "$OUT/sweep.json") ;;
    *) BENCH=(--budget-s 0.3 --no-tune) ;;
esac
timeout 420 python3 benchmarks/bench_lookup.py --json "$OUT/bench.json" --md "$OUT/bench.md" \
    "${BENCH[@]}" > "$OUT/bench.log" 2>&1
echo "bench rc=$? in $((SECONDS - t0)) s"
grep -v '^{' "$OUT/bench.log" | grep -v "^hbm\|^peer\|^host" | tail -20
grep -E "policy|r16 |r128 |sorted" "$OUT/bench.log" | grep -E " (1048584|1572864|65544) " | tail -60

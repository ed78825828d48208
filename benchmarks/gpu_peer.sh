#!/usr/bin/env bash
# Peer-group tables on a lent 2-GPU machine (the `run` device tool), from the repository root:
# installs the checkout, runs `engram-ray doctor`, tests/gpu/test_peer_cuda.py and the peer
# benchmark (bench_peer.py gpu). Files land in $OUT: env.txt doctor.txt pytest.log bench.log
# peer_gpu.md peer_gpu.json.
# Usage: ENGRAM_COMMIT=<sha> bash benchmarks/gpu_peer.sh [quick|full]
#   quick: doctor + tests + the benchmark on a small layout (2M vocab, ~12 GiB per GPU)
#   full:  doctor + tests + the benchmark on DeepSeek-V4.1-Flash at real size (~94 GiB per GPU)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
MODE=${1:-quick}
OUT=${OUT:-/tmp/engram_out}
mkdir -p "$OUT"
{
    date -u; echo "commit ${ENGRAM_COMMIT:-unknown}"; nvidia-smi; nvidia-smi topo -m
    uname -r; cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null; id
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
    python3 -m pip show cuda-bindings cuda-python 2>/dev/null | grep -E '^(Name|Version)'
    python3 -m pip install -q --no-deps --no-build-isolation -e . && echo "installed"
} > "$OUT/env.txt" 2>&1
tail -2 "$OUT/env.txt"

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
timeout $LIMIT python3 benchmarks/bench_peer.py gpu "${BENCH[@]}" --md "$OUT/peer_gpu.md" \
    --json "$OUT/peer_gpu.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$? in $((SECONDS - t0)) s"
grep -v "fill layer" "$OUT/bench.log" | tail -60

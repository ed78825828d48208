# Sourced by the benchmarks/gpu_*.sh scripts on a lent GPU machine: environment, $OUT, and an
# env.txt recording the machine, the commit and the install of this checkout.
# NVLink multicast stays off (the device tool's rule: it can take a shared host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/engram_out}
mkdir -p "$OUT"
{
    date -u; echo "commit ${ENGRAM_COMMIT:-unknown}"; nvidia-smi; nvidia-smi topo -m; uname -r
    cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag
    cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null; id
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
    python3 -m pip show cuda-bindings cuda-python 2>/dev/null | grep -E '^(Name|Version)'
    python3 -m pip install -q --no-deps --no-build-isolation -e . && echo "installed"
} > "$OUT/env.txt" 2>&1
tail -2 "$OUT/env.txt"

# results_copy NAME: a copy of benchmarks/results/NAME/ under $OUT, printed; a benchmark given
# `--results "$(results_copy NAME)"` rewrites its latest.md there and appends to its
# history.jsonl, and both come back to be copied over benchmarks/results/NAME/ and committed.
results_copy() {
    mkdir -p "$OUT/$1"
    cp "$(dirname "${BASH_SOURCE[0]}")/results/$1/"{latest.md,history.jsonl} "$OUT/$1/" 2>/dev/null
    echo "$OUT/$1"
}

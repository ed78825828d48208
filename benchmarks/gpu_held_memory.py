"""A restart in place on a real GPU, as vLLM's start-up memory check sees it: one process
holds a table slice of DeepSeek-V4.1-Flash's P=8 size (23.6 GiB; the project's cuda backend,
`cuMemCreate`, exported as a POSIX fd as a replica's slice holder keeps it), and a second
process (the restarted engine) reads the device's memory as vLLM's `MemorySnapshot` does
(`torch.cuda.mem_get_info`) and runs vLLM's own `request_memory`, its source taken from the
wheel carried beside this script (`--vllm-utils`: `vllm/v1/worker/utils.py` of vLLM 0.34), at
`gpu_memory_utilization` 0.92: without the held slice declared (what a restart did before) and
with it declared through `engram_held` (`engram_ray.vllm.held_memory.held_load_kwargs`: what
`HeldSliceLoader.get_external_weight_memory` reports).

    bash benchmarks/gpu_env.sh-style: python3 benchmarks/gpu_held_memory.py \\
        --vllm-utils .vllm/utils.py --results "$(results_copy held_memory)"

No vLLM runs on the lent machines (it needs torch 2.14); only its function does.
"""

from __future__ import annotations

import argparse
import ast
import logging
import math
import multiprocessing as mp
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))

from common import add_results_argument, environment, write_results  # noqa: E402

UTILIZATION = 0.92


def request_memory_from(source: str, label: str):
    """vLLM's `request_memory`, compiled from the text of its `vllm/v1/worker/utils.py`
    (annotations dropped: they name vLLM's types; `label` names the source in tracebacks).
    Also used by check_vllm_releases.py on each wheel's copy."""
    fn = next(n for n in ast.parse(source).body
              if isinstance(n, ast.FunctionDef) and n.name == "request_memory")
    fn.returns = None
    for arg in fn.args.args:
        arg.annotation = None
    log = logging.getLogger("request_memory")
    log.info_once = log.info
    space = {"math": math, "logger": log, "format_gib": lambda b: round(b / 2**30, 2)}
    exec(compile(ast.fix_missing_locations(ast.Module([fn], [])), label, "exec"), space)
    return space["request_memory"]


def hold(nbytes: int, ready, stop) -> None:
    """The replica's holder, stood in for by a process that allocates and exports the slice."""
    from engram_ray.tables.backends.cuda import CudaPeerMemory

    memory = CudaPeerMemory(rank=0, size=1, tag="held-memory", handle_type="posix_fd")
    row_bytes = 264
    memory.allocate(0, -(-nbytes // row_bytes), row_bytes)
    fd = memory.holder_fd(0)
    ready.send((memory.allocated_bytes(0), fd >= 0))
    stop.recv()
    memory.close()


def snapshot():
    import torch

    free, total = torch.cuda.mem_get_info()
    return SimpleNamespace(total_memory=total, free_memory=free, device_="cuda:0")


def run(args) -> dict:
    import torch

    from engram_ray.model.layout import load_layout
    from engram_ray.planning.memory import make_plan
    from engram_ray.vllm.held_memory import HELD_BYTES_KEY, held_load_kwargs

    request_memory = request_memory_from(args.vllm_utils.read_text(), str(args.vllm_utils))
    cache = SimpleNamespace(gpu_memory_utilization=UTILIZATION,
                            resolved_gpu_memory_utilization=UTILIZATION,
                            enable_extensible_kv_cache=False)
    slice_bytes = make_plan(load_layout("deepseek-v4.1-flash"), "peer", peer_group_size=8
                            ).hbm_bytes_per_gpu
    torch.cuda.init()
    first_snapshot = snapshot()
    first = request_memory(first_snapshot, cache, 0)
    ctx = mp.get_context("spawn")
    (ready_here, ready_there), (stop_here, stop_there) = ctx.Pipe(), ctx.Pipe()
    holder = ctx.Process(target=hold, args=(slice_bytes, ready_there, stop_there))
    holder.start()
    held_bytes, exported = ready_here.recv()
    try:
        restart_snapshot = snapshot()
        try:
            request_memory(restart_snapshot, cache, 0)
            before = "passed"
        except ValueError as exc:
            before = f"ValueError: {str(exc)[:160]}"
        declared = held_load_kwargs({"load_format": "auto"}, held_bytes)
        declared_bytes = declared["model_loader_extra_config"][HELD_BYTES_KEY]
        after = request_memory(restart_snapshot, cache, declared_bytes)
    finally:
        stop_here.send(True)
        holder.join(60)
    gib = lambda b: round(b / 2**30, 2)  # noqa: E731
    return {**environment(gpu=True), "utilization": UTILIZATION,
            "slice_gib": gib(slice_bytes), "held_gib": gib(held_bytes), "exported": exported,
            "total_gib": gib(first_snapshot.total_memory),
            "free_first_gib": gib(first_snapshot.free_memory),
            "free_at_restart_gib": gib(restart_snapshot.free_memory),
            "seen_held_gib": gib(first_snapshot.free_memory - restart_snapshot.free_memory),
            "first_budget_gib": gib(first), "restart_undeclared": before,
            "restart_declared_budget_gib": gib(after),
            "budget_less_held_equal": after == first - held_bytes}


def markdown(r: dict) -> str:
    return "\n".join([
        f"# A restart in place against vLLM 0.34's own memory check ({r['date']}, commit "
        f"{r['commit']})", "",
        f"Device: {r['device']}. One process holds a slice of {r['held_gib']} GiB (Flash, P=8: "
        f"{r['slice_gib']} GiB, rounded up to the allocation granule; cuMemCreate, exported as "
        f"a POSIX fd: {r['exported']}); another reads the device as vLLM does and runs vLLM "
        f"0.34's `request_memory` (source from the wheel) at gpu_memory_utilization "
        f"{r['utilization']}.", "",
        "| | GiB |", "| --- | --- |",
        f"| total | {r['total_gib']} |",
        f"| free at the first start | {r['free_first_gib']} |",
        f"| free at the restart (slice held) | {r['free_at_restart_gib']} |",
        f"| seen held (difference) | {r['seen_held_gib']} |",
        f"| budget at the first start | {r['first_budget_gib']} |",
        f"| budget at the restart, slice declared (`engram_held`) | "
        f"{r['restart_declared_budget_gib']} |", "",
        f"Restart without the slice declared: {r['restart_undeclared']}.",
        f"Declared budget = first budget less the held bytes: {r['budget_less_held_equal']} "
        "(the KV cache as at the first start: the slice was among the first start's "
        "allocations and is not allocated again).", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-utils", type=Path, required=True,
                        help="vllm/v1/worker/utils.py of the vLLM release to check")
    add_results_argument(parser, "held_memory")
    args = parser.parse_args()
    result = run(args)
    write_results(args.results, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

"""Timing and tables the lookup benchmarks share (bench_lookup, bench_model_lookup, bench_peer*).

Times are device events per launch with L2 flushed before each launch and the GPU held back by
a sleep kernel, so launches queue up and Python launch overhead stays out of the numbers.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from engram_ray.kernels import lookup as kernel
from engram_ray.kernels.lookup_tuning import num_id_sets  # noqa: F401 (the benchmarks' import)
from engram_ray.model.reference import random_table
from engram_ray.tables.backends.host_memory import allocate_host_table

HEAD_DIM, ROW_BYTES, NUM_COLS = 256, 264, 24
GIB = 1 << 30
_FLUSH: list[torch.Tensor] = []
WALL_MIN_REPS, WALL_MAX_REPS = 30, 400  # eager and graph samples per callable


def _flush_buffer() -> torch.Tensor:
    """128 MiB written before each timed launch: more than the H200's 60 MB L2."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(128 << 20, dtype=torch.uint8, device="cuda:0"))
    return _FLUSH[0]


def time_launches(fn, *, budget_s: float, min_reps: int = 10, max_reps: int = 200,
                  warmup: int = 3, wall: bool = False) -> list[float]:
    """Milliseconds of each call `fn(i)` (i rotates inputs). `wall=True` (work that starts on
    the CPU) synchronizes and reads the host clock around each call instead of events."""
    flush = _flush_buffer()
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(0)
    torch.cuda.synchronize()
    estimate = time.perf_counter() - start
    reps = int(max(min_reps, min(max_reps, budget_s / max(estimate, 1e-6))))
    if wall:
        times = []
        for i in range(reps):
            flush.zero_()
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn(i)
            torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - start))
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    torch.cuda._sleep(int(min(reps * 2e-4, 0.5) * 2e9))  # ~200 us of enqueueing per launch
    for i, (begin, end) in enumerate(events):
        flush.zero_()
        begin.record()
        fn(i)
        end.record()
    torch.cuda.synchronize()
    return [begin.elapsed_time(end) for begin, end in events]


def host_us(fns: dict, id_sets: list, out, *, warm_passes: int = 1, rounds: int = 10,
            calls: int = 50) -> dict:
    """Host us per call of each callable `fn(ids, out)`: `calls` back-to-back calls while a
    sleep kernel holds the GPU (rounds where it ended first: "rounds_not_held"), after one
    untimed call (the first after a sync pays the thread's wake-up: "first_call"; serving
    launches back to back). Best of `rounds`, the callables taking turns; medians of the
    rounds under "median". Every id set is met `warm_passes` times first (compiled, prepared,
    graphs captured)."""
    for fn in fns.values():
        for _ in range(warm_passes):
            for ids in id_sets[:calls]:
                fn(ids, out)
    torch.cuda.synchronize()
    samples, first = {name: [] for name in fns}, {name: [] for name in fns}
    not_held, slept = 0, torch.cuda.Event()
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda._sleep(int(2e9 * 0.05))  # ~50 ms: 3x the slowest round's host time
            slept.record()
            start = time.perf_counter()
            fn(id_sets[-1], out)
            first[name].append((time.perf_counter() - start) * 1e6)
            start = time.perf_counter()
            for i in range(calls):
                fn(id_sets[i % len(id_sets)], out)
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
            not_held += slept.query()
            torch.cuda.synchronize()
    found = {name: min(us) for name, us in samples.items()}
    found["median"] = {name: statistics.median(us) for name, us in samples.items()}
    found["first_call"] = {name: statistics.median(us) for name, us in first.items()}
    found["rounds_not_held"] = int(not_held)
    return found


def interleaved_wall(calls: dict, budget_s: float) -> dict:
    """{name: stats + p10/p90} of host-clock times (sync, call, sync; L2 flushed before),
    the callables taking turns sample by sample. `calls[name](j)` reads id set j (mod the
    number of sets)."""
    flush = _flush_buffer()
    for fn in calls.values():
        for i in range(3):
            fn(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for fn in calls.values():
        fn(0)
    torch.cuda.synchronize()
    per_turn = time.perf_counter() - start
    reps = int(max(WALL_MIN_REPS, min(WALL_MAX_REPS, budget_s * len(calls) / per_turn)))
    names = list(calls)
    samples = {name: [] for name in names}
    for i in range(reps):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            flush.zero_()
            torch.cuda.synchronize()
            begin = time.perf_counter()
            # each callable its own id set: a set comes round again only after as many
            # calls as there are sets (no callable reads rows, or host page translations,
            # another has just warmed)
            calls[name](i * len(names) + k)
            torch.cuda.synchronize()
            samples[name].append(1e3 * (time.perf_counter() - begin))
    return {name: spread(times) for name, times in samples.items()}


def capture(fn, id_sets, out) -> list:
    """One CUDA graph per id set (a graph's ids are fixed), warmed up on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for hashes in id_sets[:2]:
            fn(hashes, out)
    torch.cuda.current_stream().wait_stream(stream)
    graphs = []
    for hashes in id_sets:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(hashes, out)
        graphs.append(graph)
    torch.cuda.synchronize()
    return graphs


@contextlib.contextmanager
def launch_config(placement: str, config: kernel.TileConfig):
    """Lookups of `placement` with `config.block_rows` rows use `config` inside the block."""
    saved = kernel.TILE_CONFIGS[placement]
    kernel.TILE_CONFIGS[placement] = {**saved, config.block_rows: config}
    try:
        yield config
    finally:
        kernel.TILE_CONFIGS[placement] = saved


def stats(times: list[float]) -> dict:
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"median_ms": ordered[len(ordered) // 2], "p99_ms": p99, "reps": len(times)}


def spread(times: list[float]) -> dict:
    """stats() with the 10th and 90th percentiles."""
    ordered = sorted(times)
    found = stats(times)
    found.update(p10_ms=ordered[len(ordered) // 10], p90_ms=ordered[(9 * len(ordered)) // 10])
    return found


def copy_ceilings() -> dict:
    """GB/s of a device-to-device copy (read + write), a pinned host-to-device copy and a
    peer-to-device copy (GPU 1 to GPU 0, bytes read), each 1-2 GiB."""
    src = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    src.random_()
    found = {"d2d_GBps": 2 * src.numel() / stats(time_launches(
        lambda i: dst.copy_(src), budget_s=1.0))["median_ms"] / 1e6}
    host = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    found["h2d_GBps"] = GIB / stats(time_launches(
        lambda i: dst[:GIB].copy_(host, non_blocking=True), budget_s=1.0))["median_ms"] / 1e6
    if torch.cuda.device_count() > 1:
        kernel.enable_peer_access(0, 1)
        remote = torch.empty(GIB, dtype=torch.uint8, device="cuda:1")
        found["p2p_GBps"] = GIB / stats(time_launches(
            lambda i: dst[:GIB].copy_(remote, non_blocking=True), budget_s=1.0))[
            "median_ms"] / 1e6
    return found


def fill_random(table: torch.Tensor, seed: int, chunk_rows: int = 1 << 22) -> None:
    generator = torch.Generator(device="cuda:0").manual_seed(seed)
    for start in range(0, table.shape[0], chunk_rows):
        rows = min(chunk_rows, table.shape[0] - start)
        table[start:start + rows].copy_(random_table(rows, HEAD_DIM, generator=generator,
                                                     device="cuda:0"))


class Table:
    """One benchmarked table: `lookup(ids, **options)` reads it by its placement."""

    def __init__(self, placement: str, gib: int):
        self.placement = placement
        rows = gib * GIB // ROW_BYTES
        if placement == "hbm":
            self.parts = [torch.empty(rows, ROW_BYTES, dtype=torch.uint8, device="cuda:0")]
        elif placement in ("host", "host_thp"):
            memory = allocate_host_table(rows * ROW_BYTES, use_thp=placement == "host_thp")
            self.parts = [memory.view(rows, ROW_BYTES)]
        else:  # peer: one slice here, one on GPU 1, read through NVLink
            kernel.enable_peer_access(0, 1)
            self.parts = [torch.empty(rows, ROW_BYTES, dtype=torch.uint8, device=device)
                          for device in ("cuda:0", "cuda:1")]
            self.bases = torch.tensor([part.data_ptr() for part in self.parts], device="cuda:0")
        for seed, part in enumerate(self.parts):
            fill_random(part, seed)
        self.rows_per_rank = rows
        self.num_rows = rows * len(self.parts)
        torch.cuda.synchronize()

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def lookup(self, ids: torch.Tensor, **options) -> torch.Tensor:
        if self.placement == "peer":
            return kernel.engram_lookup(ids, head_dim=HEAD_DIM, peer_bases=self.bases,
                                        rows_per_rank=self.rows_per_rank, **options)
        return kernel.engram_lookup(ids, head_dim=HEAD_DIM, table=self.parts[0], **options)

    def id_sets(self, num_tokens: int, seed: int) -> list[torch.Tensor]:
        """Uniform random ids over the whole table: `num_id_sets` sets to rotate over, so that
        launch after launch reads rows no recent launch read (a host table's address
        translations stay warm for the next launch over the same rows: 4x faster at 4K rows)."""
        generator = torch.Generator(device="cuda:0").manual_seed(seed)
        return [torch.randint(0, self.num_rows, (num_tokens, NUM_COLS), generator=generator,
                              device="cuda:0")
                for _ in range(num_id_sets(num_tokens * NUM_COLS))]

"""Where the patch path's last 1-2% behind vLLM 0.33's sorted launch from pinned host memory
goes (#17), and whether three untried levers close it. A study: one run on one H200, its
findings go to docs/lookup_experiments.md, the script retires once they are recorded.

Pinned host table of DeepSeek-V4.1-Flash rows (8 GiB, small pages), int32 hashes as one
layer's column slice of `[T, 2, 24]` (what the model hands the lookup), uniform random ids,
GPU time (device events, launches queued behind a sleep kernel, L2 flushed), rounds taking
turns. Every variant's output is checked bitwise against vLLM's sorted launch.

1. Split the whole lookups into ordering and gather: vLLM's gather on ids it sorted before
   timing, ours on ids ordered by block (and by row) before timing; the ordering alone
   (counting sort: count, + scan, + scatter; torch.sort as vLLM does it).
2. Cheaper ordering: int32 output positions (vLLM's; half the scatter's writes and the
   gather's position reads), coarser blocks (shift + 2 / + 4: 4x / 16x fewer counters).
3. The L2 fetch granularity (`cudaLimitMaxL2FetchGranularity`, a per-process hint, the
   driver's default and 32 / 128 bytes): untested for host reads so far.
Also records the machine's NUMA nodes and the GPU's PCIe link and host-to-device copy rate.

4. Lookup density (`--host-gib 8 32 --main-only`): the same lookups over a 4x larger table.
   vLLM's scales of 4 rows share a 32-byte sector (16 a 128-byte line), so the more of a
   table's rows one lookup reads, the more of its scale reads are shared; packed rows share
   only a boundary sector with a looked-up neighbour. If that is the gap, it shrinks on the
   larger table (real DeepSeek-V4.1-Flash tables are 94 GiB each, 11.7x the benchmark's).

5. Tile rows against lookup density (`--tile-sweep`): the policy's 16- and 128-row sorted
   launches on the same ordered ids, 65K-1M rows, on each table (packed output).

Usage: python benchmarks/host_gap_study.py --json R.json [--budget-s 0.25]
       [--host-gib 8 [32]] [--main-only | --tile-sweep] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from engram_ray.kernels.lookup_kernel import _engram_lookup_kernel  # noqa: E402
from engram_ray.kernels.lookup_launch import _PARAMS, _RUNTIME_ARGS, LookupLauncher  # noqa: E402
from engram_ray.kernels.lookup_order import FUSE_AT, block_shift, order_by_blocks  # noqa: E402
from engram_ray.kernels.lookup_order_kernel import _count_blocks, _scan_blocks  # noqa: E402
from engram_ray.tables.backends.host_memory import allocate_host_table  # noqa: E402
from engram_ray.tables.lookup import TableLookup  # noqa: E402

import vllm_engram_ref  # noqa: E402
from bench_model_lookup import DTYPE, WIDTH, avoid_zero_scales  # noqa: E402
from common import environment  # noqa: E402
from lookup_timing import (GIB, HEAD_DIM, NUM_COLS, ROW_BYTES, fill_random,  # noqa: E402
                           stats, time_launches)

TOKENS = (10923, 43691, 65536)  # 262K, 1M, 1.57M rows
SWEEP_TOKENS = (2731, 10923, 21846, 43691)  # 65K, 262K, 524K, 1M rows
NUM_SETS = 4
FETCH = (None, 32, 128)  # None: the driver's default
MAIN = ("vllm_sorted", "patch", "vllm gather (presorted)", "ours gather (blocks)")


def l2_fetch(value: int | None = None) -> int:
    """Set (value given) and read back this process's L2 fetch granularity on GPU 0."""
    from cuda.bindings import runtime as cudart
    limit = cudart.cudaLimit.cudaLimitMaxL2FetchGranularity
    if value is not None:
        (err,) = cudart.cudaDeviceSetLimit(limit, value)
        if err != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaDeviceSetLimit(MaxL2FetchGranularity, {value}): {err}")
    err, found = cudart.cudaDeviceGetLimit(limit)
    return int(found)


def machine_notes() -> dict:
    def shell(cmd):
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
    return {"numa_nodes": shell("cat /sys/devices/system/node/online"),
            "pci_numa_nodes": shell("cat /sys/bus/pci/devices/*/numa_node | sort | uniq -c"),
            "pcie": shell("nvidia-smi --query-gpu=pcie.link.gen.current,pcie.link.gen.max,"
                          "pcie.link.width.current --format=csv,noheader"),
            "lscpu_numa": shell("lscpu | grep -i numa")}


def h2d_GBps() -> float:
    host = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(GIB, dtype=torch.uint8, device="cuda:0")
    return GIB / stats(time_launches(lambda i: dst.copy_(host, non_blocking=True),
                                     budget_s=1.0))["median_ms"] / 1e6


class Study:
    def __init__(self, host_gib: int):
        rows = host_gib * GIB // ROW_BYTES
        packed = torch.empty(rows, ROW_BYTES, dtype=torch.uint8, device="cuda:0")
        fill_random(packed, seed=1)
        avoid_zero_scales(packed)
        self.table = allocate_host_table(packed.numel()).view(-1, ROW_BYTES)
        self.table.copy_(packed)
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.vllm = vllm_engram_ref.VllmTable(vllm_engram_ref.load_kernel(), [packed], HEAD_DIM,
                                              "host", num_sms)
        del packed
        torch.cuda.empty_cache()
        self.rows = rows
        self.patch = TableLookup(HEAD_DIM, table=self.table)
        self.launcher = LookupLauncher(head_dim=HEAD_DIM, table=self.table, fuse_graphs=False)
        self.by_tiles = {rows: LookupLauncher(head_dim=HEAD_DIM, table=self.table,
                                              fuse_graphs=False, block_rows=rows)
                         for rows in (16, 128)}
        self.shift, self.num_blocks = block_shift(rows)
        self._launches = {}

    def id_sets(self, tokens: int) -> list[torch.Tensor]:
        gen = torch.Generator(device="cuda:0").manual_seed(tokens)
        sets = [torch.randint(0, self.rows, (tokens, 2, NUM_COLS), generator=gen,
                              device="cuda:0", dtype=torch.int32) for _ in range(NUM_SETS)]
        return [s[:, 1] for s in sets]

    def order(self, hashes: torch.Tensor, shift: int | None = None, dst32: bool = False):
        """(ids, positions) ordered by block (`shift` None: the committed one)."""
        shift = self.shift if shift is None else shift
        num_blocks = -(-self.rows // (1 << shift))
        n = hashes.numel()
        values = torch.empty(n, dtype=hashes.dtype, device="cuda:0")
        indices = torch.empty(n, dtype=torch.int32 if dst32 else torch.int64, device="cuda:0")
        counts = torch.zeros(num_blocks, dtype=torch.int32, device="cuda:0")
        order_by_blocks(hashes, values, indices, counts, torch.empty_like(counts), shift,
                        num_blocks)
        return values, indices

    def gather(self, ids, dst, out, launcher=None) -> None:
        """A sorted kernel launch (`launcher`'s; default: the policy's, as the patch launches
        it) on ordered ids."""
        launcher = launcher or self.launcher
        num_rows = ids.numel()
        launch = self._launch(launcher, out, num_rows)
        names = list(_PARAMS)[_RUNTIME_ARGS:]
        num_programs = min(-(-num_rows // launch.block_rows), launch.max_programs)
        _engram_lookup_kernel[(num_programs,)](
            launcher.src, ids, dst, out, num_rows, launcher.rows_per_rank,
            num_programs, 0, **dict(zip(names, launch.constexprs)), num_warps=launch.num_warps)

    def _launch(self, launcher, out, num_rows):
        """The launcher's prepared sorted launch for this output and size (made once)."""
        key = (id(launcher), out.dtype, num_rows)
        if key not in self._launches:
            probe = torch.zeros(num_rows // NUM_COLS, NUM_COLS, dtype=torch.int32,
                                device="cuda:0")
            launcher(probe, out)
            large_min, large_max = launcher._large_rows  # the launcher's entry key
            entry = (large_min <= num_rows < large_max, True, out.dtype, torch.int32, 0,
                     probe.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0)
            self._launches[key] = launcher._launches[entry]
        return self._launches[key]

    def vllm_gather(self, ids, dst, out) -> None:
        """vLLM 0.33's sorted launch on ids sorted before (its kernel, its grid)."""
        kernel, rows = self.vllm.kernel, ids.numel()
        grid = min(-(-rows // 16), self.vllm.num_sms)
        kernel[(grid,)](self.vllm.weight, self.vllm.scales, ids, dst, out, 0, self.vllm.num_rows,
                        rows, 0, 0, HEAD_START=0, LOCAL_HEADS=NUM_COLS, TOTAL_HEADS=NUM_COLS,
                        DIM=HEAD_DIM, QUANT_BLOCK=32, BLOCK_R=16, GRID=grid, SORTED=True,
                        PACKED=out.dtype == torch.uint8, OUT_STRIDE=out.stride(0), PEER_ROWS=0)

    def ordering_parts(self, hashes):
        """Callables timing the counting sort's kernels cumulatively, and torch.sort."""
        import triton
        n, num_blocks = hashes.numel(), self.num_blocks
        counts = torch.zeros(num_blocks, dtype=torch.int32, device="cuda:0")
        starts = torch.empty_like(counts)
        values = torch.empty(n, dtype=hashes.dtype, device="cuda:0")
        indices = torch.empty(n, dtype=torch.int64, device="cuda:0")
        shape = dict(SHIFT=self.shift, NUM_BLOCKS=num_blocks, PAD=torch.iinfo(hashes.dtype).max,
                     IDS_COLS=hashes.shape[1], BLOCK=1024)
        grid = (-(-n // 1024),)

        def count(h):
            _count_blocks[grid](h, counts, n, h.stride(0), **shape, num_warps=4)

        def count_scan(h):  # the scan zeroes the counts again
            count(h)
            _scan_blocks[(1,)](counts, starts, NUM_SLOTS=triton.next_power_of_2(num_blocks),
                               NUM_BLOCKS=num_blocks, num_warps=16)

        def full(h):
            order_by_blocks(h, values, indices, counts, starts, self.shift, num_blocks)

        def torch_sort(h):
            h.reshape(-1).sort()

        return {"count": count, "count+scan": count_scan, "count+scan+scatter": full,
                "torch.sort (vLLM's)": torch_sort}


def timed_rounds(fns: dict, budget_s: float, num_rounds: int) -> dict:
    """{name: median of the round medians, and the rounds}, callables taking turns."""
    rounds = {name: [] for name in fns}
    for _ in range(num_rounds):
        for name, fn in fns.items():
            rounds[name].append(stats(time_launches(fn, budget_s=budget_s))["median_ms"])
    return {name: {"ms": statistics.median(r), "rounds": r} for name, r in rounds.items()}


def check_equal(fns: dict, out: torch.Tensor) -> dict:
    """Each callable's output on id set 0 against the first's (output poisoned before each)."""
    reference, equal = None, {}
    for name, fn in fns.items():
        out.view(torch.uint8).fill_(0xA5)
        fn(0)
        torch.cuda.synchronize()
        if reference is None:
            reference = out.view(torch.uint8).clone()
        equal[name] = bool(torch.equal(reference, out.view(torch.uint8)))
    return equal


def run(args) -> dict:
    torch.cuda.set_device(0)
    found = {**environment(gpu=True), "machine": machine_notes(), "h2d_GBps": h2d_GBps(),
             "l2_fetch_default": l2_fetch(), "cases": [], "ordering": [], "fetch": []}
    print(json.dumps({k: found[k] for k in ("machine", "h2d_GBps", "l2_fetch_default")}),
          flush=True)
    for gib in args.host_gib:
        study = Study(gib)
        run_table(study, gib, args, found)
        del study
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()  # pinned tables freed
    return found


def tile_sweep(study: Study, gib: int, args, found: dict) -> None:
    """vLLM's sorted launch, the patch path (the policy) and the 16- and 128-row launches on
    ids ordered before, packed output."""
    for tokens in SWEEP_TOKENS:
        sets = study.id_sets(tokens)
        blocks = [study.order(h) for h in sets]
        out = torch.empty(tokens, NUM_COLS, ROW_BYTES, dtype=torch.uint8, device="cuda:0")
        fns = {"vllm_sorted": lambda i: study.vllm.lookup(sets[i % NUM_SETS], out, sort=True),
               "patch": lambda i: study.patch(sets[i % NUM_SETS], out)}
        for rows, launcher in study.by_tiles.items():
            fns[f"ours gather ({rows}-row tiles)"] = (
                lambda i, launcher=launcher: study.gather(*blocks[i % NUM_SETS], out, launcher))
        equal = check_equal(fns, out)
        for _ in range(FUSE_AT + 1):
            for i in range(NUM_SETS):
                fns["patch"](i)
        found["cases"].append({"table_gib": gib, "rows": tokens * NUM_COLS, "out": "packed",
                               "bitwise": equal, "share_pct": 100 * tokens * NUM_COLS / study.rows,
                               **timed_rounds(fns, args.budget_s, args.rounds)})
        print(json.dumps(found["cases"][-1]), flush=True)


def run_table(study: Study, gib: int, args, found: dict) -> None:
    if args.tile_sweep:
        return tile_sweep(study, gib, args, found)
    default_fetch = found["l2_fetch_default"]
    for tokens in TOKENS[1:] if args.main_only else TOKENS:
        sets = study.id_sets(tokens)
        num_rows = tokens * NUM_COLS
        presorted = [(v, d.int()) for v, d in (h.reshape(-1).sort() for h in sets)]
        by_row = [(v, d.long()) for v, d in presorted]
        blocks = [study.order(h) for h in sets]
        blocks32 = [study.order(h, dst32=True) for h in sets]
        coarse = {k: [study.order(h, study.shift + k) for h in sets] for k in (2, 4)}
        if not args.main_only:
            parts = study.ordering_parts(sets[0])
            found["ordering"].append({"table_gib": gib, "rows": num_rows, **timed_rounds(
                {name: (lambda i, f=f: f(sets[i % NUM_SETS])) for name, f in parts.items()},
                args.budget_s, args.rounds)})
            print(json.dumps(found["ordering"][-1]), flush=True)
        for out_kind in ("packed", "bf16"):
            out = torch.empty(tokens, NUM_COLS, WIDTH[out_kind], dtype=DTYPE[out_kind],
                              device="cuda:0")

            def on(pairs, fn, out=out):
                return lambda i: fn(*pairs[i % NUM_SETS], out)

            fns = {
                "vllm_sorted": lambda i, out=out: study.vllm.lookup(sets[i % NUM_SETS], out,
                                                                    sort=True),
                "patch": lambda i, out=out: study.patch(sets[i % NUM_SETS], out),
                "vllm gather (presorted)": on(presorted, study.vllm_gather),
                "ours gather (blocks)": on(blocks, study.gather),
                "ours gather (by row)": on(by_row, study.gather),
                "ours gather (blocks, int32 dst)": on(blocks32, study.gather),
                "ours gather (blocks x4)": on(coarse[2], study.gather),
                "ours gather (blocks x16)": on(coarse[4], study.gather),
            }
            if args.main_only:
                fns = {k: fns[k] for k in MAIN}
            equal = check_equal(fns, out)
            for _ in range(FUSE_AT + 1):  # the patch's fused graphs captured before timing
                for i in range(NUM_SETS):
                    fns["patch"](i)
            found["cases"].append({"table_gib": gib, "rows": num_rows, "out": out_kind,
                                   "bitwise": equal,
                                   **timed_rounds(fns, args.budget_s, args.rounds)})
            print(json.dumps(found["cases"][-1]), flush=True)
            if tokens == TOKENS[0] or args.main_only:
                continue
            subset = {k: fns[k] for k in MAIN}
            for value in FETCH:
                applied = l2_fetch(default_fetch if value is None else value)
                found["fetch"].append({"table_gib": gib, "rows": num_rows, "out": out_kind,
                                       "requested": value, "applied": applied,
                                       **timed_rounds(subset, args.budget_s, args.rounds)})
                print(json.dumps(found["fetch"][-1]), flush=True)
            l2_fetch(default_fetch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--host-gib", type=int, nargs="+", default=[8])
    parser.add_argument("--budget-s", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--main-only", action="store_true",
                        help="1M and 1.57M rows, the four callables of MAIN, no fetch sweep")
    parser.add_argument("--tile-sweep", action="store_true",
                        help="16- against 128-row tiles, 65K-1M rows, packed")
    args = parser.parse_args()
    result = run(args)
    Path(args.json).write_text(json.dumps(result, indent=1))
    for case in result["cases"]:
        base = case["vllm_sorted"]["ms"]
        print(case.get("table_gib", 8), "GiB", case["rows"], case["out"], " ".join(
            f"{name}={v['ms']:.3f}({base / v['ms']:.3f}x)" for name, v in case.items()
            if isinstance(v, dict) and "ms" in v), "bitwise", all(case["bitwise"].values()))
    for row in result["fetch"]:
        print("fetch", row["rows"], row["out"], row["requested"], row["applied"], " ".join(
            f"{name}={v['ms']:.3f}" for name, v in row.items()
            if isinstance(v, dict) and "ms" in v))


if __name__ == "__main__":
    main()

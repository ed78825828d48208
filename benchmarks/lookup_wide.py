"""16-byte loads of 264-byte rows (`TileConfig.wide_loads`) against the committed launches.

A 264-byte row starts 8-byte aligned, so the committed kernel reads it with 8-byte loads (33
per row; HBM packed: cut at its first sector). With `wide_loads` each row is read by 16-byte
loads from the 16-byte boundary at or 8 bytes before it (16 + 1-2 per row) and written from the
registers it was loaded into (16-byte stores where the output row's alignment allows). Random
264-byte reads alone were 12% faster as 16-byte loads of 272-byte strides than as 8-byte loads
(`results/lookup_limits_h200.md`); this measures what that gives whole lookups.
- `sweep`: a `--gib` HBM table (default 16), 1M and 1.57M rows (262K with `--small`), both
  outputs: the committed 16- and 128-row launches, then 16-byte-load launches over tile rows x
  programs per SM x warps x prefetch;
- `host`: the committed host / THP launches with and without 16-byte loads at 1.57M rows;
- `--ncu`: only one lookup per output and kind of launch, for Nsight Compute (DRAM bytes).
Outputs are checked equal to the committed launch's; rounds interleaved (lookup_pipeline's
timing). Rates: rows x (264 read + output written) / median, % of the measured device copy.
Usage: python benchmarks/lookup_wide.py --json R.json --md R.md [--parts sweep host]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from engram_ray.host_memory import allocate_host_table  # noqa: E402
from engram_ray.kernels import lookup as kernel  # noqa: E402
from lookup_limits import environment, sequential_ceilings  # noqa: E402
from lookup_pipeline import ROWS, SMALL_ROWS, markdown, time_cases  # noqa: E402
from lookup_timing import GIB, ROW_BYTES, fill_random  # noqa: E402

# (block_rows, programs per SM, warps) of the 16-byte-load launches, each with and without
# prefetch. The first sweep (results/lookup_wide_h200x2_5e142af.md: 16 x 4-16, 32 x 2-8, 64 x
# 1-4, 128 x 1-2 per SM) found 16-row tiles on 12 programs per SM fastest; --wide-sweep full
# repeats it, the default looks closer around it.
WIDE_SWEEPS = {
    "full": ([(16, p, w) for p in (4, 8, 12, 16) for w in (2, 4)]
             + [(32, p, 4) for p in (2, 4, 8)] + [(64, p, 4) for p in (1, 2, 4)]
             + [(128, p, 8) for p in (1, 2)]),
    "near": [(16, 8, 4), (16, 12, 4), (16, 16, 4), (16, 12, 2), (32, 6, 4), (32, 6, 8)],
}
NCU_LAUNCH = (16, 12, 4)  # --ncu: the 16-byte-load launch profiled


def sweep_configs(launches, kinds=(1, 2)):
    def cases(out: str) -> list[kernel.TileConfig]:
        configs = [kernel.tile_config("hbm", 16), kernel.tile_config("hbm", 128)]
        for (rows, per_sm, warps), kind in itertools.product(launches, kinds):
            for prefetch in (False, True):
                configs.append(kernel.TileConfig(rows, per_sm, warps, prefetch=prefetch,
                                                 wide_loads=kind))
        return configs
    return cases


def ncu_launches(gib: int) -> None:
    """One 1.57M-row lookup per output with the committed launch and each kind of 16-byte
    loads (NCU_LAUNCH), inside cudaProfilerStart/Stop (compiled before), in that order."""
    from lookup_timing import launch_config
    table = torch.empty(gib * GIB // ROW_BYTES, ROW_BYTES, dtype=torch.uint8, device="cuda:0")
    fill_random(table, 3)
    generator = torch.Generator(device="cuda:0").manual_seed(1)
    ids = torch.randint(0, table.shape[0], (ROWS[-1] // 24, 24), generator=generator,
                        device="cuda:0")
    configs = [kernel.tile_config("hbm", 16)] + [
        kernel.TileConfig(*NCU_LAUNCH, wide_loads=kind) for kind in (1, 2)]

    def launches():
        for out in ("packed", "bf16"):
            for config in configs:
                with launch_config("hbm", config):
                    kernel.engram_lookup(ids, head_dim=256, table=table, out=out)
    launches()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    launches()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def host_cases(placement: str):
    def cases(out: str) -> list[kernel.TileConfig]:
        committed = [kernel.tile_config(placement, rows) for rows in (16, 128)]
        return committed + [replace(c, split_bytes=0, wide_loads=kind)
                            for kind in (1, 2) for c in committed]
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["sweep", "host"],
                        choices=["sweep", "host"])
    parser.add_argument("--gib", type=int, default=16, help="HBM table (GiB)")
    parser.add_argument("--host-gib", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="also 262K-row lookups")
    parser.add_argument("--wide-sweep", choices=sorted(WIDE_SWEEPS), default="near")
    parser.add_argument("--ncu", action="store_true", help="launches for Nsight Compute only")
    parser.add_argument("--budget-s", type=float, default=0.12)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    args = parser.parse_args()
    torch.cuda.set_device(0)
    if args.ncu:
        ncu_launches(8)
        return
    report = {"environment": environment()}
    report["sequential"] = sequential_ceilings(args.budget_s)
    print("sequential", report["sequential"], flush=True)

    def save():
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
        if args.md:
            args.md.write_text(markdown(report, "16-byte loads of Engram rows"))

    if "sweep" in args.parts:
        print(f"filling a {args.gib} GiB HBM table", flush=True)
        table = torch.empty(args.gib * GIB // ROW_BYTES, ROW_BYTES, dtype=torch.uint8,
                            device="cuda:0")
        fill_random(table, 0)
        report["sweep"] = time_cases(table, "hbm", sweep_configs(WIDE_SWEEPS[args.wide_sweep]),
                                     (SMALL_ROWS if args.small else ()) + ROWS, 31,
                                     args.budget_s, {"table_gib": args.gib})
        save()
        del table
        torch.cuda.empty_cache()
    if "host" in args.parts:
        report["host"] = []
        rows = args.host_gib * GIB // ROW_BYTES
        for placement in ("host", "host_thp"):
            memory = allocate_host_table(rows * ROW_BYTES, use_thp=placement == "host_thp")
            memory.view(-1)[:1 << 24].random_()
            report["host"] += time_cases(memory.view(rows, ROW_BYTES), placement,
                                         host_cases(placement), ROWS[-1:], 41, args.budget_s,
                                         {"table_gib": args.host_gib})
            del memory
            save()
    save()


if __name__ == "__main__":
    main()

"""Pipelined Engram lookups: tiles kept in flight through cp.async (`TileConfig.num_stages`).

The committed kernel loads a tile's rows into registers (prefetch: two tiles). With
`num_stages` >= 2 Triton's software pipeline copies each tile's rows into shared memory with
cp.async, `num_stages - 1` tiles ahead, so a program keeps several tiles of reads in flight
without holding them in registers. This sweeps tile rows x programs per SM x stages x cut loads
against the committed launch, outputs checked equal to it, rounds interleaved:
- `sweep`: a `--gib` HBM table (default 16), 1M and 1.57M rows (262K with `--small`), both outputs;
- `sizes`: the committed launch and the fastest pipelined ones of the sweep over HBM tables of
  `--sizes` GiB (views of one table): how the rate depends on the table size (address
  translation), up to the size of a DeepSeek-V4.1-Flash slice per GPU;
- `host`: the committed host / THP launches against pipelined ones at 1.57M rows.
Rates: rows x (264 read + output written) / median, % of the measured device copy.
Usage: python benchmarks/lookup_pipeline.py --json R.json --md R.md [--parts sweep sizes host]
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
from engram_ray.kernels.lookup_policy import split_words  # noqa: E402
from lookup_limits import (environment, lookup_id_sets, moved_bytes,  # noqa: E402
                           sequential_ceilings, timed_launch)
from lookup_timing import GIB, ROW_BYTES, fill_random  # noqa: E402

ROWS = (1048584, 1572864)       # 43691 and 65536 tokens x 24 columns
SMALL_ROWS = (262152,)
ROUNDS = 2
# (block_rows, programs per SM, warps): ~64-1024 rows per SM in flight with 2-6 stages.
PIPELINED = ([(16, p, 4) for p in (4, 8, 12, 16)] + [(32, p, 4) for p in (2, 4, 8)]
             + [(64, p, 4) for p in (1, 2, 4)] + [(128, p, 8) for p in (1, 2)])
STAGES = {16: (2, 3, 4), 32: (2, 3, 4), 64: (2, 3), 128: (2, 3)}


def label(config: kernel.TileConfig, out: str) -> str:
    parts = [f"{config.block_rows}x{config.programs_per_sm}/SM w{config.num_warps}"]
    if config.num_stages:
        parts.append(f"stages {config.num_stages}")
    if config.prefetch:
        parts.append("prefetch")
    if split_words(config, 256, out):
        parts.append(f"cut {config.split_bytes}")
    return " ".join(parts)


def sweep_configs(out: str) -> list[kernel.TileConfig]:
    """The committed 16-row HBM launch first, then every pipelined launch, rows whole and cut
    at a sector (bf16 output too: shared memory may change what cutting costs)."""
    configs = [kernel.tile_config("hbm", 16)]
    for (rows, per_sm, warps), split in itertools.product(PIPELINED, (0, 32)):
        for stages in STAGES[rows]:
            configs.append(kernel.TileConfig(rows, per_sm, warps, num_stages=stages,
                                             split_bytes=split, split_bf16=True))
    return configs


def time_cases(table, placement: str, cases, rows_list, seed: int, budget_s: float,
               extra: dict) -> list[dict]:
    """Every launch of `cases(out)` per size and output, ROUNDS rounds interleaved; each output
    checked equal to the first launch's (the committed one). A launch that fails is recorded,
    not fatal."""
    found = []
    generator = torch.Generator(device="cuda:0").manual_seed(seed)
    for num_rows in rows_list:
        ids = lookup_id_sets(table.shape[0], num_rows, generator)
        for out in ("packed", "bf16"):
            expected = None
            for rnd in range(ROUNDS):
                for config in cases(out):
                    if expected is None:
                        expected = kernel.engram_lookup(ids[0], head_dim=256, table=table,
                                                        out=out, block_rows=config.block_rows)
                    row = {**extra, "placement": placement, "round": rnd, "rows": num_rows,
                           "out": out, "variant": label(config, out),
                           "config": config.__dict__.copy()}
                    try:
                        equal, t = timed_launch(table, placement, config, ids, out, expected,
                                                budget_s)
                    except Exception as exc:  # noqa: BLE001 - a launch Triton cannot build
                        found.append({**row, "error": f"{type(exc).__name__}: {exc}"[:300]})
                        print(json.dumps(found[-1]), flush=True)
                        continue
                    found.append({**row, "equal_to_committed": equal, **t,
                                  "GBps": moved_bytes(num_rows, out) / t["median_ms"] / 1e6})
                    print(json.dumps(found[-1]), flush=True)
    return found


def fastest(rows: list[dict], out: str, num_rows: int, count: int) -> list[kernel.TileConfig]:
    """The `count` fastest pipelined launches (best round) for one output and size."""
    best: dict[str, tuple[float, dict]] = {}
    for r in rows:
        if (r["out"] == out and r["rows"] == num_rows and "error" not in r
                and r["equal_to_committed"] and r["config"]["num_stages"]):
            if r["variant"] not in best or r["median_ms"] < best[r["variant"]][0]:
                best[r["variant"]] = (r["median_ms"], r["config"])
    ranked = sorted(best.values(), key=lambda item: item[0])[:count]
    return [kernel.TileConfig(**config) for _, config in ranked]


def size_cases(sweep: list[dict]):
    committed = kernel.tile_config("hbm", 16)
    chosen = {out: [committed] + fastest(sweep, out, ROWS[-1], 2) for out in ("packed", "bf16")}
    return lambda out: chosen[out]


def host_cases(placement: str):
    def cases(out: str) -> list[kernel.TileConfig]:
        committed = [kernel.tile_config(placement, rows) for rows in (16, 128)]
        found = list(committed)
        for base in committed:
            for stages in (2, 3, 4):
                found.append(replace(base, prefetch=False, num_stages=stages))
        return found
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["sweep", "sizes"],
                        choices=["sweep", "sizes", "host"])
    parser.add_argument("--gib", type=int, default=16, help="HBM table of the sweep (GiB)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64, 94],
                        help="HBM table sizes (GiB) of the sizes part")
    parser.add_argument("--host-gib", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="also 262K-row lookups")
    parser.add_argument("--budget-s", type=float, default=0.12)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    args = parser.parse_args()
    torch.cuda.set_device(0)
    report = {"environment": environment()}
    report["sequential"] = sequential_ceilings(args.budget_s)
    print("sequential", report["sequential"], flush=True)
    rows_list = (SMALL_ROWS if args.small else ()) + ROWS

    def save():
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
        if args.md:
            args.md.write_text(markdown(report))

    if {"sweep", "sizes"} & set(args.parts):
        largest = max([args.gib] + (args.sizes if "sizes" in args.parts else []))
        print(f"filling a {largest} GiB HBM table", flush=True)
        table = torch.empty(largest * GIB // ROW_BYTES, ROW_BYTES, dtype=torch.uint8,
                            device="cuda:0")
        fill_random(table, 0)
        if "sweep" in args.parts:
            report["sweep"] = time_cases(table[:args.gib * GIB // ROW_BYTES], "hbm",
                                         sweep_configs, rows_list, 31, args.budget_s,
                                         {"table_gib": args.gib})
            save()
        if "sizes" in args.parts:
            cases = size_cases(report.get("sweep", []))
            report["sizes"] = []
            for gib in args.sizes:
                report["sizes"] += time_cases(table[:gib * GIB // ROW_BYTES], "hbm", cases,
                                              ROWS[-1:], 37 + gib, args.budget_s,
                                              {"table_gib": gib})
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


def markdown(report: dict) -> str:
    env, copy = report["environment"], report["sequential"]["copy_GBps"]
    lines = [f"# Pipelined Engram lookups ({env['device']})", "",
             f"date {env['date']}, commit `{env['commit']}`, torch {env['torch']}, triton "
             f"{env['triton']}; device events, L2 flushed before each launch; best of "
             f"{ROUNDS} interleaved rounds (median of each); device copy {copy:.0f} GB/s. "
             "GB/s = rows x (264 read + output written) / median; first row of each group = the "
             "committed launch; equal = output identical to it.", ""]
    for part in ("sweep", "sizes", "host"):
        if part not in report:
            continue
        lines += [f"## {part}", "", "| table GiB | place | rows | out | launch | equal | "
                  "median ms | p99 ms | GB/s | % copy |", "|---" * 10 + "|"]
        best: dict[tuple, dict] = {}
        for r in report[part]:
            variant = label(kernel.TileConfig(**r["config"]), r["out"])
            key = (r["table_gib"], r["placement"], r["rows"], r["out"], variant)
            if "error" in r:
                best.setdefault(key, r)
            elif "error" in best.get(key, {"error": 1}) or r["median_ms"] < best[key]["median_ms"]:
                best[key] = r
        for (gib, place, rows, out, variant), r in best.items():
            if "error" in r:
                lines.append(f"| {gib} | {place} | {rows} | {out} | {variant} | error: "
                             f"{r['error'][:80]} | | | | |")
                continue
            # host rows: the device copy is no ceiling for PCIe reads
            percent = "" if place.startswith("host") else f"{100 * r['GBps'] / copy:.1f}%"
            lines.append(f"| {gib} | {place} | {rows} | {out} | {variant} | "
                         f"{r['equal_to_committed']} | {r['median_ms']:.4f} | {r['p99_ms']:.4f} | "
                         f"{r['GBps']:.0f} | {percent} |")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""Engram lookup benchmark: 16-row tiles, 128-row tiles and the tile policy against
`torch.index_select`, for tables in HBM, pinned host memory, huge-page host memory and split
over two GPUs (peer).

DeepSeek-V4.1-Flash rows (264 bytes, 24 columns per token), uniform random ids, tables of
`--hbm-gib` (peer: that much on each GPU) / `--host-gib`. Per launch: device events after
warm-up with L2 flushed, variants taking turns launch by launch, over rotating id sets (no
launch reads the rows of a recent one: cold address translations); `policy_reread` is the
policy reading the rows the launch before it read (warm translations: consecutive steps
asking for the same n-grams); median and p99. Bytes moved = rows x (264 read + output
written: 264 packed, 512 bf16); HBM and peer GB/s are compared with the measured device copy
ceiling (read + write), host tables' bytes read with the measured host-to-device copy ceiling.

With `--tune` (the default) the tile launches and the thresholds are measured first (rules in
engram_ray.kernels.lookup_tuning) and used for the policy rows; they are in the report.
Writes benchmarks/results/lookup/latest.md and a line of its history.jsonl (`--results DIR`).
Usage: python benchmarks/bench_lookup.py [--no-tune] [--sweep S.json] [--results DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from engram_ray.kernels import lookup as kernel  # noqa: E402
from engram_ray.kernels import lookup_tuning  # noqa: E402
from engram_ray.model.reference import dequantize_rows  # noqa: E402
from engram_ray.tables.backends.host_memory import huge_page_bytes  # noqa: E402

from common import add_results_argument, environment, write_results  # noqa: E402
from lookup_timing import (GIB, HEAD_DIM, NUM_COLS, ROW_BYTES, Table, copy_ceilings,  # noqa: E402
                           stats, time_launches)

# ~1K, 4K, 16K, 32K, 64K, 256K, 1M and 1.57M looked-up rows (65536 tokens: vLLM's bar).
TOKENS = [43, 64, 171, 683, 1366, 2731, 10923, 43691, 65536]   # 64: the bar's 1.5K rows
OUT_BYTES = {"packed": ROW_BYTES, "bf16": 2 * HEAD_DIM}


SWEEP_TOKENS = {"hbm": (43691, 2731), "peer": (43691, 2731), "host": (43691,),
                "host_thp": (43691,)}
PROGRAMS_PER_SM = (1, 2, 4, 8, 16)


def sweep(table, budget_s: float) -> list[dict]:
    """Time every (tile rows, programs per SM, prefetch) at the sweep sizes, both outputs
    (host tables: packed, with ids sorted as the large host lookups will be)."""
    placement, found = table.placement, []
    outs = ("packed",) if placement.startswith("host") else ("packed", "bf16")
    for num_tokens in SWEEP_TOKENS[placement]:
        ids = table.id_sets(num_tokens, seed=num_tokens + 1)
        for out, block_rows, per_sm, prefetch in itertools.product(
                outs, (16, 128), PROGRAMS_PER_SM, (False, True)):
            config = kernel.TileConfig(block_rows, per_sm, 4 if block_rows == 16 else 8,
                                       prefetch)

            def run(i, config=config, out=out):
                table.lookup(ids[i % len(ids)], out=out, block_rows=config.block_rows,
                             programs_per_sm=config.programs_per_sm,
                             num_warps=config.num_warps, prefetch=config.prefetch,
                             sort_rows=placement.startswith("host"))
            stat = stats(time_launches(run, budget_s=budget_s, min_reps=5, max_reps=50,
                                       warmup=2))
            found.append({"placement": placement, "rows": ids[0].numel(), "out": out,
                          **config.__dict__, **stat})
            print(json.dumps(found[-1]), flush=True)
    return found


def fixed_variants(placement: str) -> dict:
    variants = {"r16": {"block_rows": 16, "sort_rows": False},
                "r128": {"block_rows": 128, "sort_rows": False}}
    if placement.startswith("host"):
        variants["r16_sorted"] = {"block_rows": 16, "sort_rows": True}
        variants["r128_sorted"] = {"block_rows": 128, "sort_rows": True}
    return variants


def baseline(table, ids_cpu, ids, out):
    """torch.index_select (host tables: on the CPU, then copied to the GPU) [+ dequantize]."""
    if table.placement == "peer":
        owner = ids.view(-1) // table.rows_per_rank
        rows = torch.empty(ids.numel(), ROW_BYTES, dtype=torch.uint8, device="cuda:0")
        for rank, part in enumerate(table.parts):
            picked = (owner == rank).nonzero().squeeze(1)
            local = (ids.view(-1)[picked] - rank * table.rows_per_rank).to(part.device)
            rows[picked] = part.index_select(0, local).to("cuda:0")
    elif table.placement == "hbm":
        rows = table.parts[0].index_select(0, ids.view(-1))
    else:
        rows = table.parts[0].index_select(0, ids_cpu.view(-1)).to("cuda:0", non_blocking=True)
    return rows if out == "packed" else dequantize_rows(rows, HEAD_DIM)


# Variants take turns launch by launch (r16, r128, ..., policy, r16, ...), in ROUNDS runs of
# the timing loop, so that drift between modes (small host lookups are bimodal) falls on every
# variant alike.
ROUNDS = 5


def interleaved_times(variants: dict, lookup, budget_s: float) -> dict[str, list[float]]:
    """Milliseconds per variant: launch i runs variant i % V on id set i (mod the sets: no
    two launches in a row read the same rows); `lookup(i, **options)` launches one lookup."""
    names = list(variants)
    times = {name: [] for name in names}

    def run(i):
        lookup(i, **variants[names[i % len(names)]])
    for _ in range(ROUNDS):
        samples = time_launches(run, budget_s=budget_s * len(names) / ROUNDS,
                                min_reps=4 * len(names), max_reps=40 * len(names),
                                warmup=2 * len(names))
        for i, ms in enumerate(samples[:len(samples) - len(samples) % len(names)]):
            times[names[i % len(names)]].append(ms)
    return times


def measure(table, out, num_tokens, variants, budget_s, with_baseline=False) -> list[dict]:
    ids = table.id_sets(num_tokens, seed=num_tokens)
    def lookup(i, reread=False, **options):
        table.lookup(ids[(i - reread) % len(ids)], out=out, **options)
    times = interleaved_times(variants, lookup, budget_s)
    found = [{"variant": name, **stats(t)} for name, t in times.items()]
    if with_baseline:
        ids_cpu = [part.cpu() for part in ids]
        found.append({"variant": "index_select", **stats(time_launches(
            lambda i: baseline(table, ids_cpu[i % len(ids)], ids[i % len(ids)], out),
            budget_s=budget_s, min_reps=5, max_reps=50,
            wall=table.placement.startswith("host")))})
    for row in found:
        row.update(placement=table.placement, out=out, rows=num_tokens * NUM_COLS)
    return found


def add_rates(row: dict, ceilings: dict) -> dict:
    moved = row["rows"] * (ROW_BYTES + OUT_BYTES[row["out"]])
    row["GBps"] = moved / row["median_ms"] / 1e6
    row["read_GBps"] = row["rows"] * ROW_BYTES / row["median_ms"] / 1e6
    host = row["placement"].startswith("host")
    row["pct_ceiling"] = 100 * (row["read_GBps"] / ceilings["h2d_GBps"] if host
                                else row["GBps"] / ceilings["d2d_GBps"])
    return row


def bench_placement(table, args, ceilings) -> tuple[list[dict], dict]:
    placement = table.placement
    budget = args.budget_s * (1 if placement in ("hbm", "peer") else 2)
    policy = {}
    if args.tune:
        found = sweep(table, budget / 4)
        policy["sweep"] = found
        kernel.TILE_CONFIGS[placement] = lookup_tuning.best_configs(found)
    fixed = []
    if args.tune:  # the policy is measured from the fixed tiles: time it afterwards
        for out in args.outs:
            for num_tokens in args.tokens:
                fixed += measure(table, out, num_tokens, fixed_variants(placement), budget)
        sort_min_rows, window = lookup_tuning.thresholds(fixed, placement)
        kernel.SORT_MIN_ROWS[placement] = sort_min_rows
        kernel.TILE_POLICY[placement] = window
        kernel.LARGE_TILE_MIN_SHARE.pop(placement, None)  # the window measured on this table
    policy.update(tile_configs={str(b): c.__dict__ for b, c in
                                kernel.TILE_CONFIGS[placement].items()},
                  rows_128=kernel.TILE_POLICY[placement],
                  sort_min_rows=kernel.SORT_MIN_ROWS[placement])
    print(placement, {k: v for k, v in policy.items() if k != "sweep"}, flush=True)
    rows = []
    for out in args.outs:
        for num_tokens in args.tokens:
            num_rows = num_tokens * NUM_COLS
            rows += [r for r in fixed if r["out"] == out and r["rows"] == num_rows]
            variants = {"policy": {}} if args.tune else {**fixed_variants(placement),
                                                         "policy": {}}
            variants["policy_reread"] = {"reread": True}  # right after "policy"
            found = measure(table, out, num_tokens, variants, budget, with_baseline=(
                not placement.startswith("host") or num_rows <= args.max_host_baseline_rows))
            for row in found:
                if row["variant"].startswith("policy"):
                    row["block_rows"] = kernel.choose_block_rows(num_rows, ROW_BYTES, placement,
                                                                 table.num_rows)
            rows += found
    for row in rows:
        add_rates(row, ceilings)
        print(f"{placement:8} {row['out']:6} {row['rows']:>8} {row['variant']:13} "
              f"{row['median_ms']:9.4f} ms p99 {row['p99_ms']:9.4f} {row['GBps']:7.0f} GB/s "
              f"{row['pct_ceiling']:4.0f}%", flush=True)
    return rows, policy


def table_environment(tables) -> dict:
    """The run's environment (GPU 0) with the tables' sizes and the THP table's huge pages."""
    env = {**environment(gpu=True),
           "tables_GiB": {t.placement: round(t.nbytes / GIB, 2) for t in tables}}
    for table in tables:
        if table.placement == "host_thp":
            env["thp_huge_page_fraction"] = huge_page_bytes(table.parts[0]) / table.nbytes
    return env


# vLLM 0.33's own kernel on one H200 (the issue's bar), 1.57M rows = 65536 tokens x 24 columns.
VLLM_BAR_MS = {("hbm", "bf16"): 1.52, ("hbm", "packed"): 1.41, ("host", "bf16"): 56.5,
               ("host_thp", "packed"): 53.8}


def targets(report: dict) -> list[str]:
    """Per placement and output: the policy against the better fixed tile (same id order) at
    every size, p99/median, and the largest lookup against the copy ceiling and vLLM's bar."""
    by_key = {(r["placement"], r["out"], r["rows"], r["variant"]): r for r in report["results"]}
    lines = ["## Targets", "", "| placement | out | policy / better fixed tile, worst size | "
             "p99/median >= 1M rows, worst | largest lookup: % ceiling | vs vLLM 0.33 bar |",
             "|---|---|---|---|---|---|"]
    for placement, out in sorted({(r["placement"], r["out"]) for r in report["results"]}):
        sizes = sorted({r["rows"] for r in report["results"]
                        if (r["placement"], r["out"]) == (placement, out)})
        worst, jitter = (0.0, 0), 0.0
        for size in sizes:
            policy = by_key[placement, out, size, "policy"]
            suffix = "_sorted" if size >= report["policy"][placement]["sort_min_rows"] else ""
            fixed = min(by_key[placement, out, size, v + suffix]["median_ms"]
                        for v in ("r16", "r128"))
            worst = max(worst, (policy["median_ms"] / fixed, size))
            if size >= 1 << 20:
                jitter = max(jitter, policy["p99_ms"] / policy["median_ms"])
        largest = by_key[placement, out, sizes[-1], "policy"]
        bar = VLLM_BAR_MS.get((placement, out))
        versus = f"{bar} ms -> {largest['median_ms']:.3f} ms ({bar / largest['median_ms']:.1f}x)" \
            if bar and sizes[-1] == 1572864 else ""
        lines.append(f"| {placement} | {out} | {worst[0]:.3f} (at {worst[1]} rows) | "
                     f"{jitter:.3f} | {largest['pct_ceiling']:.0f}% ({largest['GBps']:.0f} GB/s) "
                     f"| {versus} |")
    return lines + [""]


def markdown(report: dict) -> str:
    env, ceilings = report["environment"], report["ceilings"]
    lines = [f"# Engram lookup benchmark ({env['device']} x{env['num_gpus']})", "",
             f"date {env['date']}, commit `{env['commit']}`, torch {env['torch']}, triton "
             f"{env['triton']}, {env['num_sms']} SMs; tables (GiB): {env['tables_GiB']}; "
             f"THP fraction of the huge-page table: {env.get('thp_huge_page_fraction')}",
             "ceilings (GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()), "",
             "GB/s = rows x (264 read + output written) / median. % = GB/s of the device copy "
             "ceiling (hbm, peer) or, for host tables, read GB/s of the host-to-device copy "
             "ceiling. Policy: " + json.dumps({p: {k: v for k, v in pol.items() if k != "sweep"}
                                               for p, pol in report["policy"].items()}), "",
             *targets(report),
             "## All measurements", "",
             "| placement | out | rows | variant | median ms | p99 ms | p99/med | GB/s | "
             "read GB/s | % ceiling | policy tile |", "|" + "---|" * 11]
    for row in report["results"]:
        lines.append(f"| {row['placement']} | {row['out']} | {row['rows']} | {row['variant']} | "
                     f"{row['median_ms']:.4f} | {row['p99_ms']:.4f} | "
                     f"{row['p99_ms'] / row['median_ms']:.2f} | {row['GBps']:.0f} | "
                     f"{row['read_GBps']:.1f} | {row['pct_ceiling']:.0f}% | "
                     f"{row.get('block_rows', '')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--placements", nargs="+", default=["hbm", "peer", "host", "host_thp"])
    parser.add_argument("--outs", nargs="+", default=["packed", "bf16"])
    parser.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    parser.add_argument("--hbm-gib", type=int, default=16)
    parser.add_argument("--host-gib", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=0.3, help="timing budget per case")
    parser.add_argument("--no-tune", dest="tune", action="store_false",
                        help="use the committed policy instead of measuring it first")
    parser.add_argument("--max-host-baseline-rows", type=int, default=300_000)
    parser.add_argument("--sweep", type=Path, help="write the tuning sweep here, not in the "
                        "history line")
    add_results_argument(parser, "lookup")
    args = parser.parse_args()
    torch.cuda.set_device(0)
    placements = [p for p in args.placements if p != "peer" or torch.cuda.device_count() > 1]
    report = {"ceilings": copy_ceilings(), "results": [], "policy": {}}
    print("ceilings", report["ceilings"], flush=True)
    tables = []
    for placement in placements:
        gib = args.hbm_gib if placement in ("hbm", "peer") else args.host_gib
        tables.append(Table(placement, gib // 2 if placement == "peer" else gib))
    report["environment"] = table_environment(tables)
    print(report["environment"], flush=True)
    for table in tables:
        rows, policy = bench_placement(table, args, report["ceilings"])
        report["results"] += rows
        report["policy"][table.placement] = policy
    if args.sweep:  # else the sweep rows stay in the report
        args.sweep.write_text(json.dumps({p: pol.pop("sweep", []) for p, pol in
                                          report["policy"].items()}, indent=1))
    write_results(args.results, report, markdown(report), env=report["environment"])


if __name__ == "__main__":
    main()

"""Engram lookup benchmark: 16-row tiles, 128-row tiles and the tile policy against
`torch.index_select`, for tables in HBM, pinned host memory and huge-page host memory.

DeepSeek-V4.1-Flash rows (264 bytes, 24 columns per token), uniform random ids, tables of
`--hbm-gib` / `--host-gib`. Times are device events per launch after warm-up, over rotating id
sets (so repeated launches do not hit L2); median and p99. Bytes moved = rows x (264 read +
output bytes written: 264 packed, 512 bf16); HBM GB/s is compared with the measured device copy
ceiling (read + write), host GB/s of bytes read with the measured host-to-device copy ceiling.

Usage: python benchmarks/bench_lookup.py --json R.json --md R.md [--sweep S.json] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from engram_ray.host_memory import allocate_host_table, huge_page_bytes
from engram_ray.kernels import lookup as kernel
from engram_ray.reference import dequantize_rows, random_table

HEAD_DIM, ROW_BYTES, NUM_COLS = 256, 264, 24
GIB = 1 << 30
TOKENS = [43, 171, 683, 2731, 10923, 43691, 65536]  # ~1K, 4K, 16K, 64K, 256K, 1M, 1.57M rows
OUT_BYTES = {"packed": ROW_BYTES, "bf16": 2 * HEAD_DIM}
NUM_ID_SETS = 4


def time_launches(fn, *, budget_s: float, min_reps: int = 10, max_reps: int = 200,
                  warmup: int = 3, wall: bool = False) -> list[float]:
    """Milliseconds of each launch, `fn(i)` rotating over inputs; L2 is flushed before each.

    Device events, with the GPU held back by a sleep kernel so that all launches queue up and
    launch overhead stays out of the numbers; `wall=True` (work that starts on the CPU)
    synchronizes and reads the host clock around each call instead.
    """
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


_FLUSH: list[torch.Tensor] = []


def _flush_buffer() -> torch.Tensor:
    """128 MiB written before each timed launch: more than the 60 MB L2 holds."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    return _FLUSH[0]


def stats(times: list[float]) -> dict:
    ordered = sorted(times)
    median = ordered[len(ordered) // 2]
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"median_ms": median, "p99_ms": p99, "reps": len(times)}


def copy_ceilings(device) -> dict:
    """Device-to-device copy (bytes read + written) and pinned host-to-device copy GB/s."""
    src = torch.empty(2 * GIB, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.random_()
    d2d = stats(time_launches(lambda i: dst.copy_(src), budget_s=1.0))
    host = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    h2d = stats(time_launches(lambda i: dst[:GIB].copy_(host, non_blocking=True), budget_s=1.0))
    return {"d2d_GBps": 2 * src.numel() / d2d["median_ms"] / 1e6,
            "h2d_GBps": GIB / h2d["median_ms"] / 1e6}


def fill_random(table: torch.Tensor, device, seed: int, chunk_rows: int = 1 << 22) -> None:
    generator = torch.Generator(device=device).manual_seed(seed)
    for start in range(0, table.shape[0], chunk_rows):
        rows = min(chunk_rows, table.shape[0] - start)
        table[start:start + rows].copy_(random_table(rows, HEAD_DIM, generator=generator,
                                                     device=device))


def make_tables(args, device) -> dict:
    tables = {}
    if "hbm" in args.placements:
        tables["hbm"] = torch.empty(args.hbm_gib * GIB // ROW_BYTES, ROW_BYTES,
                                    dtype=torch.uint8, device=device)
    for name, use_thp in (("host", False), ("host_thp", True)):
        if name in args.placements:
            rows = args.host_gib * GIB // ROW_BYTES
            tables[name] = allocate_host_table(rows * ROW_BYTES, use_thp=use_thp).view(
                rows, ROW_BYTES)
    for seed, table in enumerate(tables.values()):
        fill_random(table, device, seed)
    torch.cuda.synchronize()
    return tables


def variants(placement: str) -> dict:
    fixed = {"r16": {"block_rows": 16, "sort_rows": False},
             "r128": {"block_rows": 128, "sort_rows": False}, "policy": {}}
    if placement.startswith("host"):
        fixed["policy_sorted"] = {"sort_rows": True}
    return fixed


def baseline(table, ids_cpu, ids, out):
    """torch.index_select (host tables: on the CPU, then copied to the GPU) [+ dequantize]."""
    if table.is_cuda:
        rows = table.index_select(0, ids.view(-1))
    else:
        rows = table.index_select(0, ids_cpu.view(-1)).to(ids.device, non_blocking=True)
    return rows if out == "packed" else dequantize_rows(rows, HEAD_DIM)


def bench_one(table, placement, out, num_tokens, ceilings, args, device) -> list[dict]:
    num_rows = num_tokens * NUM_COLS
    generator = torch.Generator(device=device).manual_seed(num_tokens)
    id_sets = [torch.randint(0, table.shape[0], (num_tokens, NUM_COLS), generator=generator,
                             device=device) for _ in range(NUM_ID_SETS)]
    budget = args.budget_s * (1 if placement == "hbm" else 2)
    results = []
    for name, options in variants(placement).items():
        def run(i, options=options):
            kernel.engram_lookup(id_sets[i % NUM_ID_SETS], head_dim=HEAD_DIM, table=table,
                                 out=out, **options)
        results.append((name, stats(time_launches(run, budget_s=budget))))
    if placement == "hbm" or num_rows <= args.max_host_baseline_rows:
        ids_cpu = [ids.cpu() for ids in id_sets]
        results.append(("index_select", stats(time_launches(
            lambda i: baseline(table, ids_cpu[i % NUM_ID_SETS], id_sets[i % NUM_ID_SETS], out),
            budget_s=budget, min_reps=5, max_reps=50, wall=not table.is_cuda))))
    rows_out = []
    for name, stat in results:
        moved = num_rows * (ROW_BYTES + OUT_BYTES[out])
        read = num_rows * ROW_BYTES
        gbps = moved / stat["median_ms"] / 1e6
        read_gbps = read / stat["median_ms"] / 1e6
        ceiling = ceilings["d2d_GBps"] if placement == "hbm" else ceilings["h2d_GBps"]
        rows_out.append({"placement": placement, "out": out, "rows": num_rows, "variant": name,
                         **stat, "GBps": gbps, "read_GBps": read_gbps,
                         "pct_ceiling": 100 * (gbps if placement == "hbm" else read_gbps)
                         / ceiling,
                         "block_rows": kernel.choose_block_rows(num_rows, ROW_BYTES, placement)
                         if name.startswith("policy") else None})
    return rows_out


def sweep_cases(placement: str):
    """(tokens, out, block_rows, programs_per_sm, num_warps) to try; host cases are slow."""
    if placement == "hbm":
        for num_tokens in (43691, 2731):
            for out in ("packed", "bf16"):
                for block_rows in (16, 32, 64, 128, 256):
                    for per_sm in (1, 2, 4, 8, 16):
                        for warps in (4, 8):
                            if block_rows * 8 // warps <= 256 and (block_rows, warps) != (16, 8):
                                yield num_tokens, out, block_rows, per_sm, warps
        return
    for block_rows in (16, 64, 128, 256):
        for per_sm in (1, 2, 4, 8, 16):
            yield 43691, "packed", block_rows, per_sm, 4 if block_rows < 128 else 8


def sweep(tables, args, device) -> list[dict]:
    """Tile rows x programs per SM x warps per program, per placement."""
    found, id_sets = [], {}
    for placement, table in tables.items():
        for num_tokens, out, block_rows, per_sm, warps in sweep_cases(placement):
            if (placement, num_tokens) not in id_sets:
                id_sets[placement, num_tokens] = [
                    torch.randint(0, table.shape[0], (num_tokens, NUM_COLS), device=device)
                    for _ in range(NUM_ID_SETS)]
            ids = id_sets[placement, num_tokens]

            def run(i):
                kernel.engram_lookup(ids[i % NUM_ID_SETS], head_dim=HEAD_DIM, table=table,
                                     out=out, block_rows=block_rows, programs_per_sm=per_sm,
                                     num_warps=warps, sort_rows=False)
            stat = stats(time_launches(run, budget_s=args.budget_s / 4, min_reps=5,
                                       max_reps=50, warmup=2))
            found.append({"placement": placement, "rows": num_tokens * NUM_COLS, "out": out,
                          "block_rows": block_rows, "programs_per_sm": per_sm,
                          "num_warps": warps, **stat})
            print(json.dumps(found[-1]), flush=True)
    return found


def environment(tables) -> dict:
    commit = os.environ.get("ENGRAM_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True,
        cwd=Path(__file__).parent).stdout.strip()
    props = torch.cuda.get_device_properties(0)
    env = {"device": props.name, "num_sms": props.multi_processor_count,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit or "unknown", "torch": torch.__version__,
           "triton": __import__("triton").__version__,
           "tables_GiB": {name: round(t.nbytes / GIB, 2) for name, t in tables.items()}}
    if "host_thp" in tables:
        env["thp_huge_page_fraction"] = huge_page_bytes(tables["host_thp"]) / tables[
            "host_thp"].nbytes
    return env


def markdown(report: dict) -> str:
    env, ceilings = report["environment"], report["ceilings"]
    lines = [f"# Engram lookup benchmark ({env['device']})", "",
             f"date {env['date']}, commit `{env['commit']}`, torch {env['torch']}, triton "
             f"{env['triton']}, {env['num_sms']} SMs; tables (GiB): {env['tables_GiB']}",
             f"ceilings: device copy {ceilings['d2d_GBps']:.0f} GB/s (read + write), host-to-"
             f"device copy {ceilings['h2d_GBps']:.1f} GB/s", "",
             "GB/s = rows x (264 read + output written) / median; % = of the device copy "
             "ceiling (HBM) or, for host tables, bytes read over the H2D copy ceiling.", "",
             "| placement | out | rows | variant | median ms | p99 ms | p99/med | GB/s | read GB/s "
             "| % ceiling | policy tile |", "|" + "---|" * 11]
    for row in report["results"]:
        lines.append(f"| {row['placement']} | {row['out']} | {row['rows']} | {row['variant']} | "
                     f"{row['median_ms']:.4f} | {row['p99_ms']:.4f} | "
                     f"{row['p99_ms'] / row['median_ms']:.2f} | {row['GBps']:.0f} | "
                     f"{row['read_GBps']:.1f} | {row['pct_ceiling']:.0f}% | "
                     f"{row['block_rows'] or ''} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--placements", nargs="+", default=["hbm", "host", "host_thp"])
    parser.add_argument("--outs", nargs="+", default=["packed", "bf16"])
    parser.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    parser.add_argument("--hbm-gib", type=int, default=16)
    parser.add_argument("--host-gib", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=0.4, help="timing budget per case")
    parser.add_argument("--max-host-baseline-rows", type=int, default=300_000)
    parser.add_argument("--sweep", type=Path, help="also sweep tile shapes; write them here")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--md", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    ceilings = copy_ceilings(device)
    print("ceilings", ceilings, flush=True)
    tables = make_tables(args, device)
    report = {"environment": environment(tables), "ceilings": ceilings, "results": []}
    print(report["environment"], flush=True)
    if args.sweep:
        args.sweep.write_text(json.dumps(sweep(tables, args, device), indent=1))
    for placement, table in tables.items():
        for out in args.outs:
            for num_tokens in args.tokens:
                for row in bench_one(table, placement, out, num_tokens, ceilings, args, device):
                    report["results"].append(row)
                    print(f"{placement:8} {out:6} {row['rows']:>8} {row['variant']:13} "
                          f"{row['median_ms']:9.4f} ms p99 {row['p99_ms']:9.4f} "
                          f"{row['GBps']:7.0f} GB/s {row['pct_ceiling']:4.0f}%", flush=True)
                args.json.write_text(json.dumps(report, indent=1))
    args.md.write_text(markdown(report))


if __name__ == "__main__":
    main()

"""Peer groups of P GPUs on one host at real size: table bytes, KV-cache headroom, lookups.

For each P in `--sizes`, P spawned processes (rank r on GPU r) open the model's tables split
over the group (cuda backend, POSIX FD handles, synthetic rows generated on the GPU). Per rank:
allocated bytes per table against `make_plan(.., "peer", peer_group_size=P)`, device bytes the
tables took (`torch.cuda.mem_get_info` before/after), the KV-cache budget a vLLM-style engine
would get, `0.9 x total - (total - free)` after opening, open and rendezvous seconds; sampled
lookups bit-exact against `expected_rows`. Then two peer copy ceilings: rank 0 alone copying
1 GiB from GPU 1 (`bench_peer.peer_copy_ceiling`), and all ranks at once, rank r pulling 1 GiB
from GPU (r+1) % P (a ring: every GPU sends and receives one copy). Then ALL ranks at once
(a file barrier before each size) look up uniform random ids over the whole table
(1K..1.57M rows: (P-1)/P of them remote), device-event timings with L2 flushed
(`lookup_timing.time_launches`): median and p99, GB/s of remote row bytes per GPU.
Close, then the next P. The markdown compares the KV budget gain between consecutive sizes
with the plan's (23.60 GiB from 4 to 8 for DeepSeek-V4.1-Flash).

Usage: python benchmarks/bench_peer_scale.py --sizes 4,8 [--model deepseek-v4.1-flash |
       --small] [--results DIR]   (default benchmarks/results/peer_scale: latest.md, history.jsonl)
Run it from outside the checkout (cd /tmp) after `pip install -e .` (benchmarks/gpu_peer_scale.sh).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from engram_ray.model.layout import EngramLayout, load_layout  # noqa: E402
from engram_ray.tables.local_group import (expected_rows, file_barrier,  # noqa: E402
                                           random_row_ids, run_group)

from bench_peer import GIB, LOOKUP_ROWS, SMALL, peer_copy_ceiling  # noqa: E402
from common import add_results_argument, environment, write_results  # noqa: E402
from lookup_timing import num_id_sets  # noqa: E402

KV_FRACTION = 0.9          # vLLM's default gpu_memory_utilization
SAMPLE_TOKENS = 16         # tokens of each lookup id set compared bit-exact with the reference


def parse_sizes(text: str, num_gpus: int) -> list[int]:
    """'4,8' -> [4, 8]; each size 2 <= P <= num_gpus, else ValueError saying what to do."""
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--sizes is {text!r}: expected comma-separated integers, e.g. 4,8")
    if not sizes:
        raise ValueError("--sizes is empty: expected comma-separated integers, e.g. 4,8")
    for size in sizes:
        if size < 2:
            raise ValueError(f"--sizes has {size}: a peer group needs at least 2 GPUs")
        if size > num_gpus:
            raise ValueError(f"--sizes has {size} but this machine has {num_gpus} GPU(s) "
                             "(torch.cuda.device_count()): run on a machine with at least "
                             f"{size} GPUs (nvidia-h200-x{8 if size > 4 else 4}) or drop {size}")
    return sizes


def uniform_ids(num_rows: int, table_rows: int, num_cols: int, seed: int, device: str):
    """`[ceil(num_rows / C), C]` uniform random ids over the whole table."""
    import torch
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, table_rows, (math.ceil(num_rows / num_cols), num_cols),
                         generator=gen, device=device)


def member_lookups(rank: int, size: int, table, layout: EngramLayout, barrier_dir: str,
                   budget_s: float) -> list[dict]:
    """All ranks at once (barrier before each size): uniform ids, timed; sampled bit-exact."""
    import torch

    from lookup_timing import stats, time_launches
    device = f"cuda:{rank}"
    rows = []
    for num_rows in LOOKUP_ROWS:
        id_sets = [uniform_ids(num_rows, table.num_rows, layout.num_cols,
                               1000 * rank + 10 * k + size, device)
                   for k in range(num_id_sets(num_rows))]
        sample = id_sets[0][:SAMPLE_TOKENS]
        equal = torch.equal(table.lookup(sample), expected_rows(sample, layout.head_dim))
        file_barrier(barrier_dir, f"lookup-{num_rows}", rank, list(range(size)), 300)
        timing = stats(time_launches(lambda i: table.lookup(id_sets[i % len(id_sets)]),
                                     budget_s=budget_s))
        ids = id_sets[0]
        remote = int((ids // table.rows_per_rank != rank).sum())
        rows.append({"rows": ids.numel(), "remote_rows": remote,
                     "median_ms": timing["median_ms"], "p99_ms": timing["p99_ms"],
                     "reps": timing["reps"],
                     "remote_GBps": remote * layout.row_bytes / timing["median_ms"] / 1e6,
                     "remote_GBps_p99": remote * layout.row_bytes / timing["p99_ms"] / 1e6,
                     "sample_equal": equal})
    return rows


def scale_member(rank: int, size: int, layout: EngramLayout, store_dir: str, budget_s: float,
                 copy_reps: int) -> dict:
    import torch

    from engram_ray.planning.memory import make_plan
    from engram_ray.tables.settings import PeerGroupSettings
    from engram_ray.tables.table import open_group_tables

    ranks, barriers = list(range(size)), store_dir + "-barriers"
    torch.cuda.set_device(rank)
    free_before, total = torch.cuda.mem_get_info()
    start = time.perf_counter()
    settings = PeerGroupSettings(size=size, rank=rank, store_dir=store_dir,
                                 generation=f"scale-{size}", timeout_s=300, backend="cuda")
    tables = open_group_tables(layout, settings, device=f"cuda:{rank}")
    open_s = time.perf_counter() - start
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info()[0]
    plan = make_plan(layout, "peer", peer_group_size=size)
    out = {"rank": rank, "gpu": torch.cuda.get_device_name(rank), "open_s": open_s,
           "stats": tables.stats(), "total_bytes": total,
           "device_bytes_used": free_before - free_after,
           "resident_bytes_before": total - free_before, "resident_bytes": total - free_after,
           "kv_budget_bytes": KV_FRACTION * total - (total - free_after),
           "kv_budget_bytes_before": KV_FRACTION * total - (total - free_before),
           "plan_bytes_by_table": list(plan.hbm_bytes_per_gpu_by_table),
           "plan_bytes": plan.hbm_bytes_per_gpu}
    try:
        # Nothing touches another GPU before every rank has read its own free memory.
        file_barrier(barriers, "measured", rank, ranks, 300)
        out["equal"] = {}
        for idx, layer_id in enumerate(layout.layer_ids):
            ids = random_row_ids(layout.rows_per_table[idx], (64, layout.num_cols),
                                 100 + rank, f"cuda:{rank}")
            out["equal"][str(layer_id)] = all(
                torch.equal(tables.lookup(layer_id, ids, o),
                            expected_rows(ids, layout.head_dim, 0, o)) for o in ("packed", "bf16"))
        if rank == 0:
            out["copy_solo_GBps"] = peer_copy_ceiling(copy_reps, "cuda:1", "cuda:0")
        file_barrier(barriers, "ring", rank, ranks, 300)
        out["copy_ring_GBps"] = peer_copy_ceiling(copy_reps, f"cuda:{(rank + 1) % size}",
                                                  f"cuda:{rank}")
        torch.cuda.empty_cache()
        out["lookups"] = member_lookups(rank, size, tables.tables[layout.layer_ids[0]], layout,
                                        barriers, budget_s)
        # Keep this rank's slices mapped until every rank has finished reading them.
        file_barrier(barriers, "lookups-done", rank, ranks, 300)
    finally:
        tables.close()
    file_barrier(barriers, "closed", rank, ranks, 120)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    out["device_bytes_after_close"] = free_before - torch.cuda.mem_get_info()[0]
    return out


def bench_size(layout: EngramLayout, size: int, budget_s: float, copy_reps: int,
               timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_group(scale_member, list(range(size)),
                            (size, layout, os.path.join(tmp, "store"), budget_s, copy_reps),
                            timeout_s=timeout_s, start_method="spawn")
    bad = [r for r in results if not r.is_ok]
    if bad:
        raise RuntimeError(f"P={size}: rank {bad[0].rank} failed:\n{bad[0].value}")
    members = [r.value for r in results]
    arrivals = [m["stats"]["rendezvous_started_at"] for m in members]
    done = [a + m["stats"]["rendezvous_seconds"] for a, m in zip(arrivals, members)]
    return {"P": size, "members": members, "group_rendezvous_s": max(done) - max(arrivals),
            "slowest_member_rendezvous_s": max(m["stats"]["rendezvous_seconds"]
                                               for m in members)}


def kv_gains(layout: EngramLayout, groups: list[dict]) -> list[dict]:
    """Measured KV budget gain (min over ranks) between consecutive sizes, and the plan's."""
    from engram_ray.planning.memory import make_plan
    gains = []
    for a, b in zip(groups, groups[1:]):
        kv = [min(m["kv_budget_bytes"] for m in g["members"]) for g in (a, b)]
        plans = [make_plan(layout, "peer", peer_group_size=g["P"]) for g in (a, b)]
        gains.append({"from": a["P"], "to": b["P"], "measured_bytes": kv[1] - kv[0],
                      "plan_bytes": plans[1].kv_gain_vs(plans[0])})
    return gains


def scale_markdown(report: dict) -> str:
    env, groups = report["env"], report["groups"]
    gpu = groups[0]["members"][0]["gpu"]
    lines = [f"# Peer groups of {', '.join(str(g['P']) for g in groups)} GPUs ({gpu}), "
             f"model {report['model']}", "",
             f"Date {env['date']}, commit {env['commit']}, host {env['host']}, handle type "
             f"{groups[0]['members'][0]['stats']['handle_type']}. KV budget = "
             f"{KV_FRACTION} x total - (total - free) after opening the tables "
             "(torch.cuda.mem_get_info).", ""]
    for g in groups:
        lines += [f"## P = {g['P']}", "",
                  f"Rendezvous: group (last arrival to last done) {g['group_rendezvous_s']:.3f} s, "
                  f"slowest member {g['slowest_member_rendezvous_s']:.3f} s.", "",
                  "| rank | allocated GiB (tables) | plan GiB | over plan (bytes) | device GiB "
                  "used | KV budget GiB (before -> after) | bit-exact | open s | rendezvous s | "
                  "after close GiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for m in g["members"]:
            allocated = sum(t["local_bytes"] for t in m["stats"]["tables"])
            lines.append(
                f"| {m['rank']} | {allocated / GIB:.2f} | {m['plan_bytes'] / GIB:.2f} | "
                f"{allocated - m['plan_bytes']:,} | {m['device_bytes_used'] / GIB:.2f} | "
                f"{m['kv_budget_bytes_before'] / GIB:.2f} -> {m['kv_budget_bytes'] / GIB:.2f} | "
                f"{all(m['equal'].values()) and all(r['sample_equal'] for r in m['lookups'])} | "
                f"{m['open_s']:.1f} | {m['stats']['rendezvous_seconds']:.3f} | "
                f"{m['device_bytes_after_close'] / GIB:.2f} |")
        solo = g["members"][0]["copy_solo_GBps"]
        ring = [m["copy_ring_GBps"] for m in g["members"]]
        lines += ["", f"Peer copy ceiling: {solo:.0f} GB/s alone (1 GiB GPU1 -> GPU0); all at "
                  f"once, ring GPU r+1 -> GPU r: {min(ring):.0f}..{max(ring):.0f} GB/s per GPU.",
                  "", "Lookups, all ranks at once, uniform ids over the whole table (per GPU: "
                  "median over ranks of each rank's median / p99; remote GB/s = remote row "
                  "bytes / time):", "",
                  "| rows per GPU | remote rows (rank 0) | median ms | p99 ms (max rank) | "
                  "remote GB/s (median) | remote GB/s (min rank) | % of ring ceiling | "
                  "% of solo ceiling |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for i, r0 in enumerate(g["members"][0]["lookups"]):
            per_rank = [m["lookups"][i] for m in g["members"]]
            gbps = statistics.median(r["remote_GBps"] for r in per_rank)
            lines.append(
                f"| {r0['rows']:,} | {r0['remote_rows']:,} "
                f"({100 * r0['remote_rows'] / r0['rows']:.1f}%) | "
                f"{statistics.median(r['median_ms'] for r in per_rank):.4f} | "
                f"{max(r['p99_ms'] for r in per_rank):.4f} | {gbps:.0f} | "
                f"{min(r['remote_GBps'] for r in per_rank):.0f} | "
                f"{100 * gbps / statistics.median(ring):.0f}% | {100 * gbps / solo:.0f}% |")
        lines.append("")
    if report["kv_gains"]:
        lines += ["## KV-cache budget gain between sizes (min over ranks)", "",
                  "| from P | to P | measured gain GiB | plan gain GiB | difference MiB |",
                  "| --- | --- | --- | --- | --- |"]
        for k in report["kv_gains"]:
            lines.append(f"| {k['from']} | {k['to']} | {k['measured_bytes'] / GIB:.2f} | "
                         f"{k['plan_bytes'] / GIB:.2f} | "
                         f"{(k['measured_bytes'] - k['plan_bytes']) / 2**20:.0f} |")
        lines.append("")
    lines.append("Reference: upstream measured a 23.57 GiB KV gain from 4 to 8 GPUs (plan 23.60).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,8", help="peer group sizes, e.g. 4,8")
    parser.add_argument("--model", default="deepseek-v4.1-flash")
    parser.add_argument("--small", action="store_true", help="2M-vocab layout (~2.4 GiB in all)")
    parser.add_argument("--budget-s", type=float, default=0.2,
                        help="seconds of timed launches per lookup size")
    parser.add_argument("--copy-reps", type=int, default=30)
    parser.add_argument("--timeout-s", type=float, default=500, help="per group size")
    add_results_argument(parser, "peer_scale")
    args = parser.parse_args(argv)
    import torch
    try:
        sizes = parse_sizes(args.sizes, torch.cuda.device_count())
    except ValueError as exc:
        parser.error(str(exc))
    layout, model = (SMALL, "small (vocab 2M)") if args.small else (
        load_layout(args.model), args.model)
    groups = []
    for size in sizes:
        start = time.perf_counter()
        groups.append(bench_size(layout, size, args.budget_s, args.copy_reps, args.timeout_s))
        print(f"P={size} done in {time.perf_counter() - start:.0f} s", flush=True)
    env = {**environment(), "device": groups[0]["members"][0]["gpu"]}
    report = {"env": env, "model": model, "row_bytes": layout.row_bytes,
              "kv_fraction": KV_FRACTION, "groups": groups, "kv_gains": kv_gains(layout, groups)}
    text = scale_markdown(report)
    print(text)
    write_results(args.results, report, text, env=env)


if __name__ == "__main__":
    main()

"""Peer-group tables: rendezvous time (CPU processes, shm) and GPU peer lookups (2 GPUs, cuda).

`rendezvous`: groups of P = 2..8 local processes (shm backend, tiny tables) meet through the
FileStore, after a start barrier (so process start-up skew stays out); per group the time from
the last member's arrival to the last member done (the rendezvous itself) and the slowest
member's own rendezvous seconds (it also waits for later arrivals); median over repeats.

`gpu`: two processes, one per GPU, open a model's tables split over both GPUs (cuda backend,
synthetic rows generated on the GPU), check allocated bytes against `make_plan(.., "peer")`,
check lookups of sampled ids bit-exact against the reference, then rank 0 times lookups of
1K..1.57M rows with half the rows on the peer: GB/s of remote row bytes (264 B each) over the
lookup time, against the measured peer copy ceiling (1 GiB GPU1 -> GPU0), median and p99 of
device-event timings with L2 flushed (`lookup_timing.time_launches`).

Writes benchmarks/results/peer_rendezvous/ or peer_gpu/ (latest.md, a line of history.jsonl;
`--results DIR` elsewhere).
Usage: python benchmarks/bench_peer.py rendezvous
       python benchmarks/bench_peer.py gpu [--model deepseek-v4.1-flash | --small] [--results DIR]
"""

# Over 300 lines: the two halves of one issue's benchmark (the rendezvous on CPU processes, peer
# lookups on two GPUs) share the members, the layouts and the results writer; each is short.

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from engram_ray.model.layout import EngramLayout, load_layout  # noqa: E402
from engram_ray.tables.local_group import (check_member, expected_rows, file_barrier,  # noqa: E402
                                           random_row_ids, run_group)

from common import RESULTS, environment, write_results  # noqa: E402

TINY = EngramLayout(layer_ids=(1, 3), vocab_size=1000, max_ngram_size=3, n_heads=2,
                    head_dim=64, compressed_vocab_size=100, pad_token_id=0)
SMALL = EngramLayout(layer_ids=(1, 14), vocab_size=2_000_000, max_ngram_size=4, n_heads=8,
                     head_dim=256, compressed_vocab_size=99092, pad_token_id=2)
LOOKUP_ROWS = [1024, 8192, 65536, 262144, 1048576, 1572864]
GIB = 1 << 30


# --- rendezvous (CPU) -------------------------------------------------------------------

def bench_rendezvous(sizes: list[int], repeats: int) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {"ENGRAM_RAY_SHM_DIR": tmp}
        for size in sizes:
            slowest, group = [], []
            for rep in range(repeats):
                store = os.path.join(tmp, f"store-{size}-{rep}")
                results = run_group(check_member, list(range(size)),
                                    (TINY, size, store, f"bench-{size}-{rep}", "shm", "cpu",
                                     0, 4, 60.0, store + "-start"), env=env, timeout_s=120)
                bad = [r for r in results if not r.is_ok]
                if bad:
                    raise RuntimeError(f"P={size}: rank {bad[0].rank} failed:\n{bad[0].value}")
                stats = [r.value["stats"] for r in results]
                seconds = [s["rendezvous_seconds"] for s in stats]
                slowest.append(max(seconds))
                group.append(max(s["rendezvous_started_at"] + s["rendezvous_seconds"]
                                 for s in stats) - max(s["rendezvous_started_at"] for s in stats))
            rows.append({"P": size, "group_s": sorted(group)[repeats // 2],
                         "max_group_s": max(group),
                         "slowest_member_s": sorted(slowest)[repeats // 2],
                         "max_slowest_s": max(slowest), "repeats": repeats})
            print(json.dumps(rows[-1]), flush=True)
    return {"env": environment(), "backend": "shm", "layout": "tiny (2 tables, 66-byte rows)",
            "rows": rows}


def rendezvous_markdown(report: dict) -> str:
    env = report["env"]
    lines = ["# Peer-group rendezvous time (CPU processes, shm backend)", "",
             f"Date {env['date']}, commit {env['commit']}, host with {env['cpus']} CPUs "
             "(shared with other work), processes started by forkserver, a start barrier before the "
             "tables are opened.", "",
             "| P | group: last arrival to last done (s, median) | (s, max) | slowest member "
             "(s, median) | slowest member (s, max) |",
             "| --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        lines.append(f"| {r['P']} | {r['group_s']:.3f} | {r['max_group_s']:.3f} | "
                     f"{r['slowest_member_s']:.3f} | {r['max_slowest_s']:.3f} |")
    lines += ["", "Group: from the last member's arrival at the store until the last member is "
              "done (every member has every peer's slices mapped): the rendezvous itself. "
              "Slowest member: from its own arrival until done, including waiting for members "
              "that started later (on this shared 2-core machine, scheduling of P processes "
              "that also fill their tables). Target: under 2 s at P=8."]
    return "\n".join(lines) + "\n"


# --- GPU --------------------------------------------------------------------------------

def peer_copy_ceiling(reps: int = 20, src_device: str = "cuda:1",
                      dst_device: str = "cuda:0") -> float:
    """GB/s of a 1 GiB copy `src_device` -> `dst_device` (copy engines over NVLink), median
    of `reps`."""
    import torch
    src = torch.empty(GIB, dtype=torch.uint8, device=src_device).random_()
    dst = torch.empty(GIB, dtype=torch.uint8, device=dst_device)
    times = []
    for i in range(reps + 3):
        for d in (src_device, dst_device):
            torch.cuda.synchronize(d)
        start = time.perf_counter()
        dst.copy_(src)
        for d in (src_device, dst_device):
            torch.cuda.synchronize(d)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return GIB / sorted(times)[len(times) // 2] / 1e9


def half_remote_ids(table, num_rows: int, num_cols: int, seed: int, device):
    """`[ceil(n / C), C]` ids, half in rank 0's slice, half in rank 1's, shuffled."""
    import torch
    num_tokens = math.ceil(num_rows / num_cols)
    total = num_tokens * num_cols
    gen = torch.Generator(device=device).manual_seed(seed)
    local = torch.randint(0, table.rows_per_rank, (total // 2,), generator=gen, device=device)
    remote = torch.randint(table.rows_per_rank, table.num_rows, (total - total // 2,),
                           generator=gen, device=device)
    ids = torch.cat([local, remote])
    return ids[torch.randperm(total, generator=gen, device=device)].view(num_tokens, num_cols)


SWEEP = [dict(block_rows=b, programs_per_sm=p, num_warps=w)
         for b, p, w in ((128, 2, 8), (128, 4, 8), (64, 4, 4), (64, 8, 4), (32, 8, 4),
                         (16, 4, 4), (16, 8, 4), (16, 12, 4), (16, 16, 4))]
# The committed 16-row peer launch (kernels/lookup_policy.py) and changes to it: the launch
# committed before loads were cut at a line (one values load + a scale-word load, prefetch),
# loads cut at a sector, prefetch, grid size. (Cache hints and cp.async pipelines, measured
# slower or equal, are no longer kernel options: docs/lookup_experiments.md.)
HINT_SWEEP = [{}, {"split_bytes": 0, "prefetch": True}, {"split_bytes": 32},
              {"prefetch": True}, {"programs_per_sm": 8}, {"programs_per_sm": 24}]


def lookup_with(config, ids, layout, bases, per_rank):
    """engram_lookup with `config` as the peer launch for its tile rows (restored after)."""
    from engram_ray.kernels.lookup import engram_lookup

    from lookup_timing import launch_config
    with launch_config("peer", config):
        return engram_lookup(ids, head_dim=layout.head_dim, peer_bases=bases,
                             rows_per_rank=per_rank, block_rows=config.block_rows)


def bench_lookups(tables, layout, budget_s: float, sweep_min_rows: int) -> list[dict]:
    """Half-remote lookups (the table's own path), all-remote and all-local lookups, the
    local index_select baseline; at >= `sweep_min_rows` rows also kernel tile variants."""
    from engram_ray.kernels.lookup import engram_lookup

    from lookup_timing import num_id_sets, stats, time_launches

    table = tables.tables[layout.layer_ids[0]]
    per_rank, peer_rows = table.rows_per_rank, table.num_rows - table.rows_per_rank
    rows = []
    for num_rows in LOOKUP_ROWS:
        id_sets = [half_remote_ids(table, num_rows, layout.num_cols, k, "cuda:0")
                   for k in range(num_id_sets(num_rows))]
        local_sets = [ids.clamp(min=0).remainder(per_rank) for ids in id_sets]
        remote_sets = [per_rank + ids.remainder(peer_rows) for ids in local_sets]

        def timed(sets, fn=table.lookup):
            return stats(time_launches(lambda i: fn(sets[i % len(sets)]), budget_s=budget_s))

        peer, remote = timed(id_sets), timed(remote_sets)
        peer_bf16 = timed(id_sets, lambda ids: table.lookup(ids, out="bf16"))
        local = timed(local_sets, lambda ids: engram_lookup(ids, head_dim=layout.head_dim,
                                                            table=table.local))
        baseline = timed(local_sets, lambda ids: table.local.index_select(0, ids.view(-1)))
        looked_up = id_sets[0].numel()
        remote_bytes = (looked_up - looked_up // 2) * layout.row_bytes
        row = {"rows": looked_up, "remote_rows": looked_up - looked_up // 2,
               "peer_median_ms": peer["median_ms"], "peer_p99_ms": peer["p99_ms"],
               "remote_GBps": remote_bytes / peer["median_ms"] / 1e6,
               "all_rows_GBps": looked_up * layout.row_bytes / peer["median_ms"] / 1e6,
               "peer_bf16_median_ms": peer_bf16["median_ms"], "peer_bf16_p99_ms": peer_bf16[
                   "p99_ms"], "remote_bf16_GBps": remote_bytes / peer_bf16["median_ms"] / 1e6,
               "all_remote_median_ms": remote["median_ms"],
               "all_remote_GBps": looked_up * layout.row_bytes / remote["median_ms"] / 1e6,
               "local_kernel_median_ms": local["median_ms"],
               "local_index_select_median_ms": baseline["median_ms"], "reps": peer["reps"]}
        if num_rows >= sweep_min_rows:
            bases = table.peer_bases
            row["sweep"] = [dict(variant, median_ms=timed(id_sets, lambda ids, v=variant:
                                 engram_lookup(ids, head_dim=layout.head_dim, peer_bases=bases,
                                               rows_per_rank=per_rank, **v))["median_ms"])
                            for variant in SWEEP]
            from dataclasses import replace

            import torch

            from engram_ray.kernels.lookup import tile_config
            committed = tile_config("peer", 16)
            for hints in HINT_SWEEP:
                config = replace(committed, **hints)
                got = lookup_with(config, id_sets[0], layout, bases, per_rank)
                same = torch.equal(got, table.lookup(id_sets[0]))
                row["sweep"].append(dict(
                    block_rows=16, programs_per_sm=config.programs_per_sm,
                    num_warps=config.num_warps, prefetch=config.prefetch, hints=hints,
                    equal=same, median_ms=timed(id_sets, lambda ids, c=config: lookup_with(
                        c, ids, layout, bases, per_rank))["median_ms"]))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def gpu_member(rank: int, layout: EngramLayout, store_dir: str, done_path: str,
               budget_s: float, sweep_min_rows: int) -> dict:
    import torch

    from engram_ray.planning.memory import make_plan
    from engram_ray.tables.settings import PeerGroupSettings
    from engram_ray.tables.table import open_group_tables

    torch.cuda.set_device(rank)
    free_before = torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    settings = PeerGroupSettings(size=2, rank=rank, store_dir=store_dir,
                                 generation="bench-gpu", timeout_s=300, backend="cuda")
    tables = open_group_tables(layout, settings, device=f"cuda:{rank}")
    open_s = time.perf_counter() - start
    used = free_before - torch.cuda.mem_get_info()[0]
    plan = make_plan(layout, "peer", peer_group_size=2)
    out = {"open_s": open_s, "stats": tables.stats(), "device_bytes_used": used,
           "plan_bytes_by_table": list(plan.hbm_bytes_per_gpu_by_table),
           "gpu": torch.cuda.get_device_name(rank)}
    out["equal"] = {}
    for idx, layer_id in enumerate(layout.layer_ids):
        ids = random_row_ids(layout.rows_per_table[idx], (128, layout.num_cols), 100 + rank,
                             f"cuda:{rank}")
        out["equal"][str(layer_id)] = all(torch.equal(tables.lookup(layer_id, ids, o),
                                                 expected_rows(ids, layout.head_dim, 0, o))
                                     for o in ("packed", "bf16"))
    try:
        if rank == 0:
            out["peer_copy_GBps"] = peer_copy_ceiling()
            out["lookups"] = bench_lookups(tables, layout, budget_s, sweep_min_rows)
            Path(done_path).write_text("done")
        else:  # keep this slice mapped and alive until rank 0 has finished reading it
            deadline = time.monotonic() + 500
            while not os.path.exists(done_path) and time.monotonic() < deadline:
                time.sleep(0.2)
    finally:
        tables.close()
        Path(done_path).write_text("done")
    file_barrier(store_dir + "-closed", "closed", rank, [0, 1], timeout_s=120)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    out["device_bytes_after_close"] = free_before - torch.cuda.mem_get_info()[0]
    return out


def bench_gpu(layout: EngramLayout, model: str, budget_s: float, sweep_min_rows: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_group(gpu_member, [0, 1], (layout, os.path.join(tmp, "store"),
                                                 os.path.join(tmp, "done"), budget_s,
                                                 sweep_min_rows),
                            timeout_s=560, start_method="spawn")
    for r in results:
        if not r.is_ok:
            raise RuntimeError(f"rank {r.rank} failed:\n{r.value}")
    env = {**environment(), "device": results[0].value["gpu"]}
    return {"env": env, "model": model, "row_bytes": layout.row_bytes,
            "members": [r.value for r in results]}


def gpu_markdown(report: dict) -> str:
    env, members = report["env"], report["members"]
    first = members[0]
    lines = [f"# Peer-group tables on 2 GPUs ({first['gpu']}), model {report['model']}", "",
             f"Date {env['date']}, commit {env['commit']}, handle type "
             f"{first['stats']['handle_type']}.", "",
             "| rank | table | slice rows | allocated bytes | plan bytes | over plan | "
             "sampled lookups bit-exact | open s (alloc+fill+rendezvous) | rendezvous s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in members:
        for t, plan_bytes in zip(m["stats"]["tables"], m["plan_bytes_by_table"]):
            lines.append(f"| {m['stats']['rank']} | layer {t['layer_id']} | {t['slice'][0]:,}.."
                         f"{t['slice'][1]:,} | {t['local_bytes']:,} | {plan_bytes:,} | "
                         f"{t['local_bytes'] - plan_bytes:,} | {m['equal'][str(t['layer_id'])]} | "
                         f"{m['open_s']:.1f} | {m['stats']['rendezvous_seconds']:.3f} |")
    lines += ["", "Device memory per GPU taken by open_group_tables (mem_get_info): " + ", ".join(
        f"rank {m['stats']['rank']}: {m['device_bytes_used'] / GIB:.2f} GiB, after close "
        f"{m['device_bytes_after_close'] / GIB:.2f} GiB" for m in members), "",
        f"Peer copy ceiling (1 GiB GPU1 -> GPU0, copy engines): "
        f"{first['peer_copy_GBps']:.0f} GB/s.", "",
        "Packed output, then bf16 output (the same ids): remote GB/s = remote rows x 264 B / "
        "median.", "",
        "| rows looked up | remote rows | peer median ms | p99 ms | remote GB/s | % of ceiling |"
        " bf16 out: median ms | p99 ms | remote GB/s | % of ceiling |"
        " all rows GB/s | all-remote ms | all-remote GB/s | local kernel ms (all local) | "
        "local index_select ms |",
        "|" + " --- |" * 15]
    for r in first["lookups"]:
        lines.append(f"| {r['rows']:,} | {r['remote_rows']:,} | {r['peer_median_ms']:.4f} | "
                     f"{r['peer_p99_ms']:.4f} | {r['remote_GBps']:.0f} | "
                     f"{100 * r['remote_GBps'] / first['peer_copy_GBps']:.1f}% | "
                     + (f"{r['peer_bf16_median_ms']:.4f} | {r['peer_bf16_p99_ms']:.4f} | "
                        f"{r['remote_bf16_GBps']:.0f} | "
                        f"{100 * r['remote_bf16_GBps'] / first['peer_copy_GBps']:.1f}% | "
                        if "peer_bf16_median_ms" in r else "| | | | ") +
                     f"{r['all_rows_GBps']:.0f} | {r['all_remote_median_ms']:.4f} | "
                     f"{r['all_remote_GBps']:.0f} | {r['local_kernel_median_ms']:.4f} | "
                     f"{r['local_index_select_median_ms']:.4f} |")
    sweeps = [r for r in first["lookups"] if "sweep" in r]
    if sweeps:
        lines += ["", "Kernel tile variants on the half-remote lookups (median ms; remote GB/s):",
                  "", "| rows | block_rows | programs/SM | warps | prefetch, changes to the launch | "
                  "median ms | remote GB/s |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in sweeps:
            for v in r["sweep"]:
                gbps = r["remote_rows"] * report["row_bytes"] / v["median_ms"] / 1e6
                extra = "" if "hints" not in v else (
                    f"{'prefetch ' if v['prefetch'] else ''}{v['hints'] or 'none'}"
                    f"{'' if v['equal'] else ' NOT EQUAL'}")
                lines.append(f"| {r['rows']:,} | {v['block_rows']} | {v['programs_per_sm']} | "
                             f"{v['num_warps']} | {extra} | {v['median_ms']:.4f} | {gbps:.0f} |")
    lines += ["", "Bar (vLLM 0.33 peer-rows mode, 1.57M rows): 56 GB/s of remote rows, 14% of a "
              "389 GB/s peer copy ceiling (3.69 ms); 8 GB/s with 128-row tiles."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("rendezvous", "gpu"))
    parser.add_argument("--sizes", default="2,3,4,5,6,7,8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="deepseek-v4.1-flash")
    parser.add_argument("--small", action="store_true", help="2M-vocab layout (~2.4 GiB/GPU)")
    parser.add_argument("--budget-s", type=float, default=0.3)
    parser.add_argument("--sweep-min-rows", type=int, default=1 << 20,
                        help="time kernel tile variants for lookups of at least this many rows")
    parser.add_argument("--results", type=Path, help="folder of latest.md and history.jsonl "
                        "(default benchmarks/results/peer_rendezvous or peer_gpu)")
    args = parser.parse_args()
    if args.what == "rendezvous":
        report = bench_rendezvous([int(s) for s in args.sizes.split(",")], args.repeats)
        text = rendezvous_markdown(report)
    else:
        layout, model = (SMALL, "small (vocab 2M)") if args.small else (
            load_layout(args.model), args.model)
        report = bench_gpu(layout, model, args.budget_s, args.sweep_min_rows)
        text = gpu_markdown(report)
    print(text)
    write_results(args.results or RESULTS / f"peer_{args.what}", report, text, env=report["env"])


if __name__ == "__main__":
    main()

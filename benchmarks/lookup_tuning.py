"""Measure the lookup tile policy: the best launch of 16-row and 128-row tiles per placement,
then the lookup sizes from which 128-row tiles, and (host tables) sorted ids, win.

The chosen values are set in `engram_ray.kernels.lookup` for the rest of the benchmark run and
written to the report; the committed defaults in kernels/lookup.py are copied from it.
"""

from __future__ import annotations

import json
from dataclasses import replace

from engram_ray.kernels import lookup as kernel
from lookup_timing import stats, time_launches

SWEEP_TOKENS = {"hbm": (43691, 2731), "peer": (43691, 2731), "host": (43691,),
                "host_thp": (43691,)}
PROGRAMS_PER_SM = (1, 2, 4, 8, 16)
# A choice switches only where it wins by more than run-to-run noise (same version timed twice
# differed by up to ~2% here).
MARGIN = 0.02
# Below this many rows host lookups (< 0.6 ms) have bimodal latency (medians flip between two
# modes run to run), so tile windows only start at or above it.
MIN_WINDOW_ROWS = 16384


def sweep(table, budget_s: float) -> list[dict]:
    """Time every (tile rows, programs per SM, prefetch) at the sweep sizes, both outputs
    (host tables: packed, with ids sorted as the large host lookups will be)."""
    placement, found = table.placement, []
    outs = ("packed",) if placement.startswith("host") else ("packed", "bf16")
    for num_tokens in SWEEP_TOKENS[placement]:
        ids = table.id_sets(num_tokens, seed=num_tokens + 1)
        for out in outs:
            for block_rows in (16, 128):
                for per_sm in PROGRAMS_PER_SM:
                    for prefetch in (False, True):
                        config = kernel.TileConfig(block_rows, per_sm,
                                                   4 if block_rows == 16 else 8, prefetch)

                        def run(i, config=config):
                            table.lookup(ids[i % len(ids)], out=out,
                                         block_rows=config.block_rows,
                                         programs_per_sm=config.programs_per_sm,
                                         num_warps=config.num_warps, prefetch=config.prefetch,
                                         sort_rows=placement.startswith("host"))
                        stat = stats(time_launches(run, budget_s=budget_s, min_reps=5,
                                                   max_reps=50, warmup=2))
                        found.append({"placement": placement, "rows": ids[0].numel(),
                                      "out": out, **config.__dict__, **stat})
                        print(json.dumps(found[-1]), flush=True)
    return found


def best_configs(found: list[dict]) -> dict:
    """Per tile rows: the launch with the least total time relative to the best of each case
    (the placement's committed launch with the swept grid, warps and prefetch: its other
    fields, such as cut loads and 32-bit owner division, were in effect during the sweep)."""
    cases = {(r["rows"], r["out"]) for r in found}
    fastest = {case: min(r["median_ms"] for r in found if (r["rows"], r["out"]) == case)
               for case in cases}
    chosen = {}
    for block_rows in (16, 128):
        scores = {}
        for r in found:
            if r["block_rows"] == block_rows:
                key = (r["programs_per_sm"], r["num_warps"], r["prefetch"])
                scores[key] = scores.get(key, 0.0) + r["median_ms"] / fastest[r["rows"], r["out"]]
        per_sm, warps, prefetch = min(scores, key=scores.get)
        chosen[block_rows] = replace(kernel.tile_config(found[0]["placement"], block_rows),
                                     programs_per_sm=per_sm, num_warps=warps, prefetch=prefetch)
    return chosen


def first_size_where(better: dict[int, bool]) -> int:
    """Smallest size from which `better[size]` holds at every larger size (NEVER: none)."""
    threshold = kernel.NEVER
    for size in sorted(better, reverse=True):
        if not better[size]:
            break
        threshold = size
    return threshold


def window_where(better: dict[int, bool]) -> tuple[int, int]:
    """[first size where `better` holds, first larger size where it stops) or (NEVER, NEVER)."""
    sizes = sorted(better)
    starts = [size for size in sizes if better[size]]
    if not starts:
        return kernel.NEVER, kernel.NEVER
    stops = [size for size in sizes if size > starts[0] and not better[size]]
    return starts[0], stops[0] if stops else kernel.NEVER


def thresholds(rows: list[dict], placement: str) -> tuple[int, tuple[int, int]]:
    """(sort_min_rows, [min, max) rows for 128-row tiles) from fixed-tile results summed over
    both outputs; each choice must win by more than MARGIN."""
    total: dict[tuple[int, str], float] = {}
    for r in rows:
        total[r["rows"], r["variant"]] = total.get((r["rows"], r["variant"]), 0.0) + r[
            "median_ms"]
    sizes = sorted({size for size, _ in total})
    sort_min_rows = kernel.NEVER
    if placement.startswith("host"):
        sort_min_rows = first_size_where({
            size: min(total[size, "r16_sorted"], total[size, "r128_sorted"])
            < (1 - MARGIN) * min(total[size, "r16"], total[size, "r128"]) for size in sizes})
    suffix = {size: "_sorted" if size >= sort_min_rows else "" for size in sizes}
    window = window_where({
        size: size >= MIN_WINDOW_ROWS and total[size, "r128" + suffix[size]]
        < (1 - MARGIN) * total[size, "r16" + suffix[size]] for size in sizes})
    return sort_min_rows, window


def from_report(path: str) -> dict:
    """Re-derive the policy from a saved report: {placement: (sort_min_rows, threshold)}."""
    report = json.load(open(path))
    fixed = [r for r in report["results"] if r["variant"] in ("r16", "r128", "r16_sorted",
                                                              "r128_sorted")]
    return {placement: thresholds([r for r in fixed if r["placement"] == placement], placement)
            for placement in report["policy"]}


# --- Pinned host tables against vLLM 0.33, the lookup as the model calls it -----------------
# `python benchmarks/lookup_tuning.py --json R.json --md R.md` (device; .vllm_ref carried):
# every host launch below on int32 column-slice hashes through `LookupLauncher` (the path
# `TableLookup` takes), with vLLM 0.33's unsorted and sorted launches timed in the same run
# (before and after each case's sweep: their drift is the run's noise), L2 flushed, launches
# queued (`gpu` mode of bench_model_lookup.py). Each swept output is checked bitwise against
# vLLM's. Then host microseconds of ways to order ids, and repeats of the small peer cases.

HOST_TOKENS = (2731, 65536, 43691, 10923, 683, 64)  # 65,544 rows (the worst case) first
UNSORTED_MAX_TOKENS = 683  # unsorted launches swept up to 16,392 rows (4x slower from 65K)
SORTED_MIN_TOKENS = 683


def host_grid(is_sorted: bool):
    """16-row tiles with 2, 4 or 8 warps; 128-row tiles (sorted only) with 4 or 8 (2 warps
    would hold a 33 KB tile, twice with prefetch, in 64 threads' registers)."""
    for block_rows in (16, 128) if is_sorted else (16,):
        for warps in (2, 4, 8) if block_rows == 16 else (4, 8):
            for prefetch in (False, True):
                for split_bytes in (0, 128):
                    for per_sm in PROGRAMS_PER_SM:
                        yield kernel.TileConfig(block_rows, per_sm, warps, prefetch,
                                                split_bytes=split_bytes)


def sweep_host_vs_vllm(case, budget_s: float, deadline: float) -> list[dict]:
    """Rows {rows, out, name, sorted, config fields, median_ms, p99_ms, equal}; name is
    vllm / vllm_sorted (timed first and last: `_end`) or `ours`."""
    import time

    import torch
    from bench_model_lookup import DTYPE, WIDTH
    from lookup_timing import HEAD_DIM, NUM_COLS, launch_config

    table, found = case.source["table"], []
    for tokens in HOST_TOKENS:
        id_sets = case.ids_for(case.id_sets(tokens, seed=tokens))
        for out_kind in ("packed", "bf16"):
            out = torch.empty(tokens, NUM_COLS, WIDTH[out_kind], dtype=DTYPE[out_kind],
                              device="cuda:0")
            expected = torch.empty_like(out)
            case.vllm.lookup(id_sets[0], expected)
            base = {"rows": tokens * NUM_COLS, "out": out_kind}

            def timed(fn):
                return stats(time_launches(lambda i: fn(id_sets[i % len(id_sets)], out),
                                           budget_s=budget_s, min_reps=7, max_reps=15,
                                           warmup=2))

            def vllm(suffix):
                for name, is_sorted in (("vllm", False), ("vllm_sorted", True)):
                    found.append({**base, "name": name + suffix, "sorted": is_sorted, **timed(
                        lambda h, o, s=is_sorted: case.vllm.lookup(h, o, sort=s))})
            vllm("")
            sorts = [s for s, ok in ((False, tokens <= UNSORTED_MAX_TOKENS),
                                     (True, tokens >= SORTED_MIN_TOKENS)) if ok]
            for is_sorted in sorts:
                for config in host_grid(is_sorted):
                    if time.monotonic() > deadline:
                        return found
                    with launch_config("host", config):
                        launch = kernel.LookupLauncher(head_dim=HEAD_DIM, table=table,
                                                       block_rows=config.block_rows,
                                                       sort_rows=is_sorted)
                        out.zero_()
                        launch(id_sets[0], out)
                    equal = torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
                    found.append({**base, "name": "ours", "sorted": is_sorted,
                                  **config.__dict__, **timed(launch), "equal": equal})
            vllm("_end")
            print(json.dumps(found[-1]), flush=True)
    return found


def is_committed(row: dict) -> bool:
    """The launch today's policy makes for this row's size (tiles, sorting, config)."""
    rows = row["rows"]
    block_rows = kernel.choose_block_rows(rows, 264, "host")
    committed = kernel.tile_config("host", block_rows)
    return (row["sorted"] == (rows >= kernel.SORT_MIN_ROWS["host"])
            and all(row[k] == v for k, v in committed.__dict__.items()))


def host_table_md(found: list[dict]) -> str:
    """Per (rows, out): vLLM unsorted / sorted (first, last), the committed launch and the
    fastest launch of each tile size and sorting, in ms."""
    def label(r):
        return (f"{r['block_rows']} r, {r['programs_per_sm']}/SM, {r['num_warps']} w, "
                f"{'pf' if r['prefetch'] else 'no pf'}, split {r['split_bytes']}")
    lines = ["| rows | out | vLLM | vLLM sorted (first / last) | committed | best 16-row sorted | "
             "best 128-row sorted | best unsorted | all bitwise = vLLM |",
             "| ---: | --- | ---: | --- | --- | --- | --- | --- | --- |"]
    cases = sorted({(r["rows"], r["out"]) for r in found})
    for rows, out in cases:
        rs = [r for r in found if (r["rows"], r["out"]) == (rows, out)]
        by = {r["name"]: r["median_ms"] for r in rs if r["name"] != "ours"}
        ours = [r for r in rs if r["name"] == "ours"]
        cells = []
        for pick in (lambda r: is_committed(r), lambda r: r["sorted"] and r["block_rows"] == 16,
                     lambda r: r["sorted"] and r["block_rows"] == 128,
                     lambda r: not r["sorted"]):
            chosen = [r for r in ours if pick(r)]
            best = min(chosen, key=lambda r: r["median_ms"]) if chosen else None
            cells.append(f"{best['median_ms']:.4f} ({label(best)})" if best else "-")
        lines.append(f"| {rows:,} | {out} | {by.get('vllm', 0):.4f} | "
                     f"{by.get('vllm_sorted', 0):.4f} / {by.get('vllm_sorted_end', 0):.4f} | "
                     + " | ".join(cells) + f" | {all(r['equal'] for r in ours)} |")
    return "\n".join(lines) + "\n"


class GraphSort:
    """Candidate ordering: `torch.sort` of a static buffer padded to the next power of two
    with INT32_MAX (pads sort last, so the first num_rows pairs are the call's), captured
    once in a CUDA graph that also re-pads; a call copies the ids in and replays."""

    def __init__(self, max_rows: int):
        import torch
        size = 1 << (max_rows - 1).bit_length()
        self.keys = torch.full((size,), 2**31 - 1, dtype=torch.int32, device="cuda:0")
        self.values = torch.empty_like(self.keys)
        self.indices = torch.empty(size, dtype=torch.int64, device="cuda:0")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.sort(self.keys, out=(self.values, self.indices))
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            torch.sort(self.keys, out=(self.values, self.indices))
            self.keys.fill_(2**31 - 1)

    def __call__(self, hashes, out=None):
        self.keys[:hashes.numel()].view(hashes.shape).copy_(hashes)
        self.graph.replay()
        return self.values, self.indices


def ordering_costs(case, budget_s: float) -> list[dict]:
    """Host us per call (bench_model_lookup.host_us) and GPU ms of ways to order a host
    lookup's ids, at 65,544 and 1,572,864 rows; `launch_unsorted` is the launch alone."""
    import torch
    from bench_model_lookup import host_us
    from lookup_timing import HEAD_DIM, NUM_COLS

    table, found = case.source["table"], []
    for tokens in (2731, 65536):
        id_sets = case.ids_for(case.id_sets(tokens, seed=tokens + 7))
        out = torch.empty(tokens, NUM_COLS, 264, dtype=torch.uint8, device="cuda:0")
        flat = torch.empty(tokens * NUM_COLS, dtype=torch.int32, device="cuda:0")
        values, indices = torch.empty_like(flat), torch.empty(flat.shape, dtype=torch.int64,
                                                              device="cuda:0")

        def sort_into(h, o):
            flat.view(h.shape).copy_(h)
            return torch.sort(flat, out=(values, indices))
        graph_sort = GraphSort(tokens * NUM_COLS)
        fns = {"patch_sorted": case.patch,
               "launch_unsorted": kernel.LookupLauncher(head_dim=HEAD_DIM, table=table,
                                                        sort_rows=False),
               "reshape_sort": lambda h, o: h.reshape(-1).sort(),
               "reshape_sort_unstable": lambda h, o: h.reshape(-1).sort(stable=False),
               "sort_into_buffers": sort_into,
               "int16_key_sort": lambda h, o: (h.reshape(-1) >> 10).to(torch.int16).sort(),
               "graph_sort": graph_sort}
        hashes = id_sets[0]
        keys, order = graph_sort(hashes)
        reference = hashes.reshape(-1).sort().values
        num_rows = hashes.numel()
        same = (torch.equal(keys[:num_rows], reference)
                and torch.equal(hashes.reshape(-1)[order[:num_rows]], keys[:num_rows]))
        host = host_us(fns, id_sets, out)
        for name, fn in fns.items():
            gpu = stats(time_launches(lambda i: fn(id_sets[i % len(id_sets)], out),
                                      budget_s=budget_s, min_reps=7, max_reps=30, warmup=2))
            found.append({"rows": num_rows, "name": name, "host_us": host[name],
                          "gpu_ms": gpu["median_ms"], "graph_sort_matches": same})
            print(json.dumps(found[-1]), flush=True)
    return found


def small_peer_repeats(peer_case, rounds: int = 5) -> list[dict]:
    """Graph-replay ms of vLLM and the patch at 1,536 peer rows, `rounds` times alternating
    (is the 19.6 vs 18.0 us bf16 case of model_lookup_h200_f9ccf4f noise?)."""
    import torch
    from bench_model_lookup import DTYPE, WIDTH, capture
    from lookup_timing import NUM_COLS

    found = []
    for out_kind in ("bf16", "packed"):
        id_sets = peer_case.ids_for(peer_case.id_sets(64, seed=64))
        out = torch.empty(64, NUM_COLS, WIDTH[out_kind], dtype=DTYPE[out_kind], device="cuda:0")
        fns = {"vllm": peer_case.vllm.lookup, "patch": peer_case.patch}
        for round_idx in range(rounds):
            for name, fn in fns.items():
                graphs = capture(fn, id_sets, out)
                times = stats(time_launches(lambda i: graphs[i % len(graphs)].replay(),
                                            budget_s=0.1, wall=True))
                found.append({"out": out_kind, "round": round_idx, "name": name, **times})
                print(json.dumps(found[-1]), flush=True)
    return found


def main() -> None:
    import argparse
    import time
    from pathlib import Path

    import torch
    import vllm_engram_ref
    from bench_model_lookup import Case, avoid_zero_scales
    from lookup_timing import GIB, ROW_BYTES, fill_random

    parser = argparse.ArgumentParser(description="host launches vs vLLM 0.33 (module doc)")
    parser.add_argument("--json", required=True)
    parser.add_argument("--md", required=True)
    parser.add_argument("--sweep-s", type=float, default=200.0, help="sweep deadline")
    parser.add_argument("--budget-s", type=float, default=0.05)
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    deadline = time.monotonic() + args.sweep_s
    torch.cuda.set_device(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    vllm_kernel = vllm_engram_ref.load_kernel()
    packed = torch.empty(16 * GIB // ROW_BYTES, ROW_BYTES, dtype=torch.uint8, device="cuda:0")
    fill_random(packed, seed=1)
    avoid_zero_scales(packed)
    result = {"device": torch.cuda.get_device_name(0), "commit": args.commit,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host_gib": 8}
    host = Case("host", packed[:8 * GIB // ROW_BYTES], vllm_kernel, num_sms)
    result["sweep"] = sweep_host_vs_vllm(host, args.budget_s, deadline)
    Path(args.json).write_text(json.dumps(result))
    table = host_table_md(result["sweep"])
    Path(args.md).write_text(table)
    print(table, flush=True)
    result["ordering"] = ordering_costs(host, args.budget_s)
    Path(args.json).write_text(json.dumps(result))
    del host
    result["peer_small"] = small_peer_repeats(Case("peer", packed, vllm_kernel, num_sms))
    Path(args.json).write_text(json.dumps(result))


if __name__ == "__main__":
    main()

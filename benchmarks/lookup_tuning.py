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

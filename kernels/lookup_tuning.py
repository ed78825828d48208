"""The tile policy from timed lookups (pure Python, no Triton): which launch of 16-row and
128-row tiles to keep per placement, and from which lookup size 128-row tiles and (host
tables) sorted ids win. `benchmarks/bench_lookup.py` times the launches and applies these
rules (its default `--tune`); the committed values in lookup_policy.py are copied from its
report. Also the number of id sets a timing loop rotates over, so timed launches read rows
no recent launch read.
"""

from __future__ import annotations

from dataclasses import replace

from engram_ray.kernels.lookup_policy import NEVER, tile_config

# A choice switches only where it wins by more than run-to-run noise (same version timed twice
# differed by up to ~2% on an H200).
MARGIN = 0.02
# Below this many rows host lookups (< 0.6 ms) have bimodal latency (medians flip between two
# modes run to run), so tile windows only start at or above it.
MIN_WINDOW_ROWS = 16384
NUM_ID_SETS = 4
ID_SET_REUSE_ROWS = 1 << 18  # rows other launches read before an id set comes round again


def num_id_sets(num_rows: int) -> int:
    """Id sets a timing loop rotates over: NUM_ID_SETS, more for small lookups, so that
    ~ID_SET_REUSE_ROWS rows are read before a set is read again (at most 64 sets): a host
    table's warm address translations made the next launch over the same rows 4x faster."""
    return max(NUM_ID_SETS, min(64, ID_SET_REUSE_ROWS // max(1, num_rows)))


def best_configs(found: list[dict]) -> dict:
    """Per tile rows: the launch with the least total time relative to the best of each case
    (the placement's committed launch with the swept grid, warps and prefetch: its other
    fields, such as cut loads and 32-bit owner division, were in effect during the sweep).
    `found`: sweep rows {placement, rows, out, block_rows, programs_per_sm, num_warps,
    prefetch, median_ms}."""
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
        chosen[block_rows] = replace(tile_config(found[0]["placement"], block_rows),
                                     programs_per_sm=per_sm, num_warps=warps, prefetch=prefetch)
    return chosen


def first_size_where(better: dict[int, bool]) -> int:
    """Smallest size from which `better[size]` holds at every larger size (NEVER: none)."""
    threshold = NEVER
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
        return NEVER, NEVER
    stops = [size for size in sizes if size > starts[0] and not better[size]]
    return starts[0], stops[0] if stops else NEVER


def thresholds(rows: list[dict], placement: str) -> tuple[int, tuple[int, int]]:
    """(sort_min_rows, [min, max) rows for 128-row tiles) from fixed-tile results (variants
    r16, r128, r16_sorted, r128_sorted) summed over both outputs; each choice must win by
    more than MARGIN."""
    total: dict[tuple[int, str], float] = {}
    for r in rows:
        total[r["rows"], r["variant"]] = total.get((r["rows"], r["variant"]), 0.0) + r[
            "median_ms"]
    sizes = sorted({size for size, _ in total})
    sort_min_rows = NEVER
    if placement.startswith("host"):
        sort_min_rows = first_size_where({
            size: min(total[size, "r16_sorted"], total[size, "r128_sorted"])
            < (1 - MARGIN) * min(total[size, "r16"], total[size, "r128"]) for size in sizes})
    suffix = {size: "_sorted" if size >= sort_min_rows else "" for size in sizes}
    window = window_where({
        size: size >= MIN_WINDOW_ROWS and total[size, "r128" + suffix[size]]
        < (1 - MARGIN) * total[size, "r16" + suffix[size]] for size in sizes})
    return sort_min_rows, window


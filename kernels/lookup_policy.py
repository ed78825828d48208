"""Launch policy of the Engram lookup kernel (kernels/lookup.py): tile rows, persistent grid,
warps, prefetch and id sorting per table placement, as measured. Pure Python, no Triton.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PLACEMENTS = ("hbm", "host", "host_thp", "peer")
SPLIT_BYTES = (0, 32, 128)  # where row loads are cut: nowhere, a sector, a line
SPLIT_HEAD_DIM = 256  # rows cut: 264 bytes = 33 eight-byte words


@dataclass(frozen=True)
class TileConfig:
    """How one lookup is launched: rows per tile, persistent programs per SM, warps per
    program, whether the next tile's loads are issued before this tile's stores, and, for
    peer tables, whether each row's owner is found by a 32-bit division (used only where
    rows_per_rank x P < 2^31; else 64-bit) and where each 264-byte row's loads are cut:
    `split_bytes` 0 = one values load + one scale-word load, 32 / 128 = two loads cut at the
    row's first 32-byte sector / 128-byte line boundary (no sector / no line asked for twice;
    other row widths ignore it); `split_bf16` / `split_packed` False keeps bf16 / packed
    output's loads uncut."""

    block_rows: int
    programs_per_sm: int
    num_warps: int
    prefetch: bool = False
    rows_32: bool = False
    split_bytes: int = 0
    split_bf16: bool = True
    split_packed: bool = True

    def __post_init__(self):
        if self.block_rows & (self.block_rows - 1) or not 1 <= self.block_rows <= 512:
            raise ValueError(f"block_rows is {self.block_rows}; expected a power of two in "
                             "[1, 512]")
        if self.programs_per_sm < 1 or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"programs_per_sm {self.programs_per_sm} / num_warps "
                             f"{self.num_warps}; expected >= 1 / a power of two <= 16")
        if self.split_bytes not in SPLIT_BYTES:
            raise ValueError(f"split_bytes is {self.split_bytes!r}; expected one of {SPLIT_BYTES}")


# Measured on one H200 (the sweep: benchmarks/results/lookup/history.jsonl, its first line's
# `policy_sweep`; the cut-load runs: docs/lookup_experiments.md): the best 16-row and 128-row
# launch per placement, the lookup sizes [min, max) where 128-row tiles won by more than 2%
# (TILE_POLICY) and, for host tables, the size from which sorting the ids first won.
# Random row reads are latency-bound: what counts is rows in flight per SM (tile rows x
# resident programs). With 8 programs per SM, 16-row tiles keep as many rows in flight as one
# 128-row tile per SM and were never slower by more than noise in HBM, over NVLink or from THP
# host memory; with vLLM's one program per SM, 128-row tiles are 2.7x faster.
# Peer launches find each row's owner by a 32-bit division where every id fits (a 64-bit
# division is a ~dozen-instruction sequence per row; 2% faster over NVLink).
# Over NVLink and PCIe every memory request costs: a 264-byte row at an 8-byte offset spans
# three 128-byte lines, and the plain load (256 value bytes, then the scale word) asks for up
# to four line requests; cut at the row's first line boundary each line is asked for once
# (peer: 319 vs 303 GB/s of remote rows at 1.57M rows; host: 9.3-9.6 vs 10.5-11.1 ms). In
# HBM, where requests are cheap and DRAM accesses bound the reads, a sector cut helps packed
# output (8%) and costs bf16 output 21% (the dequantization from 64-bit words costs more than
# the requests save), so bf16 loads stay whole.
# Small-page host tables, sorted 65K-row lookups: bound by the GPU's translation of system
# memory addresses (11 of the 55 GB/s host-to-device ceiling), so fewer rows in flight touch
# fewer pages at once: one 16-row program per SM with 2 warps, prefetch. Its bf16 loads are cut
# at the line, packed loads whole (sorted 65K-262K rows from 8, 16 and 32 GiB tables,
# 2026-12-02, benchmarks/results/host_tiles/: bf16 2-11% faster cut; packed 0-4% faster
# cut, but 5% slower at 65K rows of 8 GiB, below vLLM's sorted launch there).
NEVER = 1 << 62
TILE_CONFIGS = {
    "hbm": {16: TileConfig(16, 8, 4, split_bytes=32, split_bf16=False),
            128: TileConfig(128, 1, 8, prefetch=True)},
    "peer": {16: TileConfig(16, 16, 4, rows_32=True, split_bytes=128),
             128: TileConfig(128, 1, 8, True, rows_32=True)},
    "host": {16: TileConfig(16, 1, 2, True, split_bytes=128, split_packed=False),
             128: TileConfig(128, 16, 8, True, split_bytes=128)},
    "host_thp": {16: TileConfig(16, 4, 4, True, split_bytes=128),
                 128: TileConfig(128, 1, 8, True, split_bytes=128)},
}
# Host tables, 128-row tiles from 262K rows: there the sorted reads stream (45 GB/s at 1.57M
# rows) and 16 programs of 128 rows per SM (8 resident at 8 warps) let the hardware balance
# the tail; below, the few-rows-in-flight 16-row launch wins (translation-bound). HBM and
# peer: 16-row tiles at every size. Against vLLM 0.33's sorted launch from an 8 GiB pinned
# host table: from 1M rows no swept launch reaches it (0.6-1.3% slower); neither huge pages,
# rows that never cross a 4 KiB page, vLLM's split values + scales layout nor rows padded to
# 288 bytes (sector-aligned values: 2-9% slower from 262K rows) were a launch worth keeping
# (docs/lookup_experiments.md), so host tables are packed rows like the others.
# (All of that on an 8 GiB table; for larger tables see LARGE_TILE_MIN_SHARE.)
# Swept again on one H100 (2026-12-06, 9188997, benchmarks/results/model_lookup/history.jsonl,
# the "host launch sweep" line): 17 sorted launches, 1.05M and 1.57M rows of a 32 GiB table,
# taking turns with vLLM 0.34's sorted launch: this one was the fastest or within 0.4% of it
# (1.13-1.17x vLLM); 8, 4, 2, 1 programs per SM 1.04-1.06x down to 0.95-0.98x, 4 warps
# 0.93-1.00x, the 16-row launches 0.73-1.05x, ids sorted by row instead of by block
# 0.1-1.1% slower: it stays. At 1.57M rows of a 16 GiB table (2.4% of its rows) it was
# 0.995x (packed) and 1.045x (bf16), the best launch 0.998x and 1.046x (vLLM's two timings
# there 2.1-2.4% apart).
TILE_POLICY = {"hbm": (NEVER, NEVER), "peer": (NEVER, NEVER), "host": (262152, NEVER),
               "host_thp": (262152, NEVER)}
# Host tables: 128-row tiles only from this share of the table's rows looked up at once, too
# (`large_tile_window`). Sorted reads of a lookup are table rows / lookup rows apart; the
# sparser they are, the more each row needs a translation of its own, and the fewer rows in
# flight win. Measured on one H200 (2026-12-02, benchmarks/results/host_gap/, 8 and 32 GiB
# tables): 128-row tiles won at 0.8% of the rows (262K of 8 GiB, 1M of 32 GiB: 1.12-1.18x
# vLLM's sorted launch there) and lost at 0.2% (65K of 8 GiB; 262K of 32 GiB, 0.92x vLLM's
# sorted launch) and at 0.4% (524K of 32 GiB, by 1.6%): 1/128 keeps the 8 GiB table's 262K
# threshold and moves a 32 GiB table's to 1M rows (a 94 GiB DeepSeek-V4.1-Flash table's: 3M).
# That 8 GiB gap itself belongs to dense tables: a 1.57M-row lookup reads 4.8% of its rows, and
# vLLM's scales of 4 rows share a sector; from a 32 GiB table the patch path is 1.12-1.20x
# vLLM's sorted launch from 1M rows (docs/lookup_experiments.md).
LARGE_TILE_MIN_SHARE = {"host": 1 / 128, "host_thp": 1 / 128}
# Host tables (small pages and THP alike on this machine): sorted ids make consecutive reads
# share host page translations; 3-4.5x faster from 32K rows, slower below (sort cost).
SORT_MIN_ROWS = {"hbm": NEVER, "peer": NEVER, "host": 32784, "host_thp": 32784}
# How sorted lookups order their ids (kernels/lookup_order.py): "sort" (torch.sort, by row) or
# "blocks" (a counting sort by table block of >= 256 KiB: 3 kernels instead of torch.sort's
# ~a dozen nodes, so less GPU time, 0.035-0.143 vs 0.068-0.154 ms at 65K-1.57M rows; reads
# within one block share their translations as well as sorted ones do, so whole sorted
# lookups are within run-to-run noise of each other; docs/lookup_experiments.md).
ORDER_BY = {"hbm": "sort", "peer": "sort", "host": "blocks", "host_thp": "blocks"}
# Rows wider than MAX_TILE_BYTES / 128 get smaller large tiles (2 KiB rows in 128-row tiles
# were 4.7x slower than 16-row tiles: register pressure).
MAX_TILE_BYTES = 128 * 264


def split_words(config: TileConfig, head_dim: int, out: str) -> int:
    """The kernel's SPLIT_WORDS for a launch: 8-byte words up to the boundary each row's loads
    are cut at (4 = sector, 16 = line; 0 = not cut). Only 264-byte rows (head_dim 256) are
    cut, and bf16 / packed output only where `config.split_bf16` / `config.split_packed`."""
    if head_dim != SPLIT_HEAD_DIM or not (config.split_bf16 if out == "bf16"
                                          else config.split_packed):
        return 0
    return config.split_bytes // 8


def large_block_rows(row_bytes: int) -> int:
    """Rows per large tile: 128, or fewer (a power of two >= 16) for rows wider than 264 B."""
    rows = 128
    while rows > 16 and rows * row_bytes > MAX_TILE_BYTES:
        rows //= 2
    return rows


def large_tile_window(placement: str, table_rows: int = 0) -> tuple[int, int]:
    """[min, max) rows looked up at once that get large tiles, for a table of `table_rows`
    rows (0: unknown, TILE_POLICY's window alone)."""
    if placement not in TILE_POLICY:
        raise ValueError(f"placement is {placement!r}; expected one of {PLACEMENTS}")
    min_rows, max_rows = TILE_POLICY[placement]
    share = LARGE_TILE_MIN_SHARE.get(placement)
    if share is not None:
        min_rows = max(min_rows, math.ceil(share * table_rows))
    return min_rows, max_rows


def choose_block_rows(num_rows_looked_up: int, row_bytes: int, placement: str,
                      table_rows: int = 0) -> int:
    """Tile rows for a lookup: large tiles inside the placement's measured window
    (`large_tile_window`), 16-row tiles elsewhere."""
    min_rows, max_rows = large_tile_window(placement, table_rows)
    if min_rows <= num_rows_looked_up < max_rows:
        return large_block_rows(row_bytes)
    return 16


def tile_config(placement: str, block_rows: int) -> TileConfig:
    """The measured launch for 16 or 128 rows; others keep ~128 rows per SM in flight."""
    tuned = TILE_CONFIGS[placement].get(block_rows)
    if tuned is not None:
        return tuned
    return TileConfig(block_rows, max(1, 128 // block_rows), 4 if block_rows <= 32 else 8)

"""Launch policy of the Engram lookup kernel (kernels/lookup.py): tile rows, persistent grid,
warps, prefetch and id sorting per table placement, as measured. Pure Python, no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("hbm", "host", "host_thp", "peer")
# Cache hints Triton accepts (tl.load cache_modifier / eviction_policy, tl.store cache_modifier).
LOAD_CACHE = ("", ".ca", ".cg", ".cv")
LOAD_EVICT = ("", "evict_first", "evict_last")
STORE_CACHE = ("", ".wb", ".cg", ".cs", ".wt")
SPLIT_BYTES = (0, 32, 128)  # where row loads are cut: nowhere, a sector, a line
SPLIT_HEAD_DIM = 256  # rows cut: 264 bytes = 33 eight-byte words
PIPELINE_STAGES = (0, 2, 3, 4, 5, 6, 8)  # TileConfig.num_stages: 0 = no software pipeline


@dataclass(frozen=True)
class TileConfig:
    """How one lookup is launched: rows per tile, persistent programs per SM, warps per
    program, whether the next tile's loads are issued before this tile's stores, the cache
    hints of the table loads and output stores (PTX cache modifiers / L2 eviction), and, for
    peer tables, whether each row's owner is found by a 32-bit division (used only where
    rows_per_rank x P < 2^31; else 64-bit) and where each 264-byte row's loads are cut:
    `split_bytes` 0 = one values load + one scale-word load, 32 / 128 = two loads cut at the
    row's first 32-byte sector / 128-byte line boundary (no sector / no line asked for twice;
    other row widths ignore it; cut launches take the load hints but not `store_cache`);
    `split_bf16` False keeps bf16 output's loads uncut; `num_stages` >= 2 keeps that many
    tiles of each program in flight through Triton's software pipeline (cp.async copies into
    shared memory; 0 = plain loads into registers; not with `prefetch`, its register form)."""

    block_rows: int
    programs_per_sm: int
    num_warps: int
    prefetch: bool = False
    load_cache: str = ""
    load_evict: str = ""
    store_cache: str = ""
    rows_32: bool = False
    split_bytes: int = 0
    split_bf16: bool = True
    num_stages: int = 0

    def __post_init__(self):
        if self.block_rows & (self.block_rows - 1) or not 1 <= self.block_rows <= 512:
            raise ValueError(f"block_rows is {self.block_rows}; expected a power of two in "
                             "[1, 512]")
        if self.programs_per_sm < 1 or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"programs_per_sm {self.programs_per_sm} / num_warps "
                             f"{self.num_warps}; expected >= 1 / a power of two <= 16")
        if self.split_bytes not in SPLIT_BYTES:
            raise ValueError(f"split_bytes is {self.split_bytes!r}; expected one of {SPLIT_BYTES}")
        if self.num_stages not in PIPELINE_STAGES or (self.num_stages and self.prefetch):
            raise ValueError(f"num_stages is {self.num_stages!r} with prefetch {self.prefetch}; "
                             f"expected one of {PIPELINE_STAGES}, and 0 with prefetch")
        for name, value, allowed in (("load_cache", self.load_cache, LOAD_CACHE),
                                     ("load_evict", self.load_evict, LOAD_EVICT),
                                     ("store_cache", self.store_cache, STORE_CACHE)):
            if value not in allowed:
                raise ValueError(f"{name} is {value!r}; expected one of {allowed}")


# Measured on one H200 (benchmarks/results/lookup_h200.md; sweep in lookup_sweep_h200.json):
# the best 16-row and 128-row launch per placement (rows x programs per SM ~ rows in flight),
# the lookup sizes [min, max) where 128-row tiles won by more than 2% (TILE_POLICY) and, for
# host tables, the size from which sorting the ids first won. With a grid of 8 programs per SM,
# 16-row tiles keep as many rows in flight as one 128-row tile per SM and were never slower by
# more than noise in HBM, over NVLink or from THP host memory; with vLLM's one program per SM,
# 128-row tiles are 2.7x faster (the sweep has both). Peer launches find each row's owner by a
# 32-bit division where every id fits (2% faster over NVLink, 301 vs 294 GB/s at 1M rows,
# results/peer_gpu_small_h200x2_c241878.md), and load each 264-byte row in two pieces cut at
# its first 128-byte line boundary, so each of its three lines is asked for once: 319 vs 303
# GB/s of remote rows at 1.57M rows (prefetch off: with it, 282; cut at a 32-byte sector: 311;
# results/peer_gpu_small_h200x2_b44f07d.md). Cut loads also won from host tables (line: 9.3-9.6
# vs 10.5-11.1 ms at 1.57M rows, both tiles and outputs) and for packed output from HBM
# (sector: 0.255 vs 0.277 ms; bf16 output 21% slower cut, so kept whole; results/
# lookup_split_h200_817b594.md). Sorted lookups of a small-page host
# table between 64K and 1M rows were 4-18% faster with 128-row tiles (1M and up: 5-13% slower).
NEVER = 1 << 62
TILE_CONFIGS = {
    "hbm": {16: TileConfig(16, 8, 4, split_bytes=32, split_bf16=False),
            128: TileConfig(128, 1, 8, prefetch=True)},
    "peer": {16: TileConfig(16, 16, 4, rows_32=True, split_bytes=128),
             128: TileConfig(128, 1, 8, True, rows_32=True)},
    "host": {16: TileConfig(16, 1, 2, True),
             128: TileConfig(128, 16, 8, True, split_bytes=128)},
    "host_thp": {16: TileConfig(16, 4, 4, True, split_bytes=128),
                 128: TileConfig(128, 1, 8, True, split_bytes=128)},
}
# With cut loads (results/lookup_h200x2_e205eff.md, lookup_h200_d724f29.md) sorted host
# lookups with 128-row tiles were 5-16% faster at 262K rows, 11% slower at 64K, and from 1M
# rows 0.4-3% faster in 12 of 16 (size, output, page size, run) cases, at most 1.1% slower in
# the other four: 128-row tiles from 262K rows on.
# NOTES (small-page host tables, against vLLM 0.33's sorted launch in the same run, the lookup
# as the model calls it; results/lookup_host_vs_vllm_h200_beabf19.md): sorted 65K-row lookups
# read 11 GB/s of the 55 GB/s host-to-device ceiling (bound by address translation, not by
# PCIe): fewer rows in flight touch fewer pages at once; one 16-row program per SM (vLLM's
# own grid) with 2 warps and the register prefetch, loads uncut: 1.583 / 1.588 ms (packed /
# bf16) vs vLLM's 1.600 / 1.660 and 1.714 / 1.668 with 4 programs per SM and cut loads
# (unsorted 16K rows: equal, 0.568).
# From 262K rows the sorted reads stream (45 GB/s at 1.57M rows): 16 programs of 128 rows
# per SM (8 resident at 8 warps; a program then holds about one tile at 262K rows, so the
# hardware balances the tail): 2.92 / 2.88 ms vs 3.06 / 3.07 with 8 per SM at 262K rows,
# 0.1-0.2% faster from 1M rows. There no launch of the 100 swept reaches vLLM's sorted launch
# (best 9.280 vs 9.180 ms at 1.57M rows, 0.6-1.3% slower from 1M rows); a likely cause, not
# measured: 264-byte rows cross a 4 KiB page 6% of the time, vLLM's 256-byte value rows never.
TILE_POLICY = {"hbm": (NEVER, NEVER), "peer": (NEVER, NEVER), "host": (262152, NEVER),
               "host_thp": (262152, NEVER)}
# Host tables (small pages and THP alike on this machine): sorted ids make consecutive reads
# share host page translations; 3-4.5x faster from 32K rows, slower below (sort cost).
SORT_MIN_ROWS = {"hbm": NEVER, "peer": NEVER, "host": 32784, "host_thp": 32784}
# How sorted lookups order their ids (kernels/lookup_order.py): "sort" (torch.sort, by row) or
# "blocks" (a counting sort by table block of >= 256 KiB: 3 kernels instead of torch.sort's
# ~a dozen nodes; alone 0.035-0.143 vs 0.068-0.154 ms GPU at 65K-1.57M rows, whole sorted
# lookups within run-to-run noise of each other, results/lookup_order_h200_a404965.md).
ORDER_BY = {"hbm": "sort", "peer": "sort", "host": "blocks", "host_thp": "blocks"}
# Pinned host tables' layout as the DeepSeek patch allocates them (engram_ray.tables.backends.host_memory):
# "packed" rows or vLLM's own "split" layout (values [rows, 256] + scales [rows, 8], the
# kernel's TABLE_LAYOUT 1). Measured against vLLM 0.33's sorted launch in one run each
# (benchmarks/lookup_host_layout_study.py, one H200, results/lookup_host_layout_h200_*.md):
# split values loaded as [R, 256] 8-byte vectors (ffd7124) were 0.6-1.3% faster than packed
# rows from 1M rows (1.57M packed: 9.239 vs 9.367 ms; vLLM 9.215) and equal at 262K, but 16-18%
# slower at 65K (16-row tiles: 1.776 vs 1.498; vLLM 1.585); as [R, 8, 32] 16-byte vectors
# (df6c8be) 2x slower from 262K. Packed rows 15 per 4 KiB page (no row across a page): 1.3x
# slower from 1M rows (8-byte loads, ffd7124). Huge pages (THP, 100% backed): no change
# for either kernel (df6c8be). So host tables stay packed.
HOST_TABLE_LAYOUT = "packed"
# Rows wider than MAX_TILE_BYTES / 128 get smaller large tiles (2 KiB rows in 128-row tiles
# were 4.7x slower than 16-row tiles: register pressure).
MAX_TILE_BYTES = 128 * 264


def split_words(config: TileConfig, head_dim: int, out: str) -> int:
    """The kernel's SPLIT_WORDS for a launch: 8-byte words up to the boundary each row's loads
    are cut at (4 = sector, 16 = line; 0 = not cut). Only 264-byte rows (head_dim 256) are
    cut, and bf16 output only where `config.split_bf16`."""
    if head_dim != SPLIT_HEAD_DIM or (out == "bf16" and not config.split_bf16):
        return 0
    return config.split_bytes // 8


def large_block_rows(row_bytes: int) -> int:
    """Rows per large tile: 128, or fewer (a power of two >= 16) for rows wider than 264 B."""
    rows = 128
    while rows > 16 and rows * row_bytes > MAX_TILE_BYTES:
        rows //= 2
    return rows


def choose_block_rows(num_rows_looked_up: int, row_bytes: int, placement: str) -> int:
    """Tile rows for a lookup: large tiles inside the placement's measured [min, max) rows,
    16-row tiles elsewhere."""
    if placement not in TILE_POLICY:
        raise ValueError(f"placement is {placement!r}; expected one of {PLACEMENTS}")
    min_rows, max_rows = TILE_POLICY[placement]
    if min_rows <= num_rows_looked_up < max_rows:
        return large_block_rows(row_bytes)
    return 16


def tile_config(placement: str, block_rows: int) -> TileConfig:
    """The measured launch for 16 or 128 rows; others keep ~128 rows per SM in flight."""
    tuned = TILE_CONFIGS[placement].get(block_rows)
    if tuned is not None:
        return tuned
    return TileConfig(block_rows, max(1, 128 // block_rows), 4 if block_rows <= 32 else 8)

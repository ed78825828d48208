"""Engram row lookup: Triton kernel + launcher (oracle: `engram_ray.reference.lookup_reference`).

Gathers packed rows (`head_dim` FP8 e4m3 bytes + `head_dim // 32` ue8m0 scale bytes) for row
ids `[num_tokens, num_cols]` from a table in local HBM, in pinned host memory (read through
UVA) or split over a peer group (per-rank slice base addresses), into packed bytes
`[num_tokens, num_cols, row_bytes]` or bf16 `[num_tokens, num_cols, head_dim]`.

NOTES:
- A row is 264 = 33 x 8 bytes, so every row and its scale word start 8-byte aligned but odd rows
  are not 16-byte aligned: value bytes move as 8-byte vectors (one warp-wide load = one row's
  256 value bytes) and the 8 scale bytes of a row as one uint64 word.
- Values are tiled `[BLOCK_R, NUM_SCALES, 32]`: the scale of a 32-value group is computed once
  per (row, group) and broadcast along the last axis inside each thread, with no shuffles.
- Random row reads are latency-bound: what matters is rows in flight per SM (tile rows x
  resident programs). 16-row tiles on 8 programs per SM and one 128-row tile per SM both keep
  ~33 KB in flight; the measured launches and thresholds live in `TILE_CONFIGS`/`TILE_POLICY`.
- Over NVLink and PCIe every memory request costs: a launch may cut each 264-byte row's loads
  at its first 128-byte line (or 32-byte sector) boundary, so each line is asked for once
  (`TileConfig.split_bytes`, `lookup_tiles.load_tile_split`).
"""

from __future__ import annotations

from dataclasses import replace

import math

import torch
import triton
import triton.language as tl

from engram_ray.host_memory import is_huge_page_backed
from engram_ray.kernels.lookup_tiles import (load_tile, load_tile_split, store_tile,
                                             store_tile_split)
from engram_ray.kernels.lookup_policy import (  # noqa: F401  (re-exported: the policy API)
    MAX_TILE_BYTES, NEVER, PLACEMENTS, SORT_MIN_ROWS, SPLIT_HEAD_DIM, TILE_CONFIGS, TILE_POLICY,
    TileConfig, choose_block_rows, large_block_rows, split_words, tile_config)
from engram_ray.reference import row_bytes_for

OUTPUTS = {"packed": torch.uint8, "bf16": torch.bfloat16}
SCALE_WORDS = {1: tl.uint8, 2: tl.uint16, 4: tl.uint32, 8: tl.uint64}
# Non-empty while Triton accepts pinned host tensors as pointers (it resolves their UVA address).
_HOST_POINTERS_OK = [True]


@triton.jit(do_not_specialize=["num_rows", "rows_per_rank", "num_programs"])
def _engram_lookup_kernel(
    src,            # TABLE: packed uint8 [rows, ROW_BYTES]; PEER: int64 [P] slice base addresses
    row_ids,        # int64/int32 [num_rows]; < 0 = no row
    dst_rows,       # int64 [num_rows] output row of each id (IS_SORTED only)
    out,            # uint8 [num_rows, ROW_BYTES] or bf16 [num_rows, HEAD_DIM]
    num_rows,
    rows_per_rank,  # PEER only
    num_programs,
    HEAD_DIM: tl.constexpr,
    SCALE_WORD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_PEER: tl.constexpr,
    IS_SORTED: tl.constexpr,
    IS_BF16: tl.constexpr,
    PREFETCH: tl.constexpr,
    ROW_ALIGN: tl.constexpr,  # gcd(ROW_BYTES, 8): 8 for 264-byte rows (8-byte vector loads)
    LOAD_CACHE: tl.constexpr = "",   # table loads' cache modifier ("" or ".cg": L2 only)
    LOAD_EVICT: tl.constexpr = "",   # table loads' L2 eviction policy ("" or "evict_first")
    STORE_CACHE: tl.constexpr = "",  # output stores' cache modifier ("" or ".cs": streaming)
    ROWS_32: tl.constexpr = False,   # PEER: rows_per_rank x P < 2^31 (32-bit owner division)
    SPLIT_WORDS: tl.constexpr = 0,   # 264-byte rows: 4 / 16 = loads cut at a sector / line
    NUM_STAGES: tl.constexpr = 0,    # > 1: tiles in flight through cp.async (not with PREFETCH)
):
    """Persistent loop over tiles of BLOCK_R looked-up rows. PREFETCH issues the next tile's
    loads before this tile's stores, keeping row reads in flight while results drain."""
    num_tiles = tl.cdiv(num_rows, BLOCK_R)
    tile = tl.program_id(0)
    if SPLIT_WORDS:
        if PREFETCH:
            dst, in_range, head_words, head, body = load_tile_split(
                src, row_ids, dst_rows, tile, num_rows, rows_per_rank, BLOCK_R, IS_PEER,
                IS_SORTED, LOAD_CACHE, LOAD_EVICT, ROWS_32, SPLIT_WORDS)
            for _ in tl.range(tile, num_tiles, num_programs):
                tile += num_programs  # past the end: every load of the tile is masked off
                next_dst, next_in_range, next_head_words, next_head, next_body = \
                    load_tile_split(src, row_ids, dst_rows, tile, num_rows, rows_per_rank,
                                    BLOCK_R, IS_PEER, IS_SORTED, LOAD_CACHE, LOAD_EVICT,
                                    ROWS_32, SPLIT_WORDS)
                store_tile_split(out, dst, in_range, head_words, head, body, IS_BF16,
                                 SPLIT_WORDS)
                dst, in_range, head_words = next_dst, next_in_range, next_head_words
                head, body = next_head, next_body
        else:
            for tile in tl.range(tile, num_tiles, num_programs, num_stages=NUM_STAGES or None):
                dst, in_range, head_words, head, body = load_tile_split(
                    src, row_ids, dst_rows, tile, num_rows, rows_per_rank, BLOCK_R, IS_PEER,
                    IS_SORTED, LOAD_CACHE, LOAD_EVICT, ROWS_32, SPLIT_WORDS)
                store_tile_split(out, dst, in_range, head_words, head, body, IS_BF16,
                                 SPLIT_WORDS)
    elif PREFETCH:
        dst, in_range, values, word = load_tile(
            src, row_ids, dst_rows, tile, num_rows, rows_per_rank, HEAD_DIM, SCALE_WORD,
            BLOCK_R, IS_PEER, IS_SORTED, ROW_ALIGN, LOAD_CACHE, LOAD_EVICT, ROWS_32)
        for _ in tl.range(tile, num_tiles, num_programs):
            tile += num_programs  # past the end: every load of the tile is masked off
            next_dst, next_in_range, next_values, next_word = load_tile(
                src, row_ids, dst_rows, tile, num_rows, rows_per_rank, HEAD_DIM, SCALE_WORD,
                BLOCK_R, IS_PEER, IS_SORTED, ROW_ALIGN, LOAD_CACHE, LOAD_EVICT, ROWS_32)
            store_tile(out, dst, in_range, values, word, HEAD_DIM, SCALE_WORD, IS_BF16, ROW_ALIGN,
                       STORE_CACHE)
            dst, in_range, values, word = next_dst, next_in_range, next_values, next_word
    else:
        for tile in tl.range(tile, num_tiles, num_programs, num_stages=NUM_STAGES or None):
            dst, in_range, values, word = load_tile(
                src, row_ids, dst_rows, tile, num_rows, rows_per_rank, HEAD_DIM, SCALE_WORD,
                BLOCK_R, IS_PEER, IS_SORTED, ROW_ALIGN, LOAD_CACHE, LOAD_EVICT, ROWS_32)
            store_tile(out, dst, in_range, values, word, HEAD_DIM, SCALE_WORD, IS_BF16, ROW_ALIGN,
                       STORE_CACHE)


def table_placement(table: torch.Tensor | None, peer_bases: torch.Tensor | None) -> str:
    """'hbm', 'host' (pinned small pages), 'host_thp' (registered huge pages) or 'peer'."""
    if peer_bases is not None:
        return "peer"
    if table.is_cuda:
        return "hbm"
    return "host_thp" if is_huge_page_backed(table) else "host"


def enable_peer_access(device: int, peer: int) -> None:
    """Let kernels on GPU `device` read plain CUDA allocations of GPU `peer`
    (cudaDeviceEnablePeerAccess; VMM-mapped slices get access through cuMemSetAccess instead)."""
    from cuda.bindings import runtime
    if not torch.cuda.can_device_access_peer(device, peer):
        raise RuntimeError(f"GPU {device} cannot access GPU {peer} (no peer path)")
    torch.cuda.synchronize(device)
    _, previous = runtime.cudaGetDevice()
    runtime.cudaSetDevice(device)
    (error,) = runtime.cudaDeviceEnablePeerAccess(peer, 0)
    runtime.cudaSetDevice(previous)
    if error not in (runtime.cudaError_t.cudaSuccess,
                     runtime.cudaError_t.cudaErrorPeerAccessAlreadyEnabled):
        raise RuntimeError(f"cudaDeviceEnablePeerAccess({peer}) on GPU {device}: {error}")


def _check_args(row_ids, head_dim, table, peer_bases, rows_per_rank, out) -> None:
    if out not in OUTPUTS:
        raise ValueError(f"out is {out!r}; expected one of {tuple(OUTPUTS)}")
    if head_dim // 32 not in SCALE_WORDS or head_dim % 32:
        # NOTES: rows are head_dim + head_dim / 32 bytes; the kernel tells Triton their real
        # alignment (gcd(row bytes, 8)), so 264-byte rows load as 8-byte vectors and 33-, 66- and
        # 132-byte rows as narrower ones; the scale word is as wide as the row's alignment.
        raise ValueError(f"head_dim is {head_dim}; the kernel supports "
                         f"{sorted(32 * n for n in SCALE_WORDS)}; use "
                         "engram_ray.reference.lookup_reference otherwise")
    if row_ids.dim() != 2 or row_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"row_ids are {row_ids.dtype} {tuple(row_ids.shape)}; expected int64 "
                         "[num_tokens, num_cols]")
    if (table is None) == (peer_bases is None):
        raise ValueError("pass exactly one of table= (packed [rows, row_bytes]) or "
                         "peer_bases= (int64 CUDA [P] slice addresses) with rows_per_rank=")
    if table is not None:
        if table.dtype != torch.uint8 or table.dim() != 2 or not table.is_contiguous():
            raise ValueError(f"table is {table.dtype} {tuple(table.shape)}; expected a "
                             "contiguous packed uint8 [rows, row_bytes] tensor")
        if table.shape[1] != row_bytes_for(head_dim):
            raise ValueError(f"table rows are {table.shape[1]} bytes; expected "
                             f"{row_bytes_for(head_dim)} for head_dim {head_dim}")
        if not (table.is_cuda or table.is_pinned()):
            raise ValueError("table is in pageable host memory; expected a CUDA tensor or "
                             "pinned host memory (engram_ray.host_memory.allocate_host_table)")
    else:
        if peer_bases.dtype != torch.int64 or peer_bases.dim() != 1 or not peer_bases.is_cuda:
            raise ValueError(f"peer_bases is {peer_bases.dtype} {tuple(peer_bases.shape)} on "
                             f"{peer_bases.device}; expected int64 CUDA [P]")
        if not rows_per_rank or rows_per_rank < 1:
            raise ValueError(f"rows_per_rank is {rows_per_rank!r}; expected a positive int "
                             "with peer_bases")


def _check_row_ids(ids: torch.Tensor, shape: torch.Size, num_table_rows: int) -> None:
    """ValueError naming the first of `ids` (flattened `shape`) outside [-1, num_table_rows)."""
    bad = (ids < -1) | (ids >= num_table_rows)
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        where = (position // shape[-1], position % shape[-1])
        raise ValueError(f"row_ids[{where[0]}, {where[1]}] is {int(ids[position])}; expected -1 "
                         f"(no row) or a row of the table, 0..{num_table_rows - 1}; ids come "
                         "from the n-gram hash (engram_ray.hashing): check that the table "
                         "and the hash use the same layout")


def _out_device(out_device, row_ids, table, peer_bases) -> torch.device:
    if out_device is not None:
        device = torch.device(out_device)
        if device.type != "cuda":
            raise ValueError(f"out_device is {device}; expected a CUDA device")
        return device if device.index is not None else torch.device(
            "cuda", torch.cuda.current_device())
    for tensor in (row_ids, peer_bases, table):
        if tensor is not None and tensor.is_cuda:
            return tensor.device
    return torch.device("cuda", torch.cuda.current_device())


def engram_lookup(row_ids: torch.Tensor, *, head_dim: int, table: torch.Tensor | None = None,
                  peer_bases: torch.Tensor | None = None, rows_per_rank: int | None = None,
                  out: str = "packed", block_rows: int | None = None,
                  out_device: torch.device | str | None = None, sort_rows: bool | None = None,
                  programs_per_sm: int | None = None, num_warps: int | None = None,
                  prefetch: bool | None = None, into: torch.Tensor | None = None,
                  check_ids: bool = False) -> torch.Tensor:
    """Look up rows; bitwise equal to `lookup_reference` / `lookup_reference_split`.

    row_ids: int64 `[num_tokens, num_cols]`, -1 = no row (zeros). Ids must be < table rows.
    table: packed uint8 `[rows, row_bytes]`, CUDA or pinned host (read through UVA).
    peer_bases: int64 CUDA `[P]`: 16-byte aligned base address of each rank's packed slice
        `[rows_per_rank, row_bytes]`, mapped on `out_device`; row r is local row
        `r % rows_per_rank` of rank `r // rows_per_rank`.
    Returns on `out_device` (default: row_ids', peer_bases' or table's CUDA device):
    uint8 `[num_tokens, num_cols, row_bytes]` or bf16 `[num_tokens, num_cols, head_dim]`.
    block_rows / programs_per_sm / num_warps / prefetch: None = the measured policy
    (`choose_block_rows`, `TILE_CONFIGS`); prefetch=True replaces a pipelined launch's
    cp.async stages (`TileConfig.num_stages`) by the register prefetch.
    sort_rows: None = policy (`SORT_MIN_ROWS`; the output is identical either way).
    into: optional preallocated output (contiguous, the shape and dtype above) to write.
    check_ids: refuse ids outside [-1, table rows) (peer: rows_per_rank x P) with a ValueError
        naming the first one, before launching; costs a device sync, so the serving path
        (ids from the n-gram hash, in range by construction) leaves it off. Unchecked, such
        an id reads whatever memory it points at.
    """
    _check_args(row_ids, head_dim, table, peer_bases, rows_per_rank, out)
    device = _out_device(out_device, row_ids, table, peer_bases)
    row_bytes = row_bytes_for(head_dim)
    width = row_bytes if out == "packed" else head_dim
    shape = (*row_ids.shape, width)
    result = into if into is not None else torch.empty(shape, dtype=OUTPUTS[out], device=device)
    if (result.shape != shape or result.dtype != OUTPUTS[out] or result.device != device
            or not result.is_contiguous()):
        raise ValueError(f"into is {result.dtype} {tuple(result.shape)} on {result.device}; "
                         f"expected contiguous {OUTPUTS[out]} {shape} on {device}")
    ids = row_ids.to(device).reshape(-1)
    num_rows = ids.numel()
    if num_rows == 0:
        return result
    if num_rows >= 1 << 30:
        raise ValueError(f"lookup of {num_rows} rows; expected fewer than 2^30 per call")
    if check_ids:
        _check_row_ids(ids, row_ids.shape, table.shape[0] if table is not None
                       else rows_per_rank * peer_bases.numel())
    placement = table_placement(table, peer_bases)
    config = tile_config(placement, block_rows or choose_block_rows(num_rows, row_bytes,
                                                                     placement))
    config = replace(config, programs_per_sm=programs_per_sm or config.programs_per_sm,
                     num_warps=num_warps or config.num_warps,
                     prefetch=config.prefetch if prefetch is None else prefetch,
                     num_stages=0 if prefetch else config.num_stages)
    if sort_rows is None:
        sort_rows = num_rows >= SORT_MIN_ROWS[placement]
    dst_rows = ids
    if sort_rows:
        ids, dst_rows = ids.sort()
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    num_programs = max(1, min(triton.cdiv(num_rows, config.block_rows),
                              num_sms * config.programs_per_sm))
    if table is not None and not table.is_cuda and not _HOST_POINTERS_OK:
        # Triton refused a pinned host pointer once: address the table as a one-rank peer table.
        peer_bases = torch.tensor([table.data_ptr()], dtype=torch.int64, device=device)
        table, rows_per_rank = None, table.shape[0]
    launch = dict(dst_rows=dst_rows, out=result, num_rows=num_rows,
                  rows_per_rank=rows_per_rank or 1, num_programs=num_programs,
                  HEAD_DIM=head_dim, SCALE_WORD=SCALE_WORDS[head_dim // 32],
                  BLOCK_R=config.block_rows, IS_SORTED=bool(sort_rows), IS_BF16=out == "bf16",
                  PREFETCH=config.prefetch, ROW_ALIGN=math.gcd(row_bytes_for(head_dim), 8),
                  LOAD_CACHE=config.load_cache, LOAD_EVICT=config.load_evict,
                  STORE_CACHE=config.store_cache, num_warps=config.num_warps,
                  ROWS_32=peer_bases is not None and config.rows_32
                  and (rows_per_rank or 1) * peer_bases.numel() < 2**31,
                  SPLIT_WORDS=split_words(config, head_dim, out), NUM_STAGES=config.num_stages)
    with torch.cuda.device(device):
        try:
            _engram_lookup_kernel[(num_programs,)](
                table if table is not None else peer_bases, ids,
                IS_PEER=peer_bases is not None, **launch)
        except ValueError as exc:
            if table is None or table.is_cuda or "cannot be accessed" not in str(exc):
                raise
            _HOST_POINTERS_OK.clear()
            return engram_lookup(row_ids, head_dim=head_dim, table=table, out=out,
                                 block_rows=block_rows, out_device=device, sort_rows=sort_rows,
                                 programs_per_sm=programs_per_sm, num_warps=num_warps,
                                 prefetch=prefetch, into=result)
    return result

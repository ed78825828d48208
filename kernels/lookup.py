"""Engram row lookup: `engram_lookup` (oracle: `engram_ray.model.reference.lookup_reference`); the
Triton kernel is in lookup_kernel.py, its prepared launches (what serving calls) in
lookup_launch.py.

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

import torch

from engram_ray.kernels.lookup_kernel import SCALE_WORDS, _engram_lookup_kernel  # noqa: F401
from engram_ray.kernels.lookup_launch import (_HOST_POINTERS_OK,  # noqa: F401  (re-exported)
                                              LookupLauncher, check_table, table_placement)
from engram_ray.kernels.lookup_policy import (  # noqa: F401  (re-exported: the policy API)
    LARGE_TILE_MIN_SHARE, MAX_TILE_BYTES, NEVER, PLACEMENTS, SORT_MIN_ROWS, SPLIT_HEAD_DIM,
    TILE_CONFIGS, TILE_POLICY, TileConfig, choose_block_rows, large_block_rows,
    large_tile_window, split_words, tile_config)
from engram_ray.model.reference import row_bytes_for

OUTPUTS = {"packed": torch.uint8, "bf16": torch.bfloat16}


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
    check_table(head_dim, table, peer_bases, rows_per_rank)
    if row_ids.dim() != 2 or row_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"row_ids are {row_ids.dtype} {tuple(row_ids.shape)}; expected int64 "
                         "[num_tokens, num_cols]")


def _check_row_ids(ids: torch.Tensor, shape: torch.Size, num_table_rows: int) -> None:
    """ValueError naming the first of `ids` (flattened `shape`) outside [-1, num_table_rows)."""
    bad = (ids < -1) | (ids >= num_table_rows)
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        where = (position // shape[-1], position % shape[-1])
        raise ValueError(f"row_ids[{where[0]}, {where[1]}] is {int(ids[position])}; expected -1 "
                         f"(no row) or a row of the table, 0..{num_table_rows - 1}; ids come "
                         "from the n-gram hash (engram_ray.model.hashing): check that the table "
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
    (`choose_block_rows`, `TILE_CONFIGS`).
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
    ids = row_ids.to(device)
    if ids.numel() >= 1 << 30:
        raise ValueError(f"lookup of {ids.numel()} rows; expected fewer than 2^30 per call")
    if check_ids and ids.numel():
        _check_row_ids(ids.reshape(-1), row_ids.shape, table.shape[0] if table is not None
                       else rows_per_rank * peer_bases.numel())
    launcher = LookupLauncher(head_dim=head_dim, table=table, peer_bases=peer_bases,
                              rows_per_rank=rows_per_rank, device=device, block_rows=block_rows,
                              programs_per_sm=programs_per_sm, num_warps=num_warps,
                              prefetch=prefetch, sort_rows=sort_rows)
    return launcher(ids, result)

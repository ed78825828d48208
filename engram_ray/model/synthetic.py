"""Deterministic table contents for tests and benchmarks: row r's bytes are a function of r.

Rows are packed: `head_dim` FP8 e4m3 value bytes, then `head_dim // 32` ue8m0 scale bytes.
Value bytes never form the e4m3 NaN patterns (0x7F, 0xFF); scales stay within 2^-4..2^4, so a
dequantized row is always finite. Works on any torch device; generates in chunks so that a
94 GiB slice fills without a second copy.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_NAN_BITS = 0x7F
SCALE_BIAS = 127
SCALE_SPREAD = 4


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """32-bit integer hash (lowbias32) on int64 tensors holding values < 2^32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def synthetic_rows(start: int, end: int, head_dim: int, seed: int = 0,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Packed rows `[end - start, head_dim + head_dim // 32]` uint8 of global rows [start, end)."""
    num_scales = head_dim // 32
    row_bytes = head_dim + num_scales
    rows = torch.arange(start, end, dtype=torch.int64, device=device).unsqueeze(1)
    cols = torch.arange(row_bytes, dtype=torch.int64, device=device).unsqueeze(0)
    key = ((rows & _MASK32) * 0x9E3779B1 + (rows >> 32) * 0x85EBCA77
           + cols * 0xC2B2AE3D + seed * 0x27D4EB2F) & _MASK32
    bits = _mix32(key)
    values = bits[:, :head_dim] & 0xFF
    values = torch.where((values & _NAN_BITS) == _NAN_BITS, values ^ 0x01, values)
    scales = SCALE_BIAS - SCALE_SPREAD + bits[:, head_dim:] % (2 * SCALE_SPREAD + 1)
    return torch.cat([values, scales], dim=1).to(torch.uint8)


def fill_synthetic(table: torch.Tensor, first_row: int, head_dim: int, seed: int = 0,
                   chunk_rows: int = 1 << 20, on_chunk=None) -> None:
    """Fill packed `table[rows, row_bytes]` uint8 with global rows starting at `first_row`;
    `on_chunk(rows_done)` after each chunk (progress output)."""
    for begin in range(0, table.shape[0], chunk_rows):
        end = min(table.shape[0], begin + chunk_rows)
        table[begin:end] = synthetic_rows(first_row + begin, first_row + end, head_dim, seed,
                                          device=table.device)
        if on_chunk is not None:
            on_chunk(end)

"""Torch reference of the Engram row lookup: the oracle every lookup kernel is compared to.

A table row is `head_dim` FP8 e4m3 value bytes followed by `head_dim // 32` ue8m0 scale bytes,
stored packed as one uint8 table `[rows, row_bytes]` (row_bytes = 264 at head_dim 256).

A lookup takes row ids `[num_tokens, num_cols]` (int64; -1 = no row) and returns, per
(token, column), either the row's packed bytes (`out="packed"`, uint8
`[num_tokens, num_cols, row_bytes]`; zeros for -1) or the dequantized row (`out="bf16"`,
`[num_tokens, num_cols, head_dim]`; zeros for -1):

    bf16[t, c, d] = round_to_bf16( float32(value[d]) * 2^(scale[d // 32] - 127) )

fp8 -> fp32 is exact, the power of two is exact in fp32 (scale byte 0 is the fp32 subnormal
2^-127; 0xFF is the e8m0 NaN), so the product is exact unless it overflows or is subnormal,
and the single rounding is fp32 -> bf16 round-to-nearest-even. Kernels do the same
operations in the same order (no flush-to-zero), so outputs are bitwise equal.

Imports torch only (no Triton): runs on CPU and GPU.
"""

from __future__ import annotations

import torch

from engram_ray.model.layout import VALUES_PER_SCALE

OUTPUTS = ("packed", "bf16")

# FP8 e4m3fn NaN bit patterns (S.1111.111); ue8m0 NaN is 0xFF.
FP8_NAN_BITS = (0x7F, 0xFF)
UE8M0_NAN_BITS = 0xFF


def row_bytes_for(head_dim: int) -> int:
    """Packed row width: head_dim value bytes + head_dim // 32 scale bytes."""
    if head_dim <= 0 or head_dim % VALUES_PER_SCALE:
        raise ValueError(f"head_dim is {head_dim}; expected a positive multiple of "
                         f"{VALUES_PER_SCALE} (one ue8m0 scale per {VALUES_PER_SCALE} values)")
    return head_dim + head_dim // VALUES_PER_SCALE


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)


def pack_rows(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """values `[rows, head_dim]` (fp8 e4m3 or uint8), scales `[rows, head_dim // 32]`
    (uint8 or float8_e8m0fnu) -> packed uint8 table `[rows, row_bytes]`."""
    values, scales = _as_bytes(values), _as_bytes(scales)
    if values.dim() != 2 or scales.dim() != 2 or values.shape[0] != scales.shape[0]:
        raise ValueError(f"values {tuple(values.shape)} and scales {tuple(scales.shape)} must be "
                         "[rows, head_dim] and [rows, head_dim // 32] with equal rows")
    head_dim = values.shape[1]
    if scales.shape[1] != row_bytes_for(head_dim) - head_dim:
        raise ValueError(f"scales have {scales.shape[1]} columns; expected head_dim // 32 = "
                         f"{head_dim // VALUES_PER_SCALE}")
    return torch.cat([values, scales], dim=1)


def unpack_rows(table: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed `[..., row_bytes]` -> (values uint8 `[..., head_dim]`, scales uint8
    `[..., head_dim // 32]`), both views of `table`."""
    _check_packed(table, head_dim, "table")
    return table[..., :head_dim], table[..., head_dim:]


def dequantize_rows(packed: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Packed rows `[..., row_bytes]` -> bf16 `[..., head_dim]` (formula in the module doc)."""
    values, scales = unpack_rows(packed, head_dim)
    values = values.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    powers = scales.contiguous().view(torch.float8_e8m0fnu).to(torch.float32)
    powers = powers.repeat_interleave(VALUES_PER_SCALE, dim=-1)
    return (values * powers).to(torch.bfloat16)


def random_table(num_rows: int, head_dim: int, *, generator: torch.Generator | None = None,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Random packed table `[num_rows, row_bytes]`: every FP8 bit pattern except the NaNs
    (0x7F, 0xFF), every ue8m0 scale except the NaN (0xFF). Zeros would hide unwritten output."""
    row_bytes = row_bytes_for(head_dim)
    table = torch.randint(0, 256, (num_rows, row_bytes), dtype=torch.uint8,
                          generator=generator, device=device)
    values, scales = table[:, :head_dim], table[:, head_dim:]
    # Replace NaN patterns by their neighbours rather than redrawing: one pass, same shape.
    values.sub_(((values & 0x7F) == 0x7F).to(torch.uint8))
    scales.sub_((scales == UE8M0_NAN_BITS).to(torch.uint8))
    return table


def _check_packed(table: torch.Tensor, head_dim: int, name: str) -> None:
    if table.dtype != torch.uint8:
        raise ValueError(f"{name} has dtype {table.dtype}; expected packed uint8 rows "
                         "(use pack_rows(values, scales))")
    if table.shape[-1] != row_bytes_for(head_dim):
        raise ValueError(f"{name} rows are {table.shape[-1]} bytes; expected "
                         f"{row_bytes_for(head_dim)} for head_dim {head_dim}")


def _check_row_ids(row_ids: torch.Tensor, num_rows: int) -> None:
    if row_ids.dim() != 2 or row_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"row_ids are {row_ids.dtype} {tuple(row_ids.shape)}; expected int64 "
                         "[num_tokens, num_cols]")
    if row_ids.numel():
        low, high = int(row_ids.min()), int(row_ids.max())
        if low < -1 or high >= num_rows:
            raise ValueError(f"row_ids span [{low}, {high}]; expected -1 (no row) or a row in "
                             f"[0, {num_rows})")


def _finish(rows: torch.Tensor, head_dim: int, out: str) -> torch.Tensor:
    if out == "packed":
        return rows
    if out == "bf16":
        return dequantize_rows(rows, head_dim)
    raise ValueError(f"out is {out!r}; expected one of {OUTPUTS}")


def lookup_reference(table: torch.Tensor, row_ids: torch.Tensor, head_dim: int,
                     out: str = "packed") -> torch.Tensor:
    """Gather rows of a packed table `[rows, row_bytes]` (CPU, pinned host or CUDA).

    row_ids: int64 `[num_tokens, num_cols]`, -1 = no row (zeros out).
    Returns on `row_ids.device`: uint8 `[num_tokens, num_cols, row_bytes]` (out="packed") or
    bf16 `[num_tokens, num_cols, head_dim]` (out="bf16").
    """
    if out not in OUTPUTS:
        raise ValueError(f"out is {out!r}; expected one of {OUTPUTS}")
    _check_packed(table, head_dim, "table")
    if table.dim() != 2:
        raise ValueError(f"table is {tuple(table.shape)}; expected [rows, row_bytes]")
    _check_row_ids(row_ids, table.shape[0])
    ids = row_ids.reshape(-1).to(device=table.device, dtype=torch.int64)
    rows = table.index_select(0, ids.clamp(min=0))
    rows[ids < 0] = 0
    rows = rows.to(row_ids.device).view(*row_ids.shape, table.shape[1])
    return _finish(rows, head_dim, out)


def lookup_reference_split(slices: list[torch.Tensor], rows_per_rank: int,
                           row_ids: torch.Tensor, head_dim: int,
                           out: str = "packed") -> torch.Tensor:
    """Lookup in a table split across ranks: row r is row `r % rows_per_rank` of
    `slices[r // rows_per_rank]` (each slice packed `[<= rows_per_rank, row_bytes]`, on any
    device). Same ids, output and device rules as `lookup_reference`."""
    if out not in OUTPUTS:
        raise ValueError(f"out is {out!r}; expected one of {OUTPUTS}")
    if not slices or rows_per_rank <= 0:
        raise ValueError(f"got {len(slices)} slices and rows_per_rank {rows_per_rank}; "
                         "expected at least one slice and rows_per_rank > 0")
    for rank, piece in enumerate(slices):
        _check_packed(piece, head_dim, f"slices[{rank}]")
        if piece.dim() != 2 or piece.shape[0] > rows_per_rank:
            raise ValueError(f"slices[{rank}] is {tuple(piece.shape)}; expected "
                             f"[<= {rows_per_rank}, row_bytes]")
    _check_row_ids(row_ids, len(slices) * rows_per_rank)
    ids = row_ids.reshape(-1).to(torch.int64)
    rows = torch.zeros(ids.numel(), row_bytes_for(head_dim), dtype=torch.uint8,
                       device=row_ids.device)
    owner = torch.where(ids >= 0, ids // rows_per_rank, -1)
    for rank, piece in enumerate(slices):
        picked = (owner == rank).nonzero().squeeze(1)
        if not picked.numel():
            continue
        local = (ids[picked] - rank * rows_per_rank).to(piece.device)
        if int(local.max()) >= piece.shape[0]:
            raise ValueError(f"row_ids reach local row {int(local.max())} of slices[{rank}], "
                             f"which holds {piece.shape[0]} rows")
        rows[picked] = piece.index_select(0, local).to(row_ids.device)
    rows = rows.view(*row_ids.shape, rows.shape[1])
    return _finish(rows, head_dim, out)

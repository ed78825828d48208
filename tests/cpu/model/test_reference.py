"""The torch reference lookup (the kernels' oracle), checked against slow per-element code."""

import math
import struct

import pytest
import torch

from engram_ray.model.reference import (dequantize_rows, lookup_reference, lookup_reference_split,
                                        pack_rows, random_table, row_bytes_for, unpack_rows)

HEAD_DIM = 256
ROW_BYTES = 264


def _fp8_e4m3_value(byte: int) -> float:
    """Decode one FP8 e4m3fn byte by its definition (bias 7, no infinities)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0:
        return sign * mantissa * 2.0 ** -9
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def _bf16_bits(value: float) -> int:
    """fp32 (already exact) -> bf16 bits by round-to-nearest-even on the fp32 bit pattern."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    bits += 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16) & 0xFFFF


def _slow_dequantize(row: list[int], head_dim: int) -> list[int]:
    out = []
    for d in range(head_dim):
        product = _fp8_e4m3_value(row[d]) * 2.0 ** (row[head_dim + d // 32] - 127)
        # An fp32 product: exact unless it overflows (-> inf) or falls below 2^-149.
        out.append(_bf16_bits(product if abs(product) < 2.0 ** 128 else math.copysign(
            math.inf, product)))
    return out


def _ids(num_tokens, num_cols, num_rows, generator):
    ids = torch.randint(0, num_rows, (num_tokens, num_cols), generator=generator)
    ids[torch.rand(num_tokens, num_cols, generator=generator) < 0.1] = -1
    return ids


def test_row_bytes():
    assert row_bytes_for(256) == ROW_BYTES
    with pytest.raises(ValueError, match="multiple of 32"):
        row_bytes_for(100)


def test_random_table_has_no_nan_patterns():
    table = random_table(4096, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    values, scales = unpack_rows(table, HEAD_DIM)
    assert not ((values & 0x7F) == 0x7F).any()
    assert not (scales == 0xFF).any()
    assert len(values.unique()) == 254 and len(scales.unique()) == 255


def test_pack_unpack_round_trip():
    generator = torch.Generator().manual_seed(1)
    values = torch.randint(0, 256, (37, HEAD_DIM), dtype=torch.uint8, generator=generator)
    scales = torch.randint(0, 255, (37, HEAD_DIM // 32), dtype=torch.uint8, generator=generator)
    table = pack_rows(values.view(torch.float8_e4m3fn), scales)
    assert table.shape == (37, ROW_BYTES) and table.dtype == torch.uint8
    got_values, got_scales = unpack_rows(table, HEAD_DIM)
    assert torch.equal(got_values, values) and torch.equal(got_scales, scales)


@pytest.mark.parametrize("num_tokens", [0, 1, 15, 17])
def test_packed_lookup_matches_indexing(num_tokens):
    generator = torch.Generator().manual_seed(num_tokens)
    table = random_table(1000, HEAD_DIM, generator=generator)
    ids = _ids(num_tokens, 24, 1000, generator)
    if num_tokens:
        ids[0, 0], ids[-1, -1] = 0, 999  # first and last row
    got = lookup_reference(table, ids, HEAD_DIM)
    assert got.shape == (num_tokens, 24, ROW_BYTES) and got.dtype == torch.uint8
    for t in range(num_tokens):
        for c in range(24):
            expected = table[ids[t, c]] if ids[t, c] >= 0 else torch.zeros(ROW_BYTES,
                                                                          dtype=torch.uint8)
            assert torch.equal(got[t, c], expected)


def test_bf16_matches_definition_bit_for_bit():
    generator = torch.Generator().manual_seed(7)
    table = random_table(64, HEAD_DIM, generator=generator)
    # Cover the edges: every scale from subnormal products (0) to overflow (254).
    table[:, HEAD_DIM:] = torch.arange(64 * 8).view(64, 8).remainder(255).to(torch.uint8)
    ids = torch.arange(64).view(8, 8)
    ids[3, 3] = -1
    got = lookup_reference(table, ids, HEAD_DIM, out="bf16")
    assert got.shape == (8, 8, HEAD_DIM) and got.dtype == torch.bfloat16
    bits = got.view(torch.int16).to(torch.int64) & 0xFFFF
    for t in range(8):
        for c in range(8):
            row = ids[t, c]
            expected = [0] * HEAD_DIM if row < 0 else _slow_dequantize(table[row].tolist(),
                                                                        HEAD_DIM)
            assert bits[t, c].tolist() == expected


def test_dequantize_is_lookup_of_packed():
    generator = torch.Generator().manual_seed(3)
    table = random_table(500, HEAD_DIM, generator=generator)
    ids = _ids(33, 24, 500, generator)
    packed = lookup_reference(table, ids, HEAD_DIM)
    assert torch.equal(dequantize_rows(packed, HEAD_DIM).view(torch.int16),
                       lookup_reference(table, ids, HEAD_DIM, out="bf16").view(torch.int16))


@pytest.mark.parametrize("out", ["packed", "bf16"])
def test_split_of_no_rows(out):
    table = random_table(10, HEAD_DIM)
    got = lookup_reference_split([table[:5], table[5:]], 5, torch.empty(0, 24, dtype=torch.int64),
                                 HEAD_DIM, out=out)
    assert got.shape == (0, 24, ROW_BYTES if out == "packed" else HEAD_DIM)


@pytest.mark.parametrize("out", ["packed", "bf16"])
def test_split_matches_whole_table(out):
    generator = torch.Generator().manual_seed(5)
    rows_per_rank, num_ranks = 300, 4
    table = random_table(rows_per_rank * num_ranks - 17, HEAD_DIM, generator=generator)
    slices = list(table.split(rows_per_rank))
    ids = _ids(50, 24, table.shape[0], generator)
    ids[0, 0], ids[0, 1] = 0, table.shape[0] - 1
    expected = lookup_reference(table, ids, HEAD_DIM, out=out)
    got = lookup_reference_split(slices, rows_per_rank, ids, HEAD_DIM, out=out)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def test_bad_inputs_say_what_was_expected():
    table = random_table(10, HEAD_DIM)
    with pytest.raises(ValueError, match=r"row in \[0, 10\)"):
        lookup_reference(table, torch.tensor([[10]]), HEAD_DIM)
    with pytest.raises(ValueError, match="expected int64"):
        lookup_reference(table, torch.tensor([0.0]), HEAD_DIM)
    with pytest.raises(ValueError, match="264 for head_dim 256"):
        lookup_reference(table[:, :200], torch.tensor([[0]]), HEAD_DIM)
    with pytest.raises(ValueError, match="one of"):
        lookup_reference(table, torch.tensor([[0]]), HEAD_DIM, out="fp8")
    with pytest.raises(ValueError, match="holds 3 rows"):
        lookup_reference_split([table, table[:3]], 10, torch.tensor([[15]]), HEAD_DIM)

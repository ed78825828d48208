"""The lookup kernel compiled for sm_90 (Triton's own compiler; no GPU needed): what the PTX
of a launch does with the table's rows."""

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from lookup_asm import compile_variant  # noqa: E402


@pytest.mark.parametrize("split_bytes", [0, 32])
def test_pipelined_launches_copy_rows_with_cp_async(split_bytes):
    """TileConfig.num_stages >= 2 must reach Triton's pipeliner (rows copied into shared memory
    by cp.async); 0 must leave the plain loads into registers. The GPU tests cannot tell:
    the output is identical either way."""
    plain = compile_variant(16, False, False, False, split_bytes=split_bytes).asm["ptx"]
    piped = compile_variant(16, False, False, False, split_bytes=split_bytes,
                            num_stages=3).asm["ptx"]
    assert "cp.async" not in plain and re.search(r"ld\.global\.(v2\.)?b(64|32)", plain)
    assert re.search(r"cp\.async\.c[ag]\.shared\.global", piped)
    assert "cp.async.wait_group" in piped


@pytest.mark.parametrize("wide", [1, 2])
@pytest.mark.parametrize("is_bf16", [False, True])
def test_wide_loads_move_rows_as_16_byte_vectors_in_registers(is_bf16, wide):
    """TileConfig.wide_loads: 16-byte loads of table rows (8-byte ones without it), 16-byte
    stores (bf16: every word's 8 values; packed, 1: where the output row is 16-byte aligned),
    and no shared memory: the words stay in the threads that loaded them. 2 moves words
    between the threads of a row by warp shuffles, which assume the layout Triton gives the
    row loads: a row's 16 pairs of words on 16 consecutive lanes (checked here)."""
    kernel = compile_variant(16, is_bf16, False, False, wide=wide)
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    assert re.search(r"ld\.global\.v2\.b64", ptx)
    if is_bf16 or wide == 1:
        assert re.search(r"st\.global\.v4\.b32" if is_bf16 else r"st\.global\.v2\.b64", ptx)
    assert kernel.metadata.shared == 0 and "bar.sync" not in ptx
    assert "convert_layout" not in ttgir
    assert ("shfl.sync" in ptx) == (wide == 2)
    assert re.search(r"sizePerThread = \[1, 2\], threadsPerWarp = \[2, 16\], "
                     r"warpsPerCTA = \[4, 1\], order = \[1, 0\]", ttgir)
    plain = compile_variant(16, is_bf16, False, False).asm["ptx"]
    assert not re.search(r"ld\.global(\.\w+)*\.v2\.b64|ld\.global(\.\w+)*\.v4", plain)

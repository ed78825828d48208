"""The lookup kernel compiled for sm_90 (Triton's own compiler; no GPU needed): what the PTX
of a launch does with the table's rows."""

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from support.lookup_compile import compile_variant  # noqa: E402


@pytest.mark.parametrize("is_bf16, split_bytes", [(True, 0), (False, 32)],
                         ids=["bf16-whole", "packed-sector"])
def test_hbm_launches_load_rows_into_registers_as_8_byte_vectors(is_bf16, split_bytes):
    """The 16-row HBM launch, rows whole (bf16 output) or cut at a sector (packed output): the
    rows go straight into registers as 8-byte vectors (or 64-bit words), no copy through
    shared memory. The GPU tests cannot tell: the output is identical either way."""
    ptx = compile_variant(16, is_bf16, False, False, split_bytes=split_bytes).asm["ptx"]
    assert "cp.async" not in ptx and re.search(r"ld\.global\.(v2\.)?b(64|32)", ptx)

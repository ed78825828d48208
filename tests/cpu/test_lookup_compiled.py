"""The lookup kernel compiled for sm_90 (Triton's own compiler; no GPU needed): what the PTX
of a launch does with the table's rows."""

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support.lookup_compile import compile_variant  # noqa: E402


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

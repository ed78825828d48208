"""Argument checks of the lookup kernel's launcher (kernels/lookup.py) that run before any GPU
work, so they are tested here without one."""

import pytest
import torch

from engram_ray.kernels.lookup import engram_lookup


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_head_dims_with_unaligned_rows_are_refused(head_dim):
    """The kernel loads rows as 8-byte vectors (tl.multiple_of(row_ptr, 8)): rows of 33, 66 or
    132 bytes would be misaligned, so the launcher must refuse them before launching."""
    row_bytes = head_dim + head_dim // 32
    table = torch.zeros(4, row_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"head_dim is {head_dim}; the kernel supports 256"):
        engram_lookup(torch.zeros(1, 1, dtype=torch.int64), head_dim=head_dim, table=table)

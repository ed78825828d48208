"""Argument checks of the lookup kernel's launcher (kernels/lookup.py) that run before any GPU
work, so they are tested here without one."""

import pytest
import torch

from engram_ray.kernels.lookup import engram_lookup


@pytest.mark.parametrize("head_dim", [48, 512, 1024])
def test_head_dims_the_kernel_has_no_scale_word_for_are_refused(head_dim):
    """The scale bytes of a row are read as one word of 1, 2, 4 or 8 bytes (head_dim 32..256):
    other head dims must be refused before launching, naming the supported ones."""
    row_bytes = head_dim + head_dim // 32
    table = torch.zeros(4, row_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"head_dim is {head_dim}; the kernel supports "
                                         r"\[32, 64, 128, 256\]"):
        engram_lookup(torch.zeros(1, 1, dtype=torch.int64), head_dim=head_dim, table=table)


def test_checked_ids_name_the_first_one_outside_the_table():
    """engram_lookup(check_ids=True) refuses ids outside [-1, rows) before launching, naming
    [token, column] (tests/gpu runs it through engram_lookup on HBM and peer tables)."""
    from engram_ray.kernels.lookup import _check_row_ids
    ids = torch.tensor([[0, 5, -1], [9, 10, 11]])
    _check_row_ids(ids.reshape(-1), ids.shape, 12)
    with pytest.raises(ValueError, match=r"row_ids\[1, 1\] is 10; expected -1 \(no row\) or a "
                                         r"row of the table, 0\.\.9; ids come from the n-gram"):
        _check_row_ids(ids.reshape(-1), ids.shape, 10)
    ids[0, 2] = -3
    with pytest.raises(ValueError, match=r"row_ids\[0, 2\] is -3"):
        _check_row_ids(ids.reshape(-1), ids.shape, 12)

"""Id ordering of sorted lookups (kernels/lookup_order.py): the counting sort by table block,
run by Triton's interpreter on CPU tensors, and its block sizes; tests/gpu runs both orders
inside replayed graphs against the torch reference."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

from engram_ray.kernels.lookup_order import MAX_BLOCKS, MIN_BLOCK_BYTES, block_shift  # noqa: E402

_CHECK = textwrap.dedent("""
    import torch
    from engram_ray.kernels.lookup_order import order_by_blocks, block_shift
    torch.manual_seed(5)
    for table_rows, tokens, cols, dtype, view in [(5000, 90, 3, torch.int32, True),
                                                  (100_000, 1100, 2, torch.int64, False),
                                                  (7, 5, 24, torch.int32, True)]:
        shift, num_blocks = block_shift(table_rows, row_bytes=264)
        hashes = torch.randint(0, table_rows, (tokens, 2, cols), dtype=dtype)
        hashes[::7, 1, 0] = -1
        ids = hashes[:, 1] if view else hashes[:, 1].contiguous()
        num = ids.numel()
        pad = torch.iinfo(dtype).max
        values = torch.full((num + 9,), 123, dtype=dtype)
        indices = torch.full((num + 9,), -5, dtype=torch.int64)
        counts = torch.zeros(num_blocks, dtype=torch.int32)
        starts = torch.empty_like(counts)
        for _ in range(2):  # the counts must come back zeroed for the next call
            order_by_blocks(ids, values, indices, counts, starts, shift, num_blocks)
            flat = ids.reshape(-1)
            got, pos = values[:num], indices[:num]
            assert torch.equal(torch.sort(pos).values, torch.arange(num)), "not a permutation"
            assert torch.equal(got, flat[pos]), "ids and positions disagree"
            blocks = got.clamp(min=0) >> shift
            assert bool((blocks[1:] >= blocks[:-1]).all()), "blocks out of order"
            assert int(values[num]) == 123 and int(indices[num]) == -5, "wrote past n"
            assert int(counts.abs().sum()) == 0
        # a padded bucket: the real ids first, pads (the dtype's max) left out
        padded = torch.cat([flat, torch.full((5,), pad, dtype=dtype)]).view(-1, 1)
        values[num:], indices[num:] = 123, -5
        order_by_blocks(padded, values, indices, counts, starts, shift, num_blocks)
        assert torch.equal(torch.sort(indices[:num]).values, torch.arange(num))
        assert bool((values[num:] == 123).all()) and bool((indices[num:] == -5).all())
    print("ok order")
""")


def test_counting_sort_under_the_interpreter_orders_ids_by_block(tmp_path):
    """Ids as vLLM hands them (int32 column slices, int64 contiguous, -1 entries): every id
    with its own position, blocks in order, nothing written past n, pads left out."""
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "ok order" in done.stdout


@pytest.mark.parametrize("table_rows", [1, 7, 1000, 32_537_631, 260_000_000, 2**31])
def test_blocks_are_large_enough_and_few_enough(table_rows):
    shift, num_blocks = block_shift(table_rows)
    assert (1 << shift) * 264 >= MIN_BLOCK_BYTES
    assert 1 <= num_blocks <= MAX_BLOCKS and num_blocks << shift >= table_rows
    assert shift == 10 or (num_blocks << shift) // 2 < table_rows  # no coarser than needed

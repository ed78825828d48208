"""Ordering kernels of sorted lookups (Triton; launched from kernels/lookup_order.py): a
counting sort of the looked-up ids by table block (`row >> SHIFT`), not by row.

`_count_blocks` adds each id to its block's count, `_scan_blocks` turns the counts into each
block's first slot (and zeroes the counts for the next call), `_scatter_ids` writes every id
and its position into the next free slot of its block. Within a block the order is whatever
the atomics give; the lookup writes each row to its own output position, so its output is the
same bit for bit in any order. Pads (`PAD`, the ids dtype's largest value, in the padded
buffers of a bucket graph) are left out: the lookup reads only the first n entries, the real
ids (an id equal to PAD is no row of any table).
"""

import triton
import triton.language as tl

from engram_ray.kernels.lookup_tiles import id_offsets


@triton.jit
def _block_of(row, SHIFT: tl.constexpr, NUM_BLOCKS: tl.constexpr):
    """Table block of each id: -1 (no row) in block 0, ids past the table in the last block."""
    return tl.minimum(tl.maximum(row, 0) >> SHIFT, NUM_BLOCKS - 1).to(tl.int32)


@triton.jit(do_not_specialize=["num_rows", "ids_stride"])
def _count_blocks(row_ids, counts, num_rows, ids_stride, SHIFT: tl.constexpr,
                  NUM_BLOCKS: tl.constexpr, PAD: tl.constexpr, IDS_COLS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """counts[b] += ids of block b (counts int32 [NUM_BLOCKS], zero before the call)."""
    pos = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = pos < num_rows
    row = tl.load(row_ids + id_offsets(pos, ids_stride, IDS_COLS), mask=in_range, other=PAD)
    tl.atomic_add(counts + _block_of(row, SHIFT, NUM_BLOCKS), 1, mask=row != PAD,
                  sem="relaxed")


@triton.jit
def _scan_blocks(counts, starts, NUM_SLOTS: tl.constexpr, NUM_BLOCKS: tl.constexpr):
    """starts[b] = counts[0] + ... + counts[b - 1]; counts zeroed (one program,
    NUM_SLOTS = NUM_BLOCKS rounded up to a power of two)."""
    block = tl.arange(0, NUM_SLOTS)
    valid = block < NUM_BLOCKS
    count = tl.load(counts + block, mask=valid, other=0)
    tl.store(starts + block, tl.cumsum(count, 0) - count, mask=valid)
    tl.store(counts + block, 0, mask=valid)


@triton.jit(do_not_specialize=["num_rows", "ids_stride"])
def _scatter_ids(row_ids, starts, sorted_ids, dst_rows, num_rows, ids_stride,
                 SHIFT: tl.constexpr, NUM_BLOCKS: tl.constexpr, PAD: tl.constexpr,
                 IDS_COLS: tl.constexpr, BLOCK: tl.constexpr):
    """Each id and its position (int64) into its block's next slot (starts: `_scan_blocks`)."""
    pos = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = pos < num_rows
    row = tl.load(row_ids + id_offsets(pos, ids_stride, IDS_COLS), mask=in_range, other=PAD)
    is_id = row != PAD
    slot = tl.atomic_add(starts + _block_of(row, SHIFT, NUM_BLOCKS), 1, mask=is_id,
                         sem="relaxed")
    tl.store(sorted_ids + slot, row, mask=is_id)
    tl.store(dst_rows + slot, pos, mask=is_id)

"""Tile loads and stores of the Engram lookup kernel (kernels/lookup.py): one tile of BLOCK_R
looked-up rows, whole (a values load + a scale-word load) or with each 264-byte row's loads cut
at a sector / line boundary (`TileConfig.split_bytes`), written packed or as bf16.
"""

import triton
import triton.language as tl


@triton.jit
def id_offsets(pos, ids_stride, IDS_COLS: tl.constexpr):
    """Element offsets of looked-up rows `pos` in the ids: `pos` itself for flat ids
    (IDS_COLS 0), else token `pos // IDS_COLS`, column `pos % IDS_COLS` of a `[T, IDS_COLS]`
    view with tokens `ids_stride` apart (vLLM passes one layer's columns of `[T, L, C]`)."""
    offsets = pos
    if IDS_COLS:
        pos_32 = pos.to(tl.int32)  # < 2^30 rows per launch: 32-bit division by a constant
        offsets = (pos_32 // IDS_COLS).to(tl.int64) * ids_stride + (pos_32 % IDS_COLS)
    return offsets


@triton.jit
def load_tile(src, row_ids, dst_rows, tile, num_rows, rows_per_rank,
              HEAD_DIM: tl.constexpr, SCALE_WORD: tl.constexpr, BLOCK_R: tl.constexpr,
              IS_PEER: tl.constexpr, IS_SORTED: tl.constexpr, ROW_ALIGN: tl.constexpr,
              ROWS_32: tl.constexpr, ids_stride, IDS_COLS: tl.constexpr):
    """Issue the loads of one tile of packed rows `[rows, ROW_BYTES]` (a table, or peer slices):
    (output rows, in range, values [BLOCK_R, S, 32], scale word)."""
    NUM_SCALES: tl.constexpr = HEAD_DIM // 32
    ROW_BYTES: tl.constexpr = HEAD_DIM + NUM_SCALES
    group = tl.arange(0, NUM_SCALES)
    col = (group[:, None] * 32 + tl.arange(0, 32)[None, :])[None, :, :]   # [1, NUM_SCALES, 32]
    pos = (tile * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    in_range = pos < num_rows
    row = tl.load(row_ids + id_offsets(pos, ids_stride, IDS_COLS), mask=in_range,
                  other=-1).to(tl.int64)
    has_row = row >= 0
    row = tl.where(has_row, row, 0)
    if IS_PEER:
        if ROWS_32:  # every row id < 2^31: a 32-bit division, not a 64-bit one
            owner = (row.to(tl.int32) // rows_per_rank).to(tl.int64)
        else:
            owner = row // rows_per_rank
        base = tl.load(src + owner, mask=has_row, other=0)
        row_ptr = base.to(tl.pointer_type(tl.uint8)) + (row - owner * rows_per_rank) * ROW_BYTES
    else:
        row_ptr = src + row * ROW_BYTES
    row_ptr = tl.multiple_of(row_ptr, ROW_ALIGN)
    dst = tl.load(dst_rows + pos, mask=in_range, other=0) if IS_SORTED else pos
    values = tl.load(row_ptr[:, None, None] + col, mask=has_row[:, None, None], other=0)
    word = tl.load((row_ptr + HEAD_DIM).to(tl.pointer_type(SCALE_WORD)), mask=has_row, other=0)
    return dst, in_range, values, word


@triton.jit
def _power_of_two(exponent):
    """2^(e - 127) as fp32 for ue8m0 exponents (int32): e = 0 is the subnormal 2^-127, e = 255
    the e8m0 NaN; exact, so value x power rounds once (fp32 -> bf16, RNE)."""
    bits = tl.where(exponent == 0, 0x400000, tl.where(exponent == 255, 0x7FC00000, exponent << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def load_tile_split(src, row_ids, dst_rows, tile, num_rows, rows_per_rank, BLOCK_R: tl.constexpr,
                    IS_PEER: tl.constexpr, IS_SORTED: tl.constexpr, ROWS_32: tl.constexpr,
                    SPLIT_WORDS: tl.constexpr, ids_stride, IDS_COLS: tl.constexpr):
    """Tables of 264-byte rows (33 words): each row as two loads cut at its first
    (8 x SPLIT_WORDS)-byte boundary: `head` = its 1..SPLIT_WORDS words before the cut, `body` =
    the other 33 - head (the scale word among them). Cut at a 32-byte sector (SPLIT_WORDS 4),
    no sector is asked for twice; cut at a 128-byte line (16), each of a row's three lines is
    asked for once (a values load + a scale-word load: up to 4 requests, 10 sectors).
    Returns (output rows, in range, head words per row, head [R, SPLIT_WORDS], body [R, 32])."""
    # Row addressing as in load_tile, but as an integer address (the cut depends on it); not
    # shared with load_tile: that path's exact instruction sequence is the one run on Triton
    # 3.6, where restructuring it once hit a compiler bug.
    pos = (tile * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    in_range = pos < num_rows
    row = tl.load(row_ids + id_offsets(pos, ids_stride, IDS_COLS), mask=in_range,
                  other=-1).to(tl.int64)
    has_row = row >= 0
    row = tl.where(has_row, row, 0)
    if IS_PEER:
        if ROWS_32:
            owner = (row.to(tl.int32) // rows_per_rank).to(tl.int64)
        else:
            owner = row // rows_per_rank
        address = tl.load(src + owner, mask=has_row, other=0) + (row - owner * rows_per_rank) * 264
    else:
        address = (src + row * 264).to(tl.int64)
    head_words = SPLIT_WORDS - (address // 8) % SPLIT_WORDS
    words = tl.multiple_of(address.to(tl.pointer_type(tl.uint64)), 8)
    head_lane = tl.arange(0, SPLIT_WORDS)[None, :]
    lane = tl.arange(0, 32)[None, :]
    head = tl.load(words[:, None] + head_lane,
                   mask=has_row[:, None] & (head_lane < head_words[:, None]), other=0)
    body = tl.load(words[:, None] + head_words[:, None] + lane,
                   mask=has_row[:, None] & (lane < 33 - head_words[:, None]), other=0)
    dst = tl.load(dst_rows + pos, mask=in_range, other=0) if IS_SORTED else pos
    return dst, in_range, head_words, head, body


@triton.jit
def _store_words_bf16(out_row, words, first_word, scales, mask):
    """bf16 of the 8 FP8 values in each of `words` [R, W] (row words first_word + 0..W-1; word
    w holds values 8w..8w+7, in scale group w // 4) at `out_row` [R, 1, 1] + 8w."""
    byte = (tl.arange(0, 8) * 8).to(tl.uint64)[None, None, :]
    group = tl.minimum(first_word, 31) // 4  # word 32 (the scale word) is masked off
    exponent = ((scales >> (group * 8).to(tl.uint64)) & 0xFF).to(tl.int32)
    real = ((words[:, :, None] >> byte) & 0xFF).to(tl.uint8).to(
        tl.float8e4nv, bitcast=True).to(tl.float32) * _power_of_two(exponent)[:, :, None]
    tl.store(out_row + first_word[:, :, None] * 8 + tl.arange(0, 8)[None, None, :],
             real.to(tl.bfloat16), mask=mask[:, :, None])


@triton.jit
def store_tile_split(out, dst, in_range, head_words, head, body, IS_BF16: tl.constexpr,
                     SPLIT_WORDS: tl.constexpr):
    """Write what `load_tile_split` loaded: packed (the two pieces where they belong) or bf16
    (each word's 8 values times its group's scale; the scale word is body word 32 - head)."""
    head_lane = tl.arange(0, SPLIT_WORDS)[None, :]
    lane = tl.arange(0, 32)[None, :]
    head_words = head_words[:, None]
    if IS_BF16:
        scales = tl.sum(tl.where(lane == 32 - head_words, body, 0), axis=1)[:, None]
        out_row = out + dst[:, None, None] * 256
        _store_words_bf16(out_row, head, head_lane + 0 * head_words, scales,
                          in_range[:, None] & (head_lane < head_words))
        _store_words_bf16(out_row, body, head_words + lane, scales,
                          in_range[:, None] & (head_words + lane < 32))
    else:
        out_words = (out + dst * 264).to(tl.pointer_type(tl.uint64))[:, None]
        tl.store(out_words + head_lane, head, mask=in_range[:, None] & (head_lane < head_words))
        tl.store(out_words + head_words + lane, body,
                 mask=in_range[:, None] & (lane < 33 - head_words))


@triton.jit
def store_tile(out, dst, in_range, values, word, HEAD_DIM: tl.constexpr,
               SCALE_WORD: tl.constexpr, IS_BF16: tl.constexpr, ROW_ALIGN: tl.constexpr):
    NUM_SCALES: tl.constexpr = HEAD_DIM // 32
    ROW_BYTES: tl.constexpr = HEAD_DIM + NUM_SCALES
    group = tl.arange(0, NUM_SCALES)
    col = (group[:, None] * 32 + tl.arange(0, 32)[None, :])[None, :, :]
    if IS_BF16:
        # value x 2^(e - 127): fp8 -> fp32 is exact, 2^(e-127) is exact in fp32 (e = 0 is
        # the subnormal 2^-127, e = 255 the e8m0 NaN), one rounding fp32 -> bf16 (RNE).
        shift = (group * 8).to(SCALE_WORD)[None, :]
        exponent = ((word[:, None] >> shift) & 0xFF).to(tl.int32)
        power = _power_of_two(exponent)
        real = values.to(tl.float8e4nv, bitcast=True).to(tl.float32) * power[:, :, None]
        tl.store(out + dst[:, None, None] * HEAD_DIM + col, real.to(tl.bfloat16),
                 mask=in_range[:, None, None])
    else:
        out_row = tl.multiple_of(out + dst * ROW_BYTES, ROW_ALIGN)
        tl.store(out_row[:, None, None] + col, values, mask=in_range[:, None, None])
        tl.store((out_row + HEAD_DIM).to(tl.pointer_type(SCALE_WORD)), word, mask=in_range)

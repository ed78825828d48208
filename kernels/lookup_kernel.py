"""The Engram lookup kernel (Triton); launched by kernels/lookup_launch.py, entry point
`engram_ray.kernels.lookup.engram_lookup` (whose module doc gives shapes and the NOTES)."""

import triton
import triton.language as tl

from engram_ray.kernels.lookup_tiles import load_tile, load_tile_split, store_tile, store_tile_split

SCALE_WORDS = {1: tl.uint8, 2: tl.uint16, 4: tl.uint32, 8: tl.uint64}


@triton.jit(do_not_specialize=["num_rows", "rows_per_rank", "num_programs", "ids_stride"])
def _engram_lookup_kernel(
    src,            # TABLE: packed uint8 [rows, ROW_BYTES]; PEER: int64 [P] slice base addresses
    row_ids,        # int64/int32 [num_rows] (IDS_COLS 0) or [T, IDS_COLS] rows ids_stride apart
    dst_rows,       # int64 [num_rows] output row of each id (IS_SORTED only)
    out,            # uint8 [num_rows, ROW_BYTES] or bf16 [num_rows, HEAD_DIM]
    num_rows,
    rows_per_rank,  # PEER only
    num_programs,
    ids_stride,     # IDS_COLS > 0: elements from one token's ids to the next's
    HEAD_DIM: tl.constexpr,
    SCALE_WORD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_PEER: tl.constexpr,
    IS_SORTED: tl.constexpr,
    IS_BF16: tl.constexpr,
    PREFETCH: tl.constexpr,
    ROW_ALIGN: tl.constexpr,  # gcd(ROW_BYTES, 8): 8 for 264-byte rows (8-byte vector loads)
    ROWS_32: tl.constexpr = False,   # PEER: rows_per_rank x P < 2^31 (32-bit owner division)
    SPLIT_WORDS: tl.constexpr = 0,   # 264-byte rows: 4 / 16 = loads cut at a sector / line
    IDS_COLS: tl.constexpr = 0,      # > 0: ids are [T, IDS_COLS] with a token stride (a view)
):
    """Persistent loop over tiles of BLOCK_R looked-up rows. PREFETCH issues the next tile's
    loads before this tile's stores, keeping row reads in flight while results drain."""
    # Long because it holds four persistent loops (whole or cut loads, with or without the
    # next tile's loads in flight), each carrying its own loop state; the loads and stores
    # themselves are in kernels/lookup_tiles.py.
    num_tiles = tl.cdiv(num_rows, BLOCK_R)
    tile = tl.program_id(0)
    if SPLIT_WORDS:
        if PREFETCH:
            dst, in_range, head_words, head, body = load_tile_split(
                src, row_ids, dst_rows, tile, num_rows, rows_per_rank, BLOCK_R, IS_PEER,
                IS_SORTED, ROWS_32, SPLIT_WORDS, ids_stride, IDS_COLS)
            for _ in tl.range(tile, num_tiles, num_programs):
                tile += num_programs  # past the end: every load of the tile is masked off
                next_dst, next_in_range, next_head_words, next_head, next_body = \
                    load_tile_split(src, row_ids, dst_rows, tile, num_rows, rows_per_rank,
                                    BLOCK_R, IS_PEER, IS_SORTED, ROWS_32, SPLIT_WORDS,
                                    ids_stride, IDS_COLS)
                store_tile_split(out, dst, in_range, head_words, head, body, IS_BF16,
                                 SPLIT_WORDS)
                dst, in_range, head_words = next_dst, next_in_range, next_head_words
                head, body = next_head, next_body
        else:
            for tile in tl.range(tile, num_tiles, num_programs):
                dst, in_range, head_words, head, body = load_tile_split(
                    src, row_ids, dst_rows, tile, num_rows, rows_per_rank, BLOCK_R, IS_PEER,
                    IS_SORTED, ROWS_32, SPLIT_WORDS, ids_stride, IDS_COLS)
                store_tile_split(out, dst, in_range, head_words, head, body, IS_BF16,
                                 SPLIT_WORDS)
    elif PREFETCH:
        dst, in_range, values, word = load_tile(
            src, row_ids, dst_rows, tile, num_rows, rows_per_rank, HEAD_DIM, SCALE_WORD,
            BLOCK_R, IS_PEER, IS_SORTED, ROW_ALIGN, ROWS_32, ids_stride, IDS_COLS)
        for _ in tl.range(tile, num_tiles, num_programs):
            tile += num_programs  # past the end: every load of the tile is masked off
            next_dst, next_in_range, next_values, next_word = load_tile(
                src, row_ids, dst_rows, tile, num_rows, rows_per_rank, HEAD_DIM, SCALE_WORD,
                BLOCK_R, IS_PEER, IS_SORTED, ROW_ALIGN, ROWS_32, ids_stride, IDS_COLS)
            store_tile(out, dst, in_range, values, word, HEAD_DIM, SCALE_WORD, IS_BF16, ROW_ALIGN)
            dst, in_range, values, word = next_dst, next_in_range, next_values, next_word
    else:
        for tile in tl.range(tile, num_tiles, num_programs):
            dst, in_range, values, word = load_tile(
                src, row_ids, dst_rows, tile, num_rows, rows_per_rank, HEAD_DIM, SCALE_WORD,
                BLOCK_R, IS_PEER, IS_SORTED, ROW_ALIGN, ROWS_32, ids_stride, IDS_COLS)
            store_tile(out, dst, in_range, values, word, HEAD_DIM, SCALE_WORD, IS_BF16, ROW_ALIGN)

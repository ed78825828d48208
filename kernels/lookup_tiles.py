"""Tile loads and stores of the Engram lookup kernel (kernels/lookup.py): one tile of BLOCK_R
looked-up rows, whole (a values load + a scale-word load) or with each 264-byte row's loads cut
at a sector / line boundary (`TileConfig.split_bytes`), written packed or as bf16.
"""

import triton
import triton.language as tl


@triton.jit
def load_tile(src, row_ids, dst_rows, tile, num_rows, rows_per_rank,
              HEAD_DIM: tl.constexpr, SCALE_WORD: tl.constexpr, BLOCK_R: tl.constexpr,
              IS_PEER: tl.constexpr, IS_SORTED: tl.constexpr, ROW_ALIGN: tl.constexpr,
              LOAD_CACHE: tl.constexpr, LOAD_EVICT: tl.constexpr, ROWS_32: tl.constexpr):
    """Issue the loads of one tile: (output rows, in range, values [BLOCK_R, S, 32], scale word)."""
    NUM_SCALES: tl.constexpr = HEAD_DIM // 32
    ROW_BYTES: tl.constexpr = HEAD_DIM + NUM_SCALES
    group = tl.arange(0, NUM_SCALES)
    col = (group[:, None] * 32 + tl.arange(0, 32)[None, :])[None, :, :]   # [1, NUM_SCALES, 32]
    pos = (tile * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    in_range = pos < num_rows
    row = tl.load(row_ids + pos, mask=in_range, other=-1).to(tl.int64)
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
    values = tl.load(row_ptr[:, None, None] + col, mask=has_row[:, None, None], other=0,
                     cache_modifier=LOAD_CACHE, eviction_policy=LOAD_EVICT)
    word = tl.load((row_ptr + HEAD_DIM).to(tl.pointer_type(SCALE_WORD)), mask=has_row, other=0,
                   cache_modifier=LOAD_CACHE, eviction_policy=LOAD_EVICT)
    return dst, in_range, values, word


@triton.jit
def _power_of_two(exponent):
    """2^(e - 127) as fp32 for ue8m0 exponents (int32): e = 0 is the subnormal 2^-127, e = 255
    the e8m0 NaN; exact, so value x power rounds once (fp32 -> bf16, RNE)."""
    bits = tl.where(exponent == 0, 0x400000, tl.where(exponent == 255, 0x7FC00000, exponent << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def load_tile_split(src, row_ids, dst_rows, tile, num_rows, rows_per_rank, BLOCK_R: tl.constexpr,
                    IS_PEER: tl.constexpr, IS_SORTED: tl.constexpr, LOAD_CACHE: tl.constexpr,
                    LOAD_EVICT: tl.constexpr, ROWS_32: tl.constexpr, SPLIT_WORDS: tl.constexpr):
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
    row = tl.load(row_ids + pos, mask=in_range, other=-1).to(tl.int64)
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
                   mask=has_row[:, None] & (head_lane < head_words[:, None]), other=0,
                   cache_modifier=LOAD_CACHE, eviction_policy=LOAD_EVICT)
    body = tl.load(words[:, None] + head_words[:, None] + lane,
                   mask=has_row[:, None] & (lane < 33 - head_words[:, None]), other=0,
                   cache_modifier=LOAD_CACHE, eviction_policy=LOAD_EVICT)
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
               SCALE_WORD: tl.constexpr, IS_BF16: tl.constexpr, ROW_ALIGN: tl.constexpr,
               STORE_CACHE: tl.constexpr):
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
                 mask=in_range[:, None, None], cache_modifier=STORE_CACHE)
    else:
        out_row = tl.multiple_of(out + dst * ROW_BYTES, ROW_ALIGN)
        tl.store(out_row[:, None, None] + col, values, mask=in_range[:, None, None],
                 cache_modifier=STORE_CACHE)
        tl.store((out_row + HEAD_DIM).to(tl.pointer_type(SCALE_WORD)), word, mask=in_range,
                 cache_modifier=STORE_CACHE)


@triton.jit
def load_tile_wide(src, row_ids, dst_rows, tile, num_rows, rows_per_rank, BLOCK_R: tl.constexpr,
                   IS_PEER: tl.constexpr, IS_SORTED: tl.constexpr, LOAD_CACHE: tl.constexpr,
                   LOAD_EVICT: tl.constexpr, ROWS_32: tl.constexpr):
    """Tables of 264-byte rows (33 words) read as 16-byte vectors: each row's words 0..31 (odd
    rows: -1..30) by 16 loads from the 16-byte boundary at or just before the row (an odd row
    starts 8 bytes past one; its word -1 shares the row's first sector and is dropped), then
    its scale word and, for odd rows, word 31 as 8-byte loads. No load leaves the 16-byte
    chunks the row touches. Returns (output rows, in range, odd [R], pairs [R, 16, 2] = row
    words 2k - odd + (0, 1), word 31 of odd rows, scale word)."""
    # Row addressing as in load_tile_split (see its note).
    pos = (tile * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    in_range = pos < num_rows
    row = tl.load(row_ids + pos, mask=in_range, other=-1).to(tl.int64)
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
    odd = (address // 8) % 2
    first = tl.multiple_of((address - odd * 8).to(tl.pointer_type(tl.uint64)), 16)
    # One row's 32 words across 16 threads (a thread's pair = a 16-byte load), then split.
    pairs = tl.reshape(tl.load(first[:, None] + tl.arange(0, 32)[None, :],
                               mask=has_row[:, None], other=0, cache_modifier=LOAD_CACHE,
                               eviction_policy=LOAD_EVICT), [BLOCK_R, 16, 2])
    words = address.to(tl.pointer_type(tl.uint64))
    word31 = tl.load(words + 31, mask=has_row & (odd == 1), other=0,
                     cache_modifier=LOAD_CACHE, eviction_policy=LOAD_EVICT)
    scale = tl.load(words + 32, mask=has_row, other=0, cache_modifier=LOAD_CACHE,
                    eviction_policy=LOAD_EVICT)
    dst = tl.load(dst_rows + pos, mask=in_range, other=0) if IS_SORTED else pos
    return dst, in_range, odd, pairs, word31, scale


@triton.jit
def _store_pair(address, low, high, mask_low, mask_high, ASM: tl.constexpr):
    """Words `low`, `high` (uint64) at `address`, `address` + 8: one 16-byte store where the
    address is 16-byte aligned and both are written, else 8-byte stores. ASM: through PTX, in
    the layout the words were loaded in (Triton's own stores would move them between threads
    first); False: tl.store (Triton's interpreter runs no PTX)."""
    if ASM:
        tl.inline_asm_elementwise(
            """{
            .reg .pred lo, hi, both, one;
            .reg .b64 offset;
            mov.b32 $0, 0;
            setp.ne.b32 lo, $4, 0;
            setp.ne.b32 hi, $5, 0;
            and.b64 offset, $1, 8;
            setp.eq.and.b64 both, offset, 0, lo;
            and.pred both, both, hi;
            @both st.global.v2.b64 [$1], {$2, $3};
            not.pred one, both;
            and.pred lo, lo, one;
            and.pred hi, hi, one;
            @lo st.global.b64 [$1], $2;
            @hi st.global.b64 [$1+8], $3;
            }""", "=r,l,l,l,r,r", [address, low, high, mask_low.to(tl.int32),
                                 mask_high.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        words = address.to(tl.pointer_type(tl.uint64))
        tl.store(words, low, mask=mask_low)
        tl.store(words + 1, high, mask=mask_high)


@triton.jit
def _store_quad(address, q0, q1, q2, q3, mask, ASM: tl.constexpr):
    """uint32 `q0..q3` at 16-byte aligned `address` as one 16-byte store (see `_store_pair`)."""
    if ASM:
        tl.inline_asm_elementwise(
            """{
            .reg .pred p;
            mov.b32 $0, 0;
            setp.ne.b32 p, $6, 0;
            @p st.global.v4.b32 [$1], {$2, $3, $4, $5};
            }""", "=r,l,r,r,r,r,r", [address, q0, q1, q2, q3, mask.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        quads = address.to(tl.pointer_type(tl.uint32))
        tl.store(quads, q0, mask=mask)
        tl.store(quads + 1, q1, mask=mask)
        tl.store(quads + 2, q2, mask=mask)
        tl.store(quads + 3, q3, mask=mask)


@triton.jit
def _bf16_bits(word, byte: tl.constexpr, power):
    """bf16 bits (uint32) of FP8 value `byte` of `word` times `power` (one rounding, RNE)."""
    value = ((word >> (8 * byte)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    real = (value.to(tl.float32) * power).to(tl.bfloat16)
    return real.to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _store_word_bf16(out_row, word, index, scale, mask, ASM: tl.constexpr):
    """bf16 of the 8 FP8 values of row word `index` (group index // 4) at `out_row` + 16 x
    index bytes: two values per uint32, one 16-byte store per word. ASM: converted in PTX by
    the instructions Triton uses for load_tile's values (e4m3x2 -> f16x2 -> f32, x 2^(e-127)
    without flushing subnormals, -> bf16x2 RNE), from the uint64 word in place; False: per
    byte in Triton."""
    group = tl.maximum(index, 0) // 4  # index -1 (an odd row's word before it) is masked off
    power = _power_of_two(((scale >> (group * 8).to(tl.uint64)) & 0xFF).to(tl.int32))
    if ASM:
        q0, q1, q2, q3 = tl.inline_asm_elementwise(
            """{
            .reg .b32 lo, hi, h<4>;
            .reg .b16 v<4>, f<8>;
            .reg .f32 x<8>;
            mov.b64 {lo, hi}, $4;
            mov.b32 {v0, v1}, lo;
            mov.b32 {v2, v3}, hi;
            cvt.rn.f16x2.e4m3x2 h0, v0;
            cvt.rn.f16x2.e4m3x2 h1, v1;
            cvt.rn.f16x2.e4m3x2 h2, v2;
            cvt.rn.f16x2.e4m3x2 h3, v3;
            mov.b32 {f0, f1}, h0;
            mov.b32 {f2, f3}, h1;
            mov.b32 {f4, f5}, h2;
            mov.b32 {f6, f7}, h3;
            cvt.f32.f16 x0, f0;
            cvt.f32.f16 x1, f1;
            cvt.f32.f16 x2, f2;
            cvt.f32.f16 x3, f3;
            cvt.f32.f16 x4, f4;
            cvt.f32.f16 x5, f5;
            cvt.f32.f16 x6, f6;
            cvt.f32.f16 x7, f7;
            mul.f32 x0, x0, $5;
            mul.f32 x1, x1, $5;
            mul.f32 x2, x2, $5;
            mul.f32 x3, x3, $5;
            mul.f32 x4, x4, $5;
            mul.f32 x5, x5, $5;
            mul.f32 x6, x6, $5;
            mul.f32 x7, x7, $5;
            cvt.rn.bf16x2.f32 $0, x1, x0;
            cvt.rn.bf16x2.f32 $1, x3, x2;
            cvt.rn.bf16x2.f32 $2, x5, x4;
            cvt.rn.bf16x2.f32 $3, x7, x6;
            }""", "=r,=r,=r,=r,l,f", [word, power],
            dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        q0 = _bf16_bits(word, 0, power) | (_bf16_bits(word, 1, power) << 16)
        q1 = _bf16_bits(word, 2, power) | (_bf16_bits(word, 3, power) << 16)
        q2 = _bf16_bits(word, 4, power) | (_bf16_bits(word, 5, power) << 16)
        q3 = _bf16_bits(word, 6, power) | (_bf16_bits(word, 7, power) << 16)
    _store_quad(out_row + index * 16, q0, q1, q2, q3, mask, ASM)


@triton.jit
def _shuffle_word(low, high, lane, take_high, ASM: tl.constexpr):
    """[R, 16] words of other threads of the same row: `high` (take_high) or `low` of row
    thread `lane` (< 16). ASM: warp shuffles inside each row's 16 threads (load_tile_wide's
    layout puts a row's 16 pairs on 16 consecutive lanes, pair k on lane k mod 16; a CPU test
    checks the layout); False: tl.gather (Triton's interpreter)."""
    if ASM:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 l0, l1, h0, h1, a0, a1, b0, b1;
            .reg .pred high;
            mov.b64 {l0, l1}, $1;
            mov.b64 {h0, h1}, $2;
            shfl.sync.idx.b32 a0, l0, $3, 0x101f, 0xffffffff;
            shfl.sync.idx.b32 a1, l1, $3, 0x101f, 0xffffffff;
            shfl.sync.idx.b32 b0, h0, $3, 0x101f, 0xffffffff;
            shfl.sync.idx.b32 b1, h1, $3, 0x101f, 0xffffffff;
            setp.ne.b32 high, $4, 0;
            selp.b32 a0, b0, a0, high;
            selp.b32 a1, b1, a1, high;
            mov.b64 $0, {a0, a1};
            }""", "=l,l,l,r,r", [low, high, lane, take_high], dtype=tl.uint64, is_pure=True,
            pack=1)
    else:
        lane = tl.minimum(lane, 15).to(tl.int64)
        return tl.where(take_high != 0, tl.gather(high, lane, 1), tl.gather(low, lane, 1))


@triton.jit
def store_tile_wide(out, dst, in_range, odd, pairs, word31, scale, IS_BF16: tl.constexpr,
                    ASM: tl.constexpr, SHUFFLE: tl.constexpr):
    """Write what `load_tile_wide` loaded, in the layout it was loaded in. SHUFFLE: each
    row's thread k first takes row words k and 16 + k from the others, so every store
    instruction writes whole sectors (packed: 8-byte stores of 128 contiguous bytes per row;
    bf16: 16-byte stores of 256); else pairs of words are written where they were loaded
    (packed: 16-byte stores where the output row's alignment allows, else 8-byte ones;
    bf16: 16-byte stores, every other 16 bytes per instruction)."""
    low, high = tl.split(pairs)  # [R, 16]: row words 2k - odd and 2k + 1 - odd
    if SHUFFLE:
        k = tl.arange(0, 16)[None, :]
        pick = k + odd[:, None].to(tl.int32)
        lane, take_high = pick // 2, pick % 2
        first = _shuffle_word(low, high, lane, take_high, ASM)
        second = tl.where((k == 15) & (odd[:, None] == 1), word31[:, None],
                          _shuffle_word(low, high, lane + 8, take_high, ASM))
        if IS_BF16:
            out_row = (out + dst * 256).to(tl.int64)[:, None]
            _store_word_bf16(out_row, first, k, scale[:, None], in_range[:, None], ASM)
            _store_word_bf16(out_row, second, k + 16, scale[:, None], in_range[:, None], ASM)
        else:
            words = (out + dst * 264).to(tl.pointer_type(tl.uint64))
            tl.store(words[:, None] + k, first, mask=in_range[:, None])
            tl.store(words[:, None] + 16 + k, second, mask=in_range[:, None])
            tl.store(words + 32, scale, mask=in_range)
    else:
        first_word = tl.arange(0, 16)[None, :] * 2 - odd[:, None]
        odd_row = in_range & (odd == 1)
        if IS_BF16:
            out_row = (out + dst * 256).to(tl.int64)
            scales = scale[:, None]
            _store_word_bf16(out_row[:, None], low, first_word, scales,
                             in_range[:, None] & (first_word >= 0), ASM)
            _store_word_bf16(out_row[:, None], high, first_word + 1, scales, in_range[:, None],
                             ASM)
            _store_word_bf16(out_row, word31, 31 + 0 * odd, scale, odd_row, ASM)
        else:
            out_row = (out + dst * 264).to(tl.int64)
            _store_pair(out_row[:, None] + first_word * 8, low, high,
                        in_range[:, None] & (first_word >= 0),
                        in_range[:, None] & (first_word >= -1), ASM)
            words = out_row.to(tl.pointer_type(tl.uint64))
            tl.store(words + 31, word31, mask=odd_row)
            tl.store(words + 32, scale, mask=in_range)

"""The lookup kernel compiled for sm_90 by Triton's own compiler (no GPU needed), for tests that
read its PTX (tests/cpu/kernels/test_lookup_compiled.py)."""

from __future__ import annotations

import math

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engram_ray.kernels.lookup import SCALE_WORDS, _engram_lookup_kernel, tile_config


def compile_variant(block_rows: int, is_bf16: bool, is_peer: bool, is_sorted: bool,
                    prefetch: bool = False, head_dim: int = 256, split_bytes: int = 0):
    out_type = "*bf16" if is_bf16 else "*u8"
    signature = {"src": "*i64" if is_peer else "*u8", "row_ids": "*i64", "dst_rows": "*i64",
                 "out": out_type, "num_rows": "i32", "rows_per_rank": "i32",
                 "num_programs": "i32", "ids_stride": "i32", "HEAD_DIM": "constexpr",
                 "SCALE_WORD": "constexpr",
                 "BLOCK_R": "constexpr", "IS_PEER": "constexpr", "IS_SORTED": "constexpr",
                 "IS_BF16": "constexpr", "PREFETCH": "constexpr", "ROW_ALIGN": "constexpr",
                 "ROWS_32": "constexpr", "SPLIT_WORDS": "constexpr", "IDS_COLS": "constexpr"}
    constexprs = {"HEAD_DIM": head_dim, "SCALE_WORD": SCALE_WORDS[head_dim // 32],
                  "BLOCK_R": block_rows, "IS_PEER": is_peer, "IS_SORTED": is_sorted,
                  "IS_BF16": is_bf16, "PREFETCH": prefetch,
                  "ROW_ALIGN": math.gcd(head_dim + head_dim // 32, 8),
                  "ROWS_32": bool(split_bytes), "SPLIT_WORDS": split_bytes // 8, "IDS_COLS": 0}
    # Pointers are 16-byte aligned, as Triton specializes them at launch.
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    source = ASTSource(_engram_lookup_kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tile_config("hbm", block_rows).num_warps})

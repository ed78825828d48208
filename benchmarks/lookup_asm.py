"""Compile every lookup kernel variant for sm_90 (no GPU needed) and report its memory instructions.

Evidence for the wide packed-row loads: the widths of the global loads/stores in the PTX
(`ld.global.v2.b32` = 8 bytes) and SASS (`LDG.E.64`), registers and spills per variant.
Usage: python benchmarks/lookup_asm.py [--out FILE]  (the summary plus every global memory
instruction of the 128-row packed and bf16 kernels, from PTX and SASS)
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engram_ray.kernels.lookup import SCALE_WORDS, _engram_lookup_kernel, tile_config

MEMORY_OP = re.compile(r"\b((?:ld|st)\.global[\w.]*)")
SASS_OP = re.compile(r"\b((?:LDG|STG)[\w.]*)")


def compile_variant(block_rows: int, is_bf16: bool, is_peer: bool, is_sorted: bool,
                    prefetch: bool = False, head_dim: int = 256, split_bytes: int = 0,
                    num_stages: int = 0):
    out_type = "*bf16" if is_bf16 else "*u8"
    signature = {"src": "*i64" if is_peer else "*u8", "row_ids": "*i64", "dst_rows": "*i64",
                 "out": out_type, "num_rows": "i32", "rows_per_rank": "i32",
                 "num_programs": "i32", "ids_stride": "i32", "HEAD_DIM": "constexpr",
                 "SCALE_WORD": "constexpr",
                 "BLOCK_R": "constexpr", "IS_PEER": "constexpr", "IS_SORTED": "constexpr",
                 "IS_BF16": "constexpr", "PREFETCH": "constexpr", "ROW_ALIGN": "constexpr",
                 "LOAD_CACHE": "constexpr", "LOAD_EVICT": "constexpr", "STORE_CACHE": "constexpr",
                 "ROWS_32": "constexpr", "SPLIT_WORDS": "constexpr", "NUM_STAGES": "constexpr",
                 "IDS_COLS": "constexpr"}
    constexprs = {"HEAD_DIM": head_dim, "SCALE_WORD": SCALE_WORDS[head_dim // 32],
                  "BLOCK_R": block_rows, "IS_PEER": is_peer, "IS_SORTED": is_sorted,
                  "IS_BF16": is_bf16, "PREFETCH": prefetch,
                  "ROW_ALIGN": math.gcd(head_dim + head_dim // 32, 8), "LOAD_CACHE": "",
                  "LOAD_EVICT": "", "STORE_CACHE": "", "ROWS_32": bool(split_bytes),
                  "SPLIT_WORDS": split_bytes // 8, "NUM_STAGES": num_stages, "IDS_COLS": 0}
    # Pointers are 16-byte aligned, as Triton specializes them at launch.
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    source = ASTSource(_engram_lookup_kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tile_config("hbm", block_rows).num_warps})


def resource_usage(cubin: bytes) -> str:
    """Registers, stack and shared memory of the cubin (cuobjdump --dump-resource-usage)."""
    import shutil
    from triton import knobs
    tool = knobs.nvidia.cuobjdump.path if hasattr(knobs, "nvidia") else shutil.which("cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", file.name],
                              capture_output=True, text=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", text)
    return match.group(0) if match else text.strip()[-200:]


def summarize(kernel) -> dict:
    ptx = kernel.asm["ptx"]
    ptx_ops = collections.Counter(MEMORY_OP.findall(ptx))
    info = {"ptx": dict(ptx_ops), "ftz": len(re.findall(r"\.ftz", ptx)),
            "resources": resource_usage(kernel.asm["cubin"])}
    sass = kernel.asm.get("sass")
    if sass is None:
        try:
            from triton.tools.disasm import get_sass
            sass = get_sass(kernel.asm["cubin"])
        except Exception as exc:  # disassembler missing: PTX is still evidence
            sass = f"// no SASS: {exc}"
    info["sass"] = dict(collections.Counter(SASS_OP.findall(sass)))
    return info, ptx, sass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report = [f"triton {triton.__version__}, target sm_90"]
    excerpts = []
    for block_rows in (16, 128):
        for is_bf16 in (False, True):
            for is_peer, is_sorted, prefetch, split in (
                    (False, False, False, False), (True, False, False, False),
                    (False, True, False, False), (False, False, True, False),
                    (True, False, False, 32), (True, False, True, 32),
                    (True, False, False, 128), (True, False, True, 128)):
                kernel = compile_variant(block_rows, is_bf16, is_peer, is_sorted, prefetch,
                                         split_bytes=split)
                info, ptx, sass = summarize(kernel)
                name = (f"lookup_r{block_rows}_{'bf16' if is_bf16 else 'packed'}"
                        f"{'_peer' if is_peer else ''}{'_sorted' if is_sorted else ''}"
                        f"{'_prefetch' if prefetch else ''}{f'_split{split}' if split else ''}")
                report.append(f"{name} {info}")
                if (block_rows == 128 and not (is_peer or is_sorted or prefetch)) or (
                        block_rows == 16 and split and prefetch):
                    excerpts.append(f"== {name}: PTX global memory and conversion instructions")
                    excerpts += [line.strip() for line in ptx.splitlines()
                                 if MEMORY_OP.search(line) or "cvt.rn" in line][:80]
                    excerpts.append(f"== {name}: SASS global memory instructions")
                    excerpts += [line.strip() for line in sass.splitlines()
                                 if SASS_OP.search(line)][:80]
    print("\n".join(report))
    if args.out is not None:
        args.out.write_text("\n".join(report + [""] + excerpts) + "\n")


if __name__ == "__main__":
    main()

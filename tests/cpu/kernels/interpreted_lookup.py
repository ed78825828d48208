"""Run the Triton lookup kernel under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors)
against the torch reference; used by test_lookup_interpreter.py in a subprocess, since the
interpreter must be chosen before the kernel module is imported.
Usage: TRITON_INTERPRET=1 python tests/cpu/kernels/interpreted_lookup.py HEAD_DIM SEED
       TRITON_INTERPRET=1 python tests/cpu/kernels/interpreted_lookup.py launcher SEED
"""

import itertools
import math
import sys

import torch

from engram_ray.kernels import lookup as kernel
from engram_ray.model.reference import lookup_reference, random_table


def run(src, ids, head_dim, out, *, peer_rows=None, sort=False, prefetch=False,
        block_rows=16, rows_32=False, split_bytes=0):
    """The kernel's launch (as `engram_lookup` makes it) on CPU tensors; outputs poisoned."""
    row_bytes = head_dim + head_dim // 32
    flat = ids.reshape(-1)
    result = torch.empty(flat.numel(), row_bytes if out == "packed" else head_dim,
                         dtype=kernel.OUTPUTS[out])
    result.view(torch.uint8).fill_(0xA5)
    dst = flat
    if sort:
        flat, dst = flat.sort()
    programs = 3
    kernel._engram_lookup_kernel[(programs,)](
        src, flat, dst, result, flat.numel(), peer_rows or 1, programs, 0, HEAD_DIM=head_dim,
        SCALE_WORD=kernel.SCALE_WORDS[head_dim // 32], BLOCK_R=block_rows,
        IS_PEER=peer_rows is not None, IS_SORTED=sort, IS_BF16=out == "bf16",
        PREFETCH=prefetch, ROW_ALIGN=math.gcd(row_bytes, 8), ROWS_32=rows_32,
        SPLIT_WORDS=split_bytes // 8)
    return result.view(*ids.shape, -1)


def check(head_dim: int, seed: int) -> int:
    torch.manual_seed(seed)
    row_bytes = head_dim + head_dim // 32
    rows = 41
    table = random_table(rows, head_dim)
    # numpy (the interpreter) rounds bf16 subnormals unlike the GPU: keep products normal.
    table[:, head_dim:] = torch.randint(110, 140, (rows, head_dim // 32), dtype=torch.uint8)
    checked = 0
    # A view from row 1 moves every row by row_bytes (off its usual alignment).
    for view, out, prefetch, sort, tokens, block_rows in itertools.product(
            [False, True], ["packed", "bf16"], [False, True], [False, True], [1, 17, 40],
            [16, 32]):
        source = table[1:] if view else table
        ids = torch.randint(-1, source.shape[0], (tokens, 3))
        ids.view(-1)[0], ids.view(-1)[-1] = source.shape[0] - 1, 0
        got = run(source, ids, head_dim, out, sort=sort, prefetch=prefetch,
                  block_rows=block_rows)
        expected = lookup_reference(source, ids, head_dim, out)
        if not torch.equal(got.view(torch.uint8), expected.view(torch.uint8)):
            print(f"MISMATCH view={view} out={out} prefetch={prefetch} sort={sort} "
                  f"tokens={tokens} block_rows={block_rows}")
            return 1
        checked += 1
    # Peer: two slices at unrelated (16-byte aligned) addresses, row r on slice r // half.
    half = (rows + 1) // 2
    slices = [table[:half].clone(), torch.zeros(half, row_bytes, dtype=torch.uint8)]
    slices[1][:rows - half] = table[half:]
    bases = torch.tensor([part.data_ptr() for part in slices], dtype=torch.int64)
    for out, rows_32 in itertools.product(["packed", "bf16"], [False, True]):
        ids = torch.randint(-1, rows, (20, 3))
        got = run(bases, ids, head_dim, out, peer_rows=half, rows_32=rows_32)
        if not torch.equal(got.view(torch.uint8),
                           lookup_reference(table, ids, head_dim, out).view(torch.uint8)):
            print(f"MISMATCH peer out={out} rows_32={rows_32}")
            return 1
        checked += 1
    if head_dim == kernel.SPLIT_HEAD_DIM:
        split_cases = check_split_loads(table, head_dim)
        if split_cases is None:
            return 1
        checked += split_cases
    print(f"ok head_dim={head_dim} cases={checked}")
    return 0


def check_split_loads(table, head_dim: int) -> int | None:
    """Loads cut at a 32-byte sector or a 128-byte line boundary (`split_bytes`), from a table
    and from peer slices starting 0, 8, 16 and 24 bytes past a sector boundary (rows take every
    cut point either way, since row r starts 8r bytes further mod 128); tiles, prefetch."""
    rows, row_bytes = table.shape
    half = (rows + 1) // 2
    checked = 0
    for split_bytes, shift, out, prefetch, sort, block_rows, peer in itertools.product(
            [32, 128], [0, 8, 16, 24], ["packed", "bf16"], [False, True], [False, True],
            [16, 32], [False, True]):
        count = 2 if peer else 1
        size = half if peer else rows
        buffers = [torch.zeros(size * row_bytes + 64, dtype=torch.uint8) for _ in range(count)]
        parts = []
        for k, buffer in enumerate(buffers):
            start = (-buffer.data_ptr()) % 32 + (shift + 8 * k) % 32
            parts.append(buffer[start:start + size * row_bytes].view(size, row_bytes))
        if peer:
            parts[0].copy_(table[:half])
            parts[1][:rows - half] = table[half:]
            src = torch.tensor([part.data_ptr() for part in parts], dtype=torch.int64)
        else:
            src = parts[0]
            src.copy_(table)
        ids = torch.randint(-1, rows, (23, 3))
        ids.view(-1)[0], ids.view(-1)[-1] = rows - 1, 0
        got = run(src, ids, head_dim, out, peer_rows=half if peer else None, sort=sort,
                  prefetch=prefetch, block_rows=block_rows, rows_32=peer,
                  split_bytes=split_bytes)
        if not torch.equal(got.view(torch.uint8),
                           lookup_reference(table, ids, head_dim, out).view(torch.uint8)):
            print(f"MISMATCH split_bytes={split_bytes} shift={shift} out={out} peer={peer} "
                  f"prefetch={prefetch} sort={sort} block_rows={block_rows}")
            return None
        checked += 1
    return checked


def check_launcher(seed: int) -> int:
    """`LookupLauncher` (what serving calls) on CPU tensors: int32 and int64 ids, contiguous and
    as a column slice of `[T, L, C]` (vLLM's hashes), both outputs written in place, tables and
    peer slices, the policy's 16-row tiles and fixed 32-row / sorted / prefetch launches; every
    call twice (the second reuses the prepared launch)."""
    from engram_ray.kernels.lookup_launch import LookupLauncher
    torch.manual_seed(seed)
    head_dim, rows, cols = 256, 37, 3
    table = random_table(rows, head_dim)
    table[:, head_dim:] = torch.randint(110, 140, (rows, head_dim // 32), dtype=torch.uint8)
    half = (rows + 1) // 2
    slices = [table[:half].clone(), torch.zeros(half, table.shape[1], dtype=torch.uint8)]
    slices[1][:rows - half] = table[half:]
    bases = torch.tensor([part.data_ptr() for part in slices], dtype=torch.int64)
    sources = {"table": dict(table=table), "peer": dict(peer_bases=bases, rows_per_rank=half)}
    options = [{}, dict(block_rows=32), dict(sort_rows=True), dict(prefetch=True)]
    checked = 0
    for (name, source), opts, dtype, is_view, out, tokens in itertools.product(
            sources.items(), options, [torch.int32, torch.int64], [False, True],
            ["packed", "bf16"], [1, 19]):
        launcher = LookupLauncher(head_dim=head_dim, device=torch.device("cpu"), **source,
                                  **opts)
        for _ in range(2):
            hashes = torch.randint(-1, rows, (tokens, 2, cols), dtype=dtype)
            ids = hashes[:, 1] if is_view else hashes[:, 1].contiguous()
            width = table.shape[1] if out == "packed" else head_dim
            into = torch.empty(tokens, cols, width, dtype=kernel.OUTPUTS[out])
            into.view(torch.uint8).fill_(0xA5)
            assert launcher(ids, into) is into
            expected = lookup_reference(table, ids.to(torch.int64), head_dim, out)
            if not torch.equal(into.view(torch.uint8), expected.view(torch.uint8)):
                print(f"MISMATCH launcher {name} {opts} {dtype} view={is_view} out={out} "
                      f"tokens={tokens}")
                return 1
            checked += 1
    print(f"ok launcher cases={checked}")
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "launcher":
        sys.exit(check_launcher(int(sys.argv[2])))
    sys.exit(check(int(sys.argv[1]), int(sys.argv[2])))

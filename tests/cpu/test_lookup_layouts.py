"""Table layouts of the lookup kernel (`LookupLauncher(layout=...)`): vLLM's split layout
(values `[rows, head_dim]` + scales `[rows, head_dim // 32]`, what the DeepSeek patch
allocates for pinned host tables) and packed rows that never cross a 4 KiB page, run by
Triton's interpreter on CPU tensors and compared bit for bit with the torch reference on the
packed table; plus what the launcher refuses. tests/gpu repeats the split layout on the GPU."""

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


def _tables(rows: int, head_dim: int, seed: int):
    """A packed random table (normal bf16 products: numpy rounds subnormals unlike the GPU)
    and its split and pages copies; the scales sit below the values in memory and the values
    start off any 4 KiB page (the offset the kernel adds is negative and unaligned to it)."""
    from engram_ray.kernels.lookup_launch import page_rows
    from engram_ray.model.reference import random_table
    torch.manual_seed(seed)
    row_bytes = head_dim + head_dim // 32
    table = random_table(rows, head_dim)
    table[:, head_dim:] = torch.randint(110, 140, (rows, head_dim // 32), dtype=torch.uint8)
    memory = torch.zeros(rows * row_bytes + 4096, dtype=torch.uint8)
    start = (-memory.data_ptr()) % 16 + 16
    scales = memory[start:start + rows * (head_dim // 32)].view(rows, head_dim // 32)
    first = start + rows * (head_dim // 32)
    first += (-(memory.data_ptr() + first)) % 16
    values = memory[first:first + rows * head_dim].view(rows, head_dim)
    values.copy_(table[:, :head_dim])
    scales.copy_(table[:, head_dim:])
    per_page, stride = page_rows(row_bytes)
    pages = -(-rows // per_page)
    paged = torch.zeros(pages * 4096 + 16, dtype=torch.uint8)
    shift = (-paged.data_ptr()) % 16
    paged = paged[shift:shift + pages * 4096].view(pages, 4096)
    slots = paged[:, :per_page * stride].unflatten(1, (per_page, stride))  # a view
    for row in range(rows):
        slots[row // per_page, row % per_page, :row_bytes] = table[row]
    return table, dict(table=values, scales=scales), dict(table=paged, layout="pages")


def check(seed: int) -> int:
    from engram_ray.kernels import lookup as kernel
    from engram_ray.kernels.lookup_launch import LookupLauncher
    from engram_ray.model.reference import lookup_reference
    checked = 0
    for head_dim in (64, 256):
        table, split, pages = _tables(41, head_dim, seed + head_dim)
        options = [{}, dict(block_rows=32), dict(sort_rows=True), dict(prefetch=True),
                   dict(block_rows=32, sort_rows=True, prefetch=True)]
        for (name, source), opts, (dtype, is_view), out, tokens in itertools.product(
                (("split", split), ("pages", pages)), options,
                [(torch.int32, True), (torch.int64, False)], ["packed", "bf16"], [19]):
            launcher = LookupLauncher(head_dim=head_dim, device=torch.device("cpu"), **source,
                                      **opts)
            hashes = torch.randint(-1, table.shape[0], (tokens, 2, 3), dtype=dtype)
            hashes.view(-1)[3], hashes.view(-1)[-1] = table.shape[0] - 1, 0
            ids = hashes[:, 1] if is_view else hashes[:, 1].contiguous()
            width = table.shape[1] if out == "packed" else head_dim
            into = torch.empty(tokens, 3, width, dtype=kernel.OUTPUTS[out])
            into.view(torch.uint8).fill_(0xA5)
            assert launcher(ids, into) is into
            expected = lookup_reference(table, ids.to(torch.int64), head_dim, out)
            if not torch.equal(into.view(torch.uint8), expected.view(torch.uint8)):
                print(f"MISMATCH {name} head_dim={head_dim} {opts} {dtype} view={is_view} "
                      f"out={out} tokens={tokens}")
                return 1
            checked += 1
    print(f"ok layouts cases={checked}")
    return 0


def test_split_and_page_layouts_under_the_interpreter_match_the_reference(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, __file__, "5"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "ok layouts" in done.stdout


def test_layouts_refuse_what_the_kernel_cannot_read():
    from engram_ray.kernels.lookup_launch import check_layout
    values = torch.zeros(8, 256, dtype=torch.uint8)
    scales = torch.zeros(8, 8, dtype=torch.uint8)
    check_layout(256, "split", values, scales, is_interpreted=True)  # accepted
    with pytest.raises(ValueError, match="layout is 'rows'"):
        check_layout(256, "rows", values, scales)
    with pytest.raises(ValueError, match="needs scales"):
        check_layout(256, "split", values, None)
    with pytest.raises(ValueError, match="scales are"):
        check_layout(256, "split", values, torch.zeros(7, 8, dtype=torch.uint8), True)
    with pytest.raises(ValueError, match="values"):
        check_layout(256, "split", values[:, :128], scales, True)
    with pytest.raises(ValueError, match="pinned"):  # plain host memory, not interpreted
        check_layout(256, "split", values, scales)
    with pytest.raises(ValueError, match="pages"):
        check_layout(256, "pages", torch.zeros(2, 4000, dtype=torch.uint8), None)
    with pytest.raises(ValueError, match="scales= goes with split"):
        check_layout(256, "packed", values, scales)


def test_split_tables_on_cpu_memory_are_refused_by_the_model_path():
    from engram_ray.tables.lookup import TableLookup
    with pytest.raises(ValueError, match="split tables"):
        TableLookup(256, table=torch.zeros(8, 256, dtype=torch.uint8),
                    scales=torch.zeros(8, 8, dtype=torch.uint8))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(check(int(sys.argv[1])))

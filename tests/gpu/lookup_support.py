"""Shared by the lookup kernel's GPU tests (test_lookup.py, test_lookup_launches.py): the
table's size and shape, random ids with the edge rows, poisoned outputs, bitwise checks.
Tables are larger than 2^31 bytes (a third of the rows sit past 2^31 bytes), ids are fresh per
test (their seed fixed by its parameters and shown in its id: `seeded`), -1 ids and the first and last rows are always looked up, and outputs are poisoned before
each launch so an unwritten byte cannot pass. The tables themselves are fixtures (conftest.py).
"""

import itertools
import zlib

import pytest
import torch

from engram_ray.model.reference import lookup_reference

HEAD_DIM = 256
ROW_BYTES = 264
NUM_ROWS = 12_000_000                   # 3.17 GB: rows past 8.13M sit beyond 2^31 bytes
ROWS_PER_RANK = 9_000_000               # slice 0: 2.38 GB, slice 1: the last 3M rows
assert NUM_ROWS * ROW_BYTES > 2**31 and ROWS_PER_RANK * ROW_BYTES > 2**31
# (num_tokens, num_cols): 0, 1, 15, 17, 127, 129 and ~1M rows looked up.
SHAPES = [(0, 24), (1, 1), (1, 15), (1, 17), (127, 1), (43, 3), (43691, 24)]
# (block_rows, prefetch): fixed tiles with both loop shapes, and the policy (None, None).
TILES = [(16, False), (16, True), (128, False), (128, True), (None, None)]
OUTS = ["packed", "bf16"]


def tile_id(tile):
    block_rows, prefetch = tile
    return f"r{block_rows}{'-prefetch' if prefetch else ''}" if block_rows else "policy"


def sort_id(sort_rows):
    return "sorted" if sort_rows else "unsorted"


def shape_id(shape):
    return f"{shape[0] * shape[1]}rows"


def seeded(tag, **axes):
    """`pytest.mark.parametrize` arguments over every combination of `axes` (name -> (values,
    id function or None)) plus a last argument `seed`: `seed_of(tag, *combination)`, fixed by
    the parameters and shown in the test id (`...-seed<N>`), so a failing id names its seed."""
    names = list(axes)
    params = []
    for combination in itertools.product(*(values for values, _ in axes.values())):
        seed = seed_of(tag, *combination)
        label = "-".join((ident or str)(value)
                         for (_, ident), value in zip(axes.values(), combination))
        params.append(pytest.param(*combination, seed, id=f"{label}-seed{seed}"))
    return ",".join(names + ["seed"]), params


def lookup(**kwargs):
    from engram_ray.kernels.lookup import engram_lookup
    return engram_lookup(head_dim=HEAD_DIM, **kwargs)


def seed_of(*parts):
    """A seed fixed by the test's parameters, the same in every run: crc32 of their repr, not
    `hash()`, which changes with PYTHONHASHSEED. Tests get it through `seeded`, in their id."""
    return zlib.crc32(repr(parts).encode())


def random_ids(shape, seed, device="cuda:0"):
    """Uniform random rows, ~5% -1, and the first and last row whenever there is room."""
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, NUM_ROWS, shape, generator=generator, device=device)
    ids[torch.rand(shape, generator=generator, device=device) < 0.05] = -1
    flat = ids.view(-1)
    for position, row in ((0, 0), (-1, NUM_ROWS - 1), (1, -1), (-2, ROWS_PER_RANK - 1),
                          (2, ROWS_PER_RANK)):
        if flat.numel() > 4:
            flat[position] = row
    return ids


def poisoned(shape, out, device="cuda:0"):
    width = ROW_BYTES if out == "packed" else HEAD_DIM
    result = torch.empty(*shape, width, dtype=torch.uint8 if out == "packed" else torch.bfloat16,
                         device=device)
    result.view(torch.uint8).fill_(0xA5)
    return result


def assert_bitwise(got, expected):
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert got.device == expected.device
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def check(table_for_reference, shape, out, seed, device="cuda:0", **kwargs):
    ids = random_ids(shape, seed, device)
    into = poisoned(shape, out, device)
    got = lookup(row_ids=ids, out=out, into=into, **kwargs)
    assert got.data_ptr() == into.data_ptr()
    torch.cuda.synchronize(device)
    assert_bitwise(got, lookup_reference(table_for_reference, ids, HEAD_DIM, out=out))

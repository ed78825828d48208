"""Every lookup kernel variant against the torch reference, bit for bit (`torch.equal`).

Variants: 16-row, 128-row and policy tiles x packed and bf16 output x table in HBM, pinned host
(small pages, unsorted and sorted ids), host on transparent huge pages, peer slices on one GPU
and across two GPUs. Tables are larger than 2^31 bytes (a third of the rows sit past 2^31 bytes),
ids are fresh per test, -1 ids and the first and last rows are always looked up, and outputs
are poisoned before each launch so an unwritten byte cannot pass.
"""

import pytest
import torch

from engram_ray.reference import lookup_reference, lookup_reference_split, random_table

pytestmark = pytest.mark.gpu

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


def _tile_id(tile):
    block_rows, prefetch = tile
    return f"r{block_rows}{'-prefetch' if prefetch else ''}" if block_rows else "policy"


def _lookup(**kwargs):
    from engram_ray.kernels.lookup import engram_lookup
    return engram_lookup(head_dim=HEAD_DIM, **kwargs)


@pytest.fixture(scope="module")
def hbm_table():
    generator = torch.Generator(device="cuda:0").manual_seed(2026)
    return random_table(NUM_ROWS, HEAD_DIM, generator=generator, device="cuda:0")


def _host_copy(hbm_table, use_thp):
    from engram_ray.host_memory import allocate_host_table
    table = allocate_host_table(hbm_table.numel(), use_thp=use_thp).view(-1, ROW_BYTES)
    table.copy_(hbm_table)
    return table


@pytest.fixture(scope="module")
def host_table(hbm_table):
    return _host_copy(hbm_table, use_thp=False)


@pytest.fixture(scope="module")
def thp_table(hbm_table):
    return _host_copy(hbm_table, use_thp=True)


@pytest.fixture(scope="module")
def two_gpu_slices(hbm_table):
    """Slice 0 on cuda:0 (a view of the table), slice 1 (the last, shorter) on cuda:1."""
    from engram_ray.kernels.lookup import enable_peer_access
    enable_peer_access(0, 1)
    enable_peer_access(1, 0)
    return [hbm_table[:ROWS_PER_RANK], hbm_table[ROWS_PER_RANK:].to("cuda:1")]


def _row_ids(shape, seed, device="cuda:0"):
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


def _poisoned(shape, out, device="cuda:0"):
    width = ROW_BYTES if out == "packed" else HEAD_DIM
    result = torch.empty(*shape, width, dtype=torch.uint8 if out == "packed" else torch.bfloat16,
                         device=device)
    result.view(torch.uint8).fill_(0xA5)
    return result


def _assert_bitwise(got, expected):
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert got.device == expected.device
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def _check(table_for_reference, shape, out, seed, device="cuda:0", **kwargs):
    ids = _row_ids(shape, seed, device)
    into = _poisoned(shape, out, device)
    got = _lookup(row_ids=ids, out=out, into=into, **kwargs)
    assert got.data_ptr() == into.data_ptr()
    torch.cuda.synchronize(device)
    _assert_bitwise(got, lookup_reference(table_for_reference, ids, HEAD_DIM, out=out))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0] * s[1]}rows")
@pytest.mark.parametrize("tile", TILES, ids=_tile_id)
@pytest.mark.parametrize("out", OUTS)
def test_hbm(hbm_table, out, tile, shape):
    _check(hbm_table, shape, out, seed=hash((out, tile, shape)) % 2**31,
           table=hbm_table, block_rows=tile[0], prefetch=tile[1])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0] * s[1]}rows")
@pytest.mark.parametrize("tile", TILES, ids=_tile_id)
@pytest.mark.parametrize("out", OUTS)
@pytest.mark.parametrize("sort_rows", [False, True], ids=["unsorted", "sorted"])
def test_host_pinned(host_table, sort_rows, out, tile, shape):
    _check(host_table, shape, out, seed=hash((sort_rows, out, tile, shape)) % 2**31,
           table=host_table, block_rows=tile[0], prefetch=tile[1], sort_rows=sort_rows)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0] * s[1]}rows")
@pytest.mark.parametrize("tile", TILES, ids=_tile_id)
@pytest.mark.parametrize("out", OUTS)
def test_host_thp(thp_table, out, tile, shape):
    _check(thp_table, shape, out, seed=hash(("thp", out, tile, shape)) % 2**31,
           table=thp_table, block_rows=tile[0], prefetch=tile[1])


def test_thp_table_is_registered_on_huge_pages(thp_table, host_table):
    from engram_ray.host_memory import huge_page_bytes, is_huge_page_backed
    from engram_ray.kernels.lookup import table_placement
    assert thp_table.is_pinned() and is_huge_page_backed(thp_table)
    assert table_placement(thp_table, None) == "host_thp"
    assert table_placement(host_table, None) == "host"
    fraction = huge_page_bytes(thp_table) / thp_table.nbytes
    print(f"THP table: {fraction:.1%} of {thp_table.nbytes} bytes on huge pages")
    assert fraction > 0.5


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0] * s[1]}rows")
@pytest.mark.parametrize("tile", TILES, ids=_tile_id)
@pytest.mark.parametrize("out", OUTS)
def test_peer_slices_one_gpu(hbm_table, out, tile, shape):
    slices = list(hbm_table.split(ROWS_PER_RANK))
    bases = torch.tensor([piece.data_ptr() for piece in slices], device="cuda:0")
    _check(hbm_table, shape, out, seed=hash(("peer1", out, tile, shape)) % 2**31,
           peer_bases=bases, rows_per_rank=ROWS_PER_RANK, block_rows=tile[0], prefetch=tile[1])


@pytest.mark.multi_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0] * s[1]}rows")
@pytest.mark.parametrize("tile", TILES, ids=_tile_id)
@pytest.mark.parametrize("out", OUTS)
@pytest.mark.parametrize("device", ["cuda:0", "cuda:1"])
def test_peer_slices_two_gpus(hbm_table, two_gpu_slices, device, out, tile, shape):
    bases = torch.tensor([piece.data_ptr() for piece in two_gpu_slices], device=device)
    seed = hash(("peer2", device, out, tile, shape)) % 2**31
    ids = _row_ids(shape, seed, device)
    into = _poisoned(shape, out, device)
    got = _lookup(row_ids=ids, out=out, into=into, peer_bases=bases,
                  rows_per_rank=ROWS_PER_RANK, block_rows=tile[0], prefetch=tile[1])
    torch.cuda.synchronize(device)
    expected = lookup_reference_split(two_gpu_slices, ROWS_PER_RANK, ids, HEAD_DIM, out=out)
    _assert_bitwise(got, expected)
    _assert_bitwise(expected.to("cuda:0"), lookup_reference(hbm_table, ids.to("cuda:0"),
                                                            HEAD_DIM, out=out))


def test_subnormal_and_overflowing_products_match(hbm_table):
    """Every scale byte 0..254 on the first rows: subnormal, normal and infinite bf16 results."""
    table = hbm_table[:4096].clone()
    table[:, HEAD_DIM:] = torch.arange(4096 * 8, device="cuda:0").view(4096, 8).remainder(255)
    ids = torch.arange(4096, device="cuda:0").view(128, 32)
    for block_rows, prefetch in TILES:
        got = _lookup(row_ids=ids, table=table, out="bf16", block_rows=block_rows,
                      prefetch=prefetch)
        _assert_bitwise(got, lookup_reference(table, ids, HEAD_DIM, out="bf16"))


def test_policy_and_argument_errors(hbm_table):
    from engram_ray.kernels.lookup import TILE_POLICY, choose_block_rows, large_block_rows
    for placement, (min_rows, max_rows) in TILE_POLICY.items():
        assert choose_block_rows(min(min_rows - 1, 1 << 20), ROW_BYTES, placement) == 16
        assert choose_block_rows(min_rows, ROW_BYTES, placement) == (
            128 if min_rows < max_rows else 16)
        assert choose_block_rows(max_rows, ROW_BYTES, placement) == 16
    assert large_block_rows(2048) == 16 and large_block_rows(528) == 64
    ids = torch.zeros(2, 3, dtype=torch.int64, device="cuda:0")
    with pytest.raises(ValueError, match="exactly one of"):
        _lookup(row_ids=ids)
    with pytest.raises(ValueError, match="pageable host memory"):
        _lookup(row_ids=ids, table=torch.zeros(4, ROW_BYTES, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected one of"):
        _lookup(row_ids=ids, table=hbm_table, out="fp8")
    with pytest.raises(ValueError, match="power of two"):
        _lookup(row_ids=ids, table=hbm_table, block_rows=24)


@pytest.mark.parametrize("placement", ["hbm", "peer"])
def test_checked_ids_outside_the_table_are_refused(hbm_table, placement):
    """check_ids=True: an id past the table (peer: past rows_per_rank x P) or below -1 is named
    with its [token, column] before any launch; in-range ids (-1 included) look up as usual."""
    source = {"table": hbm_table}
    limit = NUM_ROWS
    if placement == "peer":
        slices = hbm_table.split(ROWS_PER_RANK)
        source = {"peer_bases": torch.tensor([piece.data_ptr() for piece in slices],
                                             dtype=torch.int64, device="cuda:0"),
                  "rows_per_rank": ROWS_PER_RANK}
        limit = ROWS_PER_RANK * len(slices)
    ids = _row_ids((43, 3), seed=5).clamp(max=NUM_ROWS - 1)
    got = _lookup(row_ids=ids, out="packed", check_ids=True, **source)
    _assert_bitwise(got, lookup_reference(hbm_table, ids, HEAD_DIM, out="packed"))
    for bad in (limit, -2):
        wrong = ids.clone()
        wrong[7, 2] = bad
        with pytest.raises(ValueError, match=rf"row_ids\[7, 2\] is {bad}; expected -1 \(no "
                                             rf"row\) or a row of the table, 0\.\.{limit - 1}"):
            _lookup(row_ids=wrong, out="packed", check_ids=True, **source)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("tile", TILES, ids=_tile_id)
@pytest.mark.parametrize("out", OUTS)
def test_narrow_rows_hbm_and_peer(head_dim, tile, out):
    """Rows of 33, 66 and 132 bytes (not 8-byte aligned): the kernel is told their real
    alignment, so loads stay aligned; bit-exact on a whole table and on two slices."""
    from engram_ray.kernels.lookup import engram_lookup
    generator = torch.Generator(device="cuda:0").manual_seed(head_dim)
    table = random_table(100_003, head_dim, generator=generator, device="cuda:0")
    ids = _row_ids((129, 24), hash(("narrow", head_dim, out, tile)) % 2**31, "cuda:0")
    ids = ids.remainder(table.shape[0]).where(ids >= 0, ids)
    expected = lookup_reference(table, ids, head_dim, out=out)
    got = engram_lookup(ids, head_dim=head_dim, table=table, out=out, block_rows=tile[0],
                        prefetch=tile[1])
    _assert_bitwise(got, expected)
    per_rank = 60_000
    slices = [table[:per_rank].clone(), table[per_rank:].clone()]
    bases = torch.tensor([piece.data_ptr() for piece in slices], device="cuda:0")
    got = engram_lookup(ids, head_dim=head_dim, peer_bases=bases, rows_per_rank=per_rank,
                        out=out, block_rows=tile[0], prefetch=tile[1])
    _assert_bitwise(got, expected)



@pytest.mark.parametrize("out", OUTS)
@pytest.mark.parametrize("tile", TILES, ids=_tile_id)
def test_peer_slices_with_64_bit_owner_division(hbm_table, out, tile, monkeypatch):
    """The committed peer launches divide in 32 bits (TileConfig.rows_32); the 64-bit division
    (ids of 2^31 and more) stays bit-exact too."""
    from dataclasses import replace

    from engram_ray.kernels import lookup as kernel
    assert all(c.rows_32 for c in kernel.TILE_CONFIGS["peer"].values())
    monkeypatch.setitem(kernel.TILE_CONFIGS, "peer", {
        rows: replace(config, rows_32=False)
        for rows, config in kernel.TILE_CONFIGS["peer"].items()})
    slices = list(hbm_table.split(ROWS_PER_RANK))
    bases = torch.tensor([piece.data_ptr() for piece in slices], device="cuda:0")
    _check(hbm_table, (43691, 24), out, seed=hash(("rows64", out, tile)) % 2**31,
           peer_bases=bases, rows_per_rank=ROWS_PER_RANK, block_rows=tile[0], prefetch=tile[1])


@pytest.mark.parametrize("split_bytes", [0, 32, 128])
@pytest.mark.parametrize("shift", [0, 8, 16, 24])
@pytest.mark.parametrize("out", OUTS)
@pytest.mark.parametrize("tile", TILES, ids=_tile_id)
def test_peer_slices_with_split_loads(hbm_table, split_bytes, shift, out, tile, monkeypatch):
    """TileConfig.split_bytes: each 264-byte row loaded in two pieces cut at its first 32-byte
    sector or 128-byte line boundary, or (0) as a values load and a scale-word load. Slices
    start 0, 8, 16 and 24 bytes past a sector boundary, and rows take every cut point (row r
    starts 8r bytes further, mod 128)."""
    from dataclasses import replace

    from engram_ray.kernels import lookup as kernel
    monkeypatch.setitem(kernel.TILE_CONFIGS, "peer", {
        rows: replace(config, split_bytes=split_bytes)
        for rows, config in kernel.TILE_CONFIGS["peer"].items()})
    buffer = torch.empty(hbm_table.numel() + 64, dtype=torch.uint8, device="cuda:0")
    start = (-buffer.data_ptr()) % 32 + shift
    moved = buffer[start:start + hbm_table.numel()].view(-1, ROW_BYTES)
    moved.copy_(hbm_table)
    bases = torch.tensor([piece.data_ptr() for piece in moved.split(ROWS_PER_RANK)],
                         device="cuda:0")
    assert {base % 32 for base in bases.tolist()} == {shift}
    for shape in ((1, 17), (43, 3), (43691, 24)):
        _check(hbm_table, shape, out,
               seed=hash(("split", split_bytes, shift, out, tile, shape)) % 2**31,
               peer_bases=bases, rows_per_rank=ROWS_PER_RANK, block_rows=tile[0],
               prefetch=tile[1])


@pytest.mark.multi_gpu
@pytest.mark.parametrize("split_bytes", [0, 32, 128])
@pytest.mark.parametrize("out", OUTS)
def test_peer_slices_two_gpus_with_split_loads(hbm_table, two_gpu_slices, split_bytes, out,
                                               monkeypatch):
    from dataclasses import replace

    from engram_ray.kernels import lookup as kernel
    monkeypatch.setitem(kernel.TILE_CONFIGS, "peer", {
        rows: replace(config, split_bytes=split_bytes)
        for rows, config in kernel.TILE_CONFIGS["peer"].items()})
    bases = torch.tensor([piece.data_ptr() for piece in two_gpu_slices], device="cuda:0")
    ids = _row_ids((43691, 24), hash(("split2", split_bytes, out)) % 2**31)
    got = _lookup(row_ids=ids, out=out, into=_poisoned((43691, 24), out), peer_bases=bases,
                  rows_per_rank=ROWS_PER_RANK, block_rows=16)
    _assert_bitwise(got, lookup_reference(hbm_table, ids, HEAD_DIM, out=out))


@pytest.mark.parametrize("split_bytes", [32, 128])
@pytest.mark.parametrize("placement", ["hbm", "host", "host_thp"])
@pytest.mark.parametrize("out", OUTS)
@pytest.mark.parametrize("tile", TILES, ids=_tile_id)
def test_tables_with_split_loads(hbm_table, host_table, thp_table, split_bytes, placement, out,
                                 tile, monkeypatch):
    """TileConfig.split_bytes from HBM and host tables, the whole table and a view from row 1
    (every row moved by 264 bytes)."""
    from dataclasses import replace

    from engram_ray.kernels import lookup as kernel
    monkeypatch.setitem(kernel.TILE_CONFIGS, placement, {
        rows: replace(config, split_bytes=split_bytes)
        for rows, config in kernel.TILE_CONFIGS[placement].items()})
    table = {"hbm": hbm_table, "host": host_table, "host_thp": thp_table}[placement]
    for first in (0, 1):
        for shape in ((43, 3), (43691, 24)):
            seed = hash(("tsplit", split_bytes, placement, out, tile, shape, first)) % 2**31
            ids = _row_ids(shape, seed).clamp(max=NUM_ROWS - 1 - first)
            got = _lookup(row_ids=ids, out=out, into=_poisoned(shape, out), table=table[first:],
                          block_rows=tile[0], prefetch=tile[1])
            torch.cuda.synchronize()
            _assert_bitwise(got, lookup_reference(hbm_table[first:], ids, HEAD_DIM, out=out))


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("split_bytes", [0, 32, 128])
@pytest.mark.parametrize("placement", ["hbm", "host", "host_thp", "peer"])
@pytest.mark.parametrize("out", OUTS)
@pytest.mark.parametrize("block_rows", [16, 128])
def test_pipelined_loads(hbm_table, host_table, thp_table, num_stages, split_bytes, placement,
                         out, block_rows, monkeypatch):
    """TileConfig.num_stages (tiles in flight through cp.async into shared memory, masked
    copies zero-filled) from HBM, host and THP tables (the whole table and a view from row 1:
    every row moved by 264 bytes) and peer slices on one GPU (16-byte aligned bases: the
    whole table only), rows whole or cut."""
    from dataclasses import replace

    from engram_ray.kernels import lookup as kernel
    monkeypatch.setitem(kernel.TILE_CONFIGS, placement, {
        rows: replace(config, prefetch=False, num_stages=num_stages, split_bytes=split_bytes,
                      split_bf16=True)
        for rows, config in kernel.TILE_CONFIGS[placement].items()})
    table = {"hbm": hbm_table, "host": host_table, "host_thp": thp_table,
             "peer": hbm_table}[placement]
    for first in (0,) if placement == "peer" else (0, 1):
        for shape in ((43, 3), (43691, 24)):
            seed = hash(("stages", num_stages, split_bytes, placement, out, block_rows, shape,
                         first)) % 2**31
            ids = _row_ids(shape, seed).clamp(max=NUM_ROWS - 1 - first)
            source = {"table": table[first:]}
            if placement == "peer":
                slices = table[first:].split(ROWS_PER_RANK)
                source = {"peer_bases": torch.tensor([piece.data_ptr() for piece in slices],
                                                     dtype=torch.int64, device="cuda:0"),
                          "rows_per_rank": ROWS_PER_RANK}
            got = _lookup(row_ids=ids, out=out, into=_poisoned(shape, out),
                          block_rows=block_rows, **source)
            torch.cuda.synchronize()
            _assert_bitwise(got, lookup_reference(hbm_table[first:], ids, HEAD_DIM, out=out))

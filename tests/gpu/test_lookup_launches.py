"""Launch options of the lookup kernel against the torch reference, bit for bit: peer owner
division in 64 bits, row loads cut at a sector or a line (every cut point, one and two GPUs,
HBM and host tables), and checked ids."""

import pytest
import torch

from engram_ray.model.reference import lookup_reference

from lookup_support import (HEAD_DIM, NUM_ROWS, OUTS, ROW_BYTES, ROWS_PER_RANK, TILES,
                            assert_bitwise, check, lookup, poisoned, random_ids, seeded, tile_id)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(*seeded("checked", placement=(["hbm", "peer"], None)))
def test_checked_ids_outside_the_table_are_refused(hbm_table, placement, seed):
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
    ids = random_ids((43, 3), seed=seed).clamp(max=NUM_ROWS - 1)
    got = lookup(row_ids=ids, out="packed", check_ids=True, **source)
    assert_bitwise(got, lookup_reference(hbm_table, ids, HEAD_DIM, out="packed"))
    for bad in (limit, -2):
        wrong = ids.clone()
        wrong[7, 2] = bad
        with pytest.raises(ValueError, match=rf"row_ids\[7, 2\] is {bad}; expected -1 \(no "
                                             rf"row\) or a row of the table, 0\.\.{limit - 1}"):
            lookup(row_ids=wrong, out="packed", check_ids=True, **source)


@pytest.mark.parametrize(*seeded("rows64", out=(OUTS, None), tile=(TILES, tile_id)))
def test_peer_slices_with_64_bit_owner_division(hbm_table, out, tile, seed, monkeypatch):
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
    check(hbm_table, (43691, 24), out, seed=seed,
           peer_bases=bases, rows_per_rank=ROWS_PER_RANK, block_rows=tile[0], prefetch=tile[1])


@pytest.mark.parametrize(*seeded("split", split_bytes=([0, 32, 128], "split{}".format),
                                 shift=([0, 8, 16, 24], "shift{}".format), out=(OUTS, None),
                                 tile=(TILES, tile_id)))
def test_peer_slices_with_split_loads(hbm_table, split_bytes, shift, out, tile, seed,
                                      monkeypatch):
    """TileConfig.split_bytes: each 264-byte row loaded in two pieces cut at its first 32-byte
    sector or 128-byte line boundary, or (0) as a values load and a scale-word load. Slices
    start 0, 8, 16 and 24 bytes past a sector boundary, and rows take every cut point (row r
    starts 8r bytes further, mod 128). Shape k of the three reads ids of seed + k."""
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
    for k, shape in enumerate(((1, 17), (43, 3), (43691, 24))):
        check(hbm_table, shape, out, seed=seed + k, peer_bases=bases, rows_per_rank=ROWS_PER_RANK, block_rows=tile[0],
               prefetch=tile[1])


@pytest.mark.multi_gpu
@pytest.mark.parametrize(*seeded("split2", split_bytes=([0, 32, 128], "split{}".format),
                                 out=(OUTS, None)))
def test_peer_slices_two_gpus_with_split_loads(hbm_table, two_gpu_slices, split_bytes, out,
                                               seed, monkeypatch):
    from dataclasses import replace

    from engram_ray.kernels import lookup as kernel
    monkeypatch.setitem(kernel.TILE_CONFIGS, "peer", {
        rows: replace(config, split_bytes=split_bytes)
        for rows, config in kernel.TILE_CONFIGS["peer"].items()})
    bases = torch.tensor([piece.data_ptr() for piece in two_gpu_slices], device="cuda:0")
    ids = random_ids((43691, 24), seed)
    got = lookup(row_ids=ids, out=out, into=poisoned((43691, 24), out), peer_bases=bases,
                  rows_per_rank=ROWS_PER_RANK, block_rows=16)
    assert_bitwise(got, lookup_reference(hbm_table, ids, HEAD_DIM, out=out))


@pytest.mark.parametrize(*seeded("tsplit", split_bytes=([32, 128], "split{}".format),
                                 placement=(["hbm", "host", "host_thp"], None),
                                 out=(OUTS, None), tile=(TILES, tile_id)))
def test_tables_with_split_loads(hbm_table, host_table, thp_table, split_bytes, placement, out,
                                 tile, seed, monkeypatch):
    """TileConfig.split_bytes from HBM and host tables, the whole table and a view from row 1
    (every row moved by 264 bytes). Read k of the four reads ids of seed + k."""
    from dataclasses import replace

    from engram_ray.kernels import lookup as kernel
    monkeypatch.setitem(kernel.TILE_CONFIGS, placement, {
        rows: replace(config, split_bytes=split_bytes)
        for rows, config in kernel.TILE_CONFIGS[placement].items()})
    table = {"hbm": hbm_table, "host": host_table, "host_thp": thp_table}[placement]
    for k, (first, shape) in enumerate([(0, (43, 3)), (0, (43691, 24)), (1, (43, 3)),
                                        (1, (43691, 24))]):
        ids = random_ids(shape, seed + k).clamp(max=NUM_ROWS - 1 - first)
        got = lookup(row_ids=ids, out=out, into=poisoned(shape, out), table=table[first:],
                     block_rows=tile[0], prefetch=tile[1])
        torch.cuda.synchronize()
        assert_bitwise(got, lookup_reference(hbm_table[first:], ids, HEAD_DIM, out=out))

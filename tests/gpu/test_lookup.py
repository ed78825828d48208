"""Every lookup kernel variant against the torch reference, bit for bit (`torch.equal`).

Variants: 16-row, 128-row and policy tiles x packed and bf16 output x table in HBM, pinned host
(small pages, unsorted and sorted ids), host on transparent huge pages, peer slices on one GPU
and across two GPUs, narrow rows. Launch options (cut loads, pipelines, 64-bit owner division,
checked ids): test_lookup_launches.py. Tables and ids: lookup_support.py, conftest.py.
"""

import pytest
import torch

from engram_ray.model.reference import lookup_reference, lookup_reference_split, random_table

from lookup_support import (HEAD_DIM, OUTS, ROW_BYTES, ROWS_PER_RANK, SHAPES, TILES, assert_bitwise,
                            check, lookup, poisoned, random_ids, seeded, shape_id, sort_id, tile_id)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(*seeded("hbm", out=(OUTS, None), tile=(TILES, tile_id),
                                 shape=(SHAPES, shape_id)))
def test_hbm(hbm_table, out, tile, shape, seed):
    check(hbm_table, shape, out, seed=seed,
           table=hbm_table, block_rows=tile[0], prefetch=tile[1])


@pytest.mark.parametrize(*seeded("host", sort_rows=([False, True], sort_id), out=(OUTS, None),
                                 tile=(TILES, tile_id), shape=(SHAPES, shape_id)))
def test_host_pinned(host_table, sort_rows, out, tile, shape, seed):
    check(host_table, shape, out, seed=seed,
           table=host_table, block_rows=tile[0], prefetch=tile[1], sort_rows=sort_rows)


@pytest.mark.parametrize(*seeded("thp", out=(OUTS, None), tile=(TILES, tile_id),
                                 shape=(SHAPES, shape_id)))
def test_host_thp(thp_table, out, tile, shape, seed):
    check(thp_table, shape, out, seed=seed,
           table=thp_table, block_rows=tile[0], prefetch=tile[1])


def test_thp_table_is_registered_on_huge_pages(thp_table, host_table):
    from engram_ray.kernels.lookup import table_placement
    from engram_ray.tables.backends.host_memory import huge_page_bytes, is_huge_page_backed
    assert thp_table.is_pinned() and is_huge_page_backed(thp_table)
    assert table_placement(thp_table, None) == "host_thp"
    assert table_placement(host_table, None) == "host"
    fraction = huge_page_bytes(thp_table) / thp_table.nbytes
    print(f"THP table: {fraction:.1%} of {thp_table.nbytes} bytes on huge pages")
    assert fraction > 0.5


@pytest.mark.parametrize(*seeded("peer1", out=(OUTS, None), tile=(TILES, tile_id),
                                 shape=(SHAPES, shape_id)))
def test_peer_slices_one_gpu(hbm_table, out, tile, shape, seed):
    slices = list(hbm_table.split(ROWS_PER_RANK))
    bases = torch.tensor([piece.data_ptr() for piece in slices], device="cuda:0")
    check(hbm_table, shape, out, seed=seed,
           peer_bases=bases, rows_per_rank=ROWS_PER_RANK, block_rows=tile[0], prefetch=tile[1])


@pytest.mark.multi_gpu
@pytest.mark.parametrize(*seeded("peer2", device=(["cuda:0", "cuda:1"], None), out=(OUTS, None),
                                 tile=(TILES, tile_id), shape=(SHAPES, shape_id)))
def test_peer_slices_two_gpus(hbm_table, two_gpu_slices, device, out, tile, shape, seed):
    bases = torch.tensor([piece.data_ptr() for piece in two_gpu_slices], device=device)
    ids = random_ids(shape, seed, device)
    into = poisoned(shape, out, device)
    got = lookup(row_ids=ids, out=out, into=into, peer_bases=bases,
                  rows_per_rank=ROWS_PER_RANK, block_rows=tile[0], prefetch=tile[1])
    torch.cuda.synchronize(device)
    expected = lookup_reference_split(two_gpu_slices, ROWS_PER_RANK, ids, HEAD_DIM, out=out)
    assert_bitwise(got, expected)
    assert_bitwise(expected.to("cuda:0"), lookup_reference(hbm_table, ids.to("cuda:0"),
                                                            HEAD_DIM, out=out))


def test_subnormal_and_overflowing_products_match(hbm_table):
    """Every scale byte 0..254 on the first rows: subnormal, normal and infinite bf16 results."""
    table = hbm_table[:4096].clone()
    table[:, HEAD_DIM:] = torch.arange(4096 * 8, device="cuda:0").view(4096, 8).remainder(255)
    ids = torch.arange(4096, device="cuda:0").view(128, 32)
    for block_rows, prefetch in TILES:
        got = lookup(row_ids=ids, table=table, out="bf16", block_rows=block_rows,
                      prefetch=prefetch)
        assert_bitwise(got, lookup_reference(table, ids, HEAD_DIM, out="bf16"))


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
        lookup(row_ids=ids)
    with pytest.raises(ValueError, match="pageable host memory"):
        lookup(row_ids=ids, table=torch.zeros(4, ROW_BYTES, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected one of"):
        lookup(row_ids=ids, table=hbm_table, out="fp8")
    with pytest.raises(ValueError, match="power of two"):
        lookup(row_ids=ids, table=hbm_table, block_rows=24)


@pytest.mark.parametrize(*seeded("narrow", head_dim=([32, 64, 128], None), out=(OUTS, None),
                                 tile=(TILES, tile_id)))
def test_narrow_rows_hbm_and_peer(head_dim, out, tile, seed):
    """Rows of 33, 66 and 132 bytes (not 8-byte aligned): the kernel is told their real
    alignment, so loads stay aligned; bit-exact on a whole table and on two slices."""
    from engram_ray.kernels.lookup import engram_lookup
    generator = torch.Generator(device="cuda:0").manual_seed(head_dim)
    table = random_table(100_003, head_dim, generator=generator, device="cuda:0")
    ids = random_ids((129, 24), seed, "cuda:0")
    ids = ids.remainder(table.shape[0]).where(ids >= 0, ids)
    expected = lookup_reference(table, ids, head_dim, out=out)
    got = engram_lookup(ids, head_dim=head_dim, table=table, out=out, block_rows=tile[0],
                        prefetch=tile[1])
    assert_bitwise(got, expected)
    per_rank = 60_000
    slices = [table[:per_rank].clone(), table[per_rank:].clone()]
    bases = torch.tensor([piece.data_ptr() for piece in slices], device="cuda:0")
    got = engram_lookup(ids, head_dim=head_dim, peer_bases=bases, rows_per_rank=per_rank,
                        out=out, block_rows=tile[0], prefetch=tile[1])
    assert_bitwise(got, expected)

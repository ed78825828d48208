"""The tile-policy tuner's choices (engram_ray.kernels.lookup_tuning) from sweep rows: pure
Python."""

from engram_ray.kernels import lookup_tuning
from engram_ray.kernels.lookup_policy import TILE_CONFIGS


def _row(placement, block_rows, per_sm, prefetch, median_ms, rows=1048584, out="packed"):
    return {"placement": placement, "rows": rows, "out": out, "block_rows": block_rows,
            "programs_per_sm": per_sm, "num_warps": 4 if block_rows == 16 else 8,
            "prefetch": prefetch, "median_ms": median_ms}


def test_best_configs_keep_the_committed_launch_fields_and_take_the_fastest_grid():
    """A re-tune changes grid, warps and prefetch only: cut loads and 32-bit owner division,
    in effect during the sweep, stay."""
    found = [_row("peer", 16, 16, False, 0.44), _row("peer", 16, 8, False, 0.47),
             _row("peer", 16, 16, True, 0.49), _row("peer", 128, 1, True, 0.50),
             _row("peer", 128, 2, False, 0.46)]
    chosen = lookup_tuning.best_configs(found)
    committed = TILE_CONFIGS["peer"]
    assert (chosen[16].programs_per_sm, chosen[16].prefetch) == (16, False)
    assert (chosen[128].programs_per_sm, chosen[128].prefetch) == (2, False)
    assert chosen[16].split_bytes == committed[16].split_bytes == 128
    assert chosen[16].rows_32 and chosen[128].rows_32 == committed[128].rows_32


def test_timed_launches_do_not_reread_recent_rows():
    """Benchmarks rotate over enough id sets that ~2^18 rows are read before a set comes round
    again (a host table's warm address translations made the next launch over the same rows
    4x faster at 4K rows), at least 4 and at most 64 sets."""
    from engram_ray.kernels.lookup_tuning import ID_SET_REUSE_ROWS, num_id_sets
    for num_rows in (1, 1032, 4104, 16392, 65544, 1572864):
        sets = num_id_sets(num_rows)
        assert 4 <= sets <= 64
        assert sets == 64 or sets * num_rows > ID_SET_REUSE_ROWS - num_rows
    assert num_id_sets(1572864) == 4 and num_id_sets(1032) == 64  # large: no more than needed

"""The lookup kernel's launch policy (kernels/lookup_policy.py): pure Python, no GPU."""

import pytest

from engram_ray.kernels.lookup_policy import (NEVER, PLACEMENTS, SORT_MIN_ROWS, TILE_CONFIGS,
                                              TILE_POLICY, TileConfig, choose_block_rows,
                                              large_block_rows, large_tile_window, split_words,
                                              tile_config)

ROW_BYTES = 264


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_window_bounds(placement):
    min_rows, max_rows = TILE_POLICY[placement]
    assert choose_block_rows(0, ROW_BYTES, placement) == 16
    assert choose_block_rows(min(min_rows, 1 << 40) - 1, ROW_BYTES, placement) == 16
    assert choose_block_rows(min_rows, ROW_BYTES, placement) == (128 if min_rows < max_rows
                                                                 else 16)
    assert choose_block_rows(max_rows, ROW_BYTES, placement) == 16
    assert set(TILE_CONFIGS[placement]) == {16, 128} and placement in SORT_MIN_ROWS


def test_small_page_host_window_and_sorting():
    for placement in ("host", "host_thp"):
        assert choose_block_rows(65544, ROW_BYTES, placement) == 16
        assert choose_block_rows(262152, ROW_BYTES, placement) == 128
        assert choose_block_rows(1572864, ROW_BYTES, placement) == 128
    assert SORT_MIN_ROWS["host"] < NEVER and SORT_MIN_ROWS["hbm"] == NEVER


def test_large_tiles_shrink_for_wide_rows():
    assert large_block_rows(264) == 128
    assert large_block_rows(528) == 64
    assert large_block_rows(2048) == 16
    assert choose_block_rows(262152, 2048, "host") == 16


def test_tile_config_defaults_and_validation():
    assert tile_config("hbm", 16) is TILE_CONFIGS["hbm"][16]
    assert tile_config("hbm", 64) == TileConfig(64, 2, 8)
    with pytest.raises(ValueError, match="power of two"):
        TileConfig(24, 1, 4)
    with pytest.raises(ValueError, match="expected one of"):
        choose_block_rows(10, ROW_BYTES, "disk")


def test_split_loads_are_sector_or_line_and_validated():
    """Cut row loads (TileConfig.split_bytes): 0, a 32-byte sector or a 128-byte line; the
    committed launches cut them where measured faster (peer and host: line; HBM packed: sector,
    bf16 output whole; small-page host 16-row tiles: bf16 output at the line, packed whole)."""
    assert TileConfig(16, 8, 4).split_bytes == 0
    assert TILE_CONFIGS["peer"][16].split_bytes == 128
    assert TILE_CONFIGS["hbm"][16].split_bytes == 32 and not TILE_CONFIGS["hbm"][16].split_bf16
    assert {c.split_bytes for c in TILE_CONFIGS["host_thp"].values()} == {128}
    # small-page host tables: 128-row tiles cut at the line; 16-row tiles (sorted 65K-262K-row
    # lookups, translation-bound) cut bf16 output only (measured against vLLM 0.33,
    # kernels/lookup_policy.py)
    host16, host128 = TILE_CONFIGS["host"][16], TILE_CONFIGS["host"][128]
    assert (host16.split_bytes, host128.split_bytes) == (128, 128)
    assert (host16.split_bf16, host16.split_packed) == (True, False) and host128.split_packed
    with pytest.raises(ValueError, match=r"split_bytes is 64; expected one of \(0, 32, 128\)"):
        TileConfig(16, 8, 4, split_bytes=64)


def test_split_words_of_a_launch():
    """What the kernel is told: words up to the cut, for 264-byte rows only; HBM's committed
    launch cuts packed output and keeps bf16 output whole."""
    hbm = TILE_CONFIGS["hbm"][16]
    assert (split_words(hbm, 256, "packed"), split_words(hbm, 256, "bf16")) == (4, 0)
    peer = TILE_CONFIGS["peer"][16]
    assert (split_words(peer, 256, "packed"), split_words(peer, 256, "bf16")) == (16, 16)
    assert split_words(peer, 128, "packed") == 0 and split_words(peer, 512, "bf16") == 0
    assert split_words(TileConfig(16, 8, 4), 256, "packed") == 0
    host = TILE_CONFIGS["host"][16]
    assert (split_words(host, 256, "packed"), split_words(host, 256, "bf16")) == (0, 16)


def test_host_large_tiles_start_at_a_share_of_the_table():
    rows_8gib, rows_32gib = (8 << 30) // ROW_BYTES, (32 << 30) // ROW_BYTES
    for placement in ("host", "host_thp"):
        # 8 GiB: the measured 262K threshold is kept (the share is below it)
        assert large_tile_window(placement, rows_8gib) == TILE_POLICY[placement]
        assert choose_block_rows(262152, ROW_BYTES, placement, rows_8gib) == 128
        # 32 GiB: 262K rows are 0.2% of the table: 16-row tiles; 1M rows (0.8%): 128
        assert choose_block_rows(262152, ROW_BYTES, placement, rows_32gib) == 16
        assert choose_block_rows(1048584, ROW_BYTES, placement, rows_32gib) == 128
        assert large_tile_window(placement, rows_32gib)[0] == -(-rows_32gib // 128)
    for placement in ("hbm", "peer"):  # no share: HBM and NVLink reads are not translation-bound
        assert large_tile_window(placement, rows_32gib) == TILE_POLICY[placement]

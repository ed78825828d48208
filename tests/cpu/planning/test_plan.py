"""Slice assignment and memory plans, checked against the design's DeepSeek-V4.1-Flash figures."""

import pytest

from engram_ray.errors import ConfigError
from engram_ray.model.layout import load_layout
from engram_ray.planning.memory import gib, make_plan, owner_of, rows_per_rank, slice_range


@pytest.fixture(scope="module")
def flash():
    return load_layout("deepseek-v4.1-flash")


@pytest.mark.parametrize("num_rows,size", [(10, 3), (7, 7), (100, 8), (384006168, 18), (5, 4)])
def test_slices_cover_rows_once(num_rows, size):
    ranges = [slice_range(num_rows, size, r) for r in range(size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == num_rows
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        assert end == start
    per_rank = rows_per_rank(num_rows, size)
    assert all(end - start <= per_rank for start, end in ranges)
    for row in {0, num_rows - 1, num_rows // 2}:
        rank, local = owner_of(row, per_rank)
        start, end = ranges[rank]
        assert start <= row < end and start + local == row


def test_slice_errors():
    with pytest.raises(ConfigError, match="more than the 5 rows"):
        rows_per_rank(5, 6)
    with pytest.raises(ConfigError, match="peer_group_size"):
        rows_per_rank(5, 0)
    with pytest.raises(ConfigError, match="rank"):
        slice_range(10, 2, 2)


def test_flash_figures(flash):
    assert gib(flash.total_bytes) == 188.83
    assert gib(make_plan(flash, "peer", peer_group_size=8).hbm_bytes_per_gpu) == 23.60
    assert gib(make_plan(flash, "peer", peer_group_size=18).hbm_bytes_per_gpu) == 10.49
    host = make_plan(flash, "host", host_mode="dp-split", dp_size=2)
    assert gib(host.host_bytes_per_gpu) == 94.42 and host.hbm_bytes_per_gpu == 0
    p4, p8 = (make_plan(flash, "peer", peer_group_size=p) for p in (4, 8))
    assert gib(p8.kv_gain_vs(p4)) == 23.60
    assert gib(make_plan(flash, "hbm").hbm_bytes_per_gpu) == 188.83


def test_host_modes(flash):
    per_engine = make_plan(flash, "host", gpus_per_node=4)
    per_node = make_plan(flash, "host", host_mode="per-node", gpus_per_node=4)
    assert per_engine.host_bytes_per_node == 4 * flash.total_bytes
    assert per_node.host_bytes_per_node == flash.total_bytes
    with pytest.raises(ConfigError, match="--host-mode"):
        make_plan(flash, "host", host_mode="shared")
    with pytest.raises(ConfigError, match="--dp-size"):
        make_plan(flash, "host", host_mode="dp-split", dp_size=16)


def test_unknown_placement(flash):
    with pytest.raises(ConfigError, match="one of hbm, host, peer"):
        make_plan(flash, "ssd")

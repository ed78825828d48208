"""engram_ray.metrics.engine: values from real plans and lookups, the /metrics endpoint, file_sd."""

import json
import urllib.request

import pytest
import torch
from prometheus_client import REGISTRY, Gauge

from engram_ray.errors import ConfigError
from engram_ray.metrics.engine import EngineIdentity, EngineMetrics, count_remote_rows
from engram_ray.metrics.exposition import MetricsServer, write_file_sd
from engram_ray.model.layout import load_layout
from engram_ray.planning.memory import make_plan, owner_of

IDENTITY = EngineIdentity("deepseek-v4.1-flash", "engine-0", "group-0", 3)


def value(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, {**IDENTITY.labels(), **labels})


def test_table_bytes_and_gain_follow_the_plans():
    layout = load_layout("deepseek-v4.1-flash")
    peer = make_plan(layout, "peer", peer_group_size=8)
    unsplit = make_plan(layout, "hbm")
    metrics = EngineMetrics(IDENTITY)
    metrics.set_table_plan(peer, unsplit, layout.layer_ids)
    for layer_id, nbytes in zip(layout.layer_ids, peer.hbm_bytes_per_gpu_by_table):
        assert value(metrics, "engram_table_bytes", table=f"layer{layer_id}",
                     placement="peer") == nbytes
    assert value(metrics, "engram_kv_cache_gain_bytes") == (unsplit.hbm_bytes_per_gpu
                                                            - peer.hbm_bytes_per_gpu)
    assert value(metrics, "engram_kv_cache_gain_bytes") > 165 * 2**30  # 188.83 - 23.60 GiB
    assert value(metrics, "engram_host_bytes") == 0


def test_host_placement_reports_host_bytes_per_table():
    layout = load_layout("deepseek-v4.1-flash")
    host = make_plan(layout, "host", host_mode="dp-split", dp_size=2)
    metrics = EngineMetrics(IDENTITY)
    metrics.set_table_plan(host, make_plan(layout, "hbm"), layout.layer_ids)
    shares = [value(metrics, "engram_table_bytes", table=f"layer{i}", placement="host")
              for i in layout.layer_ids]
    assert abs(sum(shares) - host.host_bytes_per_gpu) <= len(shares)
    assert value(metrics, "engram_host_bytes") == host.host_bytes_per_gpu


def test_kv_cache_headroom():
    metrics = EngineMetrics(IDENTITY)
    metrics.set_kv_cache(capacity_bytes=1000, capacity_tokens=64, usage=0.25)
    assert value(metrics, "engram_kv_cache_headroom_bytes") == 750
    assert value(metrics, "engram_kv_cache_headroom_tokens") == 48
    metrics.set_kv_cache(capacity_bytes=1000, capacity_tokens=64, usage=1.5)  # clamped
    assert value(metrics, "engram_kv_cache_headroom_bytes") == 0


def test_remote_rows_counted_against_the_peer_split():
    rows_per_rank = 100
    row_ids = torch.tensor([[0, 99, 100, 250], [-1, 399, 350, -1]])
    num_local, num_remote = count_remote_rows(row_ids, rows_per_rank, rank=3)
    ranks, _ = owner_of(row_ids[row_ids >= 0], rows_per_rank)
    assert (num_local, num_remote) == (int((ranks == 3).sum()), int((ranks != 3).sum()))
    assert (num_local, num_remote) == (2, 4)
    metrics = EngineMetrics(IDENTITY)
    metrics.observe_lookup("layer1", 0.002, num_local, num_remote)
    metrics.observe_lookup("layer1", 0.001, 6, 0)
    assert value(metrics, "engram_remote_row_fraction") == pytest.approx(4 / 12)
    assert value(metrics, "engram_rows_read_total", rows="remote") == 4
    assert value(metrics, "engram_lookup_seconds_count", table="layer1", rows="remote") == 1
    assert value(metrics, "engram_lookup_seconds_sum", table="layer1", rows="local") == 0.001


def test_identity_names_the_field_at_fault():
    with pytest.raises(ConfigError, match="rank"):
        EngineIdentity("m", "e", "g", -1)
    with pytest.raises(ConfigError, match="engine"):
        EngineIdentity("m", "", "g", 0)


def test_endpoint_serves_engram_and_process_metrics_on_loopback():
    metrics = EngineMetrics(IDENTITY)
    for seconds in (0.5, 0.25, 0.125):  # exact sums: 0.875, not an approximation
        metrics.observe_step(seconds)
    metrics.set_group(generation=2, is_healthy=True, rendezvous_seconds=1.5)
    stand_in = Gauge("vllm:engram_test_stand_in", "a series in the default registry")
    stand_in.set(7)
    server = MetricsServer([metrics.registry])
    try:
        assert server.target.startswith("127.0.0.1:")
        with urllib.request.urlopen(f"http://{server.target}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.stop()
        REGISTRY.unregister(stand_in)
    labels = 'engine="engine-0",model="deepseek-v4.1-flash",peer_group="group-0",rank="3"'
    assert f"engram_engine_step_seconds_sum{{{labels}}} 0.875" in text
    assert f"engram_group_generation{{{labels}}} 2.0" in text
    assert "vllm:engram_test_stand_in 7.0" in text


def test_file_sd_list(tmp_path):
    path = tmp_path / "sd" / "targets.json"
    write_file_sd(str(path), {"b": {"target": "127.0.0.1:2", "labels": {"x": "1"}},
                              "a": {"target": "127.0.0.1:1"}})
    assert json.loads(path.read_text()) == [
        {"targets": ["127.0.0.1:1"], "labels": {}},
        {"targets": ["127.0.0.1:2"], "labels": {"x": "1"}}]
    assert [p.name for p in path.parent.iterdir()] == ["targets.json"]


def test_model_process_metrics_endpoint_is_announced_in_its_target_file(tmp_path):
    from engram_ray.metrics.exposition import start_process_metrics

    assert start_process_metrics({"engram_peer_group": {}}) is None
    target_file = tmp_path / "t" / "replica.json"
    metrics = start_process_metrics({"engram_metrics": {
        **IDENTITY.labels(), "bind_address": "127.0.0.1", "target_file": str(target_file)}})
    try:
        metrics.observe_lookup("layer1", 0.001, 3, 1)
        target = json.loads(target_file.read_text())["target"]
        assert target == metrics.server.target
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        metrics.server.stop()
    assert 'engram_rows_read_total{engine="engine-0"' in text and 'rows="remote"} 1.0' in text

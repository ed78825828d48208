"""Where /metrics and http_sd listen: the node's own address by default (`node`), 0.0.0.0 only
when a config says so. Real servers on 127.0.0.1 (the node address of every test Ray)."""

import socket
from pathlib import Path

from engram_ray.metrics import exposition
from engram_ray.metrics.exposition import (NODE_ADDRESS, MetricsServer, TargetsServer,
                                           bind_host)
from engram_ray.serve.deploy.cluster_configs import load_serve_config
from engram_ray.serve.settings.config import ServingConfig

CONFIGS = Path(__file__).resolve().parents[3] / "cluster_configs"


def test_node_is_the_default_and_resolves_to_the_node_address(monkeypatch):
    assert ServingConfig().metrics_bind_address == NODE_ADDRESS
    assert bind_host("0.0.0.0", "10.0.0.7") == "0.0.0.0"  # explicit: as configured
    assert bind_host("127.0.0.1", "10.0.0.7") == "127.0.0.1"
    assert bind_host(NODE_ADDRESS, "10.0.0.7") == "10.0.0.7"
    import ray.util

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    assert bind_host(NODE_ADDRESS) == "127.0.0.1"


def test_servers_bound_to_node_listen_on_that_address_only(monkeypatch):
    import ray.util

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    metrics = MetricsServer([], NODE_ADDRESS, 0, advertise_host="127.0.0.1")
    sd = TargetsServer(list, NODE_ADDRESS, 0)
    try:
        assert metrics._server.server_address[0] == "127.0.0.1"
        assert metrics.target == f"127.0.0.1:{metrics.port}"
        assert sd._server.server_address[0] == "127.0.0.1"
        with socket.create_connection(("127.0.0.1", sd.port), timeout=5):
            pass
    finally:
        metrics.stop()
        sd.stop()


def test_the_deepseek_config_does_not_open_every_interface():
    for config in load_serve_config(CONFIGS / "serve_deepseek_v41_flash.yaml").values():
        assert config.serving.metrics_bind_address == NODE_ADDRESS
    assert exposition.DEFAULT_BIND_ADDRESS == "127.0.0.1"  # library default: loopback

"""A fixed `serving.metrics_port` works only with one engine per node: refused in the config
where engines per node are known (CPU peer groups share one node), and at bind time where not."""

import copy
from pathlib import Path

import pytest

from engram_ray.errors import ConfigError
from engram_ray.serving.cluster_configs import check_serve_config, read_yaml
from engram_ray.serving.exposition import MetricsServer

CONFIGS = Path(__file__).resolve().parents[2] / "cluster_configs"


def _serve_args(name: str, **serving) -> dict:
    data = copy.deepcopy(read_yaml(CONFIGS / name))
    data["applications"][0]["args"]["serving"].update(serving)
    return data


def test_fixed_port_with_a_cpu_group_on_one_node_is_refused():
    with pytest.raises(ConfigError) as info:
        check_serve_config(_serve_args("serve_local_tiny.yaml", metrics_port=9400), "local.yaml")
    message = str(info.value)
    assert message.startswith("serving.metrics_port: is 9400")
    assert "2 CPU engines of a peer group share one node" in message
    assert "metrics_port 0 (each engine picks a free port" in message
    assert "one engine per node" in message


def test_fixed_port_is_accepted_where_engines_per_node_are_unknown_or_one():
    (gpus,) = check_serve_config(_serve_args("serve_deepseek_v41_flash.yaml", metrics_port=9400),
                                 "deepseek.yaml").values()
    assert gpus.serving.metrics_port == 9400
    data = _serve_args("serve_local_tiny.yaml", metrics_port=9400)
    data["applications"][0]["args"]["deployment"]["peer_group_size"] = 1
    (cpu,) = check_serve_config(data, "local.yaml").values()
    assert cpu.serving.metrics_port == 9400


def test_second_engine_on_a_node_gets_a_clear_error_for_a_taken_port():
    first = MetricsServer([], "127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError) as info:
            MetricsServer([], "127.0.0.1", first.port)
        message = str(info.value)
        assert message.startswith(f"serving.metrics_port: is {first.port}, but "
                                  f"127.0.0.1:{first.port} is taken on this node")
        assert "metrics_port 0" in message and "one engine per node" in message
    finally:
        first.stop()


def test_free_port_zero_never_collides():
    servers = [MetricsServer([], "127.0.0.1", 0) for _ in range(2)]
    try:
        assert servers[0].port != servers[1].port
    finally:
        for server in servers:
            server.stop()

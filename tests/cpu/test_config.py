"""Deployment config: defaults, validation naming the field, YAML boundary, bundles."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engram_ray.config import DeploymentConfig
from engram_ray.errors import ConfigError


def test_defaults_are_valid_and_every_field_is_described():
    config = DeploymentConfig()
    assert config.peer_group_size == 8 and config.table_backend == "cuda"
    assert all(len(info.description or "") > 10
               for info in DeploymentConfig.model_fields.values())


def test_config_is_frozen():
    with pytest.raises(ValidationError, match="frozen"):
        DeploymentConfig().peer_group_size = 2


@pytest.mark.parametrize("changes, field", [
    (dict(peer_group_size=0), "peer_group_size"),
    (dict(peer_group_size=True), "peer_group_size"),
    (dict(table_backend="nccl"), "table_backend"),
    (dict(fill="random"), "fill"),
    (dict(fill="checkpoint"), "checkpoint"),
    (dict(checkpoint="/models/ds"), "checkpoint"),  # would be ignored: fill is synthetic
    (dict(rendezvous_timeout_s=0), "rendezvous_timeout_s"),
    (dict(placement_timeout_s="soon"), "placement_timeout_s"),
    (dict(num_gpus_per_engine=2), "num_gpus_per_engine"),
    (dict(num_gpus_per_engine=0, table_backend="shm", num_cpus_per_engine=0),
     "num_cpus_per_engine"),
    (dict(num_gpus_per_engine=0), "table_backend"),
    (dict(domain_label_key=""), "domain_label_key"),
    (dict(handle_type="nvlink"), "handle_type"),
    (dict(handle_type="posix_fd", table_backend="shm", num_gpus_per_engine=0), "handle_type"),
])
def test_invalid_values_name_the_field(changes, field):
    with pytest.raises(ConfigError) as info:
        DeploymentConfig(**changes)
    assert info.value.field == field
    assert "expected" in str(info.value)


def test_unknown_keys_are_rejected_by_name():
    with pytest.raises(ConfigError, match="peer_group_sise: is not a known setting") as info:
        DeploymentConfig.from_dict({"peer_group_sise": 4}, "deploy.yaml")
    assert "peer_group_size" in str(info.value)  # the list of known settings


def test_yaml_boundary():
    import yaml

    data = yaml.safe_load("model: deepseek-v4.1-flash\npeer_group_size: 4\ntable_backend: shm\n"
                          "num_gpus_per_engine: 0\nnum_cpus_per_engine: 0.5\n")
    config = DeploymentConfig.from_dict(data, "deploy.yaml")
    assert (config.peer_group_size, config.table_backend) == (4, "shm")
    assert config.table_device == "cpu" and config.is_cpu_only
    assert DeploymentConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="deploy.yaml: is list.*a mapping of settings"):
        DeploymentConfig.from_dict(yaml.safe_load("- a list\n"), "deploy.yaml")
    assert DeploymentConfig.from_dict(yaml.safe_load("")) == DeploymentConfig()  # empty: defaults


def test_bundles_follow_the_engine_resources():
    assert DeploymentConfig().bundle == {"GPU": 1.0, "CPU": 1.0}
    assert DeploymentConfig(num_cpus_per_engine=0).bundle == {"GPU": 1.0}
    cpu = DeploymentConfig(num_gpus_per_engine=0, num_cpus_per_engine=2, table_backend="shm")
    assert cpu.bundle == {"CPU": 2.0}


def test_config_errors_survive_pickling():
    """Ray ships an actor's or a Serve replica's exception to the caller by pickle: a
    ConfigError must arrive with its field and whole message, not as 'failed to deserialize'."""
    import pickle

    error = ConfigError("serving.metrics_port", "is 9400, but 127.0.0.1:9400 is taken",
                        "metrics_port 0")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is ConfigError and copy.field == "serving.metrics_port"
    assert str(copy) == str(error) == ("serving.metrics_port: is 9400, but 127.0.0.1:9400 is "
                                       "taken (expected metrics_port 0)")


@pytest.mark.parametrize("key,instead", [("max_peer_groups", "serving.num_peer_groups"),
                                         ("seed", "load_format 'dummy'")])
def test_retired_settings_are_refused_naming_what_to_use(key, instead):
    """Settings the Serve path has no use for are refused by name, not accepted and ignored."""
    with pytest.raises(ConfigError, match=f"{key}: is no longer a setting.*{instead}"):
        DeploymentConfig.from_dict({key: 1}, "deployment")


@pytest.mark.parametrize("data,message", [
    ({"peer_group_size": 8, "peer_group_sise": 4}, "deploy.yaml: peer_group_sise: is not a known "
                                                   "setting (expected one of checkpoint, "),
    ({"peer_group_size": "8"}, "deploy.yaml: peer_group_size: is '8' (expected an integer >= 1)"),
    ({"num_cpus_per_engine": -1}, "deploy.yaml: num_cpus_per_engine: is -1 (expected a number "
                                  ">= 0)"),
    ({"fill": "random"}, "deploy.yaml: fill: is 'random' (expected 'synthetic' or 'checkpoint')"),
    (["peer_group_size"], "deploy.yaml: is list (expected a mapping of settings)"),
])
def test_errors_name_the_source_and_the_field(data, message):
    with pytest.raises(ConfigError) as info:
        DeploymentConfig.from_dict(data, "deploy.yaml")
    assert str(info.value).startswith(message)


def test_unknown_keyword_is_refused_by_name_and_replace_validates():
    with pytest.raises(ConfigError, match="^peer_group_sise: is not a known setting"):
        DeploymentConfig(peer_group_sise=4)
    config = DeploymentConfig().replace(peer_group_size=4)
    assert config.peer_group_size == 4 and config == DeploymentConfig(peer_group_size=4)
    with pytest.raises(ConfigError, match="^peer_group_size: is 0"):
        config.replace(peer_group_size=0)


def test_gpu_side_modules_import_without_pydantic():
    """The GPU machine (tests/gpu, benchmarks/gpu_*.sh) has no pydantic: nothing it imports may
    load the config models."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import importlib, sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pydantic", "pydantic_core"):
            raise ImportError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, Blocker())
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        assert "blocked by the test" not in str(exc), (name, exc)  # else: not in this checkout
assert "engram_ray.config" not in sys.modules
"""
    modules = ["engram_ray.tables.table", "engram_ray.tables.local_group",
               "engram_ray.tables.lookup", "engram_ray.tables.settings",
               "engram_ray.tables.slice_holder", "engram_ray.tables.backends.handle_types",
               "engram_ray.tables.backends.host_memory", "engram_ray.planning.memory",
               "engram_ray.model.layout", "engram_ray.model.reference",
               "engram_ray.metrics.engine", "engram_ray.metrics.lookup_meter",
               "engram_ray.vllm.assumptions", "engram_ray.vllm.compat",
               "engram_ray.kernels.lookup", "engram_ray.commands.doctor"]
    result = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True,
                            text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr

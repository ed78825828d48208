"""`serving.host_kv_cache_gib`: the host memory the peer split frees, given to each engine as
vLLM's CPU KV-cache offloading (`kv_offloading_size`), sized from the memory plan less the
reserve; refused where nothing is freed or more is asked than is freed. The engine arguments
are checked against vLLM's own `EngineArgs` and the `VllmConfig` it builds from them."""

import pytest

from engram_ray.errors import ConfigError
from engram_ray.model.layout import load_layout
from engram_ray.planning.host_kv import (HOST_KV_RESERVE_GIB, KV_OFFLOADING_ARG,
                                         freed_host_kv_budget, host_kv_budget, kv_bytes_per_token)
from engram_ray.planning.memory import GIB, gib, make_plan
from engram_ray.serve.settings.engine_args import engine_kwargs
from engram_ray.serve.settings.config import ServeAppConfig
from engram_ray.serve.settings.library_options import check_engine_kwargs


def app(**serving):
    return ServeAppConfig.from_dict({"serving": serving}, "args")


def test_budget_is_the_freed_host_memory_less_the_reserve():
    flash = load_layout("deepseek-v4.1-flash")
    peer, host = make_plan(flash, "peer", peer_group_size=8), make_plan(flash, "host",
                                                                         host_mode="dp-split", dp_size=2)
    budget = host_kv_budget(peer, host, 16.0)
    assert gib(budget.freed_bytes_per_gpu) == 94.42
    assert gib(budget.cache_bytes_per_gpu) == 78.42
    assert budget.tokens_per_gpu is None  # the preset has no attention fields
    # the other way round nothing is freed: no cache, not a negative one
    assert host_kv_budget(host, peer).cache_bytes_per_gpu == 0
    assert freed_host_kv_budget("deepseek-v4.1-flash", 8, 2, 16.0) == budget


def test_kv_bytes_per_token_of_a_plain_and_a_deepseek_v41_config():
    plain = {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 64}
    assert kv_bytes_per_token(plain).num_bytes == 2 * 2 * 2 * 64 * 2
    assert kv_bytes_per_token({"engram_layer_ids": [1]}) is None
    # kv sources 2 (ratio 1, also an index source) and 4 (ratio 2); 0 is sliding-window only,
    # 5 is past num_hidden_layers (MTP)
    v41 = {"num_hidden_layers": 5, "compress_ratios": [0, 1, 1, 2, 2, 2],
           "kv_source_layer_ids": [2, 4, 5], "index_source_layer_ids": [2],
           "index_head_dim": 128}
    assert kv_bytes_per_token(v41).num_bytes == (584 + 132) / 1 + 584 / 2


def test_auto_sizes_kv_offloading_size_from_the_plan():
    kwargs = engine_kwargs(app(host_kv_cache_gib="auto", data_parallel_size=2))
    # 94.42 GiB of tables per GPU with CPU offload over DEP2, less 16 GiB, rounded down
    assert kwargs[KV_OFFLOADING_ARG] == 78.41
    assert HOST_KV_RESERVE_GIB == 16.0
    # one copy per engine at DP=1: the whole 188.83 GiB is freed
    assert engine_kwargs(app(host_kv_cache_gib="auto"))[KV_OFFLOADING_ARG] == 172.83
    assert engine_kwargs(app(host_kv_cache_gib=40, host_kv_reserve_gib=0))[
        KV_OFFLOADING_ARG] == 40.0
    assert KV_OFFLOADING_ARG not in engine_kwargs(app())  # unset: nothing changes
    check_engine_kwargs(engine_kwargs(app(host_kv_cache_gib="auto")))  # a vLLM argument


@pytest.mark.parametrize("serving,deployment,message", [
    ({"host_kv_cache_gib": 90, "data_parallel_size": 2}, {},
     "is 90, more than the 94.42 GiB freed per GPU - 16 GiB host_kv_reserve_gib = 78.42 GiB"),
    ({"host_kv_cache_gib": "auto", "data_parallel_size": 2, "host_kv_reserve_gib": 100}, {},
     "frees no host memory beyond the reserve"),
    ({"host_kv_cache_gib": "lots"}, {}, "'auto' or a number of GiB > 0"),
    ({"host_kv_cache_gib": 0}, {}, "'auto' or a number of GiB > 0"),
    ({"host_kv_cache_gib": 8, "engine_kwargs": {"kv_offloading_size": 8}}, {},
     "engine_kwargs.kv_offloading_size: is set together with serving.host_kv_cache_gib"),
    ({"host_kv_cache_gib": 8, "engine_kwargs": {"kv_offloading_backend": "lmcache"}}, {},
     "kv_offloading_backend: is 'lmcache'"),
    ({"host_kv_cache_gib": "auto", "engine_kwargs": {"engram_config": {"cpu_offload": True}}},
     {}, "cpu_offload is true: the tables are in host memory, so the split frees none"),
    ({"host_kv_cache_gib": "auto", "device": "cpu"},
     {"table_backend": "shm", "num_gpus_per_engine": 0},
     "table_backend is 'shm': the tables are in host memory"),
])
def test_refused_naming_the_field(serving, deployment, message):
    with pytest.raises(ConfigError, match="host_kv|kv_offloading") as info:
        ServeAppConfig.from_dict({"serving": serving, "deployment": deployment}, "args")
    assert message in str(info.value)


def test_vllm_takes_the_argument_as_native_cpu_offloading(tmp_path):
    """vLLM's own EngineArgs turns the built argument into its OffloadingConnector with the
    host bytes asked for (`VllmConfig._post_init_kv_transfer_config`)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    from engram_ray.vllm.tiny_checkpoint import write_tiny_model

    assert KV_OFFLOADING_ARG in {f.name for f in dataclasses.fields(EngineArgs)}
    size = engine_kwargs(app(host_kv_cache_gib=0.25, data_parallel_size=2))[KV_OFFLOADING_ARG]
    model = write_tiny_model(tmp_path / "model")
    config = EngineArgs(model=str(model), max_model_len=256, enforce_eager=True,
                        kv_offloading_size=size).create_engine_config()
    transfer = config.kv_transfer_config
    assert transfer.kv_connector == "OffloadingConnector" and transfer.kv_role == "kv_both"
    assert transfer.kv_connector_extra_config["cpu_bytes_to_use"] == 0.25 * GIB


def test_the_deepseek_serve_yaml_with_auto_reaches_ray_serve_llms_engine_kwargs():
    """The project's DeepSeek-V4.1-Flash Serve YAML (DEP2, peer groups of 8) with `auto`:
    checked as `engram-ray check` does, and in the `LLMConfig` every group's engines get;
    the local CPU YAML (shm tables, in host memory) is refused by name."""
    import copy
    from pathlib import Path

    from engram_ray.planning.grouping import Domain, PeerGroupPlan
    from engram_ray.serve.app import llm_config
    from engram_ray.serve.deploy.cluster_configs import check_serve_config, read_yaml

    configs = Path(__file__).resolve().parents[3] / "cluster_configs"
    data = copy.deepcopy(read_yaml(configs / "serve_deepseek_v41_flash.yaml"))
    # An engine setting: the front door's only (serving.rollout.mode in_place)
    data["applications"][0]["args"]["serving"]["host_kv_cache_gib"] = "auto"
    (checked,) = check_serve_config(data, "flash.yaml").values()
    group = PeerGroupPlan("group-0", Domain("rack-0", ("n1",), 8, {"k": "rack-0"}), 0, 8)
    assert llm_config(checked, group).engine_kwargs[KV_OFFLOADING_ARG] == 78.41
    local = copy.deepcopy(read_yaml(configs / "serve_local_tiny.yaml"))
    local["applications"][0]["args"]["serving"]["host_kv_cache_gib"] = 1
    with pytest.raises(ConfigError, match="table_backend is 'shm'"):
        check_serve_config(local, "local.yaml")

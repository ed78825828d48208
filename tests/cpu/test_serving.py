"""The Serve app's parts without vLLM: the LLMConfig the builders get, and the GroupRegistry's
rank/generation protocol on a real local Ray (engines stood in by plain actors that can die)."""

import json
import time
from pathlib import Path

import pytest

from engram_ray.serve import engine_kwargs, llm_config
from engram_ray.serving.cluster_configs import load_serve_config
from engram_ray.serving.server import (APP_CONFIG_KEY, EngramDPServer, EngramLLMServer,
                                       peer_group_settings)

CONFIGS = Path(__file__).resolve().parents[2] / "cluster_configs"


def app_config(name: str):
    return next(iter(load_serve_config(CONFIGS / name).values()))


def test_local_llm_config_is_two_cpu_engine_replicas():
    app = app_config("serve_local_tiny.yaml")
    config = llm_config(app)
    assert config.server_cls is EngramLLMServer
    assert config.deployment_config["num_replicas"] == 2
    assert config.placement_group_config == {"bundles": [{"CPU": 1.0}]}
    assert config.log_engine_metrics is False  # vllm:* go to the engine's own /metrics
    kwargs = config.engine_kwargs
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"]) == (1, 1)
    assert kwargs["enable_prefix_caching"] is False and kwargs["max_model_len"] == 512
    assert config.experimental_configs[APP_CONFIG_KEY] == app.to_dict()


def test_deepseek_llm_config_is_dep2_on_gpus():
    app = app_config("serve_deepseek_v41_flash.yaml")
    config = llm_config(app)
    assert config.server_cls is EngramDPServer
    assert config.placement_group_config == {"bundles": [{"GPU": 1.0, "CPU": 8.0}]}
    assert config.deployment_config["num_replicas"] == 36  # DEP2 gangs: 9 groups x 4
    kwargs = engine_kwargs(app)
    assert (kwargs["data_parallel_size"], kwargs["enable_expert_parallel"]) == (2, True)
    assert kwargs["gpu_memory_utilization"] == 0.92


class _Unreachable:
    """A replica handle whose ping fails as `raise_error` says (no Ray needed)."""

    def __init__(self, error):
        self.__ray_ready__ = type("Method", (), {"remote": staticmethod(self._raise)})()
        self._error = error

    def _raise(self):
        raise self._error


def test_replica_peer_settings_carry_a_requested_handle_type():
    """A deployment's handle_type reaches the engine's `additional_config.engram_peer_group`
    (validated there: CUDA types need backend cuda); none is passed when unset."""
    from engram_ray.models.peer_settings import PeerGroupSettings

    assignment = {"group_id": "A-g0", "rank": 1, "member_rank": 1, "size": 2,
                  "generation": "t-A-g0.1.x", "generation_index": 1, "store": "/tmp/s",
                  "timeout_s": 30.0, "backend": "cuda", "handle_type": "posix_fd"}
    settings = peer_group_settings(assignment)
    assert settings["handle_type"] == "posix_fd"
    assert PeerGroupSettings(**settings).to_spec().handle_type == "posix_fd"
    assert "handle_type" not in peer_group_settings({**assignment, "handle_type": None})


def test_liveness_watch_takes_only_a_dead_actor_for_dead():
    """A transient `ActorUnavailableError` (a RayActorError subclass) must not restart the
    whole peer group; `ActorDiedError` must."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from engram_ray.serving.groups import _is_alive

    assert _is_alive(_Unreachable(ActorUnavailableError("node unreachable", None)), 1.0)
    assert not _is_alive(_Unreachable(ActorDiedError()), 1.0)


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             num_cpus=2, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_registry_hands_out_ranks_and_restarts_a_group_when_a_member_dies(ray_local, tmp_path):
    ray = ray_local
    from engram_ray.serving.groups import get_registry

    app = app_config("serve_local_tiny.yaml")
    raw = app.to_dict()
    raw["deployment"].update(peer_group_store=str(tmp_path / "store"), name="t",
                             health_check_interval_s=0.2)
    raw["serving"].update(prometheus_targets_file=str(tmp_path / "targets.json"))
    registry = get_registry(raw, "t")

    @ray.remote(num_cpus=0)
    class Member:
        def ping(self):
            return True

    members = [Member.remote() for _ in range(3)]
    first = [ray.get(registry.join.remote(f"m{i}", members[i])) for i in range(2)]
    assert [a["rank"] for a in first] == [0, 1]
    assert {a["generation"] for a in first} == {first[0]["generation"]}
    assert Path(first[0]["store"]).is_dir() and first[0]["backend"] == "shm"
    assert first[0]["handle_type"] is None
    with pytest.raises(ray.exceptions.RayTaskError, match="found no free rank"):
        ray.get(registry.join.remote("m2", members[2]))
    ray.get(registry.register_target.remote("m0", "127.0.0.1:1"))
    ray.get(registry.register_target.remote("m1", "127.0.0.1:2"))

    ray.kill(members[0])
    deadline = time.monotonic() + 30
    while ray.get(registry.is_current.remote("m1"))[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    is_current, reason = ray.get(registry.is_current.remote("m1"))
    assert not is_current and "moved to generation 2 (m0 died)" in reason
    assert not Path(first[0]["store"]).exists()  # the old generation's store is removed
    assert json.loads((tmp_path / "targets.json").read_text()) == []
    second = [ray.get(registry.join.remote(f"n{i}", members[i + 1])) for i in range(2)]
    assert [a["rank"] for a in second] == [0, 1]
    assert {a["generation_index"] for a in second} == {2}
    status = ray.get(registry.status.remote())["group-0"]
    assert status["history"] == [(1, "m0 died")]
    ray.kill(registry)


def test_registry_left_by_an_earlier_deployment_is_reused_replaced_or_refused(ray_local,
                                                                               tmp_path):
    """Registries are detached: one made with other settings must not hand out stale ranks."""
    ray = ray_local
    from engram_ray.errors import EngramRayError
    from engram_ray.serving.groups import get_registry

    raw = app_config("serve_local_tiny.yaml").to_dict()
    raw["deployment"].update(peer_group_store=str(tmp_path / "store"), name="redeploy")
    raw["serving"].update(prometheus_targets_file=str(tmp_path / "targets.json"))
    first = get_registry(raw, "redeploy")
    assert get_registry(raw, "redeploy")._actor_id == first._actor_id   # same settings: reused
    changed = json.loads(json.dumps(raw))
    changed["deployment"]["health_check_interval_s"] = 7.0
    second = get_registry(changed, "redeploy")                            # no members: replaced
    assert second._actor_id != first._actor_id
    assert ray.get(second.describe.remote()) == (changed, 0)

    @ray.remote(num_cpus=0)
    class Member:
        def ping(self):
            return True

    member = Member.remote()
    ray.get(second.join.remote("m0", member))
    with pytest.raises(EngramRayError, match="still has 1 members"):
        get_registry(raw, "redeploy")                                     # members: refused
    ray.kill(second)
    ray.kill(member)


def test_group_still_moves_when_the_targets_list_cannot_be_written(ray_local, tmp_path):
    """A failed write of the Prometheus list (secondary) must neither stop the liveness watch
    nor keep a group on a generation with a dead member."""
    ray = ray_local
    from engram_ray.serving.groups import get_registry

    raw = app_config("serve_local_tiny.yaml").to_dict()
    (tmp_path / "not-a-dir").write_text("")
    raw["deployment"].update(peer_group_store=str(tmp_path / "store"), name="unwritable",
                             health_check_interval_s=0.2)
    raw["serving"].update(prometheus_targets_file=str(tmp_path / "not-a-dir" / "t.json"))
    registry = get_registry(raw, "unwritable")

    @ray.remote(num_cpus=0)
    class Member:
        pass

    members = [Member.remote() for _ in range(2)]
    for i in range(2):
        ray.get(registry.join.remote(f"m{i}", members[i]))
    ray.kill(members[0])
    deadline = time.monotonic() + 30
    while ray.get(registry.is_current.remote("m1"))[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "moved to generation 2 (m0 died)" in ray.get(registry.is_current.remote("m1"))[1]
    ray.kill(registry)


def test_replica_that_cannot_start_gives_its_rank_back_at_once(ray_local, tmp_path):
    """A replica failing after it took a rank (here: its fixed metrics port is taken on the
    node) leaves its group itself, with the cause, instead of holding the rank until the
    liveness watch finds its actor dead. The replica is the real `EngramServerMixin.start`
    in a Ray actor; only Serve's replica context and the vLLM engine are stood in for."""
    ray = ray_local
    from engram_ray.serving.config import ServeAppConfig
    from engram_ray.serving.exposition import MetricsServer
    from engram_ray.serving.groups import get_registry
    from engram_ray.serving.server import EngramServerMixin

    taken = MetricsServer([], "127.0.0.1", 0)
    raw = app_config("serve_local_tiny.yaml").to_dict()
    raw["deployment"].update(peer_group_store=str(tmp_path / "store"), name="taken-port",
                             peer_group_size=1)  # a fixed port: one engine per node
    raw["serving"].update(prometheus_targets_file=str(tmp_path / "targets.json"),
                          metrics_bind_address="127.0.0.1", metrics_port=taken.port)
    config = llm_config(ServeAppConfig.from_dict(raw, "test"))
    registry = get_registry(raw, "taken-port")

    class NoEngine:
        async def start(self):
            raise AssertionError("the engine must not start without a metrics endpoint")

    @ray.remote(num_cpus=0)
    class Replica(EngramServerMixin, NoEngine):
        def __init__(self, llm_config):
            self._llm_config = llm_config

        def _replica(self):
            return "replica-0", ray.get_runtime_context().current_actor, {}

        def __del__(self):  # Serve awaits the mixin's async __del__; a plain actor cannot
            pass

    replica = Replica.remote(config)
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="is taken on this node"):
            ray.get(replica.start.remote())
        assert ray.get(registry.is_current.remote("replica-0"))[0] is False
        (index, reason), = ray.get(registry.status.remote())["group-0"]["history"]
        assert index == 1 and reason.startswith(
            "replica-0: replica failed to start: ConfigError: serving.metrics_port: is "
            f"{taken.port}, but 127.0.0.1:{taken.port} is taken on this node")
    finally:
        taken.stop()
        ray.kill(replica)
        ray.kill(registry)


def test_registry_gives_data_parallel_gangs_aligned_blocks(ray_local, tmp_path):
    """DEP2 in a group of 8: a gang's DP rank d is member base + d (the plugin's convention)."""
    ray = ray_local
    from engram_ray.serving.groups import get_registry

    raw = app_config("serve_deepseek_v41_flash.yaml").to_dict()
    raw["deployment"].update(peer_group_store=str(tmp_path / "store"), name="dep2")
    raw["serving"].update(prometheus_targets_file=str(tmp_path / "targets.json"))
    registry = get_registry(raw, "dep2")
    me = registry  # any live actor handle stands in for a replica here

    def join(replica, gang, dp_rank):
        return ray.get(registry.join.remote(replica, me, "rack-0", gang_id=gang,
                                            dp_rank=dp_rank, dp_size=2))

    got = [join("a1", "gang-a", 1), join("b0", "gang-b", 0), join("a0", "gang-a", 0),
           join("b1", "gang-b", 1)]
    assert [(a["rank"], a["member_rank"]) for a in got] == [(0, 1), (2, 2), (0, 0), (2, 3)]
    assert {a["group_id"] for a in got} == {"group-0"} and got[0]["size"] == 8
    other_rack = ray.get(registry.join.remote("c0", me, "rack-1", gang_id="gang-c",
                                              dp_rank=0, dp_size=2))
    assert other_rack["group_id"] == "group-1"  # a group never spans two NVLink domains
    ray.kill(registry)


@pytest.mark.parametrize("name,engine,num_replicas,gang_size", [
    ("serve_local_tiny.yaml", "EngramLLMServer:engram-tiny", 2, None),
    ("serve_deepseek_v41_flash.yaml", "EngramDPServer:deepseek-v4_1-flash", 72, 2)])
def test_build_app_puts_engram_engines_behind_the_openai_ingress(ray_local, name, engine,
                                                                  num_replicas, gang_size):
    from engram_ray.serve import build_app
    from engram_ray.serving.cluster_configs import read_yaml

    app = build_app(read_yaml(CONFIGS / name)["applications"][0]["args"])
    ingress = app._bound_deployment
    assert ingress.name == "OpenAiIngress" and ingress.ray_actor_options["num_cpus"] == 0
    engines = next(iter(ingress.init_kwargs["llm_deployments"].values()))._bound_deployment
    assert (engines.name, engines.num_replicas) == (engine, num_replicas)  # 72 GPUs for DEP2
    gang = engines._deployment_config.gang_scheduling_config
    assert (gang.gang_size if gang else None) == gang_size


def test_local_command_is_registered_with_its_options(capsys):
    from engram_ray.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["local", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--once" in help_text and "--port" in help_text and "--workdir" in help_text


def test_kv_cache_capacity_counts_k_and_v_but_one_latent_for_mla():
    """Arithmetic of the KV-cache gauge on config stand-ins (a vLLM config needs a model)."""
    from types import SimpleNamespace

    import torch

    from engram_ray.serving.kv_cache import formula_capacity

    def config(use_mla):
        model = SimpleNamespace(dtype=torch.bfloat16, use_mla=use_mla,
                                get_num_layers=lambda p: 4, get_num_kv_heads=lambda p: 2,
                                get_head_size=lambda: 64)
        return SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=10, block_size=16,
                                                            cache_dtype="auto"),
                               model_config=model, parallel_config=None)

    assert formula_capacity(config(False)) == (160 * 2 * 4 * 2 * 64 * 2, 160)
    assert formula_capacity(config(True)) == (160 * 1 * 4 * 2 * 64 * 2, 160)

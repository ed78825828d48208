"""The Serve app's parts without vLLM: the LLMConfig the builders get, the coordinator's
generation protocol on a real local Ray, and the application `build_app` assembles.
(Placement across NVLink domains and group restarts: tests/cpu/actors/test_placement.py.)"""

import json
import os
import threading
import time
from pathlib import Path

import pytest

from engram_ray.errors import ConfigError, EngramRayError
from engram_ray.planning.grouping import Domain, PeerGroupPlan
from engram_ray.serve.app import llm_config, server_class
from engram_ray.serve.deploy.cluster_configs import load_serve_config
from engram_ray.serve.settings.engine_args import engine_kwargs
from engram_ray.serve.member.server import (APP_CONFIG_KEY, GROUP_KEY, EngramDPServer,
                                            EngramLLMServer, peer_group_settings)

CONFIGS = Path(__file__).resolve().parents[3] / "cluster_configs"


def app_config(name: str):
    return next(iter(load_serve_config(CONFIGS / name).values()))


GROUP = PeerGroupPlan("group-0", Domain("rack-0", ("n1",), 8, {"k": "rack-0"}), 0, 8)


def _tiny_model_folder(tmp_path) -> str:
    """A model folder whose config.json names the tiny model's architecture (a replica reads
    its engine settings there, `engram_ray.vllm.engine_settings`)."""
    from engram_ray.vllm.tiny_checkpoint import ARCHITECTURE

    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": [ARCHITECTURE]}))
    return str(folder)


def _raw(name: str, tmp_path, deployment_name: str) -> dict:
    raw = app_config(name).to_dict()
    raw["deployment"].update(peer_group_store=str(tmp_path / "store"), name=deployment_name)
    model = _tiny_model_folder(tmp_path)
    raw["serving"].update(prometheus_targets_file=str(tmp_path / "targets.json"),
                          model_source=model)
    raw["deployment"].update(model="deepseek-v4.1-flash",  # the coordinator's layout: a preset
                             checkpoint=model)
    return raw


def test_local_llm_config_is_one_cpu_bundle_per_engine(tmp_path):
    app = app_config("serve_local_tiny.yaml")
    model = _tiny_model_folder(tmp_path)
    app = app.replace(deployment=app.deployment.replace(checkpoint=model),
                      serving=app.serving.replace(model_source=model))
    config = llm_config(app, GROUP)
    assert server_class(app) is EngramLLMServer
    assert config.placement_group_config == {"bundles": [{"CPU": 1.0}]}
    assert config.log_engine_metrics is False  # vllm:* go to the engine's own /metrics
    dep = app.deployment  # max_missed_pings intervals per health check
    assert config.deployment_config["health_check_timeout_s"] == (
        dep.health_check_interval_s * dep.max_missed_pings)
    kwargs = config.engine_kwargs
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"]) == (1, 1)
    assert kwargs["enable_prefix_caching"] is False and kwargs["max_model_len"] == 512
    assert config.experimental_configs[APP_CONFIG_KEY] == app.to_dict()
    assert config.experimental_configs[GROUP_KEY] == {"group_id": "group-0",
                                                      "domain_id": "rack-0"}


def test_deepseek_llm_config_is_dep2_on_gpus():
    app = app_config("serve_deepseek_v41_flash.yaml")
    config = llm_config(app, GROUP)
    assert server_class(app) is EngramDPServer
    assert config.placement_group_config == {"bundles": [{"GPU": 1.0, "CPU": 8.0}]}
    kwargs = engine_kwargs(app)
    assert (kwargs["data_parallel_size"], kwargs["enable_expert_parallel"]) == (2, True)
    assert kwargs["gpu_memory_utilization"] == 0.92


def test_replica_peer_settings_carry_a_requested_handle_type_and_the_dp_base_rank():
    """A deployment's handle_type reaches the engine's `additional_config.engram_peer_group`
    (validated there: CUDA types need backend cuda); none is passed when unset. A DP rank's
    `rank` is the member of DP rank 0 of its gang (the plugin adds the DP rank)."""
    assignment = {"group_id": "A-g0", "member_rank": 3, "size": 8,
                  "generation": "t-A-g0.1.x", "generation_index": 1, "store_dir": "/tmp/s",
                  "timeout_s": 30.0, "backend": "cuda", "handle_type": "posix_fd"}
    settings = peer_group_settings(assignment, dp_rank=1)
    assert settings.handle_type == "posix_fd" and settings.rank == 2
    assert settings.for_dp_rank(1, 2).rank == 3
    assert settings.to_additional_config()["engram_peer_group"]["handle_type"] == "posix_fd"
    unset = peer_group_settings({**assignment, "handle_type": None}).to_additional_config()
    assert "handle_type" not in unset["engram_peer_group"]


def test_coordinator_opens_a_generation_per_gang_and_drops_the_old_store(ray_local, tmp_path):
    ray = ray_local
    from engram_ray.actors.coordinator_lookup import get_coordinator
    from engram_ray.planning.generations import GroupMismatchError

    raw = _raw("serve_local_tiny.yaml", tmp_path, "gens")
    coordinator = get_coordinator(raw, {"group-0": "node-a"}, "gens")
    first = [ray.get(coordinator.join.remote("group-0", "gang1", r, 2, f"m{r}")) for r in (1, 0)]
    assert {a["generation"] for a in first} == {first[0]["generation"]}
    assert [a["generation_index"] for a in first] == [1, 1] and os.path.isdir(first[0]["store_dir"])
    slices = [a["slices"] for a in sorted(first, key=lambda a: a["member_rank"])]
    assert slices[0][0][1] == 0 and slices[0][0][2] == slices[1][0][1]  # rank 1 starts where 0 ends
    ray.get(coordinator.register_target.remote("m0", "127.0.0.1:1"))
    second = ray.get(coordinator.join.remote("group-0", "gang2", 0, 2, "n0"))
    assert second["generation_index"] == 2 and second["generation"] != first[0]["generation"]
    assert not os.path.exists(first[0]["store_dir"]) and os.path.isdir(second["store_dir"])
    listed = json.loads((tmp_path / "targets.json").read_text())  # m0's gang is gone
    assert [g["labels"] for g in listed] == [{"endpoint": "coordinator"}]  # its own endpoint
    status = ray.get(coordinator.status.remote())["group-0"]
    assert status["gang_id"] == "gang2" and [(h["index"], h["gang_id"]) for h in status["history"]] == [
        (1, "gang1")]
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(coordinator.join.remote("group-0", "gang3", 0, 4, "x"))
    assert isinstance(info.value.cause, GroupMismatchError)
    ray.kill(coordinator)


def test_coordinator_left_by_an_earlier_deployment_is_reused_replaced_or_reconfigured(
        ray_local, tmp_path):
    """Coordinators are detached: one made with other settings must not hand out stale
    generations; with members, a change rolls out (the coordinator is reconfigured) or is
    refused naming the setting that cannot roll."""
    ray = ray_local
    from engram_ray.actors.coordinator_lookup import get_coordinator

    raw = _raw("serve_local_tiny.yaml", tmp_path, "redeploy")
    groups = {"group-0": "node-a"}
    first = get_coordinator(raw, groups, "redeploy")
    assert get_coordinator(raw, groups, "redeploy")._actor_id == first._actor_id  # reused
    changed = json.loads(json.dumps(raw))
    changed["deployment"]["health_check_interval_s"] = 7.0
    second = get_coordinator(changed, groups, "redeploy")                # no members: replaced
    assert second._actor_id != first._actor_id
    assert ray.get(second.describe.remote()) == ((changed, groups), 0)
    ray.get(second.join.remote("group-0", "g", 0, 2, "m0"))
    # With members: a change that rolls reconfigures it (new generations use it) ...
    rolled = json.loads(json.dumps(changed))
    rolled["serving"]["engine_kwargs"]["max_num_seqs"] = 64
    rolled["serving"]["rollout"] = {"mode": "restart"}
    assert get_coordinator(rolled, groups, "redeploy")._actor_id == second._actor_id
    assert ray.get(second.describe.remote()) == ((rolled, groups), 1)
    # ... beside the serving gangs only where a domain has a free slot for a new gang ...
    beside = json.loads(json.dumps(rolled))
    beside["serving"]["rollout"] = {"mode": "beside"}
    beside["serving"]["engine_kwargs"]["max_num_seqs"] = 32
    with pytest.raises(EngramRayError, match="node-a has 0"):
        get_coordinator(beside, groups, "redeploy")
    # ... and a change the groups cannot roll is refused, naming it, unless applied whole.
    fixed = json.loads(json.dumps(beside))
    fixed["deployment"]["peer_group_size"] = 1
    with pytest.raises(EngramRayError, match="change of deployment.peer_group_size cannot"):
        get_coordinator(fixed, groups, "redeploy")
    fixed["serving"]["rollout"] = {"mode": "restart"}
    third = get_coordinator(fixed, groups, "redeploy")
    assert third._actor_id != second._actor_id
    assert ray.get(third.describe.remote()) == ((fixed, groups), 0)
    ray.kill(third)


def test_generations_still_move_when_the_targets_list_cannot_be_written(ray_local, tmp_path):
    ray = ray_local
    from engram_ray.actors.coordinator_lookup import get_coordinator

    raw = _raw("serve_local_tiny.yaml", tmp_path, "unwritable")
    (tmp_path / "ro").mkdir(mode=0o500)
    raw["serving"]["prometheus_targets_file"] = str(tmp_path / "ro" / "sub" / "targets.json")
    coordinator = get_coordinator(raw, {"group-0": "node-a"}, "unwritable")
    ray.get(coordinator.join.remote("group-0", "g1", 0, 2, "m0"))
    ray.get(coordinator.register_target.remote("m0", "127.0.0.1:1"))
    assert ray.get(coordinator.join.remote("group-0", "g2", 0, 2, "m1"))["generation_index"] == 2
    ray.kill(coordinator)


def test_replica_that_cannot_start_gives_its_rank_back_at_once(ray_local, tmp_path):
    """A replica failing after it joined (here: its fixed metrics port is taken on the node)
    leaves the coordinator itself, with the cause. The replica is the real
    `EngramServerMixin.start` in a Ray actor; only Serve's replica context (its gang) and the
    vLLM engine are stood in for."""
    ray = ray_local
    from types import SimpleNamespace

    from engram_ray.actors.coordinator_lookup import get_coordinator
    from engram_ray.metrics.exposition import MetricsServer
    from engram_ray.serve.settings.config import ServeAppConfig
    from engram_ray.serve.member.server import EngramServerMixin

    taken = MetricsServer([], "127.0.0.1", 0)
    raw = _raw("serve_local_tiny.yaml", tmp_path, "taken-port")
    raw["deployment"].update(peer_group_size=1)  # a fixed port: one engine per node
    raw["serving"].update(metrics_bind_address="127.0.0.1", metrics_port=taken.port)
    config = llm_config(ServeAppConfig.from_dict(raw, "test"), GROUP)
    coordinator = get_coordinator(raw, {"group-0": "rack-0"}, "taken-port")

    class NoEngine:
        async def start(self):
            raise AssertionError("the engine must not start without a metrics endpoint")

    @ray.remote(num_cpus=0)
    class Replica(EngramServerMixin, NoEngine):
        def __init__(self, llm_config):
            self._llm_config = llm_config

        def _replica(self):
            return "replica-0", SimpleNamespace(gang_id="g1", rank=0, world_size=1), {}

        def __del__(self):  # Serve awaits the mixin's async __del__; a plain actor cannot
            pass

    replica = Replica.remote(config)
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="is taken on this node"):
            ray.get(replica.start.remote())
        status = ray.get(coordinator.status.remote())["group-0"]
        assert status["generation_index"] == 1 and status["members"] == {}
    finally:
        taken.stop()
        ray.kill(replica)
        ray.kill(coordinator)


def test_build_app_puts_one_gang_per_group_behind_the_openai_ingress(ray_local, tmp_path):
    """The local YAML on one node (a CPU domain): the front door's ingress names each group's
    application; a group's application is one deployment, a gang of 2 whose bundles are
    label-selected to that node. A group's args without the front door's settings; a group
    waits for its front door's settings (other values, another rollout mode)."""
    ray = ray_local
    from engram_ray.actors.coordinator_lookup import find_coordinator
    from engram_ray.serve.app import engram_applications
    from engram_ray.serve.settings.group_apps import group_applications

    raw = _raw("serve_local_tiny.yaml", tmp_path, "built")
    raw["serving"]["ingress"] = {"num_replicas": 3}
    (door_name, door_route, door), (group_name, group_route, group_app) = \
        engram_applications(raw, "front")
    assert (door_name, door_route, group_name, group_route) == ("front", "/", "built-group-0",
                                                                None)
    ingress = door._bound_deployment
    assert ingress.name == "PeerGroupIngress" and ingress.ray_actor_options["num_cpus"] == 0
    assert ingress.num_replicas == 3
    groups = ingress.init_kwargs["peer_groups"]["engram-tiny"]
    assert groups == {"group-0": ("EngramLLMServer:built:group-0", "built-group-0")}
    assert ingress.init_kwargs["deployment_name"] == "built"
    engines = group_app._bound_deployment
    assert (engines.name, engines.num_replicas) == ("EngramLLMServer:built:group-0", 2)
    config = engines._deployment_config
    assert config.gang_scheduling_config.gang_size == 2
    node_id = ray.get_runtime_context().get_node_id()
    assert engines._replica_config.placement_group_bundle_label_selector == [
        {"ray.io/node-id": node_id}]
    (group_args,) = group_applications(raw).values()
    assert group_args["group"] == "group-0"
    assert not {"num_peer_groups", "ingress", "request_limits", "rollout", "engine_kwargs",
                "max_model_len"} & set(group_args["serving"])  # in_place: the front door's
    # A group the front door did not place, or run with other settings: refused, saying why.
    from engram_ray.actors.coordinator_lookup import group_domain
    from engram_ray.serve.settings.config import ServeAppConfig

    config = ServeAppConfig.from_dict(raw).to_dict()
    placed = ray.get(find_coordinator("built").status.remote())["group-0"]["domain"]
    assert group_domain(config, "group-0", "built", 1.0) == (placed, config)
    with pytest.raises(EngramRayError, match=r"^group-1 of deployment 'built' waited 1 s for its "
                       r"front door \(the coordinator has groups \['group-0'\]\): deploy the "
                       "application with import_path engram_ray.serve.app:build_app"):
        group_domain(config, "group-1", "built", 1.0)
    config["serving"]["engine_kwargs"]["max_num_seqs"] = 64  # the front door's (in_place)
    assert group_domain(config, "group-0", "built", 1.0) == (placed, ServeAppConfig.from_dict(
        raw).to_dict())
    config["serving"]["metrics_port"] = 9600
    with pytest.raises(EngramRayError, match="and other values of serving.metrics_port"):
        group_domain(config, "group-0", "built", 1.0)
    # A deploy that switches to beside writes the engine settings into the groups' args, and
    # Serve builds its applications in no order: a group built before its front door waits
    # for the coordinator to leave in_place, and takes the front door's settings once it has.
    written = ["serving.engine_kwargs.max_num_seqs"]
    with pytest.raises(ConfigError, match=r"^build_group args: serving.engine_kwargs.max_num_seqs:"
                       " are set in a group application while serving.rollout.mode is "
                       "in_place"):
        group_domain(ServeAppConfig.from_dict(raw).to_dict(), "group-0", "built", 1.0,
                     in_place_written=written)
    beside = json.loads(json.dumps(raw))
    beside["serving"]["rollout"] = {"mode": "beside"}
    beside["serving"]["engine_kwargs"]["max_num_seqs"] = 64
    beside = ServeAppConfig.from_dict(beside).to_dict()
    domains = {"group-0": placed}
    front_door = threading.Timer(2.0, lambda: ray.get(
        find_coordinator("built").reconfigure.remote(beside, domains)))
    front_door.start()
    started = time.monotonic()
    assert group_domain(beside, "group-0", "built", 30.0, in_place_written=written) == (
        placed, beside)
    assert time.monotonic() - started >= 2.0  # it waited for the front door
    front_door.join()
    ray.kill(find_coordinator("built"))


def test_a_refusal_fails_the_build_once_with_its_own_line(ray_local):
    """`refused_at_once`: an engram-ray refusal, raised here or in an actor (which Ray gives
    as its RayTaskError subclass, message = the task's stack), leaves the builder as
    the RayServeException Serve does not retry, its message the refusal's alone; any other
    error is left to Serve's retries."""
    ray = ray_local
    from ray.serve.exceptions import RayServeException

    from engram_ray.serve.app import refused_at_once

    @ray.remote
    def refuse():
        raise ConfigError("serving.num_peer_groups", "is 9", "at most 4")

    with pytest.raises(EngramRayError) as in_actor:
        ray.get(refuse.remote())
    assert "ray::refuse()" in str(in_actor.value) and "File " in str(in_actor.value)
    for error in (ConfigError("serving.num_peer_groups", "is 9", "at most 4"), in_actor.value):
        with pytest.raises(RayServeException) as raised:
            with refused_at_once():
                raise error
        assert str(raised.value) == "serving.num_peer_groups: is 9 (expected at most 4)"
    with pytest.raises(OSError):
        with refused_at_once():
            raise OSError("the store is not mounted yet")


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

    from engram_ray.serve.member.kv_cache import formula_capacity

    def config(use_mla):
        model = SimpleNamespace(dtype=torch.bfloat16, use_mla=use_mla,
                                get_num_layers=lambda p: 4, get_num_kv_heads=lambda p: 2,
                                get_head_size=lambda: 64)
        return SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=10, block_size=16,
                                                            cache_dtype="auto"),
                               model_config=model, parallel_config=None)

    assert formula_capacity(config(False)) == (160 * 2 * 4 * 2 * 64 * 2, 160)
    assert formula_capacity(config(True)) == (160 * 1 * 4 * 2 * 64 * 2, 160)

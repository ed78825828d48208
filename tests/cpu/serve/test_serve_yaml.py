"""The Serve YAML as operators write it: `{}` works, the checkpoint and CPUs are written once,
`engine_kwargs` typos are refused naming the nearest vLLM argument, Ray Serve LLM's own
options pass through (`serving.llm_config`, `serving.deployment_options`) except the ones the
app or the peer groups own, and the app uses Ray 2.60's public `ray.serve.llm` names."""

import copy
import logging
from pathlib import Path

import pytest

from engram_ray.errors import ConfigError
from engram_ray.planning.grouping import Domain, PeerGroupPlan
from engram_ray.serve.deploy.cluster_configs import check_serve_config, read_yaml
from engram_ray.serve.settings.config import ServeAppConfig
from engram_ray.serve.settings.library_options import check_engine_kwargs, check_llm_options

CONFIGS = Path(__file__).resolve().parents[3] / "cluster_configs"
GROUP = PeerGroupPlan("group-0", Domain("rack-0", ("n1",), 8, {"k": "rack-0"}), 0, 8)


def test_empty_args_serve_deepseek_from_its_checkpoint():
    app = ServeAppConfig.from_dict({}, "args")
    assert app.deployment.fill == "checkpoint"
    assert app.deployment.checkpoint == app.serving.model_source == "deepseek-ai/DeepSeek-V4.1-Flash"
    assert app.deployment.model == "deepseek-v4.1-flash"
    assert app.serving.num_cpus_per_replica == app.deployment.num_cpus_per_engine
    # and Ray's schema and the project's checks take it as a whole document (with its group)
    doc = {"applications": [{"name": "a", "import_path": "engram_ray.serve.app:build_app",
                             "args": {}}, _group_app("engram-group-0", {})]}
    (checked,) = check_serve_config(doc, "minimal.yaml").values()
    assert checked == app


def _group_app(name: str, args: dict, group: str = "group-0") -> dict:
    from engram_ray.serve.settings.group_apps import group_args

    return {"name": name, "route_prefix": None, "args": group_args(args, group),
            "import_path": "engram_ray.serve.app:build_group"}


def test_each_group_is_an_application_of_its_own_with_the_front_doors_settings():
    """serve_local_tiny.yaml's groups (YAML anchors) run the front door's settings but for its
    own (num_peer_groups, ingress, request_limits); `engram-ray check` names what is missing,
    left over or different."""
    from engram_ray.serve.settings.group_apps import group_applications

    data = read_yaml(CONFIGS / "serve_local_tiny.yaml")
    door, group = data["applications"]
    assert group_applications(door["args"]) == {"local-group-0": group["args"]}
    assert "num_peer_groups" in door["args"]["serving"]
    assert "num_peer_groups" not in group["args"]["serving"]

    def refused(doc) -> str:
        with pytest.raises(ConfigError) as info:
            check_serve_config(doc, "x.yaml")
        return str(info.value)

    two = copy.deepcopy(data)
    two["applications"][0]["args"]["serving"]["num_peer_groups"] = 2
    assert refused(two).startswith("x.yaml: applications: have no application 'local-group-1' "
                                   "for group-1 of 'engram-local' (serving.num_peer_groups "
                                   "counts it) (expected one named local-group-1 with ")
    two["applications"].append(_group_app("local-group-1", two["applications"][0]["args"],
                                          "group-1") | {"runtime_env": door["runtime_env"]})
    assert check_serve_config(two, "x.yaml")["engram-local"].serving.num_peer_groups == 2
    # a group setting: group-0 shares it through the anchor, group-1 (written out) does not
    other = copy.deepcopy(two)
    other["applications"][0]["args"]["deployment"]["rendezvous_timeout_s"] = 100
    assert refused(other).startswith(
        "x.yaml: applications[2].args: differ from what the front door 'engram-local' runs its "
        "groups with in deployment.rendezvous_timeout_s")
    # an engine setting (rollout.mode in_place) is the front door's: in a group it is refused
    other = copy.deepcopy(two)
    other["applications"][2]["args"]["serving"]["engine_kwargs"] = {"max_num_seqs": 64}
    assert "in serving.engine_kwargs" in refused(other)
    other = copy.deepcopy(two)
    other["applications"][2]["args"]["serving"]["num_peer_groups"] = 2  # the front door's own
    assert "in serving.num_peer_groups" in refused(other)
    other = copy.deepcopy(two)
    other["applications"][2]["route_prefix"] = "/g1"
    assert refused(other).startswith("x.yaml: applications[2].route_prefix: is '/g1'")
    other = copy.deepcopy(two)
    other["applications"][2]["runtime_env"] = {}
    assert refused(other).startswith("x.yaml: applications[2].runtime_env: differs from the "
                                     "front door 'engram-local''s (its engines run in it)")
    # 2 -> 1 with the group's application left in: refused, saying what to do
    assert refused(data | {"applications": data["applications"] + [two["applications"][2]]}) \
        == ("x.yaml: applications[2]: is group application 'local-group-1' of no front door "
            "(no build_app application's serving.num_peer_groups and deployment.name count "
            "it) (expected remove it, or raise the front door's serving.num_peer_groups)")


def test_checkpoint_and_cpus_are_written_once(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    app = ServeAppConfig.from_dict({"serving": {"model_source": str(folder)},
                                    "deployment": {"num_cpus_per_engine": 8}}, "args")
    assert app.deployment.checkpoint == str(folder) and app.deployment.model == str(folder)
    assert app.serving.num_cpus_per_replica == 8
    app = ServeAppConfig.from_dict({"deployment": {"checkpoint": str(folder)},
                                    "serving": {"num_cpus_per_replica": 4}}, "args")
    assert app.serving.model_source == str(folder) and app.deployment.num_cpus_per_engine == 4
    # dummy weights: synthetic rows, no checkpoint
    app = ServeAppConfig.from_dict({"serving": {"engine_kwargs": {"load_format": "dummy"}}})
    assert app.deployment.fill == "synthetic" and app.deployment.checkpoint is None
    # written twice and disagreeing: still refused naming both
    with pytest.raises(ConfigError, match="num_cpus_per_replica.*is 4.*num_cpus_per_engine is 8"):
        ServeAppConfig.from_dict({"deployment": {"num_cpus_per_engine": 8},
                                  "serving": {"num_cpus_per_replica": 4}})
    with pytest.raises(ConfigError, match="deployment.checkpoint"):
        ServeAppConfig.from_dict({"deployment": {"checkpoint": "/a"},
                                  "serving": {"model_source": "/b"}})


def test_the_projects_yamls_write_the_checkpoint_and_cpus_once():
    for name in ("serve_deepseek_v41_flash.yaml", "serve_local_tiny.yaml"):
        data = read_yaml(CONFIGS / name)
        (app,) = check_serve_config(data, name).values()
        args = data["applications"][0]["args"]  # the front door's
        assert app.to_dict() == ServeAppConfig.from_dict(app.to_dict()).to_dict()
        assert "checkpoint" not in args["deployment"] and "fill" not in args["deployment"]
        assert "num_cpus_per_replica" not in args["serving"]
        assert app.deployment.fill == "checkpoint"
        assert app.deployment.checkpoint == app.serving.model_source
        assert app.serving.num_cpus_per_replica == app.deployment.num_cpus_per_engine
    local = args  # the tiny model: its folder gives the layout, too
    assert "model" not in local["deployment"]
    assert app.deployment.model == app.serving.model_source == "/tmp/engram-ray/tiny-model"


@pytest.mark.parametrize("typo,nearest", [
    ("gpu_memory_utilisation", "gpu_memory_utilization"),
    ("max_num_seq", "max_num_seqs"),
    ("chat_templat", "chat_template"),  # a frontend argument (Ray Serve LLM splits them off)
])
def test_engine_kwargs_typo_is_refused_naming_the_nearest(typo, nearest):
    with pytest.raises(ConfigError) as info:
        check_engine_kwargs({"dtype": "bfloat16", typo: 1})
    assert str(info.value) == (f"serving.engine_kwargs.{typo}: is not a vLLM engine argument "
                               f"(expected `{nearest}`)")
    check_engine_kwargs({"dtype": "bfloat16", nearest: 1, "additional_config": {}})


def test_engine_kwargs_typo_fails_engram_ray_check_and_build_app():
    data = copy.deepcopy(read_yaml(CONFIGS / "serve_local_tiny.yaml"))
    data["applications"][0]["args"]["serving"]["engine_kwargs"]["gpu_memory_utilisation"] = 0.9
    with pytest.raises(ConfigError, match="gpu_memory_utilisation.*`gpu_memory_utilization`"):
        check_serve_config(data, "local.yaml")
    from engram_ray.serve.app import check_library_options

    # build_app runs this check before it makes or changes a coordinator (test_routing:
    # test_a_build_whose_check_fails_makes_and_changes_no_coordinator)
    with pytest.raises(ConfigError, match="gpu_memory_utilisation"):
        check_library_options(ServeAppConfig.from_dict(data["applications"][0]["args"]))


def test_engine_kwargs_check_is_skipped_with_a_warning_without_vllm(monkeypatch, caplog):
    import sys

    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", None)  # import fails
    with caplog.at_level(logging.WARNING):
        check_engine_kwargs({"gpu_memory_utilisation": 0.9})
    assert "serving.engine_kwargs not checked" in caplog.text


def test_llm_config_and_deployment_options_pass_through():
    from engram_ray.serve.app import llm_config

    data = read_yaml(CONFIGS / "serve_local_tiny.yaml")
    args = copy.deepcopy(data["applications"][0]["args"])
    args["serving"].update(llm_config={"log_engine_metrics": True},
                           deployment_options={"graceful_shutdown_timeout_s": 42,
                                               "max_ongoing_requests": 64})
    app = ServeAppConfig.from_dict(args, "args")
    check_llm_options(app.serving)
    config = llm_config(app, GROUP)
    assert config.log_engine_metrics is True
    assert config.deployment_config["graceful_shutdown_timeout_s"] == 42
    assert config.deployment_config["max_ongoing_requests"] == 64
    assert config.deployment_config["health_check_period_s"] == app.deployment.health_check_interval_s
    # left out: vLLM's series stay on the engine's /metrics
    plain = llm_config(ServeAppConfig.from_dict(data["applications"][0]["args"]), GROUP)
    assert plain.log_engine_metrics is False


@pytest.mark.parametrize("section,key,message", [
    ("llm_config", "engine_kwargs", "llm_config.engine_kwargs: is set by the app (expected "
                                    "serving.engine_kwargs)"),
    ("llm_config", "deployment_config", "serving.deployment_options"),
    ("deployment_options", "num_replicas", "deployment_options.num_replicas: is owned by the "
                                           "peer groups (expected serving.num_peer_groups"),
    ("deployment_options", "autoscaling_config", "owned by the peer groups"),
    ("deployment_options", "health_check_period_s", "deployment.health_check_interval_s"),
    ("deployment_options", "ray_actor_options", "NVLink domain"),
])
def test_options_the_app_or_the_groups_own_are_refused_by_name(section, key, message):
    with pytest.raises(ConfigError) as info:
        ServeAppConfig.from_dict({"serving": {section: {key: {}}}})
    assert message in str(info.value)


def test_unknown_passthrough_options_name_the_nearest():
    for section, typo, nearest in (("llm_config", "log_engine_metric", "log_engine_metrics"),
                                   ("deployment_options", "graceful_shutdown_timeout",
                                    "graceful_shutdown_timeout_s")):
        app = ServeAppConfig.from_dict({"serving": {section: {typo: 1}}})
        with pytest.raises(ConfigError) as info:
            check_llm_options(app.serving)
        assert str(info.value) == (f"serving.{section}.{typo}: is not an option there "
                                   f"(expected `{nearest}`)")


def test_replica_classes_are_built_on_rays_public_names():
    from ray.serve.llm.deployment import DPServer, LLMServer

    from engram_ray.serve.member.server import EngramDPServer, EngramLLMServer

    assert issubclass(EngramLLMServer, LLMServer) and issubclass(EngramDPServer, DPServer)
    source = (Path(__file__).resolve().parents[3] / "engram_ray" / "serve" / "member"
              / "server.py")
    imports = [line for line in source.read_text().splitlines()
               if line.startswith(("from ray", "import ray"))]
    assert imports and not any("_internal" in line for line in imports)

"""Every YAML in cluster_configs/ loads through the project's config models and Ray's schemas;
broken variants are refused naming the field at fault."""

import copy
from pathlib import Path

import pytest

from engram_ray.config import DEFAULT_DOMAIN_LABEL_KEY
from engram_ray.errors import ConfigError
from engram_ray.serve.deploy.cluster_configs import (check_ray_up_config, check_serve_config,
                                                     load_ray_up_config, load_serve_config,
                                                     read_yaml)

CONFIGS = Path(__file__).resolve().parents[3] / "cluster_configs"
SERVE_FILES = sorted(CONFIGS.glob("serve_*.yaml"))
RAY_UP_FILES = sorted(CONFIGS.glob("ray_up_*.yaml"))


def test_expected_files_exist():
    names = {p.name for p in CONFIGS.glob("*.yaml")}
    assert {"serve_deepseek_v41_flash.yaml", "serve_local_tiny.yaml", "ray_up_gb300_nvl72.yaml",
            "ray_up_onprem.yaml"} <= names


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_yaml_begins_with_purpose_and_command(path):
    head = path.read_text().splitlines()[:12]
    assert head[0].startswith("# ") and len(head[0]) > 20, "first line must state the purpose"
    assert any("ray up " in line or "serve deploy " in line or "scripts/local.sh" in line
               for line in head if line.startswith("#")), "the exact command is missing"


@pytest.mark.parametrize("path", SERVE_FILES, ids=lambda p: p.name)
def test_serve_configs_load(path):
    apps = load_serve_config(path)
    assert len(apps) == 1
    config = next(iter(apps.values()))
    assert config.deployment.domain_label_key == DEFAULT_DOMAIN_LABEL_KEY


def test_deepseek_is_dep2_with_groups_of_eight_spanning_four_replicas():
    config = next(iter(load_serve_config(CONFIGS / "serve_deepseek_v41_flash.yaml").values()))
    assert config.deployment.peer_group_size == 8
    assert config.deployment.table_backend == "cuda"
    assert (config.serving.data_parallel_size, config.serving.enable_expert_parallel) == (2, True)
    assert config.replicas_per_group == 4
    text = (CONFIGS / "serve_deepseek_v41_flash.yaml").read_text()
    assert "# peer_group_size: 18" in text  # the commented variant


def test_local_deployment_points_every_path_at_its_workdir(tmp_path):
    from engram_ray.local.deployment import LocalDeployment, LocalOptions

    local = LocalDeployment(LocalOptions(workdir=str(tmp_path)))
    dep, srv = local.config.deployment, local.config.serving
    assert dep.model == dep.checkpoint == srv.model_source == str(tmp_path / "tiny-model")


def test_local_tiny_is_two_cpu_engines_in_one_shm_group():
    config = next(iter(load_serve_config(CONFIGS / "serve_local_tiny.yaml").values()))
    assert config.num_replicas == 2
    assert (config.serving.device, config.deployment.table_backend) == ("cpu", "shm")
    assert config.serving.metrics_bind_address == "127.0.0.1"


@pytest.mark.parametrize("path", RAY_UP_FILES, ids=lambda p: p.name)
def test_ray_up_configs_load(path):
    data = load_ray_up_config(path, DEFAULT_DOMAIN_LABEL_KEY)
    assert data["provider"]["type"] in ("aws", "local")


@pytest.mark.parametrize("path", RAY_UP_FILES, ids=lambda p: p.name)
def test_ray_up_prometheus_labels_targets_with_the_cluster_name(path):
    """The head exports the scrape config with --cluster <cluster_name> and runs Prometheus on
    that export (test_metrics_discovery.py runs it in a real Prometheus)."""
    import re

    data = read_yaml(path)
    commands = data["head_start_ray_commands"]
    exports = [re.fullmatch(r"engram-ray dashboards export --force --cluster (\S+) (\S+)", c)
               for c in commands]
    [(cluster, folder)] = [m.groups() for m in exports if m]
    assert cluster == data["cluster_name"]
    [prometheus] = [c for c in commands if c.startswith("nohup prometheus ")]
    assert f"--config.file={folder}/prometheus/prometheus.yml" in prometheus
    assert commands.index(prometheus) > [bool(m) for m in exports].index(True)


BROKEN_SERVE = [
    (lambda d: d["applications"][0]["args"]["deployment"].update(peer_group_sise=8),
     "peer_group_sise: is not a known setting"),
    (lambda d: d["applications"][0]["args"]["deployment"].update(peer_group_size=7),
     "peer_group_size: is 7, not a multiple of serving.data_parallel_size 2"),
    (lambda d: d["applications"][0]["args"]["serving"].update(tensor_parallel_size=2),
     "tensor_parallel_size: is 2"),
    (lambda d: d["applications"][0]["args"]["serving"]["engine_kwargs"].update(
        tensor_parallel_size=2), "engine_kwargs.tensor_parallel_size: is set in engine_kwargs"),
    (lambda d: d["applications"][0]["args"]["serving"]["engine_kwargs"].update(
        data_parallel_size=4), "engine_kwargs.data_parallel_size: is set in engine_kwargs"),
    (lambda d: d["applications"][0]["args"]["serving"].update(num_cpus_per_replica=16),
     "serving.num_cpus_per_replica: is 16 while deployment.num_cpus_per_engine is 8"),
    (lambda d: d["applications"][0]["args"]["deployment"].update(fill="synthetic",
                                                                  checkpoint=None),
     "deployment.fill: is 'synthetic' but the engines load their tables"),
    (lambda d: d["applications"][0]["args"]["deployment"].update(checkpoint="/elsewhere"),
     "deployment.checkpoint: is '/elsewhere' while serving.model_source is"),
    (lambda d: d["applications"][0]["args"]["serving"].update(device="cpu"),
     "table_backend: is 'cuda'"),
    (lambda d: d["applications"][0].pop("import_path"), "applications.0.import_path"),
    (lambda d: d["applications"][0].update(import_path="other:app"),
     "has no engram_ray.serve.app:build_app application"),
]


@pytest.mark.parametrize("breaks,message", BROKEN_SERVE)
def test_broken_serve_config_is_refused_with_the_field(breaks, message):
    data = copy.deepcopy(read_yaml(CONFIGS / "serve_deepseek_v41_flash.yaml"))
    breaks(data)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        check_serve_config(data, "broken.yaml")


BROKEN_RAY_UP = [
    (lambda d: d.update(max_wrokers=3), "max_wrokers"),
    (lambda d: d.update(setup_commands=["pip install vllm"]), "setup_commands"),
    (lambda d: d.update(worker_start_ray_commands=["ray start --address=$RAY_HEAD_IP:6379"]),
     "worker_start_ray_commands"),
]


@pytest.mark.parametrize("breaks,field", BROKEN_RAY_UP)
def test_broken_ray_up_config_is_refused_with_the_field(breaks, field):
    data = copy.deepcopy(read_yaml(CONFIGS / "ray_up_gb300_nvl72.yaml"))
    breaks(data)
    with pytest.raises(ConfigError, match=field):
        check_ray_up_config(data, "broken.yaml", DEFAULT_DOMAIN_LABEL_KEY)


def test_local_provider_refuses_node_type_labels():
    data = copy.deepcopy(read_yaml(CONFIGS / "ray_up_onprem.yaml"))
    data["available_node_types"] = {"gpu": {"resources": {"GPU": 8}, "node_config": {},
                                            "labels": {"a": "b"}, "max_workers": 4}}
    data["head_node_type"] = "gpu"
    with pytest.raises(ConfigError, match="ignored by the local provider"):
        check_ray_up_config(data, "broken.yaml", DEFAULT_DOMAIN_LABEL_KEY)


@pytest.mark.parametrize("path", RAY_UP_FILES, ids=lambda p: p.name)
def test_ray_up_commands_run_where_they_are_run(path):
    """#46 item 3: in Docker, the setup and start commands run inside the image, which has no
    sudo (docker/Dockerfile); the Prometheus a head starts is installed there: in the image
    (Dockerfile) or by the head's setup commands."""
    data = read_yaml(path)
    in_image = () if not data.get("docker") else (
        "setup_commands", "head_setup_commands", "worker_setup_commands",
        "head_start_ray_commands", "worker_start_ray_commands")
    for key in in_image:
        assert not any("sudo " in c for c in data.get(key, [])), (key, data[key])
    if any("prometheus --config.file" in c for c in data["head_start_ray_commands"]):
        dockerfile = (CONFIGS.parent / "docker" / "Dockerfile").read_text()
        installs = " ".join(data.get("head_setup_commands", []) + data.get("setup_commands", []))
        if data.get("docker"):
            assert " prometheus " in dockerfile.split("apt-get install", 1)[1].split("&&")[0]
        else:
            assert "apt-get install" in installs and "prometheus" in installs
            assert "systemctl disable --now prometheus" in installs  # its port is ours

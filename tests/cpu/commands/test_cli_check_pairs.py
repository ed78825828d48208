"""#46 item 4: `engram-ray check` checks pairs. A Serve YAML against the cluster it is deployed
on (`--cluster`: a `ray up` file or a KubeRay manifest): its groups in the cluster's NVLink
domains, each node's engines within its CPUs, the model folder and a shared store in the
containers; a KubeRay RayService against its own rayClusterConfig, and its metrics ports
against its containers' ports and PodMonitors. Shipped pairs pass; each broken copy fails
naming the setting and what disagrees."""

import copy
from pathlib import Path

import pytest
import yaml

from engram_ray.cli import main

CONFIGS = Path(__file__).resolve().parents[3] / "cluster_configs"
FLASH = CONFIGS / "serve_deepseek_v41_flash.yaml"
ONPREM = CONFIGS / "ray_up_onprem.yaml"
GB300 = CONFIGS / "ray_up_gb300_nvl72.yaml"
KUBERAY = CONFIGS / "kuberay"


def check(capsys, *args):
    code = main(["check", *map(str, args)])
    lines = capsys.readouterr().out.splitlines()
    return code, lines


def write(tmp_path, name, data, many=False):
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(data) if many else yaml.safe_dump(data))
    return path


def load(path):
    return copy.deepcopy(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize("cluster,fits", [
    (ONPREM, "fits {}: 9 groups in 9 NVLink domains, 0 of 72 GPU slots left"),
    (GB300, "fits {}: 9 groups in 1 NVLink domain, 0 of 72 GPU slots left")])
def test_the_shipped_serve_yaml_fits_each_shipped_ray_up_file(capsys, cluster, fits):
    code, [line] = check(capsys, FLASH, "--cluster", cluster)
    assert code == 0 and line.startswith(f"OK {FLASH} (Serve: "), line
    assert fits.format(cluster) in line, line


def test_72_gpus_asked_of_a_cluster_of_4_hosts_of_8_fail(tmp_path, capsys):
    """The issue's case: the Serve YAML's 9 groups of 8 beside 4 x 8 GPUs."""
    data = load(ONPREM)
    data["provider"]["worker_ips"] = data["provider"]["worker_ips"][:4]
    small = write(tmp_path, "onprem4.yaml", data)
    code, [line] = check(capsys, FLASH, "--cluster", small)
    assert code == 1, line
    assert line == (
        f"FAILED {FLASH}: application deepseek-v41-flash: serving.num_peer_groups: is 9 groups "
        f"of 8 engines (72 GPUs): 5 fit in no NVLink domain of {small} (worker_ips: 4 x 8 "
        "GPUs; 4 domains, the largest 8 GPUs) (expected at most 4 groups (and one group "
        "application each), or a cluster with room for every group)")
    # the same Serve YAML with 4 groups (and 4 group applications) fits it
    serve = load(FLASH)
    serve["applications"][0]["args"]["serving"]["num_peer_groups"] = 4
    serve["applications"] = serve["applications"][:5]
    four = write(tmp_path, "flash4.yaml", serve)
    code, [line] = check(capsys, four, "--cluster", small)
    assert code == 0 and "fits" in line and "4 groups in 4 NVLink domains" in line, line


def test_groups_of_8_on_hosts_of_4_without_a_shared_fabric_fail(tmp_path, capsys):
    """GB300 trays without the IMEX channel are hosts of 4 GPUs: no domain holds 8."""
    data = load(GB300)
    data["docker"]["worker_run_options"] = [o for o in data["docker"]["worker_run_options"]
                                            if "imex" not in o]
    no_imex = write(tmp_path, "no-imex.yaml", data)
    code, [line] = check(capsys, FLASH, "--cluster", no_imex)
    assert code == 1 and ": serving.num_peer_groups: is 9 groups of 8 engines" in line, line
    assert "9 fit in no NVLink domain" in line and "the largest 4 GPUs" in line, line


def test_a_cluster_without_a_gpu_count_is_named(tmp_path, capsys):
    data = load(ONPREM)
    data["worker_start_ray_commands"] = [c.replace("--num-gpus=8", "")
                                         for c in data["worker_start_ray_commands"]]
    unknown = write(tmp_path, "unknown.yaml", data)
    code, [line] = check(capsys, FLASH, "--cluster", unknown)
    assert code == 1 and line.startswith(f"FAILED {FLASH}: {unknown}: worker_ips: says no GPU "
                                         "count"), line
    assert "--num-gpus=N" in line


def test_engines_need_their_cpus_on_a_node(tmp_path, capsys):
    serve = load(FLASH)
    serve["applications"][0]["args"]["deployment"]["num_cpus_per_engine"] = 40
    for app in serve["applications"][1:]:
        app["args"]["deployment"] = serve["applications"][0]["args"]["deployment"]
    hungry = write(tmp_path, "hungry.yaml", serve)
    code, [line] = check(capsys, hungry, "--cluster", GB300)
    assert code == 1 and ": deployment.num_cpus_per_engine: is 40: 4 engines of node type " \
        "gb300_tray" in line and "need 160 CPUs, it has 144" in line, line


@pytest.mark.parametrize("drop,field,problem", [
    ("/mnt/models", "serving.model_source", "which no bind mount of"),
    ("/mnt/shared:/mnt/shared", "deployment.peer_group_store", "not mounted in the head' "
                                                               "containers"),
])
def test_docker_containers_must_see_the_model_and_the_shared_store(tmp_path, capsys, drop,
                                                                   field, problem):
    data = load(GB300)
    data["docker"]["run_options"] = [o for o in data["docker"]["run_options"]
                                     if not o.endswith(drop) and drop + ":" not in o
                                     and not o.endswith(drop + ":ro")]
    assert len(data["docker"]["run_options"]) == len(load(GB300)["docker"]["run_options"]) - 1
    broken = write(tmp_path, "gb300.yaml", data)
    code, [line] = check(capsys, FLASH, "--cluster", broken)
    assert code == 1 and f"application deepseek-v41-flash: {field}: " in line, line
    assert problem in line, line


def test_a_read_only_store_mount_is_refused(tmp_path, capsys):
    data = load(GB300)
    data["docker"]["run_options"] = [o.replace("/mnt/shared:/mnt/shared", "/mnt/shared:/mnt/"
                                               "shared:ro") for o in data["docker"]["run_options"]]
    broken = write(tmp_path, "gb300.yaml", data)
    code, [line] = check(capsys, FLASH, "--cluster", broken)
    assert code == 1 and "deployment.peer_group_store: is /mnt/shared/engram-ray/store, " \
        "mounted read-only in the head' containers" in line, line


def test_a_serve_yaml_against_a_kuberay_cluster(capsys):
    """--cluster takes a KubeRay manifest: the HGX one has 4 hosts of 8 GPUs."""
    code, [line] = check(capsys, FLASH, "--cluster", KUBERAY / "rayservice_hgx_h200.yaml")
    assert code == 1 and "5 fit in no NVLink domain" in line and \
        "worker group hgx-h200: 4 x 8 GPUs" in line, line


def test_a_cluster_file_of_no_cluster_kind_is_named(tmp_path, capsys):
    code, [line] = check(capsys, FLASH, "--cluster", CONFIGS / "serve_local_tiny.yaml")
    assert code == 1 and f"--cluster {CONFIGS / 'serve_local_tiny.yaml'}: holds 0 RayCluster" \
        in line, line


def _rayservice(name):
    docs = list(yaml.safe_load_all((KUBERAY / name).read_text()))
    [service] = [d for d in docs if d["kind"] == "RayService"]
    return docs, service


def _set_serving(service, **serving):
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    for app in serve["applications"]:
        target = app["args"]["serving"]
        target.update(serving)
    service["spec"]["serveConfigV2"] = yaml.safe_dump(serve)


def test_a_rayservice_too_small_for_its_groups_fails(tmp_path, capsys):
    docs, service = _rayservice("rayservice_gb300_nvl72.yaml")
    [trays] = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    trays["replicas"] = trays["minReplicas"] = trays["maxReplicas"] = 9
    broken = write(tmp_path, "gb300.yaml", docs, many=True)
    code, [line] = check(capsys, broken)
    assert code == 1 and "serving.num_peer_groups: is 9 groups of 8 engines (72 GPUs): 5 fit " \
        "in no NVLink domain of its rayClusterConfig (worker group gb300-tray: 9 x 4 GPUs " \
        "(NVL72 racks of 72)" in line, line


@pytest.mark.parametrize("name", ["rayservice_gb300_nvl72.yaml", "rayservice_hgx_h200.yaml"])
def test_metrics_port_changed_without_its_container_ports_fails(tmp_path, capsys, name):
    docs, service = _rayservice(name)
    _set_serving(service, metrics_port=9600)
    broken = write(tmp_path, name, docs, many=True)
    code, [line] = check(capsys, broken)
    assert code == 1 and "serving.metrics_port: is 9600: worker group " in line, line
    assert "container port engram-0 is 9500, the engine in its slot binds 9600" in line, line


def test_container_ports_moved_without_the_podmonitor_fails(tmp_path, capsys):
    """metrics_port and the container ports moved together, the PodMonitor left behind."""
    docs, service = _rayservice("rayservice_hgx_h200.yaml")
    _set_serving(service, metrics_port=9600)
    for group in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        for port in container["ports"]:
            if port["name"].startswith("engram-"):
                port["containerPort"] += 100
                port["name"] = port["name"].replace("engram-", "engram-x")
        container["ports"] += [{"containerPort": 9600 + i, "name": n} for i, n in enumerate(
            f"engram-{s}{m}" for s in range(8) for m in ("", "-model"))]
        container["ports"] = [p for p in container["ports"]
                              if not p["name"].startswith("engram-x")]
    for doc in docs:
        if doc["kind"] == "PodMonitor" and doc["metadata"]["name"].endswith("-engines"):
            doc["spec"]["podMetricsEndpoints"] = doc["spec"]["podMetricsEndpoints"][:-1]
    broken = write(tmp_path, "hgx.yaml", docs, many=True)
    code, [line] = check(capsys, broken)
    assert code == 1 and "serving.metrics_port: puts worker group hgx-h200's engine endpoints " \
        "on ports engram-0 .. engram-7-model; PodMonitors dsv41-flash-h200, " \
        "dsv41-flash-h200-engines scrape no port engram-7-model" in line, line


@pytest.mark.parametrize("serving,message", [
    ({"metrics_port": 0}, "serving.metrics_port: is 0 (free ports), which PodMonitor "
                          "dsv41-flash-gb300-engines cannot name"),
    ({"http_sd_port": 9399}, "serving.http_sd_port: is 9399, no containerPort of the head's"),
], ids=["free metrics ports under a PodMonitor", "http_sd_port not on the head"])
def test_ports_the_manifest_cannot_serve_are_refused(tmp_path, capsys, serving, message):
    docs, service = _rayservice("rayservice_gb300_nvl72.yaml")
    _set_serving(service, **serving)
    broken = write(tmp_path, "gb300.yaml", docs, many=True)
    code, [line] = check(capsys, broken)
    assert code == 1 and message in line, line


def test_the_coordinators_metrics_must_be_scraped_on_the_head(tmp_path, capsys):
    docs, _ = _rayservice("rayservice_hgx_h200.yaml")
    for doc in docs:
        if doc["kind"] == "PodMonitor" and not doc["metadata"]["name"].endswith("-engines"):
            doc["spec"]["podMetricsEndpoints"] = [e for e in doc["spec"]["podMetricsEndpoints"]
                                                  if e["port"] != "engram-sd"]
    broken = write(tmp_path, "hgx.yaml", docs, many=True)
    code, [line] = check(capsys, broken)
    assert code == 1 and "serving.http_sd_port: is 9499, the coordinator's /metrics, but " \
        "PodMonitor dsv41-flash-h200 (on the head) scrapes no port engram-sd" in line, line

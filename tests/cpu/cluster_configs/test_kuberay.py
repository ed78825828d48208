"""KubeRay manifests in cluster_configs/kuberay/: the embedded serveConfigV2 through Ray Serve's
schema and build_app's config checks, pod templates through the Kubernetes schemas (strict), the
CRD fields used against the CRDs' field lists, and what the engines need (GPUs for every bundle,
the store on a ReadWriteMany volume, /dev/shm in memory, domain labels, IMEX, no added capability)
consistent with the Serve config."""

import copy
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from engram_ray.planning.grouping import NodeSlots, domains_of, place_groups
from engram_ray.serve.deploy.cluster_configs import check_serve_config, read_yaml

ROOT = Path(__file__).resolve().parents[3]
KUBERAY = ROOT / "cluster_configs" / "kuberay"
FILES = sorted(KUBERAY.glob("*.yaml"))
K8S_VERSION = "1.34"  # DRA (resource claims in pod specs) is GA from 1.34
BASE_SERVE = ROOT / "cluster_configs" / "serve_deepseek_v41_flash.yaml"
# What each manifest's Serve app may differ in from serve_deepseek_v41_flash.yaml (anything
# else drifting between them fails test_serve_config_is_the_projects).
# metrics_bind_address 0.0.0.0: a pod is its own network namespace (its IP and loopback), the
# serve YAML's `node` (issue 29) matters on hosts shared with other programs.
K8S_OVERRIDES = {
    "rayservice_gb300_nvl72.yaml": {
        ("deployment", "peer_group_store"): "/mnt/engram-store/store",
        ("deployment", "handle_type"): "fabric",
        ("serving", "metrics_bind_address"): "0.0.0.0"},
    "rayservice_hgx_h200.yaml": {
        ("deployment", "peer_group_store"): "/mnt/engram-store/store",
        ("deployment", "handle_type"): "posix_fd",
        ("serving", "num_peer_groups"): 4,
        ("serving", "metrics_bind_address"): "0.0.0.0"},
}
# Field names of the CRDs, from KubeRay v1.7.0's generated API reference (docs/reference/api.md),
# NVIDIA k8s-dra-driver-gpu's ComputeDomain v1beta1 types and prometheus-operator's PodMonitor.
# The CRD files themselves are not to be had offline here: these lists stand in for them.
RAYSERVICE_SPEC = {"rayClusterDeletionDelaySeconds", "serviceUnhealthySecondThreshold",
                   "deploymentUnhealthySecondThreshold", "serveService", "upgradeStrategy",
                   "managedBy", "serveConfigV2", "rayClusterConfig",
                   "excludeHeadPodFromServeSvc", "suspend"}
RAYCLUSTER_SPEC = {"upgradeStrategy", "authOptions", "suspend", "managedBy", "autoscalerOptions",
                   "headServiceAnnotations", "enableInTreeAutoscaling",
                   "gcsFaultToleranceOptions", "historyServerOptions", "networkPolicy",
                   "tlsOptions", "headGroupSpec", "rayVersion", "workerGroupSpecs"}
HEAD_GROUP = {"template", "headService", "enableIngress", "ingressOptions", "resources",
              "labels", "rayStartParams", "serviceType"}
WORKER_GROUP = {"suspend", "groupName", "replicas", "minReplicas", "maxReplicas",
                "idleTimeoutSeconds", "priority", "resources", "labels", "rayStartParams",
                "template", "scaleStrategy", "numOfHosts"}
UPGRADE_TYPES = {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"}
COMPUTE_DOMAIN_SPEC = {"numNodes", "channel"}
COMPUTE_DOMAIN_CHANNEL = {"resourceClaimTemplate", "allocationMode"}
PODMONITOR_SPEC = {"jobLabel", "podTargetLabels", "podMetricsEndpoints", "selector",
                   "namespaceSelector", "sampleLimit", "attachMetadata"}
PODMONITOR_ENDPOINT = {"port", "portNumber", "targetPort", "path", "scheme", "params",
                       "interval", "scrapeTimeout", "honorLabels", "honorTimestamps",
                       "relabelings", "metricRelabelings"}
RELABEL_CONFIG = {"sourceLabels", "separator", "targetLabel", "regex", "modulus",
                  "replacement", "action"}
MAX_RAYSERVICE_NAME = 47  # KubeRay: 53-character cluster names minus its 6-character suffix


def docs_of(path: Path) -> dict[str, list[dict]]:
    by_kind: dict[str, list[dict]] = {}
    for doc in yaml.safe_load_all(path.read_text()):
        by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def rayservice(docs) -> dict:
    [service] = docs["RayService"]
    return service


def groups(service) -> list[tuple[dict, str]]:
    """(group spec, kind) for the head and every worker group."""
    cluster = service["spec"]["rayClusterConfig"]
    return ([(cluster["headGroupSpec"], "head")] +
            [(g, "worker") for g in cluster.get("workerGroupSpecs", [])])


def ray_container(group) -> dict:
    return group["template"]["spec"]["containers"][0]  # KubeRay: the Ray container is first


def app_config(service):
    [config] = check_serve_config(yaml.safe_load(service["spec"]["serveConfigV2"]),
                                  "serveConfigV2").values()
    return config


def gpus(container) -> int:
    return int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def cpus(container) -> float:
    return float(container["resources"]["limits"]["cpu"])


@pytest.fixture(params=FILES, ids=lambda p: p.name)
def manifest(request):
    return request.param, docs_of(request.param)


def test_both_manifests_exist():
    assert {p.name for p in FILES} == set(K8S_OVERRIDES)


def test_header_states_purpose_and_the_kubectl_command(manifest):
    path, _ = manifest
    head = path.read_text().splitlines()[:8]
    assert head[0].startswith("# KubeRay RayService") and len(head[0]) > 40
    assert f"kubectl apply -n engram -f cluster_configs/kuberay/{path.name}" in " ".join(head)


def test_serve_config_passes_rays_schema_and_build_apps_checks(manifest):
    _, docs = manifest
    config = app_config(rayservice(docs))
    assert config.deployment.table_backend == "cuda" and config.serving.device == "cuda"


def test_serve_config_is_the_projects(manifest):
    """The embedded app is serve_deepseek_v41_flash.yaml's, up to the listed K8s overrides."""
    from engram_ray.serve.deploy.cluster_configs import group_app_configs

    path, docs = manifest
    ours = yaml.safe_load(rayservice(docs)["spec"]["serveConfigV2"])
    base = copy.deepcopy(read_yaml(BASE_SERVE))
    door = base["applications"][0]
    for (section, key), value in K8S_OVERRIDES[path.name].items():
        door["args"][section][key] = value
    base["applications"] = [door] + group_app_configs(door)  # and its groups' applications
    assert ours == base


@pytest.mark.parametrize("breaks,message", [
    (lambda a: a["deployment"].update(peer_group_sise=8), "peer_group_sise"),
    (lambda a: a["serving"].update(tensor_parallel_size=2), "tensor_parallel_size"),
    (lambda a: a["deployment"].update(handle_type="nvlink"), "handle_type"),
])
def test_broken_embedded_serve_config_is_refused(manifest, breaks, message):
    from engram_ray.errors import ConfigError

    _, docs = manifest
    serve = yaml.safe_load(rayservice(docs)["spec"]["serveConfigV2"])
    breaks(serve["applications"][0]["args"])
    with pytest.raises(ConfigError, match=message):
        check_serve_config(serve, "serveConfigV2")


def test_pod_templates_pass_the_kubernetes_schemas(manifest):
    _, docs = manifest
    for group, kind in groups(rayservice(docs)):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": f"{kind}-template"}, "template": group["template"]}
        kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)
    for claim in docs["PersistentVolumeClaim"]:
        kubernetes_validate.validate(claim, K8S_VERSION, strict=True)


def test_the_schema_check_can_fail(manifest):
    _, docs = manifest
    group, _ = groups(rayservice(docs))[1]
    template = copy.deepcopy(group["template"])
    template["spec"]["containers"][0]["volumeMount"] = []  # typo of volumeMounts
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                      "metadata": {"name": "x"}, "template": template},
                                     K8S_VERSION, strict=True)


def test_crd_fields_are_the_crds_and_kuberays_rules_hold(manifest):
    _, docs = manifest
    service = rayservice(docs)
    name = service["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= MAX_RAYSERVICE_NAME
    assert set(service["spec"]) <= RAYSERVICE_SPEC
    assert service["spec"]["upgradeStrategy"]["type"] in UPGRADE_TYPES
    cluster = service["spec"]["rayClusterConfig"]
    assert set(cluster) <= RAYCLUSTER_SPEC and cluster["rayVersion"] == "2.60.0"
    for group, kind in groups(service):
        assert set(group) <= (HEAD_GROUP if kind == "head" else WORKER_GROUP)
        # KubeRay refuses rayStartParams['labels'] (the group's `labels` field replaces it)
        assert "labels" not in group["rayStartParams"]
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        assert group["template"]["spec"]["containers"], "KubeRay needs a container per group"
    for domain in docs.get("ComputeDomain", []):
        assert set(domain["spec"]) <= COMPUTE_DOMAIN_SPEC
        assert set(domain["spec"]["channel"]) <= COMPUTE_DOMAIN_CHANNEL
        assert domain["spec"]["channel"]["allocationMode"] in ("Single", "All")
    for monitor in docs["PodMonitor"]:
        assert set(monitor["spec"]) <= PODMONITOR_SPEC
        assert all(set(e) <= PODMONITOR_ENDPOINT for e in monitor["spec"]["podMetricsEndpoints"])


def test_gpus_cpus_and_bundles_agree_with_the_serve_config(manifest):
    """Every engine bundle ({GPU: num_gpus_per_engine, CPU: num_cpus_per_engine}) has a GPU and
    its CPUs in some worker pod, and the head offers no GPU to Ray."""
    _, docs = manifest
    service = rayservice(docs)
    config = app_config(service)
    dep = config.deployment
    head, *workers = groups(service)
    assert head[0]["rayStartParams"]["num-gpus"] == "0" and gpus(ray_container(head[0])) == 0
    total_gpus = 0
    for group, _ in workers:
        container = ray_container(group)
        assert "num-gpus" not in group["rayStartParams"]  # KubeRay takes the container's limit
        engines_per_pod = gpus(container) // dep.num_gpus_per_engine
        assert engines_per_pod * dep.num_cpus_per_engine <= cpus(container)
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"]
        total_gpus += group["replicas"] * gpus(container)
    assert total_gpus == config.num_replicas * dep.num_gpus_per_engine


def test_every_group_fits_one_nvlink_domain(manifest):
    """build_app's placement (engram_ray.planning.grouping) on the nodes the manifest makes: GB300 trays
    share the rack's fabric clique, each H200 pod is its own host domain."""
    _, docs = manifest
    service = rayservice(docs)
    config = app_config(service)
    nodes = []
    for group, _ in groups(service)[1:]:
        gpus_per_pod = gpus(ray_container(group))
        shared = "podAffinity" in group["template"]["spec"].get("affinity", {})
        for idx in range(group["replicas"]):
            label = "mnnvl-rack0-0" if shared else f"host-{group['groupName']}-{idx}"
            nodes.append(NodeSlots(f"{group['groupName']}-{idx}", label, gpus_per_pod,
                                   gpus_per_pod))
    domains = domains_of(nodes, config.deployment.domain_label_key)
    placed, unplaced = place_groups(domains, config.deployment.peer_group_size,
                                    config.serving.num_peer_groups)
    assert unplaced == 0 and len(placed) == config.serving.num_peer_groups


def test_store_is_on_a_readwritemany_volume_in_every_ray_pod(manifest):
    """The coordinator (head) creates each generation's folder; every engine opens it."""
    _, docs = manifest
    service = rayservice(docs)
    store = app_config(service).deployment.peer_group_store
    claims = {c["metadata"]["name"]: c for c in docs["PersistentVolumeClaim"]}
    for group, kind in groups(service):
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        [mount] = [m for m in ray_container(group)["volumeMounts"]
                   if store.startswith(m["mountPath"].rstrip("/") + "/")]
        assert not mount.get("readOnly"), kind
        claim = claims[volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]]
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"], kind


def test_models_and_shared_memory_are_mounted(manifest):
    _, docs = manifest
    service = rayservice(docs)
    model_source = app_config(service).serving.model_source
    for group, kind in groups(service):
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        mounts = {m["mountPath"]: m for m in ray_container(group)["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]["name"]]
        assert shm["emptyDir"]["medium"] == "Memory", kind
        if kind == "worker":
            assert any(model_source.startswith(path + "/") for path in mounts), model_source


def test_domain_labels_reach_ray_start(manifest):
    """Head: `labels` says no domain. Workers: the init container writes the labels file that
    `ray start --labels-file` (rayStartParams) reads, with the Serve config's label key."""
    _, docs = manifest
    service = rayservice(docs)
    key = app_config(service).deployment.domain_label_key
    head, *workers = groups(service)
    assert head[0]["labels"] == {key: "none"}
    for group, _ in workers:
        labels_file = group["rayStartParams"]["labels-file"]
        spec = group["template"]["spec"]
        [init] = [c for c in spec["initContainers"] if "node-labels" in c["command"]]
        command = init["command"]
        assert command[:2] == ["engram-ray", "node-labels"]
        assert command[command.index("--labels-file") + 1] == labels_file
        if "--label-key" in command:
            assert command[command.index("--label-key") + 1] == key
        else:
            from engram_ray.config import DEFAULT_DOMAIN_LABEL_KEY
            assert key == DEFAULT_DOMAIN_LABEL_KEY
        directory = str(Path(labels_file).parent)
        for container in (init, ray_container(group)):
            [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes[mount["name"]]
        assert gpus(init) == gpus(ray_container(group))  # NVML sees the pod's GPUs


def test_handles_match_the_hardware(manifest):
    """GB300: groups span trays, FABRIC handles need the ComputeDomain's IMEX channel in every
    engine pod. H200: a group is one pod's 8 GPUs, POSIX FDs pass over Unix sockets: no
    container adds a capability (no SYS_PTRACE)."""
    path, docs = manifest
    service = rayservice(docs)
    config = app_config(service)
    for group, _ in groups(service)[1:]:
        spec, container = group["template"]["spec"], ray_container(group)
        if config.deployment.handle_type == "fabric":
            [domain] = docs["ComputeDomain"]
            template = domain["spec"]["channel"]["resourceClaimTemplate"]["name"]
            claims = {c["name"]: c for c in spec["resourceClaims"]}
            [claim] = [c for c in claims.values() if c["resourceClaimTemplateName"] == template]
            assert {"name": claim["name"]} in container["resources"]["claims"]
        else:
            assert config.deployment.handle_type == "posix_fd" and "ComputeDomain" not in docs
            assert gpus(container) == config.deployment.peer_group_size
        capabilities = container.get("securityContext", {}).get("capabilities", {})
        assert not capabilities.get("add"), capabilities


def monitors(docs) -> tuple[dict, dict]:
    """(the PodMonitor of Ray's export on every pod, the one of the engines' endpoints)."""
    by_name = {m["metadata"]["name"]: m for m in docs["PodMonitor"]}
    name = rayservice(docs)["metadata"]["name"]
    assert set(by_name) == {name, f"{name}-engines"}
    return by_name[name], by_name[f"{name}-engines"]


def test_podmonitor_scrapes_every_ray_pod(manifest):
    _, docs = manifest
    service = rayservice(docs)
    monitor, _ = monitors(docs)
    selector = monitor["spec"]["selector"]["matchLabels"]
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert ports == {"metrics", "engram-sd"}  # Ray's export everywhere, the coordinator's
    for group, kind in groups(service):
        labels = group["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), kind
        named = {p["name"]: p["containerPort"] for p in ray_container(group)["ports"]}
        assert named["metrics"] == int(group["rayStartParams"]["metrics-export-port"])
        assert ("engram-sd" in named) == (kind == "head"), kind


def test_engine_metrics_ports_are_fixed_named_and_scraped(manifest):
    """Every engine slot of an engine pod (one engine per GPU) has its two container ports,
    named and numbered as the engines bind them (serving.metrics_port), and the engines'
    PodMonitor scrapes exactly those on exactly the engine pods; the head serves http_sd."""
    from engram_ray.metrics.exposition import ENDPOINTS, metrics_port, port_name

    _, docs = manifest
    service = rayservice(docs)
    srv = app_config(service).serving
    assert srv.metrics_port > 0 and srv.http_sd_port > 0
    assert srv.metrics_bind_address == "0.0.0.0"  # reachable from Prometheus' pod
    _, engines = monitors(docs)
    scraped = [e["port"] for e in engines["spec"]["podMetricsEndpoints"]]
    assert all(e["path"] == "/metrics" for e in engines["spec"]["podMetricsEndpoints"])
    selector = engines["spec"]["selector"]["matchLabels"]
    for group, kind in groups(service):
        container = ray_container(group)
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert len(named) == len(container["ports"]) == len(set(named.values())), kind
        labels = group["template"]["metadata"]["labels"]
        if kind == "head":
            assert named["engram-sd"] == srv.http_sd_port
            assert not selector.items() <= labels.items()  # no engines on the head
            continue
        assert selector.items() <= labels.items()
        expected = {port_name(s, e): metrics_port(srv.metrics_port, s, e)
                    for s in range(gpus(container)) for e in ENDPOINTS}
        assert {n: p for n, p in named.items() if n.startswith("engram-")} == expected
        assert sorted(scraped) == sorted(expected)


def test_every_scraped_target_gets_the_cluster_label(manifest):
    """Both PodMonitors give every endpoint's targets `cluster` = the RayService's name (the
    dashboards' $cluster): a literal replace with no source labels, ahead of any other rule
    (tests/cpu/metrics/test_metrics_discovery.py runs these rules in a real Prometheus)."""
    _, docs = manifest
    name = rayservice(docs)["metadata"]["name"]
    for monitor in monitors(docs):
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            rules = endpoint.get("relabelings", [])
            assert all(set(rule) <= RELABEL_CONFIG for rule in rules), rules
            cluster = [r for r in rules if r.get("targetLabel") == "cluster"]
            assert cluster == [{"targetLabel": "cluster", "replacement": name}], (
                monitor["metadata"]["name"], endpoint["port"])
            assert cluster[0].get("action", "replace") == "replace"


CHECKPOINT = KUBERAY / "checkpoint" / "engram_models.yaml"


def test_checkpoint_claim_is_filled_by_a_job_and_mounted_read_only(manifest):
    """#46 item 3: the models' claim is ReadWriteMany and filled by a Job of its own manifest
    (a step that can run), writing where serving.model_source points; the RayService mounts it
    read-only and does not create it (so it can be applied after the Job completed)."""
    _, docs = manifest
    checkpoint = docs_of(CHECKPOINT)
    [claim], [job] = checkpoint["PersistentVolumeClaim"], checkpoint["Job"]
    for doc in (claim, job):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert all(c["metadata"]["name"] != claim["metadata"]["name"]
               for c in docs.get("PersistentVolumeClaim", []))
    model_source = app_config(rayservice(docs)).serving.model_source
    pod = job["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"]
                if v["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]]
    [container] = pod["containers"]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert not mount.get("readOnly") and model_source.startswith(mount["mountPath"] + "/")
    assert f'local_dir="{model_source}"' in " ".join(container["command"])
    for group, kind in groups(rayservice(docs))[1:]:
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        [mount] = [m for m in ray_container(group)["volumeMounts"]
                   if model_source.startswith(m["mountPath"] + "/")]
        source = volumes[mount["name"]]["persistentVolumeClaim"]
        assert source == {"claimName": claim["metadata"]["name"], "readOnly": True}, kind
        assert mount.get("readOnly") is True, kind

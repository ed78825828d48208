"""Whether a Serve YAML's peer groups fit the cluster it is deployed on, and whether the paths
its engines read are in their containers (`engram-ray check SERVE --cluster CLUSTER`, and a
KubeRay RayService against its own `rayClusterConfig`).

The cluster is read from its file, not from Ray: a `ray up` file's worker node types
(`max_workers` nodes of `resources` GPU and CPU each; the local provider's `worker_ips`, with
the GPUs of `ray start --num-gpus=N`) or a RayCluster's worker groups (`maxReplicas` pods of
the container's `nvidia.com/gpu` and `cpu` limits). Its NVLink domains follow the hardware the
file asks for, as `engram-ray node-labels` will find it:

- nodes given an IMEX channel (a `ray up` docker option naming `nvidia-caps-imex-channels`, a
  pod claiming a DRA resource: a ComputeDomain's channel) are GB200/GB300 NVL72 trays, whose
  rack of MNNVL_RACK_GPUS GPUs is one domain, filled in order;
- every other node is a domain of its own GPUs (an HGX host).

The groups are then placed by the function the app places them with
(`engram_ray.planning.grouping.place_groups`), one front door after another.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from engram_ray.errors import ConfigError
from engram_ray.planning.grouping import NodeSlots, domains_of, place_groups
from engram_ray.serve.deploy.store_sharing import (container_gpus, container_resource,
                                                  ray_container, spans_hosts)

MNNVL_RACK_GPUS = 72  # one GB200/GB300 NVL72 rack: 18 trays of 4 GPUs, one NVLink domain
IMEX_DEVICE = "nvidia-caps-imex-channels"
_NUM_GPUS = re.compile(r"--num-gpus[= ]+[\"']?(\d+)")
_NUM_CPUS = re.compile(r"--num-cpus[= ]+[\"']?(\d+)")


@dataclass(frozen=True)
class Hosts:
    """`count` worker nodes of one kind, `gpus` and `cpus` each (None: not in the file)."""

    kind: str
    count: int
    gpus: int | None
    cpus: float | None
    fabric: bool  # the nodes' GPUs share a rack-wide NVLink fabric (IMEX)


def ray_up_hosts(data: dict) -> list[Hosts]:
    """The worker nodes a `ray up` file (schema-checked) can start."""
    docker = data.get("docker") or {}
    options = " ".join(map(str, (docker.get("run_options") or [])
                           + (docker.get("worker_run_options") or [])))
    starts = " ".join(data.get("worker_start_ray_commands") or [])
    if data["provider"].get("type") == "local":
        ips = data["provider"].get("worker_ips") or []
        count = min(len(ips), data.get("max_workers", len(ips)))
        gpus, cpus = _NUM_GPUS.search(starts), _NUM_CPUS.search(starts)
        return [Hosts("worker_ips", count, int(gpus[1]) if gpus else None,
                      float(cpus[1]) if cpus else None, IMEX_DEVICE in options)]
    hosts = []
    for name, node_type in (data.get("available_node_types") or {}).items():
        if name == data.get("head_node_type"):
            continue
        resources = node_type.get("resources") or {}
        own = (node_type.get("docker") or {}).get("worker_run_options") or []
        count = min(node_type.get("max_workers", 0), data.get("max_workers", 10**6))
        hosts.append(Hosts(f"node type {name}", count, resources.get("GPU"),
                           resources.get("CPU"), IMEX_DEVICE in options + " ".join(own)))
    return hosts


def _quantity(value) -> float | None:
    """A Kubernetes CPU quantity ('128', '500m', 16) in CPUs."""
    if value is None:
        return None
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def kuberay_hosts(cluster_spec: dict) -> list[Hosts]:
    """The worker pods of a RayCluster spec (a RayService's `rayClusterConfig`)."""
    hosts = []
    for group in cluster_spec.get("workerGroupSpecs") or []:
        spec = (group.get("template") or {}).get("spec") or {}
        container = ray_container(group.get("template") or {})
        count = group.get("maxReplicas", group.get("replicas", 0))
        hosts.append(Hosts(f"worker group {group.get('groupName', '?')}", int(count or 0),
                           container_gpus(container),
                           _quantity(container_resource(container, "cpu")),
                           bool(spec.get("resourceClaims"))))
    return hosts


def _nodes(hosts: list[Hosts], gpus_per_engine: float) -> list[NodeSlots]:
    """One NodeSlots per node, labelled with the domain node-labels would give it."""
    nodes, racks = [], 0
    for host in hosts:
        slots = int(host.gpus // gpus_per_engine) if host.gpus else 0
        per_rack = max(1, MNNVL_RACK_GPUS // host.gpus) if host.gpus else 1
        for idx in range(host.count):
            if host.fabric:
                label = f"rack-{racks + idx // per_rack}"
            else:
                label = f"host-{host.kind}-{idx}" if slots > 1 else None
            nodes.append(NodeSlots(f"{host.kind}-{idx}", label, slots, slots))
        if host.fabric:
            racks += -(-host.count // per_rack)
    return nodes


def _shape(hosts: list[Hosts]) -> str:
    return ", ".join(f"{h.kind}: {h.count} x {h.gpus} GPUs"
                     + (f" (NVL72 racks of {MNNVL_RACK_GPUS})" if h.fabric else "")
                     for h in hosts) or "no worker nodes"


def check_fit(apps: dict, hosts: list[Hosts], where: str, cluster: str) -> str:
    """Every GPU front door's groups placed in the cluster's domains, and its engines' CPUs on
    a node; ConfigError naming the front door and what does not fit. A summary for the OK
    line."""
    unknown = [h.kind for h in hosts if h.gpus is None]
    gpu_apps = {n: a for n, a in apps.items() if a.serving.device == "cuda"}
    if not gpu_apps:
        return f"; on {cluster}: no GPU engines"
    if unknown:
        raise ConfigError(f"{cluster}: {unknown[0]}", "says no GPU count, so the groups cannot "
                          "be checked against it", "resources: {GPU: N} on the node type, or "
                          "--num-gpus=N on the worker's `ray start` (local provider)")
    domains = None
    placed_total = 0
    for name, app in gpu_apps.items():
        dep, srv = app.deployment, app.serving
        for host in hosts:
            engines = int(host.gpus // dep.num_gpus_per_engine)
            if host.cpus is not None and engines * dep.num_cpus_per_engine > host.cpus:
                raise ConfigError(
                    f"{where}: application {name}: deployment.num_cpus_per_engine",
                    f"is {dep.num_cpus_per_engine:g}: {engines} engines of {host.kind} "
                    f"({cluster}) need {engines * dep.num_cpus_per_engine:g} CPUs, it has "
                    f"{host.cpus:g}", f"at most {host.cpus / max(engines, 1):g}")
        if domains is None:
            domains = domains_of(_nodes(hosts, dep.num_gpus_per_engine), dep.domain_label_key)
        placed, unplaced = place_groups(domains, dep.peer_group_size, srv.num_peer_groups)
        if unplaced:
            gpus = dep.peer_group_size * dep.num_gpus_per_engine
            largest = max((d.num_slots for d in domains if not d.is_isolated), default=0)
            raise ConfigError(
                f"{where}: application {name}: serving.num_peer_groups",
                f"is {srv.num_peer_groups} groups of {dep.peer_group_size} engines "
                f"({srv.num_peer_groups * gpus:g} GPUs): {unplaced} fit in no NVLink domain of "
                f"{cluster} ({_shape(hosts)}; {len(domains)} domains, the largest "
                f"{largest * dep.num_gpus_per_engine:g} GPUs)",
                f"at most {len(placed)} groups (and one group application each), or a cluster "
                "with room for every group")
        used = {}
        for group in placed:
            used[group.domain.domain_id] = used.get(group.domain.domain_id, 0) + group.size
        domains = [replace(d, num_slots=d.num_slots - used.get(d.domain_id, 0)) for d in domains]
        placed_total += len(placed)
    total = sum(h.count * h.gpus for h in hosts)
    free = sum(d.num_slots for d in domains)
    return (f"; fits {cluster}: {placed_total} group{'s' if placed_total != 1 else ''} in "
            f"{len(domains)} NVLink domain{'s' if len(domains) != 1 else ''}, "
            f"{free} of {total:g} GPU slots left")


_VOLUME = re.compile(r"(?:^|\s)(?:-v|--volume)[= ]\s*(\S+)")
_MOUNT = re.compile(r"--mount[= ]\s*(\S+)")


def docker_mounts(options: list) -> dict[str, bool]:
    """{container path: read-only} of the bind mounts in `docker run` options."""
    text = " " + " ".join(map(str, options))
    mounts = {}
    for spec in _VOLUME.findall(text):
        parts = spec.split(":")
        if len(parts) >= 2:
            mounts[parts[1].rstrip("/") or "/"] = len(parts) > 2 and "ro" in parts[2].split(",")
    for spec in _MOUNT.findall(text):
        fields = dict(f.split("=", 1) if "=" in f else (f, "true") for f in spec.split(","))
        target = fields.get("target") or fields.get("destination") or fields.get("dst")
        if target:
            flag = fields.get("readonly", fields.get("ro", "false"))
            mounts[target.rstrip("/") or "/"] = flag in ("true", "1")
    return mounts


def _mounted(mounts: dict[str, bool], path: str) -> tuple[str, bool] | None:
    path = path.rstrip("/")
    hits = [m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")]
    return (max(hits, key=len), mounts[max(hits, key=len)]) if hits else None


def check_ray_up_mounts(data: dict, apps: dict, hosts: list[Hosts], cluster: str,
                        where: str) -> None:
    """With `docker:` in a `ray up` file, each engine's container sees its model folder
    (`serving.model_source`), and where a group spans hosts the head's and every worker's
    containers see `peer_group_store`, writable: bind mounts in the docker run options."""
    docker = data.get("docker")
    if not docker:
        return
    common = list(docker.get("run_options") or [])
    workers = docker_mounts(common + list(docker.get("worker_run_options") or []))
    head = docker_mounts(common + list(docker.get("head_run_options") or []))
    gpus_per_host = max((h.gpus or 0 for h in hosts), default=0) or None
    for name, app in apps.items():
        dep, srv = app.deployment, app.serving
        source = srv.model_source
        if source.startswith("/") and _mounted(workers, source) is None:
            raise ConfigError(
                f"{where}: application {name}: serving.model_source",
                f"is {source}, which no bind mount of {cluster}'s docker run options puts in "
                "the workers' containers", f"a `-v HOST_PATH:{_parent(source)}:ro` in "
                "docker.run_options or worker_run_options, with the checkpoint on every node")
        reason = spans_hosts(dep, gpus_per_host)
        if reason is None:
            continue
        store = dep.peer_group_store
        for who, mounts in (("head", head), ("workers", workers)):
            hit = _mounted(mounts, store)
            if hit is None or hit[1]:
                raise ConfigError(
                    f"{where}: application {name}: deployment.peer_group_store",
                    f"is {store}, {'mounted read-only' if hit else 'not mounted'} in the "
                    f"{who}' containers by {cluster}'s docker run options, and {reason}",
                    f"a `-v SHARED_HOST_PATH:{_parent(store)}` (one shared file system, "
                    "writable) in docker.run_options")


def _parent(path: str) -> str:
    parts = path.rstrip("/").split("/")
    return "/".join(parts[:3]) if len(parts) > 3 else path

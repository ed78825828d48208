"""Whether a deployment's `peer_group_store` must be one folder shared by several hosts, and
whether a KubeRay manifest gives it one (`engram-ray check`).

Each member keeps what it needs on its own node (its holder socket; the generation folder is
made where it is used), so a node-local path (the default `/tmp/engram-ray/store`) serves every
group that stays on one host. The FileStore rendezvous of a group whose members run on several
hosts is one file all of them open: its path must be one shared folder, mounted at the same
place on every node of the group and on the head (the coordinator makes each generation's
folder there). A group spans hosts when it uses `handle_type: fabric` (IMEX: the only handle
type across hosts) or when it has more GPUs than one host.
"""

from __future__ import annotations

from engram_ray.errors import ConfigError

GPU_RESOURCE = "nvidia.com/gpu"


def spans_hosts(dep, gpus_per_host: int | None) -> str | None:
    """Why a group of deployment section `dep` runs on several hosts, or None when it does
    not (or, without `gpus_per_host`, when that is not known)."""
    if dep.handle_type == "fabric":
        return "handle_type fabric: a group's members run on several hosts"
    gpus = dep.peer_group_size * dep.num_gpus_per_engine
    if gpus_per_host and dep.num_gpus_per_engine and gpus > gpus_per_host:
        return f"a group's {gpus:g} GPUs are more than the {gpus_per_host} of one pod"
    return None


def serve_note(apps: dict) -> str:
    """For a Serve YAML alone (hosts unknown): where the store must be shared ('' when no
    group can span hosts: handle_type posix_fd, or the shm backend)."""
    def listed(names):
        return ", ".join(f"{n} ({apps[n].deployment.peer_group_store})" for n in names)

    must = [n for n, app in apps.items() if spans_hosts(app.deployment, None)]
    maybe = [n for n, app in apps.items() if app.deployment.handle_type is None
             and app.deployment.table_backend == "cuda"]
    note = ""
    if must:
        note += ("; peer_group_store must be one folder shared by the head and every node "
                 f"(handle_type fabric): {listed(must)}")
    if maybe:
        note += ("; peer_group_store must be one folder shared by the head and every node "
                 f"where a group's NVLink domain spans hosts (handle_type unset): {listed(maybe)}")
    return note


def ray_container(template: dict) -> dict:
    """A pod template's first container: Ray's (KubeRay's convention)."""
    return (((template.get("spec") or {}).get("containers")) or [{}])[0]


def container_resource(container: dict, resource: str):
    """What a pod's container asks of `resource`: its limit, else its request (None)."""
    resources = container.get("resources") or {}
    for kind in ("limits", "requests"):
        value = (resources.get(kind) or {}).get(resource)
        if value is not None:
            return value
    return None


def container_gpus(container: dict) -> int:
    """The GPUs a pod's container asks for (its nvidia.com/gpu limit, else request)."""
    return int(container_resource(container, GPU_RESOURCE) or 0)


def _claim(template: dict, path: str) -> str | None:
    """The persistentVolumeClaim whose mount in the pod's first (Ray) container holds `path`."""
    spec = template.get("spec") or {}
    containers = spec.get("containers") or [{}]
    mounts = sorted(((m.get("mountPath") or "").rstrip("/"), m.get("name"))
                    for m in containers[0].get("volumeMounts") or [])
    name = next((n for mount, n in reversed(mounts)
                 if mount and (path == mount or path.startswith(mount + "/"))), None)
    volume = next((v for v in spec.get("volumes") or [] if v.get("name") == name), {})
    return (volume.get("persistentVolumeClaim") or {}).get("claimName")


def check_kuberay_store(service: dict, apps: dict, where: str) -> str:
    """A RayService whose groups span pods must mount each app's `peer_group_store` from one
    persistentVolumeClaim in the head and every GPU worker group; ConfigError naming the app
    and what is missing otherwise. A note for the summary ('' when nothing is shared)."""
    spec = (service.get("spec") or {}).get("rayClusterConfig") or {}
    head = (spec.get("headGroupSpec") or {}).get("template") or {}
    workers = [(w.get("groupName", "?"), w.get("template") or {})
               for w in spec.get("workerGroupSpecs") or []]
    gpu_workers = [(name, t) for name, t in workers
                   if container_gpus(ray_container(t))]
    gpus_per_host = max((container_gpus(ray_container(t)) for _, t in gpu_workers), default=0)
    notes = []
    for name, app in apps.items():
        reason = spans_hosts(app.deployment, gpus_per_host or None)
        if reason is None:
            continue
        path = app.deployment.peer_group_store.rstrip("/")
        claims = {"head": _claim(head, path), **{f"worker group {n}": _claim(t, path)
                                                 for n, t in gpu_workers}}
        if None in claims.values() or len(set(claims.values())) != 1:
            missing = ", ".join(f"{pod}: {claim or 'no claim'}" for pod, claim in claims.items())
            raise ConfigError(f"{where}: application {name}: deployment.peer_group_store",
                              f"is {path}, not on one shared volume ({missing}), and {reason}",
                              "a path under one persistentVolumeClaim (ReadWriteMany) mounted "
                              "at the same place in the head and every GPU worker pod")
        notes.append(f"{name}: store shared on claim {next(iter(claims.values()))}")
    return f" ({'; '.join(notes)})" if notes else ""

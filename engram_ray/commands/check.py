"""`engram-ray check FILE...`: validate deployment files, telling their kind from the content:

- Serve (`serve deploy`) YAML (top-level `applications`): Ray Serve's schema, then every
  `engram_ray.serve.app:build_app` application's args through the checks `build_app` makes,
  and its groups' `build_group` applications (one each, the same settings);
- `ray up` cluster YAML (top-level `provider`): Ray's autoscaler schema and what engram-ray needs
  on the nodes (engram_ray.serve.deploy.cluster_configs);
- KubeRay manifest (one or more documents, one `kind: RayService`): each RayService's embedded
  `spec.serveConfigV2` through the same Serve checks, and each application's
  `peer_group_store` on one claim shared by the head and every GPU worker pod where its groups
  span pods (`engram_ray.serve.deploy.store_sharing`; a Serve YAML alone says where it must be),
  its groups against its own `rayClusterConfig` and its metrics ports against its containers'
  ports and PodMonitors (`engram_ray.serve.deploy.metrics_ports`).

Pairs (`--cluster CLUSTER`, a `ray up` file or a KubeRay manifest with a RayCluster or a
RayService): each Serve YAML is also checked against the cluster it will be deployed on: every
peer group placed in the cluster's NVLink domains, each node's engines within its CPUs, and with
`docker:` in a `ray up` file the model folder and a shared store mounted into the containers
(`engram_ray.serve.deploy.cluster_fit`).

One line per file, `OK FILE (kind: ...)` or `FAILED FILE: field: problem`; exit 1 if any failed.
"""

from __future__ import annotations

from engram_ray.config import DEFAULT_DOMAIN_LABEL_KEY
from engram_ray.errors import ConfigError, EngramRayError

HELP = "validate Serve YAMLs, `ray up` files and KubeRay RayService manifests (kind from content)"
FAILED = 1


def configure(parser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="YAML files to check")
    parser.add_argument("--label-key", default=DEFAULT_DOMAIN_LABEL_KEY,
                        help="NVLink-domain node label the `ray up` files must set")
    parser.add_argument("--cluster", metavar="CLUSTER",
                        help="the `ray up` file or KubeRay RayCluster/RayService manifest the "
                             "Serve YAMLs are deployed on: their groups must fit it")


def run(args) -> int:
    failed = 0
    for path in args.files:
        try:
            try:
                summary = check_file(path, args.label_key, args.cluster)
            except ImportError as exc:  # `pip install engram-ray` without an extra: no Ray
                raise EngramRayError(f"checking needs Ray Serve's schemas ({exc}); install "
                                     "engram-ray[cpu] or engram-ray[gpu]") from None
        except EngramRayError as exc:
            failed += 1
            message = str(exc)
            print(f"FAILED {message if message.startswith(path) else f'{path}: {message}'}",
                  flush=True)
        else:
            print(f"OK {path} ({summary})", flush=True)
    return FAILED if failed else 0


def _documents(path: str) -> list:
    import yaml

    try:
        with open(path) as f:
            return [d for d in yaml.safe_load_all(f) if d is not None]
    except OSError as exc:
        raise ConfigError(path, f"cannot be read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        problem = " ".join(str(exc).split())
        raise ConfigError(path, f"is not valid YAML ({problem})") from None


def kind_of(docs: list) -> str:
    """'kuberay', 'serve' or 'ray-up' from the documents' content."""
    if any(isinstance(d, dict) and "kind" in d and "apiVersion" in d for d in docs):
        return "kuberay"
    if len(docs) == 1 and isinstance(docs[0], dict):
        if "applications" in docs[0]:
            return "serve"
        if "provider" in docs[0]:
            return "ray-up"
    raise ConfigError("top level", "is none of the kinds engram-ray checks",
                      "a Serve YAML (applications:), a `ray up` file (provider:) or a KubeRay "
                      "manifest (apiVersion: ray.io/v1, kind: RayService)")


def _apps(apps: dict) -> str:
    """The front doors, each with its groups' applications."""
    return f"application{'s' if len(apps) != 1 else ''} " + ", ".join(
        f"{name} + {config.serving.num_peer_groups} group application"
        f"{'s' if config.serving.num_peer_groups != 1 else ''}" for name, config in apps.items())


def check_file(path: str, label_key: str = DEFAULT_DOMAIN_LABEL_KEY,
               cluster: str | None = None) -> str:
    """Validate one file (a Serve YAML against `cluster` too, when given); a one-line summary
    if it passes, else ConfigError naming the field."""
    from engram_ray.serve.deploy.cluster_configs import check_ray_up_config, check_serve_config

    docs = _documents(path)
    try:
        kind = kind_of(docs)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc.field}", exc.problem, exc.expected) from None
    if kind == "serve":
        from engram_ray.serve.deploy.store_sharing import serve_note

        apps = check_serve_config(docs[0], path)
        fit = _check_pair(apps, path, cluster, label_key) if cluster else ""
        return f"Serve: {_apps(apps)}{serve_note(apps)}{fit}"
    if kind == "ray-up":
        check_ray_up_config(docs[0], path, label_key)
        data = docs[0]
        return (f"ray up: cluster {data.get('cluster_name', '?')}, provider "
                f"{data['provider'].get('type', '?')}")
    return _check_kuberay(path, docs)


def _check_pair(apps: dict, path: str, cluster: str, label_key: str) -> str:
    """The Serve YAML's apps against the cluster file: groups placed, containers' mounts."""
    from engram_ray.serve.deploy import cluster_fit
    from engram_ray.serve.deploy.cluster_configs import check_ray_up_config

    docs = _documents(cluster)
    try:
        kind = kind_of(docs)
    except ConfigError as exc:
        raise ConfigError(f"--cluster {cluster}: {exc.field}", exc.problem,
                          "a `ray up` file or a KubeRay manifest with a RayCluster or "
                          "RayService") from None
    if kind == "ray-up":
        check_ray_up_config(docs[0], cluster, label_key)
        hosts = cluster_fit.ray_up_hosts(docs[0])
        cluster_fit.check_ray_up_mounts(docs[0], apps, hosts, cluster, path)
        return cluster_fit.check_fit(apps, hosts, path, cluster)
    specs = [((d.get("spec") or {}).get("rayClusterConfig") if d.get("kind") == "RayService"
              else d.get("spec")) for d in docs
             if isinstance(d, dict) and d.get("kind") in ("RayService", "RayCluster")]
    if len(specs) != 1 or not isinstance(specs[0], dict):
        raise ConfigError(f"--cluster {cluster}", f"holds {len(specs)} RayCluster or "
                          "RayService documents with a cluster spec", "exactly one")
    return cluster_fit.check_fit(apps, cluster_fit.kuberay_hosts(specs[0]), path, cluster)


def _check_kuberay(path: str, docs: list) -> str:
    import yaml

    from engram_ray.serve.deploy import cluster_fit
    from engram_ray.serve.deploy.cluster_configs import check_serve_config
    from engram_ray.serve.deploy.metrics_ports import check_kuberay_ports
    from engram_ray.serve.deploy.store_sharing import check_kuberay_store

    services = [(i, d) for i, d in enumerate(docs)
                if isinstance(d, dict) and d.get("kind") == "RayService"]
    if not services:
        kinds = ", ".join(sorted({str(d.get("kind")) for d in docs if isinstance(d, dict)}))
        raise ConfigError(f"{path}: kind", f"no RayService among the documents ({kinds})",
                          "one document with kind: RayService")
    summaries = []
    for idx, service in services:
        name = (service.get("metadata") or {}).get("name", f"document {idx}")
        where = f"{path}: RayService {name}: spec.serveConfigV2"
        text = (service.get("spec") or {}).get("serveConfigV2")
        if not isinstance(text, str):
            raise ConfigError(where, "is missing" if text is None else "is not a string",
                              "the Serve YAML as a string (serveConfigV2: |)")
        try:
            serve = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(where, f"is not valid YAML ({' '.join(str(exc).split())})") from None
        if not isinstance(serve, dict):
            raise ConfigError(where, f"holds a {type(serve).__name__}", "a YAML mapping")
        apps = check_serve_config(serve, where)
        store = check_kuberay_store(service, apps, where)
        ports = check_kuberay_ports(service, docs, apps, where)
        hosts = cluster_fit.kuberay_hosts((service.get("spec") or {}).get("rayClusterConfig")
                                          or {})
        fit = cluster_fit.check_fit(apps, hosts, where, "its rayClusterConfig")
        summaries.append(f"{name}: {_apps(apps)}{store}{ports}{fit}")
    return f"KubeRay RayService {'; '.join(summaries)}"

"""Exposition of engram-ray metrics: a `/metrics` HTTP endpoint per engine process, the
Prometheus file_sd target list, the HTTP service-discovery endpoint (`TargetsServer`), and the
hook that gives vLLM's model process (where lookups run) its own endpoint. Series are defined in
`engram_ray.metrics.engine`.

Ports (`serving.metrics_port`): 0 gives every endpoint a free port, found through the file_sd
list or the HTTP service discovery. A base port P > 0 gives the engine in slot s of its node
(the coordinator hands out slots 0, 1, ... per node: one engine per GPU) two fixed, named
ports, the same on every node, for a Kubernetes container port list and a PodMonitor:

    P + 2s      engram-<s>        the Serve replica's endpoint (engram_* and vllm:* series)
    P + 2s + 1  engram-<s>-model  vLLM's model process: the lookups (engram_lookup_*)
"""

from __future__ import annotations

import errno
import json
import os
import tempfile

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

from engram_ray.errors import ConfigError
from engram_ray.metrics.engine import EngineIdentity, EngineMetrics
from engram_ray.private_dirs import is_shared_tmp, private_dir

DEFAULT_BIND_ADDRESS = "127.0.0.1"
# `serving.metrics_bind_address` default: this node's own address as Ray reports it (what
# Prometheus scrapes on a cluster), not every interface; 0.0.0.0 only when configured.
NODE_ADDRESS = "node"
# vLLM `additional_config` key telling the model process where to report lookups.
PROCESS_METRICS_KEY = "engram_metrics"
METRICS_PORT_FIX = ("another serving.metrics_port (base port P: the engine in slot s of a node "
                    "binds P + 2s and P + 2s + 1), or 0 (free ports, found through file_sd or "
                    "serving.http_sd_port)")
ENDPOINTS = ("replica", "model")  # the two endpoints of one engine, in port order


def metrics_port(base: int, slot: int, endpoint: str) -> int:
    """Fixed port of `endpoint` ('replica' or 'model') of the engine in `slot` of its node;
    0 (a free port) when `base` is 0."""
    return base + 2 * slot + ENDPOINTS.index(endpoint) if base else 0


MAX_SLOTS = 100  # engine slots of one node that can have fixed ports (port_name: 15 characters)


def fixed_ports(base: int) -> range:
    """Every port the engines of a node may bind with `serving.metrics_port` `base` (empty
    for 0): a free port taken for anything else must not be one of them."""
    return range(base, metrics_port(base, MAX_SLOTS, ENDPOINTS[0])) if base else range(0)


def port_name(slot: int, endpoint: str) -> str:
    """Kubernetes port name of that endpoint (at most 15 characters: slots up to 99)."""
    return f"engram-{slot}" if endpoint == "replica" else f"engram-{slot}-model"


def bind_host(bind_address: str, node_ip: str | None = None) -> str:
    """The address to listen on: `bind_address` as given, or for NODE_ADDRESS `node_ip` (the
    replica passes `ray.util.get_node_ip_address()`), else this Ray node's address."""
    if bind_address != NODE_ADDRESS:
        return bind_address
    if node_ip:
        return node_ip
    import ray  # only here: the model process passes node_ip and never needs Ray

    return ray.util.get_node_ip_address()


def scrape_target(bind_address: str, port: int, advertise_host: str | None = None) -> str:
    """`host:port` for Prometheus: the bind address, or `advertise_host` (this node's IP)
    when bound to all addresses."""
    host = bind_address
    if host in ("0.0.0.0", "::", ""):
        host = advertise_host or "127.0.0.1"
    return f"{host}:{port}"


class _ProcessRegistry:
    """Collector forwarding the process's default registry (vLLM's `vllm:*` series)."""

    def collect(self):
        return REGISTRY.collect()


class MetricsServer:
    """`/metrics` over HTTP for one or more registries; port 0 picks a free port."""

    def __init__(self, registries, bind_address: str = DEFAULT_BIND_ADDRESS, port: int = 0,
                 include_process_registry: bool = True, advertise_host: str | None = None):
        self.registry = CollectorRegistry(auto_describe=False)
        for registry in registries:
            self.registry.register(registry)
        if include_process_registry:
            self.registry.register(_ProcessRegistry())
        bind_address = bind_host(bind_address, advertise_host)
        try:
            self._server, self._thread = start_http_server(port, addr=bind_address,
                                                           registry=self.registry)
        except OSError as exc:
            if not port or exc.errno != errno.EADDRINUSE:
                raise
            # A fixed port comes from serving.metrics_port (base + 2 * slot [+ 1]).
            raise ConfigError("serving.metrics_port", f"gives this engine port {port}, but "
                              f"{bind_address}:{port} is taken on this node (by an engine "
                              "that has not stopped yet, or another program)",
                              METRICS_PORT_FIX) from exc
        self.bind_address, self.advertise_host = bind_address, advertise_host
        self.port = self._server.server_port

    @property
    def target(self) -> str:
        return scrape_target(self.bind_address, self.port, self.advertise_host)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def target_groups(targets: dict[str, dict]) -> list[dict]:
    """Prometheus target groups (the file_sd and http_sd format) of `targets`: key ->
    {"target": "host:port", "labels": {...}}; one group per target so each keeps its labels."""
    return [{"targets": [entry["target"]], "labels": dict(entry.get("labels", {}))}
            for _, entry in sorted(targets.items())]


def write_file_sd(path: str, targets: dict[str, dict]) -> None:
    """Write a Prometheus file_sd list atomically (`target_groups`). Prometheus re-reads the
    file on change (inotify), no restart."""
    groups = target_groups(targets)
    directory = os.path.dirname(os.path.abspath(path))
    if is_shared_tmp(directory):  # anyone could have made it first: it must be ours alone
        private_dir(directory, "serving.prometheus_targets_file folder")
    else:  # the operator's folder is left as made (created 0700 when missing); the list
        # itself is 0600 (mkstemp): Prometheus reads it as this user (docs/operators.md)
        os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".engram_sd.", suffix=".json")
    with os.fdopen(fd, "w") as out:
        json.dump(groups, out, indent=1)
    os.replace(tmp, path)


class TargetsServer:
    """The coordinator's HTTP endpoint: GET `/targets` answers the target groups `get_groups()`
    returns, as JSON (Prometheus `http_sd_configs`; only when `get_groups` is given), GET
    `/metrics` the series of `registry` (the coordinator's own, `engram_ray.metrics.coordinator`;
    only when given); anything else is a 404. Port 0 picks a free port. Runs in a daemon thread
    of its owner (the coordinator)."""

    PATH = "/targets"
    METRICS_PATH = "/metrics"

    def __init__(self, get_groups, bind_address: str = DEFAULT_BIND_ADDRESS, port: int = 0,
                 registry=None, avoid: range = range(0)):
        import http.server
        import threading

        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        paths = [p for p, on in ((TargetsServer.PATH, get_groups),
                                 (TargetsServer.METRICS_PATH, registry)) if on is not None]

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                path = self.path.split("?")[0]
                if path == TargetsServer.PATH and get_groups is not None:
                    body, kind = json.dumps(get_groups()).encode(), "application/json"
                elif path == TargetsServer.METRICS_PATH and registry is not None:
                    body, kind = generate_latest(registry), CONTENT_TYPE_LATEST
                else:
                    self.send_error(404, f"only {' and '.join(paths)}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # Prometheus asks every refresh_interval
                pass

        bind_address = bind_host(bind_address)
        if port:
            try:
                self._server = http.server.ThreadingHTTPServer((bind_address, port), Handler)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                raise ConfigError("serving.http_sd_port", f"is {port}, but "
                                  f"{bind_address}:{port} is taken on the head node",
                                  "another port, or 0 for none") from exc
        else:
            self._server = _bind_free(lambda p: http.server.ThreadingHTTPServer(
                (bind_address, p), Handler), bind_address, avoid)
        self._server.daemon_threads = True
        self.bind_address = bind_address
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="engram-http-sd")
        self._thread.start()

    def target(self, advertise_host: str | None = None) -> str:
        return scrape_target(self.bind_address, self.port, advertise_host)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


FREE_PORT_TRIES = 100


def _bind_free(make, bind_address: str, avoid: range):
    """`make(port)`'s server on a free port that is not in `avoid` (the engines' fixed ports:
    the OS may hand one out while its engine is not running, and the engine then finds it
    taken; seen in test_faults, a new gang's engine against the coordinator's port). The
    OS's choice when it is outside `avoid`, else random ports of its free-port range."""
    import random

    server = make(0)
    if server.server_address[1] not in avoid:
        return server
    server.server_close()
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except OSError:
        low, high = 32768, 60999  # Linux's default
    for _ in range(FREE_PORT_TRIES):
        candidate = random.randint(low, high)
        if candidate in avoid:
            continue
        try:
            return make(candidate)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
    raise ConfigError("serving.metrics_port", f"is {avoid.start}: no free port on "
                      f"{bind_address} outside the engines' fixed ports {avoid.start}-"
                      f"{avoid.stop - 1} in {FREE_PORT_TRIES} tries",
                      "serving.http_sd_port set, or a metrics_port outside the OS's range of "
                      "free ports (9500, as shipped)")


def start_process_metrics(additional_config) -> EngineMetrics | None:
    """In vLLM's model process (where lookups run): this engine's metrics on their own
    `/metrics` endpoint, whose `host:port` is written to `target_file` so the Serve replica
    registers it as a Prometheus target. None when `additional_config` has no
    `engram_metrics` entry (the engine was not started by the Serve app).

    `additional_config["engram_metrics"]`: model, engine, peer_group, rank, bind_address,
    advertise_host, target_file, port (fixed, or 0/absent for a free one). Tables opened
    with it (`engram_ray.tables.table.open_group_tables(..., metrics=...)`) feed it.
    """
    raw = (additional_config or {}).get(PROCESS_METRICS_KEY)
    if not raw:
        return None
    metrics = EngineMetrics(EngineIdentity(raw["model"], raw["engine"], raw["peer_group"],
                                           int(raw["rank"])))
    metrics.server = MetricsServer([metrics.registry], raw.get("bind_address",
                                                               DEFAULT_BIND_ADDRESS),
                                   int(raw.get("port") or 0), include_process_registry=False,
                                   advertise_host=raw.get("advertise_host"))
    # Private: a target planted there would be scraped and labelled as an engine.
    directory = private_dir(os.path.dirname(os.path.abspath(raw["target_file"])),
                            "model metrics targets folder")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".engram_target.")
    with os.fdopen(fd, "w") as out:
        json.dump({"target": metrics.server.target, "pid": os.getpid()}, out)
    os.replace(tmp, raw["target_file"])
    return metrics

"""Exposition of engram-ray metrics: a `/metrics` HTTP endpoint per engine process, the
Prometheus file_sd target list, and the hook that gives vLLM's model process (where lookups run)
its own endpoint. Series are defined in `engram_ray.metrics`.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

from engram_ray.errors import ConfigError
from engram_ray.metrics import EngineIdentity, EngineMetrics

DEFAULT_BIND_ADDRESS = "127.0.0.1"
# vLLM `additional_config` key telling the model process where to report lookups.
PROCESS_METRICS_KEY = "engram_metrics"
METRICS_PORT_FIX = ("metrics_port 0 (each engine picks a free port and registers it as a "
                    "Prometheus target), or a fixed port only with one engine per node")


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
        try:
            self._server, self._thread = start_http_server(port, addr=bind_address,
                                                           registry=self.registry)
        except OSError as exc:
            if not port or exc.errno != errno.EADDRINUSE:
                raise
            # A fixed port is serving.metrics_port (the other endpoints use 0): a second
            # engine on this node, where the config could not tell engines per node.
            raise ConfigError("serving.metrics_port", f"is {port}, but {bind_address}:{port} "
                              "is taken on this node (by an engine started here before, or "
                              "another program)", METRICS_PORT_FIX) from exc
        self.bind_address, self.advertise_host = bind_address, advertise_host
        self.port = self._server.server_port

    @property
    def target(self) -> str:
        """`host:port` for Prometheus: the bind address, or `advertise_host` (this node's IP)
        when bound to all addresses."""
        host = self.bind_address
        if host in ("0.0.0.0", "::", ""):
            host = self.advertise_host or "127.0.0.1"
        return f"{host}:{self.port}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def write_file_sd(path: str, targets: dict[str, dict]) -> None:
    """Write a Prometheus file_sd list atomically.

    `targets`: key -> {"target": "host:port", "labels": {...}}; one group per target so each
    keeps its own labels. Prometheus re-reads the file on change (inotify), no restart.
    """
    groups = [{"targets": [entry["target"]], "labels": dict(entry.get("labels", {}))}
              for _, entry in sorted(targets.items())]
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".engram_sd.", suffix=".json")
    with os.fdopen(fd, "w") as out:
        json.dump(groups, out, indent=1)
    os.replace(tmp, path)


def start_process_metrics(additional_config) -> EngineMetrics | None:
    """In vLLM's model process (where lookups run): this engine's metrics on their own
    `/metrics` endpoint, whose `host:port` is written to `target_file` so the Serve replica
    registers it as a Prometheus target. None when `additional_config` has no
    `engram_metrics` entry (the engine was not started by the Serve app).

    `additional_config["engram_metrics"]`: model, engine, peer_group, rank, bind_address,
    advertise_host, target_file. Feed lookups with `metered_lookup(metrics, tables, ...)`.
    """
    raw = (additional_config or {}).get(PROCESS_METRICS_KEY)
    if not raw:
        return None
    metrics = EngineMetrics(EngineIdentity(raw["model"], raw["engine"], raw["peer_group"],
                                           int(raw["rank"])))
    metrics.server = MetricsServer([metrics.registry], raw.get("bind_address",
                                                               DEFAULT_BIND_ADDRESS),
                                   include_process_registry=False,
                                   advertise_host=raw.get("advertise_host"))
    directory = os.path.dirname(os.path.abspath(raw["target_file"]))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".engram_target.")
    with os.fdopen(fd, "w") as out:
        json.dump({"target": metrics.server.target, "pid": os.getpid()}, out)
    os.replace(tmp, raw["target_file"])
    return metrics

"""Run a real Prometheus on 127.0.0.1 and query it: used by tests and `engram-ray local`.

The binary is the Debian package's `prometheus` (scripts/setup.sh installs it).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from engram_ray.errors import EngramRayError

CLUSTER_LABEL = "cluster"
LOCAL_CLUSTER = "local"  # the `cluster` label of the local deployment's targets


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_port_block(num_ports: int, host: str = "127.0.0.1") -> int:
    """A base port P with P .. P + num_ports - 1 free on `host` (fixed metrics ports)."""
    import contextlib

    for _ in range(50):
        base = free_port(host)
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + num_ports):
                    sock = held.enter_context(socket.socket())
                    sock.bind((host, port))
            except OSError:
                continue
        return base
    raise EngramRayError(f"no {num_ports} consecutive free ports on {host}")


def with_cluster(config: dict, cluster: str) -> dict:
    """`config` with every scrape job setting the target label `cluster` to `cluster` (the
    dashboards' `$cluster` variable), replacing a `cluster` rule it had. A target label, not an
    external label: Prometheus adds external labels only on the way out (federation, remote
    write, Alertmanager), so its own queries, and Grafana's through it, would not see them."""
    if not isinstance(cluster, str) or not cluster.strip():
        raise EngramRayError(f"cluster: is {cluster!r}, expected a non-empty name (the value "
                             "of the `cluster` label on every target)")
    for job in config["scrape_configs"]:
        rules = [r for r in job.get("relabel_configs", ())
                 if r.get("target_label") != CLUSTER_LABEL]
        job["relabel_configs"] = [{"target_label": CLUSTER_LABEL, "replacement": cluster},
                                  *rules]
    return config


def scrape_config(base: Path, engram_sd: str, ray_sd: str | None, interval: str,
                  cluster: str = LOCAL_CLUSTER) -> dict:
    """`base` (dashboards/prometheus.yml) with its file_sd paths and intervals replaced, every
    target labelled `cluster` (`with_cluster`) and its rule files made absolute (the config is
    written elsewhere; Prometheus reads rule files relative to the config file and takes a glob
    matching nothing as no rules)."""
    config = yaml.safe_load(base.read_text())
    config["rule_files"] = [str(base.parent / f) for f in config.get("rule_files", ())]
    config["global"].update(scrape_interval=interval, evaluation_interval=interval)
    jobs = []
    for job in config["scrape_configs"]:
        path = engram_sd if job["job_name"] == "engram" else ray_sd
        if path is None:
            continue
        job["file_sd_configs"] = [{"files": [path], "refresh_interval": interval}]
        jobs.append(job)
    config["scrape_configs"] = jobs
    return with_cluster(config, cluster)


class Prometheus:
    """A Prometheus process with a temporary TSDB; `stop()` ends it and removes the TSDB."""

    def __init__(self, config: dict, port: int | None = None, workdir: str | None = None):
        binary = shutil.which("prometheus")
        if binary is None:
            raise EngramRayError("prometheus not found on PATH (expected the Debian package "
                                 "`prometheus`; run bash scripts/setup.sh)")
        self.dir = Path(tempfile.mkdtemp(prefix="engram-prom-", dir=workdir))
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(self.dir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.dir / 'prometheus.yml'}",
             f"--web.listen-address=127.0.0.1:{self.port}",
             f"--storage.tsdb.path={self.dir / 'tsdb'}", "--storage.tsdb.retention.time=1h"],
            stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngramRayError(f"prometheus exited with {self.proc.returncode}: "
                                     f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise EngramRayError(f"prometheus not ready after {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, num_chars: int = 2000) -> str:
        path = self.dir / "prometheus.log"
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""

    def api(self, endpoint: str, **params) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{endpoint}?{query}", timeout=10) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise EngramRayError(f"prometheus query {params} failed: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant-query result vector (a list of {metric, value})."""
        return self.api("query", query=expr)["result"]

    def active_targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

"""Metrics discovery for Kubernetes and Prometheus Operator: fixed, named ports per engine slot
(`serving.metrics_port` base + 2 * slot), the coordinator's slots per node, and the HTTP
service-discovery endpoint (`serving.http_sd_port`) found by a real Prometheus (127.0.0.1)."""

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from engram_ray.errors import ConfigError
from engram_ray.local.prometheus import Prometheus, free_port
from engram_ray.metrics.exposition import (MetricsServer, TargetsServer, metrics_port, port_name,
                                           target_groups, write_file_sd)
from engram_ray.serve.deploy.cluster_configs import load_serve_config, read_yaml

CONFIGS = Path(__file__).resolve().parents[3] / "cluster_configs"
# Kubernetes' IANA_SVC_NAME: 1-15 lowercase letters, digits and single inner hyphens.
PORT_NAME = re.compile(r"^(?=.{1,15}$)(?=.*[a-z])[a-z0-9]+(-[a-z0-9]+)*$")


def test_fixed_ports_are_base_plus_two_per_slot_and_named():
    assert [metrics_port(9500, s, e) for s in (0, 1, 7) for e in ("replica", "model")] == [
        9500, 9501, 9502, 9503, 9514, 9515]
    assert metrics_port(0, 3, "replica") == metrics_port(0, 3, "model") == 0  # free ports
    assert port_name(0, "replica") == "engram-0" and port_name(7, "model") == "engram-7-model"
    for slot in (0, 9, 99):
        for endpoint in ("replica", "model"):
            assert PORT_NAME.match(port_name(slot, endpoint)), port_name(slot, endpoint)


def test_taken_fixed_port_is_refused_naming_it():
    first = MetricsServer([], "127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError) as info:
            MetricsServer([], "127.0.0.1", first.port)
        message = str(info.value)
        assert message.startswith(f"serving.metrics_port: gives this engine port {first.port}, "
                                  f"but 127.0.0.1:{first.port} is taken on this node")
        assert "P + 2s" in message
        with pytest.raises(ConfigError, match=f"http_sd_port: is {first.port}, but"):
            TargetsServer(list, "127.0.0.1", first.port)
    finally:
        first.stop()


def test_ports_are_checked_in_the_config():
    from engram_ray.serve.settings.config import ServingConfig

    for name in ("metrics_port", "http_sd_port"):
        for bad in (-1, 70000, 1.5):
            with pytest.raises(ConfigError, match=name):
                ServingConfig(**{name: bad})
    # Slots make a fixed base port fine for CPU engines sharing a node, too (refused before).
    import copy

    from engram_ray.serve.deploy.cluster_configs import check_serve_config, read_yaml

    data = copy.deepcopy(read_yaml(CONFIGS / "serve_local_tiny.yaml"))
    for app in data["applications"]:  # the front door's and the group's (one anchor)
        app["args"]["serving"]["metrics_port"] = 9500
    (app,) = check_serve_config(data, "local.yaml").values()
    assert app.deployment.peer_group_size == 2 and app.serving.metrics_port == 9500


def test_targets_server_answers_only_its_path():
    groups = [{"targets": ["127.0.0.1:1"], "labels": {"endpoint": "engram-0"}}]
    server = TargetsServer(lambda: groups, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/targets", timeout=5) as r:
            assert r.headers["Content-Type"] == "application/json"
            assert json.load(r) == groups
        for path in ("/other", "/metrics"):  # no registry: no /metrics
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5)
            assert info.value.code == 404
    finally:
        server.stop()


def test_a_coordinator_without_http_sd_serves_only_its_metrics():
    """http_sd_port 0: the coordinator's endpoint is a free port with /metrics alone."""
    from engram_ray.metrics.coordinator import SERIES, CoordinatorMetrics, CoordinatorSnapshot

    snap = CoordinatorSnapshot(groups_configured=3, groups_serving=2, groups_rolling=0,
                               roll_members=6, roll_members_done=4, roll_stopped=False,
                               start_time=1.5e9, restarted=True)
    metrics = CoordinatorMetrics("m", "d", lambda: snap)
    server = TargetsServer(None, "127.0.0.1", 0, registry=metrics.registry)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        values = dict(re.findall(r'^(engram_\w+)\{deployment="d",model="m"\} (\S+)$', text,
                                 re.M))
        assert set(values) == set(SERIES)
        assert float(values["engram_roll_in_progress"]) == 1  # 2 members to go
        assert float(values["engram_groups_serving"]) == 2
        assert float(values["engram_coordinator_restarted"]) == 1
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/targets", timeout=5)
        assert info.value.code == 404
        assert server.target() == f"127.0.0.1:{server.port}"
    finally:
        server.stop()


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def test_prometheus_finds_engines_through_http_sd(tmp_path):
    """A real Prometheus with only an `http_sd_configs` job scrapes two engine endpoints on
    fixed ports with the endpoint label, then drops the one that leaves."""
    from prometheus_client import CollectorRegistry, Gauge

    base = free_port()
    registries = []
    for slot in range(2):
        registry = CollectorRegistry()
        Gauge("engram_test_slot", "slot of this endpoint", registry=registry).set(slot)
        registries.append(registry)
    servers, targets, sd = [], {}, None
    prom = None
    try:
        for slot, registry in enumerate(registries):
            try:
                servers.append(MetricsServer([registry], "127.0.0.1",
                                             metrics_port(base, slot, "replica"),
                                             include_process_registry=False))
            except ConfigError:
                pytest.skip("a port next to a free one was taken")
            targets[f"r{slot}"] = {"target": servers[-1].target, "labels": {
                "endpoint": port_name(slot, "replica"), "__meta_engram_slot": str(slot)}}
        assert [s.port for s in servers] == [base, base + 2]
        sd = TargetsServer(lambda: target_groups(targets), "127.0.0.1", 0)
        prom = Prometheus({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{
                "job_name": "engram",
                "http_sd_configs": [{"url": f"http://127.0.0.1:{sd.port}/targets",
                                     "refresh_interval": "1s"}],
                # __meta_* labels are there for relabeling only
                "relabel_configs": [{"source_labels": ["__meta_engram_slot"],
                                     "target_label": "slot"}]}]}, workdir=str(tmp_path))

        def up():
            found = [t for t in prom.active_targets() if t["health"] == "up"]
            return found if len(found) == 2 else None

        found = _wait(up, 30, f"two targets up; log: {prom.log_tail()}")
        assert sorted(t["labels"]["endpoint"] for t in found) == ["engram-0", "engram-1"]
        assert sorted(t["scrapeUrl"] for t in found) == [
            f"http://127.0.0.1:{base}/metrics", f"http://127.0.0.1:{base + 2}/metrics"]
        result = _wait(lambda: prom.query("engram_test_slot") or None, 30, "series")
        by_slot = {r["metric"]["slot"]: float(r["value"][1]) for r in result}
        assert by_slot == {"0": 0.0, "1": 1.0}
        assert all("exported_endpoint" not in r["metric"] for r in result)

        del targets["r1"]
        _wait(lambda: len(prom.active_targets()) == 1, 30, "r1 dropped")
    finally:
        if prom is not None:
            prom.stop()
        if sd is not None:
            sd.stop()
        for server in servers:
            server.stop()


def _coordinator_series(port: int) -> dict[str, float]:
    """The coordinator's own series at its endpoint, {name: value} (one sample each)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels == {"model": "deepseek-v4.1-flash", "deployment": "slots"}
            series[sample.name] = sample.value
    return series


def test_coordinator_slots_per_node_and_its_http_sd(ray_local, tmp_path):
    """Slots are the lowest free per node, kept on a second ask, freed on leave and when a
    gang ends; the coordinator serves its targets as http_sd (and file_sd) lists, itself among
    them, and its own series (#46 item 5) on the same port: groups configured and serving,
    the roll's members."""
    ray = ray_local
    from engram_ray.actors.coordinator_lookup import get_coordinator

    raw = next(iter(load_serve_config(CONFIGS / "serve_local_tiny.yaml").values())).to_dict()
    raw["deployment"].update(peer_group_store=str(tmp_path / "store"), name="slots",
                             model="deepseek-v4.1-flash")
    sd_port = free_port()
    raw["serving"].update(prometheus_targets_file=str(tmp_path / "targets.json"),
                          metrics_bind_address="127.0.0.1", http_sd_port=sd_port)
    coordinator = get_coordinator(raw, {"group-0": "node-a"}, "slots")
    try:
        for r in (0, 1):
            ray.get(coordinator.join.remote("group-0", "gang1", r, 2, f"m{r}"))
        slot = coordinator.metrics_slot.remote
        # One ask at a time: the coordinator is a threaded actor (max_concurrency=16), so calls
        # sent together may run in any order, and "lowest free" depends on the order.
        asks = [("m0", "node-x"), ("m1", "node-x"), ("m0", "node-x"), ("m1", "node-y")]
        assert [ray.get(slot(*ask)) for ask in asks] == [0, 1, 0, 0]
        ray.get(coordinator.register_target.remote("m0", "127.0.0.1:9500",
                                                   {"endpoint": "engram-0"}))
        ray.get(coordinator.register_target.remote("m0/model", "127.0.0.1:9501",
                                                   {"endpoint": "engram-0-model"}))
        expected = [{"targets": [f"127.0.0.1:{sd_port}"], "labels": {"endpoint": "coordinator"}},
                    {"targets": ["127.0.0.1:9500"], "labels": {"endpoint": "engram-0"}},
                    {"targets": ["127.0.0.1:9501"], "labels": {"endpoint": "engram-0-model"}}]
        with urllib.request.urlopen(f"http://127.0.0.1:{sd_port}/targets", timeout=5) as resp:
            assert json.load(resp) == expected
        assert json.loads((tmp_path / "targets.json").read_text()) == expected
        series = _coordinator_series(sd_port)
        assert {k: v for k, v in series.items() if k != "engram_coordinator_start_time_seconds"
                } == {"engram_groups_configured": 1, "engram_groups_serving": 0,
                      "engram_groups_rolling": 0, "engram_roll_in_progress": 0,
                      "engram_roll_members": 2, "engram_roll_members_done": 2,
                      "engram_roll_stopped": 0, "engram_coordinator_restarted": 0}
        assert abs(series["engram_coordinator_start_time_seconds"] - time.time()) < 600
        for r in (0, 1):
            ray.get(coordinator.member_ready.remote(f"m{r}"))
        assert _coordinator_series(sd_port)["engram_groups_serving"] == 1
        ray.get(coordinator.leave.remote("m0"))
        assert ray.get(slot("m2", "node-x")) == 0  # m0's slot is free again
        ray.get(coordinator.join.remote("group-0", "gang2", 0, 2, "n0"))  # gang1 ended
        assert ray.get(slot("n0", "node-x")) == 0
        with urllib.request.urlopen(f"http://127.0.0.1:{sd_port}/targets", timeout=5) as resp:
            assert json.load(resp) == expected[:1]  # its own endpoint stays
        assert _coordinator_series(sd_port)["engram_groups_serving"] == 0  # gang2 not ready
    finally:
        ray.kill(coordinator)


def test_the_coordinators_free_port_is_never_an_engines_fixed_port():
    """The OS hands out free ports from its ephemeral range, where a metrics_port block may
    lie (test_faults' does; seen: a new gang's engine found its fixed port taken by the
    coordinator's free one): the coordinator skips every port the engines may bind. Here the
    ports to skip are half the ephemeral range, so each of three servers lands there with
    even odds unless it skips them; too many to skip is refused, naming the setting."""
    from engram_ray.metrics.exposition import fixed_ports

    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    half = range(low, (low + high) // 2)
    taken = []
    try:
        for _ in range(3):
            taken.append(TargetsServer(None, "127.0.0.1", 0, avoid=half))
            assert taken[-1].port not in half, (taken[-1].port, half)
    finally:
        for server in taken:
            server.stop()
    with pytest.raises(ConfigError, match="serving.metrics_port: is 1: no free port on "
                                          "127.0.0.1 outside the engines' fixed ports"):
        TargetsServer(None, "127.0.0.1", 0, avoid=range(1, 65536))
    assert list(fixed_ports(0)) == [] and len(fixed_ports(9500)) == 200


def test_free_port_zero_never_collides():
    servers = [MetricsServer([], "127.0.0.1", 0) for _ in range(2)]
    try:
        assert servers[0].port != servers[1].port
    finally:
        for server in servers:
            server.stop()


def test_model_process_endpoint_binds_its_fixed_port(tmp_path):
    """What the replica hands vLLM's model process (`additional_config.engram_metrics`): its
    endpoint binds the given port and writes that target for the replica to register."""
    from engram_ray.metrics.exposition import start_process_metrics

    port = free_port()
    target_file = tmp_path / "model-target.json"
    metrics = start_process_metrics({"engram_metrics": {
        "model": "m", "engine": "g-r0", "peer_group": "g", "rank": 0,
        "bind_address": "127.0.0.1", "target_file": str(target_file), "port": port}})
    try:
        assert metrics.server.port == port
        assert json.loads(target_file.read_text())["target"] == f"127.0.0.1:{port}"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert b"engram_" in resp.read()
    finally:
        metrics.server.stop()


# --- the `cluster` label ($cluster in the dashboards) on every shipped scrape path -----------

DASHBOARDS = CONFIGS.parent / "dashboards"


def _ray_up_cluster(path: Path) -> str:
    """The --cluster of the `engram-ray dashboards export` a ray up file runs on its head."""
    for command in read_yaml(path)["head_start_ray_commands"]:
        found = re.search(r"engram-ray dashboards export .*--cluster (\S+)", command)
        if found:
            return found[1]
    raise AssertionError(f"{path.name}: no engram-ray dashboards export --cluster on the head")


def _podmonitor_relabel_configs(manifest: Path) -> list[dict]:
    """The engines' PodMonitor relabelings as Prometheus relabel_configs (what Prometheus
    Operator writes for them: the same fields in snake_case)."""
    import yaml

    [monitor] = [d for d in yaml.safe_load_all(manifest.read_text())
                 if d["kind"] == "PodMonitor" and d["metadata"]["name"].endswith("-engines")]
    [relabelings] = {yaml.safe_dump(e["relabelings"]): e["relabelings"]
                     for e in monitor["spec"]["podMetricsEndpoints"]}.values()
    snake = {"targetLabel": "target_label", "sourceLabels": "source_labels",
             "replacement": "replacement", "action": "action", "regex": "regex"}
    return [{snake[k]: v for k, v in rule.items()} for rule in relabelings]


def _local_path(sd_file: Path, tmp_path: Path) -> tuple[dict, str]:
    from engram_ray.local.prometheus import LOCAL_CLUSTER, scrape_config

    return scrape_config(DASHBOARDS / "prometheus.yml", str(sd_file), None, "1s"), LOCAL_CLUSTER


def _ray_up_path(sd_file: Path, tmp_path: Path) -> tuple[dict, str]:
    """What ray_up_onprem.yaml's head runs: the exported prometheus.yml of its --cluster, its
    file_sd paths pointed at this test's list."""
    import yaml

    from engram_ray.commands.dashboards import export

    cluster = _ray_up_cluster(CONFIGS / "ray_up_onprem.yaml")
    export(tmp_path / "obs", cluster=cluster)
    config = yaml.safe_load((tmp_path / "obs/prometheus/prometheus.yml").read_text())
    config["rule_files"] = [str(tmp_path / "obs/prometheus" / f) for f in config["rule_files"]]
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    # The engines' list for the engram job; Ray's own discovery file (the ray job) is empty
    # here: pointing both jobs at the engines' list would scrape each engine twice.
    ray_sd = tmp_path / "ray_targets.json"
    ray_sd.write_text("[]")
    for job in config["scrape_configs"]:
        files = [str(sd_file if job["job_name"] == "engram" else ray_sd)]
        job["file_sd_configs"] = [{"files": files, "refresh_interval": "1s"}]
    assert "engram" in [job["job_name"] for job in config["scrape_configs"]]
    return config, cluster


def _kuberay_path(sd_file: Path, tmp_path: Path) -> tuple[dict, str]:
    manifest = CONFIGS / "kuberay" / "rayservice_gb300_nvl72.yaml"
    return {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "engines",
                                "file_sd_configs": [{"files": [str(sd_file)],
                                                     "refresh_interval": "1s"}],
                                "relabel_configs": _podmonitor_relabel_configs(manifest)}]}, \
        "dsv41-flash-gb300"


@pytest.mark.parametrize("scrape_path", [_local_path, _ray_up_path, _kuberay_path],
                         ids=["local", "ray-up", "kuberay-podmonitor"])
def test_every_scrape_path_labels_its_targets_with_the_cluster(scrape_path, tmp_path):
    """A real Prometheus run with each shipped scrape config answers a query on
    cluster="<name>" (what the dashboards' $cluster sends) with the engine's series, and `up`."""
    from prometheus_client import CollectorRegistry, Gauge

    registry = CollectorRegistry()
    Gauge("engram_group_healthy", "a group's health, as the engines export it",
          registry=registry).set(1)
    server = MetricsServer([registry], "127.0.0.1", 0, include_process_registry=False)
    sd_file = tmp_path / "targets.json"
    write_file_sd(str(sd_file), {"r0": {"target": server.target}})
    config, cluster = scrape_path(sd_file, tmp_path)
    prom = None
    try:
        prom = Prometheus(config, workdir=str(tmp_path))
        query = f'engram_group_healthy{{cluster="{cluster}"}}'
        result = _wait(lambda: prom.query(query), 30, f"{query}; log: {prom.log_tail()}")
        assert [float(r["value"][1]) for r in result] == [1.0]
        # The values Grafana offers for $cluster (label_values(engram_group_healthy, cluster)).
        assert prom.api("label/cluster/values") == [cluster]
        assert prom.query(f'up{{cluster="{cluster}"}}')
        assert not prom.query('engram_group_healthy{cluster=""}')
    finally:
        if prom is not None:
            prom.stop()
        server.stop()


def test_cluster_label_names_are_checked_and_replace_the_files():
    import yaml

    from engram_ray.errors import EngramRayError
    from engram_ray.local.prometheus import with_cluster

    base = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    assert {job["job_name"]: job["relabel_configs"] for job in base["scrape_configs"]} == {
        job: [{"target_label": "cluster", "replacement": "engram"}] for job in ("engram", "ray")}
    relabeled = with_cluster(base, "rack-7")
    for job in relabeled["scrape_configs"]:
        assert job["relabel_configs"] == [{"target_label": "cluster", "replacement": "rack-7"}]
    for bad in ("", "  ", None):
        with pytest.raises(EngramRayError, match="cluster: is"):
            with_cluster(base, bad)


def test_dashboards_export_cluster_option(tmp_path, capsys):
    """`engram-ray dashboards export --cluster NAME` (what the ray up heads run) labels both jobs
    NAME; a blank NAME is one line and exit 2."""
    import yaml

    from engram_ray.cli import main

    assert main(["dashboards", "export", str(tmp_path / "obs"), "--cluster", "rack-7"]) == 0
    config = yaml.safe_load((tmp_path / "obs/prometheus/prometheus.yml").read_text())
    assert [j["relabel_configs"] for j in config["scrape_configs"]] == [
        [{"target_label": "cluster", "replacement": "rack-7"}]] * 2
    assert config["rule_files"] == ["engram_alerts.yml"]
    assert main(["dashboards", "export", str(tmp_path / "other"), "--cluster", ""]) == 2
    assert "cluster: is ''" in capsys.readouterr().err

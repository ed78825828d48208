"""Alert rules (dashboards/engram_alerts.yml): generated, accepted by `promtool check rules`, and
each alert fires on a synthetic series that should trip it and stays quiet on one that should not
(`promtool test rules`). promtool comes with Debian's prometheus package (scripts/setup.sh)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
DASHBOARDS = ROOT / "dashboards"
RULES = DASHBOARDS / "engram_alerts.yml"
sys.path.insert(0, str(DASHBOARDS))
import generate  # noqa: E402

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason=(
    "promtool not on PATH: it comes with Debian's prometheus package (bash scripts/setup.sh)"))

G0 = 'model="m", peer_group="g0", engine="e0", rank="0", job="engram", instance="h:1"'
KUBERAY_E2 = 'job="engram/dsv41-flash-h200-engines", endpoint="engram-0", instance="h:3"'
G1 = 'model="m", peer_group="g1", engine="e1", rank="0", job="engram", instance="h:2"'
GROUP0 = {"job": "engram", "model": "m", "peer_group": "g0"}
# The coordinators of deployments d0 (trips each coordinator alert) and d1 (healthy).
D0 = {"job": "engram", "model": "m", "deployment": "d0"}
D1 = {"job": "engram", "model": "m", "deployment": "d1"}


def _labels(labels: dict, **more) -> str:
    return ", ".join(f'{k}="{v}"' for k, v in {**labels, **more}.items())


def promtool(*args, cwd=None):
    return subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=60)


def unit_tests() -> dict:
    """Series over 2 h at 1 m steps; group g0 trips each alert, group g1 stays healthy."""
    series = [
        # g0 unhealthy from minute 10 on; g1 healthy throughout.
        {"series": f"engram_group_healthy{{{G0}}}", "values": "1x9 0x110"},
        {"series": f"engram_group_healthy{{{G1}}}", "values": "1x120"},
        # g0 restarts 5 times within 20 minutes; g1 once (below the threshold).
        {"series": f"engram_group_generation{{{G0}}}", "values": "1x9 2x4 3x4 4x4 5x4 6x90"},
        {"series": f"engram_group_generation{{{G1}}}", "values": "1x59 2x60"},
        # e0's KV cache fills to 95 % from minute 30; e1 stays half free.
        {"series": f"engram_kv_cache_capacity_bytes{{{G0}}}", "values": "1000x120"},
        {"series": f"engram_kv_cache_headroom_bytes{{{G0}}}", "values": "500x29 50x90"},
        {"series": f"engram_kv_cache_capacity_bytes{{{G1}}}", "values": "1000x120"},
        {"series": f"engram_kv_cache_headroom_bytes{{{G1}}}", "values": "500x120"},
        # e0's endpoint stops answering at minute 50; on KubeRay (a PodMonitor's job, its
        # port name as endpoint) e2's at minute 60; Ray's own export is no engine.
        {"series": 'up{job="engram", endpoint="replica", instance="h:1"}',
         "values": "1x49 0x70"},
        {"series": 'up{job="engram", endpoint="replica", instance="h:2"}', "values": "1x120"},
        {"series": f'up{{{KUBERAY_E2}}}', "values": "1x59 0x60"},
        {"series": 'up{job="engram/dsv41-flash-h200", endpoint="metrics", instance="h:4"}',
         "values": "0x120"},
        # e0 restarts its engine in place 4 times from minute 20 on, the last one for 16 m
        # (counted as each serves again: minutes 21, 23, 25, 42); e1 once, briefly.
        {"series": f"engram_engine_restarting{{{G0}}}",
         "values": "0x19 1 0 1 0 1 0 1x15 0x79"},
        {"series": f"engram_engine_restarts_total{{{G0}}}", "values": "0x20 1x1 2x1 3x16 4x78"},
        {"series": f"engram_engine_restarting{{{G1}}}", "values": "0x29 1 0x90"},
        {"series": f"engram_engine_restarts_total{{{G1}}}", "values": "0x30 1x90"},
        # d0: 3 groups, one not serving from minute 10 to 30; d1 serves its 2 throughout
        # but for 10 minutes (a cold start, a `restart` roll: under the alert's 15 m).
        {"series": f"engram_groups_configured{{{_labels(D0)}}}", "values": "3x120"},
        {"series": f"engram_groups_serving{{{_labels(D0)}}}", "values": "3x9 2x20 3x90"},
        {"series": f"engram_groups_configured{{{_labels(D1)}}}", "values": "2x120"},
        {"series": f"engram_groups_serving{{{_labels(D1)}}}", "values": "2x69 0x10 2x40"},
        # d0 rolls settings out from minute 0 on, stopped from 100 to 110; d1 rolls for an
        # hour.
        {"series": f"engram_roll_in_progress{{{_labels(D0)}}}", "values": "1x120"},
        {"series": f"engram_roll_stopped{{{_labels(D0)}}}", "values": "0x99 1x10 0x10"},
        {"series": f"engram_roll_in_progress{{{_labels(D1)}}}", "values": "0x9 1x60 0x50"},
        {"series": f"engram_roll_stopped{{{_labels(D1)}}}", "values": "0x120"},
        # d0's coordinator dies at minute 40 (its endpoint silent 40-45, then 7 m more from
        # 60) and Ray restarts it at minute 45 (start time 2700 s); d1's never restarts
        # (started before the test's time 0).
        {"series": f"engram_coordinator_start_time_seconds{{{_labels(D0)}}}",
         "values": "0x44 2700x75"},
        {"series": f"engram_coordinator_restarted{{{_labels(D0)}}}", "values": "0x44 1x75"},
        {"series": f"engram_coordinator_start_time_seconds{{{_labels(D1)}}}", "values": "0x120"},
        {"series": f"engram_coordinator_restarted{{{_labels(D1)}}}", "values": "0x120"},
        {"series": 'up{job="engram", endpoint="coordinator", instance="h:9"}',
         "values": "1x59 0x7 1x53"},
        {"series": 'up{job="engram/dsv41-flash-h200", endpoint="engram-sd", instance="h:10"}',
         "values": "1x120"},
    ]
    def fires(name, at, labels, value=""):
        if labels is None:
            return {"eval_time": at, "alertname": name, "exp_alerts": []}
        return {"eval_time": at, "alertname": name, "exp_alerts": [{
            "exp_labels": {**labels, "severity": RULE[name]["labels"]["severity"]},
            "exp_annotations": {k: expand(v, labels, value)
                                for k, v in RULE[name]["annotations"].items()}}]}
    unhealthy, churn = "EngramPeerGroupUnhealthy", "EngramGenerationChurn"
    headroom, down = "EngramKVCacheHeadroomLow", "EngramEngineDown"
    slow, restarts = "EngramEngineRestartSlow", "EngramEngineRestartChurn"
    engine0 = {**GROUP0, "engine": "e0"}
    alerts = [
        fires(unhealthy, "9m", None), fires(unhealthy, "11m", None),  # not yet for 2 m
        fires(unhealthy, "13m", GROUP0),
        fires(churn, "15m", None),  # 2 restarts so far
        fires(churn, "30m", GROUP0, "5"),  # 5 in the last hour
        fires(churn, "100m", None),  # the restarts were more than an hour ago
        fires(headroom, "35m", None),  # low, but not for 10 m yet
        fires(headroom, "45m", {**GROUP0, "engine": "e0"}),
        fires(down, "49m", None),
        fires(down, "53m", {"job": "engram", "endpoint": "replica", "instance": "h:1"}),
        {"eval_time": "63m", "alertname": down, "exp_alerts": [
            {"exp_labels": {**labels, "severity": "critical"},
             "exp_annotations": {k: expand(v, labels, "")
                                 for k, v in RULE[down]["annotations"].items()}}
            for labels in ({"job": "engram", "endpoint": "replica", "instance": "h:1"},
                           {"job": "engram/dsv41-flash-h200-engines", "endpoint": "engram-0",
                            "instance": "h:3"})]},
        fires(slow, "30m", None),  # restarting since minute 26: not for 10 m yet
        fires(slow, "38m", engine0),
        fires(slow, "45m", None),  # back at minute 42
        fires(restarts, "30m", None),  # 3 restarts so far
        fires(restarts, "45m", engine0),
        fires(restarts, "90m", None),  # one restart in the last hour
        fires("EngramGroupsNotServing", "20m", None),  # not for 15 m yet
        fires("EngramGroupsNotServing", "27m", D0, "1"),
        fires("EngramGroupsNotServing", "35m", None),
        fires("EngramGroupsNotServing", "78m", None),  # d1's 10 minutes
        fires("EngramRollStopped", "95m", None),
        fires("EngramRollStopped", "105m", D0),
        fires("EngramRollSlow", "100m", None),  # d0 rolls since 0: not for 2 h yet; d1 1 h
        fires("EngramRollSlow", "120m", D0),
        fires("EngramCoordinatorRestarted", "44m", None),
        fires("EngramCoordinatorRestarted", "50m", D0),
        fires("EngramCoordinatorRestarted", "61m", None),  # more than 15 minutes ago
        fires("EngramCoordinatorDown", "63m", None),  # not for 5 m yet
        fires("EngramCoordinatorDown", "66m", {"job": "engram", "endpoint": "coordinator",
                                               "instance": "h:9"}),
        fires("EngramCoordinatorDown", "70m", None),
    ]
    return {"rule_files": [str(RULES)], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": alerts}]}


RULE = {r["alert"]: r for r in generate.build_rules()["groups"][0]["rules"]}


def expand(template: str, labels: dict, value: str) -> str:
    """The annotation Prometheus renders: `{{ $labels.x }}` and `{{ $value }}` filled in."""
    text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], template)
    return text.replace("{{ $value }}", value)


def test_committed_rules_match_the_generator():
    assert RULES.read_text() == generate.render_rules(generate.build_rules())


def test_rules_use_only_metrics_the_engines_and_the_coordinator_export():
    from engram_ray.metrics.coordinator import SERIES
    from engram_ray.metrics.engine import EngineIdentity, EngineMetrics
    defined = {m.name for m in EngineMetrics(EngineIdentity("m", "e", "g", 0)).registry.collect()}
    defined |= set(SERIES)
    used = {name for r in generate.build_rules()["groups"][0]["rules"]
            for name in re.findall(r"\bengram_[a-z_]+", r["expr"].replace("_total", ""))}
    assert used and used <= defined, used - defined
    assert set(RULE) == {"EngramPeerGroupUnhealthy", "EngramEngineDown",
                         "EngramGenerationChurn", "EngramKVCacheHeadroomLow",
                         "EngramEngineRestartSlow", "EngramEngineRestartChurn",
                         "EngramGroupsNotServing", "EngramRollStopped", "EngramRollSlow",
                         "EngramCoordinatorRestarted", "EngramCoordinatorDown"}


def test_prometheus_config_loads_the_rules():
    config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    assert config["rule_files"] == [RULES.name]


@needs_promtool
def test_promtool_check_rules():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 11 rules found" in result.stdout


@needs_promtool
def test_each_alert_fires_on_its_series_and_stays_quiet_otherwise(tmp_path):
    tests = tmp_path / "alerts_test.yml"
    tests.write_text(yaml.safe_dump(unit_tests(), sort_keys=False))
    result = promtool("test", "rules", str(tests))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_unit_test_can_fail(tmp_path):
    """A wrong expectation (g1 healthy, yet expected to alert) makes promtool fail."""
    spec = unit_tests()
    spec["tests"][0]["alert_rule_test"] = [{
        "eval_time": "30m", "alertname": "EngramPeerGroupUnhealthy",
        "exp_alerts": [{"exp_labels": {**GROUP0, "peer_group": "g1", "severity": "critical"}},
                       {"exp_labels": {**GROUP0, "severity": "critical"}}]}]
    tests = tmp_path / "alerts_test.yml"
    tests.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert promtool("test", "rules", str(tests)).returncode != 0

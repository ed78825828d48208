"""Grafana dashboards and Prometheus alert rules of engram-ray, generated: `python3
dashboards/generate.py` writes `dashboards/engram_memory.json`, `dashboards/engram_step_time.json`
and `dashboards/engram_alerts.yml`; `--check` exits 1 if a committed file differs from what this
code generates (tests/cpu/metrics/test_dashboards.py runs it).

Queries filter on the template variables `$cluster`, `$job` (Prometheus' own target labels: `job`
from the scrape job, `cluster` from an external label or relabelling; a series without `cluster`
still matches `.*`), `$model`, `$engine`, `$peer_group` and use `$__rate_interval`; vLLM's own
series are matched under every name they can carry: `vllm:*` or `vllm_*` (an engine's
`/metrics`) and `ray_vllm_*` (Ray's metrics export, Ray Serve LLM).
"""

# Over 300 lines: the two dashboards and the alert rules are one vocabulary of series, label
# selectors and thresholds; split, the panels and the alerts would drift apart.

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
SEL = ('cluster=~"$cluster", job=~"$job", model=~"$model", engine=~"$engine", '
       'peer_group=~"$peer_group"')
# The coordinator's series (engram_ray.metrics.coordinator): per deployment, no engine or group.
COORD_SEL = 'cluster=~"$cluster", job=~"$job", model=~"$model"'
# Variables a panel query filters on, in the order Grafana shows them.
TEMPLATE_LABELS = ("cluster", "job", "model", "engine", "peer_group")
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.95, 0.99)


def vllm_series(name: str) -> str:
    """Selector matching vLLM metric `name` as exported directly (`vllm:name`; scraped as
    OpenMetrics, prometheus-client escapes it to `vllm_name`) and through Ray (`ray_vllm_name`)."""
    return (f'{{__name__=~"(ray_)?vllm[:_]{name}", cluster=~"$cluster", job=~"$job", '
            f'model_name=~"$model"}}')


def quantile_targets(bucket_selector: str, by: str = "engine") -> list[dict]:
    """p50/p95/p99 of a histogram from the rate of its buckets, one series per `by` value."""
    return [target(f"histogram_quantile({q}, sum by (le, {by}) "
                   f"(rate({bucket_selector}[{RATE}])))", f"p{int(q * 100)} {{{{{by}}}}}")
            for q in QUANTILES]


def target(expr: str, legend: str) -> dict:
    return {"expr": expr, "legendFormat": legend}


def panel(title: str, unit: str, targets: list[dict], description: str = "") -> dict:
    return {"type": "timeseries", "title": title, "description": description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "table", "placement": "bottom",
                                   "calcs": ["lastNotNull", "max"]}},
            "targets": targets}


def variables() -> list[dict]:
    out = [{"name": "datasource", "type": "datasource", "query": "prometheus",
            "label": "Prometheus"}]
    for name in TEMPLATE_LABELS:
        out.append({"name": name, "type": "query", "label": name, "includeAll": True,
                    "multi": True, "allValue": ".*", "current": {"text": "All",
                                                                  "value": "$__all"},
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {"query": f"label_values(engram_group_healthy, {name})",
                              "refId": f"{name}-values"},
                    "refresh": 2, "sort": 1})
    return out


def dashboard(uid: str, title: str, description: str, panels: list[dict]) -> dict:
    """A dashboard of `panels` laid out two per row (12 of Grafana's 24 columns each)."""
    for idx, item in enumerate(panels):
        item["id"] = idx + 1
        item["gridPos"] = {"h": 8, "w": 12, "x": 12 * (idx % 2), "y": 8 * (idx // 2)}
        for ref_idx, tgt in enumerate(item["targets"]):
            tgt["refId"] = chr(ord("A") + ref_idx)
            tgt["datasource"] = {"type": "prometheus", "uid": "${datasource}"}
    return {"uid": uid, "title": title, "description": description, "tags": ["engram-ray"],
            "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
            "time": {"from": "now-1h", "to": "now"}, "timezone": "utc",
            "templating": {"list": variables()}, "annotations": {"list": []},
            "panels": panels}


def memory_dashboard() -> dict:
    by_engine = "{{engine}}"
    return dashboard("engram-memory", "Engram memory", "Engram table memory per GPU, host "
                     "memory, KV-cache capacity, usage and headroom, gain from splitting", [
        panel("Table bytes per GPU", "bytes", [target(
            f"sum by (engine, table, placement) (engram_table_bytes{{{SEL}}})",
            "{{engine}} {{table}} {{placement}}")],
            "Engram table bytes each GPU holds, by table and placement (hbm, host, peer slice)"),
        panel("Host memory per engine", "bytes", [target(
            f"sum by (engine) (engram_host_bytes{{{SEL}}})", by_engine)]),
        panel("KV-cache capacity", "bytes", [target(
            f"sum by (engine) (engram_kv_cache_capacity_bytes{{{SEL}}})", by_engine)]),
        panel("KV-cache capacity (tokens)", "short", [target(
            f"sum by (engine) (engram_kv_cache_capacity_tokens{{{SEL}}})", by_engine)]),
        panel("KV-cache usage", "percentunit", [target(
            f"max by (engine) (engram_kv_cache_usage_ratio{{{SEL}}})", by_engine)]),
        panel("KV-cache headroom", "bytes", [target(
            f"sum by (engine) (engram_kv_cache_headroom_bytes{{{SEL}}})", by_engine)]),
        panel("KV-cache headroom (tokens)", "short", [target(
            f"sum by (engine) (engram_kv_cache_headroom_tokens{{{SEL}}})", by_engine)]),
        panel("KV cache gained by splitting", "bytes", [target(
            f"max by (engine) (engram_kv_cache_gain_bytes{{{SEL}}})", by_engine)],
            "HBM per GPU freed for KV cache against whole tables in every GPU's HBM"),
        panel("Peer-group health and generation", "short", [
            target(f"min by (peer_group) (engram_group_healthy{{{SEL}}})",
                   "healthy {{peer_group}}"),
            target(f"max by (peer_group) (engram_group_generation{{{SEL}}})",
                   "generation {{peer_group}}")]),
        panel("Engines restarting in place", "short", [
            target(f"max by (engine) (engram_engine_restarting{{{SEL}}})",
                   "restarting {{engine}}"),
            target(f"sum by (engine) (increase(engram_engine_restarts_total{{{SEL}}}[1h]))",
                   "restarts in the last hour {{engine}}")],
            "1 while an engine restarts inside its replica (its group serves on the others); "
            "restarts in place counted per engine"),
        panel("Slices re-attached at the engine's start", "short", [target(
            f"max by (engine) (engram_slices_reattached{{{SEL}}})", by_engine)],
            "1: the engine mapped its slices from their holders (a restart in place, no "
            "checkpoint read); 0: it filled them (a gang's first start)"),
        panel("Peer groups configured and serving", "short", [
            target(f"max by (deployment) (engram_groups_configured{{{COORD_SEL}}})",
                   "configured {{deployment}}"),
            target(f"max by (deployment) (engram_groups_serving{{{COORD_SEL}}})",
                   "serving {{deployment}}"),
            target(f"max by (deployment) (engram_groups_rolling{{{COORD_SEL}}})",
                   "new gang beside or old one draining {{deployment}}")],
            "From the coordinator: groups the deployment asks for, groups the ingress sends "
            "requests to (a group whose engines are all gone counts here and nowhere else)"),
        panel("Rolling change", "short", [
            target(f"max by (deployment) (engram_roll_members_done{{{COORD_SEL}}}) / max by "
                   f"(deployment) (engram_roll_members{{{COORD_SEL}}} > 0)",
                   "fraction of members on the latest settings {{deployment}}"),
            target(f"max by (deployment) (engram_roll_in_progress{{{COORD_SEL}}})",
                   "under way {{deployment}}"),
            target(f"max by (deployment) (engram_roll_stopped{{{COORD_SEL}}})",
                   "stopped {{deployment}}")],
            "A serve deploy of changed settings rolls them out: the fraction of members done, "
            "1 while it is under way, 1 when it stopped (an engine would not start with the "
            "new settings; engram-ray status says which)"),
        panel("Coordinator uptime", "s", [target(
            f"time() - max by (deployment) (engram_coordinator_start_time_seconds"
            f"{{{COORD_SEL}}})", "{{deployment}}")],
            "Seconds since the coordinator's process started: a drop is a restart (its groups "
            "serve on; it rebuilds its book from the members)"),
    ])


def step_time_dashboard() -> dict:
    return dashboard("engram-step-time", "Engram step time", "Engine step time, Engram "
                     "lookup latency, remote rows, vLLM time to first token and inter-token "
                     "latency", [
        panel("Engine step time p50/p95/p99", "s",
              quantile_targets(f"engram_engine_step_seconds_bucket{{{SEL}}}")),
        panel("Lookup latency p50/p95/p99 (local and remote rows)", "s",
              quantile_targets(f"engram_lookup_seconds_bucket{{{SEL}}}", by="rows")),
        panel("Rows read from peers", "percentunit", [target(
            f'sum by (engine) (rate(engram_rows_read_total{{{SEL}, rows="remote"}}[{RATE}]))'
            f" / sum by (engine) (rate(engram_rows_read_total{{{SEL}}}[{RATE}]))",
            "{{engine}}")]),
        panel("Rendezvous duration", "s", [target(
            f"max by (peer_group) (engram_rendezvous_duration_seconds{{{SEL}}})",
            "{{peer_group}}")]),
        panel("vLLM time to first token", "s", quantile_targets(
            vllm_series("time_to_first_token_seconds_bucket"), by="model_name")),
        panel("vLLM inter-token latency", "s", quantile_targets(
            vllm_series("inter_token_latency_seconds_bucket"), by="model_name")),
    ])


# Alert thresholds (engram_alerts.yml). A group restart bumps engram_group_generation once.
UNHEALTHY_FOR = "2m"
ENGINE_DOWN_FOR = "2m"
CHURN_RESTARTS_PER_HOUR = 3
# serving.rollout.in_place_timeout_s's default (600 s) gives a restart in place up: one that
# lasts longer runs with a raised deadline, or is stuck.
RESTART_SLOW_FOR = "10m"
ENGINE_RESTARTS_PER_HOUR = 3
# The engines' own endpoints, whatever the scrape job is called: `endpoint` is the file_sd
# label the coordinator gives each target (replica / model, or engram-<s>[-model] with fixed
# ports) and the port name Prometheus Operator's PodMonitor puts there (engram-<s>[-model]).
ENGINE_ENDPOINTS = 'endpoint=~"replica|model|engram-[0-9]+(-model)?"'

# The coordinator's alerts: a group counted configured but not serving for this long (a cold
# start of DeepSeek-V4.1-Flash takes minutes; a rolling change `restart` stops every group);
# a roll under way this long; a coordinator restart reported this long after it happened.
GROUPS_NOT_SERVING_FOR = "15m"
ROLL_SLOW_FOR = "2h"
COORDINATOR_RESTART_WINDOW_S = 900
COORDINATOR_DOWN_FOR = "5m"
# The coordinator's endpoint: file_sd / http_sd label `coordinator`, the head's port name on
# KubeRay (serving.http_sd_port's container port, scraped by the PodMonitor) `engram-sd`.
COORDINATOR_ENDPOINT = 'endpoint=~"coordinator|engram-sd"'
COORD_BY = "cluster, job, model, deployment"

HEADROOM_LOW_RATIO = 0.1
HEADROOM_LOW_FOR = "10m"
ALERTS_FILE = "engram_alerts.yml"
GROUP_BY = "cluster, job, model, peer_group"


def alert(name: str, expr: str, duration: str, severity: str, summary: str,
          description: str) -> dict:
    return {"alert": name, "expr": expr, "for": duration,
            "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description}}


def build_rules() -> dict:
    """Prometheus rule file (alerting rules) over the series the engines export
    (engram_ray.metrics.engine): not-serving peer groups, engines down, generation churn,
    engines restarting in place too long or too often, KV headroom; and over the coordinator's
    (engram_ray.metrics.coordinator): groups configured but not serving, a roll stopped or
    slow, the coordinator restarted or down."""
    return {"groups": [{"name": "engram-ray", "rules": [
        alert("EngramPeerGroupUnhealthy",
              f"min by ({GROUP_BY}) (engram_group_healthy) == 0", UNHEALTHY_FOR, "critical",
              "Peer group {{ $labels.peer_group }} is not serving",
              "A member of peer group {{ $labels.peer_group }} (model {{ $labels.model }}) "
              "reports its group incomplete or not serving (engram_group_healthy 0) for "
              f"{UNHEALTHY_FOR}: the ingress routes around it; its capacity is lost."),
        alert("EngramEngineDown",
              f"up{{{ENGINE_ENDPOINTS}}} == 0", ENGINE_DOWN_FOR, "critical",
              "Engine metrics endpoint {{ $labels.instance }} is down",
              "Prometheus cannot scrape engine {{ $labels.instance }} for "
              f"{ENGINE_DOWN_FOR}: the engine (or its node) is gone, so its peer group "
              "cannot serve."),
        alert("EngramGenerationChurn",
              f"max by ({GROUP_BY}) (changes(engram_group_generation[1h])) "
              f"> {CHURN_RESTARTS_PER_HOUR}", "0m", "warning",
              "Peer group {{ $labels.peer_group }} restarted {{ $value }} times in an hour",
              "engram_group_generation of peer group {{ $labels.peer_group }} changed more "
              f"than {CHURN_RESTARTS_PER_HOUR} times in the last hour: the group keeps "
              "restarting (a member crashes, or the rendezvous fails); check the engine logs."),
        alert("EngramEngineRestartSlow",
              f"max by ({GROUP_BY}, engine) (engram_engine_restarting) == 1", RESTART_SLOW_FOR,
              "warning",
              "Engine {{ $labels.engine }} has been restarting in place for "
              f"{RESTART_SLOW_FOR}",
              "Engine {{ $labels.engine }} of peer group {{ $labels.peer_group }} has been "
              f"restarting inside its replica for {RESTART_SLOW_FOR} (its group serves on the "
              "others with one engine less): past serving.rollout.in_place_timeout_s the "
              "member is given up and its gang restarts; check the replica's log."),
        alert("EngramEngineRestartChurn",
              f"max by ({GROUP_BY}, engine) (increase(engram_engine_restarts_total[1h])) "
              f"> {ENGINE_RESTARTS_PER_HOUR}", "0m", "warning",
              "Engine {{ $labels.engine }} restarted in place more than "
              f"{ENGINE_RESTARTS_PER_HOUR} times in an hour",
              "Engine {{ $labels.engine }} of peer group {{ $labels.peer_group }} restarted in "
              f"place more than {ENGINE_RESTARTS_PER_HOUR} times in the last hour (each one "
              "costs the group an engine for tens of seconds): its engine keeps dying; check "
              "the replica's log for the cause (engram-ray status, `engine died`)."),
        alert("EngramGroupsNotServing",
              f"max by ({COORD_BY}) (engram_groups_configured - engram_groups_serving) > 0",
              GROUPS_NOT_SERVING_FOR, "critical",
              "{{ $value }} peer groups of {{ $labels.deployment }} are not serving",
              "The coordinator of {{ $labels.deployment }} counts {{ $value }} of its "
              f"configured peer groups not serving for {GROUPS_NOT_SERVING_FOR} (started, "
              "restarting or lost, including groups whose engines are all gone): their "
              "capacity is lost; engram-ray status says why for each."),
        alert("EngramRollStopped",
              f"max by ({COORD_BY}) (engram_roll_stopped) == 1", "0m", "warning",
              "The rolling change of {{ $labels.deployment }} stopped",
              "A member's engine of {{ $labels.deployment }} would not start with the new "
              "settings: it serves on the old ones and the roll goes no further. engram-ray "
              "status names the member and the reason; deploy fixed settings (or the old file)."),
        alert("EngramRollSlow",
              f"max by ({COORD_BY}) (engram_roll_in_progress) == 1", ROLL_SLOW_FOR, "warning",
              f"A rolling change of {{{{ $labels.deployment }}}} is under way for {ROLL_SLOW_FOR}",
              "Settings of {{ $labels.deployment }} have been rolling out for "
              f"{ROLL_SLOW_FOR}: a group may not be whole (a roll waits for it), or a gang "
              "started beside may not take over; see engram_roll_members_done and engram-ray "
              "status."),
        alert("EngramCoordinatorRestarted",
              f"max by ({COORD_BY}) (time() - engram_coordinator_start_time_seconds < "
              f"{COORDINATOR_RESTART_WINDOW_S}) and max by ({COORD_BY}) "
              "(engram_coordinator_restarted) == 1", "0m", "warning",
              "The coordinator of {{ $labels.deployment }} restarted",
              "The coordinator actor of {{ $labels.deployment }} was restarted by Ray in the "
              f"last {COORDINATOR_RESTART_WINDOW_S // 60} minutes (its process died): its groups "
              "served on and it rebuilt its book from the members; find why it died in the "
              "head's Ray logs."),
        alert("EngramCoordinatorDown",
              f"up{{{COORDINATOR_ENDPOINT}}} == 0", COORDINATOR_DOWN_FOR, "warning",
              "Coordinator endpoint {{ $labels.instance }} is down",
              f"Prometheus cannot scrape the coordinator at {{{{ $labels.instance }}}} for "
              f"{COORDINATOR_DOWN_FOR}: the groups serve on with the routing they have, but "
              "no group is restarted, rolled or placed again until it is back."),
        alert("EngramKVCacheHeadroomLow",
              "min by (cluster, job, model, peer_group, engine) (engram_kv_cache_headroom_bytes"
              " / (engram_kv_cache_capacity_bytes > 0)) "
              f"< {HEADROOM_LOW_RATIO}", HEADROOM_LOW_FOR, "warning",
              "KV-cache headroom of engine {{ $labels.engine }} is low",
              f"Engine {{{{ $labels.engine }}}} has had less than {HEADROOM_LOW_RATIO:.0%} of "
              f"its KV cache free for {HEADROOM_LOW_FOR}: requests queue or get preempted; "
              "add engines or lower max_num_seqs / max_model_len."),
    ]}]}


def render_rules(rules: dict) -> str:
    header = ("# Generated by dashboards/generate.py (do not edit): engram-ray alerting rules.\n"
              "# Check: promtool check rules engram_alerts.yml\n")
    return header + yaml.safe_dump(rules, sort_keys=False, width=100)


def build_files() -> dict[str, str]:
    """File name -> text of every generated file."""
    files = {name: render(model) for name, model in build_dashboards().items()}
    files[ALERTS_FILE] = render_rules(build_rules())
    return files


def build_dashboards() -> dict[str, dict]:
    """File name -> dashboard JSON model."""
    return {"engram_memory.json": memory_dashboard(),
            "engram_step_time.json": step_time_dashboard()}


def render(model: dict) -> str:
    return json.dumps(model, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    stale = []
    for name, text in build_files().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale generated files: {', '.join(stale)}; run python3 dashboards/generate.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

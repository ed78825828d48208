"""A KubeRay manifest's metrics ports against its Serve config (`engram-ray check`).

With `serving.metrics_port` P > 0 the engine in slot s of a pod serves /metrics on P + 2s
(`engram-<s>`) and its model process on P + 2s + 1 (`engram-<s>-model`),
`engram_ray.metrics.exposition`; one engine per `num_gpus_per_engine` GPUs of the pod. A
PodMonitor scrapes a pod's ports by name, so every GPU worker container must list exactly those
ports under those names, and a PodMonitor selecting the engine pods must scrape each of them;
`serving.http_sd_port` (the coordinator's HTTP service discovery and its own /metrics, on the
head) must be a port of the head's container, scraped by a PodMonitor that selects the head. With P = 0 the ports are free ones: no PodMonitor can name them, so a
manifest whose PodMonitor selects engine pods is refused (use P > 0, or http_sd).
"""

from __future__ import annotations

import re

from engram_ray.errors import ConfigError
from engram_ray.metrics.exposition import ENDPOINTS, metrics_port, port_name
from engram_ray.serve.deploy.store_sharing import container_gpus, ray_container

ENGINE_PORT = re.compile(r"engram-\d+(-model)?")  # port_name's names, not engram-sd


def _selects(monitor: dict, labels: dict) -> bool:
    wanted = ((monitor.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return bool(wanted) and wanted.items() <= labels.items()


def check_kuberay_ports(service: dict, docs: list, apps: dict, where: str) -> str:
    """ConfigError naming the port, container or PodMonitor that disagrees with an app's
    `metrics_port` / `http_sd_port`; a note for the OK line."""
    cluster = (service.get("spec") or {}).get("rayClusterConfig") or {}
    head = (cluster.get("headGroupSpec") or {}).get("template") or {}
    monitors = [d for d in docs if isinstance(d, dict) and d.get("kind") == "PodMonitor"]
    notes = []
    for name, app in apps.items():
        srv, dep = app.serving, app.deployment
        at = f"{where}: application {name}"
        if srv.http_sd_port:
            head_ports = {p.get("containerPort"): p.get("name")
                          for p in ray_container(head).get("ports") or []}
            if srv.http_sd_port not in head_ports:
                raise ConfigError(f"{at}: serving.http_sd_port", f"is {srv.http_sd_port}, no "
                                  "containerPort of the head's Ray container",
                                  f"- {{containerPort: {srv.http_sd_port}, name: engram-sd}} "
                                  "in headGroupSpec's container ports")
            # The coordinator's own /metrics is on that port: scraped where the head is.
            head_labels = ((head.get("metadata") or {}).get("labels")) or {}
            on_head = [m for m in monitors if _selects(m, head_labels)]
            sd_name = head_ports[srv.http_sd_port]
            if on_head and not any(e.get("port") == sd_name
                                   for m in on_head
                                   for e in (m.get("spec") or {}).get("podMetricsEndpoints")
                                   or []):
                raise ConfigError(f"{at}: serving.http_sd_port", f"is {srv.http_sd_port}, the "
                                  "coordinator's /metrics, but PodMonitor "
                                  f"{on_head[0]['metadata'].get('name', '?')} (on the head) "
                                  f"scrapes no port {sd_name}",
                                  f"- {{port: {sd_name}, path: /metrics}} in its "
                                  "podMetricsEndpoints")
        for group in cluster.get("workerGroupSpecs") or []:
            template = group.get("template") or {}
            container = ray_container(template)
            gpus = container_gpus(container)
            if not gpus or not dep.num_gpus_per_engine:
                continue
            kind = f"worker group {group.get('groupName', '?')}"
            labels = (template.get("metadata") or {}).get("labels") or {}
            scraping = [m for m in monitors if _selects(m, labels)]
            declared = {p.get("name"): p.get("containerPort")
                        for p in container.get("ports") or []}
            if not srv.metrics_port:
                names = [m["metadata"].get("name") for m in scraping
                         if any(ENGINE_PORT.fullmatch(str(e.get("port", "")))
                                for e in m["spec"].get("podMetricsEndpoints") or [])]
                if names:
                    raise ConfigError(f"{at}: serving.metrics_port", f"is 0 (free ports), "
                                      f"which PodMonitor {names[0]} cannot name on {kind}",
                                      "a base port P > 0 (the engine in slot s binds P + 2s "
                                      "and P + 2s + 1)")
                continue
            engines = int(gpus // dep.num_gpus_per_engine)
            expected = {port_name(s, e): metrics_port(srv.metrics_port, s, e)
                        for s in range(engines) for e in ENDPOINTS}
            for port, number in expected.items():
                if declared.get(port) != number:
                    got = (f"is {declared[port]}" if port in declared
                           else "is not declared")
                    raise ConfigError(
                        f"{at}: serving.metrics_port",
                        f"is {srv.metrics_port}: {kind}'s container port {port} {got}, the "
                        f"engine in its slot binds {number} ({engines} engines a pod)",
                        f"- {{containerPort: {number}, name: {port}}} for each slot s < "
                        f"{engines}: engram-<s> on {srv.metrics_port} + 2s, engram-<s>-model "
                        "on the next")
            extra = sorted(p for p in declared if p and ENGINE_PORT.fullmatch(p)
                           and p not in expected)
            if extra:
                raise ConfigError(f"{at}: serving.metrics_port", f"gives {kind} {engines} "
                                  f"engine slots, but its container also declares {extra[0]} "
                                  "(no engine binds it)", f"ports engram-0 .. engram-"
                                  f"{engines - 1}-model only")
            scraped = {e.get("port") for m in scraping
                       for e in (m.get("spec") or {}).get("podMetricsEndpoints") or []}
            missing = [p for p in expected if p not in scraped]
            if missing:
                which = (f"PodMonitor{'s' if len(scraping) > 1 else ''} " + ", ".join(
                    m["metadata"].get("name", "?") for m in scraping)) if scraping else \
                    "no PodMonitor (none selects its pods' labels)"
                names = list(expected)
                raise ConfigError(f"{at}: serving.metrics_port", f"puts {kind}'s engine "
                                  f"endpoints on ports {names[0]} .. {names[-1]}; {which} "
                                  f"scrape{'s' if len(scraping) == 1 else ''} no port "
                                  f"{missing[0]}", "a PodMonitor selecting the engine pods "
                                  "with one podMetricsEndpoints entry per engine port name")
            notes.append(f"{kind}: {len(expected)} engine ports scraped")
    return f" ({'; '.join(notes)})" if notes else ""

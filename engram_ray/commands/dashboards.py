"""`engram-ray dashboards export DIR`: the Grafana dashboards, Prometheus config and alert rules
(package data `engram_ray.dashboards`) plus Grafana provisioning files, written into DIR:

    DIR/prometheus/prometheus.yml        scrape config (rule_files: engram_alerts.yml beside it)
    DIR/prometheus/engram_alerts.yml     alerting rules
    DIR/grafana/dashboards/*.json        the dashboards
    DIR/grafana/provisioning/dashboards/engram-ray.yml    dashboards provider (that folder)
    DIR/grafana/provisioning/datasources/engram-ray.yml   Prometheus datasource (--prometheus-url)

Grafana reads them with GF_PATHS_PROVISIONING=DIR/grafana/provisioning; Prometheus with
--config.file=DIR/prometheus/prometheus.yml. Needs neither torch nor Ray.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from engram_ray.errors import EngramRayError

HELP = "export the Grafana dashboards, Prometheus config, alert rules and Grafana provisioning"
DATASOURCE_UID = "engram-prometheus"
PROMETHEUS_FILES = ("prometheus.yml", "engram_alerts.yml")


def configure(parser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    export = sub.add_parser("export", help="write every file into DIR",
                            description="write dashboards, prometheus.yml, engram_alerts.yml "
                                        "and Grafana provisioning files into DIR")
    export.add_argument("dir", metavar="DIR", help="output folder (created; must be empty "
                                                   "unless --force)")
    export.add_argument("--force", action="store_true",
                        help="write into a non-empty DIR, replacing files of the same name")
    export.add_argument("--prometheus-url", default="http://localhost:9090",
                        help="URL of the Prometheus the Grafana datasource queries")
    export.add_argument("--dashboards-path", metavar="PATH",
                        help="folder of the dashboard JSON as Grafana sees it (e.g. inside its "
                             "container); default: DIR/grafana/dashboards, absolute")
    export.add_argument("--cluster", metavar="NAME",
                        help="value of the `cluster` label prometheus.yml gives every target "
                             "(the dashboards' $cluster); default: the shipped file's, engram")


def run(args) -> int:
    written = export(Path(args.dir), force=args.force, prometheus_url=args.prometheus_url,
                     dashboards_path=args.dashboards_path, cluster=args.cluster)
    for path in written:
        print(path)
    return 0


def provisioning(dashboards_path: str, prometheus_url: str) -> dict[str, dict]:
    """Grafana provisioning files (relative path -> YAML model)."""
    provider = {"apiVersion": 1, "providers": [{
        "name": "engram-ray", "orgId": 1, "folder": "engram-ray", "type": "file",
        "disableDeletion": False, "allowUiUpdates": True, "updateIntervalSeconds": 30,
        "options": {"path": dashboards_path, "foldersFromFilesStructure": False}}]}
    datasource = {"apiVersion": 1, "datasources": [{
        "name": "Prometheus (engram-ray)", "uid": DATASOURCE_UID, "type": "prometheus",
        "access": "proxy", "url": prometheus_url, "isDefault": True, "editable": True,
        "jsonData": {"timeInterval": "15s"}}]}
    return {"grafana/provisioning/dashboards/engram-ray.yml": provider,
            "grafana/provisioning/datasources/engram-ray.yml": datasource}


def export(out: Path, force: bool = False, prometheus_url: str = "http://localhost:9090",
           dashboards_path: str | None = None, cluster: str | None = None) -> list[Path]:
    import yaml

    if out.exists() and not out.is_dir():
        raise EngramRayError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise EngramRayError(f"{out} is not empty; pass --force to write into it anyway")
    package = resources.files("engram_ray.dashboards")
    files: dict[str, str] = {}
    for name in PROMETHEUS_FILES:
        files[f"prometheus/{name}"] = (package / name).read_text()
    if cluster is not None:
        from engram_ray.local.prometheus import with_cluster

        config = with_cluster(yaml.safe_load(files["prometheus/prometheus.yml"]), cluster)
        files["prometheus/prometheus.yml"] = (
            f"# dashboards/prometheus.yml, every target labelled cluster={cluster!r} "
            f"(engram-ray dashboards export --cluster)\n"
            + yaml.safe_dump(config, sort_keys=False))
    dashboards = sorted(p.name for p in package.iterdir() if p.name.endswith(".json"))
    if not dashboards:
        raise EngramRayError("no dashboards in the installed package (engram_ray.dashboards)")
    for name in dashboards:
        files[f"grafana/dashboards/{name}"] = (package / name).read_text()
    target = dashboards_path or str((out / "grafana" / "dashboards").resolve())
    for rel, model in provisioning(target, prometheus_url).items():
        files[rel] = yaml.safe_dump(model, sort_keys=False)
    written = []
    for rel, text in files.items():
        path = out / rel
        os.makedirs(path.parent, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written

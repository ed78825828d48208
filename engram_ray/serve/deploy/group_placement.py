"""Groups follow capacity: a group whose NVLink domain is lost is placed again in a domain
with room, by changing its own Serve deployment and no other.

The coordinator asks every CHECK_PERIOD_S (`actors/coordinator.py`, a thread of its own):
where each group's deployment points (its bundle label selector, from Serve), which domains
are alive (`actors/placement.py`), which groups have been lost for
`deployment.replace_lost_group_after_s` (`engram_ray.planning.lost_domains`). A group due goes
to `replacement_domain` (free slots for the whole gang, a domain holding no group first).

Serve's declarative config is where the change is made: the group application's config as
`serve deploy` left it is applied again with a `deployments:` entry for its deployment naming
the new domain (`placement_group_bundles`, `placement_group_bundle_label_selector`, and its
engines' `ENGRAM_RAY_DOMAIN`, which Serve needs to see a change at all). The code
version is unchanged, so Serve rebuilds nothing and restarts only that deployment, whose new
gang starts in the new domain; the other groups serve on. A later `serve deploy` of the same
file drops the entry and points the group at the lost domain again: the next check moves it
back. A `serve deploy` of a changed config rebuilds the application, and the build keeps every
group where it runs (`plan_groups(keep=...)`). Applications started with `serve.run` have no
declarative config: their groups wait for their domain, and the log says so.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

# NOTES: Ray Serve imported here, at module level: the coordinator imports this module before
# it starts its threads; two threads importing ray.serve at once see it half-initialized
# (ImportError, measured: it ended the member watch of a coordinator).
from ray import serve
from ray.serve.context import _get_global_client

from engram_ray.actors.placement import discover_domains, engine_deployment_marker
from engram_ray.config import DeploymentConfig
from engram_ray.planning.grouping import Domain, domain_summary, replacement_domain
from engram_ray.planning.lost_domains import LostDomainWatch

logger = logging.getLogger(__name__)
CHECK_PERIOD_S = 5.0  # a few Serve and GCS reads per period; the grace time is 30 s
DOMAIN_ENV = "ENGRAM_RAY_DOMAIN"  # set on the engines of a group placed again: its domain id


def group_deployments(deployment_name: str) -> dict[str, tuple[str, str]]:
    """{group id: (its Serve application, its engine deployment)} of the groups whose engine
    deployments are `<class>:<deployment_name>:group-<i>` (one application per group)."""
    marker = engine_deployment_marker(deployment_name)
    return {name.rsplit(":", 1)[1]: (app_name, name)
            for app_name, app in serve.status().applications.items()
            for name in app.deployments if marker in name}


def live_selectors(client, deployments: dict[str, tuple[str, str]]) -> dict[str, dict]:
    """{group id: the bundle label selector Serve places its gang by now}."""
    selectors = {}
    for group_id, (app_name, name) in deployments.items():
        info, _ = client.get_deployment_info(name, app_name)
        selector = info.replica_config.placement_group_bundle_label_selector
        if selector:
            selectors[group_id] = dict(selector[0])
    return selectors


def point_deployment(client, app_name: str, deployment: str, bundle: dict,
                     domain: Domain) -> bool:
    """Apply the declarative config again with `deployment`'s gang label-selected into
    `domain`; False when `app_name` has no declarative config (deployed by `serve.run`)."""
    from ray.serve.schema import ServeDeploySchema

    details = client.get_serve_details()
    apps = details.get("applications", {})
    if apps.get(app_name, {}).get("deployed_app_config") is None:
        return False
    # NOTES: Serve 2.60 takes a change of only a deployment's placement options for no change
    # at all (DeploymentState.deploy compares deployment_config, ray_actor_options, route
    # prefix and code version), so the engines' DOMAIN_ENV changes with them.
    info, _ = client.get_deployment_info(deployment, app_name)
    actor_options = dict(info.replica_config.ray_actor_options or {})
    runtime_env = dict(actor_options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), DOMAIN_ENV: domain.domain_id}
    actor_options["runtime_env"] = runtime_env
    configs = []
    for name, app in apps.items():
        config = app.get("deployed_app_config")
        if config is None:
            continue
        if name == app_name:
            entries = list(config.get("deployments", []))
            entry = next((e for e in entries if e.get("name") == deployment), None)
            if entry is None:
                entries.append(entry := {"name": deployment})
            entry.update(placement_group_bundles=[dict(bundle)],
                         placement_group_bundle_label_selector=[dict(domain.selector)],
                         ray_actor_options=actor_options)
            config = {**config, "deployments": entries}
        configs.append(config)
    client.deploy_apps(ServeDeploySchema.model_validate({
        "applications": configs, "target_capacity": details.get("target_capacity")}))
    return True


class CapacityFollower:
    """The coordinator's check: `check` places the groups due again; what it cannot do (no
    domain with room, no declarative config) it logs once per group and lost domain."""

    def __init__(self) -> None:
        self.watch: LostDomainWatch | None = None
        self.reported: set[tuple] = set()

    def check(self, config: DeploymentConfig) -> dict[str, str]:
        """{group id: new domain id} of the groups moved now."""
        grace_s = config.replace_lost_group_after_s
        if grace_s is None:
            return {}
        if self.watch is None or self.watch.grace_s != grace_s:
            self.watch = LostDomainWatch(grace_s)
        deployments = group_deployments(config.name)
        if not deployments:
            return {}
        client = _get_global_client()
        selectors = live_selectors(client, deployments)
        domains = discover_domains(config, own_free=False)
        now = time.monotonic()
        moved = {}
        for group_id in self.watch.due(selectors, domains, config.peer_group_size, now):
            holding = {d.domain_id for d in domains for g, s in selectors.items()
                       if g != group_id and s == d.selector}
            target = replacement_domain(domains, config.peer_group_size, holding)
            if target is None:
                self._report_once(group_id, selectors[group_id], "no domain has room for its "
                                  f"{config.peer_group_size} engine(s) ({domain_summary(domains)});"
                                  " it is placed once one has")
                continue
            if not point_deployment(client, *deployments[group_id], config.bundle, target):
                self._report_once(group_id, selectors[group_id], "the application was started "
                                  "with serve.run, not serve deploy: redeploy it to place the "
                                  "group again")
                continue
            logger.warning("engram-ray: %s of %s: its domain (%s) is lost; placed again in %s",
                           group_id, config.name, selectors[group_id], target.domain_id)
            self.watch.placed(group_id, now)
            moved[group_id] = target.domain_id
            selectors[group_id] = dict(target.selector)  # holds a group now, and its slots:
            domains = [replace(d, num_slots=d.num_slots - config.peer_group_size)
                       if d is target else d for d in domains]
        return moved

    def _report_once(self, group_id: str, selector: dict, why: str) -> None:
        key = (group_id, tuple(sorted(selector.items())), why[:20])
        if key not in self.reported:
            self.reported.add(key)
            logger.warning("engram-ray: %s's domain (%s) is lost and the group is not placed "
                           "again: %s", group_id, selector, why)

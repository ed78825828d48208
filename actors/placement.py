"""Placement: NVLink domains from Ray node labels, and the Serve gang options that keep each
peer group inside one of them.

Ray's scheduler does the placing: a peer group is one Serve gang (`gang_size` =
`peer_group_size`, RESTART_GANG) whose placement group has one bundle per engine, every bundle
with a label selector naming the group's domain (`domain_label_key=<value>`, or the node id
when engines run on CPU and a domain is one node). A bundle can only go to a node of that
domain, so all P engines of a group are in one domain or the group does not start. Which
domain a group gets is decided when the application is built (`plan_groups`, from the
domains' free slots); a group that fits in no domain within `placement_timeout_s` fails the
build with one line (`unplaced_message`), which Serve shows as the application's status.
"""

from __future__ import annotations

import time

import ray

from engram_ray.config import DeploymentConfig
from engram_ray.planning.grouping import (Domain, NodeSlots, PeerGroupPlan, PlacementError,
                                          domain_summary, domains_of, place_groups)


def slot_resource(config: DeploymentConfig) -> tuple[str, float]:
    """The resource an engine slot is counted in, and how much of it one engine takes."""
    if config.is_cpu_only:
        return "CPU", float(config.num_cpus_per_engine)
    return "GPU", float(config.num_gpus_per_engine)


def _free_resources_per_node() -> dict[str, dict]:
    try:  # DeveloperAPI; totals are the fallback when it moves
        from ray._private.state import available_resources_per_node
        return available_resources_per_node()
    except Exception:
        return {}


def engine_deployment_marker(deployment_name: str) -> str:
    """In the name of every engine deployment (and of its gangs' placement groups) of
    `deployment_name`: `<class>:<deployment name>:group-<i>` (`engram_ray.serve.app`)."""
    return f":{deployment_name}:group-"


def own_reservations(config: DeploymentConfig, resource: str) -> dict[str, float]:
    """`resource` per node held by the gangs of this deployment's engines (a redeploy of a
    running application may plan with them: Serve replaces those gangs)."""
    from ray.serve._private.common import GANG_PG_NAME_PREFIX

    marker = engine_deployment_marker(config.name)
    held: dict[str, float] = {}
    for pg in ray.util.placement_group_table().values():
        if pg.get("state") != "CREATED" or not pg.get("name", "").startswith(GANG_PG_NAME_PREFIX) \
                or marker not in pg["name"]:
            continue
        for index, node_id in pg.get("bundles_to_node_id", {}).items():
            amount = pg["bundles"][index].get(resource, 0.0)
            held[node_id] = held.get(node_id, 0.0) + amount
    return held


def discover_nodes(config: DeploymentConfig, own_free: bool = True) -> list[NodeSlots]:
    """Alive nodes with their domain label and free engine slots (this deployment's own
    gangs counted as free, unless not `own_free`)."""
    resource, per_engine = slot_resource(config)
    free = _free_resources_per_node()
    held = own_reservations(config, resource) if own_free else {}
    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        node_id = node["NodeID"]
        total = node.get("Resources", {}).get(resource, 0.0)
        available = free.get(node_id, node.get("Resources", {})).get(resource, 0.0)
        available = min(total, available + held.get(node_id, 0.0))
        # NOTES: the small epsilon absorbs Ray's fixed-point resource arithmetic (0.1 * 3).
        nodes.append(NodeSlots(node_id, node.get("Labels", {}).get(config.domain_label_key),
                               int(available / per_engine + 1e-6),
                               int(total / per_engine + 1e-6)))
    return nodes


def discover_domains(config: DeploymentConfig, own_free: bool = True) -> list[Domain]:
    return domains_of(discover_nodes(config, own_free), config.domain_label_key,
                      node_is_domain=config.is_cpu_only)


def check_room_beside(config: DeploymentConfig, domains: dict[str, str]) -> None:
    """`serving.rollout.mode: beside`: every domain holding groups (`domains`: group id ->
    domain id) has `peer_group_size` free slots beside the gangs serving there, so a new gang
    can start next to an old one (groups sharing a domain then roll in turn); else
    PlacementError naming the domains short of room and what to do."""
    free = {d.domain_id: d.num_slots for d in discover_domains(config, own_free=False)}
    short = sorted({d for d in domains.values() if free.get(d, 0) < config.peer_group_size})
    if short:
        raise PlacementError(
            f"serving.rollout.mode beside needs {config.peer_group_size} free engine slot(s) "
            f"beside the serving gangs in each domain with groups; "
            + ", ".join(f"{d} has {free.get(d, 0)}" for d in short)
            + ": free slots there, or set serving.rollout.mode: restart (every group restarts "
              "at once: an outage of one cold start)")


def plan_groups(config: DeploymentConfig, num_groups: int,
                keep: dict[str, str] | None = None) -> list[PeerGroupPlan]:
    """`num_groups` peer groups, each given a domain with room for it (a group of `keep`,
    group id -> domain id, stays where it runs while it has room there); waits up to
    `placement_timeout_s` for room (nodes joining, GPUs being freed), then `PlacementError`."""
    deadline = time.monotonic() + config.placement_timeout_s
    while True:
        domains = discover_domains(config)
        placed, num_missing = place_groups(domains, config.peer_group_size, num_groups, keep)
        if not num_missing:
            return placed
        if time.monotonic() >= deadline:
            raise PlacementError(unplaced_message(config, num_groups, placed, domains))
        time.sleep(1.0)


def unplaced_message(config: DeploymentConfig, num_groups: int, placed: list[PeerGroupPlan],
                     domains: list[Domain]) -> str:
    """One line: the groups that cannot be placed, what each needs, every domain's free
    slots, what to do."""
    resource, _ = slot_resource(config)
    placed_ids = {g.group_id for g in placed}
    missing = [f"group-{i}" for i in range(num_groups) if f"group-{i}" not in placed_ids]
    return (f"peer group(s) {', '.join(missing)} of {num_groups} cannot be placed within "
            f"{config.placement_timeout_s:g} s (placement_timeout_s): each needs "
            f"{config.peer_group_size} x {config.bundle} in one NVLink domain "
            f"({config.domain_label_key}); domains (free/total {resource}s): "
            f"{domain_summary(domains)}; placed: "
            + (", ".join(f"{g.group_id} in {g.domain.domain_id}" for g in placed) or "none")
            + "; free slots in one domain, add nodes, or lower serving.num_peer_groups or "
              "deployment.peer_group_size")


def gang_options(config: DeploymentConfig, group: PeerGroupPlan) -> dict:
    """Serve deployment options making `group` one gang of `peer_group_size` replicas inside
    its domain. PACK keeps a one-host domain's group on as few nodes as it can; the label
    selector, not the strategy, is what keeps it in the domain."""
    return {"num_replicas": config.peer_group_size,
            "gang_scheduling_config": {"gang_size": config.peer_group_size,
                                       "gang_placement_strategy": "PACK",
                                       "runtime_failure_policy": "RESTART_GANG"},
            "placement_group_bundle_label_selector": [dict(group.domain.selector)]}

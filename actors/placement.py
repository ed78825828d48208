"""Placement: NVLink domains from Ray node labels, one placement group per peer group.

Each peer group gets a placement group of `peer_group_size` bundles (`config.bundle`: one GPU,
or CPUs for engines on CPU), every bundle restricted to the group's domain by a bundle label
selector on the domain label (`ray.io/node-id` when the domain is one node), STRICT_PACK when
the domain is one host, PACK otherwise. Engine actors are pinned one per bundle.
"""

from __future__ import annotations

import time

import ray
from ray.util.placement_group import (PlacementGroup, placement_group,
                                      remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engram_ray.config import DeploymentConfig
from engram_ray.grouping import (Domain, NodeSlots, PeerGroupPlan, PlacementError,
                                 describe_domains, domains_of)


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


def discover_nodes(config: DeploymentConfig) -> list[NodeSlots]:
    """Alive nodes with their domain label and free engine slots."""
    resource, per_engine = slot_resource(config)
    free = _free_resources_per_node()
    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        node_id = node["NodeID"]
        total = node.get("Resources", {}).get(resource, 0.0)
        available = free.get(node_id, node.get("Resources", {})).get(resource, 0.0)
        # NOTES: the small epsilon absorbs Ray's fixed-point resource arithmetic (0.1 * 3).
        nodes.append(NodeSlots(node_id, node.get("Labels", {}).get(config.domain_label_key),
                               int(available / per_engine + 1e-6),
                               int(total / per_engine + 1e-6)))
    return nodes


def discover_domains(config: DeploymentConfig) -> list[Domain]:
    return domains_of(discover_nodes(config), config.domain_label_key,
                      node_is_domain=config.is_cpu_only)


def placement_strategy(domain: Domain) -> str:
    return "STRICT_PACK" if domain.is_single_host else "PACK"


def reserve_group(group: PeerGroupPlan, config: DeploymentConfig) -> PlacementGroup:
    """A ready placement group for `group`; `PlacementError` after `placement_timeout_s`."""
    pg = placement_group([dict(config.bundle) for _ in range(group.size)],
                         strategy=placement_strategy(group.domain),
                         name=f"{config.name}-{group.group_id}",
                         bundle_label_selector=[dict(group.domain.selector)
                                                for _ in range(group.size)])
    if pg.wait(config.placement_timeout_s):
        return pg
    remove_placement_group(pg)
    raise PlacementError(infeasible_message(group, config, discover_domains(config)))


def infeasible_message(group: PeerGroupPlan, config: DeploymentConfig,
                       domains: list[Domain]) -> str:
    resource, _ = slot_resource(config)
    return (f"placement group for peer group {group.group_id} was not placed within "
            f"{config.placement_timeout_s:g} s (placement_timeout_s).\n"
            f"Asked: {group.size} bundles of {config.bundle}, {placement_strategy(group.domain)}, "
            f"all on nodes with {group.domain.selector}.\n"
            f"Domains Ray knows now (free {resource} slots):\n{describe_domains(domains)}\n"
            "Free the domain's GPUs (other placement groups or actors hold them), lower "
            "peer_group_size, or raise placement_timeout_s if nodes are still joining.")


def engine_options(pg: PlacementGroup, bundle_index: int, config: DeploymentConfig) -> dict:
    """`.options(...)` pinning one engine actor to bundle `bundle_index` of `pg`."""
    return dict(
        num_gpus=config.num_gpus_per_engine,
        num_cpus=config.num_cpus_per_engine,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle_index,
            placement_group_capture_child_tasks=False))


def wait_for_free(resource: str, amount: float, timeout_s: float) -> bool:
    """Wait until the cluster reports at least `amount` of `resource` free (released
    resources reach Ray's resource view a moment after their actors and groups are gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.available_resources().get(resource, 0.0) >= amount - 1e-6:
            return True
        time.sleep(0.1)
    return False


def release_group(pg: PlacementGroup | None) -> None:
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # already removed, or Ray is shutting down
            pass

"""NVLink domains of a Ray cluster and the peer groups that fit inside them. Pure: no Ray.

A domain is a set of engine slots (GPUs, or CPU slots for engines on CPU) whose members can
read each other's memory. Nodes carrying the same value of the domain label form one domain.
Nodes without the label, or labelled `none`, are isolated: each GPU is its own domain. With
`node_is_domain` (engines on CPU) every node is a domain of its own.

`place_groups` puts the groups a deployment asks for into the domains (a domain may hold
several); what fits nowhere is counted, and the caller reports it (`actors/placement.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engram_ray.errors import EngramRayError
from engram_ray.planning.topology import NO_DOMAIN

NODE_ID_LABEL_KEY = "ray.io/node-id"  # Ray sets it on every node


class PlacementError(EngramRayError):
    """The cluster cannot hold the requested peer groups."""


@dataclass(frozen=True)
class NodeSlots:
    """One alive Ray node: its domain label and its free engine slots."""

    node_id: str
    domain_label: str | None
    num_slots: int
    num_total_slots: int | None = None


@dataclass(frozen=True)
class Domain:
    """Engine slots that can be peers. `selector` picks its nodes in a bundle label selector."""

    domain_id: str
    node_ids: tuple[str, ...]
    num_slots: int
    selector: dict
    is_isolated: bool = False  # no NVLink between its slots: only groups of 1
    num_total_slots: int | None = None  # free or not

    @property
    def is_single_host(self) -> bool:
        return len(self.node_ids) == 1


@dataclass(frozen=True)
class PeerGroupPlan:
    """One peer group to start: `size` slots of one domain."""

    group_id: str
    domain: Domain
    index: int
    size: int


def domains_of(nodes: list[NodeSlots], label_key: str, *,
               node_is_domain: bool = False) -> list[Domain]:
    """Domains of the alive nodes, sorted by id. Nodes with no free slot still appear."""
    if node_is_domain:
        return sorted((Domain(f"node-{n.node_id[:12]}", (n.node_id,), n.num_slots,
                              {NODE_ID_LABEL_KEY: n.node_id},
                              num_total_slots=n.num_total_slots) for n in nodes),
                      key=lambda d: d.domain_id)
    by_label: dict[str, list[NodeSlots]] = {}
    domains = []
    for node in nodes:
        if node.domain_label in (None, "", NO_DOMAIN):
            domains.append(Domain(f"isolated-{node.node_id[:12]}", (node.node_id,),
                                  node.num_slots, {NODE_ID_LABEL_KEY: node.node_id},
                                  is_isolated=True, num_total_slots=node.num_total_slots))
        else:
            by_label.setdefault(node.domain_label, []).append(node)
    for value, members in by_label.items():
        domains.append(Domain(value, tuple(sorted(n.node_id for n in members)),
                              sum(n.num_slots for n in members), {label_key: value},
                              num_total_slots=sum(n.num_total_slots or 0 for n in members)))
    return sorted(domains, key=lambda d: d.domain_id)


def place_groups(domains: list[Domain], peer_group_size: int, num_groups: int,
                 keep: dict[str, str] | None = None) -> tuple[list[PeerGroupPlan], int]:
    """`num_groups` groups `group-0..` put in the domains one per domain in turn (in domain
    order, skipping a domain once it has no room for another), so groups land in separate
    failure domains while there are more domains than groups. `keep` (group id -> domain id:
    where the groups run now) first: a group stays in its domain while that has room for it,
    so a redeploy moves no group that need not move. Returns (placed groups by index, number
    that fit nowhere)."""
    room = {d.domain_id: 0 if d.is_isolated and peer_group_size > 1
            else d.num_slots // peer_group_size for d in domains}
    by_id = {d.domain_id: d for d in domains}
    placed: dict[int, Domain] = {}
    for index in range(num_groups):
        kept = (keep or {}).get(f"group-{index}")
        if room.get(kept):
            room[kept] -= 1
            placed[index] = by_id[kept]
    waiting = [i for i in range(num_groups) if i not in placed]
    while waiting and any(room.values()):
        for domain in domains:
            if room[domain.domain_id] and waiting:
                room[domain.domain_id] -= 1
                placed[waiting.pop(0)] = domain
    groups = [PeerGroupPlan(f"group-{i}", placed[i], i, peer_group_size) for i in sorted(placed)]
    return groups, num_groups - len(groups)


def replacement_domain(domains: list[Domain], peer_group_size: int,
                       holding_groups: set[str]) -> Domain | None:
    """Where a group whose domain was lost goes: a domain with `peer_group_size` free slots
    (`num_slots`: not held by any gang), one holding no group first (groups in separate
    failure domains), then the one with the most free slots; None when none has room."""
    fits = [d for d in domains if d.num_slots >= peer_group_size
            and not (d.is_isolated and peer_group_size > 1)]
    if not fits:
        return None
    return min(fits, key=lambda d: (d.domain_id in holding_groups, -d.num_slots, d.domain_id))


def domain_summary(domains: list[Domain] | tuple[Domain, ...], what: str = "GPU") -> str:
    """`a 1/4, b 0/4` (free/total slots per domain) for one-line reports."""
    if not domains:
        return "no alive node"
    return ", ".join(f"{d.domain_id} {d.num_slots}/{d.num_total_slots}"
                     + (" (isolated)" if d.is_isolated else "") for d in domains)

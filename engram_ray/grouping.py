"""NVLink domains of a Ray cluster and the peer groups that fit inside them. Pure: no Ray.

A domain is a set of engine slots (GPUs, or CPU slots for engines on CPU) whose members can
read each other's memory. Nodes carrying the same value of the domain label form one domain.
Nodes without the label, or labelled `none`, are isolated: each GPU is its own domain. With
`node_is_domain` (engines on CPU) every node is a domain of its own.

`form_peer_groups` cuts each domain into as many groups of `peer_group_size` as fit; a domain
may hold several groups. Slots that do not fill a group are reported with the reason, never
used silently.
"""

from __future__ import annotations

from dataclasses import dataclass

from engram_ray.errors import EngramRayError
from engram_ray.topology import NO_DOMAIN, label_value

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


@dataclass(frozen=True)
class UnusedSlots:
    domain_id: str
    num_slots: int
    reason: str


@dataclass(frozen=True)
class GroupingPlan:
    groups: tuple[PeerGroupPlan, ...]
    unused: tuple[UnusedSlots, ...]
    domains: tuple[Domain, ...]
    peer_group_size: int

    def groups_in(self, domain_id: str) -> list[PeerGroupPlan]:
        return [g for g in self.groups if g.domain.domain_id == domain_id]


def domains_of(nodes: list[NodeSlots], label_key: str, *,
               node_is_domain: bool = False) -> list[Domain]:
    """Domains of the alive nodes, sorted by id. Nodes with no free slot still appear."""
    if node_is_domain:
        return sorted((Domain(f"node-{n.node_id[:12]}", (n.node_id,), n.num_slots,
                              {NODE_ID_LABEL_KEY: n.node_id}) for n in nodes),
                      key=lambda d: d.domain_id)
    by_label: dict[str, list[NodeSlots]] = {}
    domains = []
    for node in nodes:
        if node.domain_label in (None, "", NO_DOMAIN):
            domains.append(Domain(f"isolated-{node.node_id[:12]}", (node.node_id,),
                                  node.num_slots, {NODE_ID_LABEL_KEY: node.node_id},
                                  is_isolated=True))
        else:
            by_label.setdefault(node.domain_label, []).append(node)
    for value, members in by_label.items():
        domains.append(Domain(value, tuple(sorted(n.node_id for n in members)),
                              sum(n.num_slots for n in members), {label_key: value}))
    return sorted(domains, key=lambda d: d.domain_id)


def group_name(domain_id: str, index: int) -> str:
    """Group id: `<domain>-g<index>`, usable as a folder name and in actor names."""
    return label_value(f"{domain_id}-g{index}")


def form_peer_groups(domains: list[Domain], peer_group_size: int) -> GroupingPlan:
    """As many groups of `peer_group_size` as fit in each domain; the rest reported unused."""
    if not isinstance(peer_group_size, int) or peer_group_size < 1:
        raise ValueError(f"peer_group_size is {peer_group_size!r}, expected an integer >= 1")
    groups, unused = [], []
    for domain in domains:
        num_groups = domain.num_slots // peer_group_size
        if domain.is_isolated and peer_group_size > 1:
            num_groups = 0
        groups += [PeerGroupPlan(group_name(domain.domain_id, i), domain, i, peer_group_size)
                   for i in range(num_groups)]
        num_left = domain.num_slots - num_groups * peer_group_size
        if num_left:
            unused.append(UnusedSlots(domain.domain_id, num_left,
                                      _unused_reason(domain, num_groups, num_left,
                                                     peer_group_size)))
    return GroupingPlan(tuple(groups), tuple(unused), tuple(domains), peer_group_size)


def _unused_reason(domain: Domain, num_groups: int, num_left: int, size: int) -> str:
    if domain.is_isolated:
        return (f"node {domain.node_ids[0][:12]} has no NVLink domain label (or `none`): its "
                f"GPUs cannot be peers, so no group of {size} can form there; label it with "
                "`ray start --labels \"$(engram-ray node-labels)\"` if its GPUs are NVLink peers")
    if num_groups == 0:
        return (f"domain has {domain.num_slots} free slot(s), fewer than peer_group_size {size}: "
                "unable to form a peer group")
    return f"{num_left} slot(s) left over after {num_groups} group(s) of {size}"


def describe_domains(domains: list[Domain] | tuple[Domain, ...]) -> str:
    """One line per domain: id, nodes, free slots (for errors and logs)."""
    if not domains:
        return "  (no alive node)"
    return "\n".join(
        f"  {d.domain_id}: {d.num_slots} free slot(s) on {len(d.node_ids)} node(s)"
        + (" [isolated: no NVLink peers]" if d.is_isolated else "") for d in domains)


def check_has_groups(plan: GroupingPlan, what: str = "GPU") -> None:
    """Raise `PlacementError` naming every domain when not one group can form."""
    if plan.groups:
        return
    raise PlacementError(
        f"no peer group of {plan.peer_group_size} {what}s fits in any NVLink domain. "
        f"Domains Ray knows (free {what}s):\n{describe_domains(plan.domains)}\n"
        f"Asked: groups of peer_group_size={plan.peer_group_size}, each inside one domain. "
        "Lower peer_group_size, add nodes to a domain, or label the nodes with their domain "
        "(`engram-ray node-labels`).")

"""The generations of a deployment's peer groups: the coordinator's bookkeeping. Pure: no Ray.

A peer group is one Serve gang (`actors/placement.py`); Serve gives every member its rank,
the world size and the gang id, and restarts the whole gang when one member fails. A new gang
id therefore is a new generation: the first member that joins with it opens generation n+1
(a fresh id and store folder, 0700) and the previous generation's folder is removed: its
members were stopped before Serve started the new gang.

    book = GenerationBook(deployment_config, layout, {"group-0": "domain-a"})
    book.join("group-0", gang_id, rank, world_size, replica_id, node_labels) -> assignment dict
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from engram_ray.assignment import (create_store_dir, generation_id, generation_store_dir,
                                   group_store_root, remove_store_dir, slices_of)
from engram_ray.config import DeploymentConfig
from engram_ray.errors import EngramRayError
from engram_ray.layout import EngramLayout


class GroupMismatchError(EngramRayError):
    """A replica's gang does not match the peer group it was deployed as."""


@dataclass
class Generation:
    index: int
    generation: str
    gang_id: str
    store_dir: str
    members: dict = field(default_factory=dict)   # rank -> {"replica_id", "node_labels"}
    started_at: float = field(default_factory=time.time)


@dataclass
class GroupRecord:
    group_id: str
    domain_id: str
    current: Generation | None = None
    history: list = field(default_factory=list)    # (index, gang id, seconds it lived)


class GenerationBook:
    def __init__(self, config: DeploymentConfig, layout: EngramLayout, domains: dict[str, str]):
        self.config, self.layout = config, layout
        self.groups = {gid: GroupRecord(gid, domain) for gid, domain in domains.items()}

    def join(self, group_id: str, gang_id: str, rank: int, world_size: int, replica_id: str,
             node_labels: dict | None = None) -> dict:
        """The assignment of member `rank` of gang `gang_id` (a new gang opens a generation)."""
        size = self.config.peer_group_size
        if group_id not in self.groups or world_size != size or not 0 <= rank < size:
            raise GroupMismatchError(
                f"replica {replica_id}: gang of {world_size} (rank {rank}) joined peer group "
                f"{group_id!r}; expected one of {sorted(self.groups)} with peer_group_size "
                f"{size}: the Serve application and its coordinator disagree, redeploy it")
        group = self.groups[group_id]
        if group.current is None or group.current.gang_id != gang_id:
            self._open(group, gang_id)
        gen = group.current
        gen.members[rank] = {"replica_id": replica_id, "node_labels": dict(node_labels or {})}
        return self._assignment(group, gen, rank)

    def _open(self, group: GroupRecord, gang_id: str) -> None:
        old = group.current
        if old is not None:
            group.history.append((old.index, old.gang_id, round(time.time() - old.started_at, 1)))
            remove_store_dir(old.store_dir)
        index = old.index + 1 if old else 1
        gen_id = generation_id(self.config.name, group.group_id, index, secrets.token_hex(3))
        store = create_store_dir(generation_store_dir(
            self.config.peer_group_store, self.config.name, group.group_id, gen_id))
        group.current = Generation(index, gen_id, gang_id, store)

    def _assignment(self, group: GroupRecord, gen: Generation, rank: int) -> dict:
        dep = self.config
        return {"group_id": group.group_id, "domain_id": group.domain_id, "member_rank": rank,
                "size": dep.peer_group_size, "generation": gen.generation,
                "generation_index": gen.index, "gang_id": gen.gang_id, "store": gen.store_dir,
                "timeout_s": dep.rendezvous_timeout_s, "backend": dep.table_backend,
                "handle_type": dep.handle_type,
                "slices": [(s.layer_id, s.start, s.end)
                           for s in slices_of(self.layout, rank, dep.peer_group_size)]}

    def leave(self, replica_id: str) -> None:
        for group in self.groups.values():
            gen = group.current
            for rank, member in list(gen.members.items()) if gen else ():
                if member["replica_id"] == replica_id:
                    del gen.members[rank]

    def num_members(self) -> int:
        return sum(len(g.current.members) for g in self.groups.values() if g.current)

    def remove_stores(self) -> None:
        for group_id in self.groups:
            remove_store_dir(group_store_root(self.config.peer_group_store, self.config.name,
                                              group_id))

    def status(self) -> dict:
        return {gid: {"domain": g.domain_id,
                      "generation": g.current.generation if g.current else None,
                      "generation_index": g.current.index if g.current else 0,
                      "gang_id": g.current.gang_id if g.current else None,
                      "store": g.current.store_dir if g.current else None,
                      "members": {r: dict(m) for r, m in g.current.members.items()}
                      if g.current else {},
                      "history": list(g.history)}
                for gid, g in self.groups.items()}

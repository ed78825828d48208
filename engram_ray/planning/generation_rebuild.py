"""A restarted coordinator's book, rebuilt from its members (`engram_ray.planning.generations`,
`actors/lifetime.py`). Pure.

Every live member tells it what it holds (`rejoin`); `is_complete` says when every group has
all its members back; `unclaimed_store_dirs` are the generation folders no rebuilt generation
owns (left by gangs that ended while no coordinator ran).
"""

from __future__ import annotations

import os
import time

from engram_ray.planning.assignment import group_store_root
from engram_ray.planning.generation_state import Generation


class RebuildMixin:
    def rejoin(self, member: dict) -> bool:
        """Rebuild member `member["replica_id"]` from what it holds: `assignment` (as `join`
        gave it), `node_labels`, `ready_at` (wall time its engine served, or None),
        `restarting` ({"reason", "since", "epoch"} or None), `dp_epoch` (restarts in place of
        its data-parallel gang so far), `broken` (why it is lost, or None). False
        when its group has a newer generation or another config (it is being replaced)."""
        a = member["assignment"]
        group = self.groups.get(a["group_id"])
        if group is None or a["size"] != self.config.peer_group_size:
            return False
        gen = next((g for g in group.generations() if g.generation == a["generation"]), None)
        if gen is None:
            if group.current is not None and group.current.index > a["generation_index"]:
                return False
            gen = Generation(a["generation_index"], a["generation"], a["gang_id"],
                             a["store_dir"])
            if group.current is not None and member.get("ready_at") is None:
                group.next = gen  # a gang that was starting beside the current one
            else:
                group.current = gen
        rank = a["member_rank"]
        gen.members[rank] = {"replica_id": member["replica_id"],
                             "node_labels": dict(member.get("node_labels") or {})}
        if member.get("ready_at") is not None:
            gen.ready_at[rank] = member["ready_at"]
        if member.get("restarting"):
            gen.restarting[rank] = dict(member["restarting"])
        if member.get("dp_epoch"):  # restarts in place of its DP gang so far: never reused
            dp_gang = rank // self.dp_size
            gen.dp_epochs[dp_gang] = max(gen.dp_epochs.get(dp_gang, 0), member["dp_epoch"])
        if member.get("broken") and gen.broken is None:
            gen.broken, gen.broken_at = f"member {rank}: {member['broken']}", time.time()
        return True

    def is_complete(self) -> bool:
        """Every group has a current generation with all its members known."""
        size = self.config.peer_group_size
        return all(g.current is not None and len(g.current.members) == size
                   for g in self.groups.values())

    def unclaimed_store_dirs(self) -> list[str]:
        """Generation folders under the groups' store roots that no current generation owns."""
        found = []
        for gid, group in self.groups.items():
            root = group_store_root(self.config.peer_group_store, self.config.name, gid)
            owned = {g.store_dir for g in group.generations()}
            found += [os.path.join(root, name) for name in _listdir(root)
                      if os.path.join(root, name) not in owned]
        return sorted(found)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []

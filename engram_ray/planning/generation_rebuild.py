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
        its data-parallel gang so far), `broken` (why it is lost, or None), `role` ("serving",
        "starting": its start has not returned, "retired": a rolling change replaced its
        gang). Its generation goes where its role says (`_place`), whatever order the members
        rejoin in. False when its group has a newer generation or another config (it is
        being replaced)."""
        a = member["assignment"]
        group = self.groups.get(a["group_id"])
        if group is None or a["size"] != self.config.peer_group_size:
            return False
        gen = next((g for g in group.generations() if g.generation == a["generation"]), None)
        if gen is None:
            gen = Generation(a["generation_index"], a["generation"], a["gang_id"],
                             a["store_dir"])
            if a.get("holder_token"):  # the members' holders check the one they were given
                gen.holder_token = a["holder_token"]
            if not _place(group, gen, member_role(member), bool(a.get("beside"))):
                return False
        rank = a["member_rank"]
        gen.members[rank] = {"replica_id": member["replica_id"],
                             "node_labels": dict(member.get("node_labels") or {})}
        if member.get("ready_at") is not None:
            gen.ready_at[rank] = member["ready_at"]
        if member_role(member) == "serving":
            gen.running.add(rank)  # its start returned: Serve runs it
        if member.get("restarting"):
            gen.restarting[rank] = dict(member["restarting"])
        if member.get("dp_epoch"):  # restarts in place of its DP gang so far: never reused
            dp_gang = rank // self.dp_size
            gen.dp_epochs[dp_gang] = max(gen.dp_epochs.get(dp_gang, 0), member["dp_epoch"])
        if member.get("broken") and gen.broken is None:
            gen.broken, gen.broken_at = f"member {rank}: {member['broken']}", time.time()
        return True

    def end_rebuild(self) -> None:
        """Every member that will rejoin has: a gang current beside an older retired one had
        taken over before the restart (it serves once Serve runs every member)."""
        for group in self.groups.values():
            gen = group.current
            if gen is not None and group.retired is not None and gen.index > group.retired.index:
                gen.took_over, gen.took_over_at = True, time.time()

    def is_complete(self) -> bool:
        """Every group has a current generation with all its members known, and none is a
        gang started beside a serving one whose members have not all rejoined yet (ending
        the rebuild then would route the group to the starting gang: not serving)."""
        size = self.config.peer_group_size
        return all(g.current is not None and len(g.current.members) == size
                   and not g.current.awaits_serving for g in self.groups.values())

    def unclaimed_store_dirs(self) -> list[str]:
        """Generation folders under the groups' store roots that no current generation owns."""
        found = []
        for gid, group in self.groups.items():
            root = group_store_root(self.config.peer_group_store, self.config.name, gid)
            owned = {g.store_dir for g in group.generations()}
            found += [os.path.join(root, name) for name in _listdir(root)
                      if os.path.join(root, name) not in owned]
        return sorted(found)


def member_role(member: dict) -> str:
    """A rejoining member's role; members of an older release send none: serving once
    ready."""
    return member.get("role") or ("serving" if member.get("ready_at") is not None
                                  else "starting")


def _place(group, gen: Generation, role: str, beside: bool = False) -> bool:
    """Put a rebuilt generation where its member's `role` says, whatever order the members
    rejoin in: a serving gang is `current` (one rebuilt earlier from a starting gang's
    member moves to `next`), a starting gang is `next` beside a current one (or `current`
    alone: a first start, or a gang that took over from a `retired` one), a retired gang is
    `retired`. False when a newer generation holds the place (this gang is being
    replaced). `beside`: a starting gang that started beside a serving one (its assignment
    says so): alone as `current`, it awaits that one (`Generation.awaits_serving`)."""
    gen.rebuilt_as = role
    if role == "retired":
        if group.retired is not None and group.retired.index > gen.index:
            return False
        group.retired = gen
        if group.current is not None:  # the gang it waited for had been replaced already
            group.current.awaits_serving = False
        return True
    current = group.current
    if current is None:
        group.current = gen
        gen.awaits_serving = role == "starting" and beside and group.retired is None
        return True
    if role == "serving":
        if current.rebuilt_as == "starting" and current.index > gen.index:
            group.next, group.current = current, gen  # the starting gang rejoined first
            return True
        # Two serving gangs: the coordinator died as the newer took over, before the older
        # heard it was retired. The newer serves; the older drains.
        older, newer = sorted((current, gen), key=lambda g: g.index)
        if group.retired is not None:
            return False
        group.current, group.retired = newer, older
        return True
    if current.index < gen.index and group.next is None:
        group.next = gen
        return True
    return False


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []

"""The generations of a deployment's peer groups: the coordinator's bookkeeping. Pure: no Ray.

A peer group is one Serve gang (`actors/placement.py`); Serve gives every member its rank,
the world size and the gang id, and restarts the whole gang when one member fails. A new gang
id therefore is a new generation: the first member that joins with it opens generation n+1
(a fresh id and store folder, 0700) and the previous generation's folder is removed: its
members were stopped before Serve started the new gang.

    book = GenerationBook(deployment_config, layout, {"group-0": "domain-a"})
    book.join("group-0", gang_id, rank, world_size, replica_id, node_labels) -> assignment dict
    book.member_ready(replica_id)                   # its engine serves (again)
    book.member_restarting(replica_id, why)         # its engine died, restarts in place
    book.break_generation(group_id, generation, why)  # a member lost: stop routing to it
    book.routing() -> {group_id: {"generation", "serving", "reason", "serving_members",
                                  "restarting_ranks"}}
    book.rejoin(member_record)                      # a restarted coordinator learns a member

A coordinator that restarts rebuilds this book from its members
(`engram_ray.planning.generation_rebuild`); a rolling change starts a gang beside the serving
one, which takes over once ready (`engram_ray.planning.generation_rollout`).

A group serves (the ingress sends it requests) while its current generation has had every
member ready, none lost, and at least one member not restarting; requests go to the members
that serve (`serving_members`: their replica ids). A member whose engine died but whose
replica holds its slices restarts that engine in the same generation (engines serve side by
side when they read the same rows: `engram_ray.tables.holding`); a member lost (its replica, GPU or node, or a
restart that failed) breaks the generation for good: Serve restarts the whole gang, and the
next gang opens a new generation.
"""

# Over 300 lines: every transition of a group's generations (join, ready, restart in place,
# break, leave, routing) reads and writes the same book (the coordinator calls it under its
# lock); the rollout's and the rebuild's are mixins beside it (generation_rollout,
# generation_rebuild).

from __future__ import annotations

import secrets
import time

from engram_ray.config import DeploymentConfig
from engram_ray.errors import EngramRayError
from engram_ray.model.layout import EngramLayout
from engram_ray.planning.assignment import (create_store_dir, deaths_dir, generation_id,
                                            generation_store_dir, group_store_root,
                                            remove_store_dir, slices_of)
from engram_ray.planning.generation_rebuild import RebuildMixin
from engram_ray.planning.generation_rollout import RolloutMixin
from engram_ray.planning.generation_state import Generation, GroupRecord


class GroupMismatchError(EngramRayError):
    """A replica's gang does not match the peer group it was deployed as."""


class GenerationBook(RolloutMixin, RebuildMixin):
    def __init__(self, config: DeploymentConfig, layout: EngramLayout, domains: dict[str, str],
                 dp_size: int = 1):
        self.config, self.layout = config, layout
        self.dp_size = dp_size  # engines per data-parallel gang (serving.data_parallel_size)
        self.groups = {gid: GroupRecord(gid, domain) for gid, domain in domains.items()}
        # Gang ids of generations that ended (their members are gone): the coordinator
        # removes what they kept outside the book (DP round keys) and empties this.
        self.ended_gangs: list[str] = []

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
        gen = next((g for g in (group.current, group.next) if g and g.gang_id == gang_id), None)
        if gen is None and group.current is not None and group.current.is_serving(size):
            gen = group.next = self._new_generation(group, gang_id)  # beside: a rolling change
            if group.retired is not None:
                self._end(group, group.retired)
                group.retired = None
        elif gen is None:
            if group.current is not None:
                self._end(group, group.current)
            if group.next is not None:
                self._end(group, group.next)
                group.next = None
            gen = group.current = self._new_generation(group, gang_id)
        gen.members[rank] = {"replica_id": replica_id, "node_labels": dict(node_labels or {})}
        return self._assignment(group, gen, rank)

    def reconfigure(self, config: DeploymentConfig, domains: dict[str, str]) -> None:
        """A changed config rolling out: new generations use `config`; a group of `domains`
        is kept (a new gang of it goes to its new domain), added, or dropped with its store
        folders (Serve deletes its deployment)."""
        self.config = config
        for gid in [g for g in self.groups if g not in domains]:
            self.ended_gangs += [g.gang_id for g in self.groups[gid].generations()]
            del self.groups[gid]
            remove_store_dir(group_store_root(config.peer_group_store, config.name, gid))
        for gid, domain in domains.items():
            self.groups.setdefault(gid, GroupRecord(gid, domain)).domain_id = domain

    def _new_generation(self, group: GroupRecord, gang_id: str) -> Generation:
        index = max((g.index for g in group.generations()), default=0) + 1
        gen_id = generation_id(self.config.name, group.group_id, index, secrets.token_hex(3))
        store = create_store_dir(generation_store_dir(
            self.config.peer_group_store, self.config.name, group.group_id, gen_id))
        return Generation(index, gen_id, gang_id, store)

    def _end(self, group: GroupRecord, old: Generation) -> None:
        """`old` ends: recorded in the group's history, its store folder removed."""
        group.history.append({
            "index": old.index, "gang_id": old.gang_id, "generation": old.generation,
            "started_at": old.started_at, "ready_at": dict(old.ready_at),
            "broken": old.broken, "broken_at": old.broken_at, "retired_at": old.retired_at,
            "ended_at": time.time()})
        remove_store_dir(old.store_dir)
        self.ended_gangs.append(old.gang_id)

    def _assignment(self, group: GroupRecord, gen: Generation, rank: int) -> dict:
        dep = self.config
        return {"group_id": group.group_id, "domain_id": group.domain_id, "member_rank": rank,
                "size": dep.peer_group_size, "generation": gen.generation,
                "generation_index": gen.index, "gang_id": gen.gang_id,
                "store_dir": gen.store_dir, "holder_token": gen.holder_token,
                "beside": group.next is gen,  # started beside a serving gang (a rebuild
                                              # waits for that one too)
                "timeout_s": dep.rendezvous_timeout_s, "backend": dep.table_backend,
                "handle_type": dep.handle_type,
                "slices": [(s.layer_id, s.start, s.end)
                           for s in slices_of(self.layout, rank, dep.peer_group_size)]}

    def leave(self, replica_id: str) -> None:
        """A member stopped (Serve stops a gang's members before it starts the next one; a
        replica whose start failed leaves too): its generation never serves again."""
        for group in self.groups.values():
            for gen in group.generations():
                rank = gen.rank_of(replica_id)
                if rank is None:
                    continue
                del gen.members[rank]
                gen.in_flight.pop(rank, None)
                if gen is group.retired:
                    if not gen.members:  # the replaced gang has stopped
                        self._end(group, gen)
                        group.retired = None
                else:
                    self.break_generation(group.group_id, gen.generation,
                                          f"member {rank} stopped")

    def member_ready(self, replica_id: str) -> tuple[str, int] | None:
        """Member `replica_id`'s engine serves; (group id, rank), or None if no current
        generation holds it (its gang was replaced meanwhile)."""
        for group in self.groups.values():
            for gen in (group.current, group.next):
                rank = gen.rank_of(replica_id) if gen else None
                if rank is None:
                    continue
                gen.ready_at.setdefault(rank, time.time())
                restart = gen.restarting.pop(rank, None)
                if restart is not None:
                    gen.restarts.append({"rank": rank, **restart, "ready_at": time.time()})
                if gen is group.next and len(gen.ready_at) == self.config.peer_group_size:
                    self._ready_to_take_over(group)
                return group.group_id, rank
        return None

    def member_restarting(self, replica_id: str, reason: str) -> int | None:
        """Member `replica_id`'s engine restarts inside its replica, in the same generation
        (its engine died, or a roll restarts it): no requests for it until it is ready again.
        With `dp_size` > 1 the unit is the member's data-parallel gang (its engines form one
        vLLM DP group, which cannot lose a rank): every member of that gang restarts with it.
        The restart's number in that gang (1, 2, ...; one restart under way is answered with
        its number to every member that asks), or None when no serving generation holds the
        member (the group is broken already)."""
        member = self.find_member(replica_id)
        gen = self.groups[member[0]].current if member else None
        rank = gen.rank_of(replica_id) if gen else None
        if rank is None or gen.broken is not None or rank not in gen.ready_at:
            return None  # not a current member (one starting beside it restarts its gang)
        if rank in gen.restarting:
            return gen.restarting[rank].get("epoch", 1)
        dp_gang = rank // self.dp_size
        epoch = gen.dp_epochs[dp_gang] = gen.dp_epochs.get(dp_gang, 0) + 1
        for peer in self.dp_ranks(rank):
            why = reason if peer == rank else f"member {rank} of its data-parallel gang: {reason}"
            gen.restarting.setdefault(peer, {"reason": why, "since": time.time(),
                                             "epoch": epoch})
        return epoch

    def dp_ranks(self, rank: int) -> range:
        """The ranks of member `rank`'s data-parallel gang (DP rank d is rank first + d)."""
        first = rank - rank % self.dp_size
        return range(first, first + self.dp_size)

    def dp_peers(self, replica_id: str) -> list[str]:
        """Replica ids of the other members of `replica_id`'s data-parallel gang."""
        member = self.find_member(replica_id)
        if member is None:
            return []
        gen = self.groups[member[0]].current
        if gen is None or gen.generation != member[1]:
            return []
        return [gen.members[r]["replica_id"] for r in self.dp_ranks(member[2])
                if r != member[2] and r in gen.members]

    def restart_epoch(self, replica_id: str) -> int | None:
        """The number of the restart in place member `replica_id` is part of now, if any."""
        member = self.find_member(replica_id)
        gen = self.groups[member[0]].current if member else None
        if gen is None or gen.generation != member[1]:
            return None
        restart = gen.restarting.get(member[2])
        return restart.get("epoch", 1) if restart else None

    def break_generation(self, group_id: str, generation: str, reason: str) -> bool:
        """Generation `generation` of `group_id` stops serving (first reason kept); False if
        it is not the group's current one or was broken already."""
        group = self.groups.get(group_id)
        if group is not None and group.next is not None and group.next.generation == generation:
            group.next.broken = reason  # the gang started beside failed: the current serves on
            self._end(group, group.next)
            group.next = None
            return True
        gen = group.current if group is not None else None
        if gen is None or gen.generation != generation or gen.broken is not None:
            return False
        gen.broken, gen.broken_at = reason, time.time()
        self._take_over_next()  # a group that was taking over no longer holds the others
        return True

    def routing(self) -> dict[str, dict]:
        """Per group: its current generation, whether it serves, and why not."""
        size = self.config.peer_group_size
        table = {}
        for gid, group in self.groups.items():
            gen = group.current
            if gen is None:
                table[gid] = {"generation": None, "serving": False, "reason": "not started"}
                continue
            reason = gen.broken or (None if gen.is_serving(size) else
                                    f"{len(gen.ready_at)} of {size} members ready"
                                    if len(gen.ready_at) < size else
                                    f"taking over ({len(gen.running)} of {size} members "
                                    "running)" if gen.took_over and len(gen.running) < size
                                    else "every member's engine is restarting")
            table[gid] = {"generation": gen.generation, "serving": reason is None,
                          "reason": reason, "serving_members": gen.serving_members(),
                          "restarting_ranks": sorted(gen.restarting)}
        return table

    def whole_group_of(self, replica_id: str) -> str | None:
        """The group id of member `replica_id` when its group's current generation holds it
        and serves whole (every member ready, none restarting, no gang beside it)."""
        for group in self.groups.values():
            gen = group.current
            if gen is None or gen.rank_of(replica_id) is None:
                continue
            whole = (gen.is_serving(self.config.peer_group_size) and not gen.restarting
                     and group.next is None and group.retired is None)
            return group.group_id if whole else None
        return None

    def find_member(self, replica_id: str) -> tuple[str, str, int] | None:
        """(group id, generation, rank) of a member of a current generation (or of the gang
        starting beside it)."""
        for group in self.groups.values():
            for gen in (group.current, group.next):
                rank = gen.rank_of(replica_id) if gen else None
                if rank is not None:
                    return group.group_id, gen.generation, rank
        return None

    def member_ids(self) -> set[str]:
        """Replica ids of every member of every live generation (retired ones included)."""
        return {m["replica_id"] for g in self.groups.values() for gen in g.generations()
                for m in gen.members.values()}

    def num_members(self) -> int:
        return len(self.member_ids())

    def remove_stores(self) -> None:
        """Every group's store folder, the engine-death records, then the deployment's
        folder itself if nothing else is in it; every gang counted ended."""
        self.ended_gangs += [g.gang_id for group in self.groups.values()
                             for g in group.generations()]
        self.ended_gangs += [h["gang_id"] for group in self.groups.values()
                             for h in group.history]
        for group_id in self.groups:
            remove_store_dir(group_store_root(self.config.peer_group_store, self.config.name,
                                              group_id))
        deaths = deaths_dir(self.config.peer_group_store, self.config.name)
        remove_store_dir(str(deaths))
        try:
            deaths.parent.rmdir()
        except OSError:  # not empty (another deployment's leftovers are not ours) or gone
            pass

    def status(self) -> dict:
        return {gid: {"domain": g.domain_id,
                      "generation": g.current.generation if g.current else None,
                      "generation_index": g.current.index if g.current else 0,
                      "gang_id": g.current.gang_id if g.current else None,
                      "store_dir": g.current.store_dir if g.current else None,
                      "members": {r: dict(m) for r, m in g.current.members.items()}
                      if g.current else {},
                      "started_at": g.current.started_at if g.current else None,
                      "ready_at": dict(g.current.ready_at) if g.current else {},
                      "broken": g.current.broken if g.current else None,
                      "broken_at": g.current.broken_at if g.current else None,
                      "restarting": dict(g.current.restarting) if g.current else {},
                      "restarts": list(g.current.restarts) if g.current else [],
                      "starting": g.next.generation if g.next else None,
                      "retired": g.retired.generation if g.retired else None,
                      "history": list(g.history)}
                for gid, g in self.groups.items()}


"""`GroupRegistry`: hands Serve replicas their place in a peer group, and keeps the metric
targets list. One named actor per application (`engram-groups-<deployment name>`), on the head.

Ranks are handed out under one lock (the rank-assigner pattern of Ray Serve LLM). A group's
life is a generation: ranks 0..P-1 of the current generation are claimed by joining replicas;
the engines then meet in their table rendezvous. When a member dies (the watch pings every
member each `health_check_interval_s`), the group moves to a new generation with every rank
free: the replacement replica Serve starts takes a rank at once, and the survivors, whose
health checks now fail (`is_current` is false), are restarted by Serve and take the others.
A replica only joins a group of its own NVLink domain (the node label `domain_label_key`).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

import ray

from engram_ray.assignment import (create_store_dir, generation_id, generation_store_dir,
                                   remove_store_dir)
from engram_ray.errors import EngramRayError
from engram_ray.serving.exposition import write_file_sd


logger = logging.getLogger(__name__)


class NoFreeSlotError(EngramRayError):
    """More replicas than peer-group ranks (num_peer_groups * peer_group_size)."""


@dataclass
class _Generation:
    index: int
    generation: str
    store_dir: str
    members: dict = field(default_factory=dict)   # member rank -> (replica_id, actor handle)
    gangs: dict = field(default_factory=dict)     # gang id -> (base rank, dp_size)
    ready: set = field(default_factory=set)        # ranks whose engine started
    started_at: float = field(default_factory=time.time)


@dataclass
class _Group:
    group_id: str
    domain: str | None = None
    current: _Generation | None = None
    history: list = field(default_factory=list)    # (index, reason) of ended generations


def registry_name(deployment_name: str) -> str:
    return f"engram-groups-{deployment_name}"


@ray.remote(num_cpus=0, max_concurrency=16)
class GroupRegistry:
    def __init__(self, app_config_dict: dict):
        from engram_ray.serving.config import ServeAppConfig

        self.app_config_dict = app_config_dict
        self.config = ServeAppConfig.from_dict(app_config_dict, "registry")
        dep = self.config.deployment
        self.groups = {f"group-{i}": _Group(f"group-{i}")
                       for i in range(self.config.serving.num_peer_groups)}
        self.targets: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._interval_s = dep.health_check_interval_s
        threading.Thread(target=self._watch, daemon=True, name="engram-group-watch").start()

    def describe(self) -> tuple[dict, int]:
        """(the app config it was made with, number of members of current generations)."""
        with self._lock:
            return self.app_config_dict, sum(len(g.current.members) for g in self.groups.values()
                                             if g.current)

    # --- ranks ---------------------------------------------------------------------------
    def join(self, replica_id: str, handle, domain: str | None = None,
             gang_id: str | None = None, dp_rank: int = 0, dp_size: int = 1) -> dict:
        """Claim a member rank for `replica_id`; the assignment as a dict.

        A data-parallel gang (Ray Serve LLM `DPServer`: `gang_id`, `dp_rank`, `dp_size`)
        takes a block of `dp_size` consecutive ranks starting at a multiple of `dp_size`; its
        DP rank d is member `base + d`, the plugin's convention (`rank` in
        `engram_peer_group` is the base). A replica outside a gang is a gang of one."""
        gang_id = gang_id or replica_id
        with self._lock:
            for group in self.groups.values():
                if group.domain not in (None, domain):
                    continue
                gen = group.current or self._new_generation_locked(group, "first start")
                base = self._block_locked(gen, gang_id, dp_size)
                if base is not None:
                    group.domain = domain
                    gen.members[base + dp_rank] = (replica_id, handle)
                    return self._assignment(group, gen, base, base + dp_rank)
        raise NoFreeSlotError(
            f"replica {replica_id} found no free rank: {self.config.num_replicas} ranks in "
            f"{len(self.groups)} peer group(s) of {self.config.deployment.peer_group_size}, all "
            f"taken (domain {domain!r}); lower the replica count or raise num_peer_groups")

    def _block_locked(self, gen: "_Generation", gang_id: str, dp_size: int) -> int | None:
        if gang_id in gen.gangs:
            return gen.gangs[gang_id][0]
        taken = {base + i for base, size in gen.gangs.values() for i in range(size)}
        size = self.config.deployment.peer_group_size
        for base in range(0, size - dp_size + 1, dp_size):
            if not taken & set(range(base, base + dp_size)):
                gen.gangs[gang_id] = (base, dp_size)
                return base
        return None

    def _assignment(self, group: _Group, gen: _Generation, base: int, member: int) -> dict:
        dep = self.config.deployment
        return {"group_id": group.group_id, "rank": base, "member_rank": member,
                "size": dep.peer_group_size, "generation": gen.generation,
                "generation_index": gen.index, "store": gen.store_dir,
                "timeout_s": dep.rendezvous_timeout_s, "backend": dep.table_backend,
                "handle_type": dep.handle_type}

    def _new_generation_locked(self, group: _Group, reason: str) -> _Generation:
        dep = self.config.deployment
        old = group.current
        index = old.index + 1 if old else 1
        if old is not None:
            group.history.append((old.index, reason))
            remove_store_dir(old.store_dir)
            for _, (replica_id, _) in old.members.items():
                self.targets.pop(replica_id, None)
                self.targets.pop(f"{replica_id}/model", None)
            self._write_targets_locked()
        gen_id = generation_id(dep.name, group.group_id, index, secrets.token_hex(3))
        store = generation_store_dir(dep.peer_group_store, dep.name, group.group_id, gen_id)
        create_store_dir(store)
        group.current = _Generation(index, gen_id, store)
        return group.current

    def ready(self, replica_id: str) -> None:
        with self._lock:
            for group in self.groups.values():
                for rank, (rid, _) in (group.current.members.items() if group.current else ()):
                    if rid == replica_id:
                        group.current.ready.add(rank)

    def is_current(self, replica_id: str) -> tuple[bool, str]:
        """(True, "") while `replica_id` holds a rank of its group's current generation."""
        with self._lock:
            for group in self.groups.values():
                gen = group.current
                if gen and any(rid == replica_id for rid, _ in gen.members.values()):
                    return True, ""
            moved = [f"{g.group_id} moved to generation {g.current.index} "
                     f"({g.history[-1][1]})" for g in self.groups.values()
                     if g.current and g.history]
            return False, "; ".join(moved) or "this replica holds no rank"

    def leave(self, replica_id: str, reason: str = "replica stopped") -> None:
        """A member leaving ends its generation (the others must rejoin the next one)."""
        with self._lock:
            self.targets.pop(replica_id, None)
            self.targets.pop(f"{replica_id}/model", None)
            for group in self.groups.values():
                gen = group.current
                if gen and any(rid == replica_id for rid, _ in gen.members.values()):
                    self._new_generation_locked(group, f"{replica_id}: {reason}")
            self._write_targets_locked()

    # --- liveness ------------------------------------------------------------------------
    def _watch(self) -> None:
        while True:  # a failed round is logged; the watch itself must never end
            time.sleep(self._interval_s)
            try:
                self._check_members()
            except Exception:
                logger.exception("engram-ray: peer-group liveness round failed")

    def _check_members(self) -> None:
        """Ping every member once; a dead one moves its group to a new generation."""
        with self._lock:
            members = [(g, rid, h) for g in self.groups.values() if g.current
                       for rid, h in g.current.members.values()]
        for group, replica_id, handle in members:
            if not _is_alive(handle, timeout_s=max(5.0, 5 * self._interval_s)):
                with self._lock:
                    gen = group.current
                    if gen and any(rid == replica_id for rid, _ in gen.members.values()):
                        self._new_generation_locked(group, f"{replica_id} died")

    # --- metric targets --------------------------------------------------------------------
    def register_target(self, key: str, target: str, labels: dict | None = None) -> None:
        with self._lock:
            self.targets[key] = {"target": target, "labels": labels or {}}
            self._write_targets_locked()

    def _write_targets_locked(self) -> None:
        path = self.config.serving.prometheus_targets_file
        try:
            write_file_sd(path, self.targets)
        except OSError as exc:  # Prometheus misses a change; groups must still move on
            logger.error("engram-ray: could not write the Prometheus targets list %s: %s",
                         path, exc)

    def status(self) -> dict:
        with self._lock:
            return {gid: {"domain": g.domain,
                          "generation": g.current.generation if g.current else None,
                          "generation_index": g.current.index if g.current else 0,
                          "members": {r: rid for r, (rid, _) in g.current.members.items()}
                          if g.current else {},
                          "ready": sorted(g.current.ready) if g.current else [],
                          "history": list(g.history)}
                    for gid, g in self.groups.items()}


def _is_alive(handle, timeout_s: float) -> bool:
    """False only when the actor is known dead; a slow answer is not death."""
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=timeout_s)
        return True
    except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
        return True  # unavailable (e.g. its node unreachable for a moment) may recover
    except ray.exceptions.RayActorError:
        return False


def _head_node_id() -> str:
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return node["NodeID"]
    return ray.get_runtime_context().get_node_id()


def get_registry(app_config_dict: dict, deployment_name: str):
    """The application's registry, created on the head node by the first replica that asks.

    A registry is detached, so one left by an earlier deployment of the same name may still
    run: reused when it was made with the same config, replaced when it differs and has no
    members, refused (with what to do) when it differs and still has members.
    An explicit node-affinity strategy keeps it out of the asking replica's placement group
    (a child actor would otherwise be captured into the replica's bundle)."""
    registry = _registry_actor(app_config_dict, deployment_name)
    config, num_members = ray.get(registry.describe.remote())
    if config == app_config_dict:
        return registry
    if num_members:
        raise EngramRayError(
            f"{registry_name(deployment_name)}: a group registry of an earlier deployment with "
            f"other settings still has {num_members} members; shut that deployment down "
            "(serve shutdown) or give this one another deployment.name")
    logger.info("replacing %s: made with other settings, no members",
                registry_name(deployment_name))
    ray.kill(registry, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get_actor(registry_name(deployment_name), namespace="engram")
            time.sleep(0.2)
        except ValueError:  # the name is free again
            break
    return _registry_actor(app_config_dict, deployment_name)


def _registry_actor(app_config_dict: dict, deployment_name: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return GroupRegistry.options(
        name=registry_name(deployment_name), namespace="engram", get_if_exists=True,
        lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(_head_node_id(), soft=True),
    ).remote(app_config_dict)

"""`CoordinatorActor`: one per peer group. Starts its engines, hands out generations, watches.

A generation is one life of the group: a fresh id and store folder (0700), one assignment per
engine (rank + slices from `engram_ray.assignment`), every engine told to build, and the group
`ready` once all report ready. Lookups never pass through here.

The watch thread pings every engine each `health_check_interval_s`. A dead engine (or one
that misses `max_missed_pings`, or reports itself failed) makes the group `restarting`: the
survivors drop their tables and peer mappings, the dead engine is recreated in the same
bundle, a new generation is built, and the old generation's store folder is removed.
Engines are detached actors so that they outlive a dead coordinator long enough to notice
it and stop serving (`actors/engine.py`); `shutdown` (or `Deployment.shutdown`) removes them.
"""

from __future__ import annotations

import secrets
import threading
import time

import ray

from engram_ray.assignment import (create_store_dir, generation_id, generation_store_dir,
                                   group_store_root, make_assignments, remove_store_dir)
from engram_ray.config import DeploymentConfig
from engram_ray.grouping import PeerGroupPlan
from engram_ray.layout import EngramLayout
from engram_ray.actors.engine import EngineActor, engine_name
from engram_ray.actors.placement import engine_options

STARTING, READY, RESTARTING, UNHEALTHY, FAILED, SHUT_DOWN = (
    "starting", "ready", "restarting", "unhealthy", "failed", "shut_down")
MAX_FAILED_GENERATIONS = 3  # in a row, before the group is left `failed`
_BROKEN_MEMBER_STATES = ("failed", "stopped")


@ray.remote(num_cpus=0, max_concurrency=8)
class CoordinatorActor:
    def __init__(self, config: DeploymentConfig, layout: EngramLayout, group: PeerGroupPlan,
                 placement_group, engine_factory=None):
        self.config, self.layout, self.group = config, layout, group
        self.pg, self.engine_factory = placement_group, engine_factory
        self.engines: list = [None] * group.size
        self.reports: dict[int, dict] = {}
        self.generation, self.generation_index, self.store_dir = None, 0, None
        self.state, self.reason = STARTING, "not started"
        self.num_restarts, self.num_failed_in_row = 0, 0
        self.events: list[tuple[float, str]] = []
        self._generation_lock = threading.Lock()
        self._stop = threading.Event()

    # --- life cycle -----------------------------------------------------------------------

    def start(self) -> dict:
        """Create the engines (one per bundle), build generation 1, start watching."""
        self.reason = "creating engines and building generation 1"
        for rank in range(self.group.size):
            self.engines[rank] = self._create_engine(rank)
        self._run_generation()
        threading.Thread(target=self._watch, daemon=True, name="engram-group-watch").start()
        return self.status()

    def _create_engine(self, rank: int):
        me = ray.get_runtime_context().current_actor
        # NOTES: detached, so the engine is not fate-shared with this coordinator: when the
        # coordinator dies its engines must observe it and stop serving, not vanish mid-lookup.
        # Named, so that `Deployment.restart_group` finds every engine of the group even when
        # this coordinator is dead or stuck (`named_group_engines`).
        name = engine_name(self.config.name, self.group.group_id, rank)
        return EngineActor.options(lifetime="detached", name=name,
                                   **engine_options(self.pg, rank, self.config)).remote(
            self.layout, self.config, self.group.group_id, rank, me, self.engine_factory)

    def _run_generation(self) -> None:
        """Build a new generation on the current engines; `ready` or raise."""
        with self._generation_lock:
            old_store = self.store_dir
            self.generation_index += 1
            generation = generation_id(self.config.name, self.group.group_id,
                                       self.generation_index, secrets.token_hex(3))
            try:
                store_dir = create_store_dir(generation_store_dir(
                    self.config.peer_group_store, self.config.name, self.group.group_id,
                    generation))
            except Exception as exc:
                self._note_failure(f"generation {generation} failed: {exc}")
                raise
            if old_store and old_store != store_dir:
                remove_store_dir(old_store)  # survivors dropped their mappings already
            self._log(f"generation {generation}: assigning {self.group.size} ranks")
            self.generation, self.store_dir, self.reports = generation, store_dir, {}
            assignments = make_assignments(self.layout, self.group.group_id, self.group.size,
                                           generation, self.generation_index, store_dir)
            refs = [engine.build.remote(a) for engine, a in zip(self.engines, assignments)]
            try:
                reports = ray.get(refs, timeout=self.config.rendezvous_timeout_s + 30)
            except Exception as exc:
                self._note_failure(f"generation {generation} failed: {exc}")
                remove_store_dir(store_dir)
                raise
            self.reports = {r["rank"]: r for r in reports}
            self.state, self.reason = READY, f"generation {generation} ready"
            self.num_failed_in_row = 0
            self._log(self.reason)

    def _note_failure(self, reason: str) -> None:
        """Unhealthy (the watch retries), or failed after MAX_FAILED_GENERATIONS in a row."""
        self.state, self.reason = UNHEALTHY, reason
        self.num_failed_in_row += 1
        self._log(reason)
        if self.num_failed_in_row >= MAX_FAILED_GENERATIONS:
            self.state = FAILED
            self._log(f"group failed: {self.num_failed_in_row} attempts in a row failed")

    def shutdown(self) -> None:
        """Stop watching, kill the engines, remove every store folder of this group."""
        self._stop.set()
        with self._generation_lock:
            for engine in self.engines:
                _kill(engine)
            self.state, self.reason = SHUT_DOWN, "shut down"
            remove_store_dir(group_store_root(self.config.peer_group_store, self.config.name,
                                              self.group.group_id))

    # --- watching -------------------------------------------------------------------------

    def _watch(self) -> None:
        num_missed = [0] * self.group.size
        while not self._stop.wait(self.config.health_check_interval_s):
            if self.state == FAILED:
                return
            try:
                broken = self._find_broken(num_missed)
                if broken or self.state in (UNHEALTHY, RESTARTING):
                    self._restart(broken)
            except Exception as exc:  # noqa: BLE001 (the watch must outlive any one failure)
                self._note_failure(f"restart failed: {type(exc).__name__}: {exc}")

    def _find_broken(self, num_missed: list[int]) -> dict[int, str]:
        refs = [engine.ping.remote() for engine in self.engines]
        timeout = max(self.config.health_check_interval_s, 1.0)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        ready, broken = set(ready), {}
        for rank, ref in enumerate(refs):
            if ref not in ready:
                num_missed[rank] += 1
                if num_missed[rank] >= self.config.max_missed_pings:
                    broken[rank] = f"missed {num_missed[rank]} pings"
                continue
            try:
                member_state = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:
                num_missed[rank] += 1  # briefly unreachable: counted like a missed ping
                if num_missed[rank] >= self.config.max_missed_pings:
                    broken[rank] = f"unreachable for {num_missed[rank]} pings"
                continue
            except ray.exceptions.RayActorError as exc:
                broken[rank] = f"died ({type(exc).__name__})"
                continue
            num_missed[rank] = 0
            if member_state in _BROKEN_MEMBER_STATES and self.state == READY:
                broken[rank] = f"reports {member_state}"
        for rank in broken:
            num_missed[rank] = 0
        return broken

    def _restart(self, broken: dict[int, str]) -> None:
        """The whole group again: survivors drop, broken engines recreated, new generation."""
        why = ", ".join(f"rank {r} {w}" for r, w in sorted(broken.items())) or self.reason
        self.state, self.reason = RESTARTING, f"restarting: {why}"
        self.num_restarts += 1
        self._log(self.reason)
        survivors = [r for r in range(self.group.size) if r not in broken]
        drops = [self.engines[r].drop.remote(f"group restarting: {why}") for r in survivors]
        try:
            ray.get(drops, timeout=max(10.0, self.config.health_check_interval_s * 5))
        except Exception as exc:  # a survivor that cannot drop is replaced as well
            self._log(f"a survivor failed to drop its tables ({exc}); recreating all")
            broken = {r: "failed to drop" for r in range(self.group.size)}
        for rank in broken:
            _kill(self.engines[rank])
            self.engines[rank] = self._create_engine(rank)
        try:
            self._run_generation()
            self.reason = f"{self.reason} after restart ({why})"
        except Exception:
            pass  # _run_generation noted the failure; the watch retries or the group failed

    # --- status ---------------------------------------------------------------------------

    def ping(self) -> str:
        return self.state

    def get_engines(self) -> list:
        return list(self.engines)

    def status(self) -> dict:
        members = [{"rank": rank, **{key: self.reports.get(rank, {}).get(key) for key in (
                        "actor_id", "node_id", "owned_bytes", "local_bytes",
                        "rendezvous_seconds")}}
                   for rank in range(self.group.size)]
        return {"group_id": self.group.group_id, "domain_id": self.group.domain.domain_id,
                "size": self.group.size, "state": self.state, "reason": self.reason,
                "is_ready": self.state == READY, "generation": self.generation,
                "generation_index": self.generation_index, "store_dir": self.store_dir,
                "num_restarts": self.num_restarts, "members": members,
                "bytes_per_rank": [m["local_bytes"] for m in members],
                "events": [f"{t:.3f} {text}" for t, text in self.events[-20:]]}

    def _log(self, text: str) -> None:
        self.events.append((time.time(), text))


def _kill(actor) -> None:
    if actor is None:
        return
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already dead
        pass

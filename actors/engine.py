"""`EngineActor`: one per GPU (one per bundle). Holds a `GroupMember` and, later, a vLLM engine.

Thin on purpose: the tables, states and checks live in `engram_ray.member`. What is Ray-specific
is here: the coordinator watch. A background thread pings the coordinator every
`health_check_interval_s`; when the coordinator is dead (or misses `max_missed_pings` pings in a
row) the member stops: health false, lookups raise, tables closed. An engine never serves a
table its group can no longer repair.

vLLM hook: `engine_factory(tables, assignment) -> engine` is called after every successful
build (a new generation means new tables); its result is `self.engine`. The vLLM engineer
plugs the vLLM engine in there; `start_engine` builds it on demand for the current tables.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Callable

import ray

from engram_ray.assignment import EngineAssignment
from engram_ray.config import DeploymentConfig
from engram_ray.layout import EngramLayout
from engram_ray.member import GroupMember

# Lookups, pings and health answer while a build waits in the rendezvous.
ENGINE_MAX_CONCURRENCY = 8


def engine_name_prefix(deployment_name: str, group_id: str) -> str:
    """Start of the actor name of every engine of one peer group (in the job's namespace)."""
    return f"engram-engine:{deployment_name}:{group_id}:"


def engine_name(deployment_name: str, group_id: str, rank: int) -> str:
    """A fresh name per engine: a recreated rank must not wait for its predecessor's name."""
    return f"{engine_name_prefix(deployment_name, group_id)}rank{rank}:{secrets.token_hex(4)}"


def named_group_engines(deployment_name: str, group_id: str) -> list:
    """Handles of the live engines of one group, whoever created them: the coordinator
    recreates engines the driver never hears of, and a dead coordinator cannot list them."""
    prefix = engine_name_prefix(deployment_name, group_id)
    handles = []
    for name in ray.util.list_named_actors():
        if name.startswith(prefix):
            try:
                handles.append(ray.get_actor(name))
            except ValueError:  # died since it was listed
                pass
    return handles


def wait_dead(actors: list, timeout_s: float) -> list:
    """Wait until Ray reports every actor dead (engines and coordinators: anything with
    `ping`); those still alive after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    alive = list(actors)
    while alive and time.monotonic() < deadline:
        refs = [actor.ping.remote() for actor in alive]
        answered, _ = ray.wait(refs, num_returns=len(refs),
                               timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        answered = set(answered)
        alive = [actor for actor, ref in zip(alive, refs)
                 if ref not in answered or not _is_dead_answer(ref)]
        if alive:
            time.sleep(0.1)
    return alive


def ranks_not_running(engines: list, timeout_s: float = 2.0) -> list[int]:
    """Ranks whose engine is missing, dead, or answers no ping within `timeout_s` (not
    scheduled yet: a running engine answers even while its build waits in the rendezvous)."""
    refs = {rank: e.ping.remote() for rank, e in enumerate(engines) if e is not None}
    answered = set(ray.wait(list(refs.values()), num_returns=len(refs),
                            timeout=timeout_s)[0]) if refs else set()
    return [rank for rank in range(len(engines)) if rank not in refs
            or refs[rank] not in answered or _is_dead_answer(refs[rank])]


def _is_dead_answer(ref) -> bool:
    try:
        ray.get(ref)
    except ray.exceptions.ActorUnavailableError:  # a subclass of RayActorError: not dead
        return False
    except ray.exceptions.RayActorError:
        return True
    return False


@ray.remote(max_concurrency=ENGINE_MAX_CONCURRENCY)
class EngineActor:
    def __init__(self, layout: EngramLayout, config: DeploymentConfig, group_id: str,
                 rank: int, coordinator=None,
                 engine_factory: Callable | None = None):
        self.member = GroupMember(layout, config)
        self.config, self.group_id, self.rank = config, group_id, rank
        self.engine_factory, self.engine = engine_factory, None
        self._coordinator = coordinator
        self._stop_watch = threading.Event()
        if coordinator is not None:
            threading.Thread(target=self._watch_coordinator, daemon=True,
                             name="engram-coordinator-watch").start()

    # --- control (called by the coordinator) ----------------------------------------------

    def ping(self) -> str:
        return self.member.state

    def build(self, assignment: EngineAssignment) -> dict:
        """Open this rank's slice of every table for `assignment` (blocks for the rendezvous)."""
        report = self.member.build(assignment)
        if self.engine_factory is not None:
            self.engine = self.engine_factory(self.member.tables, assignment)
        context = ray.get_runtime_context()
        return dict(report, node_id=context.get_node_id(), actor_id=context.get_actor_id())

    def drop(self, reason: str) -> None:
        """Release the old generation's tables and peer mappings."""
        self.engine = None
        self.member.drop(reason)

    # --- serving --------------------------------------------------------------------------

    def lookup(self, layer_id: int, row_ids):
        """`[T, C]` int64 -> `[T, C, row_bytes]` uint8; raises `NotServingError` unless ready."""
        return self.member.lookup(layer_id, row_ids)

    def health(self) -> dict:
        return dict(self.member.health(), node_id=ray.get_runtime_context().get_node_id())

    def is_healthy(self) -> bool:
        return self.member.is_healthy

    def start_engine(self):
        """Build the engine (vLLM) on the current tables via `engine_factory`, if not yet."""
        if self.engine_factory is None:
            raise NotImplementedError("this EngineActor was created without an engine_factory")
        if self.engine is None:
            self.engine = self.engine_factory(self.member.tables, self.member._assignment)
        return True

    # --- coordinator watch ----------------------------------------------------------------

    def _watch_coordinator(self) -> None:
        interval = self.config.health_check_interval_s
        num_missed = 0
        while not self._stop_watch.wait(interval):
            try:
                ray.get(self._coordinator.ping.remote(), timeout=max(interval, 1.0))
                num_missed = 0
            except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
                num_missed += 1  # slow or briefly unreachable, not dead (yet)
                if num_missed >= self.config.max_missed_pings:
                    self._lose_coordinator(f"coordinator missed {num_missed} pings")
                    return
            except ray.exceptions.RayActorError as exc:
                self._lose_coordinator(f"coordinator died ({type(exc).__name__})")
                return

    def _lose_coordinator(self, reason: str) -> None:
        self.engine = None
        self.member.stop(f"{reason}: this group can no longer restart a lost member, so "
                         "the engine stops serving rather than serve a partial table")

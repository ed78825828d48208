"""`deploy(config, address)`: peer groups of engines on a Ray cluster, one coordinator each.

    discover domains (node labels) -> form peer groups inside each domain -> one placement group
    per peer group (wait <= placement_timeout_s) -> one CoordinatorActor per group, which starts
    one EngineActor per bundle and builds generation 1 -> `Deployment` (handles, unused slots)

Usage:

    from engram_ray.config import DeploymentConfig
    from engram_ray.deploy import deploy
    dep = deploy(DeploymentConfig(model="deepseek-v4.1-flash", peer_group_size=8), "auto")
    dep.engines()            # {group_id: [EngineActor handle by rank]}
    dep.status()             # {group_id: coordinator status}
    dep.shutdown()
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

from engram_ray.assignment import group_store_root, remove_store_dir
from engram_ray.config import DeploymentConfig
from engram_ray.errors import EngramRayError
from engram_ray.grouping import (GroupingPlan, PeerGroupPlan, UnusedSlots, check_has_groups,
                                 form_peer_groups)
from engram_ray.layout import EngramLayout, load_layout

_STARTUP_MARGIN_S = 60.0
_STOP_TIMEOUT_S = 10.0  # for a coordinator or engine to answer or be reported dead


class GroupRestartError(EngramRayError):
    """A peer group restarted by `Deployment.restart_group` did not become ready."""


@dataclass
class GroupHandle:
    plan: PeerGroupPlan
    coordinator: object
    placement_group: object
    engines: list = field(default_factory=list)  # last known handles, by rank


@dataclass
class Deployment:
    """Handles of a running deployment. `engines()` asks the coordinators (handles change on
    restart); `unused` lists, per domain, the slots no group uses and why."""

    config: DeploymentConfig
    layout: EngramLayout
    grouping: GroupingPlan
    groups: dict[str, GroupHandle]
    startup_seconds: float = 0.0
    engine_factory: object = None

    @property
    def coordinators(self) -> dict:
        return {gid: g.coordinator for gid, g in self.groups.items()}

    @property
    def unused(self) -> dict[str, list[UnusedSlots]]:
        out: dict[str, list[UnusedSlots]] = {}
        for item in self.grouping.unused:
            out.setdefault(item.domain_id, []).append(item)
        return out

    def engines(self, group_id: str | None = None, timeout_s: float = 30.0):
        """Current engine handles by rank, of one group or of all (dict by group id)."""
        import ray

        ids = [group_id] if group_id else list(self.groups)
        for gid in ids:
            handle = self.groups[gid]
            try:
                handle.engines = ray.get(handle.coordinator.get_engines.remote(),
                                         timeout=timeout_s)
            except ray.exceptions.RayActorError:  # coordinator gone: the last known handles
                pass
        return self.groups[group_id].engines if group_id else {
            gid: g.engines for gid, g in self.groups.items()}

    def status(self, timeout_s: float = 30.0) -> dict:
        import ray

        return {gid: ray.get(g.coordinator.status.remote(), timeout=timeout_s)
                for gid, g in self.groups.items()}

    def restart_group(self, group_id: str, timeout_s: float | None = None) -> dict:
        """A new coordinator and new engines for a group (e.g. after its coordinator died),
        in the same placement group; its status once ready.

        The old coordinator is killed first (dead, stuck or busy restarting: it is not asked),
        then every engine of the group, found by name: also those it recreated that this
        driver never saw, which would otherwise keep their bundles from the new engines.
        Raises `GroupRestartError`, naming the group and the ranks that did not come up,
        when the group is not ready within `timeout_s` (default rendezvous_timeout_s + 60)."""
        import ray

        handle = self.groups[group_id]
        _stop_group(self.config, group_id, handle, _STOP_TIMEOUT_S)
        remove_store_dir(group_store_root(self.config.peer_group_store, self.config.name,
                                          group_id))
        handle.coordinator = _new_coordinator(self.config, self.layout, handle.plan,
                                              handle.placement_group, self.engine_factory)
        if timeout_s is None:
            timeout_s = self.config.rendezvous_timeout_s + _STARTUP_MARGIN_S
        try:
            return ray.get(handle.coordinator.start.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise GroupRestartError(_not_ready_message(group_id, handle.coordinator,
                                                       timeout_s)) from None
        except ray.exceptions.RayError as exc:
            raise GroupRestartError(f"peer group {group_id} failed to restart: {exc}") from exc

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Coordinators stop and kill their engines; placement groups and stores removed.
        Returns once Ray reports the groups' slots free again (or after `timeout_s`)."""
        from engram_ray.actors.placement import slot_resource, wait_for_free

        resource, per_engine = slot_resource(self.config)
        import ray

        num_freed = sum(h.plan.size for h in self.groups.values()) * per_engine
        target = min(ray.cluster_resources().get(resource, 0.0),
                     ray.available_resources().get(resource, 0.0) + num_freed)
        for group_id, handle in self.groups.items():
            _shutdown_group(self.config, group_id, handle, timeout_s)
        self.groups = {}
        try:  # the deployment's own folder, once its groups' folders are gone
            os.rmdir(os.path.join(self.config.peer_group_store, self.config.name))
        except OSError:
            pass
        wait_for_free(resource, target, timeout_s)


def _shutdown_group(config: DeploymentConfig, group_id: str, handle: GroupHandle,
                    timeout_s: float) -> None:
    import ray

    from engram_ray.actors.placement import release_group

    try:
        handle.engines = ray.get(handle.coordinator.get_engines.remote(), timeout=timeout_s)
        ray.get(handle.coordinator.shutdown.remote(), timeout=timeout_s)
    except Exception:  # coordinator dead or stuck: kill what we know of
        pass
    _stop_group(config, group_id, handle, min(timeout_s, _STOP_TIMEOUT_S))
    release_group(handle.placement_group)
    remove_store_dir(group_store_root(config.peer_group_store, config.name, group_id))


def _stop_group(config: DeploymentConfig, group_id: str, handle: GroupHandle,
                timeout_s: float) -> None:
    """Kill the group's coordinator, then every engine of the group: the last known handles
    and every named engine of the group. Waits at most about 2 x `timeout_s` for Ray to report
    them dead (their bundles are free then); what still lives after that is left to Ray."""
    from engram_ray.actors.engine import named_group_engines, wait_dead

    _kill(handle.coordinator)
    # NOTES: engines are listed only once the coordinator is dead: until then its watch may
    # create more (named actors register before `.remote()` returns, so none is missed).
    wait_dead([handle.coordinator], timeout_s)
    engines = [e for e in handle.engines if e is not None]
    engines += named_group_engines(config.name, group_id)
    for actor in engines:
        _kill(actor)
    wait_dead(engines, timeout_s)
    handle.engines = []


def _kill(actor) -> None:
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already dead
        pass


def _not_ready_message(group_id: str, coordinator, timeout_s: float) -> str:
    """Why a restarted group is not ready: the coordinator's state and the ranks whose
    engine does not run (its bundle is held by another actor, or it cannot be scheduled)."""
    import ray

    from engram_ray.actors.engine import ranks_not_running

    head = f"peer group {group_id} did not become ready within {timeout_s:g} s of restart_group"
    try:
        status = ray.get(coordinator.status.remote(), timeout=_STOP_TIMEOUT_S)
        engines = ray.get(coordinator.get_engines.remote(), timeout=_STOP_TIMEOUT_S)
    except Exception as exc:
        return (f"{head}: its new coordinator does not answer ({type(exc).__name__}: {exc}). "
                "Call restart_group again, or shutdown.")
    idle = ranks_not_running(engines)
    what = (f"rank(s) {', '.join(map(str, idle))} have no running engine (their "
            "placement-group bundle is held by another actor, or the engine cannot be "
            "scheduled); free the bundle, then call restart_group again" if idle else
            "every engine runs but the generation is not built yet; raise timeout_s (or "
            "rendezvous_timeout_s) or call restart_group again")
    return f"{head}: coordinator state {status['state']!r} ({status['reason']}); {what}."


def _new_coordinator(config, layout, group: PeerGroupPlan, pg, engine_factory):
    from engram_ray.actors.coordinator import CoordinatorActor

    # The coordinator sits in its domain: the store path must be the one its engines see.
    return CoordinatorActor.options(label_selector=dict(group.domain.selector)).remote(
        config, layout, group, pg, engine_factory)


def limit_groups(plan: GroupingPlan, max_groups: int | None) -> GroupingPlan:
    """Keep the first `max_groups` groups; the slots of the others are reported unused."""
    if max_groups is None or len(plan.groups) <= max_groups:
        return plan
    kept, dropped = plan.groups[:max_groups], plan.groups[max_groups:]
    extra = tuple(UnusedSlots(g.domain.domain_id, g.size,
                              f"group {g.group_id} not started: max_peer_groups={max_groups}")
                  for g in dropped)
    return dataclasses.replace(plan, groups=kept, unused=plan.unused + extra)


def plan_groups(config: DeploymentConfig) -> GroupingPlan:
    """Peer groups for the cluster Ray is connected to (raises when not one fits)."""
    from engram_ray.actors.placement import discover_domains

    plan = form_peer_groups(discover_domains(config), config.peer_group_size)
    check_has_groups(plan, "CPU slot" if config.is_cpu_only else "GPU")
    return limit_groups(plan, config.max_peer_groups)


def deploy(config: DeploymentConfig, address: str | None = None, *, engine_factory=None,
           **ray_init_kwargs) -> Deployment:
    """Start every peer group that fits; see the module docstring. Raises `PlacementError`
    when the groups cannot be placed, and the group's error when one fails to start."""
    import ray

    from engram_ray.actors.placement import reserve_group

    if not ray.is_initialized():
        ray.init(address=address, **ray_init_kwargs)
    started = time.perf_counter()
    layout = load_layout(config.model)
    plan = plan_groups(config)
    deployment = Deployment(config, layout, plan, {}, engine_factory=engine_factory)
    try:
        for group in plan.groups:
            pg = reserve_group(group, config)
            coordinator = _new_coordinator(config, layout, group, pg, engine_factory)
            deployment.groups[group.group_id] = GroupHandle(group, coordinator, pg)
        starts = [g.coordinator.start.remote() for g in deployment.groups.values()]
        ray.get(starts, timeout=config.rendezvous_timeout_s + _STARTUP_MARGIN_S)
    except BaseException:
        deployment.shutdown()
        raise
    deployment.startup_seconds = time.perf_counter() - started
    return deployment

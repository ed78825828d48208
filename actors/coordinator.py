"""`Coordinator`: the per-group bookkeeping of one Serve application, in one named actor
(`engram-coordinator-<deployment name>`, namespace `engram`, on the head node).

Serve's gang scheduling owns placing a group (one gang per group, `actors/placement.py`), ranks
and world size (`gang_context`), noticing a dead member and restarting the group as one
(RESTART_GANG). What is left is here, composed of parts:

    book      `engram_ray.planning.generations.GenerationBook`: each group's generations (a
              new gang id opens one: fresh FileStore folder), members, slices, restarts in
              place, a gang started beside a serving one (a rolling change)
    roll      `engram_ray.planning.in_place_roll`: an in-place roll's turns, stop, progress
    feed      `actors/coordinator_waits.RoutingFeed`: the routing table's version, long-polled
              by the ingress (`routing`)
    rebuild   `RebuildWait`: only when no saved state was found after a restart
    watch     `actors/coordinator_watch.CoordinatorWatch`: members' replica actors, the Serve
              application, the groups' domains
    targets   `engram_ray.metrics.target_book.TargetBook`: every engine's /metrics (a file_sd
              list, `serving.prometheus_targets_file`; Prometheus HTTP service discovery when
              `serving.http_sd_port` is set) and each engine's slot on its node
    metrics   its own series at /metrics of the same endpoint (`engram_ray.metrics.coordinator`)

NOTES: an asyncio actor. Every call runs on one event loop and none blocks it: waits (the
ingress's long polls, calls during a rebuild) are coroutines, so hundreds of waiting callers
cost the members' calls nothing (a threaded actor with `max_concurrency=16` was starved by 16
long polls: one `member_check` took 9.5 s). Every call's state change runs without an `await`
in between, so no lock is needed; the HTTP endpoint's thread reads through the loop
(`_read`). What it decided is saved (`actors/lifetime.py`) before the answer leaves.

Routing (`routing`): a group serves while every member of its generation has been ready, none
is lost and one at least is not restarting; the ingress sends requests to the members that
serve. A member whose engine died restarts it in place (`member_restarting`, `member_ready`). A
member is lost when its replica reports it (`report_broken`) or stops (`leave`), or when the
watch finds its replica actor dead.

A rolling change (`reconfigure`): with `serving.rollout.mode: in_place` members restart their
engines with the new settings, each told by `member_check` when it is its turn (`take_turn`;
`member_settings`, `roll_failed`); with `beside` a gang started beside the serving one takes
over once ready and the old one drained (`may_take_over`, `member_running`). A change the
build refuses is left here (`refuse`) for the groups' builds of the same deploy.

Created by `engram_ray.serve.app.build_app` before the engines (detached), found by name
(`actors/coordinator_lookup.py`). Killed, it restarts with its saved state; it ends with its
Serve application, taking the store folders, the targets and the http_sd port with it.
"""

# Over 300 lines: the actor's calls, one short method each over its parts (module doc); the
# logic is in the parts.

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import ray

from engram_ray.actors.coordinator_waits import RebuildWait, RoutingFeed
from engram_ray.actors.coordinator_watch import CoordinatorWatch
from engram_ray.actors.lifetime import (REBUILD_WAIT_S, is_restarted_actor, save_settings,
                                        save_state, saved_settings, saved_state)
from engram_ray.metrics.coordinator import CoordinatorMetrics, snapshot_of
from engram_ray.metrics.exposition import TargetsServer, fixed_ports
from engram_ray.metrics.target_book import COORDINATOR_KEY, TargetBook
from engram_ray.planning.assignment import remove_store_dir
from engram_ray.planning.in_place_roll import take_turn

logger = logging.getLogger(__name__)


def coordinator_name(deployment_name: str) -> str:
    return f"engram-coordinator-{deployment_name}"


# Restarted by Ray when its process dies, calls in flight retried (`actors/lifetime.py`).
@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Coordinator:
    def __init__(self, app_config_dict: dict, domains: dict[str, str]):
        from engram_ray.model.layout import load_layout
        from engram_ray.planning.generations import GenerationBook
        from engram_ray.planning.in_place_roll import InPlaceRoll
        from engram_ray.serve.settings.config import ServeAppConfig
        from engram_ray.serve.settings.config_change import config_version

        restarted = is_restarted_actor()
        name = coordinator_name(ServeAppConfig.from_dict(app_config_dict,
                                                         "coordinator").deployment.name)
        # Ray re-runs this constructor with its first arguments: a rolled-out config is kept.
        kept = saved_settings(name) if restarted else None
        if kept is not None:
            app_config_dict, domains = kept["app"], kept["domains"]
        # Its members and no others rejoin it after a restart (not those of a coordinator it
        # replaced: serving.rollout.mode restart).
        self.lineage = kept["lineage"] if kept else secrets.token_hex(4)
        state = saved_state(name) if kept else None
        if state is not None and state.get("lineage") != self.lineage:
            state = None
        self.made_with = (app_config_dict, domains)
        self.config = config = ServeAppConfig.from_dict(app_config_dict, "coordinator")
        self._rollout = config.serving.rollout.to_dict()
        self.deployment_name = config.deployment.name
        self.incarnation = secrets.token_hex(4)
        self.book = GenerationBook(config.deployment, load_layout(config.deployment.model),
                                   domains, config.serving.data_parallel_size)
        self.roll = InPlaceRoll(config_version(app_config_dict), app_config_dict)
        self.metric_targets = TargetBook(config.serving.prometheus_targets_file)
        self.feed = RoutingFeed()
        self.rebuild = RebuildWait(REBUILD_WAIT_S if restarted and state is None else None)
        self.watch = CoordinatorWatch(self.deployment_name, self._lost, self._end_with_application,
                                      self._moved, lambda: self.config.deployment)
        self._refusal: tuple[dict, str] | None = None  # (group settings, why) of a refused deploy
        if state is not None:
            self._restore(state)
        self._loop = asyncio.get_running_loop()
        self.watch.start()
        started_at = time.time()
        self.metrics = CoordinatorMetrics(config.deployment.model, self.deployment_name,
                                          lambda: self._read(lambda: snapshot_of(
                                              self.config, self.book, self.roll, started_at,
                                              restarted)))
        self.sd_server = TargetsServer(
            (lambda: self._read(self.metric_targets.groups)) if config.serving.http_sd_port
            else None, config.serving.metrics_bind_address, config.serving.http_sd_port,
            registry=self.metrics.registry, avoid=fixed_ports(config.serving.metrics_port))
        self.metric_targets.register(COORDINATOR_KEY, self.sd_server.target(
            ray.util.get_node_ip_address()), {"endpoint": "coordinator"})
        self._save(settings=True)
        if restarted:
            logger.warning("engram-ray: coordinator %s restarted; %s", self.deployment_name,
                           "its saved state restored" if state is not None else
                           f"no saved state: rebuilding its groups from their members for up "
                           f"to {REBUILD_WAIT_S:.0f} s")

    # --- its state, kept across its restarts (actors/lifetime.py) --------------------------
    def _save(self, settings: bool = False) -> None:
        """State (and, when they changed, the settings) into Ray's KV store; called after
        every change, before the call that made it answers."""
        if settings:
            save_settings(coordinator_name(self.deployment_name), *self.made_with,
                          self.lineage)
        save_state(coordinator_name(self.deployment_name), {
            "lineage": self.lineage, "groups": self.book.groups, "roll": self.roll,
            "targets": (self.metric_targets.targets, self.metric_targets.slots),
            "refusal": self._refusal, "actors": dict(self.watch.actors)})

    def _restore(self, state: dict) -> None:
        """What the coordinator before it saved. Store folders no generation owns are
        removed now: every folder it handed out is in its saved state, so these are folders
        made for a join whose answer never left (their owners are known gone)."""
        self.book.groups, self.roll, self._refusal = state["groups"], state["roll"], \
            state["refusal"]
        self.metric_targets.targets, self.metric_targets.slots = state["targets"]
        self.metric_targets.targets.pop(COORDINATOR_KEY, None)  # its own: a new endpoint
        for replica_id, actor in state["actors"].items():
            self.watch.watch(replica_id, actor)
        for store_dir in self.book.unclaimed_store_dirs():
            remove_store_dir(store_dir)
            logger.warning("engram-ray: coordinator %s: store folder %s, handed to no member, "
                           "removed", self.deployment_name, store_dir)

    def _changed(self, routing: bool = True, settings: bool = False) -> None:
        if routing:
            self.feed.changed()
        self._save(settings)
        gangs, self.book.ended_gangs = self.book.ended_gangs, []
        if gangs:  # their DP round keys, off the loop (GCS calls)
            self._loop.create_task(asyncio.to_thread(_forget_gangs, gangs))

    async def _rebuilt(self) -> None:
        """Calls that read or change groups wait until the members rejoined (only after a
        restart that found no saved state)."""
        if await self.rebuild.wait():
            self._end_rebuild()

    def _end_rebuild(self) -> None:
        """Every serving gang is back (or the wait ended): calls go on. Folders no member
        claimed are left (without saved state, their owners are not known gone); the
        application's end removes them."""
        if not self.rebuild.end():
            return
        self.book.end_rebuild()
        logger.warning("engram-ray: coordinator %s rebuilt: %s", self.deployment_name, {
            g: r["reason"] or "serving" for g, r in self.book.routing().items()})
        self._changed()

    def _read(self, fn):
        """`fn()` on the event loop, from the HTTP endpoint's thread."""
        async def call():
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout=10)

    # --- members -------------------------------------------------------------------------
    async def member_check(self, replica_id: str | None = None, in_flight: int | None = None,
                           knows_retired: bool = False, config_version: str | None = None
                           ) -> dict:
        """{"incarnation" (a member that joined another one rejoins: `rejoin`), "retired"
        (its gang was replaced by a rolling change: no new requests), "restart_for" (the
        settings version its engine restarts with now, or None), "restart_epoch" (the number
        of the restart in place it is part of now, or None)}; `in_flight`: the requests the
        member runs, counted once it `knows_retired`; `config_version`: its engine's
        settings; "rollout": `serving.rollout` as deployed now (a change of it reaches the
        restarts, DP waits and takeovers of running members). Asked by every member every
        second: no wait, a save only on a turn."""
        is_retired = replica_id is not None and self.book.is_retired(replica_id)
        if is_retired and knows_retired and in_flight is not None:
            self.book.report_in_flight(replica_id, in_flight)
        restart_for = None
        if replica_id is not None and config_version is not None and \
                not self.rebuild.is_waiting:
            rollout = self.config.serving.rollout
            had_turn = replica_id in self.roll.turns
            restart_for, routing = take_turn(self.roll, self.book, replica_id, config_version,
                                             rollout.mode, rollout.max_groups_at_once)
            if restart_for is not None and not had_turn:
                logger.warning("engram-ray: member %s restarts its engine with settings %s "
                               "(in-place roll)", replica_id, restart_for)
                self._changed(routing)
        restart_epoch = self.book.restart_epoch(replica_id) if replica_id else None
        return {"incarnation": self.incarnation, "retired": is_retired,
                "restart_for": restart_for, "restart_epoch": restart_epoch,
                "rollout": self._rollout}

    async def join(self, group_id: str, gang_id: str, rank: int, world_size: int,
                   replica_id: str, node_labels: dict | None = None) -> dict:
        await self._rebuilt()
        assignment = dict(self.book.join(group_id, gang_id, rank, world_size, replica_id,
                                         node_labels), incarnation=self.incarnation,
                          lineage=self.lineage)
        # It starts on these settings (`member_settings`: not a stopped roll's target).
        self.roll.running(replica_id, self.roll.settings_for(None)[0])
        self._forget_ended()
        self._changed()
        return assignment

    async def rejoin(self, member: dict, actor=None) -> str | None:
        """A member of a coordinator that died: `member` as `GenerationBook.rejoin` takes it
        plus its metric `targets` ({key: {"target", "labels"}}), `slot` and `node_id`. The
        incarnation, or None when this coordinator will not have it (a newer generation)."""
        if member["assignment"].get("lineage") != self.lineage or \
                not self.book.rejoin(member):
            return None
        replica_id = member["replica_id"]
        self.roll.rejoined(replica_id, member.get("config_version"))
        if actor is not None and member.get("ready_at") is not None:
            self.watch.watch(replica_id, actor)
        self.metric_targets.restore(replica_id, member.get("node_id"), member.get("slot"),
                                    member.get("targets") or {})
        if self.rebuild.is_waiting and self.book.is_complete():
            self._end_rebuild()
        self._changed(routing=not self.rebuild.is_waiting)
        return self.incarnation

    async def member_ready(self, replica_id: str, actor=None, config_version: str | None = None
                           ) -> None:
        """The member's engine serves (on settings `config_version`); `actor` (its replica
        actor) is watched from now on."""
        await self._rebuilt()
        self.roll.running(replica_id, config_version)
        ready = self.book.member_ready(replica_id) is not None
        if ready and actor is not None:
            self.watch.watch(replica_id, actor)
        self._changed(routing=ready)

    async def member_running(self, replica_id: str) -> None:
        """Serve runs the member (its first health check passed)."""
        await self._rebuilt()
        if self.book.member_running(replica_id):
            self._changed()

    async def member_restarting(self, replica_id: str, reason: str) -> int | None:
        """Member `replica_id`'s engine died and restarts in place, with the rest of its
        data-parallel gang if it has one: the ingress stops sending them requests. The
        restart's number (`GenerationBook.member_restarting`), or None when its generation no
        longer serves (then it is not restarted in place)."""
        await self._rebuilt()
        epoch = self.book.member_restarting(replica_id, reason)
        if epoch is not None:
            group_id, generation, rank = self.book.find_member(replica_id)
            logger.warning("engram-ray: %s generation %s member %d restarts its engine%s: %s",
                           group_id, generation, rank, " with its data-parallel gang"
                           if self.book.dp_size > 1 else "", reason)
            self._changed()
        return epoch

    async def report_broken(self, replica_id: str, reason: str) -> None:
        """Member `replica_id` is lost (its engine died, its health check failed)."""
        await self._rebuilt()
        self._break(replica_id, reason)

    async def leave(self, replica_id: str) -> None:
        await self._rebuilt()
        self.book.leave(replica_id)
        self.roll.forget(replica_id)
        self.watch.forget(replica_id)
        self.metric_targets.forget(replica_id)
        self._changed()

    async def may_take_over(self, replica_id: str) -> bool | None:
        """A member of a gang started beside a serving one may end its start (then Serve
        stops the old gang): its gang took over and the old one drained; None: its gang
        failed meanwhile (`GenerationBook.may_take_over`)."""
        await self._rebuilt()
        return self.book.may_take_over(replica_id, self.config.serving.rollout.drain_timeout_s)

    def _break(self, replica_id: str, reason: str) -> None:
        if self.book.is_retired(replica_id):  # a replaced gang's member stopped
            self.book.leave(replica_id)
            self._changed()
            return
        member = self.book.find_member(replica_id)
        if member is None:
            return
        group_id, generation, rank = member
        if self.book.break_generation(group_id, generation, f"member {rank}: {reason}"):
            logger.warning("engram-ray: %s generation %s stops serving: member %d: %s",
                           group_id, generation, rank, reason)
            self._changed()

    def _lost(self, replica_id: str, reason: str) -> None:
        """The watch found a member's replica actor dead."""
        self._break(replica_id, reason)
        self._save()

    def _forget_ended(self) -> None:
        """Actors, versions and targets of replicas no live generation holds."""
        current = self.book.member_ids()
        for replica_id in [r for r in self.watch.actors if r not in current]:
            self.watch.forget(replica_id)
        for replica_id in [r for r in self.roll.member_versions if r not in current]:
            self.roll.forget(replica_id)
        self.metric_targets.keep_only(current.__contains__)

    # --- routing, status ---------------------------------------------------------------
    async def routing(self, version: int = -1, timeout_s: float = 0.0) -> tuple[int, dict]:
        """(version, {group_id: {"generation", "serving", "reason", ...}}), returned as soon
        as the version differs from `version`, else after `timeout_s` (a long poll)."""
        await self._rebuilt()
        await self.feed.wait(version, timeout_s)
        return self.feed.version, self.book.routing()

    async def describe(self) -> tuple[tuple, int]:
        """(what it was made with, number of members of current generations), once a
        restarted coordinator knows its members (a build must not take it for empty)."""
        await self._rebuilt()
        return self.made_with, self.book.num_members()

    async def status(self) -> dict:
        await self._rebuilt()
        return self.book.status()

    # --- settings: a change that rolls out, an in-place roll's calls -----------------------
    async def reconfigure(self, app_config_dict: dict, domains: dict[str, str]) -> None:
        """A changed config that rolls out (`get_coordinator`): new generations use it, the
        serving ones go on until their gangs are replaced; groups added or removed."""
        from engram_ray.serve.settings.config import ServeAppConfig
        from engram_ray.serve.settings.config_change import config_version

        await self._rebuilt()
        config = ServeAppConfig.from_dict(app_config_dict, "coordinator")
        self._refusal = None
        if self.roll.set_target(config_version(app_config_dict), app_config_dict) and \
                config.serving.rollout.mode == "in_place":
            logger.warning("engram-ray: coordinator %s rolls settings %s out: each member's "
                           "engine restarts in place, one per group at a time",
                           self.deployment_name, self.roll.version)
        self.book.reconfigure(config.deployment, domains)
        self.config, self.made_with = config, (app_config_dict, domains)
        self._rollout = config.serving.rollout.to_dict()
        self.metric_targets.targets_file = config.serving.prometheus_targets_file
        self._changed(settings=True)
        logger.warning("engram-ray: coordinator %s reconfigured: groups %s", self.deployment_name,
                       sorted(domains))

    def _moved(self, moved: dict[str, str]) -> None:
        """Groups whose domain was lost, placed again (the watch): kept here and saved, so a
        restart or the next build keeps them there."""
        app_config_dict, domains = self.made_with
        domains = {**domains, **moved}
        self.book.reconfigure(self.config.deployment, domains)
        self.made_with = (app_config_dict, domains)
        self._changed(settings=True)

    async def member_settings(self, version: str | None = None) -> tuple[str, dict]:
        """(settings version, app config) a member's engine runs: those of `version` while a
        turn for it is under way (every engine of a DP gang restarts with the settings its
        turn was given for, whatever was deployed since), else the target's."""
        found, settings = self.roll.settings_for(version)
        if settings is None:  # a state saved before settings were kept per version
            from engram_ray.serve.settings.config_change import config_version

            return config_version(self.made_with[0]), self.made_with[0]
        return found, settings

    async def roll_failed(self, replica_id: str, reason: str, version: str | None = None
                          ) -> None:
        """Member `replica_id`'s engine would not start with settings `version` (it serves
        on the old ones again): the roll of them stops at it, also across restarts of this
        coordinator, until the settings change; a turn for settings deployed over since just
        ends."""
        stopped = self.roll.stop(replica_id, reason, version)
        self._changed(routing=False)
        if not stopped:
            logger.warning("engram-ray: member %s did not start with settings %s, no longer "
                           "the target (%s): the roll goes on", replica_id, version,
                           self.roll.version)
            return
        logger.error("engram-ray: the in-place roll of %s's settings %s stopped at member %s "
                     "(it serves on its old settings): %s; deploy settings that start, or the "
                     "old ones", self.deployment_name, self.roll.version, replica_id, reason)

    async def roll_status(self) -> dict:
        """The in-place roll's progress (`InPlaceRoll.progress`) and the mode."""
        await self._rebuilt()
        return {"mode": self.config.serving.rollout.mode,
                **self.roll.progress(self.book.member_ids()),
                "member_versions": dict(self.roll.member_versions)}

    async def refuse(self, group_settings: dict, reason: str) -> None:
        """The front door's build refused a deploy whose groups run `group_settings`."""
        self._refusal = (group_settings, reason)
        self._save()

    async def refusal(self, group_settings: dict) -> str | None:
        """Why the deploy whose groups run `group_settings` was refused, if it was."""
        if self._refusal is not None and self._refusal[0] == group_settings:
            return self._refusal[1]
        return None

    # --- metric targets (engram_ray.metrics.target_book) ---------------------------------
    async def register_target(self, key: str, target: str, labels: dict | None = None) -> None:
        await self._rebuilt()
        self.metric_targets.register(key, target, labels)
        self._save()

    async def target_groups(self) -> list[dict]:
        """Every engine's /metrics as Prometheus target groups (file_sd and http_sd)."""
        return self.metric_targets.groups()

    async def metrics_slot(self, replica_id: str, node_id: str) -> int:
        """The replica's slot on its node (the lowest free one; the same on a second ask)."""
        await self._rebuilt()
        slot = self.metric_targets.slot(replica_id, node_id)
        self._save()
        return slot

    # --- its end -------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Remove every store folder of the application's groups, every metrics target (an
        empty file_sd list), and close the http_sd port."""
        self.book.remove_stores()
        gangs, self.book.ended_gangs = self.book.ended_gangs, []
        await asyncio.to_thread(_forget_gangs, gangs)
        self.metric_targets.clear()
        sd_server, self.sd_server = self.sd_server, None
        if sd_server is not None:  # its thread may wait on this loop (`_read`): not here
            await asyncio.to_thread(sd_server.stop)

    async def _end_with_application(self) -> None:
        """Its Serve application is gone: clean up and end this actor for good."""
        logger.warning("engram-ray: the application of %s is gone: the coordinator removes "
                       "its store folders and targets and ends", self.deployment_name)
        await self.shutdown()
        save_settings(coordinator_name(self.deployment_name), None)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def _forget_gangs(gang_ids: list[str]) -> None:
    """The DP round keys of gangs whose generation ended (`dp_gang.forget_gang`)."""
    from engram_ray.serve.member.dp_gang import forget_gang

    for gang_id in gang_ids:
        try:
            forget_gang(gang_id)
        except Exception:  # noqa: BLE001 - the GCS busy: left for the application's end
            logger.exception("engram-ray: removing the DP round keys of gang %s failed", gang_id)

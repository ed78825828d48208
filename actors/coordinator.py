"""`Coordinator`: the per-group bookkeeping of one Serve application, in one named actor
(`engram-coordinator-<deployment name>`, namespace `engram`, on the head node).

Serve's gang scheduling owns what this actor did before: placing a group (one gang per group,
`actors/placement.py`), ranks and world size (`gang_context`), noticing a dead member and
restarting the group as one (RESTART_GANG). What is left is here, held for every group of the
application (`engram_ray.planning.generations.GenerationBook`): the generation of each group (a new gang
id opens one: fresh FileStore folder, old one removed), each member's slices, and the list of
every engine's /metrics for Prometheus: written as a file_sd list on the head node
(`serving.prometheus_targets_file`, for `ray up`), served as Prometheus HTTP service discovery
when `serving.http_sd_port` is set (GET /targets, for Prometheus in another pod), and the slot
of each engine on its node (0, 1, ...: its fixed ports with `serving.metrics_port`). Its own
series (groups configured and serving, a roll's progress, its restarts:
`engram_ray.metrics.coordinator`) are at GET /metrics of the same endpoint (a free port when
`http_sd_port` is 0), listed among the targets as `endpoint="coordinator"`.

Routing (`routing`, long-polled by the ingress): a group serves while every member of its
generation has been ready, none is lost and one at least is not restarting; the ingress sends
requests to the members that serve. A member whose engine died restarts it in place
(`member_restarting`, then `member_ready`). A member is lost when its replica reports it
(`report_broken`: no slices to re-attach, a failed restart) or stops (`leave`), or when this
actor's watch finds its replica actor dead (pinged every WATCH_PERIOD_S): the ingress stops
sending the group requests within a fraction of a second, long before Serve's health checks
restart the gang.

Created by `engram_ray.serve.app.build_app` before the engines (detached: a `serve deploy` build
task ends, the application stays), found by name (`actors/coordinator_lookup.py`: reuse,
reconfiguration for a rolling change, replacement).

A rolling change (`reconfigure`): with `serving.rollout.mode: in_place` the members restart
their engines with the new settings one at a time, each told by `member_check` when it is its
turn (`engram_ray.planning.in_place_roll`; `member_settings`, `roll_failed`); with `beside` a
gang started beside the serving one takes over once ready and the old one drained
(`member_check`, `may_take_over`, `member_running`: `engram_ray.planning.generation_rollout`).
A change the build refuses is left here (`refuse`) for the groups' builds of the same deploy.

Groups follow capacity (`_follow_capacity`): a group whose domain is lost is placed again in
another with room (`engram_ray.serve.deploy.group_placement`).

Lifetime (`actors/lifetime.py`): killed, it restarts and rebuilds its book from the members
(`rejoin`, sent by `engram_ray.serve.member.link`); it ends with its Serve application,
taking the store folders, the targets and the http_sd port with it.
"""

# Over 300 lines: one actor's calls (members, routing, rebuild, rollouts, targets) share its one
# lock and book; the in-place roll's calls are in actors/coordinator_roll.py.

from __future__ import annotations

import logging
import secrets
import threading
import time

import ray

from engram_ray.actors.coordinator_roll import InPlaceRollMixin
from engram_ray.actors.lifetime import (APP_CHECK_S, REBUILD_WAIT_S, ApplicationWatch,
                                        is_restarted_actor, save_settings, saved_settings)
from engram_ray.metrics.coordinator import CoordinatorMetrics, snapshot_of
from engram_ray.metrics.exposition import TargetsServer, fixed_ports
from engram_ray.metrics.target_book import COORDINATOR_KEY, TargetBook
from engram_ray.planning.assignment import remove_store_dir

logger = logging.getLogger(__name__)
WATCH_PERIOD_S = 0.2     # how often every ready member's replica actor is pinged


def coordinator_name(deployment_name: str) -> str:
    return f"engram-coordinator-{deployment_name}"


# Restarted by Ray when its process dies, calls in flight retried (`actors/lifetime.py`).
@ray.remote(num_cpus=0, max_concurrency=16, max_restarts=-1, max_task_retries=-1)
class Coordinator(InPlaceRollMixin):
    def __init__(self, app_config_dict: dict, domains: dict[str, str]):
        from engram_ray.model.layout import load_layout
        from engram_ray.planning.generations import GenerationBook
        from engram_ray.planning.in_place_roll import InPlaceRoll
        from engram_ray.serve.settings.config import ServeAppConfig
        from engram_ray.serve.settings.config_change import config_version

        restarted = is_restarted_actor()
        # Ray re-runs this constructor with its first arguments: a rolled-out config is kept.
        kept = saved_settings(coordinator_name(ServeAppConfig.from_dict(
            app_config_dict, "coordinator").deployment.name)) if restarted else None
        if kept is not None:
            app_config_dict, domains = kept["app"], kept["domains"]
        # Its members and no others rejoin it after a restart (not those of a coordinator it
        # replaced: serving.rollout.mode restart).
        self.lineage = kept["lineage"] if kept else secrets.token_hex(4)
        self.made_with = (app_config_dict, domains)
        self.config = config = ServeAppConfig.from_dict(app_config_dict, "coordinator")
        self.deployment_name = config.deployment.name
        self.incarnation = secrets.token_hex(4)
        # Versions go on from the wall clock (ms), so an ingress that polled the coordinator
        # before a restart never takes a new table for one it has seen.
        self._version = time.time_ns() // 1_000_000
        self._rebuild_until = time.monotonic() + REBUILD_WAIT_S if restarted else 0.0
        self.book = GenerationBook(config.deployment, load_layout(config.deployment.model),
                                   domains, config.serving.data_parallel_size)
        self.metric_targets = TargetBook(config.serving.prometheus_targets_file)
        self.roll = InPlaceRoll(config_version(app_config_dict))
        self._refusal: tuple[dict, str] | None = None  # (group settings, why) of a refused deploy
        save_settings(coordinator_name(self.deployment_name), app_config_dict, domains,
                      self.lineage)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._actors: dict[str, object] = {}  # replica id -> its actor, for the watch
        # Imported here, before the threads start: both use Ray Serve, and two threads
        # importing it at once see it half-initialized (`engram_ray.serve.deploy.group_placement`).
        from engram_ray.serve.deploy.group_placement import CapacityFollower

        threading.Thread(target=self._watch_members, daemon=True,
                         name="engram-member-watch").start()
        threading.Thread(target=self._follow_capacity, args=(CapacityFollower(),), daemon=True,
                         name="engram-capacity-watch").start()
        started_at = time.time()
        self.metrics = CoordinatorMetrics(config.deployment.model, self.deployment_name,
                                          lambda: self._snapshot(started_at, restarted))
        self.sd_server = TargetsServer(
            self.target_groups if config.serving.http_sd_port else None,
            config.serving.metrics_bind_address, config.serving.http_sd_port,
            registry=self.metrics.registry, avoid=fixed_ports(config.serving.metrics_port))
        self.metric_targets.register(COORDINATOR_KEY, self.sd_server.target(
            ray.util.get_node_ip_address()), {"endpoint": "coordinator"})
        if self._rebuild_until:
            logger.warning("engram-ray: coordinator %s restarted; rebuilding its groups from "
                           "their members for up to %.0f s", self.deployment_name,
                           REBUILD_WAIT_S)

    # --- a restart: the members tell it what they hold (actors/lifetime.py) -----------------
    def member_check(self, replica_id: str | None = None, in_flight: int | None = None,
                     knows_retired: bool = False, config_version: str | None = None) -> dict:
        """{"incarnation" (a member that joined another one rejoins: `rejoin`), "retired"
        (the member's gang was replaced by a rolling change: it takes no new requests),
        "restart_for" (the settings version its engine restarts with now, or None),
        "restart_epoch" (the number of the restart in place it is part of now, or None: a
        member of a data-parallel gang restarts when another member's engine died)};
        `in_flight`: the requests the member runs, counted once it `knows_retired`;
        `config_version`: the settings its engine runs."""
        with self._lock:
            is_retired = replica_id is not None and self.book.is_retired(replica_id)
            if is_retired and knows_retired and in_flight is not None:
                self.book.report_in_flight(replica_id, in_flight)
            restart_for = None
            if replica_id is not None and config_version is not None and \
                    not self._rebuild_until:
                restart_for = self._roll_turn_locked(replica_id, config_version)
            restart_epoch = self.book.restart_epoch(replica_id) if replica_id else None
            return {"incarnation": self.incarnation, "retired": is_retired,
                    "restart_for": restart_for, "restart_epoch": restart_epoch}

    def member_running(self, replica_id: str) -> None:
        """Serve runs the member (its first health check passed)."""
        self._wait_rebuilt()
        with self._lock:
            if self.book.member_running(replica_id):
                self._routing_changed_locked()

    def may_take_over(self, replica_id: str) -> bool | None:
        """A member of a gang started beside a serving one may end its start (then Serve
        stops the old gang): its gang took over and the old one drained; None: its gang
        failed meanwhile (`GenerationBook.may_take_over`)."""
        self._wait_rebuilt()
        with self._lock:
            return self.book.may_take_over(replica_id,
                                           self.config.serving.rollout.drain_timeout_s)

    def reconfigure(self, app_config_dict: dict, domains: dict[str, str]) -> None:
        """A changed config that rolls out (`get_coordinator`): new generations use it, the
        serving ones go on until their gangs are replaced; groups added or removed."""
        from engram_ray.serve.settings.config import ServeAppConfig

        from engram_ray.serve.settings.config_change import config_version

        config = ServeAppConfig.from_dict(app_config_dict, "coordinator")
        with self._lock:
            self._refusal = None
            if self.roll.set_target(config_version(app_config_dict)) and \
                    config.serving.rollout.mode == "in_place":
                logger.warning("engram-ray: coordinator %s rolls settings %s out: each "
                               "member's engine restarts in place, one per group at a time",
                               self.deployment_name, self.roll.version)
            self.book.reconfigure(config.deployment, domains)
            self.config, self.made_with = config, (app_config_dict, domains)
            self.metric_targets.targets_file = config.serving.prometheus_targets_file
            save_settings(coordinator_name(self.deployment_name), app_config_dict, domains,
                      self.lineage)
            self._routing_changed_locked()
        logger.warning("engram-ray: coordinator %s reconfigured: groups %s", self.deployment_name,
                       sorted(domains))

    def rejoin(self, member: dict, actor=None) -> str | None:
        """A member of a coordinator that died: `member` as `GenerationBook.rejoin` takes it
        plus its metric `targets` ({key: {"target", "labels"}}), `slot` and `node_id`. The
        incarnation, or None when this coordinator will not have it (a newer generation)."""
        with self._lock:
            if member["assignment"].get("lineage") != self.lineage or \
                    not self.book.rejoin(member):
                return None
            replica_id = member["replica_id"]
            self.roll.running(replica_id, member.get("config_version"))
            if actor is not None and member.get("ready_at") is not None:
                self._actors[replica_id] = actor
            self.metric_targets.restore(replica_id, member.get("node_id"), member.get("slot"),
                                        member.get("targets") or {})
            if self._rebuild_until and self.book.is_complete():
                self._end_rebuild_locked()
            elif not self._rebuild_until:  # a late rejoin may change the table
                self._routing_changed_locked()
            return self.incarnation

    def _wait_rebuilt(self) -> None:
        """Calls that read or change groups wait until the members have rejoined."""
        if self._rebuild_until:
            with self._changed:
                self._changed.wait_for(lambda: not self._rebuild_until,
                                       timeout=max(0.0, self._rebuild_until - time.monotonic()))
                if self._rebuild_until:
                    self._end_rebuild_locked()

    def _end_rebuild_locked(self) -> None:
        """Every serving gang is back: calls go on. Folders no member claimed are removed
        only `REBUILD_WAIT_S` later: the current gangs can all be back before a gang starting
        beside them has rejoined (its members ask every `MEMBER_CHECK_S` like the others),
        and removing its folder would cost it its holder sockets and rendezvous."""
        self._rebuild_until = 0.0
        self.book.end_rebuild()
        logger.warning("engram-ray: coordinator %s rebuilt: %s", self.deployment_name, {
            g: r["reason"] or "serving" for g, r in self.book.routing().items()})
        self._routing_changed_locked()
        timer = threading.Timer(REBUILD_WAIT_S, self._remove_unclaimed)
        timer.daemon = True
        timer.start()

    def _remove_unclaimed(self) -> None:
        """Store folders of generations no member rejoined (an interrupted gang's) removed."""
        with self._lock:
            stale = self.book.unclaimed_store_dirs()
            for store_dir in stale:
                remove_store_dir(store_dir)
        if stale:
            logger.warning("engram-ray: coordinator %s: %d store folder(s) nobody claimed "
                           "after its rebuild removed", self.deployment_name, len(stale))

    def describe(self) -> tuple[tuple, int]:
        """(what it was made with, number of members of current generations), once a
        restarted coordinator has heard from its members (a build must not take it for
        empty)."""
        self._wait_rebuilt()
        with self._lock:
            return self.made_with, self.book.num_members()

    def join(self, group_id: str, gang_id: str, rank: int, world_size: int, replica_id: str,
             node_labels: dict | None = None) -> dict:
        self._wait_rebuilt()
        with self._lock:
            assignment = dict(self.book.join(group_id, gang_id, rank, world_size, replica_id,
                                             node_labels), incarnation=self.incarnation,
                              lineage=self.lineage)
            self.roll.running(replica_id, self.roll.version)  # it starts on these settings
            self._forget_ended_locked()
            self._routing_changed_locked()
            return assignment

    def leave(self, replica_id: str) -> None:
        self._wait_rebuilt()
        with self._lock:
            self.book.leave(replica_id)
            self.roll.forget(replica_id)
            self._actors.pop(replica_id, None)
            self._routing_changed_locked()
            self.metric_targets.forget(replica_id)

    # --- routing ------------------------------------------------------------------------
    def member_ready(self, replica_id: str, actor=None, config_version: str | None = None
                     ) -> None:
        """The member's engine serves (on settings `config_version`); `actor` (its replica
        actor) is watched from now on."""
        self._wait_rebuilt()
        with self._lock:
            self.roll.running(replica_id, config_version)
            if self.book.member_ready(replica_id) is not None:
                if actor is not None:
                    self._actors[replica_id] = actor
                self._routing_changed_locked()

    def member_restarting(self, replica_id: str, reason: str) -> int | None:
        """Member `replica_id`'s engine died and restarts in place (its replica holds its
        slices), with the rest of its data-parallel gang if it has one: the ingress stops
        sending them requests; its group's other members serve on. The restart's number
        (`GenerationBook.member_restarting`), or None when its generation no longer serves
        (then it is not restarted in place)."""
        self._wait_rebuilt()
        with self._lock:
            epoch = self.book.member_restarting(replica_id, reason)
            if epoch is None:
                return None
            group_id, generation, rank = self.book.find_member(replica_id)
            logger.warning("engram-ray: %s generation %s member %d restarts its engine%s: %s",
                           group_id, generation, rank, " with its data-parallel gang"
                           if self.book.dp_size > 1 else "", reason)
            self._routing_changed_locked()
            return epoch

    def report_broken(self, replica_id: str, reason: str) -> None:
        """Member `replica_id` is lost (its engine died, its health check failed)."""
        self._wait_rebuilt()
        with self._lock:
            self._break_locked(replica_id, reason)

    def routing(self, version: int = -1, timeout_s: float = 0.0) -> tuple[int, dict]:
        """(version, {group_id: {"generation", "serving", "reason"}}), returned as soon as
        the version differs from `version`, else after `timeout_s` (a long poll)."""
        self._wait_rebuilt()
        with self._changed:
            self._changed.wait_for(lambda: self._version != version, timeout=timeout_s)
            return self._version, self.book.routing()

    def _break_locked(self, replica_id: str, reason: str) -> None:
        if self.book.is_retired(replica_id):  # a replaced gang's member stopped
            self.book.leave(replica_id)
            return
        member = self.book.find_member(replica_id)
        if member is None:
            return
        group_id, generation, rank = member
        if self.book.break_generation(group_id, generation, f"member {rank}: {reason}"):
            logger.warning("engram-ray: %s generation %s stops serving: member %d: %s",
                           group_id, generation, rank, reason)
            self._routing_changed_locked()

    def _routing_changed_locked(self) -> None:
        self._version += 1
        self._changed.notify_all()

    def _watch_members(self) -> None:
        """Ping every ready member's replica actor (one ping outstanding per member, so a
        busy replica delays no other's check); one found dead breaks its generation."""
        pending: dict = {}  # ping ref -> replica id
        application, app_checked_at = ApplicationWatch(self.deployment_name), time.monotonic()
        while True:
            time.sleep(WATCH_PERIOD_S)
            if time.monotonic() - app_checked_at >= APP_CHECK_S:
                app_checked_at = time.monotonic()
                try:
                    gone = application.gone()
                except Exception:  # noqa: BLE001 - this watch must outlive any one failure
                    logger.exception("engram-ray: asking Serve whether %s's application is "
                                     "there failed; asking again", self.deployment_name)
                    gone = False
                if gone:
                    self._end_with_application()
            with self._lock:
                watched = dict(self._actors)
            waiting = set(pending.values())
            for replica_id, actor in watched.items():
                if replica_id not in waiting:
                    pending[actor.__ray_ready__.remote()] = replica_id
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            for ref in done:
                replica_id = pending.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.ActorUnavailableError:
                    continue  # unreachable for now (restarting, a network blip): ask again
                except Exception as exc:  # ActorDiedError: gone for good
                    with self._lock:
                        if self._actors.pop(replica_id, None) is not None:
                            self._break_locked(replica_id, "replica actor lost "
                                                           f"({type(exc).__name__})")

    def _follow_capacity(self, follower) -> None:
        """A group whose domain is lost is placed again in one with room (`follower`:
        `engram_ray.serve.deploy.group_placement.CapacityFollower`); its new domain is kept
        here and in the saved settings, so a restart or the next build keeps it there."""
        from engram_ray.serve.deploy.group_placement import CHECK_PERIOD_S

        last_error = None
        while True:
            time.sleep(CHECK_PERIOD_S)
            try:
                moved = follower.check(self.config.deployment)
            except Exception as exc:  # noqa: BLE001 - Serve busy or restarting: checked again
                if repr(exc) != last_error:  # once per kind of failure, not every period
                    logger.exception("engram-ray: checking the domains of %s's groups failed",
                                     self.deployment_name)
                last_error = repr(exc)
                continue
            last_error = None
            if moved:
                with self._lock:
                    app_config_dict, domains = self.made_with
                    domains = {**domains, **moved}
                    self.book.reconfigure(self.config.deployment, domains)
                    self.made_with = (app_config_dict, domains)
                    save_settings(coordinator_name(self.deployment_name), app_config_dict,
                                  domains, self.lineage)
                    self._routing_changed_locked()

    def _snapshot(self, started_at: float, restarted: bool):
        with self._lock:
            return snapshot_of(self.config, self.book, self.roll, started_at, restarted)

    def status(self) -> dict:
        self._wait_rebuilt()
        with self._lock:
            return self.book.status()

    def shutdown(self) -> None:
        """Remove every store folder of the application's groups, every metrics target (an
        empty file_sd list), and close the http_sd port."""
        with self._lock:
            self.book.remove_stores()
            self.metric_targets.clear()
            sd_server, self.sd_server = self.sd_server, None
        if sd_server is not None:  # outside the lock: a request being answered takes it
            sd_server.stop()

    def _end_with_application(self) -> None:
        """Its Serve application is gone: clean up and end this actor for good."""
        logger.warning("engram-ray: the application of %s is gone: the coordinator removes "
                       "its store folders and targets and ends", self.deployment_name)
        self.shutdown()
        save_settings(coordinator_name(self.deployment_name), None, None)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    # --- metric targets (engram_ray.metrics.target_book) -----------------------------------
    def register_target(self, key: str, target: str, labels: dict | None = None) -> None:
        self._wait_rebuilt()
        with self._lock:
            self.metric_targets.register(key, target, labels)

    def target_groups(self) -> list[dict]:
        """Every engine's /metrics as Prometheus target groups (file_sd and http_sd)."""
        with self._lock:
            return self.metric_targets.groups()

    def metrics_slot(self, replica_id: str, node_id: str) -> int:
        """The replica's slot on its node (the lowest free one; the same on a second ask)."""
        self._wait_rebuilt()
        with self._lock:
            return self.metric_targets.slot(replica_id, node_id)

    def _forget_ended_locked(self) -> None:
        """Targets of replicas no live generation holds (stopped with their gang)."""
        current = self.book.member_ids()
        for replica_id in [r for r in self._actors if r not in current]:
            del self._actors[replica_id]
        for replica_id in [r for r in self.roll.member_versions if r not in current]:
            self.roll.forget(replica_id)
        self.metric_targets.keep_only(current.__contains__)

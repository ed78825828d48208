"""A member's engine settings, from its coordinator, and their change in place
(`serving.rollout.mode: in_place`; the coordinator's side: `engram_ray.planning.in_place_roll`).

An engine runs the coordinator's `IN_PLACE_SETTINGS` (`member_settings`: its version and the
app config), taken at the member's start and again at every roll. When its turn comes
(`member_check` answers `restart_for`, the coordinator already routes around it):

    drain        new requests refused (`MemberRetiredError`: the ingress sends them to a
                 member that serves), the running ones finished, up to `drain_timeout_s`
    restart      the engine stopped and started with the new settings, in its generation,
                 its slices re-attached (`MemberRestartMixin._restart_engine`)
    ready        `member_ready` with the new version: the next member's turn
    DP gangs     the members of a data-parallel gang get the turn together, drain, wait for
                 each other (`dp_barrier`), then restart on a new DP master
                 (`MemberRestartMixin._meet_dp_gang`); a rollback restarts them together too
    or rollback  the new engine would not start (or not within `in_place_timeout_s`): the
                 engine starts again on the old settings, `roll_failed` stops the roll there,
                 the member serves on; if even that fails the member is lost (gang restart)
"""

from __future__ import annotations

import asyncio
import logging
import time

logger = logging.getLogger("ray.serve")
DRAIN_POLL_S = 0.1


class MemberRollMixin:
    """Mixed into `engram_ray.serve.replica.EngramServerMixin`."""

    _config_version: str | None = None   # the settings its engine runs
    _draining = False                    # refuses new requests: its engine is about to restart
    _roll_task: asyncio.Task | None = None
    _own_kwargs: dict | None = None      # engine arguments its class set (DP rank, ...)
    _member_additional: dict | None = None  # additional_config keys the replica adds

    def _set_engine_kwargs(self, app) -> None:
        """The engine arguments of `app` (`engram_ray.serve.app.engine_kwargs`) plus the ones
        this replica adds, in its `LLMConfig` and its cached engine config alike (Ray Serve
        LLM caches a copy; a key the new settings drop must go from both)."""
        from engram_ray.serve.app import engine_kwargs
        from engram_ray.serve.kv_cache import probe_engine_kwargs

        kwargs = {**engine_kwargs(app), **(self._own_kwargs or {})}
        kwargs["additional_config"] = {**(kwargs.get("additional_config") or {}),
                                       **(self._member_additional or {})}
        kwargs.update(probe_engine_kwargs(kwargs))
        self._llm_config.engine_kwargs.clear()
        self._llm_config.engine_kwargs.update(kwargs)
        cached = self._llm_config._engine_config
        if cached is not None:  # split into engine and frontend arguments as Ray Serve LLM does
            fresh = type(cached).from_llm_config(self._llm_config)
            for name in ("engine_kwargs", "frontend_kwargs"):
                getattr(cached, name).clear()
                getattr(cached, name).update(getattr(fresh, name))
        self._app = app

    def _app_with(self, settings: dict):
        """This replica's app config with the `IN_PLACE_SETTINGS` of `settings` (the
        coordinator's app config)."""
        from engram_ray.serve.config import ServeAppConfig
        from engram_ray.serve.config_change import with_in_place_values

        return ServeAppConfig.from_dict(with_in_place_values(self._app.to_dict(), settings),
                                        "replica")

    async def _take_settings(self) -> None:
        """This engine's settings from the coordinator; the replica's own start adds its
        peer-group keys after."""
        version, settings = await self._coordinator.member_settings.remote()
        self._app, self._config_version = self._app_with(settings), version

    def _on_roll_turn(self, version: str, epoch: int | None = None) -> None:
        """`member_check` said: restart with settings `version` now, as restart `epoch` of
        its data-parallel gang (a member holding no slices cannot: the roll stops at it, and
        it serves on)."""
        if self._roll_task is None or self._roll_task.done():
            if self._restarting or self._restart_error is not None:
                return
            roll = (self._roll(version, epoch or self._dp_epoch + 1)
                    if self.can_restart_in_place() else self._cannot_roll())
            self._roll_task = asyncio.get_running_loop().create_task(roll)

    async def _cannot_roll(self) -> None:
        from engram_ray.serve.member_restart import own_actor

        await self._coordinator.roll_failed.remote(
            self._replica_id, "its engine cannot restart in place (its replica holds no "
            "slices: FABRIC-only slices)")
        await self._coordinator.member_ready.remote(self._replica_id, own_actor(),
                                                    self._config_version)

    async def _roll(self, version: str, epoch: int) -> None:
        from engram_ray.serve.config import ServeAppConfig
        from engram_ray.serve.member_restart import restart_failure

        a, old_app, old_version = self._assignment, self._app, self._config_version
        name = f"{a['group_id']}-r{a['member_rank']}"
        new_version, settings = await self._coordinator.member_settings.remote()
        if new_version == old_version:
            await self._coordinator.member_ready.remote(self._replica_id, None, old_version)
            return
        new_app = self._app_with(settings)
        # The front door's own settings (the rollout's) are the coordinator's current ones.
        rollout = ServeAppConfig.from_dict(settings, "coordinator").serving.rollout
        self._restarting = True  # health checks pass while it drains and restarts
        self._note_restarting(f"settings {new_version} rolling out")
        started = time.monotonic()
        self._dp_epoch = epoch
        try:
            drained = await self._drain(rollout.drain_timeout_s)
            await self._gang_drained(epoch, rollout.drain_timeout_s)
            self._stop_watching_engine()
            try:
                self._set_engine_kwargs(new_app)
                phases = await asyncio.wait_for(self._restart_engine(str(epoch)),
                                                rollout.in_place_timeout_s)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - the roll stops; old settings again
                reason = restart_failure(exc, rollout.in_place_timeout_s)
                logger.error("engram-ray: engine %s did not start with settings %s (%s): "
                             "starting it again on settings %s", name, new_version, reason,
                             old_version)
                await self._roll_back(old_app, old_version, name, reason, f"{epoch}-back")
                return
            self._config_version = new_version
        finally:
            self._restarting, self._draining = False, False
            self._note_restarting(None)
        await self._served_again(new_version)
        logger.warning("engram-ray: engine %s restarted in place with settings %s in %.1f s "
                       "(%d request(s) drained%s; %s)", name, new_version,
                       time.monotonic() - started, drained[0],
                       "" if drained[1] else ", drain timed out",
                       ", ".join(f"{step} {s:.1f} s" for step, s in phases.items()))

    async def _roll_back(self, old_app, old_version: str, name: str, reason: str,
                         dp_round: str) -> None:
        """The engine on its old settings again; the roll stops at this member (and its
        data-parallel gang, whose engines fail with it and start again with it)."""
        self._restarting = True
        try:
            self._set_engine_kwargs(old_app)
            await self._restart_engine(dp_round)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - lost: Serve restarts the gang
            await self._lose(f"engine {name} could not start again on its old settings after "
                             f"a failed roll ({reason}): {type(exc).__name__}: {exc}")
            return
        finally:
            self._restarting, self._draining = False, False
        self._config_version = old_version
        await self._coordinator.roll_failed.remote(
            self._replica_id, f"engine {name} did not start with the new settings: {reason}")
        await self._served_again(old_version)

    async def _served_again(self, version: str) -> None:
        from engram_ray.serve.member_restart import own_actor

        self._death = None
        self.engram_metrics.count_engine_restart()
        self.engram_metrics.set_group(self._assignment["generation_index"], True)
        await self._coordinator.member_ready.remote(self._replica_id, own_actor(), version)
        self._engine_watch_task = asyncio.get_running_loop().create_task(self._watch_engine())

    async def _drain(self, timeout_s: float) -> tuple[int, bool]:
        """Refuse new requests, then wait until the running ones end: (how many ran when
        the drain began, whether they all ended within `timeout_s`)."""
        self._draining = True
        running, deadline = self._in_flight, time.monotonic() + timeout_s
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return running, not self._in_flight

    async def _gang_drained(self, epoch: int, drain_timeout_s: float) -> None:
        """A member of a data-parallel gang stops its engine only once every member of the
        gang has drained: the first engine to stop ends its peers' (one vLLM DP group), with
        whatever they still ran."""
        if getattr(self, "dp_size", 1) == 1:
            return
        from engram_ray.serve.dp_gang import dp_barrier

        if not await dp_barrier(f"{self.gang_id}@{epoch}", self.dp_rank, self.dp_size,
                                drain_timeout_s + 30.0):
            logger.warning("engram-ray: not every member of DP gang %s drained in time: "
                           "restarting anyway", self.gang_id)

    def _stop_watching_engine(self) -> None:
        """The engine stops on purpose: its death watch must not restart it."""
        watch = getattr(self, "_engine_watch_task", None)
        if watch is not None and not watch.done():
            watch.cancel()

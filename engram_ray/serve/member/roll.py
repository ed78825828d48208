"""A member's engine settings, from its coordinator, and their change in place
(`serving.rollout.mode: in_place`; the coordinator's side: `engram_ray.planning.in_place_roll`).

An engine runs the coordinator's `IN_PLACE_SETTINGS` (`member_settings`: its version and the
app config), taken at the member's start and again at every roll. When its turn comes
(`member_check` answers `restart_for`, the coordinator already routes around it):

    drain        new requests refused (`MemberRetiredError`: the ingress sends them to a
                 member that serves), the running ones finished, up to `drain_timeout_s`
    restart      the engine stopped and started with the new settings, in its generation,
                 its slices re-attached (`MemberEngine.restart`)
    ready        `member_ready` with the new version: the next member's turn
    DP gangs     the members of a data-parallel gang get the turn together, drain, wait for
                 each other (`dp_barrier`), then restart on a new DP master
                 (`MemberEngine.restart`); a rollback restarts them together too
    or rollback  the new engine would not start (or not within `in_place_timeout_s`): the
                 engine starts again on the old settings, `roll_failed` stops the roll there,
                 the member serves on; if even that fails the member is lost (gang restart)
"""

from __future__ import annotations

import asyncio
import logging
import time

from engram_ray.serve.member.link import current_rollout
from engram_ray.serve.member.processes import own_actor
from engram_ray.serve.member.restart import restart_failure

logger = logging.getLogger("ray.serve")


class SettingsRoll:
    """The settings of `server`'s engine and their roll (module doc); the server's parts it
    uses: `_coordinator`, `_replica_id`, `_assignment`, `_app`, `_member_engine`, `_restarts`,
    `_requests`."""

    def __init__(self, server):
        self.server = server
        self.version: str | None = None   # the settings its engine runs
        self._task: asyncio.Task | None = None

    def is_rolling(self) -> bool:
        return self._task is not None and not self._task.done()

    def app_with(self, settings: dict):
        """The member's app config with the `IN_PLACE_SETTINGS` of `settings` (the
        coordinator's app config)."""
        from engram_ray.serve.settings.config import ServeAppConfig
        from engram_ray.serve.settings.config_change import with_in_place_values

        return ServeAppConfig.from_dict(with_in_place_values(self.server._app.to_dict(),
                                                             settings), "replica")

    async def take_settings(self) -> None:
        """This engine's settings from the coordinator; the member's start adds its
        peer-group keys after."""
        version, settings = await self.server._coordinator.member_settings.remote()
        self.server._app, self.version = self.app_with(settings), version

    def on_turn(self, version: str, epoch: int | None = None) -> None:
        """`member_check` said: restart with settings `version` now, as restart `epoch` of
        its data-parallel gang (a member holding no slices cannot: the roll stops at it, and
        it serves on)."""
        restarts = self.server._restarts
        if self.is_rolling() or restarts.is_restarting or restarts.error is not None:
            return
        roll = (self._roll(version, epoch or restarts.dp_epoch + 1) if restarts.can_restart()
                else self._cannot_roll())
        self._task = asyncio.get_running_loop().create_task(roll)

    async def _cannot_roll(self) -> None:
        server = self.server
        await server._coordinator.roll_failed.remote(
            server._replica_id, "its engine cannot restart in place (its replica holds no "
            "slices: FABRIC-only slices)")
        await server._coordinator.member_ready.remote(server._replica_id, own_actor(),
                                                      self.version)

    async def _roll(self, version: str, epoch: int) -> None:
        server, restarts = self.server, self.server._restarts
        a, old_app, old_version = server._assignment, server._app, self.version
        name = f"{a['group_id']}-r{a['member_rank']}"
        new_version, settings = await server._coordinator.member_settings.remote(version)
        if new_version == old_version:
            await server._coordinator.member_ready.remote(server._replica_id, None, old_version)
            return
        new_app = self.app_with(settings)
        rollout = current_rollout(server)  # the front door's, as deployed now
        restarts.is_restarting = True  # health checks pass while it drains and restarts
        restarts.note(f"settings {new_version} rolling out")
        started = time.monotonic()
        restarts.dp_epoch = epoch
        try:
            drained = await server._requests.drain(rollout.drain_timeout_s)
            await self._gang_drained(epoch, rollout.drain_timeout_s)
            server._member_engine.stop_watching()
            try:
                server._member_engine.set_kwargs(new_app)
                phases = await asyncio.wait_for(server._member_engine.restart(str(epoch)),
                                                rollout.in_place_timeout_s)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - the roll stops; old settings again
                reason = restart_failure(exc, rollout.in_place_timeout_s)
                logger.error("engram-ray: engine %s did not start with settings %s (%s): "
                             "starting it again on settings %s", name, new_version, reason,
                             old_version)
                await self._roll_back(old_app, old_version, name, reason, f"{epoch}-back",
                                      rollout.in_place_timeout_s, new_version)
                return
            self.version = new_version
        finally:
            restarts.is_restarting = False
            server._requests.draining = False
            restarts.note(None)
        await restarts.serving_again(new_version)
        logger.warning("engram-ray: engine %s restarted in place with settings %s in %.1f s "
                       "(%d request(s) drained%s; %s)", name, new_version,
                       time.monotonic() - started, drained[0],
                       "" if drained[1] else ", drain timed out",
                       ", ".join(f"{step} {s:.1f} s" for step, s in phases.items()))

    async def _roll_back(self, old_app, old_version: str, name: str, reason: str,
                         dp_round: str, timeout_s: float, new_version: str) -> None:
        """The engine on its old settings again, within `timeout_s` (past it the member is
        lost: Serve restarts the gang); the roll stops at this member (and its data-parallel
        gang, whose engines fail with it and start again with it)."""
        server, restarts = self.server, self.server._restarts
        restarts.is_restarting = True
        try:
            server._member_engine.set_kwargs(old_app)
            await asyncio.wait_for(server._member_engine.restart(dp_round), timeout_s)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - lost: Serve restarts the gang
            await restarts.lose(f"engine {name} could not start again on its old settings "
                                f"after a failed roll ({reason}): "
                                f"{restart_failure(exc, timeout_s)}")
            return
        finally:
            restarts.is_restarting = False
            server._requests.draining = False
        self.version = old_version
        await server._coordinator.roll_failed.remote(
            server._replica_id, f"engine {name} did not start with the new settings: {reason}",
            new_version)
        await restarts.serving_again(old_version)

    async def _gang_drained(self, epoch: int, drain_timeout_s: float) -> None:
        """A member of a data-parallel gang stops its engine only once every member of the
        gang has drained: the first engine to stop ends its peers' (one vLLM DP group), with
        whatever they still ran."""
        server = self.server
        if getattr(server, "dp_size", 1) == 1:
            return
        from engram_ray.serve.member.dp_gang import dp_barrier

        if not await dp_barrier(f"{server.gang_id}@{epoch}", server.dp_rank, server.dp_size,
                                drain_timeout_s + 30.0):
            logger.warning("engram-ray: not every member of DP gang %s drained in time: "
                           "restarting anyway", server.gang_id)

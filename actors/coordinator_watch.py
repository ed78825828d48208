"""What the coordinator watches (`actors/coordinator.py`): every ready member's replica actor
(pinged every `WATCH_PERIOD_S`, one ping outstanding per member, so a busy replica delays no
other's), its Serve application (`actors/lifetime.py`), and the domains of its groups
(`engram_ray.serve.deploy.group_placement.CapacityFollower`). Findings reach the coordinator on
its event loop; what asks Serve (a blocking call) runs in a worker thread, never on the loop.

NOTES: the pings run in a thread of their own (`ray.wait` with no timeout over the pending
pings): awaited one by one on the loop, 72 members' pings five times a second cost the
members' own calls (member_check p99 22 ms against 7 ms, 2 cores, 2026-12-07).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import ray

from engram_ray.actors.lifetime import APP_CHECK_S, ApplicationWatch

logger = logging.getLogger("engram_ray.actors.coordinator")
WATCH_PERIOD_S = 0.2     # how often every ready member's replica actor is pinged


class CoordinatorWatch:
    """`on_lost(replica_id, why)`: a watched replica actor is gone for good;
    `on_app_gone()`: the application is gone; `on_moved(domains)`: groups placed again."""

    def __init__(self, deployment_name: str, on_lost, on_app_gone, on_moved, deployment):
        self.deployment_name = deployment_name
        self.actors: dict[str, object] = {}  # replica id -> its actor
        self._on_lost, self._on_app_gone, self._on_moved = on_lost, on_app_gone, on_moved
        self._deployment = deployment        # () -> the current DeploymentConfig
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        # Imported here, before any worker thread: both use Ray Serve, and two threads
        # importing it at once see it half-initialized (`group_placement`).
        from engram_ray.serve.deploy.group_placement import CapacityFollower

        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch_application()),
                       loop.create_task(self._follow_capacity(CapacityFollower()))]
        threading.Thread(target=self._ping_members, args=(loop,), daemon=True,
                         name="engram-member-watch").start()

    def watch(self, replica_id: str, actor) -> None:
        self.actors[replica_id] = actor

    def forget(self, replica_id: str) -> None:
        self.actors.pop(replica_id, None)

    def _ping_members(self, loop) -> None:
        """In its own thread: `actors` is read as a copy (one dict copy, atomic under the
        GIL); a member found dead goes to `_on_lost` on the loop."""
        pending: dict = {}  # ping ref -> (replica id, actor)
        while True:
            time.sleep(WATCH_PERIOD_S)
            waiting = {replica_id for replica_id, _ in pending.values()}
            for replica_id, actor in dict(self.actors).items():
                if replica_id not in waiting:
                    pending[actor.__ray_ready__.remote()] = (replica_id, actor)
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            for ref in done:
                replica_id, actor = pending.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.ActorUnavailableError:
                    continue  # unreachable for now (restarting, a network blip): asked again
                except Exception as exc:  # noqa: BLE001 - ActorDiedError: gone for good
                    loop.call_soon_threadsafe(self._lost, replica_id, actor,
                                              f"replica actor lost ({type(exc).__name__})")

    def _lost(self, replica_id: str, actor, why: str) -> None:
        if self.actors.get(replica_id) is actor:  # not one watched anew meanwhile
            del self.actors[replica_id]
            self._on_lost(replica_id, why)

    async def _watch_application(self) -> None:
        application = ApplicationWatch(self.deployment_name)
        while True:
            await asyncio.sleep(APP_CHECK_S)
            try:
                gone = await asyncio.to_thread(application.gone)
            except Exception:  # noqa: BLE001 - this watch must outlive any one failure
                logger.exception("engram-ray: asking Serve whether %s's application is there "
                                 "failed; asking again", self.deployment_name)
                continue
            if gone:
                await self._on_app_gone()
                return

    async def _follow_capacity(self, follower) -> None:
        """A group whose domain is lost is placed again in one with room."""
        from engram_ray.serve.deploy.group_placement import CHECK_PERIOD_S

        last_error = None
        while True:
            await asyncio.sleep(CHECK_PERIOD_S)
            try:
                moved = await asyncio.to_thread(follower.check, self._deployment())
            except Exception as exc:  # noqa: BLE001 - Serve busy or restarting: checked again
                if repr(exc) != last_error:  # once per kind of failure, not every period
                    logger.exception("engram-ray: checking the domains of %s's groups failed",
                                     self.deployment_name)
                last_error = repr(exc)
                continue
            last_error = None
            if moved:
                self._on_moved(moved)

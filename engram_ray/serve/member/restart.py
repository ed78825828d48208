"""One member's engine restarted inside its replica, in its generation, while the group serves.

A replica holds its engine's table slices (`engram_ray.tables.slice_holder.SliceHolder`, in
the replica process: it outlives the engine's processes and needs no CUDA context). When the
engine dies (EngineCore or its worker: vLLM's client reports `errored`):

    coordinator.member_restarting   the ingress sends this member no requests; its peers serve
    stop the dead engine            vLLM's client shut down; every process the engine started
                                    killed and waited for (`EngineProcesses`), so none keeps
                                    memory or the fixed metrics port; its ring buffers released
    start a new engine              same settings: same generation, rank and store; the model
                                    process finds its holder full and re-attaches every slice
                                    (no checkpoint read, no rendezvous, digests checked)
    coordinator.member_ready        requests again; `engram_engine_restarts` counts it

A member of a data-parallel gang (`serving.data_parallel_size` > 1: its engines form one
vLLM DP group, which cannot lose a rank) restarts with its gang: the coordinator marks every
member of the gang restarting (`member_restarting` returns the restart's number), the others
learn it at their next `member_check` and stop their engines too, and the gang's engines
form a new DP group on a fresh master port (`MemberEngine.restart`). The group's other DP gangs
serve throughout.

A member whose holder holds nothing (FABRIC-only slices) or whose restart fails or does not
serve within `serving.rollout.in_place_timeout_s` is reported lost: its generation breaks,
Serve restarts the whole gang and a new generation starts, as when a replica, its GPU or its
node is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time

from engram_ray.serve.member.link import current_rollout
from engram_ray.serve.member.processes import own_actor

logger = logging.getLogger("ray.serve")


class InPlaceRestart:
    """The restart in place of `server`'s engine (module doc); the server's parts it uses:
    `_coordinator`, `_replica_id`, `_assignment`, `_app`, `_holder`, `engram_metrics`,
    `_member_engine` (`engine.MemberEngine`), `_roll` and `_report_broken`."""

    def __init__(self, server):
        self.server = server
        self.is_restarting = False  # its engine is being restarted (health checks pass)
        self.error: str | None = None  # why the member is lost: its health checks fail
        self.reason: str | None = None  # why its engine restarts now (None: it does not)
        self.since: float | None = None
        self.dp_epoch = 0  # restarts in place of its data-parallel gang so far
        self._gang_task: asyncio.Task | None = None

    def note(self, reason: str | None) -> None:
        """Why the engine restarts from now (`None`: it serves again), for the coordinator's
        rebuild (`CoordinatorLink.record`) and `engram_engine_restarting`."""
        self.reason, self.since = reason, time.time()
        metrics = getattr(self.server, "engram_metrics", None)
        if metrics is not None:
            metrics.set_restarting(reason is not None)

    def can_restart(self) -> bool:
        """Whether the member's holder keeps every slice its new engine re-attaches."""
        holder = getattr(self.server, "_holder", None)
        return holder is not None and holder.is_full

    async def on_engine_death(self) -> None:
        """The engine died while serving: restart it in place (with its data-parallel gang),
        or report the member lost (its health checks fail from then on, so Serve restarts
        the gang)."""
        if self.is_restarting or self.server._roll.is_rolling():
            return  # a roll or its DP gang's restart stopped it: that restart goes on
        death = self.server._member_engine.find_death("while serving")
        await self.restart(death.line() if death is not None else "engine died")

    def on_gang_restart(self, epoch: int) -> None:
        """`member_check` said this member's data-parallel gang restarts in place (restart
        `epoch`: another member's engine died): its own engine, alive or not, restarts too."""
        if epoch <= self.dp_epoch or self.is_restarting or self.error is not None \
                or self.server._roll.is_rolling():
            return
        self.is_restarting = True  # from now: its death watch leaves the engine to this restart
        self.server._member_engine.stop_watching()
        self._gang_task = asyncio.get_running_loop().create_task(
            self.restart(f"its data-parallel gang restarts (restart {epoch})", epoch))

    async def restart(self, reason: str, epoch: int | None = None) -> None:
        """Restart the engine in its generation (`epoch`: the restart's number, when the
        coordinator gave it already), or lose the member."""
        server = self.server
        self.is_restarting = True  # health checks pass while this decides and restarts
        try:
            if epoch is None:
                epoch = await self._may_restart(reason)
                if not epoch:  # None (or False from a coordinator of an older release)
                    await self.lose(reason)
                    return
            self.dp_epoch = epoch
            started, a = time.monotonic(), server._assignment
            self.note(reason)  # the group serves on: engram_group_healthy stays 1
            deadline_s = current_rollout(server).in_place_timeout_s
            try:  # a restart that hangs is given up: the member is lost, the gang restarts
                phases = await asyncio.wait_for(server._member_engine.restart(str(epoch)),
                                                deadline_s)
            except asyncio.CancelledError:  # the replica is shutting down
                raise
            except BaseException as exc:  # noqa: BLE001 - the member is lost; Serve takes over
                await self.lose(f"engine of {a['group_id']}-r{a['member_rank']} could not "
                                f"restart in place: {restart_failure(exc, deadline_s)}")
                return
        finally:
            self.is_restarting = False
            self.note(None)
        await self.serving_again(server._roll.version)
        logger.warning("engram-ray: engine %s-r%d restarted in place in %.1f s (generation %s, "
                       "its slices re-attached, not reloaded; %s)", a["group_id"],
                       a["member_rank"], time.monotonic() - started, a["generation"],
                       ", ".join(f"{name} {s:.1f} s" for name, s in phases.items()))

    async def serving_again(self, version: str | None) -> None:
        """The new engine serves (on settings `version`): counted, the coordinator told, its
        death watched again."""
        server = self.server
        server.engram_metrics.count_engine_restart()
        server.engram_metrics.set_group(server._assignment["generation_index"], True)
        await server._coordinator.member_ready.remote(server._replica_id, own_actor(), version)
        server._member_engine.start_watching()

    async def _may_restart(self, reason: str) -> int | None:
        """The restart's number when this member can re-attach its slices and the
        coordinator lets it restart inside its generation (not when the generation broke
        meanwhile); None otherwise."""
        if not self.can_restart():
            return None
        try:
            return await self.server._coordinator.member_restarting.remote(
                self.server._replica_id, reason)
        except Exception as exc:  # noqa: BLE001 - no coordinator: no restart in place
            logger.error("engram-ray: the coordinator could not be told of the restart: %s", exc)
            return None

    async def lose(self, reason: str) -> None:
        """This member is lost: its health checks fail with `reason` from now on (Serve
        restarts the group's gang) and its generation is reported broken."""
        self.error = reason
        logger.error("engram-ray: %s", reason)
        metrics = getattr(self.server, "engram_metrics", None)
        if metrics is not None:  # its generation breaks: the group does not serve
            metrics.set_group(self.server._assignment["generation_index"], False)
        await self.server._report_broken(reason)


def restart_failure(exc: BaseException, timeout_s: float) -> str:
    """One line: the error's own lines, without pydantic's "For further information" links."""
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return f"not serving after serving.rollout.in_place_timeout_s ({timeout_s:g} s)"
    lines = [line.strip() for line in str(exc).splitlines()
             if line.strip() and not line.strip().startswith("For further information")]
    return f"{type(exc).__name__}: {' '.join(lines)}"[:400]

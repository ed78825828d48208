"""A member's link to its coordinator, kept across the coordinator's restarts.

The coordinator (`actors/coordinator.py`) restarts when its process dies, holding nothing
(`actors/lifetime.py`). Every member asks for its incarnation every `MEMBER_CHECK_S`; when it
changed, the member tells the new one what it holds: its assignment, whether its engine serves
or restarts or is lost, its metric targets and slot (`rejoin`). What the member registers
(`_register_target`) is kept here for that.
"""

from __future__ import annotations

import asyncio
import logging

from engram_ray.actors.lifetime import MEMBER_CHECK_S
from engram_ray.errors import EngramRayError

logger = logging.getLogger("ray.serve")


class CoordinatorLinkMixin:
    """Mixed into `engram_ray.serve.replica.EngramServerMixin` (it sets `_coordinator`,
    `_assignment`, `_replica_id`, `_replica_labels`, `_metrics_slot`, `_node_id`)."""

    _ready_at: float | None = None      # wall time its engine first served
    _in_flight = 0                      # requests this member runs now
    _retired = False                    # its gang was replaced by a rolling change
    _running_told = False               # the coordinator knows Serve runs this member
    _start_returned = False             # its start returned: Serve runs it
    _lost_reason: str | None = None     # why the member is lost (reported broken)
    _link_task: asyncio.Task | None = None

    def _start_link(self) -> None:
        self._incarnation = self._assignment.get("incarnation")
        self._targets: dict[str, dict] = {}
        self._link_task = asyncio.get_running_loop().create_task(self._keep_link())

    def _stop_link(self) -> None:
        if self._link_task is not None:
            self._link_task.cancel()
            self._link_task = None

    async def _register_target(self, key: str, target: str, labels: dict) -> None:
        self._targets[key] = {"target": target, "labels": labels}
        await self._coordinator.register_target.remote(key, target, labels)

    async def _take_over_when_drained(self, timeout_s: float) -> None:
        """A member of a gang started beside a serving one (a rolling change) ends its start
        only once its gang took over and the old gang finished its requests: Serve stops the
        old gang the moment this start returns."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not (may := await self._coordinator.may_take_over.remote(self._replica_id)):
            if may is None:
                raise EngramRayError("this member's gang failed while it started beside the "
                                     "serving one: Serve starts a new gang")
            if asyncio.get_running_loop().time() > deadline:
                logger.warning("engram-ray: no takeover within %.0f s: starting anyway", timeout_s)
                return
            await asyncio.sleep(0.5)

    def _tell_running(self) -> None:
        """At the first health check that passes, Serve runs this member: the coordinator is
        told in the background (a health check never waits on it)."""
        if not self._running_told:
            self._running_told = True
            self._running_task = asyncio.get_running_loop().create_task(self._send_running())

    async def _send_running(self) -> None:
        for _ in range(10):
            try:
                await self._coordinator.member_running.remote(self._replica_id)
                return
            except Exception as exc:  # noqa: BLE001 - asked again
                logger.warning("engram-ray: could not tell the coordinator this member runs: "
                               "%s", exc)
                await asyncio.sleep(MEMBER_CHECK_S)

    async def _counted(self, call, request, raw_request_info):
        """`call(request, raw_request_info)`'s stream, tagged with this member's generation
        and counted in `_in_flight` from the call until the stream ends (a retired member
        drains them)."""
        from engram_ray.serve.fingerprint import tag_generation

        self._in_flight += 1
        try:
            stream = await call(request, raw_request_info)
        except BaseException:
            self._in_flight -= 1
            raise
        return self._until_done(tag_generation(stream, self._assignment["generation"],
                                               self._config_version))

    async def _until_done(self, stream):
        try:
            async for item in stream:
                yield item
        finally:
            self._in_flight -= 1

    def _member_record(self) -> dict:
        """What this member holds, as `Coordinator.rejoin` takes it."""
        restarting = None  # MemberRestartMixin notes a restart in place
        if self._restart_reason is not None:
            restarting = {"reason": self._restart_reason, "since": self._restart_since,
                          "epoch": self._dp_epoch}
        return {"replica_id": self._replica_id, "assignment": self._assignment,
                "node_labels": self._replica_labels, "ready_at": self._ready_at,
                "restarting": restarting, "broken": self._lost_reason,
                "config_version": self._config_version, "dp_epoch": self._dp_epoch,
                "role": "retired" if self._retired else "serving" if self._start_returned
                else "starting",
                "targets": dict(self._targets), "slot": getattr(self, "_metrics_slot", None),
                "node_id": self._node_id}

    async def _keep_link(self) -> None:
        from engram_ray.serve.member_restart import own_actor

        complained = False
        while True:
            await asyncio.sleep(MEMBER_CHECK_S)
            try:
                knew, in_flight = self._retired, self._in_flight
                answer = await self._coordinator.member_check.remote(
                    self._replica_id, in_flight, knew, self._config_version)
                incarnation = answer["incarnation"]
                if answer.get("restart_for"):
                    self._on_roll_turn(answer["restart_for"], answer.get("restart_epoch"))
                elif answer.get("restart_epoch"):  # another engine of its DP gang died
                    self._on_gang_restart(answer["restart_epoch"])
                if answer["retired"] and not self._retired:
                    logger.warning("engram-ray: this member's gang was replaced by a rolling "
                                   "change: it takes no new requests and finishes %d",
                                   self._in_flight)
                self._retired = answer["retired"]
                if incarnation != self._incarnation:
                    taken = await self._coordinator.rejoin.remote(self._member_record(),
                                                                  own_actor())
                    logger.warning("engram-ray: the coordinator restarted (%s -> %s); this "
                                   "member %s", self._incarnation, incarnation,
                                   "rejoined" if taken else "was refused: a newer generation "
                                   "of its group exists")
                    self._incarnation = incarnation
                complained = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - asked again next time
                if not complained:
                    logger.warning("engram-ray: coordinator unreachable: %s", exc)
                    complained = True

"""A member's link to its coordinator, kept across the coordinator's restarts.

The coordinator (`actors/coordinator.py`) restarts when its process dies, holding nothing
(`actors/lifetime.py`). Every member asks for its incarnation every `MEMBER_CHECK_S`; when it
changed, the member tells the new one what it holds: its assignment, whether its engine serves
or restarts or is lost, its metric targets and slot (`rejoin`). What the member registers
(`register_target`) is kept here for that.
"""

from __future__ import annotations

import asyncio
import logging

from engram_ray.actors.lifetime import MEMBER_CHECK_S
from engram_ray.errors import EngramRayError
from engram_ray.serve.member.processes import own_actor

logger = logging.getLogger("ray.serve")


def current_rollout(server):
    """`serving.rollout` as the coordinator holds it now (a `serve deploy` of it changes the
    front door only: running members learn it at their next check), else the member's own."""
    link = getattr(server, "_link", None)
    return (link.rollout if link is not None else None) or server._app.serving.rollout


class CoordinatorLink:
    """`server`'s link to its coordinator (`server._coordinator`, `_replica_id`,
    `_assignment`); a `member_check` answer goes to its parts (`_roll`, `_restarts`,
    `_requests`)."""

    def __init__(self, server):
        self.server = server
        self.ready_at: float | None = None   # wall time its engine first served
        self.start_returned = False          # its start returned: Serve runs it
        self.lost_reason: str | None = None  # why the member is lost (reported broken)
        self._incarnation = None
        self._targets: dict[str, dict] = {}
        self._running_told = False           # the coordinator knows Serve runs this member
        self.rollout = None                  # `serving.rollout` as the coordinator has it now
        self._rollout_seen: dict | None = None
        self._task: asyncio.Task | None = None
        self._running_task: asyncio.Task | None = None

    def start(self) -> None:
        """Kept from the member's join (its assignment) until it leaves."""
        self._incarnation = self.server._assignment.get("incarnation")
        self._task = asyncio.get_running_loop().create_task(self._keep())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def register_target(self, key: str, target: str, labels: dict) -> None:
        self._targets[key] = {"target": target, "labels": labels}
        await self.server._coordinator.register_target.remote(key, target, labels)

    async def take_over_when_drained(self, timeout_s: float) -> None:
        """A member of a gang started beside a serving one (a rolling change) ends its start
        only once its gang took over and the old gang finished its requests: Serve stops the
        old gang the moment this start returns."""
        coordinator, replica_id = self.server._coordinator, self.server._replica_id
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not (may := await coordinator.may_take_over.remote(replica_id)):
            if may is None:
                raise EngramRayError("this member's gang failed while it started beside the "
                                     "serving one: Serve starts a new gang")
            if asyncio.get_running_loop().time() > deadline:
                logger.warning("engram-ray: no takeover within %.0f s: starting anyway", timeout_s)
                return
            await asyncio.sleep(0.5)

    def tell_running(self) -> None:
        """At the first health check that passes, Serve runs this member: the coordinator is
        told in the background (a health check never waits on it)."""
        if not self._running_told:
            self._running_told = True
            self._running_task = asyncio.get_running_loop().create_task(self._send_running())

    async def _send_running(self) -> None:
        for _ in range(10):
            try:
                await self.server._coordinator.member_running.remote(self.server._replica_id)
                return
            except Exception as exc:  # noqa: BLE001 - asked again
                logger.warning("engram-ray: could not tell the coordinator this member runs: "
                               "%s", exc)
                await asyncio.sleep(MEMBER_CHECK_S)

    def record(self) -> dict:
        """What this member holds, as `Coordinator.rejoin` takes it."""
        server = self.server
        restarts, requests = server._restarts, server._requests
        restarting = None  # its engine restarts in place now
        if restarts.reason is not None:
            restarting = {"reason": restarts.reason, "since": restarts.since,
                          "epoch": restarts.dp_epoch}
        return {"replica_id": server._replica_id, "assignment": server._assignment,
                "node_labels": server._replica_labels, "ready_at": self.ready_at,
                "restarting": restarting, "broken": self.lost_reason,
                "config_version": server._roll.version, "dp_epoch": restarts.dp_epoch,
                "role": "retired" if requests.retired else "serving" if self.start_returned
                else "starting",
                "targets": dict(self._targets), "slot": getattr(server, "_metrics_slot", None),
                "node_id": server._node_id}

    def _take_answer(self, answer: dict) -> None:
        """A `member_check` answer: a roll's turn, its DP gang's restart, retirement, the
        rollout settings."""
        requests = self.server._requests
        if answer.get("rollout") is not None and answer["rollout"] != self._rollout_seen:
            from engram_ray.serve.settings.config import RolloutConfig

            self.rollout = RolloutConfig.from_dict(answer["rollout"], "the coordinator's rollout")
            self._rollout_seen = answer["rollout"]
        if answer.get("restart_for"):
            self.server._roll.on_turn(answer["restart_for"], answer.get("restart_epoch"))
        elif answer.get("restart_epoch"):  # another engine of its DP gang died
            self.server._restarts.on_gang_restart(answer["restart_epoch"])
        if answer["retired"] and not requests.retired:
            logger.warning("engram-ray: this member's gang was replaced by a rolling "
                           "change: it takes no new requests and finishes %d",
                           requests.in_flight)
        requests.retired = answer["retired"]

    async def _keep(self) -> None:
        server, complained = self.server, False
        while True:
            await asyncio.sleep(MEMBER_CHECK_S)
            try:
                requests = server._requests
                # Not retried by Ray: a check sent while the coordinator restarts fails now
                # and the next one, a second later, finds it (Ray's retries back off).
                answer = await server._coordinator.member_check.options(
                    max_task_retries=0).remote(server._replica_id, requests.in_flight,
                                               requests.retired, server._roll.version)
                self._take_answer(answer)
                incarnation = answer["incarnation"]
                if incarnation != self._incarnation:
                    taken = await server._coordinator.rejoin.remote(self.record(), own_actor())
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

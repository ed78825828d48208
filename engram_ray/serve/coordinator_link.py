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

logger = logging.getLogger("ray.serve")


class CoordinatorLinkMixin:
    """Mixed into `engram_ray.serve.replica.EngramServerMixin` (it sets `_coordinator`,
    `_assignment`, `_replica_id`, `_replica_labels`, `_metrics_slot`, `_node_id`)."""

    _ready_at: float | None = None      # wall time its engine first served
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

    def _member_record(self) -> dict:
        """What this member holds, as `Coordinator.rejoin` takes it."""
        restarting = None  # MemberRestartMixin notes a restart in place
        if self._restart_reason is not None:
            restarting = {"reason": self._restart_reason, "since": self._restart_since}
        return {"replica_id": self._replica_id, "assignment": self._assignment,
                "node_labels": self._replica_labels, "ready_at": self._ready_at,
                "restarting": restarting, "broken": self._lost_reason,
                "targets": dict(self._targets), "slot": getattr(self, "_metrics_slot", None),
                "node_id": self._node_id}

    async def _keep_link(self) -> None:
        from engram_ray.serve.member_restart import own_actor

        complained = False
        while True:
            await asyncio.sleep(MEMBER_CHECK_S)
            try:
                incarnation = await self._coordinator.member_check.remote()
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

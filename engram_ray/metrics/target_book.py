"""`TargetBook`: every engine's /metrics endpoints and fixed-port slots, as the coordinator
(`actors/coordinator.py`) keeps them for Prometheus: written as a file_sd list on every change
(`serving.prometheus_targets_file`) and answered as http_sd target groups (`groups`).

Not thread-safe: its owner holds its own lock around every call.
"""

from __future__ import annotations

import logging

from engram_ray.metrics.exposition import target_groups, write_file_sd

logger = logging.getLogger(__name__)
COORDINATOR_KEY = "coordinator"  # the coordinator's own endpoint: kept until `clear`


class TargetBook:
    def __init__(self, targets_file: str):
        self.targets_file = targets_file
        self.targets: dict[str, dict] = {}          # key ("<replica id>[/model]") -> target
        self.slots: dict[str, dict[int, str]] = {}  # node id -> {slot: replica id}

    def register(self, key: str, target: str, labels: dict | None = None) -> None:
        self.targets[key] = {"target": target, "labels": labels or {}}
        self._write()

    def groups(self) -> list[dict]:
        """Prometheus target groups (file_sd and http_sd)."""
        return target_groups(self.targets)

    def slot(self, replica_id: str, node_id: str) -> int:
        """The replica's slot on its node: the lowest free one, the same on a second ask."""
        taken = self.slots.setdefault(node_id, {})
        for slot, holder in taken.items():
            if holder == replica_id:
                return slot
        slot = next(s for s in range(len(taken) + 1) if s not in taken)
        taken[slot] = replica_id
        return slot

    def restore(self, replica_id: str, node_id: str | None, slot: int | None,
                targets: dict[str, dict]) -> None:
        """What a member held before the coordinator restarted (its slot and targets)."""
        if slot is not None and node_id is not None:
            self.slots.setdefault(node_id, {})[slot] = replica_id
        self.targets.update(targets)
        self._write()

    def forget(self, replica_id: str) -> None:
        """A replica that stopped: its targets and its slot."""
        self.keep_only(lambda r: r != replica_id)

    def keep_only(self, is_kept) -> None:
        """Drop the targets and slots of replicas for which `is_kept(replica_id)` is false."""
        for taken in self.slots.values():
            for slot in [s for s, holder in taken.items() if not is_kept(holder)]:
                del taken[slot]
        stale = [k for k in self.targets
                 if k != COORDINATOR_KEY and not is_kept(k.split("/")[0])]
        for key in stale:
            del self.targets[key]
        if stale:
            self._write()

    def clear(self) -> None:
        self.targets.clear()
        self.slots.clear()
        self._write()

    def _write(self) -> None:
        try:
            write_file_sd(self.targets_file, self.targets)
        except OSError as exc:  # Prometheus misses a change; groups must still move on
            logger.error("engram-ray: could not write the Prometheus targets list %s: %s",
                         self.targets_file, exc)

"""One engine's membership in its peer group: its tables, its state, its health. No Ray here.

The engine actor (`engram_ray.actors.engine`) holds one `GroupMember` and forwards to it. States:

    idle ──build──► building ──► serving ──drop──► idle          (a new generation follows)
                        └──error──► failed                        (the coordinator decides)
    any ──stop──► stopped                                         (coordinator lost: terminal)

Lookups are served only in `serving`; in every other state they raise `NotServingError`, so a
member never answers from half a table. Build runs outside the lock (the rendezvous blocks until
every peer arrives); a drop or stop that lands meanwhile supersedes it, and the tables it
opens are closed at once.
"""

from __future__ import annotations

import threading
import time

from engram_ray.assignment import EngineAssignment
from engram_ray.config import DeploymentConfig
from engram_ray.errors import EngramRayError
from engram_ray.layout import EngramLayout

IDLE, BUILDING, SERVING, FAILED, STOPPED = "idle", "building", "serving", "failed", "stopped"


class NotServingError(EngramRayError):
    """A lookup reached an engine whose group is not ready (restarting, failed or stopped)."""


class GroupMember:
    def __init__(self, layout: EngramLayout, config: DeploymentConfig):
        self.layout, self.config = layout, config
        self._lock = threading.Lock()
        self._state, self._reason = IDLE, "waiting for an assignment"
        self._assignment: EngineAssignment | None = None
        self._wanted_generation: str | None = None
        self._tables = None
        self._ready_at: float | None = None

    # --- life cycle -----------------------------------------------------------------------

    def build(self, assignment: EngineAssignment) -> dict:
        """Open this rank's tables for `assignment` (blocks for the rendezvous); the report."""
        from engram_ray.table import open_group_tables

        with self._lock:
            if self._state == STOPPED:
                raise NotServingError(f"engine stopped ({self._reason}); it takes no assignment")
            self._close_locked()
            self._state, self._reason = BUILDING, f"building generation {assignment.generation}"
            self._assignment, self._wanted_generation = assignment, assignment.generation
        try:
            tables = open_group_tables(
                self.layout, assignment.peer_group_spec(self.config.rendezvous_timeout_s,
                                                        self.config.handle_type),
                backend=self.config.table_backend, device=self.config.table_device,
                fill=self.config.fill, seed=self.config.seed, checkpoint=self.config.checkpoint)
            check_slices(tables, assignment)
        except BaseException as exc:
            with self._lock:
                if self._wanted_generation == assignment.generation:
                    self._state, self._reason = FAILED, f"{type(exc).__name__}: {exc}"
            raise
        with self._lock:
            if self._wanted_generation != assignment.generation:  # dropped or stopped meanwhile
                tables.close()
                raise NotServingError(f"generation {assignment.generation} was superseded "
                                      f"while it was being built ({self._reason})")
            self._tables, self._ready_at = tables, time.time()
            self._state, self._reason = SERVING, f"serving generation {assignment.generation}"
            return self._report_locked()

    def drop(self, reason: str) -> None:
        """Release this generation's tables and mappings; wait for the next assignment."""
        with self._lock:
            if self._state != STOPPED:
                self._close_locked()
                self._state, self._reason = IDLE, reason

    def stop(self, reason: str) -> None:
        """Stop serving for good (the coordinator is gone): tables closed, lookups refused."""
        with self._lock:
            self._close_locked()
            self._state, self._reason = STOPPED, reason

    def _close_locked(self) -> None:
        self._wanted_generation = None
        if self._tables is not None:
            tables, self._tables = self._tables, None
            tables.close()

    # --- serving --------------------------------------------------------------------------

    def lookup(self, layer_id: int, row_ids):
        """`[T, C]` int64 row ids -> `[T, C, row_bytes]` uint8 packed rows."""
        with self._lock:
            if self._state != SERVING:
                raise NotServingError(
                    f"engine rank {self.rank} of group {self.group_id} is {self._state} "
                    f"({self._reason}): lookups are refused until its group is ready again")
            return self._tables.lookup(layer_id, row_ids, out="packed")

    @property
    def tables(self):
        """The open tables (for the vLLM engine hook), or None when not serving."""
        return self._tables

    @property
    def state(self) -> str:
        return self._state

    @property
    def is_healthy(self) -> bool:
        return self._state == SERVING

    @property
    def rank(self) -> int | None:
        return self._assignment.rank if self._assignment else None

    @property
    def group_id(self) -> str | None:
        return self._assignment.group_id if self._assignment else None

    def health(self) -> dict:
        with self._lock:
            return {"is_healthy": self._state == SERVING, "state": self._state,
                    "reason": self._reason, "rank": self.rank, "group_id": self.group_id,
                    "generation": self._assignment.generation if self._assignment else None}

    def _report_locked(self) -> dict:
        stats = self._tables.stats()
        return {"rank": self._assignment.rank, "generation": self._assignment.generation,
                "owned_bytes": self._assignment.num_owned_bytes,
                "local_bytes": sum(t["local_bytes"] for t in stats["tables"]),
                "rendezvous_seconds": stats["rendezvous_seconds"], "ready_at": self._ready_at}


def check_slices(tables, assignment: EngineAssignment) -> None:
    """The tables opened hold exactly the slices the coordinator assigned."""
    for expected in assignment.slices:
        table = tables.tables[expected.layer_id]
        got = (table.slice_start, table.slice_end)
        if got != (expected.start, expected.end):
            tables.close()
            raise EngramRayError(
                f"rank {assignment.rank}: table of layer {expected.layer_id} holds rows {got}, "
                f"the coordinator assigned {(expected.start, expected.end)}: the coordinator and "
                "the engine disagree on the slice plan (different engram-ray versions?)")

"""The coordinator's waits, none of which holds a thread (`actors/coordinator.py` is an asyncio
actor: one event loop serves every call, waiting ones included).

`RoutingFeed`: the routing table's version and the ingress replicas' long polls on it. Every
change bumps the version and wakes every poll at once; a poll parks a coroutine, not a thread,
so 64 ingress replicas polling cost the members' calls nothing while they wait.

`RebuildWait`: a coordinator restarted without saved state (its predecessor ran an older
release, `actors/lifetime.py`) rebuilds from its members' rejoins; calls that read or change
groups wait for that, up to its deadline, as coroutines.
"""

from __future__ import annotations

import asyncio
import time


class RoutingFeed:
    def __init__(self):
        # Versions go on from the wall clock (ms), so an ingress that polled the coordinator
        # before a restart never takes a new table for one it has seen.
        self.version = time.time_ns() // 1_000_000
        self._changed = asyncio.Event()

    def changed(self) -> None:
        """The routing table changed: every waiting poll answers."""
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, seen: int, timeout_s: float) -> None:
        """Return once the version differs from `seen`, or after `timeout_s`."""
        if self.version != seen or timeout_s <= 0:
            return
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass


class RebuildWait:
    """Until `end()` (every serving gang rejoined) or `deadline_s` after construction."""

    def __init__(self, deadline_s: float | None):
        self.until = time.monotonic() + deadline_s if deadline_s else 0.0
        self._done = asyncio.Event()
        if not self.until:
            self._done.set()

    @property
    def is_waiting(self) -> bool:
        return not self._done.is_set()

    def end(self) -> bool:
        """True when this ended the wait (False: it had ended)."""
        if self._done.is_set():
            return False
        self._done.set()
        return True

    async def wait(self) -> bool:
        """Wait for the rebuild; True when its deadline passed first (the caller ends it)."""
        if self._done.is_set():
            return False
        try:
            await asyncio.wait_for(self._done.wait(), max(0.0, self.until - time.monotonic()))
            return False
        except asyncio.TimeoutError:
            return self.is_waiting

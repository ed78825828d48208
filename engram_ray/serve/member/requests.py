"""The requests a member runs: counted while they stream, refused once its gang was replaced
or its engine is about to restart (the ingress sends them elsewhere: nothing was sent yet),
and drained before a restart with new settings."""

from __future__ import annotations

import asyncio
import time
import weakref

from engram_ray.errors import EngramRayError

DRAIN_POLL_S = 0.1


class MemberRetiredError(EngramRayError):
    """This member's gang was replaced by a rolling change, or its engine is about to restart
    with new settings (a group failure for the ingress: the request goes elsewhere)."""


class MemberRequests:
    def __init__(self):
        self.in_flight = 0       # requests this member runs now
        self.retired = False     # its gang was replaced by a rolling change
        self.draining = False    # refuses new requests: its engine is about to restart

    def refuse_if_retired(self, assignment: dict) -> None:
        """A member whose gang a rolling change replaced, or whose engine is about to restart
        with new settings, takes no new request."""
        if self.draining:
            raise MemberRetiredError(f"{assignment['group_id']} member "
                                     f"{assignment['member_rank']} restarts its engine "
                                     "with new settings")
        if self.retired:
            raise MemberRetiredError(f"{assignment['group_id']} generation "
                                     f"{assignment['generation']} was replaced")

    async def counted(self, call, request, raw_request_info, generation: str,
                      version: str | None):
        """`call(request, raw_request_info)`'s stream, tagged with the generation and
        settings that answer it and counted in `in_flight` from the call until the stream
        ends (a retired member drains them)."""
        from engram_ray.serve.edge.fingerprint import tag_generation

        self.in_flight += 1
        try:
            stream = await call(request, raw_request_info)
        except BaseException:
            self.in_flight -= 1
            raise
        return self._until_done(tag_generation(stream, generation, version))

    def _until_done(self, stream):
        """The stream as an async generator (what Serve streams), counted until it ends,
        fails or is cancelled, or is dropped unstarted: an async generator closed before its
        first item runs no `finally` (the count stayed at 1 and every later drain waited its
        full `drain_timeout_s`), so its collection ends the count too."""
        ended = []

        def end():
            if not ended:
                ended.append(True)
                self.in_flight -= 1

        async def counted():
            try:
                async for item in stream:
                    yield item
            finally:
                end()
        gen = counted()
        weakref.finalize(gen, end)
        return gen

    async def drain(self, timeout_s: float) -> tuple[int, bool]:
        """Refuse new requests, then wait until the running ones end: (how many ran when
        the drain began, whether they all ended within `timeout_s`)."""
        self.draining = True
        running, deadline = self.in_flight, time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return running, not self.in_flight


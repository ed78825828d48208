"""The member's parts apart from Serve (`engram_ray.serve.member`): what a `member_check` answer
sets going (`CoordinatorLink`), the record a restarted coordinator rebuilds from, and the
requests a member counts, refuses and drains (`MemberRequests`). The parts together run end to
end in tests/cpu/local (kills, rolls, DP gangs)."""

import asyncio

import pytest

from engram_ray.serve.member.link import CoordinatorLink
from engram_ray.serve.member.requests import MemberRequests, MemberRetiredError
from engram_ray.serve.member.restart import InPlaceRestart
from engram_ray.serve.member.roll import SettingsRoll

ASSIGNMENT = {"group_id": "group-0", "member_rank": 1, "generation": "local-group-0.1",
              "generation_index": 1, "incarnation": "abcd"}


class _Server:
    """The attributes of `EngramServerMixin` the parts read; the roll's and the restart's
    entry points record what they were asked."""

    def __init__(self):
        self._replica_id, self._assignment, self._replica_labels = "r1", ASSIGNMENT, {}
        self._node_id, self._metrics_slot, self._holder = "node-a", 0, None
        self._requests = MemberRequests()
        self._restarts, self._roll = InPlaceRestart(self), SettingsRoll(self)
        self._link = CoordinatorLink(self)
        self.turns, self.gang_restarts = [], []
        self._roll.on_turn = lambda version, epoch: self.turns.append((version, epoch))
        self._restarts.on_gang_restart = self.gang_restarts.append


def _answer(**fields):
    return {"incarnation": "abcd", "retired": False, "restart_for": None,
            "restart_epoch": None, **fields}


def test_a_roll_turn_goes_to_the_roll_and_a_gang_restart_to_the_restart():
    server = _Server()
    server._link._take_answer(_answer(restart_for="v2", restart_epoch=3))
    assert server.turns == [("v2", 3)] and server.gang_restarts == []
    server._link._take_answer(_answer(restart_epoch=4))  # another engine of its gang died
    assert server.turns == [("v2", 3)] and server.gang_restarts == [4]
    server._link._take_answer(_answer())
    assert server.gang_restarts == [4] and not server._requests.retired


def test_the_rejoin_record_says_what_the_member_is_and_holds():
    server = _Server()
    link = server._link
    assert link.record()["role"] == "starting" and link.record()["restarting"] is None
    link.start_returned, link.ready_at = True, 12.0
    server._roll.version, server._restarts.dp_epoch = "v1", 2
    server._restarts.note("engine died")
    record = link.record()
    assert record["role"] == "serving" and record["ready_at"] == 12.0
    assert (record["config_version"], record["dp_epoch"]) == ("v1", 2)
    assert record["restarting"]["reason"] == "engine died" and record["restarting"]["epoch"] == 2
    link._take_answer(_answer(retired=True))  # its gang was replaced by a rolling change
    assert server._requests.retired and link.record()["role"] == "retired"


def test_requests_are_counted_until_their_stream_ends_and_refused_once_retired():
    requests = MemberRequests()

    async def call(request, raw_request_info):
        async def stream():
            for chunk in ("a", "b"):
                yield chunk
        return stream()

    async def run():
        stream = await requests.counted(call, {}, None, "local-group-0.1", "v1")
        assert requests.in_flight == 1
        chunks = [chunk async for chunk in stream]
        assert requests.in_flight == 0
        return chunks
    assert asyncio.run(run())  # tagged chunks (engram_ray.serve.edge.fingerprint)
    requests.refuse_if_retired(ASSIGNMENT)  # serving: taken
    requests.retired = True
    with pytest.raises(MemberRetiredError, match="generation local-group-0.1 was replaced"):
        requests.refuse_if_retired(ASSIGNMENT)


def test_a_drain_refuses_new_requests_and_waits_for_the_running_ones():
    requests = MemberRequests()
    requests.in_flight = 2

    async def run():
        async def finish():
            await asyncio.sleep(0.3)
            requests.in_flight = 0
        finishing = asyncio.get_running_loop().create_task(finish())
        with_two = await requests.drain(5.0)
        await finishing
        requests.in_flight = 1
        return with_two, await requests.drain(0.2)  # one that never ends: timed out
    assert asyncio.run(run()) == ((2, True), (1, False))
    with pytest.raises(MemberRetiredError, match="restarts its engine with new settings"):
        requests.refuse_if_retired(ASSIGNMENT)


def test_a_stream_closed_or_dropped_before_its_first_item_is_no_longer_counted():
    """A client gone before the first token: Serve closes (or drops) the stream unread; the
    member's count falls back to 0 once it is gone, so the next drain does not wait for it.
    The stream stays an async generator (Serve streams nothing else)."""
    import gc
    import inspect

    requests = MemberRequests()

    async def call(request, raw_request_info):
        async def stream():
            yield "a"
        return stream()

    async def run():
        stream = await requests.counted(call, {}, None, "local-group-0.1", "v1")
        assert inspect.isasyncgen(stream) and requests.in_flight == 1
        await stream.aclose()
        await stream.aclose()
        del stream
        gc.collect()
        assert requests.in_flight == 0
        dropped = await requests.counted(call, {}, None, "local-group-0.1", "v1")
        assert requests.in_flight == 1
        del dropped
        gc.collect()
        assert requests.in_flight == 0
        read = await requests.counted(call, {}, None, "local-group-0.1", "v1")
        assert [chunk async for chunk in read] and requests.in_flight == 0
        del read
        gc.collect()
        assert requests.in_flight == 0  # counted down once
        assert await requests.drain(5.0) == (0, True)
    asyncio.run(run())


def test_a_changed_rollout_reaches_a_running_member_at_its_next_check():
    """`serve deploy` of `serving.rollout` alone changes the front door and the coordinator,
    not the members' args: a running member takes it from its next `member_check` answer
    for its restarts' deadlines, its DP gang's waits and its takeover."""
    from engram_ray.serve.member.link import current_rollout

    server = _Server()
    server._link._take_answer(_answer(rollout={"in_place_timeout_s": 42.0,
                                                "drain_timeout_s": 3.0}))
    rollout = current_rollout(server)
    assert (rollout.in_place_timeout_s, rollout.drain_timeout_s) == (42.0, 3.0)
    with pytest.raises(Exception, match="in_place_timeout_s"):
        server._link._take_answer(_answer(rollout={"in_place_timeout_s": -1}))


def test_a_stopping_member_tells_the_coordinator_within_its_bound(monkeypatch):
    """A replica that stops or failed to start tells the coordinator it leaves, for at most
    `LEAVE_TIMEOUT_S` (its watch finds the replica gone anyway): a coordinator that does not
    answer no longer holds the stop past Serve's graceful shutdown."""
    import time

    from engram_ray.serve.member import server as member_server

    class _Never:
        def remote(self, *args):
            return asyncio.sleep(3600)

    server = _Server()
    server._coordinator = type("C", (), {"leave": _Never()})()
    monkeypatch.setattr(member_server, "LEAVE_TIMEOUT_S", 0.5)
    started = time.monotonic()
    asyncio.run(member_server.EngramServerMixin._leave(server))
    assert time.monotonic() - started < 5.0

"""The restart-in-place decision of a replica whose engine died (`InPlaceRestart`): a member
that may not restart (no slices held, the coordinator refuses because the generation broke
meanwhile, or the coordinator cannot be reached) is lost: it reports its generation broken and
its health checks fail from then on, so Serve restarts the gang. A health check that fails
while the engine lives breaks the generation only after as many failures in a row as make
Serve restart the replica. The restart itself runs end to end in tests/cpu/local (an
EngineCore or worker killed under load)."""

import asyncio

import pytest

from engram_ray.serve.member.restart import InPlaceRestart


class _Call:
    """`actor.method.remote(...)` as the coordinator's handle offers it: an awaitable."""

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def remote(self, *args):
        self.calls.append(args)

        async def result():
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer
        return result()


class _Coordinator:
    def __init__(self, restarting):
        self.member_restarting = _Call(restarting)


class _Engine:
    """`MemberEngine` as the restart uses it: a restart that fails (or hangs)."""

    def __init__(self, hangs):
        self.hangs, self.restarted, self.watch_stopped = hangs, False, False

    def find_death(self, phase):
        return None  # no recorded cause: "engine died"

    def stop_watching(self):
        self.watch_stopped = True

    async def restart(self, dp_round=""):
        self.restarted, self.dp_round = True, dp_round
        if self.hangs:
            await asyncio.sleep(3600)
        raise RuntimeError("not in this test")


class _Roll:
    version = None

    def is_rolling(self):
        return False


class _Metrics:
    """`EngineMetrics` as the restart reports to it: (series, value) in order."""

    def __init__(self):
        self.reports = []

    def set_group(self, generation, is_healthy):
        self.reports.append(("engram_group_healthy", int(is_healthy)))

    def set_restarting(self, is_restarting):
        self.reports.append(("engram_engine_restarting", int(is_restarting)))


class _Server:
    """The server parts `InPlaceRestart` reaches; its holder full or not."""

    def __init__(self, restarting, holds_slices=True, deadline_s=600.0, hangs=False):
        from engram_ray.serve.settings.config import ServeAppConfig

        self._coordinator, self._replica_id = _Coordinator(restarting), "replica-0"
        self._holder = type("Holder", (), {"is_full": holds_slices})()
        self._member_engine, self._roll, self.reported = _Engine(hangs), _Roll(), []
        self._app = ServeAppConfig.from_dict({"serving": {"rollout": {
            "in_place_timeout_s": deadline_s}}})
        self._assignment = {"generation_index": 1, "group_id": "group-0", "member_rank": 1,
                            "generation": "local-group-0.1"}
        self.engram_metrics = _Metrics()
        self._restarts = InPlaceRestart(self)

    async def _report_broken(self, reason):
        self.reported.append(reason)


def _member(restarting, holds_slices=True, deadline_s=600.0, hangs=False) -> InPlaceRestart:
    return _Server(restarting, holds_slices, deadline_s, hangs)._restarts


@pytest.mark.parametrize("restarting, holds_slices", [
    (False, True),                        # the generation broke meanwhile
    (ConnectionError("gone"), True),      # no coordinator
    (None, True),                         # the same, from this release's coordinator
    (1, False),                           # nothing held (FABRIC-only slices)
], ids=["refused", "coordinator unreachable", "refused (None)", "no slices held"])
def test_a_member_that_may_not_restart_is_lost_and_fails_its_health_checks(restarting,
                                                                           holds_slices):
    member = _member(restarting, holds_slices)
    server = member.server
    asyncio.run(member.on_engine_death())
    assert not server._member_engine.restarted
    assert server.reported == ["engine died"]
    assert member.error == "engine died"  # check_health raises it from now on
    assert not member.is_restarting
    if not holds_slices:
        assert server._coordinator.member_restarting.calls == []


def test_a_restart_that_fails_loses_the_member_naming_why():
    member = _member(True)
    asyncio.run(member.on_engine_death())
    assert member.server._member_engine.restarted and not member.is_restarting
    assert member.error == ("engine of group-0-r1 could not restart in place: "
                            "RuntimeError: not in this test")
    assert member.server.reported == [member.error]
    # The group serves on while the engine restarts; only the lost member breaks it.
    assert member.server.engram_metrics.reports == [
        ("engram_engine_restarting", 1), ("engram_group_healthy", 0),
        ("engram_engine_restarting", 0)]


def test_a_restart_that_does_not_serve_within_the_deadline_loses_the_member():
    """serving.rollout.in_place_timeout_s: a restart in place that hangs is given up; the
    member is lost (its health checks fail: Serve restarts its gang)."""
    member = _member(True, deadline_s=0.2, hangs=True)
    asyncio.run(asyncio.wait_for(member.on_engine_death(), 5.0))
    assert member.server._member_engine.restarted and not member.is_restarting
    assert member.error == (
        "engine of group-0-r1 could not restart in place: not serving after "
        "serving.rollout.in_place_timeout_s (0.2 s)")
    assert member.server.reported == [member.error]


class _Checks:
    """Ray Serve LLM's own health check: fails where `failures` says so, in turn."""

    def __init__(self, failures):
        self.failures = list(failures)

    async def check_health(self):
        if self.failures.pop(0):
            raise TimeoutError("the engine answered late")


def _replica(failures):
    from engram_ray.serve.member.server import EngramServerMixin

    class Replica(EngramServerMixin, _Checks):
        def __init__(self):
            _Checks.__init__(self, failures)
            self._make_parts()  # no engine watch yet: no death found, the failures transient
            self._assignment, self.reported = {"group_id": "group-0"}, []

        async def _report_broken(self, reason):
            self.reported.append(reason)

        def __del__(self):  # the mixin's async __del__ is Serve's to await
            pass

    return Replica()


def _run_checks(replica, count: int) -> list[bool]:
    async def checks():
        passed = []
        for _ in range(count):
            try:
                await replica.check_health()
                passed.append(True)
            except TimeoutError:
                passed.append(False)
        return passed
    return asyncio.run(checks())


def test_a_health_check_that_fails_once_does_not_break_the_generation():
    replica = _replica([True, False, True, True, False])
    assert _run_checks(replica, 5) == [False, True, False, False, True]
    assert replica.reported == []  # never as many failures in a row as make Serve restart it


def test_failures_in_a_row_that_make_serve_restart_the_replica_break_the_generation():
    from engram_ray.serve.member.server import FAILED_CHECKS_TO_RESTART

    replica = _replica([True] * FAILED_CHECKS_TO_RESTART)
    assert not any(_run_checks(replica, FAILED_CHECKS_TO_RESTART))
    assert replica.reported == [f"health check failed {FAILED_CHECKS_TO_RESTART} time(s) in a "
                                "row (TimeoutError)"]


def test_a_member_whose_dp_gang_restarts_stops_its_live_engine_and_restarts_with_the_gang():
    """Another engine of its data-parallel gang died (`member_check` answers the restart's
    number): this member's engine, alive, is stopped and restarted under that number, without
    asking the coordinator again; the same number again, or its own engine's death meanwhile,
    starts nothing more."""
    member = _member(2)
    engine = member.server._member_engine

    async def run():
        member.on_gang_restart(1)
        assert member.is_restarting and engine.watch_stopped
        member.on_gang_restart(1)  # asked again before it finished: nothing more
        await member.on_engine_death()  # its engine dies as the gang's stops: left to it
        await member._gang_task
    asyncio.run(run())
    assert engine.restarted and engine.dp_round == "1" and member.dp_epoch == 1
    assert member.server._coordinator.member_restarting.calls == []
    assert member.error.endswith("RuntimeError: not in this test")  # the fake's
    member.error, engine.restarted = None, False
    member.on_gang_restart(1)  # a number it has restarted under already
    assert not engine.restarted and not member.is_restarting


def test_a_start_past_its_deadline_is_killed_and_reaped_before_the_deadline_returns():
    """A start that hangs in its thread (it spawned a process and waits on it, as `AsyncLLM`
    waits on its EngineCore) and is given up by `wait_for`: the process it spawned is killed
    and the thread has ended by the time the TimeoutError reaches the caller (the rollback
    starts only then); before, the thread went on loading beside the rollback."""
    import subprocess
    import threading
    import time

    import psutil

    from engram_ray.serve.member.engine import _cancellable

    spawned, ended = [], threading.Event()

    def start():
        try:
            proc = subprocess.Popen(["sleep", "600"])
            spawned.append(proc.pid)
            proc.wait()  # killed: returns
            raise RuntimeError("engine core died during start-up")
        finally:
            ended.set()

    async def run():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(_cancellable(start), 1.0)
        return time.monotonic()

    started = time.monotonic()
    returned = asyncio.run(run())
    assert ended.is_set() and spawned
    assert not psutil.pid_exists(spawned[0]) or \
        psutil.Process(spawned[0]).status() == psutil.STATUS_ZOMBIE
    assert returned - started < 10.0


def test_a_start_that_ends_in_time_returns_its_engine():
    from engram_ray.serve.member.engine import _cancellable

    assert asyncio.run(_cancellable(lambda a, b: a + b, 2, 3)) == 5

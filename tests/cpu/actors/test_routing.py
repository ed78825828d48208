"""Routing off a broken peer group: the generation book's serving state (pure), the
coordinator's long-polled routing table and member watch on a real local Ray, and the
ingress's view of it. (The whole path under load, with engines killed: test_faults.py.)"""

import asyncio
import json
import time
from pathlib import Path

import pytest

from engram_ray.model.layout import load_layout
from engram_ray.planning.generations import GenerationBook
from engram_ray.serve.deploy.cluster_configs import load_serve_config
from engram_ray.serve.edge.ingress import (RETIRED_FAILURE, GroupRouting, error_event,
                                           is_failure_named, is_group_failure)

CONFIGS = Path(__file__).resolve().parents[3] / "cluster_configs"


def _raw(tmp_path, name: str) -> dict:
    raw = next(iter(load_serve_config(CONFIGS / "serve_local_tiny.yaml").values())).to_dict()
    raw["deployment"].update(peer_group_store=str(tmp_path / "store"), name=name,
                             model="deepseek-v4.1-flash")
    raw["serving"].update(prometheus_targets_file=str(tmp_path / "targets.json"))
    return raw


def _book(tmp_path) -> GenerationBook:
    from engram_ray.serve.settings.config import ServeAppConfig

    config = ServeAppConfig.from_dict(_raw(tmp_path, "book"), "test").deployment
    return GenerationBook(config, load_layout(config.model), {"group-0": "a", "group-1": "b"})


def test_a_group_serves_only_with_every_member_ready_and_none_lost(tmp_path):
    book = _book(tmp_path)
    assert book.routing()["group-0"] == {"generation": None, "serving": False,
                                         "reason": "not started"}
    first = book.join("group-0", "gang1", 0, 2, "m0")["generation"]
    book.join("group-0", "gang1", 1, 2, "m1")
    book.member_ready("m0")
    assert book.routing()["group-0"]["reason"] == "1 of 2 members ready"
    assert book.member_ready("m1") == ("group-0", 1)
    assert book.routing()["group-0"] == {"generation": first, "serving": True, "reason": None,
                                         "serving_members": ["m0", "m1"], "restarting_ranks": []}
    assert book.break_generation("group-0", first, "member 1: engine died")
    assert not book.break_generation("group-0", first, "again")  # the first reason stays
    assert book.routing()["group-0"] == {"generation": first, "serving": False,
                                         "reason": "member 1: engine died",
                                         "serving_members": ["m0", "m1"], "restarting_ranks": []}
    assert not book.member_restarting("m0", "engine died")  # broken: no restart in place
    book.leave("m0")  # Serve stops the survivor: still broken, for the first reason
    assert book.routing()["group-0"]["reason"] == "member 1: engine died"
    second = book.join("group-0", "gang2", 0, 2, "n0")["generation"]
    book.join("group-0", "gang2", 1, 2, "n1")
    assert not book.break_generation("group-0", first, "late report of the old gang")
    assert not book.routing()["group-0"]["serving"]
    book.member_ready("n0"), book.member_ready("n1")
    assert book.routing()["group-0"]["serving"] and book.routing()["group-0"]["generation"] == second
    assert book.routing()["group-1"]["serving"] is False  # groups are independent
    assert book.member_ready("m1") is None  # a replica of a replaced gang
    (old,) = book.status()["group-0"]["history"]
    assert old["broken"] == "member 1: engine died" and old["broken_at"] >= old["started_at"]


def test_a_member_that_stops_breaks_its_generation(tmp_path):
    book = _book(tmp_path)
    gen = book.join("group-1", "g", 0, 2, "a")["generation"]
    book.join("group-1", "g", 1, 2, "b")
    book.member_ready("a"), book.member_ready("b")
    book.leave("b")
    assert book.routing()["group-1"] == {"generation": gen, "serving": False,
                                         "reason": "member 1 stopped", "serving_members": ["a"],
                                         "restarting_ranks": []}


def test_removing_the_stores_takes_the_death_records_and_a_late_record_stays_out(tmp_path):
    """What `serve shutdown` leaves (CI, 2026-12-03: a replica's engine-death record outlived
    its application): the book removes every group folder, the death records and the
    deployment's folder; a replica that records a death after that writes nothing."""
    from engram_ray.planning.assignment import deaths_dir
    from engram_ray.serve.member.engine_death import EngineDeath, record_death

    book = _book(tmp_path)
    gen = book.join("group-0", "g", 0, 2, "a")
    folder = deaths_dir(book.config.peer_group_store, book.config.name)
    death = EngineDeath("group-0-r0", "worker exited with code 1", "while serving", None, 1.0)
    record_death(folder, "a", death)
    assert Path(gen["store_dir"]).is_dir() and (folder / "a.json").is_file()
    book.join("group-1", "g1", 0, 2, "c")
    book.reconfigure(book.config, {"group-0": "a"})  # num_peer_groups 2 -> 1: group-1 goes
    assert sorted(p.name for p in folder.parent.iterdir()) == ["engine-deaths", "group-0"]
    book.remove_stores()
    assert not folder.parent.exists()
    record_death(folder, "b", death)
    assert not folder.parent.exists()


def test_a_data_parallel_gang_restarts_whole_while_the_groups_other_gang_serves(tmp_path):
    """DEP2 in a group of 4: an engine's death restarts its DP gang (ranks 2 and 3) under
    one restart number; the other gang serves; numbers go on, also across a rebuild."""
    from engram_ray.serve.settings.config import ServeAppConfig

    raw = _raw(tmp_path, "dp")
    raw["deployment"]["peer_group_size"], raw["serving"]["data_parallel_size"] = 4, 2
    config = ServeAppConfig.from_dict(raw, "test")
    book = GenerationBook(config.deployment, load_layout(config.deployment.model),
                          {"group-0": "a"}, config.serving.data_parallel_size)
    gen = [book.join("group-0", "g", r, 4, f"m{r}") for r in range(4)][0]["generation"]
    for r in range(4):
        book.member_ready(f"m{r}")
    assert book.member_restarting("m3", "engine core exited with SIGKILL") == 1
    route = book.routing()["group-0"]
    assert route["serving"] and route["serving_members"] == ["m0", "m1"]
    assert route["restarting_ranks"] == [2, 3]
    assert (book.restart_epoch("m2"), book.restart_epoch("m0")) == (1, None)
    assert book.member_restarting("m2", "engine died") == 1  # the same restart, not another
    assert "member 3 of its data-parallel gang" in book.status()["group-0"]["restarting"][2][
        "reason"]
    assert book.dp_peers("m2") == ["m3"] and book.dp_peers("m0") == ["m1"]
    book.member_ready("m3"), book.member_ready("m2")
    status = book.status()["group-0"]
    assert status["generation"] == gen and status["restarting"] == {}
    assert [(r["rank"], r["epoch"]) for r in status["restarts"]] == [(3, 1), (2, 1)]
    assert book.member_restarting("m0", "engine died") == 1  # gang 0's first
    assert book.member_restarting("m2", "engine died") == 2  # gang 1's second
    rebuilt = GenerationBook(config.deployment, load_layout(config.deployment.model),
                             {"group-0": "a"}, 2)
    a = book._assignment(book.groups["group-0"], book.groups["group-0"].current, 2)
    assert rebuilt.rejoin({"replica_id": "m2", "assignment": a, "ready_at": 1.0,
                           "dp_epoch": 2})
    rebuilt.rejoin({"replica_id": "m3", "assignment": {**a, "member_rank": 3},
                    "ready_at": 1.0, "dp_epoch": 2})
    assert rebuilt.member_restarting("m3", "engine died") == 3  # never a number used before


def test_a_member_restarting_its_engine_keeps_its_group_and_generation(tmp_path):
    book = _book(tmp_path)
    gen = book.join("group-0", "g", 0, 2, "a")["generation"]
    book.join("group-0", "g", 1, 2, "b")
    assert not book.member_restarting("a", "engine died")  # never ready: nothing to restart
    book.member_ready("a"), book.member_ready("b")
    assert book.member_restarting("b", "engine core exited with SIGKILL")
    route = book.routing()["group-0"]
    assert route == {"generation": gen, "serving": True, "reason": None, "serving_members": ["a"],
                     "restarting_ranks": [1]}
    assert book.member_restarting("a", "engine died")  # both at once: the group pauses
    assert book.routing()["group-0"]["reason"] == "every member's engine is restarting"
    book.member_ready("b")
    book.member_ready("a")
    status = book.status()["group-0"]
    assert status["generation"] == gen and status["restarting"] == {}
    assert [r["rank"] for r in status["restarts"]] == [1, 0]
    assert status["restarts"][0]["reason"] == "engine core exited with SIGKILL"
    assert status["restarts"][0]["ready_at"] >= status["restarts"][0]["since"]
    assert book.routing()["group-0"]["serving_members"] == ["a", "b"]


def test_group_failures_are_told_from_request_errors():
    import ray.exceptions

    assert is_group_failure(ray.exceptions.ActorDiedError())
    wrapped = ray.exceptions.RayTaskError("f", "tb", type("EngineDeadError", (Exception,), {})())
    assert is_group_failure(wrapped)
    assert not is_group_failure(ValueError("bad prompt"))
    assert not is_group_failure(ray.exceptions.RayTaskError("f", "tb", ValueError("x")))
    retired = ray.exceptions.RayTaskError("f", "tb", type("MemberRetiredError", (Exception,), {})())
    assert is_group_failure(retired) and is_failure_named(retired, RETIRED_FAILURE)
    assert not is_failure_named(wrapped, RETIRED_FAILURE)  # a dead engine: its group is lost
    assert error_event("gone").startswith('data: {"error": {"message": "gone"')


def test_coordinator_stops_routing_to_a_group_whose_replica_dies(ray_local, tmp_path):
    """Two one-member groups; group-0's replica actor is killed: the routing table says so
    within a second (the coordinator's watch), the long poll returns at once, group-1 serves."""
    ray = ray_local
    from engram_ray.actors.coordinator_lookup import get_coordinator

    @ray.remote(num_cpus=0)
    class Replica:
        def ping(self):
            return True

    raw = _raw(tmp_path, "watch")
    raw["deployment"]["peer_group_size"] = 1
    raw["serving"]["num_peer_groups"] = 2
    coordinator = get_coordinator(raw, {"group-0": "a", "group-1": "b"}, "watch")
    replicas = [Replica.remote(), Replica.remote()]
    ray.get([r.ping.remote() for r in replicas])
    for i, replica in enumerate(replicas):
        ray.get(coordinator.join.remote(f"group-{i}", f"gang{i}", 0, 1, f"m{i}"))
        ray.get(coordinator.member_ready.remote(f"m{i}", replica))
    version, table = ray.get(coordinator.routing.remote())
    assert table["group-0"]["serving"] and table["group-1"]["serving"]
    started = time.monotonic()
    assert ray.get(coordinator.routing.remote(version, 0.5))[0] == version  # no change: timeout
    assert time.monotonic() - started >= 0.5
    poll = coordinator.routing.remote(version, 30.0)
    killed_at = time.monotonic()
    ray.kill(replicas[0], no_restart=True)
    version, table = ray.get(poll)
    noticed_s = time.monotonic() - killed_at
    assert noticed_s < 1.0, noticed_s
    assert not table["group-0"]["serving"] and table["group-1"]["serving"]
    assert "replica actor lost" in table["group-0"]["reason"]
    poll = coordinator.routing.remote(version, 30.0)
    assert ray.get(coordinator.member_restarting.remote("m1", "engine died"))
    version, table = ray.get(poll)  # the long poll returns at once
    assert table["group-1"]["restarting_ranks"] == [0] and not table["group-1"]["serving"]
    ray.get(coordinator.member_ready.remote("m1", replicas[1]))
    assert ray.get(coordinator.routing.remote())[1]["group-1"]["serving_members"] == ["m1"]
    ray.get(coordinator.report_broken.remote("m1", "engine died"))
    assert ray.get(coordinator.routing.remote())[1]["group-1"]["reason"] == (
        "member 0: engine died")
    ray.kill(coordinator)


def _route(generation: str, serving: bool = True, members=("m0",)) -> dict:
    return {"generation": generation, "serving": serving, "reason": None if serving else "x",
            "serving_members": list(members), "restarting_ranks": []}


def test_the_ingress_view_skips_groups_it_saw_fail_until_a_new_generation():
    import engram_ray.serve.edge.ingress as ingress

    async def scenario():
        routing = GroupRouting("unused")
        assert routing.is_serving("group-0")  # nothing known yet: Serve's own routing
        routing._update({"group-0": _route("g.1")})
        routing.mark_lost("group-0", "g.1")
        assert not routing.is_serving("group-0")
        routing._update({"group-0": _route("g.2", members=("m0", "m1")),
                         "group-1": _route("h.1", serving=False, members=("n0",))})
        assert routing.is_serving("group-0")
        assert ingress.live_replica_ids() == {"m0", "m1"}  # members of serving groups only
        sent = routing.version  # a request sent now
        waiter = asyncio.ensure_future(routing.wait_change(sent, 5.0))
        await asyncio.sleep(0.01)
        routing._update({"group-0": _route("g.2", members=("m1",))}, changed=False)
        await asyncio.sleep(0.05)  # the waiter runs: it must still be waiting
        assert not waiter.done()  # a long poll that timed out is no change
        routing._update({"group-0": _route("g.2", members=("m1",))})
        assert await waiter and ingress.live_replica_ids() == {"m1"}
        assert await routing.wait_change(sent, 0.0)  # changed before its failure came back
        assert not await routing.wait_change(routing.version, 0.01)
    asyncio.run(scenario())


def test_a_request_waiting_for_a_group_that_stops_serving_goes_elsewhere():
    """A request queued for a group whose members Serve stops (its application deleted by a
    `serve deploy` that lowered num_peer_groups) gives up the group once the coordinator stops
    routing to it; a routing change that keeps the group serving does not."""
    from engram_ray.serve.edge.ingress import GroupLeft

    async def never_answers():
        await asyncio.sleep(3600)
        yield "never"

    async def answers():
        yield "first"

    async def scenario():
        routing = GroupRouting("unused")
        routing._update({"group-0": _route("g.1"), "group-2": _route("k.1")})
        assert await routing.first_chunk(answers(), "group-2") == "first"
        waiting = asyncio.ensure_future(routing.first_chunk(never_answers(), "group-2"))
        await asyncio.sleep(0.01)
        routing._update({"group-0": _route("g.1"), "group-2": _route("k.1", members=("x",))})
        await asyncio.sleep(0.05)
        assert not waiting.done()  # still serving: it waits on
        routing._update({"group-0": _route("g.1")})  # group-2 gone from the table
        with pytest.raises(GroupLeft):
            await asyncio.wait_for(waiting, 1.0)
    asyncio.run(scenario())


def test_a_failure_seen_only_by_the_ingress_expires(monkeypatch):
    """A transient error must not take a group the coordinator calls healthy out for good."""
    import engram_ray.serve.edge.ingress as ingress

    monkeypatch.setattr(ingress, "LOST_HINT_S", 0.05)
    routing = GroupRouting("unused")
    routing._update({"group-0": _route("g.1")})
    routing.mark_lost("group-0", "g.1")
    assert not routing.is_serving("group-0")
    time.sleep(0.06)
    assert routing.is_serving("group-0")


def test_a_failure_the_coordinator_answers_with_a_member_restarting_clears_at_once():
    """One group of two engines, one engine dies: the ingress saw a request fail there and
    skipped the group; the coordinator's next table (the member restarting, the other serving)
    is its word on it: the group takes requests again, not a 503 until the hint expires."""
    routing = GroupRouting("unused")
    routing._update({"group-0": _route("g.1", members=("m0", "m1"))})
    routing.mark_lost("group-0", "g.1")
    routing._update({"group-0": _route("g.1", members=("m0", "m1"))}, changed=False)
    assert not routing.is_serving("group-0")  # a long poll that timed out says nothing
    routing._update({"group-0": {**_route("g.1", members=("m0",)), "restarting_ranks": [1]}})
    assert routing.is_serving("group-0")
    routing.mark_lost("group-0", "g.1")
    routing._update({"group-0": _route("g.1", serving=False)})
    assert not routing.is_serving("group-0")


def _member_record(assignment: dict, replica_id: str, ready: bool = True) -> dict:
    """What a replica's coordinator link sends a restarted coordinator
    (`engram_ray.serve.member.link`)."""
    return {"replica_id": replica_id, "assignment": assignment, "node_labels": {},
            "ready_at": time.time() if ready else None, "restarting": None, "broken": None,
            "targets": {replica_id: {"target": f"127.0.0.1:9{replica_id[-1]}", "labels": {}}},
            "slot": 0, "node_id": f"node-{replica_id}"}


def test_a_rebuilt_book_routes_as_before_and_retires_or_refuses_older_generations(tmp_path):
    book = _book(tmp_path)
    a0 = book.join("group-0", "g", 0, 2, "a")
    a1 = book.join("group-0", "g", 1, 2, "b")
    book.member_ready("a"), book.member_ready("b")
    book.member_restarting("b", "engine died")
    before = book.routing()
    stale = Path(a0["store_dir"]).parent / "local-old-generation"
    stale.mkdir(mode=0o700)
    rebuilt = _book(tmp_path)
    assert not rebuilt.is_complete()
    assert rebuilt.rejoin(_member_record(a0, "a"))
    record = _member_record(a1, "b")
    record["restarting"] = {"reason": "engine died", "since": time.time()}
    assert rebuilt.rejoin(record)
    assert rebuilt.routing()["group-0"] == before["group-0"]
    assert rebuilt.unclaimed_store_dirs() == [str(stale)]
    # An older gang still serving (the coordinator died as the newer one took over, before
    # it heard it was retired) drains; one older still is refused.
    older = dict(a0, generation="older", generation_index=0)
    assert rebuilt.rejoin(_member_record(older, "z")) and rebuilt.is_retired("z")
    assert rebuilt.routing()["group-0"] == before["group-0"]
    oldest = dict(a0, generation="oldest", generation_index=-1)
    assert not rebuilt.rejoin(_member_record(oldest, "y"))
    assert not rebuilt.is_complete()  # group-1 has no generation
    # A rebuilt generation goes on as any: its next gang opens generation index + 1.
    assert rebuilt.join("group-0", "g2", 0, 2, "c")["generation_index"] == a0["generation_index"] + 1


def _rolling_book(tmp_path, took_over: bool):
    """A `beside` roll of group-0 under way: gang g1 (a, b) serving, gang g2 (c ready, d
    starting) beside it; with `took_over`, d ready too: g2 took over, g1 retired."""
    book = _book(tmp_path)
    old = [book.join("group-0", "g1", r, 2, m) for r, m in enumerate("ab")]
    for m in "ab":
        book.member_ready(m), book.member_running(m)
    new = [book.join("group-0", "g2", r, 2, m) for r, m in enumerate("cd")]
    book.member_ready("c")
    if took_over:
        book.member_ready("d")
    return book, old, new


@pytest.mark.parametrize("order", ["cadb", "abcd", "dcba"])
def test_a_coordinator_rebuilt_mid_rollout_keeps_the_serving_gang_and_the_starting_one(
        tmp_path, order):
    """Members rejoin in any order with their role: the serving gang stays current, the one
    starting beside it stays next (neither refused), no folder of either is removed, and the
    roll goes on: the last new member ready takes over."""
    book, old, new = _rolling_book(tmp_path, took_over=False)
    before = book.routing()["group-0"]
    records = {"a": _member_record(old[0], "a"), "b": _member_record(old[1], "b"),
               "c": {**_member_record(new[0], "c"), "role": "starting"},
               "d": {**_member_record(new[1], "d", ready=False), "role": "starting"}}
    rebuilt = _book(tmp_path)
    del rebuilt.groups["group-1"]  # group-0 alone: is_complete speaks of it only
    complete = []
    for member in order:
        assert rebuilt.rejoin(records[member])
        complete.append(rebuilt.is_complete())
    # Complete once the serving gang is back, not when the starting one alone is (seen in
    # test_faults, 2026-12-06: the rebuild ended on the starting gang, which does not serve).
    assert complete == [bool({"a", "b"} <= set(order[:i + 1])) for i in range(len(order))]
    assert new[0]["beside"] and not old[0]["beside"]
    rebuilt.end_rebuild()
    assert rebuilt.routing()["group-0"] == before
    assert rebuilt.status()["group-0"]["starting"] == new[0]["generation"]
    assert rebuilt.unclaimed_store_dirs() == []
    rebuilt.member_ready("d")  # the new gang complete: it takes over, the old one drains
    assert rebuilt.status()["group-0"]["generation"] == new[0]["generation"]
    assert rebuilt.is_retired("a") and rebuilt.may_take_over("d", 60.0) is False


def test_a_coordinator_rebuilt_after_a_takeover_keeps_the_new_gang_current(tmp_path):
    """The coordinator died after the new gang took over: the old members rejoin retired,
    the new ones still starting (waiting for the drain): the new gang is current and took
    over, the old one drains, no folder removed."""
    book, old, new = _rolling_book(tmp_path, took_over=True)
    assert book.is_retired("a")
    rebuilt = _book(tmp_path)
    del rebuilt.groups["group-1"]  # group-0 alone: is_complete speaks of it only
    for record in [{**_member_record(new[1], "d"), "role": "starting"},
                   {**_member_record(old[0], "a"), "role": "retired"},
                   {**_member_record(new[0], "c"), "role": "starting"},
                   {**_member_record(old[1], "b"), "role": "retired"}]:
        assert rebuilt.rejoin(record)
    assert rebuilt.is_complete()  # the new gang had taken over: it awaits no serving one
    rebuilt.end_rebuild()
    status = rebuilt.status()["group-0"]
    assert (status["generation"], status["retired"]) == (new[0]["generation"],
                                                         old[0]["generation"])
    assert rebuilt.unclaimed_store_dirs() == []
    rebuilt.report_in_flight("a", 0), rebuilt.report_in_flight("b", 0)
    assert rebuilt.may_take_over("c", 60.0) is True  # drained: the new members end their start


def test_a_killed_coordinator_restarts_with_its_saved_state(ray_local, tmp_path):
    """kill -9 of the coordinator's process: Ray restarts it with the state it saved; a long
    poll in flight is answered at once with the same table (no wait for the members), targets
    and slots are back, a folder handed to no member is removed at once (its owners are known
    gone: every folder handed out is in the saved state), the members' folders stay, also
    that of a gang whose engine is still loading and which never rejoins, rejoins are taken,
    and a join after the restart continues the generation."""
    import os
    import signal

    ray = ray_local
    from engram_ray.actors.coordinator_lookup import get_coordinator

    raw = _raw(tmp_path, "rebuild")
    raw["deployment"]["peer_group_size"] = 1
    raw["serving"]["num_peer_groups"] = 3
    coordinator = get_coordinator(raw, {"group-0": "a", "group-1": "b", "group-2": "c"},
                                  "rebuild")
    assignments = {}
    for i in range(2):
        assignments[f"m{i}"] = ray.get(coordinator.join.remote(f"group-{i}", f"g{i}", 0, 1,
                                                               f"m{i}"))
        ray.get(coordinator.register_target.remote(f"m{i}", f"127.0.0.1:9{i}", {}))
        assert ray.get(coordinator.metrics_slot.remote(f"m{i}", "node-a")) == i
        ray.get(coordinator.member_ready.remote(f"m{i}"))
    # group-2's gang is starting: its engine loads (minutes for DeepSeek), it cannot rejoin.
    loading = ray.get(coordinator.join.remote("group-2", "g2", 0, 1, "m2"))
    version, before = ray.get(coordinator.routing.remote())
    incarnation = ray.get(coordinator.member_check.remote())["incarnation"]
    assert assignments["m0"]["incarnation"] == incarnation
    stale = Path(assignments["m0"]["store_dir"]).parent / "rebuild-group-0-old"
    stale.mkdir(mode=0o700)
    pid = ray.get(coordinator.__ray_call__.remote(lambda _self: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    poll = coordinator.routing.remote(version, 30.0)  # retried on the restarted actor
    new_version, after = ray.get(poll, timeout=30)
    assert after == before and new_version > version
    assert ray.get(coordinator.member_check.remote())["incarnation"] != incarnation
    assert not stale.exists()
    assert all(Path(a["store_dir"]).is_dir() for a in [*assignments.values(), loading])
    assert ray.get(coordinator.status.remote())["group-2"]["generation"] == \
        loading["generation"]  # known without its rejoin
    assert ray.get(coordinator.member_ready.remote("m2")) is None
    assert ray.get(coordinator.routing.remote())[1]["group-2"]["serving"]
    targets = {t for g in ray.get(coordinator.target_groups.remote()) for t in g["targets"]
               if g["labels"].get("endpoint") != "coordinator"}  # its own: a new one
    assert targets == {"127.0.0.1:90", "127.0.0.1:91"}
    assert ray.get(coordinator.metrics_slot.remote("m1", "node-a")) == 1  # kept
    for replica_id, a in assignments.items():
        assert ray.get(coordinator.rejoin.remote(_member_record(a, replica_id)))
    assert {g: r for g, r in ray.get(coordinator.routing.remote())[1].items()
            if g != "group-2"} == {g: r for g, r in before.items() if g != "group-2"}
    again = ray.get(coordinator.join.remote("group-0", "g0", 0, 1, "m0"))
    assert again["generation"] == assignments["m0"]["generation"]
    ray.get(coordinator.shutdown.remote())
    assert not Path(assignments["m0"]["store_dir"]).exists()
    assert not Path(loading["store_dir"]).exists()
    ray.kill(coordinator)


def test_a_coordinator_killed_mid_roll_of_a_dp_gang_decides_as_before(ray_local, tmp_path):
    """An in-place roll of two groups of 4 (DEP2, max_groups_at_once 1); the coordinator is
    killed right after it gave member 0 its turn (so member 1, its DP peer, restarts with
    it) and again after the roll stopped: the restarted one keeps the turn, the peer's
    restart epoch and the group's routing, gives no other group a turn, and a stopped roll
    stays stopped."""
    import os
    import signal

    ray = ray_local
    from engram_ray.actors.coordinator_lookup import get_coordinator
    from engram_ray.serve.settings.config_change import config_version

    raw = _raw(tmp_path, "midroll")
    raw["deployment"]["peer_group_size"], raw["serving"]["num_peer_groups"] = 4, 2
    raw["serving"]["data_parallel_size"] = 2
    raw["serving"]["rollout"] = {"mode": "in_place", "max_groups_at_once": 1}
    domains = {"group-0": "a", "group-1": "b"}
    coordinator = get_coordinator(raw, domains, "midroll")
    members = [(g, r, f"g{g}m{r}") for g in range(2) for r in range(4)]
    for g, r, replica_id in members:
        ray.get(coordinator.join.remote(f"group-{g}", f"gang{g}", r, 4, replica_id))
        ray.get(coordinator.member_ready.remote(replica_id))
    old = config_version(raw)
    new_raw = json.loads(json.dumps(raw))
    new_raw["serving"]["max_model_len"] = raw["serving"].get("max_model_len", 512) + 64
    ray.get(coordinator.reconfigure.remote(new_raw, domains))
    new = config_version(new_raw)
    check = lambda rid: ray.get(coordinator.member_check.remote(rid, 0, False, old))  # noqa: E731
    answer = check("g0m0")
    assert answer["restart_for"] == new and answer["rollout"]["max_groups_at_once"] == 1
    version, before = ray.get(coordinator.routing.remote())
    assert before["group-0"]["restarting_ranks"] == [0, 1]

    def kill():
        pid = ray.get(coordinator.__ray_call__.remote(lambda _self: os.getpid()))
        os.kill(pid, signal.SIGKILL)
    kill()
    assert ray.get(coordinator.routing.remote(version, 30.0), timeout=30)[1] == before
    answer = check("g0m1")  # the DP peer: same turn, same restart epoch
    assert answer["restart_for"] == new and answer["restart_epoch"] == 1
    assert check("g0m0")["restart_epoch"] == 1
    assert all(check(f"g1m{r}")["restart_for"] is None for r in range(4))  # one group at once
    assert check("g0m2")["restart_for"] is None  # never two DP gangs of one group
    assert ray.get(coordinator.roll_status.remote())["restarting"] == ["g0m0", "g0m1"]
    ray.get(coordinator.roll_failed.remote("g0m0", "engine did not start"))
    ray.get(coordinator.member_ready.remote("g0m0", None, old))
    ray.get(coordinator.member_ready.remote("g0m1", None, old))
    kill()
    status = ray.get(coordinator.roll_status.remote(), timeout=30)
    assert status["stopped"]["reason"] == "engine did not start"
    assert all(check(rid)["restart_for"] is None for _, _, rid in members)  # stays stopped
    ray.get(coordinator.shutdown.remote())
    ray.kill(coordinator)


def test_waiting_callers_do_not_starve_the_members(ray_local, tmp_path):
    """64 routing long polls parked on the coordinator (as 64 ingress replicas hold them):
    a member's check and a join still answer at once, and a change reaches every poll."""
    ray = ray_local
    from engram_ray.actors.coordinator_lookup import get_coordinator

    raw = _raw(tmp_path, "polls")
    raw["deployment"]["peer_group_size"] = 1
    raw["serving"]["num_peer_groups"] = 2
    coordinator = get_coordinator(raw, {"group-0": "a", "group-1": "b"}, "polls")
    ray.get(coordinator.join.remote("group-0", "g0", 0, 1, "m0"))
    version, _ = ray.get(coordinator.routing.remote())
    polls = [coordinator.routing.remote(version, 60.0) for _ in range(64)]
    time.sleep(1.0)
    assert not ray.wait(polls, num_returns=1, timeout=0)[0]  # all parked
    started = time.monotonic()
    ray.get(coordinator.member_check.remote("m0", 0, False, None))
    ray.get(coordinator.join.remote("group-1", "g1", 0, 1, "m1"))
    assert time.monotonic() - started < 5.0  # 16 polls held a threaded actor for 10 s each
    answers = ray.get(polls, timeout=10)
    assert {v for v, _ in answers} == {answers[0][0]} and answers[0][0] > version
    ray.get(coordinator.shutdown.remote())
    ray.kill(coordinator)


def test_a_rolling_change_starts_a_gang_beside_the_serving_one_which_drains_then_stops(tmp_path):
    book = _book(tmp_path)
    old = book.join("group-0", "g1", 0, 2, "a")
    book.join("group-0", "g1", 1, 2, "b")
    book.member_ready("a"), book.member_ready("b")
    before = book.routing()["group-0"]
    new = book.join("group-0", "g2", 0, 2, "c")  # a new gang while the old one serves
    book.join("group-0", "g2", 1, 2, "d")
    assert new["generation_index"] == old["generation_index"] + 1
    assert new["store_dir"] != old["store_dir"] and Path(old["store_dir"]).is_dir()
    assert book.routing()["group-0"] == before  # the old gang serves on meanwhile
    assert book.status()["group-0"]["starting"] == new["generation"]
    book.member_ready("c")
    assert not book.may_take_over("c", 60.0)  # its gang is not ready yet
    book.member_ready("d")  # all ready: it takes over, the old one retires
    route = book.routing()["group-0"]
    assert route["generation"] == new["generation"] and not route["serving"]
    assert route["reason"] == "taking over (0 of 2 members running)"
    assert book.is_retired("a") and not book.is_retired("c")
    assert not book.may_take_over("c", 60.0)  # the old gang has not drained yet
    book.report_in_flight("a", 0)
    book.report_in_flight("b", 2)
    assert not book.may_take_over("c", 60.0)
    assert book.may_take_over("c", 0.0)  # the drain timeout passed
    book.report_in_flight("b", 0)
    assert book.may_take_over("c", 60.0) and book.may_take_over("d", 60.0)
    assert not book.member_running("c") and book.member_running("d")  # serves with both
    assert book.routing()["group-0"]["serving_members"] == ["c", "d"]
    book.leave("a")  # Serve stops the old gang: its generation ends with its last member
    assert Path(old["store_dir"]).is_dir()
    book.leave("b")
    assert not Path(old["store_dir"]).exists() and book.status()["group-0"]["retired"] is None
    assert book.routing()["group-0"]["serving"]  # leaving retired members break nothing
    # A gang started beside that fails ends alone: the serving one is untouched.
    third = book.join("group-0", "g3", 0, 2, "e")
    assert book.break_generation("group-0", third["generation"], "member 0: engine died")
    assert not Path(third["store_dir"]).exists()
    assert book.may_take_over("e", 60.0) is None  # its gang failed: it must not run
    assert book.routing()["group-0"]["generation"] == new["generation"]
    assert book.routing()["group-0"]["serving"]
    # A gang that replaces a broken one starts in its place (no drain).
    book.break_generation("group-0", new["generation"], "member 1: lost")
    fourth = book.join("group-0", "g4", 0, 2, "f")
    assert book.may_take_over("f", 60.0)
    assert book.routing()["group-0"]["generation"] == fourth["generation"]


def test_a_changed_setting_is_named_and_only_rollable_ones_roll():
    from engram_ray.actors.coordinator_lookup import rolls_out
    from engram_ray.errors import EngramRayError
    from engram_ray.serve.settings.config_change import changed_settings, fixed_changes

    old = {"deployment": {"model": "m", "peer_group_size": 2},
           "serving": {"engine_kwargs": {"max_num_seqs": 128}, "rollout": {"mode": "beside"}}}
    rolled = {**old, "serving": {**old["serving"], "engine_kwargs": {"max_num_seqs": 64}}}
    assert changed_settings(old, rolled) == ["serving.engine_kwargs.max_num_seqs"]
    assert rolls_out(old, rolled, "d")
    fixed = {**old, "deployment": {"model": "m", "peer_group_size": 4}}
    assert fixed_changes(changed_settings(old, fixed)) == ["deployment.peer_group_size"]
    try:
        rolls_out(old, fixed, "d")
    except EngramRayError as exc:
        assert "deployment.peer_group_size" in str(exc) and "rollout.mode: restart" in str(exc)
    else:
        raise AssertionError("a change of peer_group_size rolled out")
    whole = {**fixed, "serving": {**old["serving"], "rollout": {"mode": "restart"}}}
    assert not rolls_out(old, whole, "d")  # applied whole: the coordinator is replaced


def test_groups_take_over_one_at_a_time_so_that_another_always_serves(tmp_path):
    book = _book(tmp_path)
    for g in ("group-0", "group-1"):
        for rank in (0, 1):
            book.join(g, f"{g}-old", rank, 2, f"{g}-o{rank}")
            book.member_ready(f"{g}-o{rank}")
    for g in ("group-0", "group-1"):  # both new gangs ready at once (spare slots for both)
        for rank in (0, 1):
            book.join(g, f"{g}-new", rank, 2, f"{g}-n{rank}")
            book.member_ready(f"{g}-n{rank}")
    status = book.status()
    assert status["group-0"]["retired"] and status["group-1"]["starting"]  # one takes over
    assert book.routing()["group-1"]["serving"]  # the other serves on its old gang
    assert not book.may_take_over("group-1-n0", 0.0)
    book.member_running("group-0-n0")
    book.member_running("group-0-n1")  # group-0 serves again: group-1's turn
    status = book.status()
    assert status["group-1"]["retired"] and status["group-1"]["starting"] is None
    assert book.routing()["group-0"]["serving"] and not book.routing()["group-1"]["serving"]


def test_a_build_whose_check_fails_makes_and_changes_no_coordinator(ray_local, tmp_path):
    """`get_coordinator(..., check=)` (build_app's checks against vLLM's option names): a
    check that fails makes no coordinator, and one with members is not reconfigured; a change
    refused by the rollout mode is refused before the check runs (a refused deploy's build
    does not import vLLM for nothing)."""
    ray = ray_local
    from engram_ray.actors.coordinator_lookup import find_coordinator, get_coordinator
    from engram_ray.errors import ConfigError, EngramRayError

    def typo():
        raise ConfigError("serving.engine_kwargs.gpu_memory_utilisation",
                          "is not a vLLM engine argument")

    raw = _raw(tmp_path, "checked")
    raw["deployment"]["peer_group_size"] = 1
    domains = {"group-0": "a"}
    with pytest.raises(ConfigError, match="gpu_memory_utilisation"):
        get_coordinator(raw, domains, "checked", check=typo)
    with pytest.raises(ValueError):
        find_coordinator("checked")  # none was made
    checks = []
    coordinator = get_coordinator(raw, domains, "checked", check=lambda: checks.append(1))
    try:
        assert checks == [1]
        ray.get(coordinator.join.remote("group-0", "g0", 0, 1, "m0"))
        ray.get(coordinator.member_ready.remote("m0"))
        rolled = json.loads(json.dumps(raw))
        rolled["serving"]["engine_kwargs"]["max_num_seqs"] = 64  # rolls in place
        with pytest.raises(ConfigError):
            get_coordinator(rolled, domains, "checked", check=typo)
        made_with, _ = ray.get(coordinator.describe.remote())
        assert made_with[0] == raw  # not reconfigured
        regang = json.loads(json.dumps(raw))
        regang["deployment"]["rendezvous_timeout_s"] = 299  # needs new gangs: refused
        checks.clear()
        with pytest.raises(EngramRayError, match="needs new gangs"):
            get_coordinator(regang, domains, "checked", check=lambda: checks.append(1))
        assert checks == []
    finally:
        ray.kill(coordinator)


def test_chaos_at_the_shipped_shape_keeps_every_invariant(ray_local, tmp_path):
    """The chaos harness (`support.chaos`) at 9 groups of 8 members (DEP2) with 32 ingress
    polls, on one schedule that puts every fault where it hurts: an in-place roll, the
    coordinator killed mid-roll, engine kills (one whose restart hangs past
    in_place_timeout_s), a refused deploy, settings that will not start, the coordinator
    killed after the roll stopped, a gang's process killed, a deploy back to good settings.
    The full count of random schedules is `benchmarks/bench_chaos.py`."""
    from support.chaos import Ingress, Shape, run_schedule

    ray = ray_local
    shape = Shape()
    ingress = Ingress.remote(shape.num_ingress)
    events = [(0.0, "deploy", 0, 0), (2.5, "coordinator_kill", 0, 0),
              (4.0, "engine_kill", 5, 3), (5.0, "hang", 7, 6), (6.0, "refused", 0, 0),
              (10.0, "will_not_start", 0, 0), (16.0, "coordinator_kill", 0, 0),
              (17.0, "replica_kill", 2, 0), (18.0, "deploy", 0, 0)]
    run = run_schedule(7, shape, str(tmp_path), ingress, events=events)
    ray.kill(ingress)
    assert run.violations == []
    rolled = {e["replica"] for e in run.events if e["kind"] == "restarting"
              and e["reason"].startswith("settings ")}
    assert len(rolled) >= shape.dp_size  # the roll ran (and went on after the kill)
    assert len(run.figures["coordinator_back_s"]) == 2
    assert any(h[1] == "refused" for h in run.harness)
    assert run.stops  # the will-not-start settings stopped the roll


def test_the_dp_round_keys_of_an_ended_gang_are_removed(ray_local, tmp_path):
    """A DP gang's master and barrier keys (every restart round leaves some: a failed roll's,
    a gang restarted whole) go once the coordinator knows its gang gone: its generation
    ended when the next gang of the group joined, or the application stopped."""
    from ray.experimental.internal_kv import _internal_kv_list, _internal_kv_put

    from engram_ray.actors.coordinator_lookup import get_coordinator
    from engram_ray.serve.member.dp_gang import BARRIER_PREFIX, MASTER_PREFIX, dp_gang_id

    ray = ray_local
    raw = _raw(tmp_path, "dpkeys")
    raw["deployment"]["peer_group_size"], raw["serving"]["num_peer_groups"] = 2, 1
    raw["serving"]["data_parallel_size"] = 2
    coordinator = get_coordinator(raw, {"group-0": "a"}, "dpkeys")

    def keys(gang):
        return [k for prefix in (BARRIER_PREFIX, MASTER_PREFIX)
                for k in _internal_kv_list(f"{prefix}{gang}-dp".encode())]

    for gang in ("old", "new"):
        for r in range(2):
            ray.get(coordinator.join.remote("group-0", gang, r, 2, f"{gang}{r}"))
        for suffix in ("", "@3", "@3-back"):
            _internal_kv_put(f"{MASTER_PREFIX}{dp_gang_id(gang, 0)}{suffix}".encode(), b"x")
        _internal_kv_put(f"{BARRIER_PREFIX}{dp_gang_id(gang, 0)}@3/1".encode(), b"1")
    deadline = time.monotonic() + 10
    while keys("old") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert keys("old") == [] and len(keys("new")) == 4  # "new" serves on
    ray.get(coordinator.shutdown.remote())
    assert keys("new") == []
    ray.kill(coordinator)


def test_a_coordinator_whose_application_was_never_seen_ends_with_serve(ray_local, tmp_path):
    """Every group's build failed (no engine deployment of its deployment ever listed), then
    `serve shutdown`: the coordinator it left ends, taking its store folder (before, it
    stayed for the life of the cluster). Last in this module: it stops Serve."""
    from ray import serve

    from engram_ray.actors.coordinator_lookup import find_coordinator, get_coordinator
    from engram_ray.actors.lifetime import APP_CHECK_S

    ray = ray_local
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    raw = _raw(tmp_path, "unseen")
    raw["deployment"]["peer_group_size"], raw["serving"]["num_peer_groups"] = 1, 1
    coordinator = get_coordinator(raw, {"group-0": "a"}, "unseen")
    store = Path(ray.get(coordinator.join.remote("group-0", "g", 0, 1, "m0"))["store_dir"])
    time.sleep(APP_CHECK_S + 1)  # its watch saw Serve running, and no application of its own
    assert find_coordinator("unseen") is not None
    serve.shutdown()
    deadline = time.monotonic() + 3 * APP_CHECK_S
    while time.monotonic() < deadline:
        try:
            find_coordinator("unseen")
        except ValueError:
            break
        time.sleep(0.2)
    with pytest.raises(ValueError):
        find_coordinator("unseen")
    assert not store.exists()

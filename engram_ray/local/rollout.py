"""A changed config rolled out under load through `serve deploy`, measured from the clients'
side: every request sent while it rolls must be answered (`serving.rollout.mode` in_place:
engines restarted one at a time; beside: new gangs beside the serving ones); a change of
`serving.num_peer_groups` adds or removes groups and leaves the others' engines running
(`scale_under_load`).

Used by tests/cpu/local/test_faults.py and benchmarks/bench_serving_changes.py on the local
deployment (`LocalDeployment.redeploy`).
"""

from __future__ import annotations

import time

from engram_ray.local.faults import compare_answers, group_status, routing
from engram_ray.local.loadgen import FAILED, LOST, Traffic


def roll_status(deployment_name: str) -> dict:
    import ray

    from engram_ray.actors.coordinator_lookup import find_coordinator

    return ray.get(find_coordinator(deployment_name).roll_status.remote())


def roll_under_load(deployment, traffic: Traffic, changes: dict, settle_s: float = 3.0,
                    timeout_s: float = 900.0, reference: dict[bool, str] | None = None,
                    during=None) -> dict:
    """`serve deploy` of `changes` while `traffic` runs, then wait until every member of
    every group runs the new engine settings and serves, and no gang is left starting or
    draining (`serving.rollout.mode` in_place or beside), or until the roll stopped at a
    member (a new engine that would not start). Every request sent meanwhile, how many failed
    (0 is the target), seconds until each group had rolled and until all had (`rolled_s`),
    whether each group kept its generation, the members' restarts, and the answers compared
    with `reference`. `during(statuses)`, if given, is called at every poll with each group's
    coordinator status (a fault injected mid-roll: `coordinator_kill_when`)."""
    name = deployment.config.deployment.name
    before = {g: r["generation"] for g, r in routing(name).items()}
    old_version = roll_status(name)["version"]
    first, started_at = len(traffic.results), time.monotonic()
    deployment.redeploy(changes)
    rolled: dict[str, float] = {}
    deadline = started_at + timeout_s
    while time.monotonic() < deadline:
        roll, table = roll_status(name), routing(name)
        statuses = {g: group_status(name, g) for g in table}
        if during is not None:
            during(statuses)
        if roll["stopped"] is not None and not any(s["restarting"] for s in statuses.values()):
            break  # stopped at a member, which serves again on its old settings
        for group_id, state in table.items():
            members = [m["replica_id"] for m in statuses[group_id]["members"].values()]
            if group_id not in rolled and roll["version"] != old_version and state["serving"] \
                    and members and not statuses[group_id]["restarting"] \
                    and all(roll["member_versions"].get(r) == roll["version"] for r in members):
                rolled[group_id] = round(time.monotonic() - started_at, 1)
        if len(rolled) == len(table) and not roll["restarting"] and not any(
                s["retired"] or s["starting"] for s in statuses.values()):
            break
        time.sleep(0.5)
    else:
        raise TimeoutError(f"the change did not roll out within {timeout_s:.0f} s: "
                           f"{routing(name)}; {roll_status(name)}")
    done_at = time.monotonic()
    table = routing(name)
    return {"kind": "rollout", "changes": changes, "rolled_s": round(done_at - started_at, 1),
            "groups_rolled_s": rolled, "old_version": old_version, "version": roll["version"],
            "stopped": roll["stopped"], "member_restarts": roll["restarted"],
            "same_generation": {g: table[g]["generation"] == before.get(g) for g in table},
            **_clients_saw(traffic, first, done_at, settle_s, reference)}


def coordinator_kill_when(deployment_name: str, moment: str):
    """A `during` for `roll_under_load` and `scale_under_load`: kill -9 of the coordinator's
    process, once, the first time its groups show `moment`: "starting" (a gang has joined and
    is starting: beside a group's serving one, or a group's first: a group added) or
    "restarting" (a member restarts its engine in place: an in-place roll's turn); `.killed_at`
    (time.time()) says when, None if it never was."""
    import os
    import signal

    from engram_ray.local.faults import coordinator_pid

    def starting(status: dict) -> bool:
        return status["starting"] is not None or (
            status["generation"] is not None and len(status["ready_at"]) < len(status["members"]))

    def restarting(status: dict) -> bool:
        return bool(status["restarting"])

    seen = {"starting": starting, "restarting": restarting}[moment]

    def during(statuses: dict) -> None:
        if during.killed_at is None and any(seen(s) for s in statuses.values()):
            os.kill(coordinator_pid(deployment_name), signal.SIGKILL)
            during.killed_at = time.time()
    during.killed_at = None
    return during


def scale_under_load(deployment, traffic: Traffic, num_groups: int, settle_s: float = 3.0,
                     timeout_s: float = 600.0, reference: dict[bool, str] | None = None,
                     during=None) -> dict:
    """Deploy `serving.num_peer_groups: num_groups` while `traffic` runs and wait until
    exactly those groups serve and the applications of removed groups are gone: every request
    sent meanwhile, how many failed (must be 0), seconds until then (`scaled_s`), and whether
    the groups kept from before still serve the generation they served (`untouched`: their
    engines were not restarted), and the generation index each added group serves (1: its
    first gang). `during(statuses)` as in `roll_under_load`."""
    from ray import serve

    from engram_ray.serve.settings.group_apps import group_app_name

    name = deployment.config.deployment.name
    before = {g: r["generation"] for g, r in routing(name).items()}
    wanted = {f"group-{i}" for i in range(num_groups)}
    first, started_at = len(traffic.results), time.monotonic()
    deployment.redeploy({"serving": {"num_peer_groups": num_groups}})
    deadline = started_at + timeout_s
    while time.monotonic() < deadline:
        table = routing(name)
        if during is not None:
            during({g: group_status(name, g) for g in table})
        apps = serve.status().applications
        if set(table) == wanted and all(r["serving"] for r in table.values()) and not any(
                group_app_name(name, g) in apps for g in set(before) - wanted):
            break
        time.sleep(0.5)
    else:
        raise TimeoutError(f"num_peer_groups {num_groups} did not take effect within "
                           f"{timeout_s:.0f} s: {routing(name)}")
    done_at = time.monotonic()
    return {"kind": "scale", "changes": {"serving": {"num_peer_groups": num_groups}},
            "scaled_s": round(done_at - started_at, 1),
            "untouched": {g: table[g]["generation"] == before[g]
                          for g in sorted(wanted & set(before))},
            "added_generation_index": {g: group_status(name, g)["generation_index"]
                                       for g in sorted(wanted - set(before))},
            **_clients_saw(traffic, first, done_at, settle_s, reference)}


def _clients_saw(traffic: Traffic, first: int, done_at: float, settle_s: float,
                 reference: dict[bool, str] | None) -> dict:
    """What the clients saw of a change, after `settle_s` more: the requests from result
    `first` on, those sent until `done_at` (the window) and how many of them failed, the
    failures by kind, and the answers compared with `reference`."""
    time.sleep(settle_s)
    results = traffic.results[first:]
    window = [r for r in results if r.started_at <= done_at]
    return {"requests": len(results), "window_requests": len(window),
            "window_failed": sum(not r.ok for r in window),
            "lost_silently": sum(r.outcome == LOST for r in results),
            "failed_visibly": sum(r.outcome == FAILED for r in results),
            "errors": sorted({r.error[:120] for r in results if not r.ok})[:6],
            **compare_answers(results, reference)}

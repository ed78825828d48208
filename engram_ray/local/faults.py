"""Faults on a running deployment, measured from the client's side: kill one member's engine
(its EngineCore or its worker) or its Serve replica under load and see what every client saw.

Used by tests/cpu/local/test_faults.py and benchmarks/bench_serving_faults.py, on the local
deployment (`engram_ray.local.deployment.LocalDeployment`, this process its Ray driver).

    report = kill_under_load(deployment, traffic, "engine_core", "group-0")

An engine kill ("engine_core", "worker") restarts that member's engine in place, in its
generation (`engram_ray.serve.member.restart`); a replica kill restarts the group's whole gang
in a new generation; a coordinator kill (its process, kill -9) restarts the coordinator, which
restores its saved state (`actors/lifetime.py`) while every group serves on:
`recovered_s` is then when it answered again with every group as before. Per kill: requests sent, lost silently (must be 0), failed visibly,
`running_at_kill_failed` (failures of requests sent before the kill was detected: those the
dead engine had taken, including any sent in the fraction of a second between the kill and the
coordinator marking the member restarting or the generation broken), `window_*` (requests sent
from that detection until the member or group served again: every one must be answered),
`traffic_off_s` (from the kill to the start of the last request that
still went to the broken generation or failed other than by the ingress's fail-fast 503),
`recovered_s` and the recovery's parts from the coordinator's record; given the greedy answers
from before the first kill (`reference_answers`), `answers_checked` and `answers_differing`:
every complete answer from the kill on, compared token for token (the traffic asks one prompt
at temperature 0; the split tables give the whole table's answers: tests/cpu/vllm).
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

from engram_ray.local.loadgen import FAILED, LOST, RequestResult, Traffic

ENGINE_KINDS = ("engine_core", "worker")   # restarted in place, same generation
KILL_KINDS = ENGINE_KINDS + ("replica",    # a replica: its whole gang, a new generation
                              "coordinator")  # restarts with its saved state


def replica_actors(group_id: str) -> list:
    """Handles of the Serve replica actors of peer group `group_id`."""
    import ray

    return [ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True)
            if ("EngramLLMServer" in a["name"] or "EngramDPServer" in a["name"])
            and a["name"].split("#")[1].endswith(
                f":{group_id}")]


def engine_core_pid(replica) -> int:
    """PID of the vLLM EngineCore process a replica actor started."""
    import psutil
    import ray

    replica_pid = ray.get(replica.__ray_call__.remote(lambda _self: os.getpid()))
    for child in psutil.Process(replica_pid).children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
            return child.pid
    raise RuntimeError(f"replica process {replica_pid} has no EngineCore child")


def coordinator_pid(deployment_name: str) -> int:
    import ray

    from engram_ray.actors.coordinator_lookup import find_coordinator

    return ray.get(find_coordinator(deployment_name).__ray_call__.remote(
        lambda _self: os.getpid()))


def wait_coordinator_back(deployment_name: str, old_incarnation: str, routing_before: dict,
                          timeout_s: float) -> float:
    """Monotonic time when the coordinator answered with a new incarnation and the routing
    table it had (every group's generation and serving state) before its restart."""
    import ray

    from engram_ray.actors.coordinator_lookup import find_coordinator

    deadline, coordinator = time.monotonic() + timeout_s, find_coordinator(deployment_name)
    while time.monotonic() < deadline:
        if ray.get(coordinator.member_check.remote())["incarnation"] != old_incarnation:
            table = routing(deployment_name)
            if all(table[g]["generation"] == r["generation"] and table[g]["serving"]
                   == r["serving"] for g, r in routing_before.items()):
                return time.monotonic()
        time.sleep(0.2)
    raise TimeoutError(f"the coordinator did not come back with its groups within "
                       f"{timeout_s:.0f} s (last: {routing(deployment_name)})")


def kill(kind: str, group_id: str) -> None:
    """kill -9 of the EngineCore or the worker of `group_id`'s first member, or that member's
    replica."""
    import psutil
    import ray

    replica = replica_actors(group_id)[0]
    if kind == "engine_core":
        os.kill(engine_core_pid(replica), signal.SIGKILL)
    elif kind == "worker":
        core = psutil.Process(engine_core_pid(replica))
        workers = [c for c in core.children() if "Worker" in " ".join(c.cmdline()) + c.name()]
        if not workers:
            raise RuntimeError(f"EngineCore {core.pid} has no VLLM::Worker child")
        os.kill(workers[0].pid, signal.SIGKILL)
    elif kind == "replica":
        ray.kill(replica, no_restart=True)
    else:
        raise ValueError(f"kill kind {kind!r}: expected one of {KILL_KINDS}")


def routing(deployment_name: str) -> dict:
    import ray

    from engram_ray.actors.coordinator_lookup import find_coordinator

    return ray.get(find_coordinator(deployment_name).routing.remote())[1]


def group_status(deployment_name: str, group_id: str) -> dict:
    import ray

    from engram_ray.actors.coordinator_lookup import find_coordinator

    return ray.get(find_coordinator(deployment_name).status.remote())[group_id]


def wait_serving(deployment_name: str, group_id: str, other_than: str | None,
                 timeout_s: float) -> str:
    """The generation of `group_id` once one other than `other_than` serves."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = routing(deployment_name)[group_id]
        if state["serving"] and state["generation"] != other_than:
            return state["generation"]
        time.sleep(0.5)
    raise TimeoutError(f"{group_id}: no new generation served within {timeout_s:.0f} s "
                       f"(last: {routing(deployment_name)[group_id]})")


def wait_member_back(deployment_name: str, group_id: str, num_restarts: int,
                     timeout_s: float, dp_size: int = 1) -> dict:
    """The coordinator's record of `group_id`'s next engine restart in place, once it is
    ready again: of its whole data-parallel gang when `dp_size` > 1 (the first `since`, the
    last `ready_at`, the ranks)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = group_status(deployment_name, group_id)
        if len(status["restarts"]) >= num_restarts + dp_size:
            records = status["restarts"][num_restarts:num_restarts + dp_size]
            return {**records[0], "since": min(r["since"] for r in records),
                    "ready_at": max(r["ready_at"] for r in records),
                    "ranks": sorted(r["rank"] for r in records)}
        if status["broken"]:
            raise RuntimeError(f"{group_id}: the restart in place failed: {status['broken']}")
        time.sleep(0.5)
    raise TimeoutError(f"{group_id}: no member back within {timeout_s:.0f} s")


def reference_answers(results: list[RequestResult]) -> dict[bool, str]:
    """The greedy answer of each endpoint (chat or not: their prompts differ) among `results`:
    the most common complete text; every one of them should be it."""
    texts: dict[bool, Counter] = {}
    for r in results:
        if r.ok:
            texts.setdefault(r.chat, Counter())[r.text] += 1
    return {chat: counts.most_common(1)[0][0] for chat, counts in texts.items()}


def kill_under_load(deployment, traffic: Traffic, kind: str, group_id: str,
                    settle_s: float = 3.0, recovery_timeout_s: float = 600.0,
                    reference: dict[bool, str] | None = None) -> dict:
    """Kill `kind` in `group_id` while `traffic` runs; wait until the member (engine kinds) or
    the group's new generation (replica) serves and `settle_s` more; the figures of the
    module docstring (`reference`: `reference_answers` of the traffic before any kill)."""
    import ray

    from engram_ray.actors.coordinator_lookup import find_coordinator

    name, dp_size = deployment.config.deployment.name, deployment.config.serving.data_parallel_size
    table = routing(name)
    old = table[group_id]["generation"]
    num_restarts = len(group_status(name, group_id)["restarts"])
    incarnation = ray.get(find_coordinator(name).member_check.remote())["incarnation"]
    pid = coordinator_pid(name) if kind == "coordinator" else None
    first = len(traffic.results)
    killed_at, killed_wall = time.monotonic(), time.time()
    if kind == "coordinator":
        os.kill(pid, signal.SIGKILL)
        back_at = wait_coordinator_back(name, incarnation, table, recovery_timeout_s)
        new, recovery = routing(name)[group_id]["generation"], {"detection_s": 0.0}
    elif kind in ENGINE_KINDS:
        kill(kind, group_id)
        restart = wait_member_back(name, group_id, num_restarts, recovery_timeout_s, dp_size)
        new, back_at = old, killed_at + restart["ready_at"] - killed_wall
        recovery = {"detection_s": _span(killed_wall, restart["since"]),
                    "engine_restart_s": _span(restart["since"], restart["ready_at"]),
                    "ranks": restart.get("ranks", [restart["rank"]])}
    else:
        kill(kind, group_id)
        new = wait_serving(name, group_id, other_than=old, timeout_s=recovery_timeout_s)
        back_at = _first_answer(traffic, new, timeout_s=60.0)
        status = group_status(name, group_id)
        ended = next(h for h in status["history"] if h["generation"] == old)
        recovery = _recovery_parts(killed_wall, ended, status, back_at, killed_at)
    # Until the coordinator knows (detection_s), a new request can still reach the dead engine.
    detected_at = killed_at + (recovery["detection_s"] or 0.0)
    time.sleep(settle_s)
    results = traffic.results[first:]
    window = [r for r in results
              if detected_at <= r.started_at <= (back_at or time.monotonic())]
    return {"kind": kind, "group": group_id, "old_generation": old, "new_generation": new,
            "same_generation": new == old, "requests": len(results),
            "ok": sum(r.ok for r in results),
            "lost_silently": sum(r.outcome == LOST for r in results),
            "failed_visibly": sum(r.outcome == FAILED for r in results),
            "running_at_kill_failed": sum(not r.ok for r in results
                                          if r.started_at < detected_at),
            "window_requests": len(window), "window_ok": sum(r.ok for r in window),
            "window_failed": sum(not r.ok for r in window),
            "failed_503_retry_after": sum(r.status == 503 and r.retry_after is not None
                                          for r in results),
            "errors": sorted({r.error[:120] for r in results if not r.ok})[:6],
            "traffic_off_s": round(traffic_off_s(results, killed_at,
                                                 None if new == old else old), 3),
            "recovered_s": round(back_at - killed_at, 1) if back_at else None,
            "recovery": recovery, **compare_answers(results, reference)}


def compare_answers(results: list[RequestResult], reference: dict[bool, str] | None) -> dict:
    if reference is None:
        return {}
    checked = [r for r in results if r.ok and r.chat in reference]
    return {"answers_checked": len(checked),
            "answers_differing": sum(r.text != reference[r.chat] for r in checked)}


def traffic_off_s(results: list[RequestResult], killed_at: float, old: str | None) -> float:
    """Seconds from the kill to the start of the last request that went to generation `old`
    (None: the generation lives on) or failed other than by the ingress's fail-fast 503 (0 if
    none did)."""
    def went_to_broken(r: RequestResult) -> bool:
        if old is not None and r.generation == old:
            return True
        return not r.ok and not (r.status == 503 and r.retry_after is not None)
    late = [r.started_at - killed_at for r in results
            if r.started_at >= killed_at and went_to_broken(r)]
    return max(late, default=0.0)


def _first_answer(traffic: Traffic, generation: str, timeout_s: float) -> float | None:
    """Monotonic time the first request answered by `generation` ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = [r.ended_at for r in list(traffic.results) if r.ok and r.generation == generation]
        if done:
            return min(done)
        time.sleep(0.2)
    return None


def _recovery_parts(killed_wall: float, ended: dict, status: dict, answered: float | None,
                    killed_at: float) -> dict:
    """Seconds of each part of the recovery (coordinator wall-clock times)."""
    ready = max(status["ready_at"].values()) if status["ready_at"] else None
    parts = {"detection_s": _span(killed_wall, ended["broken_at"]),
             "teardown_s": _span(ended["broken_at"], status["started_at"]),
             "engine_start_s": _span(status["started_at"], ready)}
    if answered is not None and ready is not None:
        parts["first_answer_s"] = round(answered - killed_at - (ready - killed_wall), 2)
    return parts


def _span(start: float | None, end: float | None) -> float | None:
    return round(end - start, 2) if start is not None and end is not None else None

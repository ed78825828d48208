"""Faults on a running deployment, measured from the client's side: kill a peer group's
engine core or its replica under load and see what every client saw.

Used by tests/cpu/local/test_faults.py and benchmarks/bench_serving_faults.py, on the local
deployment (`engram_ray.local.deployment.LocalDeployment`, this process its Ray driver).

    report = kill_under_load(deployment, traffic, "engine_core", "group-0")

Per kill: requests sent, lost silently (must be 0), failed visibly, `traffic_off_s` (from the
kill to the start of the last request that still went to the broken generation or failed
other than by the ingress's fail-fast 503), `recovered_s` (until the group's new generation
answered a request) and the recovery's parts (detection, teardown, engine start, rendezvous,
first answer) from the coordinator's record of the generations.
"""

from __future__ import annotations

import os
import signal
import time

from engram_ray.local.loadgen import FAILED, LOST, RequestResult, Traffic

KILL_KINDS = ("engine_core", "replica")


def replica_actors(group_id: str) -> list:
    """Handles of the Serve replica actors of peer group `group_id`."""
    import ray

    return [ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True)
            if "EngramLLMServer" in a["name"] and a["name"].split("#")[1].endswith(
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


def kill(kind: str, group_id: str) -> None:
    """kill -9 of the EngineCore of `group_id`'s first member, or that member's replica."""
    import ray

    replica = replica_actors(group_id)[0]
    if kind == "engine_core":
        os.kill(engine_core_pid(replica), signal.SIGKILL)
    elif kind == "replica":
        ray.kill(replica, no_restart=True)
    else:
        raise ValueError(f"kill kind {kind!r}: expected one of {KILL_KINDS}")


def routing(deployment_name: str) -> dict:
    import ray

    from engram_ray.actors.coordinator import find_coordinator

    return ray.get(find_coordinator(deployment_name).routing.remote())[1]


def group_status(deployment_name: str, group_id: str) -> dict:
    import ray

    from engram_ray.actors.coordinator import find_coordinator

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


def kill_under_load(deployment, traffic: Traffic, kind: str, group_id: str,
                    settle_s: float = 3.0, recovery_timeout_s: float = 600.0) -> dict:
    """Kill `kind` in `group_id` while `traffic` runs; wait until the group serves a new
    generation and `settle_s` more; the figures of module docstring."""
    name = deployment.config.deployment.name
    old = routing(name)[group_id]["generation"]
    first = len(traffic.results)
    killed_at, killed_wall = time.monotonic(), time.time()
    kill(kind, group_id)
    new = wait_serving(name, group_id, other_than=old, timeout_s=recovery_timeout_s)
    answered = _first_answer(traffic, new, timeout_s=60.0)
    time.sleep(settle_s)
    results = traffic.results[first:]
    status = group_status(name, group_id)
    ended = next(h for h in status["history"] if h["generation"] == old)
    return {"kind": kind, "group": group_id, "old_generation": old, "new_generation": new,
            "requests": len(results),
            "ok": sum(r.ok for r in results),
            "lost_silently": sum(r.outcome == LOST for r in results),
            "failed_visibly": sum(r.outcome == FAILED for r in results),
            "failed_503_retry_after": sum(r.status == 503 and r.retry_after is not None
                                          for r in results),
            "errors": sorted({r.error[:120] for r in results if not r.ok})[:6],
            "traffic_off_s": round(traffic_off_s(results, killed_at, old), 3),
            "recovered_s": round(answered - killed_at, 1) if answered else None,
            "recovery": _recovery_parts(killed_wall, ended, status, answered, killed_at)}


def traffic_off_s(results: list[RequestResult], killed_at: float, old: str) -> float:
    """Seconds from the kill to the start of the last request that went to generation `old`
    or failed other than by the ingress's fail-fast 503 (0 if none did)."""
    def went_to_broken(r: RequestResult) -> bool:
        if r.generation == old:
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

"""What a stopped deployment leaves behind, checked as an operator would (issue 28): after a
kill -9 of an engram-ray process and then `serve shutdown`, no engine process, shared-memory
segment or semaphore, listening metrics port, store folder or coordinator may remain.

Used by tests/cpu/local/test_faults.py and benchmarks/bench_serving_changes.py on the local
deployment (this process its Ray driver).
"""

from __future__ import annotations

import os
import time

from engram_ray.local.faults import kill


def engine_processes() -> list[int]:
    """This user's vLLM engine processes (EngineCore, workers) on this machine."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "uids", "name", "cmdline"]):
        try:
            text = proc.info["name"] + " " + " ".join(proc.info["cmdline"] or [])
            if proc.info["uids"].real == os.getuid() and proc.pid != os.getpid() and (
                    "EngineCore" in text or "VLLM::Worker" in text):
                found.append(proc.pid)
        except (psutil.Error, TypeError, AttributeError):
            continue
    return found


def leftovers(deployment, shm_before: frozenset = frozenset()) -> dict:
    """What of the deployment is still there: engine processes, /dev/shm segments and
    semaphores no live process maps (but those in `shm_before`: another run's), listening
    metrics ports, store folders, the coordinator."""
    import glob
    import socket

    from engram_ray.actors.coordinator_lookup import find_coordinator
    from engram_ray.serve.member.engine_shm import mapped_shm_inodes

    mapped = mapped_shm_inodes() or set()
    shm = [p for p in glob.glob("/dev/shm/psm_*") + glob.glob("/dev/shm/sem.mp-*")
           if p not in shm_before and os.stat(p).st_ino not in mapped]
    base = deployment.config.serving.metrics_port  # 0: free ports, not checked here
    listening = []
    for port in range(base, base + 2 * deployment.options.num_logical_cpus if base else 0):
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                listening.append(port)
    dep = deployment.config.deployment
    store = os.path.join(dep.peer_group_store, dep.name)
    try:
        find_coordinator(dep.name)
        coordinator = True
    except ValueError:
        coordinator = False
    return {k: v for k, v in {
        "engine_processes": engine_processes(), "shm": shm, "listening": listening,
        "store": os.listdir(store) if os.path.isdir(store) else [],
        "coordinator": coordinator}.items() if v}


def kill_then_shut_down(deployment, wait_s: float = 5.0, timeout_s: float = 60.0) -> dict:
    """kill -9 of group-0's Serve replica (its gang restarts), `wait_s`, then `serve shutdown`
    as an operator runs it (Ray stays up): seconds until nothing of the deployment was left
    (`leftovers`), and what was still there at `timeout_s` ("left", empty when clean)."""
    from ray import serve

    other_runs = frozenset(leftovers(deployment).get("shm", []))  # before the kill: not ours
    kill("replica", "group-0")
    time.sleep(wait_s)
    started = time.monotonic()
    serve.shutdown()
    shut_down_s = time.monotonic() - started
    left = leftovers(deployment, other_runs)
    while left and time.monotonic() - started < timeout_s:
        time.sleep(1.0)
        left = leftovers(deployment, other_runs)
    # Unmapped before the kill: another run's, or this deployment's from earlier faults; what
    # of them is still there is reported, not counted (another run's are not ours to remove).
    return {"kind": "kill -9 replica, then serve shutdown", "serve_shutdown_s":
            round(shut_down_s, 1), "clean_after_s": None if left else
            round(time.monotonic() - started, 1), "left": left,
            "unmapped_before_kill": sorted(other_runs),
            "unmapped_before_kill_left": sorted(p for p in other_runs if os.path.exists(p))}

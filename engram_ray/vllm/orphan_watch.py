"""An engine process ends when the process that started it is gone.

vLLM's EngineCore and workers are children (multiprocessing) of the Serve replica and of the
EngineCore. When the replica dies with SIGKILL, or `ray stop --force` kills Ray's workers,
a child can be left running, reparented, holding its GPU memory, table slice, KV cache and
fixed metrics port, so the group's next gang fails vLLM's free-memory check or the bind.
`watch_parent` starts a daemon thread that checks the parent pid every `CHECK_S`: when it
changed, the process sends itself SIGTERM (vLLM shuts down: its shared memory is released)
and, if it is still alive `TERM_GRACE_S` later, SIGKILL.

A poll, not `PR_SET_PDEATHSIG`: that signal follows the parent *thread* that forked the child,
and the replica starts engines from worker threads (a restart in place runs off its event
loop), whose end would kill a healthy engine.

The watch starts with the plugin, and vLLM loads plugins after its engine-core handshake: an
EngineCore whose replica dies during that handshake waits there, orphaned, with no watch (seen
once: a replica killed mid-start). `kill_orphaned_engines` ends such processes; a replica runs
it when it starts and stops (`engram_ray.serve.member.engine_shm.release_leftovers`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time

CHECK_S = 1.0
TERM_GRACE_S = 10.0
_started = False


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(CHECK_S)
    print(f"engram-ray: engine process {os.getpid()} lost its parent {parent_pid}: exiting",
          flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(TERM_GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)


def watch_parent() -> bool:
    """In a multiprocessing child (vLLM's EngineCore, its workers): end with the parent (see
    module doc). Elsewhere (a Ray worker, a CLI): nothing. True when a watch runs."""
    global _started
    parent = multiprocessing.parent_process()
    if _started or parent is None or parent.pid != os.getppid():
        return _started
    _started = True
    threading.Thread(target=_watch, args=(parent.pid,), daemon=True,
                     name="engram-parent-watch").start()
    return True


ENGINE_TITLES = ("VLLM::EngineCore", "VLLM::Worker")  # vLLM's process titles


def kill_orphaned_engines(grace_s: float = 3.0) -> list[int]:
    """End this user's vLLM engine processes whose parent is gone (reparented to init: an
    engine process always has its client as parent): SIGTERM, SIGKILL after `grace_s`.
    Their pids."""
    import psutil

    orphans = []
    for proc in psutil.process_iter(["ppid", "uids", "name", "cmdline"]):
        try:
            title = (proc.info["name"] or "") + " " + " ".join(proc.info["cmdline"] or [])
            if proc.info["ppid"] == 1 and proc.info["uids"].real == os.getuid() \
                    and any(t in title for t in ENGINE_TITLES):
                orphans.append(proc)
        except (psutil.Error, TypeError, AttributeError):
            continue
    for proc in orphans:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(orphans, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    return [proc.pid for proc in orphans]

"""The processes one vLLM engine started below its replica, and their end.

An engine is its EngineCore (a child of the replica) and the workers below it. vLLM's client
learns of a worker's death only once its EngineCore acts on it, and Ray Serve LLM's own stop
leaves the engine running: `EngineProcesses` finds them right after the engine started, so
that the member sees a death at once and none outlives the engine (`end_engine`).
"""

from __future__ import annotations

KILL_WAIT_S = 10.0   # how long the dead engine's leftover processes get to exit after SIGKILL


class EngineProcesses:
    """The processes one engine started (EngineCore and everything below it), found right
    after it started, so that none outlives the engine."""

    def __init__(self, engine_client):
        import psutil

        from engram_ray.serve.member.engine_death import engine_core_processes

        self.procs, self.vital = [], []
        for proc in engine_core_processes(engine_client):
            try:
                core = psutil.Process(proc.pid)
                children = core.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            self.procs += [core, *children]
            self.vital += [core, *(c for c in children if _is_worker(c))]

    def any_exited(self) -> bool:
        """Whether the EngineCore or one of its workers has exited (gone, or a zombie not
        yet reaped). vLLM's client learns of a worker's death only once its EngineCore acts
        on it; the member's engine watch looks here too, so that it is routed around at
        once (requests still sent to it would fail)."""
        import psutil

        for proc in self.vital:
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                return True
        return False

    def kill(self) -> list[int]:
        """SIGKILL every one still alive and wait for them; the pids of those that would not
        go (none, unless a process is stuck in the kernel)."""
        import psutil

        alive = [p for p in self.procs if p.is_running()]
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        _, stuck = psutil.wait_procs(alive, timeout=KILL_WAIT_S)
        return [p.pid for p in stuck]


def _is_worker(proc) -> bool:
    """A vLLM worker process (`VLLM::Worker...`), not a helper that may end on its own."""
    import psutil

    try:
        return "Worker" in proc.name() or "Worker" in " ".join(proc.cmdline()[:1])
    except psutil.Error:
        return False


def end_engine(client, processes: EngineProcesses | None, owner: str | None = None) -> list[int]:
    """vLLM's client shut down (its engine-core process and executor: Ray Serve LLM's own
    shutdown does not), every process of the engine killed and waited for (one still exiting
    would keep its ring buffers mapped), then its ring buffers and what killed replicas left
    on this node released (`engine_shm.release_leftovers`; `owner`: that replica's records
    only). The pids that would not go."""
    from engram_ray.serve.member.engine_shm import release_leftovers

    if client is not None and hasattr(client, "shutdown"):
        client.shutdown()
    stuck = processes.kill() if processes is not None else []
    release_leftovers(owner)
    return stuck


def own_actor():
    """This replica's Ray actor handle (the coordinator pings it), None outside an actor."""
    import ray

    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError:
        return None

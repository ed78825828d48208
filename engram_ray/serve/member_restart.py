"""One member's engine restarted inside its replica, in its generation, while the group serves.

A replica holds its engine's table slices (`engram_ray.tables.slice_holder.SliceHolder`, in
the replica process: it outlives the engine's processes and needs no CUDA context). When the
engine dies (EngineCore or its worker: vLLM's client reports `errored`):

    coordinator.member_restarting   the ingress sends this member no requests; its peers serve
    stop the dead engine            vLLM's client shut down; every process the engine started
                                    killed and waited for (`EngineProcesses`), so none keeps
                                    memory or the fixed metrics port; its ring buffers released
    start a new engine              same settings: same generation, rank and store; the model
                                    process finds its holder full and re-attaches every slice
                                    (no checkpoint read, no rendezvous, digests checked)
    coordinator.member_ready        requests again; `engram_engine_restarts` counts it

A member of a data-parallel gang (`serving.data_parallel_size` > 1: its engines form one
vLLM DP group, which cannot lose a rank) restarts with its gang: the coordinator marks every
member of the gang restarting (`member_restarting` returns the restart's number), the others
learn it at their next `member_check` and stop their engines too, and the gang's engines
form a new DP group on a fresh master port (`_meet_dp_gang`). The group's other DP gangs
serve throughout.

A member whose holder holds nothing (FABRIC-only slices) or whose restart fails or does not
serve within `serving.rollout.in_place_timeout_s` is reported lost: its generation breaks,
Serve restarts the whole gang and a new generation starts, as when a replica, its GPU or its
node is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time

logger = logging.getLogger("ray.serve")
KILL_WAIT_S = 10.0   # how long the dead engine's leftover processes get to exit after SIGKILL


class EngineProcesses:
    """The processes one engine started (EngineCore and everything below it), found right
    after it started, so that none outlives the engine."""

    def __init__(self, engine_client):
        import psutil

        from engram_ray.serve.engine_death import engine_core_processes

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
        on it; the replica's watch looks here too, so that its member is routed around at
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
    from engram_ray.serve.engine_shm import release_leftovers

    if client is not None and hasattr(client, "shutdown"):
        client.shutdown()
    stuck = processes.kill() if processes is not None else []
    release_leftovers(owner)
    return stuck


class MemberRestartMixin:
    """The restart in place of `EngramServerMixin` (module doc)."""

    _restarting = False
    _restart_error: str | None = None
    _failed_checks = 0  # health checks failed in a row while the engine lives (replica.py)
    _restart_reason: str | None = None  # why its engine restarts now (None: it does not)
    _restart_since: float | None = None
    _dp_epoch = 0  # restarts in place of its data-parallel gang so far (`member_restarting`)

    def _note_restarting(self, reason: str | None) -> None:
        self._restart_reason, self._restart_since = reason, time.time()

    def can_restart_in_place(self) -> bool:
        holder = getattr(self, "_holder", None)
        return holder is not None and holder.is_full

    async def _engine_started(self) -> None:
        """What follows every engine start, the first and each restart: its processes noted,
        KV-cache capacity and stat logger, the model process's metrics target, its ring
        buffers recorded."""
        from engram_ray.serve.engine_shm import record_segments

        self._engine_processes = EngineProcesses(
            getattr(getattr(self, "engine", None), "_engine_client", None))
        await self._attach_stat_logger()
        await self._register_model_process_target()
        await asyncio.to_thread(record_segments, self._replica_id)
        self._segments_recorded_at = time.monotonic()

    async def _on_engine_death(self) -> None:
        """The engine died while serving: restart it in place (with its data-parallel gang),
        or report the member lost (its health checks fail from then on, so Serve restarts
        the gang)."""
        roll = getattr(self, "_roll_task", None)
        if self._restarting or (roll is not None and not roll.done()):
            return  # a roll or its DP gang's restart stopped it: that restart goes on
        death = self._engine_death("while serving")
        await self._restart_in_place(death.line() if death is not None else "engine died")

    def _on_gang_restart(self, epoch: int) -> None:
        """`member_check` said this member's data-parallel gang restarts in place (restart
        `epoch`: another member's engine died): its own engine, alive or not, restarts too."""
        roll = getattr(self, "_roll_task", None)
        if epoch <= self._dp_epoch or self._restarting or self._restart_error is not None \
                or (roll is not None and not roll.done()):
            return
        self._restarting = True  # from now: its death watch leaves the engine to this restart
        self._stop_watching_engine()
        self._gang_restart_task = asyncio.get_running_loop().create_task(
            self._restart_in_place(f"its data-parallel gang restarts (restart {epoch})", epoch))

    async def _restart_in_place(self, reason: str, epoch: int | None = None) -> None:
        """Restart the engine in its generation (`epoch`: the restart's number, when the
        coordinator gave it already), or lose the member."""
        self._restarting = True  # health checks pass while this decides and restarts
        try:
            if epoch is None:
                epoch = await self._may_restart(reason)
                if not epoch:  # None (or False from a coordinator of an older release)
                    await self._lose(reason)
                    return
            self._dp_epoch = epoch
            started, a = time.monotonic(), self._assignment
            self._note_restarting(reason)
            self.engram_metrics.set_group(a["generation_index"], False)
            deadline_s = self._app.serving.rollout.in_place_timeout_s
            try:  # a restart that hangs is given up: the member is lost, the gang restarts
                phases = await asyncio.wait_for(self._restart_engine(str(epoch)), deadline_s)
            except asyncio.CancelledError:  # the replica is shutting down
                raise
            except BaseException as exc:  # noqa: BLE001 - the member is lost; Serve takes over
                await self._lose(f"engine of {a['group_id']}-r{a['member_rank']} could not "
                                 f"restart in place: {restart_failure(exc, deadline_s)}")
                return
        finally:
            self._restarting = False
            self._note_restarting(None)
        self._death = None
        self.engram_metrics.count_engine_restart()
        self.engram_metrics.set_group(a["generation_index"], True)
        await self._coordinator.member_ready.remote(self._replica_id, own_actor(),
                                                    self._config_version)
        logger.warning("engram-ray: engine %s-r%d restarted in place in %.1f s (generation %s, "
                       "its slices re-attached, not reloaded; %s)", a["group_id"],
                       a["member_rank"], time.monotonic() - started, a["generation"],
                       ", ".join(f"{name} {s:.1f} s" for name, s in phases.items()))
        self._engine_watch_task = asyncio.get_running_loop().create_task(self._watch_engine())

    async def _may_restart(self, reason: str) -> int | None:
        """The restart's number when this member can re-attach its slices and the
        coordinator lets it restart inside its generation (not when the generation broke
        meanwhile); None otherwise."""
        if not self.can_restart_in_place():
            return None
        try:
            return await self._coordinator.member_restarting.remote(self._replica_id, reason)
        except Exception as exc:  # noqa: BLE001 - no coordinator: no restart in place
            logger.error("engram-ray: the coordinator could not be told of the restart: %s", exc)
            return None

    async def _lose(self, reason: str) -> None:
        """This member is lost: its health checks fail with `reason` from now on (Serve
        restarts the group's gang) and its generation is reported broken."""
        self._restart_error = reason
        logger.error("engram-ray: %s", reason)
        await self._report_broken(reason)

    async def _restart_engine(self, dp_round: str = "") -> dict[str, float]:
        """Stop the engine (dead or not) and start a new one; seconds per step. A member of a
        data-parallel gang meets its gang's other members for a new DP group first
        (`dp_round` names this restart: every member of the gang passes the same)."""
        from engram_ray.serve.engine_death import EngineWatch
        from engram_ray.serve.engine_shm import recording_segments

        phases, since = {}, time.monotonic()

        def step(name):
            nonlocal since
            now = time.monotonic()
            phases[name], since = now - since, now

        await self._stop_engine()
        step("reap")
        await self._meet_dp_gang(dp_round)
        self._declare_held_slices()
        watch = self._engine_watch
        self._engine_watch = EngineWatch(watch.engine, watch.replica_id, watch.folder)
        with recording_segments(self._replica_id):  # a death while starting too
            self.engine = await _engine_started_off_the_loop(self._engine_cls,
                                                             self._llm_config, step)
            try:
                await self._start_engine()
                await self._engine_started()
            except BaseException:
                # Nothing of a half-started engine may keep memory or the metrics port.
                self._engine_processes = EngineProcesses(getattr(self.engine,
                                                                 "_engine_client", None))
                await self._stop_engine()
                raise
        step("serving")
        if getattr(self, "dp_size", 1) > 1 and self.dp_rank == 0:
            from engram_ray.serve.dp_gang import forget_dp_round
            # Every rank has read them: the gang's DP group formed.
            await asyncio.to_thread(forget_dp_round, f"{self.gang_id}@{dp_round}",
                                    self.dp_size)
        return phases

    async def _meet_dp_gang(self, dp_round: str) -> None:
        """A data-parallel gang's engines form a new vLLM DP group at every restart in
        place: DP rank 0 registers a fresh master address and port under the gang's id and
        `dp_round` (Ray Serve LLM's `GangMasterInfoRegistry`, as at the first start), the
        other ranks wait for it."""
        if getattr(self, "dp_size", 1) == 1:
            return
        from engram_ray.serve.dp_gang import meet_dp_master

        address, port = await meet_dp_master(f"{self.gang_id}@{dp_round}", self.dp_rank,
                                              self._app.serving.rollout.in_place_timeout_s)
        self._own_kwargs.update(data_parallel_address=address, data_parallel_rpc_port=port)
        self._set_engine_kwargs(self._app)

    def _declare_held_slices(self) -> None:
        """The new engine loads through `engram_held`, which tells vLLM's memory check what
        the holder keeps allocated (device bytes: 0 with the shm backend), so that it starts
        with the budget and KV cache of the first start (`engram_ray.vllm.held_memory`)."""
        from engram_ray.vllm.held_memory import held_load_kwargs

        held = self._holder.held_bytes if self._app.deployment.table_backend == "cuda" else 0
        self._llm_config.update_engine_kwargs(**held_load_kwargs(
            self._llm_config.engine_kwargs, held))

    async def _stop_engine(self) -> None:
        """The engine ended (`end_engine`) before it starts again in place."""
        stuck = await asyncio.to_thread(end_engine, getattr(self.engine, "_engine_client", None),
                                        self._engine_processes, self._replica_id)
        if stuck:
            raise RuntimeError(f"processes {stuck} of the engine did not exit")


async def _engine_started_off_the_loop(engine_cls, llm_config, step=lambda _name: None):
    """A new Ray Serve LLM engine whose vLLM engine config and `AsyncLLM` (engine processes
    spawned, model loaded: a minute and more on a busy CPU node) are made in a thread, so that
    `start()` on the event loop only picks them up.

    NOTES: `VLLMEngine.start` makes both synchronously on the replica's event loop, which
    also answers Serve's health checks; blocked for longer than three health-check timeouts,
    the replica would be taken for dead and its whole gang restarted. `AsyncLLM` may be made
    outside a running loop (its tasks start on first use); the two methods are VLLMEngine's
    own steps, given back their results."""
    engine = engine_cls(llm_config)
    ctx = llm_config.get_or_create_callback().ctx
    # The model's files are on this node since the first start: no download tasks again
    # (Ray Serve LLM's own switch for it).
    ctx.run_init_node = False
    prepare = getattr(engine, "_prepare_engine_config", None)
    start_llm = getattr(engine, "_start_async_llm_engine", None)
    if prepare is None or start_llm is None:
        return engine  # another engine class: it starts on the loop
    prepared = await asyncio.to_thread(prepare, ctx)
    step("vllm config")
    engine_args, _, engine_config = prepared
    client = await asyncio.to_thread(start_llm, engine_args, engine_config,
                                     ctx.placement_group)
    step("engine start")
    engine._prepare_engine_config = lambda _ctx: prepared
    engine._start_async_llm_engine = lambda *_args: client
    return engine


def own_actor():
    """This replica's Ray actor handle (the coordinator pings it), None outside an actor."""
    import ray

    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError:
        return None


def restart_failure(exc: BaseException, timeout_s: float) -> str:
    """One line: the error's own lines, without pydantic's "For further information" links."""
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return f"not serving after serving.rollout.in_place_timeout_s ({timeout_s:g} s)"
    lines = [line.strip() for line in str(exc).splitlines()
             if line.strip() and not line.strip().startswith("For further information")]
    return f"{type(exc).__name__}: {' '.join(lines)}"[:400]

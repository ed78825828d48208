"""A member's vLLM engine inside its replica: its arguments, what follows its every start, the
watch on its death, and its stop and start again in place.

Ray Serve LLM owns the engine (`server.engine`, made from `server._llm_config`); this part sets
the arguments it starts with (the app's, plus the replica's own: DP rank and master, peer-group
settings, the KV-cache probe), notes its processes once started (`EngineProcesses`), and
watches them: a death goes to the member's restart (`restart.InPlaceRestart`). A restart in
place stops every process of the old engine, forms a new DP group with the other ranks of its
data-parallel gang (`dp_gang`), tells vLLM's memory check what the slice holder keeps, and
starts a new engine off the replica's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time

from engram_ray.serve.member.engine_death import EngineWatch
from engram_ray.serve.member.engine_shm import record_segments, recording_segments
from engram_ray.serve.member.processes import EngineProcesses, end_engine

ENGINE_WATCH_PERIOD_S = 0.1  # how often a member looks whether its engine is still alive
# The engine's shared-memory segments are recorded again at a health check this often (some
# exist only once it serves; engram_ray.serve.member.engine_shm).
RECORD_SEGMENTS_EVERY_S = 10.0
logger = logging.getLogger("ray.serve")


class MemberEngine:
    """The engine of `server` (an `EngramServerMixin` over Ray Serve LLM's server class)."""

    def __init__(self, server):
        self.server = server
        self.own_kwargs: dict = {}          # engine arguments its server class set (DP rank)
        self.additional: dict = {}          # additional_config keys the member adds
        self.processes: EngineProcesses | None = None
        self.watch: EngineWatch | None = None   # its deaths, explained and recorded
        self.death = None                   # the death found (one report per death)
        self._watch_task: asyncio.Task | None = None
        self._segments_recorded_at: float | None = None  # None: not started yet

    @property
    def client(self):
        """vLLM's `AsyncLLM` of the engine, None before it started."""
        return getattr(getattr(self.server, "engine", None), "_engine_client", None)

    def set_kwargs(self, app) -> None:
        """The engine arguments of `app` (`engram_ray.serve.settings.engine_args.engine_kwargs`, the
        model's architecture read on this node) plus the member's own, in its `LLMConfig` and
        its cached engine config alike (Ray Serve LLM caches a copy; a key the new settings
        drop must go from both); `app` becomes the member's app config."""
        from engram_ray.serve.settings.engine_args import engine_kwargs
        from engram_ray.serve.member.kv_cache import probe_engine_kwargs

        llm_config = self.server._llm_config
        kwargs = {**engine_kwargs(app, on_engine_node=True), **self.own_kwargs}
        kwargs["additional_config"] = {**(kwargs.get("additional_config") or {}),
                                       **self.additional}
        kwargs.update(probe_engine_kwargs(kwargs))
        llm_config.engine_kwargs.clear()
        llm_config.engine_kwargs.update(kwargs)
        cached = llm_config._engine_config
        if cached is not None:  # split into engine and frontend arguments as Ray Serve LLM does
            fresh = type(cached).from_llm_config(llm_config)
            for name in ("engine_kwargs", "frontend_kwargs"):
                getattr(cached, name).clear()
                getattr(cached, name).update(getattr(fresh, name))
        self.server._app = app

    async def started(self) -> None:
        """What follows every engine start, the first and each restart: its processes noted,
        KV-cache capacity and stat logger, the model process's metrics target, its ring
        buffers recorded."""
        self.processes = EngineProcesses(self.client)
        await self.server._attach_stat_logger()
        await self.server._register_model_process_target()
        await asyncio.to_thread(record_segments, self.server._replica_id)
        self._segments_recorded_at = time.monotonic()

    async def record_segments_if_due(self) -> None:
        """At a health check: its ring buffers recorded again every `RECORD_SEGMENTS_EVERY_S`."""
        if self._segments_recorded_at is not None and \
                time.monotonic() - self._segments_recorded_at >= RECORD_SEGMENTS_EVERY_S:
            self._segments_recorded_at = time.monotonic()
            await asyncio.to_thread(record_segments, self.server._replica_id)

    def find_death(self, phase: str):
        """The engine's death (`engine_death.EngineDeath`) if its processes or log show one;
        logged and recorded for `engram-ray local` (once per death)."""
        if self.watch is None:  # failed before its engine started
            return None
        if self.death is None:
            self.death = self.watch.find(phase, self.client)
            if self.death is not None:
                logger.error("engram-ray: %s", self.death.line())
                self.watch.report(self.death)
        return self.death

    def start_watching(self) -> None:
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    def stop_watching(self) -> None:
        """The engine stops on purpose: its death watch must not restart it."""
        if self.is_watched():
            self._watch_task.cancel()

    def is_watched(self) -> bool:
        return self._watch_task is not None and not self._watch_task.done()

    async def _watch(self) -> None:
        """Act on the engine's death the moment vLLM's client knows it (`AsyncLLM.errored`:
        its engine-core process is gone) or one of its processes is seen gone (a worker: its
        EngineCore may take seconds to give up): the member's restart decides what follows."""
        client = self.client
        if client is None or not hasattr(client, "errored"):
            return
        while not client.errored and not (self.processes is not None
                                          and self.processes.any_exited()):
            await asyncio.sleep(ENGINE_WATCH_PERIOD_S)
        await self.server._restarts.on_engine_death()

    async def stop(self) -> None:
        """Every process of the engine ended (`end_engine`) before it starts again in place."""
        stuck = await asyncio.to_thread(end_engine, self.client, self.processes,
                                        self.server._replica_id)
        if stuck:
            raise RuntimeError(f"processes {stuck} of the engine did not exit")

    async def restart(self, dp_round: str = "") -> dict[str, float]:
        """Stop the engine (dead or not) and start a new one; seconds per step. A member of a
        data-parallel gang meets its gang's other members for a new DP group first
        (`dp_round` names this restart: every member of the gang passes the same)."""
        server, phases, since = self.server, {}, time.monotonic()

        def step(name):
            nonlocal since
            now = time.monotonic()
            phases[name], since = now - since, now

        await self.stop()
        step("reap")
        await self._meet_dp_gang(dp_round)
        self._declare_held_slices()
        self.watch, self.death = EngineWatch(self.watch.engine, self.watch.replica_id,
                                             self.watch.folder), None
        with recording_segments(server._replica_id):  # a death while starting too
            server.engine = await _start_off_the_loop(server._engine_cls, server._llm_config,
                                                      step)
            try:
                await server._start_engine()
                await self.started()
            except BaseException:
                # Nothing of a half-started engine may keep memory or the metrics port.
                self.processes = EngineProcesses(self.client)
                await self.stop()
                raise
        step("serving")
        if getattr(server, "dp_size", 1) > 1 and server.dp_rank == 0:
            from engram_ray.serve.member.dp_gang import forget_dp_round
            # Every rank has read them: the gang's DP group formed.
            await asyncio.to_thread(forget_dp_round, f"{server.gang_id}@{dp_round}",
                                    server.dp_size)
        return phases

    async def _meet_dp_gang(self, dp_round: str) -> None:
        """A data-parallel gang's engines form a new vLLM DP group at every restart in
        place: DP rank 0 registers a fresh master address and port under the gang's id and
        `dp_round` (as at the first start), the other ranks wait for it."""
        server = self.server
        if getattr(server, "dp_size", 1) == 1:
            return
        from engram_ray.serve.member.dp_gang import meet_dp_master

        from engram_ray.serve.member.link import current_rollout

        address, port = await meet_dp_master(f"{server.gang_id}@{dp_round}", server.dp_rank,
                                              current_rollout(server).in_place_timeout_s)
        self.own_kwargs.update(data_parallel_address=address, data_parallel_rpc_port=port)
        self.set_kwargs(server._app)

    def _declare_held_slices(self) -> None:
        """The new engine loads through `engram_held`, which tells vLLM's memory check what
        the holder keeps allocated (device bytes: 0 with the shm backend), so that it starts
        with the budget and KV cache of the first start (`engram_ray.vllm.held_memory`)."""
        from engram_ray.vllm.held_memory import held_load_kwargs

        server = self.server
        held = server._holder.held_bytes if server._app.deployment.table_backend == "cuda" else 0
        server._llm_config.update_engine_kwargs(**held_load_kwargs(
            server._llm_config.engine_kwargs, held))


async def _start_off_the_loop(engine_cls, llm_config, step=lambda _name: None):
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
    client = await _cancellable(start_llm, engine_args, engine_config, ctx.placement_group)
    step("engine start")
    engine._prepare_engine_config = lambda _ctx: prepared
    engine._start_async_llm_engine = lambda *_args: client
    return engine


async def _cancellable(start, *args):
    """`start(*args)` (it makes `AsyncLLM`: spawns the engine's processes and waits for them
    to load) in a thread. Cancelled (the restart's deadline, the replica's stop), it does not
    return before what it started is gone: the processes spawned since it began killed (the
    thread's `AsyncLLM` then fails its handshake and the thread ends), the thread waited for,
    and an engine it made all the same ended, so that no rollback or next start meets its
    memory, its ports or its ring buffers.

    NOTES: cancelling `asyncio.to_thread` cancels the await, not the thread: before this, a
    start past `in_place_timeout_s` kept loading while the rollback started the old settings
    beside it, which then failed vLLM's memory check or the metrics port's bind."""
    import psutil

    own = psutil.Process()
    before = {p.pid for p in own.children(recursive=True)}
    future = asyncio.get_running_loop().run_in_executor(None, start, *args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.shield(_abandon(future, own, before))
        raise


async def _abandon(future, own, before: set[int]) -> None:
    """The processes of a cancelled start (module's `_cancellable`) killed and reaped, its
    thread waited for (up to `KILL_WAIT_S` after the last kill), a client it made ended."""
    import psutil

    from engram_ray.serve.member.processes import KILL_WAIT_S

    deadline = time.monotonic() + KILL_WAIT_S
    while not future.done() and time.monotonic() < deadline:
        spawned = [p for p in own.children(recursive=True) if p.pid not in before]
        for proc in spawned:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(spawned, timeout=1.0)
        if spawned:
            deadline = time.monotonic() + KILL_WAIT_S
        await asyncio.sleep(0.1)
    if not future.done():
        logger.error("engram-ray: a cancelled engine start did not end within %.0f s of its "
                     "processes' kill", KILL_WAIT_S)
        return
    client = None if future.cancelled() or future.exception() else future.result()
    if client is not None:
        await asyncio.to_thread(end_engine, client, EngineProcesses(client))
    logger.warning("engram-ray: a cancelled engine start was stopped: its processes killed "
                   "and reaped")

"""Members of a peer group with a stand-in engine: the real member parts
(`engram_ray.serve.member`: `CoordinatorLink`, `SettingsRoll`, `InPlaceRestart`,
`MemberRequests`) over an engine that is a few coroutines, so that 72 members (9 groups of 8,
DEP2) run against the real coordinator on a 2-core machine (the chaos harness,
`support.chaos`). No Serve and no vLLM: `MemberHost` (one Ray actor per gang, as a gang's
replicas die together when its node goes) does what `EngramServerMixin.start` and Serve do
around the parts, and records what happened for the harness's invariants.

The stand-in engine starts in `start_s`; its data-parallel group forms only when every rank
of its DP gang starts the same round (`dp_barrier` on `<gang>@<round>/start`, as vLLM's DP
master is keyed by round: ranks on two rounds wait until `in_place_timeout_s`); settings with
`max_model_len % 1000 == 999` do not start (a will-not-start deploy); it can be killed (its
death watch restarts it in place) or made to hang at its next start.
"""

from __future__ import annotations

import asyncio
import os
import time

import ray

from engram_ray.serve.member.engine import MemberEngine

WILL_NOT_START = 999  # max_model_len % 1000 of settings the stand-in engine refuses


class _Death:
    def __init__(self, why: str):
        self.why = why

    def line(self) -> str:
        return f"stand-in engine {self.why}"


class _Metrics:
    """The member's metrics calls, counted (no endpoint)."""

    def __init__(self):
        self.restarts = 0

    def count_engine_restart(self):
        self.restarts += 1

    def set_group(self, *args, **kwargs):
        pass

    def set_restarting(self, is_restarting: bool):
        pass


class _Holder:
    is_full, held_bytes = True, 0


class StandInEngine(MemberEngine):
    """`MemberEngine` with the vLLM engine replaced: its death watch (start, stop) is the
    real one; start, restart, death and settings are the stand-in's."""

    def __init__(self, member: "StandInMember", start_s: float):
        super().__init__(member)
        self.member, self.start_s = member, start_s
        self.alive, self.hang_next = False, False

    def set_kwargs(self, app) -> None:
        self.member._app = app

    async def start(self, dp_round: str) -> None:
        from engram_ray.serve.member.dp_gang import _barrier_key, dp_barrier

        m = self.member
        if self.hang_next:
            self.hang_next = False
            m.host.record("hang", m)
            await asyncio.sleep(3600)
        if m._app.serving.max_model_len % 1000 == WILL_NOT_START:
            raise RuntimeError("stand-in engine: will not start with these settings")
        if m.dp_size > 1:
            key = f"{m.gang_id}@{dp_round}/start"
            if not await dp_barrier(key, m.dp_rank, m.dp_size,
                                    m._app.serving.rollout.in_place_timeout_s):
                raise TimeoutError(f"DP group {key}: not every rank came")
            if m.dp_rank == 0:
                await asyncio.sleep(0.5)  # the other ranks have seen every key
                from ray.experimental.internal_kv import _internal_kv_del
                for rank in range(m.dp_size):
                    _internal_kv_del(_barrier_key(key, rank))
        await asyncio.sleep(self.start_s)
        self.alive, self.death = True, None

    async def restart(self, dp_round: str = "") -> dict[str, float]:
        started = time.monotonic()
        self.alive = False
        await self.start(dp_round)
        return {"start": time.monotonic() - started}

    def kill(self) -> None:
        if self.alive:
            self.alive, self.death = False, _Death("killed")

    def find_death(self, phase: str):
        return self.death

    async def _watch(self) -> None:
        while self.alive:
            await asyncio.sleep(0.05)
        await self.member._restarts.on_engine_death()


class StandInMember:
    """The attributes of `EngramServerMixin` the member's parts read."""

    def __init__(self, host: "MemberHost", coordinator, group_id: str, gang_id: str,
                 rank: int, size: int, dp_size: int, start_s: float):
        from engram_ray.serve.member.link import CoordinatorLink
        from engram_ray.serve.member.requests import MemberRequests
        from engram_ray.serve.member.restart import InPlaceRestart
        from engram_ray.serve.member.roll import SettingsRoll

        self.host, self._coordinator = host, coordinator
        self.group_id, self.rank, self.size = group_id, rank, size
        self._replica_id = f"{gang_id}-r{rank}"
        self.dp_size, self.dp_rank = dp_size, rank % dp_size
        from engram_ray.serve.member.dp_gang import dp_gang_id

        self.gang_id = dp_gang_id(gang_id, rank // dp_size)
        self._replica_labels, self._node_id, self._metrics_slot = {}, "node-standin", rank
        self._holder, self.engram_metrics = _Holder(), _Metrics()
        self._assignment, self._app = None, None
        self._requests, self._member_engine = MemberRequests(), StandInEngine(self, start_s)
        self._link, self._restarts = CoordinatorLink(self), InPlaceRestart(self)
        self._roll = SettingsRoll(self)
        note = self._restarts.note

        def noted(reason):  # what the harness's invariants read
            host.record("restarting" if reason else "serving", self, reason=reason,
                        version=self._roll.version)
            note(reason)
        self._restarts.note = noted

    async def start(self, group_gang: str) -> None:
        """`EngramServerMixin.start` with the stand-in engine."""
        from engram_ray.serve.member.processes import own_actor
        from engram_ray.serve.settings.config import ServeAppConfig

        coordinator = self._coordinator
        self._assignment = await coordinator.join.remote(
            self.group_id, group_gang, self.rank, self.size, self._replica_id, {})
        self.host.record("joined", self, generation=self._assignment["generation"],
                         gang=group_gang)
        self._link.start()
        _, settings = await coordinator.member_settings.remote()
        self._app = ServeAppConfig.from_dict(settings, "replica")
        await self._roll.take_settings()
        await self._member_engine.start("first")
        self._link.ready_at = time.time()
        await coordinator.member_ready.remote(self._replica_id, own_actor(), self._roll.version)
        self._member_engine.start_watching()
        self._link.start_returned = True
        self._link.tell_running()
        self.host.record("serving", self, version=self._roll.version)

    async def _report_broken(self, reason: str) -> None:
        self._link.lost_reason = reason
        self.host.record("lost", self, reason=reason)
        await self._coordinator.report_broken.remote(self._replica_id, reason)

    async def leave(self) -> None:
        """Serve stops this replica (`EngramServerMixin._leave`)."""
        self._link.stop()
        self._member_engine.stop_watching()
        await self._coordinator.leave.remote(self._replica_id)


@ray.remote(num_cpus=0, max_restarts=0)
class MemberHost:
    """One gang's members (a peer group's 8 replicas) in one process."""

    def __init__(self, deployment_name: str):
        from engram_ray.actors.coordinator_lookup import find_coordinator

        self.coordinator = find_coordinator(deployment_name)
        self.members: list[StandInMember] = []
        self.events: list[dict] = []
        self.folder_checks = asyncio.get_running_loop().create_task(self._check_folders())

    def record(self, kind: str, member: StandInMember, **fields) -> None:
        self.events.append({"t": time.time(), "kind": kind, "group": member.group_id,
                            "replica": member._replica_id, "dp_gang": member.gang_id,
                            **fields})

    async def start(self, group_id: str, gang_id: str, size: int, dp_size: int,
                    start_s: float) -> str | None:
        """Start the gang's members; None once all serve, else why one failed."""
        self.members = [StandInMember(self, self.coordinator, group_id, gang_id, rank, size,
                                      dp_size, start_s) for rank in range(size)]
        results = await asyncio.gather(*(m.start(gang_id) for m in self.members),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        return f"{type(failed[0]).__name__}: {failed[0]}" if failed else None

    async def kill_engine(self, rank: int) -> None:
        self.members[rank]._member_engine.kill()

    async def hang_next_start(self, rank: int) -> None:
        self.members[rank]._member_engine.hang_next = True

    async def lost(self) -> list[str]:
        """Why members are lost (their health checks fail: Serve restarts the gang)."""
        return [m._restarts.error for m in self.members if m._restarts.error is not None]

    async def state(self) -> list[dict]:
        return [{"replica": m._replica_id, "version": m._roll.version,
                 "restarting": m._restarts.reason, "error": m._restarts.error,
                 "store_dir": m._assignment and m._assignment["store_dir"]}
                for m in self.members]

    async def stop(self) -> None:
        """Serve stops the gang: every member leaves."""
        await asyncio.gather(*(m.leave() for m in self.members), return_exceptions=True)

    async def take_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events

    async def _check_folders(self) -> None:
        """A live member's store folder must never go (`folder_removed` events)."""
        while True:
            await asyncio.sleep(0.5)
            for m in self.members:
                a = m._assignment
                if a and m._restarts.error is None and not os.path.isdir(a["store_dir"]):
                    self.record("folder_removed", m, store_dir=a["store_dir"])

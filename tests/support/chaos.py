"""A chaos harness at the shipped shape: the real coordinator (`actors/coordinator.py`, made
and reconfigured by `get_coordinator`, the function `serve deploy`'s build calls), the real
member parts over stand-in engines (`support.standin_member`: 9 groups of 8 members, DEP2, one
process per gang) and the real ingress routing (`GroupRouting`, 32 of them long-polling), under
random schedules of faults, with invariants checked throughout.

What stands in for Serve: a gang whose process was killed, or one of whose members is lost
(its health checks would fail), is stopped and started again with a new gang id, as
RESTART_GANG does. What is not here: Serve's replicas, HTTP requests through the ingress (the
real engine's end-to-end tests in tests/cpu/local keep those), `beside` rolls (they need Serve
to start a gang beside another).

A schedule (from its seed, which replays it): faults at random instants over `duration_s`:
in-place deploys (a new `max_model_len`), a deploy whose settings will not start, a deploy
refused (a fixed setting changed), a deploy back to good settings, engine kills, a hung start
(the member's next start never ends), a gang's process killed, and the coordinator killed.
Then quiet: the roll must end (every member on the target settings, or the roll stopped with
its reason) and every group serve. Invariants (`check`), each a line in `violations`:

    never two DP gangs of one group restarting for a roll at once
    never more than `max_groups_at_once` groups with a member restarting for a roll
    as many turns as DP gangs: none restarts twice for the same settings
    a roll stopped for settings v gives no turn for v after its stop
    one generation per gang; a gang restarted only by the harness (a kill or a lost member)
    a member lost only where a fault was put (a hung start in its DP gang)
    no folder of a live gang removed
    after quiet: the roll ended and every group serves; after stop: no store folder, no DP
    barrier key of the deployment left in Ray's KV store
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from support.standin_member import WILL_NOT_START, MemberHost

CONFIGS = Path(__file__).resolve().parents[2] / "cluster_configs"
EVENTS = ("deploy", "will_not_start", "refused", "engine_kill", "hang", "replica_kill",
          "coordinator_kill")


@dataclass
class Shape:
    num_groups: int = 9
    group_size: int = 8
    dp_size: int = 2
    num_ingress: int = 32
    max_groups_at_once: int = 3
    start_s: float = 0.3          # a stand-in engine's start
    in_place_timeout_s: float = 15.0


def app_config(name: str, store: str, shape: Shape, max_model_len: int = 512) -> dict:
    from engram_ray.serve.deploy.cluster_configs import load_serve_config

    raw = next(iter(load_serve_config(CONFIGS / "serve_local_tiny.yaml").values())).to_dict()
    raw["deployment"].update(name=name, peer_group_store=store, model="deepseek-v4.1-flash",
                             peer_group_size=shape.group_size)
    raw["serving"].update(num_peer_groups=shape.num_groups, max_model_len=max_model_len,
                          data_parallel_size=shape.dp_size,
                          prometheus_targets_file=os.path.join(os.path.dirname(store),
                                                               "targets.json"))
    raw["serving"]["rollout"] = {"mode": "in_place", "drain_timeout_s": 2.0,
                                 "max_groups_at_once": shape.max_groups_at_once,
                                 "in_place_timeout_s": shape.in_place_timeout_s}
    return raw


def schedule(seed: int, duration_s: float) -> list[tuple[float, str, int, int]]:
    """(seconds from start, event, group, rank) in time order."""
    rng = random.Random(seed)
    events = []
    for _ in range(rng.randint(3, 8)):
        events.append((round(rng.uniform(0, duration_s), 2), rng.choice(EVENTS),
                       rng.randrange(1 << 16), rng.randrange(1 << 16)))
    return sorted(events)


class _RecordedCoordinator:
    """The coordinator's handle as one ingress poll sees it: each routing answer's version
    and when it arrived, kept per poll."""

    def __init__(self, handle, seen: list):
        self._handle, self._seen = handle, seen

    @property
    def routing(self):
        return self

    def remote(self, version: int, timeout_s: float):
        return self._routing(version, timeout_s)

    async def _routing(self, version: int, timeout_s: float):
        answer = await self._handle.routing.remote(version, timeout_s)
        self._seen.append((answer[0], time.time()))
        return answer


@ray.remote(num_cpus=0)
class Ingress:
    """`num` real `GroupRouting` long polls (the ingress replicas' view of the routing) of
    the deployment `watch` names, and a probe timing `member_check` as members send it. Made
    once (its imports take tens of seconds on 2 busy cores), told each schedule's deployment."""

    def __init__(self, num: int):
        import contextvars

        from engram_ray.actors import coordinator_lookup
        from engram_ray.serve.edge.ingress import GroupRouting

        self.num, self.routing_cls, self.find = num, GroupRouting, coordinator_lookup.find_coordinator
        self.poller = contextvars.ContextVar("poller")  # which poll asks (its task's context)
        coordinator_lookup.find_coordinator = lambda name: _RecordedCoordinator(
            self.find(name), self.seen[self.poller.get()])
        self.routings, self.tasks = [], []

    async def watch(self, deployment_name: str) -> None:
        for task in self.tasks:
            task.cancel()
        self.seen: list[list] = [[] for _ in range(self.num)]
        self.check_ms: list[float] = []
        self.routings = [self.routing_cls(deployment_name) for _ in range(self.num)]
        for index, routing in enumerate(self.routings):
            self.poller.set(index)  # the poll's task takes this context
            routing.ensure_started()
        self.tasks = [r._task for r in self.routings]
        self.coordinator = self.find(deployment_name)
        self.tasks.append(asyncio.get_running_loop().create_task(self._probe()))

    async def _probe(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            started = time.perf_counter()
            try:
                await self.coordinator.member_check.options(max_task_retries=0).remote()
                self.check_ms.append((time.time(), (time.perf_counter() - started) * 1e3))
            except Exception:  # noqa: BLE001 - the coordinator restarting
                pass

    async def figures(self, since: float) -> dict:
        """`check_ms`: (when, member_check round trip) since `since`; `lag_s`: per routing
        version first seen after `since`, how long after the first ingress the last one had
        it (or a newer one)."""
        lags = []
        versions = sorted({v for seen in self.seen for v, t in seen if t > since})
        for version in versions:
            firsts = [min((t for v, t in seen if v >= version), default=None)
                      for seen in self.seen]
            firsts = [t for t in firsts if t is not None]
            if len(firsts) == len(self.seen):
                lags.append(max(firsts) - min(firsts))
        return {"check_ms": [c for c in self.check_ms if c[0] > since], "lag_s": lags}


@dataclass
class Run:
    """One schedule's run (`run_schedule`)."""

    seed: int
    shape: Shape
    name: str
    store: str
    events: list = field(default_factory=list)       # every member's events (hosts)
    harness: list = field(default_factory=list)      # what the harness did: (t, what, ...)
    stops: dict = field(default_factory=dict)        # settings version -> when seen stopped
    violations: list = field(default_factory=list)
    figures: dict = field(default_factory=dict)


class Harness:
    """The schedule's driver and Serve's stand-in for one deployment (`run_schedule`)."""

    def __init__(self, run: Run):
        from engram_ray.serve.settings.config_change import config_version

        self.run, self.shape = run, run.shape
        self.good = app_config(run.name, run.store, self.shape)
        self.config = self.good
        self.domains = {f"group-{g}": f"domain-{g}" for g in range(self.shape.num_groups)}
        self.hosts: dict[str, object] = {}
        self.gangs = 0
        self.version_of = config_version

    def note(self, *what) -> None:
        self.run.harness.append((time.time(), *what))

    def deploy(self, config: dict) -> str | None:
        """What `serve deploy`'s build does with the coordinator; the refusal, if any."""
        from engram_ray.actors.coordinator_lookup import get_coordinator
        from engram_ray.errors import EngramRayError

        try:
            self.coordinator = get_coordinator(config, self.domains, self.run.name)
        except EngramRayError as exc:
            self.note("refused", str(exc)[:80])
            return str(exc)
        self.config = config
        self.note("deployed", self.version_of(config), config["serving"]["max_model_len"])
        return None

    def start_gang(self, group_id: str, cause: str) -> None:
        self.gangs += 1
        gang_id = f"{self.run.name}-gang{self.gangs}"
        host = MemberHost.remote(self.run.name)
        self.hosts[group_id] = (host, gang_id, host.start.remote(
            group_id, gang_id, self.shape.group_size, self.shape.dp_size, self.shape.start_s))
        self.note("gang_start", group_id, gang_id, cause)

    def restart_lost_gangs(self) -> None:
        """Serve's part: a gang with a dead process or a lost member restarts whole."""
        for group_id, (host, gang_id, _) in list(self.hosts.items()):
            try:
                lost = ray.get(host.lost.remote(), timeout=10)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                lost = [f"gang process gone ({type(exc).__name__})"]
            if not lost:
                continue
            self.collect(host)
            try:
                ray.get(host.stop.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - gone already
                pass
            ray.kill(host)
            self.note("gang_stopped", group_id, gang_id, lost[0][:120])
            self.start_gang(group_id, lost[0][:120])

    def collect(self, host) -> None:
        try:
            self.run.events += ray.get(host.take_events.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - killed: what it had not handed over is lost
            pass

    def collect_all(self) -> None:
        for host, _, _ in self.hosts.values():
            self.collect(host)

    def apply(self, event: str, group_pick: int, rank_pick: int, rng) -> None:
        group_id = f"group-{group_pick % self.shape.num_groups}"
        rank = rank_pick % self.shape.group_size
        host = self.hosts[group_id][0]
        self.note(event, group_id, rank)
        if event == "deploy":
            self.good = json.loads(json.dumps(self.good))
            self.good["serving"]["max_model_len"] = 512 + 64 * rng.randrange(1, 60)
            self.deploy(self.good)
        elif event == "will_not_start":
            bad = json.loads(json.dumps(self.good))
            bad["serving"]["max_model_len"] = 1000 + WILL_NOT_START
            self.deploy(bad)
        elif event == "refused":
            bad = json.loads(json.dumps(self.config))
            bad["serving"]["model_id"] = "another-model"
            self.deploy(bad)
        elif event == "engine_kill":
            host.kill_engine.remote(rank)
        elif event == "hang":
            host.hang_next_start.remote(rank)
            host.kill_engine.remote(rank)
        elif event == "replica_kill":
            self.collect(host)
            ray.kill(host)
        elif event == "coordinator_kill":
            self.kill_coordinator()

    def kill_coordinator(self) -> None:
        """kill -9 of its process; the seconds until a restarted one answers a member's
        check (its state restored) go into `Run.figures["coordinator_back_s"]`."""
        before = ray.get(self.coordinator.member_check.remote())["incarnation"]
        pid = ray.get(self.coordinator.__ray_call__.remote(lambda _self: os.getpid()))
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        while ray.get(self.coordinator.member_check.remote(), timeout=60)["incarnation"] \
                == before:
            time.sleep(0.05)
        self.run.figures.setdefault("coordinator_back_s", []).append(
            round(time.monotonic() - killed_at, 3))
        self.run.figures.setdefault("killed_at", []).append(time.time())

    def status(self) -> None:
        """The roll's stop as the coordinator shows it (for the stopped-roll invariant)."""
        try:
            roll = ray.get(self.coordinator.roll_status.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - restarting
            return
        if roll["stopped"] is not None:
            self.run.stops.setdefault(roll["version"], time.time())

    def quiet(self, timeout_s: float) -> str | None:
        """Wait until the roll ended and every group serves; why not, past `timeout_s`."""
        deadline, why = time.monotonic() + timeout_s, "never asked"
        while time.monotonic() < deadline:
            self.restart_lost_gangs()
            self.status()
            try:
                roll = ray.get(self.coordinator.roll_status.remote(), timeout=10)
                table = ray.get(self.coordinator.routing.remote(), timeout=10)[1]
            except Exception as exc:  # noqa: BLE001 - restarting
                why = f"coordinator: {exc}"
                time.sleep(0.5)
                continue
            not_serving = sorted(g for g, r in table.items()
                                 if not r["serving"] or r["restarting_ranks"])
            ended = roll["stopped"] is not None or (
                roll["done"] == roll["members"] == self.shape.num_groups * self.shape.group_size
                and not roll["restarting"])
            if ended and not not_serving:
                return None
            why = (f"roll {roll['done']}/{roll['members']} done, restarting "
                   f"{roll['restarting']}, stopped {roll['stopped']}; not serving: "
                   f"{not_serving}")
            time.sleep(0.5)
        return why


def run_schedule(seed: int, shape: Shape, workdir: str, ingress, duration_s: float = 20.0,
                 quiet_s: float = 180.0, events: list | None = None) -> Run:
    """One schedule at `shape` on the running Ray: start every gang, play the faults (those
    of `schedule(seed)`, or `events` as it returns them), wait for quiet, stop, check
    (`Run.violations`, `Run.figures`). `ingress`: an `Ingress`."""
    name = f"chaos{seed}"
    run = Run(seed, shape, name, os.path.join(workdir, name, "store"))
    os.makedirs(os.path.dirname(run.store), mode=0o700, exist_ok=True)
    harness = Harness(run)
    harness.deploy(harness.good)
    ray.get(ingress.watch.remote(name))
    for group_id in harness.domains:
        harness.start_gang(group_id, "first start")
    startup = harness.quiet(120.0)
    if startup is not None:
        run.violations.append(f"never served at first: {startup}")
    started, rng = time.time(), random.Random(seed)
    for at, event, group_pick, rank_pick in events or schedule(seed, duration_s):
        while time.time() - started < at:
            harness.restart_lost_gangs()
            harness.status()
            time.sleep(0.25)
        harness.apply(event, group_pick, rank_pick, rng)
    why = harness.quiet(quiet_s)
    if why is not None:
        run.violations.append(f"no quiet within {quiet_s:.0f} s: {why}")
    harness.collect_all()
    run.figures.update(ray.get(ingress.figures.remote(started)))
    stop(harness)
    run.violations += check(run)
    if run.violations:  # what happened, for whoever replays the seed
        path = os.path.join(workdir, f"{name}-events.json")
        with open(path, "w") as f:
            json.dump({"harness": run.harness, "events": run.events, "stops": run.stops}, f)
        run.violations.append(f"events of seed {seed}: {path}")
    return run


def stop(harness: Harness) -> None:
    """The application's end: gangs stopped, the coordinator shut down and ended."""
    from ray.experimental.internal_kv import _internal_kv_list

    from engram_ray.serve.member.dp_gang import BARRIER_PREFIX

    for host, _, _ in harness.hosts.values():
        try:
            ray.get(host.stop.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - gone already
            pass
        ray.kill(host)
    ray.get(harness.coordinator.shutdown.remote())
    ray.kill(harness.coordinator, no_restart=True)
    run = harness.run
    if os.path.exists(os.path.join(run.store, run.name)):
        run.violations.append(f"store folders left after the stop: "
                              f"{os.listdir(os.path.join(run.store, run.name))}")
    keys = [k for k in _internal_kv_list(BARRIER_PREFIX.encode())
            if f"{run.name}-gang".encode() in k]
    if keys:
        run.violations.append(f"{len(keys)} DP barrier keys left in Ray's KV store, e.g. "
                              f"{keys[0].decode()}")


def _intervals(events: list[dict], harness: list) -> list[tuple[float, float, dict]]:
    """(begin, end, the begin event) of every member's restart for a roll; one its gang's
    stop cut short ends there."""
    stopped = {h[3]: h[0] for h in harness if h[1] == "gang_stopped"}  # gang id -> when
    open_at, found = {}, []
    for e in sorted(events, key=lambda e: e["t"]):
        key = e["replica"]
        if e["kind"] == "restarting" and (e.get("reason") or "").startswith("settings "):
            open_at.setdefault(key, e)
        elif e["kind"] in ("serving", "lost", "restarting") and key in open_at:
            begin = open_at.pop(key)
            found.append((begin["t"], e["t"], begin))
    now = time.time()
    found += [(e["t"], stopped.get(e["replica"].rsplit("-r", 1)[0], now), e)
              for e in open_at.values()]
    return found


def check(run: Run) -> list[str]:
    """The invariants (module doc) over what the members and the harness recorded."""
    violations = []
    rolls = _intervals(run.events, run.harness)
    for begin, _, first in rolls:
        live = [(e["group"], e["dp_gang"]) for b, end, e in rolls if b <= begin < end]
        gangs_in_group = {g for grp, g in live if grp == first["group"]}
        if len(gangs_in_group) > 1:
            violations.append(f"two DP gangs of {first['group']} restarting for a roll at "
                              f"once: {sorted(gangs_in_group)}")
        groups = {grp for grp, _ in live}
        if len(groups) > run.shape.max_groups_at_once:
            violations.append(f"{len(groups)} groups rolling at once (max "
                              f"{run.shape.max_groups_at_once}): {sorted(groups)}")
        # A turn goes to a DP gang: a member that learns its peer's turn after the stop
        # still restarts with it (its peer waits for it at the gang's barrier).
        version = first["reason"].split()[1]
        turn_at = min(b for b, end, e in rolls if e["dp_gang"] == first["dp_gang"]
                      and e["reason"] == first["reason"] and b <= begin < end or e is first)
        if version in run.stops and turn_at > run.stops[version]:
            violations.append(f"{first['dp_gang']} got a turn for settings {version} after "
                              "the roll of them stopped")
    # As many turns as DP gangs: none restarts twice for the same settings (a coordinator
    # restarted mid-roll that forgot a turn gave it again). The members of one turn overlap:
    # each waits at its gang's barrier for the others.
    turns: dict[tuple, list] = {}
    for begin, end, first in sorted(rolls, key=lambda r: r[0]):
        spans = turns.setdefault((first["dp_gang"], first["reason"]), [])
        if spans and begin <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([begin, end])
    violations += [f"{gang} restarted {len(spans)} times for {reason}"
                   for (gang, reason), spans in turns.items() if len(spans) > 1]
    generations: dict[str, set] = {}
    for e in run.events:
        if e["kind"] == "joined":
            generations.setdefault(e["gang"], set()).add(e["generation"])
        elif e["kind"] == "folder_removed":
            violations.append(f"store folder of live member {e['replica']} removed")
    violations += [f"gang {g} got {len(gens)} generations" for g, gens in generations.items()
                   if len(gens) > 1]
    hung = {e["dp_gang"] for e in run.events if e["kind"] == "hang"}
    violations += [f"member {e['replica']} lost with no fault put there: {e['reason']}"
                   for e in run.events if e["kind"] == "lost" and e["dp_gang"] not in hung]
    return sorted(set(violations))

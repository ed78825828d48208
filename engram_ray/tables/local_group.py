"""Run the members of a peer group as local processes, and check one member's lookups.

Serves the CPU and GPU tests and the benchmarks alike: `run_group` starts one process per rank
(forkserver by default: each member starts clean, as with spawn, but forks from a server that
imported torch once, so a group of 8 starts in a second instead of 8 torch imports), returns
each member's result or its traceback;
`check_member` opens the member's tables from the synthetic generator and compares lookups of
random row ids with the torch reference over the same rows (`torch.equal`); `serve_member`
does so round after round until told to stop, as an engine serving next to peers that die and
restart (slice holders on: `engram_ray.tables.slice_holder`).
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from engram_ray.model.layout import EngramLayout
from engram_ray.model.reference import lookup_reference
from engram_ray.model.synthetic import synthetic_rows
from engram_ray.private_dirs import private_dir
from engram_ray.tables.settings import PeerGroupSettings
from engram_ray.tables.table import open_group_tables


@dataclass(frozen=True)
class MemberResult:
    rank: int
    is_ok: bool
    value: object        # the target's return value, or the traceback text
    seconds: float


def _member_main(target, rank, args, env, num_threads, results, key) -> None:
    start = time.perf_counter()
    os.environ.update(env)
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        results.put((key, rank, True, target(rank, *args), time.perf_counter() - start))
    except BaseException:  # noqa: BLE001 - reported to the parent, which decides
        results.put((key, rank, False, traceback.format_exc(), time.perf_counter() - start))


def run_group(target: Callable, ranks: list[int], args: tuple = (), *,
              env: dict[str, str] | None = None, timeout_s: float = 120.0,
              start_method: str = "forkserver",
              num_threads: int | None = 1) -> list[MemberResult]:
    """Call `target(rank, *args)` in one new process per rank; results sorted by rank.

    `env` is applied in each member (a forkserver's children see the server's environment,
    not the caller's current one). `num_threads`: torch CPU threads per member (1: P members
    on a few cores would otherwise spin P x cores OpenMP threads against each other). A
    process that dies without a result (or outlives `timeout_s`) gets `is_ok=False`."""
    members = Members(target, args, env=env, start_method=start_method,
                      num_threads=num_threads)
    for rank in ranks:
        members.start(rank)
    return members.collect(timeout_s)


class Members:
    """Member processes started one by one (`start`), their results gathered by `collect`."""

    def __init__(self, target: Callable, args: tuple = (), *, env: dict[str, str] | None = None,
                 start_method: str = "forkserver", num_threads: int | None = 1):
        self.target, self.args, self.env, self.num_threads = target, args, env or {}, num_threads
        self.ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            self.ctx.set_forkserver_preload(["torch", __name__, target.__module__])
        self.results = self.ctx.Queue()
        self.procs: dict[int, mp.Process] = {}  # key -> process (key: rank, or as given)
        self.ranks: dict[int, int] = {}          # key -> the rank its process runs

    def start(self, rank: int, key: int | None = None):
        key = rank if key is None else key
        self.ranks[key] = rank
        self.procs[key] = proc = self.ctx.Process(
            target=_member_main, args=(self.target, rank, self.args, self.env,
                                       self.num_threads, self.results, key), daemon=True)
        proc.start()
        return proc

    def collect(self, timeout_s: float) -> list[MemberResult]:
        found, deadline = {}, time.monotonic() + timeout_s
        while len(found) < len(self.procs) and time.monotonic() < deadline:
            try:
                key, rank, is_ok, value, seconds = self.results.get(timeout=0.2)
                found[key] = MemberResult(rank, is_ok, value, seconds)
            except queue.Empty:
                if all(not p.is_alive() for k, p in self.procs.items() if k not in found):
                    break
        for key, proc in self.procs.items():
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
            found.setdefault(key, MemberResult(self.ranks[key], False,
                                               f"exit code {proc.exitcode}", 0.0))
        return [found[k] for k in sorted(found)]


def file_barrier(directory: str, name: str, rank: int, ranks: list[int],
                 timeout_s: float = 120.0) -> None:
    """Wait until every rank in `ranks` has reached barrier `name` (files in `directory`)."""
    private_dir(directory, "barrier folder")
    open(os.path.join(directory, f"{name}-{rank}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(os.path.join(directory, f"{name}-{r}")) for r in ranks):
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: not every rank of {ranks} arrived")
        time.sleep(0.02)


def expected_rows(row_ids: torch.Tensor, head_dim: int, seed: int = 0,
                  out: str = "packed") -> torch.Tensor:
    """Reference lookup of synthetic rows at `row_ids` `[T, C]`, generating only those rows."""
    valid = row_ids[row_ids >= 0]
    unique = torch.unique(valid)
    rows = torch.cat([synthetic_rows(int(u), int(u) + 1, head_dim, seed, row_ids.device)
                      for u in unique.tolist()] or
                     [synthetic_rows(0, 0, head_dim, seed, row_ids.device)])
    local = torch.where(row_ids >= 0, torch.searchsorted(unique, row_ids.clamp(min=0)), -1)
    return lookup_reference(rows, local, head_dim, out)


def random_row_ids(num_rows: int, shape: tuple[int, int], seed: int,
                   device: str = "cpu") -> torch.Tensor:
    """Random ids in [0, num_rows) with about 5% -1 (no row), always the first and last row."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_rows, shape, generator=gen)
    ids[torch.rand(shape, generator=gen) < 0.05] = -1
    ids.view(-1)[:2] = torch.tensor([0, num_rows - 1])
    return ids.to(device)


def check_member(rank: int, layout: EngramLayout, size: int, store_dir: str, generation: str,
                 backend: str = "shm", device: str = "cpu", seed: int = 0,
                 num_tokens: int = 64, timeout_s: float = 30.0,
                 start_barrier: str | None = None, handle_type: str | None = None) -> dict:
    """Open this rank's tables, compare lookups of random ids with the reference; stats.
    `start_barrier`: a folder where all members first wait for each other (benchmarks);
    `handle_type`: the type this member requests (cuda backend; None: the group chooses)."""
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    settings = PeerGroupSettings(size=size, rank=rank, store_dir=store_dir,
                                 generation=generation, timeout_s=timeout_s, backend=backend,
                                 handle_type=handle_type)
    if start_barrier:
        file_barrier(start_barrier, "start", rank, list(range(size)))
    tables = open_group_tables(layout, settings, device=device, seed=seed)
    try:
        checks = {}
        for layer_id, num_rows in zip(layout.layer_ids, layout.rows_per_table):
            ids = random_row_ids(num_rows, (num_tokens, layout.num_cols), seed + rank, device)
            checks[layer_id] = all(
                torch.equal(tables.lookup(layer_id, ids, out),
                            expected_rows(ids, layout.head_dim, seed, out))
                for out in ("packed", "bf16"))
        return {"stats": tables.stats(), "equal": checks}
    finally:
        tables.close()


def serve_member(rank: int, layout: EngramLayout, size: int, store_dir: str, generation: str,
                 control_dir: str, backend: str = "shm", device: str = "cpu", seed: int = 0,
                 num_tokens: int = 64, timeout_s: float = 30.0) -> dict:
    """Open this rank's tables with slice holders on (fill and deposit, or re-attach when
    its holder holds them), touch `<control_dir>/ready-<rank>-<pid>`, then compare lookups of
    fresh random ids with the reference until `<control_dir>/stop` exists:
    {"rounds", "equal_rounds", "rounds_after_kill" (those ended after `<control_dir>/killed`
    appeared), "seconds_read_after_kill", "reattached", "stats"}."""
    if device == "cuda":
        torch.cuda.set_device(device := f"cuda:{rank % torch.cuda.device_count()}")
    settings = PeerGroupSettings(size=size, rank=rank, store_dir=store_dir,
                                 generation=generation, timeout_s=timeout_s, backend=backend,
                                 holders=True)
    tables = open_group_tables(layout, settings, device=device, seed=seed)
    control = lambda name: os.path.join(control_dir, name)  # noqa: E731
    open(control(f"ready-{rank}-{os.getpid()}"), "w").close()
    rounds = equal = after_kill = 0
    first_after_kill_at = last_at = None
    try:
        while not os.path.exists(control("stop")):
            layer_id = layout.layer_ids[rounds % len(layout.layer_ids)]
            ids = random_row_ids(layout.rows_per_table[layout.layer_idx(layer_id)],
                                 (num_tokens, layout.num_cols), seed + 1000 * rank + rounds,
                                 device)
            is_equal = torch.equal(tables.lookup(layer_id, ids, "packed"),
                                   expected_rows(ids, layout.head_dim, seed, "packed"))
            rounds, equal, last_at = rounds + 1, equal + is_equal, time.monotonic()
            if os.path.exists(control("killed")):
                after_kill += 1
                first_after_kill_at = first_after_kill_at or last_at
        return {"rounds": rounds, "equal_rounds": equal, "rounds_after_kill": after_kill,
                "seconds_read_after_kill": (last_at - first_after_kill_at
                                            if first_after_kill_at else 0.0),
                "reattached": tables.reattach_seconds is not None, "stats": tables.stats()}
    finally:
        tables.close()


def wait_ready(control_dir: str, rank: int, count: int = 1, timeout_s: float = 240.0) -> None:
    """Until `count` processes of `rank` run `serve_member` (their ready files exist)."""
    deadline = time.monotonic() + timeout_s
    while len(glob.glob(os.path.join(control_dir, f"ready-{rank}-*"))) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} not ready within {timeout_s:g} s")
        time.sleep(0.05)


def kill_member(proc, rank: int, control_dir: str) -> None:
    """SIGKILL a `serve_member` process of `rank` and wait for it; from then on the others
    count their rounds as after the kill, and `wait_ready` waits for a new process of `rank`."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    open(os.path.join(control_dir, "killed"), "w").close()
    for ready in glob.glob(os.path.join(control_dir, f"ready-{rank}-*")):
        os.unlink(ready)


def kill_and_restart(members: Members, victim, rank: int, control_dir: str,
                     read_after_kill_s: float, timeout_s: float = 240.0) -> list[MemberResult]:
    """The failover sequence of `serve_member` processes: SIGKILL `victim` (a process of
    `rank`), let the others read on for `read_after_kill_s`, start a new process of `rank`
    (it re-attaches from the holders), let it read, stop everyone; results by key (the victim
    first, the restarted process last)."""
    kill_member(victim, rank, control_dir)
    time.sleep(read_after_kill_s)
    members.start(rank, key=max(members.procs) + 1)
    wait_ready(control_dir, rank)
    time.sleep(1.0)
    open(os.path.join(control_dir, "stop"), "w").close()
    return members.collect(timeout_s)

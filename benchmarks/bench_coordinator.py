"""The coordinator under the shipped shape's load, side by side with the one before it.

A real coordinator (`get_coordinator`, as `serve deploy`'s build makes it) with 9 groups of 8
members (DEP2) joined and ready, their replica actor answering its pings; 72 members each
sending `member_check` once a second (as `CoordinatorLink` does); N ingress long polls
(`routing`, re-polled at once as `GroupRouting` does), and a routing change every second (a
member restarting, then ready). Per N: `member_check` round trips (p50, p99, max), how long
after a change every poll had it, and the coordinator process's CPU. The baseline is the
coordinator of another commit (a git worktree of it), run the same way in its own Ray.

    python benchmarks/bench_coordinator.py [--baseline f3f6036] [--polls 0 16 32 64]

Each implementation runs in a child process (its own Ray, `127.0.0.1`); run it inside a
loopback-only network namespace (scripts/in_netns.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import REPO, RESULTS, environment, write_results  # noqa: E402

NUM_GROUPS, GROUP_SIZE, DP_SIZE = 9, 8, 2
WINDOW_S = 12.0


def measure(polls: list[int], workdir: str) -> dict:
    """In the child: every N of `polls` against one coordinator of this tree."""
    import psutil
    import ray

    from engram_ray.actors.coordinator_lookup import get_coordinator
    from engram_ray.serve.deploy.cluster_configs import load_serve_config

    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             num_cpus=2, log_to_driver=False)
    raw = next(iter(load_serve_config(REPO / "cluster_configs" / "serve_local_tiny.yaml")
                    .values())).to_dict()
    raw["deployment"].update(name="bench", peer_group_store=os.path.join(workdir, "store"),
                             model="deepseek-v4.1-flash", peer_group_size=GROUP_SIZE)
    raw["serving"].update(num_peer_groups=NUM_GROUPS, data_parallel_size=DP_SIZE,
                          prometheus_targets_file=os.path.join(workdir, "targets.json"))
    domains = {f"group-{g}": f"domain-{g}" for g in range(NUM_GROUPS)}
    coordinator = get_coordinator(raw, domains, "bench")
    replica = Replica.remote()
    ray.get(replica.__ray_ready__.remote())
    members = [f"g{g}m{r}" for g in range(NUM_GROUPS) for r in range(GROUP_SIZE)]
    for g in range(NUM_GROUPS):
        for r in range(GROUP_SIZE):
            ray.get(coordinator.join.remote(f"group-{g}", f"gang{g}", r, GROUP_SIZE,
                                            f"g{g}m{r}"))
    for m in members:
        ray.get(coordinator.member_ready.remote(m, replica))
    pid = ray.get(coordinator.__ray_call__.remote(lambda _self: os.getpid()))
    proc = psutil.Process(pid)
    load = Load.remote(members)
    rows = []
    for num_polls in polls:
        ray.get(load.start.remote(num_polls))
        time.sleep(2.0)  # polls parked, checks flowing
        cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
        changes, started = [], time.monotonic()
        while time.monotonic() - started < WINDOW_S:
            # A change's time is taken just before the call that makes it: every poll
            # answer after it is that change's (the one before is 1 s older).
            member = members[len(changes) % len(members)]
            changes.append(time.time())
            ray.get(coordinator.member_restarting.remote(member, "bench"))
            time.sleep(1.0)
            changes.append(time.time())
            ray.get(coordinator.member_ready.remote(member, replica))
            time.sleep(1.0)
        cpu = (sum(proc.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0)
        figures = ray.get(load.stop.remote(changes))
        rows.append({"polls": num_polls, "coordinator_cpu": round(cpu, 3), **figures})
        print(json.dumps(rows[-1]), flush=True)
    ray.shutdown()
    return {"rows": rows}


def _remote_classes():
    import ray

    @ray.remote(num_cpus=0)
    class Replica:
        def ping(self):
            return True

    @ray.remote(num_cpus=0)
    class Load:
        """72 members' checks at 1 Hz each, and N long polls re-polled at once."""

        def __init__(self, members: list[str]):
            from engram_ray.actors.coordinator_lookup import find_coordinator

            self.coordinator, self.members = find_coordinator("bench"), members
            self.tasks, self.check_ms, self.seen = [], [], []

        async def start(self, num_polls: int) -> None:
            loop = asyncio.get_running_loop()
            self.check_ms, self.seen = [], [[] for _ in range(num_polls)]
            self.tasks = [loop.create_task(self._member(m, i / len(self.members)))
                          for i, m in enumerate(self.members)]
            self.tasks += [loop.create_task(self._poll(i)) for i in range(num_polls)]

        async def _member(self, replica_id: str, offset: float) -> None:
            await asyncio.sleep(offset)
            while True:
                started = time.perf_counter()
                await self.coordinator.member_check.remote(replica_id, 0, False, None)
                self.check_ms.append((time.perf_counter() - started) * 1e3)
                await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - started)))

        async def _poll(self, index: int) -> None:
            version = -1
            while True:
                version, _ = await self.coordinator.routing.remote(version, 10.0)
                self.seen[index].append(time.time())

        async def stop(self, changes: list[float]) -> dict:
            for task in self.tasks:
                task.cancel()
            checks = sorted(self.check_ms)
            lags = []
            for at in changes:  # when the last poll had each change (or a later one)
                firsts = [min((t for t in seen if t >= at), default=None) for seen in self.seen]
                if firsts and None not in firsts:
                    lags.append(max(firsts) - at)
            lags.sort()
            pct = (lambda xs, q: round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)
                   if xs else None)
            return {"checks": len(checks), "check_p50_ms": pct(checks, 0.5),
                    "check_p99_ms": pct(checks, 0.99), "check_max_ms": pct(checks, 1.0),
                    "changes": len(changes), "seen_by_all_p50_s": pct(lags, 0.5),
                    "seen_by_all_max_s": pct(lags, 1.0)}
    return Replica, Load


def baseline_tree(commit: str, workdir: str) -> str:
    """A worktree of `commit` whose `engram_ray.actors` and `.kernels` resolve inside it
    (the editable install maps them to this checkout's folders)."""
    tree = os.path.join(workdir, f"tree-{commit}")
    subprocess.run(["git", "worktree", "add", "--detach", "-f", tree, commit], cwd=REPO,
                   check=True, capture_output=True)
    for name in ("actors", "kernels"):
        os.symlink(os.path.join("..", name), os.path.join(tree, "engram_ray", name))
    return tree


def run_child(tree: str, polls: list[int], workdir: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, ENGRAM_BENCH_CHILD="1")
    out = subprocess.run([sys.executable, __file__, "--child", "--polls", *map(str, polls),
                          "--workdir", workdir], env=env, capture_output=True, text=True,
                         timeout=1800, cwd=tree)  # Ray puts the driver's folder on workers' path
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not rows:
        raise RuntimeError(f"child in {tree} failed ({out.returncode}): {out.stderr[-3000:]}")
    return {"rows": rows}


def report(env: dict, baseline: str, results: dict) -> str:
    lines = [f"# The coordinator at 9 x 8 members (DEP2) under N ingress long polls",
             "", f"Device {env['device']}; date {env['date']}; commit {env['commit']}; "
             f"baseline {baseline} (a worktree of it, run the same way in its own Ray); 72 "
             "members checking once a second each, a routing change every second, "
             f"{WINDOW_S:.0f} s per N.", "",
             "Command: `bash scripts/in_netns.sh python benchmarks/bench_coordinator.py`", "",
             "| N polls | tree | checks | check p50 ms | check p99 ms | check max ms | "
             "every poll had a change, p50 s | max s | coordinator CPU (cores) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, row in enumerate(results["checkout"]["rows"]):
        for tree in ("baseline", "checkout"):
            r = results[tree]["rows"][i]
            lines.append(f"| {r['polls']} | {tree} | {r['checks']} | {r['check_p50_ms']} | "
                         f"{r['check_p99_ms']} | {r['check_max_ms']} | "
                         f"{r['seen_by_all_p50_s']} | {r['seen_by_all_max_s']} | "
                         f"{r['coordinator_cpu']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="f3f6036")
    parser.add_argument("--polls", type=int, nargs="+", default=[0, 16, 32, 64])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--results", default=None)
    args = parser.parse_args()
    if args.child:
        measure(args.polls, args.workdir)
        return
    env = environment()
    with tempfile.TemporaryDirectory(prefix="bench-coordinator-") as workdir:
        tree = baseline_tree(args.baseline, workdir)
        try:
            results = {"baseline": run_child(tree, args.polls, os.path.join(workdir, "b")),
                       "checkout": run_child(str(REPO), args.polls,
                                             os.path.join(workdir, "c"))}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=REPO)
    markdown = report(env, args.baseline, results)
    print(markdown)
    write_results(Path(args.results) if args.results else RESULTS / "coordinator",
                  {"baseline": args.baseline, **results}, markdown, env)


Replica = Load = None
if os.environ.get("ENGRAM_BENCH_CHILD"):
    Replica, Load = _remote_classes()

if __name__ == "__main__":
    main()

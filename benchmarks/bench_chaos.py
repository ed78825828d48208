"""Random fault schedules at the shipped shape: the chaos harness (`tests/support/chaos.py`:
the real coordinator, the real member parts over stand-in engines, 9 groups of 8 members in
DP gangs of 2, 32 real ingress routing polls) over many seeds, with its invariants.

    bash scripts/in_netns.sh python benchmarks/bench_chaos.py [--seeds 300] [--first 1]

Per run: schedules run, invariant violations (each printed with its seed: `--first SEED
--seeds 1` replays one), `member_check` round trips away from and right after a coordinator
kill, how long after the first ingress poll the last one had each routing change, and how long
a killed coordinator took to answer again with its state.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
TESTS = str(Path(__file__).resolve().parents[1] / "tests")
sys.path.insert(0, TESTS)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))

from common import RESULTS, environment, write_results  # noqa: E402

AFTER_KILL_S = 5.0  # checks this soon after a coordinator kill are counted apart


def pct(values: list[float], q: float):
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=300)
    parser.add_argument("--first", type=int, default=1)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of faults")
    parser.add_argument("--budget-min", type=float, default=None,
                        help="stop starting schedules after this many minutes")
    parser.add_argument("--results", default=None)
    args = parser.parse_args()
    import ray

    from support.chaos import Ingress, Shape, run_schedule

    env, shape = environment(), Shape()
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             num_cpus=2, log_to_driver=False)
    ingress = Ingress.remote(shape.num_ingress)
    ray.get(ingress.__ray_ready__.remote())
    started, runs = time.monotonic(), []
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as workdir:
        for seed in range(args.first, args.first + args.seeds):
            if args.budget_min and time.monotonic() - started > args.budget_min * 60:
                break
            t0 = time.monotonic()
            run = run_schedule(seed, shape, workdir, ingress, duration_s=args.duration)
            runs.append(run)
            print(f"seed {seed}: {time.monotonic() - t0:.0f} s, "
                  f"{[h[1] for h in run.harness if h[1] not in ('gang_start', 'deployed')]}, "
                  f"violations {run.violations}", flush=True)
    ray.shutdown()
    kills = [t for r in runs for t in r.figures.get("killed_at", [])]
    near = [ms for r in runs for t, ms in r.figures["check_ms"]
            if any(0 <= t - k <= AFTER_KILL_S for k in r.figures.get("killed_at", []))]
    away = [ms for r in runs for t, ms in r.figures["check_ms"]
            if not any(0 <= t - k <= AFTER_KILL_S for k in r.figures.get("killed_at", []))]
    lags = [lag for r in runs for lag in r.figures["lag_s"]]
    back = [s for r in runs for s in r.figures.get("coordinator_back_s", [])]
    bad = [(r.seed, v) for r in runs for v in r.violations]
    events = {}
    for r in runs:
        for h in r.harness:
            events[h[1]] = events.get(h[1], 0) + 1
    figures = {
        "shape": vars(shape), "schedules": len(runs), "seconds": round(time.monotonic() - started),
        "violations": len(bad), "violating_seeds": sorted({s for s, _ in bad}),
        "events": events, "coordinator_kills": len(kills),
        "check_p50_ms": pct(away, 0.5), "check_p99_ms": pct(away, 0.99),
        "check_max_ms": pct(away, 1.0), "checks": len(away),
        "check_after_kill_p50_ms": pct(near, 0.5), "check_after_kill_max_ms": pct(near, 1.0),
        "routing_lag_p50_s": pct(lags, 0.5), "routing_lag_p99_s": pct(lags, 0.99),
        "routing_lag_max_s": pct(lags, 1.0), "routing_changes": len(lags),
        "coordinator_back_p50_s": pct(back, 0.5), "coordinator_back_max_s": pct(back, 1.0)}
    lines = [
        "# Chaos at 9 x 8 members (DEP2), 32 ingress polls: random fault schedules", "",
        f"Device {env['device']}; date {env['date']}; commit {env['commit']}. Stand-in "
        "engines (no vLLM, no Serve replicas: `tests/support/standin_member.py`) under the real "
        "coordinator, member parts and ingress routing; `max_groups_at_once` "
        f"{shape.max_groups_at_once}, `in_place_timeout_s` {shape.in_place_timeout_s:g}.", "",
        f"Command: `bash scripts/in_netns.sh python benchmarks/bench_chaos.py --seeds "
        f"{args.seeds} --first {args.first}`", "",
        f"- schedules run: {len(runs)} (seeds {args.first}..{args.first + len(runs) - 1}), "
        f"{figures['seconds']} s; faults put: {events}",
        f"- invariant violations: {len(bad)}" + "".join(
            f"\n  - seed {s}: {v}" for s, v in bad[:40]),
        f"- `member_check` round trip (probe every 0.2 s, away from coordinator kills): p50 "
        f"{figures['check_p50_ms']} ms, p99 {figures['check_p99_ms']} ms, max "
        f"{figures['check_max_ms']} ms over {len(away)} checks; within {AFTER_KILL_S:g} s "
        f"after one of {len(kills)} kills: p50 {figures['check_after_kill_p50_ms']} ms, max "
        f"{figures['check_after_kill_max_ms']} ms",
        f"- a routing change, first ingress poll to last: p50 {figures['routing_lag_p50_s']} s, "
        f"p99 {figures['routing_lag_p99_s']} s, max {figures['routing_lag_max_s']} s over "
        f"{len(lags)} changes",
        f"- a killed coordinator answering again with its state (kill to first answer of the "
        f"new process, its start included): p50 {figures['coordinator_back_p50_s']} s, max "
        f"{figures['coordinator_back_max_s']} s"]
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    write_results(Path(args.results) if args.results else RESULTS / "chaos", figures,
                  markdown, env)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

"""Change, scale and stop without an outage, on the local deployment under load (issue 28).

    bash scripts/in_netns.sh python3 benchmarks/bench_serving_changes.py

(TMPDIR a folder you clean, VLLM_CPU_KVCACHE_SPACE=1, HF_HUB_OFFLINE=1, RAY_AUTH_MODE=disabled.)
Starts the local deployment with two peer groups of one CPU engine and one spare engine slot
(`--slots 3`: a changed config rolls out beside the serving gangs, one group after the other),
runs steady traffic (`--concurrency` clients, streamed and not, completions and chat; a request
counts as served only if its client saw finish_reason and [DONE]), then, each once the last is
over:

1. kill -9 of the coordinator's process: it restarts and rebuilds its groups from the members;
2. kill -9 of group-0's vLLM worker: the member restarts in place (with the rebuilt
   coordinator);
3. `serve deploy` of another `engine_kwargs` value (max_num_seqs 128 -> 64);
4. `serving.num_peer_groups` 2 -> 3, then 3 -> 2 (with `--scale`, in the spare slot): a group
   application added, then deleted; the other groups' engines must not restart;
5. traffic stopped, kill -9 of group-0's Serve replica, then `serve shutdown`: what is left.

Writes `benchmarks/results/serving_changes/latest.md` and a line of its `history.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import add_results_argument, environment, now, write_results  # noqa: E402


def run(args) -> dict:
    from engram_ray.local.deployment import LocalDeployment, LocalOptions, log
    from engram_ray.local.faults import kill_under_load, reference_answers
    from engram_ray.local.loadgen import LOST, Traffic
    from engram_ray.local.prometheus import free_port_block
    from engram_ray.local.rollout import roll_under_load, scale_under_load
    from engram_ray.local.stop_check import kill_then_shut_down

    env = environment()  # the code this run imports, whatever lands while it runs
    deployment = LocalDeployment(LocalOptions(
        workdir=args.workdir, port=args.port, name="changes", num_peer_groups=2,
        peer_group_size=1, num_logical_cpus=args.slots, metrics_port=free_port_block(2 * args.slots)))
    steps = []
    try:
        deployment.start()
        startup_s = deployment.wait_ready()
        traffic = Traffic(f"{deployment.url}/v1", deployment.model_id,
                          concurrency=args.concurrency, max_tokens=args.max_tokens).start()
        time.sleep(5.0)
        reference = reference_answers(list(traffic.results))
        for kind in ("coordinator", "worker"):
            log(f"kill -9 of the {kind} under load")
            steps.append(kill_under_load(deployment, traffic, kind, "group-0",
                                         reference=reference))
            log(json.dumps(steps[-1]))
        change = {"serving": {"engine_kwargs": {"max_num_seqs": 64}}}
        log(f"rolling out {change} under load")
        steps.append(roll_under_load(deployment, traffic, change, reference=reference))
        log(json.dumps(steps[-1]))
        for num_groups in (3, 2) if args.scale else ():
            log(f"num_peer_groups -> {num_groups} under load")
            steps.append(scale_under_load(deployment, traffic, num_groups, reference=reference))
            log(json.dumps(steps[-1]))
        results = traffic.stop()
        log("kill -9 of group-0's replica, then serve shutdown")
        stop = kill_then_shut_down(deployment)
        log(json.dumps(stop))
    finally:
        deployment.stop()
    return {"date": now(), "commit": env["commit"], "worktree_clean": env["worktree_clean"],
            "device": env["device"], "engine_slots": args.slots,
            "concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "startup_s": round(startup_s, 1), "steps": steps, "stop": stop,
            "requests": len(results), "lost_silently": sum(r.outcome == LOST for r in results),
            "failed": sum(not r.ok for r in results)}


def markdown(result: dict) -> str:
    lines = [f"# Change, scale and stop under load, local deployment ({result['date']}, commit "
             f"{result['commit']})", "",
             f"Device: {result['device']}. Two peer groups of one CPU engine (tiny Engram "
             f"model, shm tables) in {result['engine_slots']} engine slots, Ray Serve, "
             f"loopback only. Traffic: {result['concurrency']} clients back to back, streamed "
             f"and not, completions and chat, {result['max_tokens']} tokens; a request is "
             "served only if its client saw finish_reason and [DONE].", "",
             "| step | requests meanwhile | failed | lost silently | back / rolled out / done (s) | "
             "per group (s) | same answer |", "| --- " * 7 + "|"]
    for s in result["steps"]:
        if s["kind"] == "rollout":
            what, back = f"serve deploy {json.dumps(s['changes'])}", s["rolled_s"]
            per_group = ", ".join(f"{g} {t}" for g, t in s["groups_rolled_s"].items())
            failed = s["window_failed"]
        elif s["kind"] == "scale":
            what, back = f"serve deploy {json.dumps(s['changes'])}", s["scaled_s"]
            per_group = ", ".join(f"{g} {'untouched' if same else 'RESTARTED'}"
                                  for g, same in s["untouched"].items())
            failed = s["window_failed"]
        else:
            what, back, per_group = f"kill -9 {s['kind']}", s["recovered_s"], ""
            failed = s["failed_visibly"]
        lines.append(f"| {what} | {s.get('window_requests', s['requests'])} | {failed} | "
                     f"{s['lost_silently']} | {back} | {per_group} | "
                     f"{s['answers_checked'] - s['answers_differing']} / "
                     f"{s['answers_checked']} |")
    stop = result["stop"]
    lines += ["", f"All requests: {result['requests']}, failed {result['failed']}, lost "
              f"silently {result['lost_silently']}.", "",
              f"Stop: kill -9 of group-0's Serve replica, 5 s, then `serve shutdown` "
              f"({stop['serve_shutdown_s']} s): "
              + (f"nothing of the deployment left after {stop['clean_after_s']} s (no engine "
                 "process, no unmapped /dev/shm segment or semaphore, no listening metrics "
                 "port, no store folder, no coordinator)." if not stop["left"] else
                 f"LEFT after 60 s: {stop['left']}"),
              f"Unmapped /dev/shm files from before the kill (earlier steps' or another "
              f"run's): {len(stop['unmapped_before_kill'])}, of them still there after the "
              f"stop: {len(stop['unmapped_before_kill_left'])}.", "",
              "Coordinator kill: back = until it answered with a new incarnation and every "
              "group as before (requests counted from the kill). Worker kill: back = until "
              "the member served again (requests sent from its detection). Rollouts: rolled "
              "out = from `serve deploy` until every group served a new generation and no old "
              "gang was left; per group = when each group's new generation served; requests "
              "= those sent until then. num_peer_groups: done = from `serve deploy` until "
              "exactly those groups served and a removed group's application was gone; "
              "untouched = the group served the same generation before and after (its "
              "engine never restarted). Same answer: complete answers equal to the greedy "
              "answer from before the first step, token for token."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=3,
                        help="engine slots (logical CPUs) for the two engines: one spare for "
                        "the rollout beside them, and for the third group of --scale")
    parser.add_argument("--scale", action="store_true",
                        help="also roll num_peer_groups 2 -> 3 -> 2")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--workdir", default="/tmp/engram-ray-changes")
    parser.add_argument("--port", type=int, default=8110)
    add_results_argument(parser, "serving_changes")
    args = parser.parse_args()
    result = run(args)
    write_results(args.results, result, markdown(result))


if __name__ == "__main__":
    main()

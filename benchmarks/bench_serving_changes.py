"""Change, scale and stop without an outage, on the local deployment under load, every change
through `serve deploy` (the declarative config, as the CLI and KubeRay apply it).

    bash scripts/in_netns.sh python3 benchmarks/bench_serving_changes.py

(TMPDIR a folder you clean, VLLM_CPU_KVCACHE_SPACE=1, HF_HUB_OFFLINE=1, RAY_AUTH_MODE=disabled.)
Three layouts, one after the other, each started afresh under steady traffic (`--concurrency`
clients, streamed and not, completions and chat; a request counts as served only if its
client saw finish_reason and [DONE]):

A. one peer group of two CPU engines, no spare engine slot (2 slots): `serve deploy` of another
   `engine_kwargs` value (max_num_seqs 128 -> 96; `serving.rollout.mode: in_place`, the
   default), then of a value whose engine will not start (max_model_len 100000 > the model's):
   the roll must stop at the first member, which serves again on the old settings;
B. two groups of one engine, no spare slot: kill -9 of the coordinator, of group-0's vLLM
   worker, an in-place roll (max_num_seqs 128 -> 96), then traffic stopped, kill -9 of
   group-0's Serve replica and `serve shutdown`: what is left;
C. two groups of one engine, one spare slot (3 slots), `rollout.mode: beside`: a roll of
   max_num_seqs (new gangs beside the serving ones), with `--scale` num_peer_groups 2 -> 3 -> 2.

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

NEW_VALUE = {"serving": {"engine_kwargs": {"max_num_seqs": 96}}}
WONT_START = {"serving": {"max_model_len": 100000}}  # above the tiny model's 512 positions
LAYOUTS = {  # name: (groups, engines per group, engine slots, rollout mode)
    "A": (1, 2, 2, "in_place"), "B": (2, 1, 2, "in_place"), "C": (2, 1, 3, "beside")}


def run_layout(args, layout: str) -> dict:
    from engram_ray.local.deployment import LocalDeployment, LocalOptions, log
    from engram_ray.local.faults import kill_under_load, reference_answers
    from engram_ray.local.loadgen import LOST, Traffic
    from engram_ray.local.prometheus import free_port_block
    from engram_ray.local.rollout import roll_under_load, scale_under_load
    from engram_ray.local.stop_check import kill_then_shut_down

    groups, size, slots, mode = LAYOUTS[layout]
    deployment = LocalDeployment(LocalOptions(
        workdir=f"{args.workdir}-{layout}", port=args.port, name=f"changes-{layout.lower()}",
        num_peer_groups=groups, peer_group_size=size, num_logical_cpus=slots,
        metrics_port=free_port_block(2 * slots), rollout_mode=mode))
    steps, stop = [], None
    try:
        deployment.start()
        startup_s = deployment.wait_ready()
        traffic = Traffic(f"{deployment.url}/v1", deployment.model_id,
                          concurrency=args.concurrency, max_tokens=args.max_tokens).start()
        time.sleep(5.0)
        reference = reference_answers(list(traffic.results))

        def step(result):
            steps.append(result)
            log(f"{layout}: {json.dumps(result)}")

        if layout == "B":
            for kind in ("coordinator", "worker"):
                log(f"{layout}: kill -9 of the {kind} under load")
                step(kill_under_load(deployment, traffic, kind, "group-0", reference=reference))
        log(f"{layout}: serve deploy of {NEW_VALUE} under load ({mode})")
        step(roll_under_load(deployment, traffic, NEW_VALUE, reference=reference))
        if layout == "A":
            log(f"{layout}: serve deploy of {WONT_START} (will not start) under load")
            step(roll_under_load(deployment, traffic, WONT_START, reference=reference))
        for num_groups in (3, 2) if layout == "C" and args.scale else ():
            step(scale_under_load(deployment, traffic, num_groups, reference=reference))
        results = traffic.stop()
        if layout == "B":
            log(f"{layout}: kill -9 of group-0's replica, then serve shutdown")
            stop = kill_then_shut_down(deployment)
            log(json.dumps(stop))
    finally:
        deployment.stop()
    return {"layout": layout, "num_peer_groups": groups, "peer_group_size": size,
            "engine_slots": slots, "rollout_mode": mode, "startup_s": round(startup_s, 1),
            "steps": steps, "stop": stop, "requests": len(results),
            "lost_silently": sum(r.outcome == LOST for r in results),
            "failed": sum(not r.ok for r in results)}


def run(args) -> dict:
    env = environment()  # the code this run imports, whatever lands while it runs
    layouts = [run_layout(args, layout) for layout in args.layouts]
    return {"date": now(), "commit": env["commit"], "worktree_clean": env["worktree_clean"],
            "device": env["device"], "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "layouts": layouts,
            "requests": sum(r["requests"] for r in layouts),
            "failed": sum(r["failed"] for r in layouts),
            "lost_silently": sum(r["lost_silently"] for r in layouts)}


def _step_row(s: dict) -> str:
    if s["kind"] == "rollout":
        what, back = f"serve deploy {json.dumps(s['changes'])}", s["rolled_s"]
        detail = ", ".join(f"{r['group_id']} {r['replica_id']} {r['seconds']} s"
                           for r in s["member_restarts"])
        detail = (f"settings {s['old_version']} -> {s['version']}; restarts: {detail or 'none'}"
                  f"; same generation: {s['same_generation']}")
        if s["stopped"]:
            detail += f"; ROLL STOPPED at {s['stopped']['replica_id']}: {s['stopped']['reason']}"
        failed = s["window_failed"]
    elif s["kind"] == "scale":
        what, back = f"serve deploy {json.dumps(s['changes'])}", s["scaled_s"]
        detail = ", ".join(f"{g} {'untouched' if same else 'RESTARTED'}"
                           for g, same in s["untouched"].items())
        failed = s["window_failed"]
    else:
        what, back, detail = f"kill -9 {s['kind']}", s["recovered_s"], ""
        failed = s["failed_visibly"]
    return (f"| {what} | {s.get('window_requests', s['requests'])} | {failed} | "
            f"{s['lost_silently']} | {back} | {detail} | "
            f"{s['answers_checked'] - s['answers_differing']} / {s['answers_checked']} |")


def markdown(result: dict) -> str:
    lines = [f"# Change, scale and stop under load through `serve deploy` ({result['date']}, "
             f"commit {result['commit']})", "",
             f"Device: {result['device']}. CPU engines (tiny Engram model, shm tables), Ray "
             "Serve, loopback only; every change applied as `serve deploy` applies it (Serve's "
             "declarative config: each application built in its own task). Traffic: "
             f"{result['concurrency']} clients back to back, streamed and not, completions and "
             f"chat, {result['max_tokens']} tokens; a request is served only if its client saw "
             "finish_reason and [DONE]."]
    for lay in result["layouts"]:
        lines += ["", f"## Layout {lay['layout']}: {lay['num_peer_groups']} group(s) of "
                  f"{lay['peer_group_size']} engine(s) in {lay['engine_slots']} engine slots, "
                  f"rollout.mode {lay['rollout_mode']} (ready in {lay['startup_s']} s)", "",
                  "| step | requests meanwhile | failed | lost silently | back / rolled out / "
                  "done (s) | detail | same answer |", "| --- " * 7 + "|"]
        lines += [_step_row(s) for s in lay["steps"]]
        lines += ["", f"All requests: {lay['requests']}, failed {lay['failed']}, lost silently "
                  f"{lay['lost_silently']}."]
        stop = lay["stop"]
        if stop:
            lines += ["", f"Stop: kill -9 of group-0's Serve replica, 5 s, then `serve shutdown` "
                      f"({stop['serve_shutdown_s']} s): "
                      + (f"nothing of the deployment left after {stop['clean_after_s']} s (no "
                         "engine process, no unmapped /dev/shm segment or semaphore, no "
                         "listening metrics port, no store folder, no coordinator)."
                         if not stop["left"] else f"LEFT after 60 s: {stop['left']}")]
    lines += ["", "Kills: back = until the coordinator answered with a new incarnation and "
              "every group as before / until the member served again. Rollouts: rolled out = "
              "from `serve deploy` until every member of every group ran the new settings and "
              "served, no gang left starting or draining (or the roll stopped); restarts = each "
              "member's engine restart in place for the roll (in_place); requests = those sent "
              "until then. Same answer: complete answers equal to the greedy answer from before "
              "the first step, token for token."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["A", "B", "C"])
    parser.add_argument("--scale", action="store_true",
                        help="layout C: also num_peer_groups 2 -> 3 -> 2 in the spare slot")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--workdir", default="/tmp/engram-ray-changes")
    parser.add_argument("--port", type=int, default=8110)
    add_results_argument(parser, "serving_changes")
    args = parser.parse_args()
    result = run(args)
    write_results(args.results, result, markdown(result))


if __name__ == "__main__":
    main()

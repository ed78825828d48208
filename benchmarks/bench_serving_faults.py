"""Faults under load on the local deployment, measured from the clients' side (issue 20).

    bash scripts/in_netns.sh python3 benchmarks/bench_serving_faults.py [--layout 2x1|1x2|1x4dp2]

Starts the local deployment (`engram_ray.local.deployment`, two CPU engines: `2x1` = two peer
groups of one engine, `1x2` = one group of two; `1x4dp2` = one group of four engines as two
data-parallel gangs of two, DEP2 as the shipped GPU configs, the tiny model with 4 experts per
MLP), runs steady traffic (`--concurrency` clients,
streamed and not, completions and chat; a request counts as served only if its client saw
finish_reason and [DONE]), then kills (kill -9), each once the last is over: group-0's
EngineCore and, in turn, its worker (the member's engine restarts in place, same generation,
slices re-attached; with `1x4dp2` the member's whole DP gang restarts in place while the
other gang serves), then a Serve replica (of the other group with 2x1: its gang restarts in a
new generation; not with `1x4dp2`); then sends the malformed-request table (`engram_ray.local.probes`). Writes
`benchmarks/results/serving_faults/latest.md` and a line of its `history.jsonl` (`--results
DIR` elsewhere; `--append` adds this layout's table to latest.md instead of replacing it): per
kill `requests`, `lost_silently`, `failed_visibly`, `running_at_kill_failed`, `window_*`
(requests sent from the kill's detection until the member or group served again), `traffic_off_s`,
`recovered_s` and the recovery's parts; `malformed_probes`, `malformed_4xx`,
`tracebacks_in_bodies`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import add_results_argument, environment, now, write_results  # noqa: E402

LAYOUTS = {"2x1": (2, 1, 1), "1x2": (1, 2, 1), "1x4dp2": (1, 4, 2)}  # groups, size, DP


def run(layout: str, concurrency: int, max_tokens: int, workdir: str, port: int) -> dict:
    from engram_ray.local.deployment import LocalDeployment, LocalOptions, log
    from engram_ray.local.faults import kill_under_load, reference_answers
    from engram_ray.local.loadgen import LOST, Traffic
    from engram_ray.local.probes import probe_summary, run_probes

    num_groups, size, dp_size = LAYOUTS[layout]
    env = environment()  # the code this run imports, whatever lands while it runs
    deployment = LocalDeployment(LocalOptions(workdir=workdir, port=port, name="faults",
                                              num_peer_groups=num_groups,
                                              peer_group_size=size, data_parallel_size=dp_size,
                                              num_experts=4 if dp_size > 1 else 0))
    try:
        deployment.start()
        startup_s = deployment.wait_ready()
        traffic = Traffic(f"{deployment.url}/v1", deployment.model_id,
                          concurrency=concurrency, max_tokens=max_tokens).start()
        time.sleep(5.0)
        before = list(traffic.results)
        reference = reference_answers(before)
        victims = ["group-0", "group-0", "group-1" if num_groups > 1 else "group-0"]
        kinds = ("engine_core", "worker") if dp_size > 1 else ("engine_core", "worker",
                                                               "replica")
        kills = []
        for kind, group in zip(kinds, victims):
            log(f"killing {kind} of {group} under load")
            kills.append(kill_under_load(deployment, traffic, kind, group,
                                         reference=reference))
            log(json.dumps(kills[-1]))
        results = traffic.stop()
        probes = run_probes(deployment.url, deployment.model_id)
    finally:
        deployment.stop()
    return {"date": now(), "commit": env["commit"], "worktree_clean": env["worktree_clean"],
            "device": env["device"], "layout": layout,
            "num_peer_groups": num_groups, "peer_group_size": size, "data_parallel_size": dp_size,
            "concurrency": concurrency, "max_tokens": max_tokens,
            "startup_s": round(startup_s, 1), "kills": kills,
            "answers_before": sum(r.ok for r in before),
            "answers_before_differing": sum(r.ok and r.text != reference.get(r.chat)
                                            for r in before),
            "requests": len(results), "lost_silently": sum(r.outcome == LOST for r in results),
            "failed_visibly": sum(not r.ok and r.outcome != LOST for r in results),
            **probe_summary(probes)}


def dp_text(result: dict) -> str:
    dp_size = result.get("data_parallel_size", 1)
    if dp_size == 1:
        return ""
    return (f" as {result['peer_group_size'] // dp_size} vLLM data-parallel gangs of "
            f"{dp_size} (4 experts per MLP; an engine kill restarts its whole DP gang)")


def markdown(result: dict) -> str:
    lines = [f"# Faults under load, local deployment ({result['date']}, commit "
             f"{result['commit']})", "",
             f"Device: {result['device']}. Layout {result['layout']}: "
             f"{result['num_peer_groups']} peer group(s) of {result['peer_group_size']} CPU "
             f"engine(s){dp_text(result)} (tiny Engram model, shm tables), Ray Serve LLM "
             "ingress, loopback only. "
             f"Traffic: {result['concurrency']} clients back to back, streamed and not, "
             f"completions and chat, {result['max_tokens']} tokens; a request is served only "
             "if its client saw finish_reason and [DONE].", "",
             "| kill (kill -9) | group | same generation | requests | lost silently | "
             "failed visibly | of them sent before detection | sent until back: answered / "
             "failed | 503 + Retry-After | traffic off (s) | back serving (s) | detection | "
             "engine restart | teardown | engine start | first answer | same answer |",
             "| --- " * 17 + "|"]
    for k in result["kills"]:
        r = k["recovery"]
        lines.append(f"| {k['kind']} | {k['group']} | {'yes' if k['same_generation'] else 'no'} "
                     f"| {k['requests']} | {k['lost_silently']} | {k['failed_visibly']} | "
                     f"{k['running_at_kill_failed']} | {k['window_ok']} / {k['window_failed']} "
                     f"| {k['failed_503_retry_after']} | {k['traffic_off_s']} | "
                     f"{k['recovered_s']} | {r.get('detection_s')} | "
                     f"{r.get('engine_restart_s')} | {r.get('teardown_s')} | "
                     f"{r.get('engine_start_s')} | {r.get('first_answer_s')} | "
                     f"{k['answers_checked'] - k['answers_differing']} / "
                     f"{k['answers_checked']} |")
    lines += ["", f"All requests: {result['requests']}, lost silently "
              f"{result['lost_silently']}, failed visibly {result['failed_visibly']}.",
              f"Greedy answers (one prompt per endpoint, temperature 0): before the first kill "
              f"{result['answers_before'] - result['answers_before_differing']} of "
              f"{result['answers_before']} the same text (the reference); same answer = "
              "complete answers from the kill on equal to it, token for token.",
              f"Malformed requests: {result['malformed_probes']} sent, "
              f"{result['malformed_4xx']} answered 4xx, {result['malformed_ok']} with a clean "
              f"short body; tracebacks in bodies: {result['tracebacks_in_bodies']}.", "",
              "Engine kills (engine_core, worker) restart the member's engine in place: "
              "detection = kill to the member marked restarting (the ingress stops sending it "
              "requests at once); engine restart = to the member serving again (dead "
              "processes reaped, new vLLM engine, slices re-attached from the replica's "
              "holder). Sent until back: requests sent from the detection until the member "
              "(or, for a replica, the new generation) served again; those sent between the "
              "kill and its detection could still reach the dead engine. "
              "traffic off: from the kill to the start of the last request that still went to "
              "the broken generation or failed other than by the ingress's fail-fast 503. "
              "Replica kills (coordinator clock): detection = kill to the generation marked "
              "broken (the ingress stops routing there at once); teardown = to the new gang's "
              "first member joining the coordinator (Serve's health checks or its actor-death "
              "notice, stopping the old gang, a fresh replica process importing Ray Serve LLM "
              "and vLLM); engine start = to every member ready (vLLM engine start, table load, "
              "rendezvous); first answer = to the first request the new generation answered. "
              "While a group recovers the other one serves all traffic.", "",
              "Errors seen by clients (first of each kind):", ""]
    for k in result["kills"]:
        lines += [f"- {k['kind']}: " + "; ".join(k["errors"]) if k["errors"] else
                  f"- {k['kind']}: none"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="2x1")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--workdir", default="/tmp/engram-ray-faults")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--append", action="store_true",
                        help="add this layout's table to latest.md (a run per layout)")
    add_results_argument(parser, "serving_faults")
    args = parser.parse_args()
    result = run(args.layout, args.concurrency, args.max_tokens, args.workdir, args.port)
    text = markdown(result)
    latest = Path(args.results) / "latest.md"
    if args.append and latest.exists():
        text = latest.read_text() + "\n" + text
    write_results(args.results, result, text)


if __name__ == "__main__":
    main()

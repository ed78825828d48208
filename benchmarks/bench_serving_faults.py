"""Faults under load on the local deployment, measured from the clients' side (issue 20).

    bash scripts/in_netns.sh python3 benchmarks/bench_serving_faults.py [--layout 2x1|1x2]

Starts the local deployment (`engram_ray.serving.local`, two CPU engines: `2x1` = two peer
groups of one engine, `1x2` = one group of two), runs steady traffic (`--concurrency` clients,
streamed and not, completions and chat; a request counts as served only if its client saw
finish_reason and [DONE]), kills an EngineCore (kill -9), waits until its group serves a new
generation, kills a Serve replica (of the other group with 2x1), waits again, then sends the
malformed-request table (`engram_ray.serving.probes`). Writes
`benchmarks/results/serving_faults_<date>_<commit>.json` and `.md`: per kill `requests`,
`lost_silently`, `failed_visibly`, `traffic_off_s`, `recovered_s` and the recovery's parts;
`malformed_probes`, `malformed_4xx`, `tracebacks_in_bodies`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUTS = {"2x1": (2, 1), "1x2": (1, 2)}


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB"


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=RESULTS.parent.parent).stdout.strip() or "unknown"


def run(layout: str, concurrency: int, max_tokens: int, workdir: str, port: int) -> dict:
    from engram_ray.serving.faults import kill_under_load
    from engram_ray.serving.loadgen import LOST, Traffic
    from engram_ray.serving.local import LocalDeployment, LocalOptions, log
    from engram_ray.serving.probes import probe_summary, run_probes

    num_groups, size = LAYOUTS[layout]
    code_commit = commit()  # the code this run imports, whatever lands while it runs
    deployment = LocalDeployment(LocalOptions(workdir=workdir, port=port, name="faults",
                                              num_peer_groups=num_groups,
                                              peer_group_size=size))
    try:
        deployment.start()
        startup_s = deployment.wait_ready()
        traffic = Traffic(f"{deployment.url}/v1", deployment.model_id,
                          concurrency=concurrency, max_tokens=max_tokens).start()
        time.sleep(5.0)
        victims = ["group-0", "group-1" if num_groups > 1 else "group-0"]
        kills = []
        for kind, group in zip(("engine_core", "replica"), victims):
            log(f"killing {kind} of {group} under load")
            kills.append(kill_under_load(deployment, traffic, kind, group))
            log(json.dumps(kills[-1]))
        results = traffic.stop()
        probes = run_probes(deployment.url, deployment.model_id)
    finally:
        deployment.stop()
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": code_commit, "device": machine(), "layout": layout,
            "num_peer_groups": num_groups, "peer_group_size": size,
            "concurrency": concurrency, "max_tokens": max_tokens,
            "startup_s": round(startup_s, 1), "kills": kills,
            "requests": len(results), "lost_silently": sum(r.outcome == LOST for r in results),
            "failed_visibly": sum(not r.ok and r.outcome != LOST for r in results),
            **probe_summary(probes)}


def write(result: dict) -> Path:
    day = result["date"][:10]
    suffix = "" if result["layout"] == "2x1" else f"_{result['layout']}"
    stem = RESULTS / f"serving_faults_{day}_{result['commit']}{suffix}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Faults under load, local deployment ({result['date']}, commit "
             f"{result['commit']})", "",
             f"Device: {result['device']}. Layout {result['layout']}: "
             f"{result['num_peer_groups']} peer group(s) of {result['peer_group_size']} CPU "
             f"engine(s) (tiny Engram model, shm tables), Ray Serve LLM ingress, loopback only. "
             f"Traffic: {result['concurrency']} clients back to back, streamed and not, "
             f"completions and chat, {result['max_tokens']} tokens; a request is served only "
             "if its client saw finish_reason and [DONE].", "",
             "| kill (kill -9) | group | requests | lost silently | failed visibly | "
             "503 + Retry-After | traffic off (s) | recovered (s) | detection | teardown | "
             "engine start | first answer |", "| --- " * 12 + "|"]
    for k in result["kills"]:
        r = k["recovery"]
        lines.append(f"| {k['kind']} | {k['group']} | {k['requests']} | {k['lost_silently']} "
                     f"| {k['failed_visibly']} | {k['failed_503_retry_after']} | "
                     f"{k['traffic_off_s']} | {k['recovered_s']} | {r.get('detection_s')} | "
                     f"{r.get('teardown_s')} | {r.get('engine_start_s')} | "
                     f"{r.get('first_answer_s')} |")
    lines += ["", f"All requests: {result['requests']}, lost silently "
              f"{result['lost_silently']}, failed visibly {result['failed_visibly']}.",
              f"Malformed requests: {result['malformed_probes']} sent, "
              f"{result['malformed_4xx']} answered 4xx, {result['malformed_ok']} with a clean "
              f"short body; tracebacks in bodies: {result['tracebacks_in_bodies']}.", "",
              "traffic off: from the kill to the start of the last request that still went to "
              "the broken generation or failed other than by the ingress's fail-fast 503. "
              "Recovery parts (coordinator clock): detection = kill to the generation marked "
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
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return stem.with_suffix(".md")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="2x1")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--workdir", default="/tmp/engram-ray-faults")
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args()
    result = run(args.layout, args.concurrency, args.max_tokens, args.workdir, args.port)
    print(f"wrote {write(result)}")


if __name__ == "__main__":
    main()

"""Serving under load on the local deployment (loopback only): concurrent streams, then one
engine killed while requests are in flight, and the time until the deployment serves again.

    bash scripts/in_netns.sh python3 benchmarks/bench_serving.py [--streams 100] [--kill]

Starts the local deployment (`engram_ray.serving.local`, two CPU engines in one peer group),
runs `--streams` concurrent streams (half completions, half chat, `--max-tokens` each; bounded
by `--timeout`), records the latency distribution, optionally kills one engine under load, and
writes `benchmarks/results/serving/latest.md` and appends to `history.jsonl` (device, date,
commit, figures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB"


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=RESULTS.parent.parent).stdout.strip() or "unknown"


def kill_one_engine(deployment, num_streams: int, max_tokens: int) -> dict:
    """Kill one engine replica while `num_streams` streams run and a prober sends one small
    request after another; time until the new generation answers (the whole group restarted:
    Serve's RESTART_GANG) and until both engines report it healthy. Every probe answer carries
    its generation; an old one answering after the new one fails the run."""
    import ray

    from engram_ray.serving.loadgen import check_generation_order, probe_generations, run_load
    from engram_ray.serving.summary import engine_row, merge_by_engine

    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if "EngramLLMServer" in a["name"]]
    victim = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])
    box, stop = {}, threading.Event()
    url = f"{deployment.url}/v1"
    loader = threading.Thread(target=lambda: box.update(report=run_load(
        url, deployment.model_id, num_streams=num_streams, max_tokens=max_tokens,
        timeout_s=180)))
    prober = threading.Thread(target=lambda: box.update(
        answers=probe_generations(url, deployment.model_id, stop)))
    prober.start()
    loader.start()
    time.sleep(1.0)
    killed_at = time.monotonic()
    ray.kill(victim, no_restart=True)
    loader.join(240)
    restored = None
    while restored is None and time.monotonic() - killed_at < 900:
        time.sleep(1)
        try:
            rows = [engine_row(samples) for samples in
                    merge_by_engine(deployment.metrics_texts()[0]).values()]
        except Exception:  # still restarting
            continue
        if len(rows) == 2 and all(r["healthy"] and r["generation"] >= 2 for r in rows):
            restored = time.monotonic() - killed_at
    time.sleep(2)
    stop.set()
    prober.join(120)
    answers = box["answers"]
    (order,) = check_generation_order(answers).values()
    new = order[-1]
    first_new = next(at for at, gen in answers if gen == new) - killed_at
    last_old = max((at for at, gen in answers if gen == order[0]), default=killed_at) - killed_at
    return {"killed": names[0]["name"], "generations": order,
            "last_old_generation_answer_after_kill_s": round(last_old, 2),
            "new_generation_first_answer_after_kill_s": round(first_new, 1),
            "group_healthy_after_kill_s": round(restored, 1) if restored else None,
            "probe_answers": sum(gen is not None for _, gen in answers),
            "probe_failures": sum(gen is None for _, gen in answers),
            "in_flight": box["report"].summary()}


def write_results(result: dict) -> Path:
    """`results/serving/latest.md` (this run) and one line appended to `history.jsonl`."""
    folder = RESULTS / "serving"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "history.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    load = result["load"]
    lines = [f"# Serving on the local deployment ({result['date']}, commit {result['commit']})",
             "", f"Device: {result['device']}. Two vLLM CPU engines (tiny Engram model) in one "
             "peer group (shm), one Serve gang, Ray Serve LLM ingress, loopback only.", "",
             f"Load: {load['num_streams']} concurrent streams (half completions, half chat), "
             f"{result['max_tokens']} tokens each: {load['num_failed']} failed, wall "
             f"{load['wall_s']} s, ready after {result['startup_s']} s.", "",
             "| latency (s) | p50 | p90 | p99 | max | mean |", "| --- | --- | --- | --- | --- | --- |"]
    for name in ("ttft_s", "total_s"):
        p = load[name]
        lines.append(f"| {name} | " + " | ".join(f"{p[k]:.3f}" for k in
                                                 ("p50", "p90", "p99", "max", "mean")) + " |")
    if "kill" in result:
        kill = result["kill"]
        lines += ["", "One engine killed under load (Serve restarts its whole group: "
                  "RESTART_GANG):", "", "| from the kill to | s |", "| --- | --- |",
                  f"| the old generation's last answer | "
                  f"{kill.get('last_old_generation_answer_after_kill_s')} |",
                  f"| the new generation's first answer (group serving again) | "
                  f"{kill.get('new_generation_first_answer_after_kill_s')} |",
                  f"| both engines healthy on the new generation | "
                  f"{kill.get('group_healthy_after_kill_s')} |", "",
                  f"Generations that answered, in order: {kill.get('generations')} "
                  f"({kill.get('probe_answers')} probe answers, {kill.get('probe_failures')} "
                  "failed while no generation served; none from the old generation after the "
                  "new one).", "", f"In-flight streams at the kill: {json.dumps(kill['in_flight'])}"]
    (folder / "latest.md").write_text("\n".join(lines) + "\n")
    return folder / "latest.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--kill", action="store_true", help="also kill one engine under load")
    parser.add_argument("--workdir", default="/tmp/engram-ray-bench")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()

    from engram_ray.serving.loadgen import run_load
    from engram_ray.serving.local import LocalDeployment, LocalOptions, log

    deployment = LocalDeployment(LocalOptions(workdir=args.workdir, port=args.port))
    try:
        deployment.start()
        startup_s = deployment.wait_ready()
        run_load(f"{deployment.url}/v1", deployment.model_id, num_streams=4, max_tokens=4)
        report = run_load(f"{deployment.url}/v1", deployment.model_id,
                          num_streams=args.streams, max_tokens=args.max_tokens,
                          timeout_s=args.timeout)
        result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "commit": commit(), "device": machine(), "max_tokens": args.max_tokens,
                  "startup_s": round(startup_s, 1), "load": report.summary()}
        log(f"load: {json.dumps(result['load'])}")
        if args.kill:
            result["kill"] = kill_one_engine(deployment, 20, 300)
            log(f"kill: {json.dumps(result['kill'])}")
        log(f"wrote {write_results(result)}")
    finally:
        deployment.stop()


if __name__ == "__main__":
    main()

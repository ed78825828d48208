"""The engram-ray ingress against Ray Serve LLM's plain OpenAI app, side by side in one run
(issue 28, "the front door scales").

    TMPDIR=/tmp/engram-ray-tmp VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled \\
        bash scripts/in_netns.sh python3 benchmarks/bench_ingress.py [--quick]

(TMPDIR a folder you clean.) The targets: with the default ingress settings
(`serving.ingress.num_replicas` 2) against `ray.serve.llm.build_openai_app`'s defaults (one
ingress replica), and with two ingress replicas against its ingress with two, at least 90% of
its requests per second on the same tiny model and a p50 latency at most 5% above its.

Two vLLM CPU engines (one {"CPU": 1} bundle each) and six front doors serve the whole run,
side by side in one Ray instance; nothing is redeployed while it measures:

    the plain engine, `build_openai_app`'s, of the engram engine's own LLMConfig
               (`engram_ray.serve.app.llm_config`: engine kwargs with eager mode and no prefix
               caching, the bundle, health checks, max_ongoing_requests) less its engram
               settings, with two front doors:
      plain          its ingress as `build_openai_app` builds it (one replica, at num_cpus 0
                     as the engram ingress), at /plain
      plain-2        the same ingress with two replicas (`build_openai_app`'s
                     `ingress_deployment_config` num_replicas 2) over the same engine, at
                     /plain-2
    the engram engine (`LocalDeployment`, one peer group of one engine), with four front
               doors over that one group (the group, its engine and the coordinator shared):
      engram-2       the app's own front door at /: engram-ray's ingress as configured by
                     default (2 replicas), deployed as `serve deploy` deploys it
      engram-1       the same ingress (`engram_ray.serve.app._ingress`, as `build_app` makes
                     it) with serving.ingress.num_replicas 1, at /engram-1
      engram-1-threads  engram-1 without `engram_ray.serve.app.INGRESS_ENV_VARS` (Serve's
                     default threads: user code in a thread of its own, the router in a loop
                     of its own), at /engram-1-threads
      ray-ingress    Ray Serve LLM's own `OpenAiIngress`, made as build_openai_app makes it
                     (one replica), over the same group, at /ray-ingress: against it, engram-1
                     is the ingress's cost alone (engine and member router shared)

How: after every front door has answered a warm-up of every request kind
(`engram_ray.local.warmup`), each cycle (`--cycles`) measures every PAIR below (the order
rotated by one per cycle): an engram-engine front door's window and a plain one's, one right
after the other (which goes first alternates by cycle):

    engram-2 / plain     the default against build_openai_app's default (the first target)
    engram-2 / plain-2   two ingress replicas against two (the second target)
    engram-1 / plain     one against one
    ray-ingress / plain  Ray's ingress on each engine: what the engines alone differ by
    engram-1-threads / plain   engram-1 without INGRESS_ENV_VARS (a diagnostic: what running
                         the ingress's code and router on the replica's one event loop does)

In a window `--concurrency` closed-loop clients (`engram_ray.local.loadgen.Traffic`:
completions and chat, streamed and not, in turn; `--max-tokens`, greedy, one prompt) send to
one front door for `--warmup-s`, then `--duration-s` measured. Requests that ended in a window
count: req/s = answered / window, p50 and p99 of the client's whole-request time; a request is
answered only when its client saw it complete. Beside them, the CPU time (user + system,
psutil) each role's processes used in the window per answered request: the serving front
door's ingress replicas, the engine replica with its vLLM processes, Serve's proxy, the
coordinator, the clients, the whole host.

Why pairs: on 2 shared cores the machine's speed drifts by more than the ingress costs (runs
of this benchmark that deployed each case alone, one after another, saw one case's req/s move
23 -> 32 between consecutive cases). Everything is up all the time, so the idle parts'
background costs fall on both windows of a pair, and a front door's figures are divided by the
plain window beside it: req/s ratio = the front door's answered requests / plain's over the
same number of windows, p50 ratio of the pooled latencies, and the median of the pairs'
ratios beside. Against ray-ingress, the engram front doors' ratio to plain is divided by
its. Why nothing is swapped: runs that replaced the engram app's front door in place
before each pair (b80a7d9 to 696ca28) measured what follows a swap (new replicas and Ray
workers starting, old ones stopping) in the front door's windows: in 696ca28's run the pairs
whose front door window came first, right after its swap, had a median req/s ratio of 0.89x,
those where plain's came first 0.95x.

The engines differ in where the Engram table lives (the engram engine: a peer-group slice in
shared memory, its lookups timed for its metrics; the plain one: whole in the engine process,
filled by vLLM's weight loading), so against plain the figures are the whole stack (the
issue's target); against ray-ingress the ingress alone.

Pooled over runs: plain's own windows vary by about 10% in req/s within a run (the pairs'
ratios of one run ranged over 0.72x-1.27x in the runs of 2026-12-05), so one run's pooled
ratios move by a few percent from run to run. latest.md therefore also pools every pair of
every run in `history.jsonl` that measured this way (all front doors up, none swapped: pairs
without `swap_s`) with this
run's: per pair of front doors, the req/s ratio of the summed requests, the median of the
pairs' p50 ratios, and 95% bootstrap intervals of both (resampled pairs).

`--pairs` measures only the pairs named (e.g. `--pairs engram-2/plain,engram-2/plain-2`, the
two targets' pairs, to add pairs to the pooled figures in less time); every front door is up
all the same, so the idle ones cost what they cost in a run of every pair.

Writes `benchmarks/results/ingress/latest.md` and a line of its `history.jsonl` (`--results
DIR` elsewhere); `--quick` (one short cycle) only prints its table: a smoke run, not a result.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import add_results_argument, environment, write_results  # noqa: E402

# Front doors over the engram engine -> their ingress replicas (None: the default: the
# config's, or build_openai_app's).
ENGRAM_DOORS = {"engram-2": None, "engram-1": 1, "engram-1-threads": 1}
# Front doors without engram-ray's INGRESS_ENV_VARS: Serve's default threads and loops.
SERVE_THREADS = ("engram-1-threads",)
RAY_DOORS = {"ray-ingress": None}
DEFAULT_DOOR = "engram-2"  # the engram app's own front door (the config's default), at /
PLAIN = "plain"  # build_openai_app's application: its name and route (/plain)
PLAIN_2 = "plain-2"  # its ingress with two replicas, over its engine (/plain-2)
BASES = (PLAIN, PLAIN_2)
# Each pair: (front door over the engram engine, plain front door) (module doc).
PAIRS = (("engram-2", PLAIN), ("engram-2", PLAIN_2), ("engram-1", PLAIN),
         ("ray-ingress", PLAIN), ("engram-1-threads", PLAIN))
MIN_RPS_RATIO, MAX_P50_RATIO = 0.90, 1.05  # issue 28's targets
KINDS = {f"{'chat' if chat else 'completions'}{'_stream' if stream else ''}": (chat, stream)
         for chat in (False, True) for stream in (False, True)}


def plain_app(deployment):
    """`build_openai_app` of the engram engine's LLMConfig without its engram settings (its
    ingress as Ray Serve LLM builds it, at num_cpus 0)."""
    from ray.serve.llm import build_openai_app

    return build_openai_app({"llm_configs": [plain_llm_config(deployment)],
                             "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}})


def plain_llm_config(deployment):
    """The engram engine's LLMConfig without its engram settings."""
    from ray.serve.llm import LLMConfig

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
    return config


def ray_ingress(config, engines: dict, replicas: int | None = None):
    """Ray Serve LLM's `OpenAiIngress` over the engine deployment of `engines` ({group:
    (deployment, application)} as `engram_ray.serve.app._ingress` takes them; the first),
    with the options `build_openai_app` gives it (as in `plain_app`) and `replicas` if set."""
    from ray import serve
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.builder import (
        maybe_apply_llm_deployment_config_defaults)
    from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress, make_fastapi_ingress

    ingress = {"ray_actor_options": {"num_cpus": 0}}
    if replicas is not None:
        ingress["num_replicas"] = replicas
    options = maybe_apply_llm_deployment_config_defaults(
        OpenAiIngress.get_deployment_options([config]), ingress)
    deployment, app_name = next(iter(engines.values()))  # the group's own application
    return serve.deployment(make_fastapi_ingress(OpenAiIngress), **options).bind(
        llm_deployments={config.model_id: serve.get_deployment_handle(
            deployment, app_name, _check_exists=False)},
        model_cards={config.model_id: to_model_metadata(config.model_id, config)},
        lora_paths={})


def deploy_plain(deployment) -> float:
    """The plain app beside the engram app, at /plain; seconds until it answers."""
    from ray.serve.api import _run

    from engram_ray.local.deployment import log

    log(f"deploying {PLAIN}: ray.serve.llm.build_openai_app at /{PLAIN}")
    # serve.run of the extra front doors beside the deployment's declarative apps (Serve deletes
    # only declarative apps a new config leaves out); _run(_blocking=False) returns at once.
    _run(plain_app(deployment), _blocking=False, name=PLAIN, route_prefix=f"/{PLAIN}")
    return wait_settled(PLAIN, f"{deployment.url}/{PLAIN}", deployment.options.startup_timeout_s)


def plain_segments() -> set[str]:
    """The shared-memory segments (vLLM's ring buffers) the plain engine's processes map now:
    engram-ray's replicas record and release their engines' own, the plain app's are the
    benchmark's to release (`release_plain_segments`)."""
    import psutil

    from engram_ray.serve.member.engine_shm import mapped_segments

    found = set()
    for process in psutil.process_iter(["cmdline"]):
        title = " ".join(process.info["cmdline"] or []).split(" ")[0]
        if title.startswith(f"ray::ServeReplica:{PLAIN}:LLMServer"):
            found.update(mapped_segments(process.pid))
    return found


def release_plain_segments(paths: set[str], wait_s: float = 30.0) -> None:
    """Unlink `paths` once no process maps them (the plain engine's exit after Ray's stop)."""
    from engram_ray.local.deployment import log
    from engram_ray.serve.member.engine_shm import release_segments

    log(f"releasing the plain engine's shared memory: {sorted(paths) or 'none found'}")
    deadline = time.monotonic() + wait_s
    while (kept := release_segments(sorted(paths))) and time.monotonic() < deadline:
        time.sleep(1.0)
    if kept:
        log(f"left in use after {wait_s:.0f} s (not removed): {kept}")


def door_app(deployment, door: str):
    """Front door `door` (not engram-2, the engram app's own) as its own application over the
    engram app's group: the engram ingress as `build_app` makes it (`_ingress`), or Ray's."""
    import copy

    from engram_ray.planning.grouping import Domain, PeerGroupPlan
    from engram_ray.serve import app
    from engram_ray.serve.settings.config import ServeAppConfig

    args = copy.deepcopy(deployment.args)
    if door in ENGRAM_DOORS:
        args["serving"]["ingress"] = {"num_replicas": ENGRAM_DOORS[door]}
    config = ServeAppConfig.from_dict(args)
    name, server_cls = config.deployment.name, app.server_class(config)
    groups = [f"group-{i}" for i in range(config.serving.num_peer_groups)]
    engines = app.group_engines(server_cls, name, groups)
    llm = app.llm_config(config, PeerGroupPlan(groups[0], Domain("local", (), 1, {}), 0, 1))
    if door in RAY_DOORS:
        return ray_ingress(llm, engines, RAY_DOORS[door])
    if door in SERVE_THREADS:
        from unittest import mock

        with mock.patch.object(app, "INGRESS_ENV_VARS", {}):
            return app._ingress(llm, engines, name)
    return app._ingress(llm, engines, name)


def plain_2_app(deployment):
    """Ray Serve LLM's ingress with two replicas over the plain app's engine."""
    from ray import serve

    engine = next(name for name in serve.status().applications[PLAIN].deployments
                  if name.startswith("LLMServer"))
    return ray_ingress(plain_llm_config(deployment), {PLAIN: (engine, PLAIN)}, replicas=2)


def deploy_doors(deployment) -> dict[str, str]:
    """Every front door up, each its own application at /<door> (engram-2: the engram app's
    own, at /; plain: build_openai_app's, deployed before): {door: its base url}."""
    from ray.serve.api import _run

    from engram_ray.local.deployment import log

    urls = {DEFAULT_DOOR: deployment.url, PLAIN: f"{deployment.url}/{PLAIN}"}
    for door in (*ENGRAM_DOORS, *RAY_DOORS, PLAIN_2):
        if door in urls:
            continue
        log(f"deploying front door {door} at /{door}")
        app = plain_2_app(deployment) if door == PLAIN_2 else door_app(deployment, door)
        _run(app, _blocking=False, name=door, route_prefix=f"/{door}")
        urls[door] = f"{deployment.url}/{door}"
    for door, url in urls.items():
        settled_s = wait_settled(app_name(deployment, door), url,
                                 deployment.options.startup_timeout_s)
        log(f"{door} settled after {settled_s:.0f} s")
    return urls


def app_name(deployment, door: str) -> str:
    return deployment.app_name if door == DEFAULT_DOOR else door


def wait_settled(app_name: str, url: str, timeout_s: float) -> float:
    """Until `app_name` runs, each of its deployments has only RUNNING replicas (a replaced
    front door's old ones gone), and `url` answers; seconds it took."""
    from ray import serve

    from engram_ray.local.deployment import log

    start, last = time.monotonic(), None
    while (elapsed := time.monotonic() - start) < timeout_s:
        app = serve.status().applications.get(app_name)
        if app is not None and app.status == "DEPLOY_FAILED":
            raise RuntimeError(f"{app_name}: deployment failed: {app.message}")
        replicas = {} if app is None else {
            name: dict(dep.replica_states) for name, dep in app.deployments.items()}
        settled = all(set(states) == {"RUNNING"} for states in replicas.values())
        if app is not None and app.status == "RUNNING" and replicas and settled \
                and _answers(f"{url}/v1/models"):
            return elapsed
        state = f"{getattr(app, 'status', 'waiting for the application')} {replicas}"
        if state != last:
            log(f"{elapsed:5.0f} s  {app_name}: {state}")
            last = state
        time.sleep(1.0)
    raise RuntimeError(f"{app_name} was not settled after {timeout_s:.0f} s")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def replicas_running(app_names) -> dict[str, int]:
    """{deployment: running replicas} of the applications `app_names`."""
    from ray import serve

    status = serve.status().applications
    return {name: dep.replica_states.get("RUNNING", 0) for app_name in app_names
            for name, dep in status[app_name].deployments.items()}


def role_processes(ingress_apps, engine_apps) -> dict[str, list]:
    """role -> its processes now (with their children), from the titles Ray gives its actors'
    processes ("ray::ServeReplica:<app>:<deployment>", "ray::ProxyActor", ...): `ingress`, the
    replicas of `ingress_apps`' ingress deployments; `engine`, those of `engine_apps`' engine
    deployments with their vLLM processes; `proxy`; `coordinator`; `clients`, this process (the
    load generator's threads)."""
    import psutil

    procs = {"ingress": [], "engine": [], "proxy": [], "coordinator": []}
    for process in psutil.process_iter(["cmdline"]):
        title = " ".join(process.info["cmdline"] or []).split(" ")[0]
        if not title.startswith("ray::"):
            continue
        parts = title.split(":")  # ray, "", ServeReplica, app, deployment (may hold ":")
        app_name, deployment = ((parts[3], ":".join(parts[4:]))
                                if parts[2:3] == ["ServeReplica"] and len(parts) > 4 else ("", ""))
        if app_name in ingress_apps and "Ingress" in deployment:
            role = "ingress"
        elif app_name in engine_apps and "LLMServer" in deployment:
            role = "engine"
        elif "ProxyActor" in title:
            role = "proxy"
        elif "Coordinator" in title:
            role = "coordinator"
        else:
            continue
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


def measure(url: str, model_id: str, procs: dict, label: str, args,
            settle_s: float = 0.0) -> tuple[dict, list]:
    """`args.concurrency` closed-loop clients on `url` for `args.warmup_s` (+ `settle_s`), then
    `args.duration_s` measured: (figures, the requests that ended in the window)."""
    from engram_ray.local.deployment import log
    from engram_ray.local.loadgen import Traffic

    traffic = Traffic(f"{url}/v1", model_id, concurrency=args.concurrency,
                      max_tokens=args.max_tokens).start()
    time.sleep(args.warmup_s + settle_s)
    load_before = os.getloadavg()[0]
    cpu_before = cpu_seconds(procs)
    begin = time.monotonic()
    time.sleep(args.duration_s)
    end = time.monotonic()
    cpu_after = cpu_seconds(procs)
    window = [r for r in traffic.stop() if begin <= r.ended_at <= end]
    row = {**figures(window, end - begin, args.concurrency),
           "cpu_s": {role: round(cpu_after[role] - cpu_before[role], 2) for role in cpu_after},
           "load_avg_1m_before": round(load_before, 1)}
    log(f"{label}: {row['answered']} answered, {row['failed']} failed, {row['rps']} req/s, "
        f"p50 {row['p50_ms']} ms")
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


def ratios(case: dict, base: dict) -> dict:
    """req/s ratio and p50 ratio of `case` to `base`, whether the targets are met (with no
    failed request in either)."""
    if not base["rps"] or not base["p50_ms"] or case["p50_ms"] is None:
        return {"rps_ratio": None, "p50_ratio": None, "met": False}
    return _met(case["rps"] / base["rps"], case["p50_ms"] / base["p50_ms"],
                not case["failed"] and not base["failed"])


def _met(rps_ratio: float, p50_ratio: float, no_failures: bool = True) -> dict:
    return {"rps_ratio": round(rps_ratio, 3), "p50_ratio": round(p50_ratio, 3),
            "met": rps_ratio >= MIN_RPS_RATIO and p50_ratio <= MAX_P50_RATIO and no_failures}


def pair_orders(cycles: int, pairs=PAIRS) -> list[tuple[tuple[str, str], ...]]:
    """The pairs of each cycle, rotated by one per cycle: none always first or last."""
    n = len(pairs)
    return [pairs[i % n:] + pairs[:i % n] for i in range(cycles)]


def run(args) -> dict:
    from engram_ray.local.deployment import LocalDeployment, LocalOptions, log
    from engram_ray.local.warmup import warm_up

    env = environment()  # the code this run imports, whatever lands while it runs
    deployment = LocalDeployment(LocalOptions(workdir=args.workdir, port=args.port,
                                              name="frontdoor", num_peer_groups=1,
                                              peer_group_size=1))
    plain_url = f"{deployment.url}/{PLAIN}"
    segments: set[str] = set()
    pairs, windows = [], {}  # (door, base, side) -> the requests of those windows
    try:
        deployment.start()  # its front door: the default, engram-2
        log(f"engram app ready after {deployment.wait_ready():.0f} s")
        log(f"{PLAIN} ready after {deploy_plain(deployment):.0f} s")
        urls = deploy_doors(deployment)
        warm_up(plain_url, deployment.model_id, num_engines=1)
        segments = plain_segments()  # its engine makes them by the time it has served
        # 4 requests of each kind at once: every ingress replica (at most 2) sees each.
        warmups = {door: sum(len(w["errors"]) for w in warm_up(url, deployment.model_id,
                                                               num_engines=2))
                   for door, url in urls.items()}
        running = {door: replicas_running([app_name(deployment, door)]) for door in urls}
        engine_apps = {door: [PLAIN] if door in BASES else deployment.applications[1:]
                       for door in urls}
        first = True
        for cycle, order in enumerate(pair_orders(args.cycles, args.pairs)):
            for door, base in order:
                pair = {"cycle": cycle + 1, "door": door, "base": base,
                        "replicas_running": {door: running[door], base: running[base]},
                        "warmup_errors": warmups[door] + warmups[base],
                        "first": (door, base)[cycle % 2]}
                for side, name in (("door", door), ("base", base))[::1 if cycle % 2 == 0 else -1]:
                    label = f"cycle {cycle + 1}/{args.cycles}, {door} / {base} pair, {name}"
                    row, window = measure(urls[name], deployment.model_id,
                                          role_processes([app_name(deployment, name)],
                                                         engine_apps[name]), label, args,
                                          args.settle_s if first else 0.0)
                    first = False
                    pair[f"{side}_row"] = row
                    windows.setdefault((door, base, side), []).extend(window)
                pair.update(ratios(pair["door_row"], pair["base_row"]))
                pairs.append(pair)
                log(f"cycle {cycle + 1}, {door} / {base}: req/s {pair['rps_ratio']}x, "
                    f"p50 {pair['p50_ratio']}x")
    finally:
        segments |= plain_segments()
        deployment.stop()
        release_plain_segments(segments)
    return summarize(env, args, pairs, windows)


def case_names(door: str, base: str) -> tuple[str, str]:
    """The names of a pair's pooled front-door and plain windows."""
    return f"{door} (beside {base})", f"{base} (beside {door})"


def summarize(env: dict, args, pairs: list[dict], windows: dict) -> dict:
    """Pooled figures of each pair's two sides; ratios; against ray-ingress."""
    cases, comparison = {}, {"pairs": {}}
    for door, base in args.pairs:
        of_pair = [p for p in pairs if (p["door"], p["base"]) == (door, base)]
        for side, name in zip(("door", "base"), case_names(door, base)):
            rows = [p[f"{side}_row"] for p in of_pair]
            cases[name] = figures(windows.get((door, base, side), []),
                                  sum(r["window_s"] for r in rows), args.concurrency)
            answered = cases[name]["answered"]
            cases[name]["cpu_ms_per_request"] = {
                role: round(1000 * sum(r["cpu_s"][role] for r in rows) / answered, 2)
                if answered else None for role in rows[0]["cpu_s"]}
        comparison["pairs"][f"{door} / {base}"] = {
            **ratios(*(cases[n] for n in case_names(door, base))),
            "median_of_pairs": _met(statistics.median(p["rps_ratio"] for p in of_pair),
                                    statistics.median(p["p50_ratio"] for p in of_pair)),
            "per_pair": [{k: p[k] for k in ("rps_ratio", "p50_ratio")} for p in of_pair]}
    # The engram front doors' ratios to plain over Ray's ingress's on the same engine.
    ray_door = next(iter(RAY_DOORS))
    ray = comparison["pairs"].get(f"{ray_door} / {PLAIN}")
    comparison[ray_door] = {} if ray is None else {
        door: _met(c["rps_ratio"] / ray["rps_ratio"], c["p50_ratio"] / ray["p50_ratio"],
                   not any(cases[name]["failed"] for pair in ((door, PLAIN), (ray_door, PLAIN))
                           for name in case_names(*pair)))
        for (door, base), c in zip(args.pairs, comparison["pairs"].values())
        if base == PLAIN and door in ENGRAM_DOORS}
    return {**{k: env[k] for k in ("date", "commit", "worktree_clean", "device")},
            "concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "warmup_s": args.warmup_s, "settle_s": args.settle_s,
            "duration_s": args.duration_s, "cycles": args.cycles,
            "pairs_measured": [f"{door} / {base}" for door, base in args.pairs],
            "targets": {"min_rps_ratio": MIN_RPS_RATIO, "max_p50_ratio": MAX_P50_RATIO},
            "cases": cases, "comparison": comparison,
            "pairs": [{k: v for k, v in p.items() if not k.endswith("_row")}
                      | {f"{side}_{key}": p[f"{side}_row"][key]
                         for side in ("door", "base") for key in ("rps", "p50_ms", "cpu_s")}
                      | {"load_avg_1m_before": p["door_row" if p["first"] == p["door"]
                                                 else "base_row"]["load_avg_1m_before"]}
                      for p in pairs]}


def markdown(result: dict) -> str:
    tree = "" if result["worktree_clean"] else " plus uncommitted changes"
    lines = [f"# Ingress against Ray Serve LLM's plain app ({result['date']}, commit "
             f"{result['commit']}{tree})", "",
             f"Device: {result['device']}. Two vLLM CPU engines side by side the whole run "
             "(tiny Engram model, eager, no prefix caching, one {\"CPU\": 1} bundle each), "
             "each behind its front doors, every one up the whole run: the engram engine "
             "(one peer group of one engine) behind engram-2 (engram-ray's ingress, default "
             "settings: 2 replicas), engram-1 (1 replica), engram-1-threads (1 replica, Serve's "
             "default threads) and ray-ingress (Ray Serve LLM's OpenAiIngress, 1 replica); the "
             "plain engine (`build_openai_app`) behind plain "
             "(its ingress as built: 1 replica) and plain-2 (the same with 2). Ray on "
             f"127.0.0.1, loopback only. Load: {result['concurrency']} closed-loop clients "
             "(completions and chat, streamed and not, in turn; "
             f"{result['max_tokens']} tokens, greedy) on one front door at a time: "
             f"{result['duration_s']:.0f} s measured per window after {result['warmup_s']:.0f} s "
             f"of the same load (the first window: {result['settle_s']:.0f} s more); "
             f"{result['cycles']} cycles, each measuring "
             + ("every pair" if len(result.get("pairs_measured", PAIRS)) == len(PAIRS) else
                "the pairs " + ", ".join(result["pairs_measured"]))
             + " (an engram-engine front door's window and a plain one's, one after the other, "
             "the first alternating by cycle). Times in ms, of the whole request as its client "
             "saw it.", "",
             "| windows | answered | failed | req/s | p50 | p99 | TTFT p50 (streamed) | "
             + " | ".join(f"p50 {kind}" for kind in KINDS) + " |", "|" + " --- |" * 11]
    for case, c in result["cases"].items():
        lines.append(f"| {case} | {c['answered']} | {c['failed']} | {c['rps']} | {c['p50_ms']} "
                     f"| {c['p99_ms']} | {c['ttft_p50_ms_streamed']} | "
                     + " | ".join(str(c[f"p50_ms_{kind}"]) for kind in KINDS) + " |")
    lines += ["", "CPU time per answered request (ms, user + system; `ingress`: the serving "
              "front door's ingress replicas; `engine`: its engine replica and vLLM processes; "
              "`clients`: the load generator; `host`: every process of the machine, the idle "
              "ones too):", ""]
    roles = list(next(iter(result["cases"].values()))["cpu_ms_per_request"])
    lines += ["| windows | " + " | ".join(roles) + " | ingress / host |",
              "|" + " --- |" * (len(roles) + 2)]
    for case, c in result["cases"].items():
        cpu = c["cpu_ms_per_request"]
        share = f"{cpu['ingress'] / cpu['host']:.1%}" if cpu.get("host") else "-"
        lines.append(f"| {case} | " + " | ".join(str(cpu[role]) for role in roles)
                     + f" | {share} |")
    target = (f"target: req/s ratio >= {MIN_RPS_RATIO}, p50 ratio <= {MAX_P50_RATIO}, no "
              "failed request")
    lines += ["", "Each pair, its front door's windows pooled over the plain windows beside "
              f"them (issue 28's targets: engram-2 / plain and engram-2 / plain-2; {target}):",
              "", "| pair | req/s ratio | p50 ratio | met | median of pairs: req/s, p50 | "
              "per pair: req/s ratio | per pair: p50 ratio |", "|" + " --- |" * 7]
    for label, c in result["comparison"]["pairs"].items():
        m = c["median_of_pairs"]
        lines.append(f"| {label} | {c['rps_ratio']} | {c['p50_ratio']} | "
                     f"{'yes' if c['met'] else 'no'} | {m['rps_ratio']}, {m['p50_ratio']} | "
                     f"{', '.join(str(p['rps_ratio']) for p in c['per_pair'])} | "
                     f"{', '.join(str(p['p50_ratio']) for p in c['per_pair'])} |")
    lines += ["", "Against `ray-ingress` (Ray Serve LLM's ingress over the same engine: the "
              "ingress's cost alone): the ratios to plain above divided by ray-ingress's "
              f"({target}):", "", "| front door | req/s ratio | p50 ratio | met |",
              "|" + " --- |" * 4]
    if not result["comparison"]["ray-ingress"]:
        measured = "ray-ingress / plain" in result.get("pairs_measured", [])
        lines.append(f"| (no {'engram front door / plain' if measured else 'ray-ingress / plain'}"
                     " pair measured in this run) | - | - | - |")
    for door, c in result["comparison"]["ray-ingress"].items():
        lines.append(f"| {door} | {c['rps_ratio']} | {c['p50_ratio']} | "
                     f"{'yes' if c['met'] else 'no'} |")
    lines += ["", "Each pair:", "", "| cycle | pair | first | replicas running | req/s | "
              "plain req/s | p50 | plain p50 | host load 1m before | CPU s in the front door's "
              "window: ingress, host | in plain's: ingress, host |", "|" + " --- |" * 11]
    for p in result["pairs"]:
        lines.append(f"| {p['cycle']} | {p['door']} / {p['base']} | {p['first']} | "
                     f"{json.dumps(p['replicas_running'])} | {p['door_rps']} | "
                     f"{p['base_rps']} | {p['door_p50_ms']} | {p['base_p50_ms']} | "
                     f"{p['load_avg_1m_before']} | {p['door_cpu_s']['ingress']}, "
                     f"{p['door_cpu_s']['host']} | {p['base_cpu_s']['ingress']}, "
                     f"{p['base_cpu_s']['host']} |")
    errors = sorted({e for c in result["cases"].values() for e in c["errors"]})
    if errors:
        lines += ["", "Errors seen (first of each kind):", ""] + [f"- {e}" for e in errors]
    return "\n".join(lines) + "\n"


def pooled_runs(history: Path, result: dict, resamples: int = 4000) -> dict:
    """{pair label: pooled figures} over this run and every run of `history` whose front
    doors were all up and never swapped (module doc, "Pooled over runs")."""
    import random

    runs = [json.loads(line) for line in history.read_text().splitlines() if line.strip()] \
        if history.exists() else []
    runs = [r for r in runs if r.get("pairs") and not any("swap_s" in p for p in r["pairs"])]
    by_label: dict[str, list] = {}
    failed = any(c["failed"] for run in [*runs, result] for c in run["cases"].values())
    for index, run in enumerate([*runs, result]):
        for p in run["pairs"]:
            base = p.get("base", PLAIN)  # adf06ff's run: every pair against plain
            door_rps, base_rps = p["door_rps"], p.get("base_rps", p.get("plain_rps"))
            p50_ratio = p["door_p50_ms"] / p.get("base_p50_ms", p.get("plain_p50_ms"))
            by_label.setdefault(f"{p['door']} / {base}", []).append(
                (door_rps * run["duration_s"], base_rps * run["duration_s"], p50_ratio, index))
    rng = random.Random(0)

    def interval(values: list, stat) -> list[float]:
        draws = sorted(stat([rng.choice(values) for _ in values]) for _ in range(resamples))
        return [round(draws[int(0.025 * resamples)], 3), round(draws[int(0.975 * resamples)], 3)]

    def rps(rows):
        return sum(r[0] for r in rows) / sum(r[1] for r in rows)

    def p50(rows):
        return statistics.median(r[2] for r in rows)

    return {label: {"pairs": len(rows), "runs": len({r[3] for r in rows}),
                    **_met(rps(rows), p50(rows), not failed),
                    "rps_ratio_95": interval(rows, rps), "p50_ratio_95": interval(rows, p50)}
            for label, rows in by_label.items()}


def pooled_markdown(pooled: dict) -> str:
    lines = ["", "Pooled over runs (this one and every earlier run in history.jsonl with all "
             "front doors up and none swapped; req/s ratio of the summed requests, median of "
             "the pairs' p50 ratios, 95% bootstrap intervals over the pairs; target: req/s "
             f"ratio >= {MIN_RPS_RATIO}, p50 ratio <= {MAX_P50_RATIO}):", "",
             "| pair | runs | pairs | req/s ratio | 95% interval | p50 ratio (median) | "
             "95% interval | met |", "|" + " --- |" * 8]
    for label, c in pooled.items():
        lines.append(f"| {label} | {c['runs']} | {c['pairs']} | {c['rps_ratio']} | "
                     f"{c['rps_ratio_95'][0]}-{c['rps_ratio_95'][1]} | {c['p50_ratio']} | "
                     f"{c['p50_ratio_95'][0]}-{c['p50_ratio_95'][1]} | "
                     f"{'yes' if c['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


def _pairs(text: str) -> tuple[tuple[str, str], ...]:
    known = {f"{door}/{base}": (door, base) for door, base in PAIRS}
    chosen = [name.strip().replace(" ", "") for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in known]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'no pair'}: pairs are "
                                         f"{', '.join(known)}")
    return tuple(known[name] for name in dict.fromkeys(chosen))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--warmup-s", type=float, default=8.0,
                        help="seconds of the load before each measured window")
    parser.add_argument("--duration-s", type=float, default=16.0,
                        help="seconds of each measured window")
    parser.add_argument("--cycles", type=int, default=6,
                        help="every pair measured (--pairs) once per cycle")
    parser.add_argument("--settle-s", type=float, default=60.0,
                        help="more seconds of load before the first window (it follows Ray's "
                             "start and the tiny model's making)")
    parser.add_argument("--pairs", type=_pairs, default=PAIRS, metavar="DOOR/BASE,...",
                        help="the pairs measured (all front doors stay up either way); "
                             "default: " + ",".join(f"{d}/{b}" for d, b in PAIRS))
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: one cycle of 8 s windows, nothing written")
    parser.add_argument("--workdir", default="/tmp/engram-ray-ingress")
    parser.add_argument("--port", type=int, default=8200)
    add_results_argument(parser, "ingress")
    args = parser.parse_args()
    for name in ("concurrency", "cycles"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.duration_s <= 0 or args.warmup_s < 0 or args.settle_s < 0:
        parser.error("--duration-s must be > 0, --warmup-s and --settle-s >= 0")
    if args.quick:
        args.cycles, args.warmup_s, args.settle_s, args.duration_s = 1, 3.0, 3.0, 8.0
    result = run(args)
    text = markdown(result)
    if args.quick:
        print(text)
    else:
        pooled = pooled_runs(Path(args.results) / "history.jsonl", result)
        write_results(args.results, {**result, "pooled_runs": pooled},
                      text + pooled_markdown(pooled))


if __name__ == "__main__":
    main()

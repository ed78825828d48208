"""The Ray Serve application of engram-ray: `import_path: engram_ray.serve.app:build_app`.

    serve deploy cluster_configs/serve_local_tiny.yaml      # args: {deployment, serving}

    build_app(args)
      plan groups     each of serving.num_peer_groups gets a domain   actors/placement.py
      coordinator     generations, store folders, slices, targets      actors/coordinator.py
      per group       one Serve deployment = one gang of P engines,    engram_ray.serve.replica
                      bundles label-selected to the group's domain,
                      requests only to members that serve      engram_ray.serve.member_router
      ingress         OpenAI API, requests spread over the groups      engram_ray.serve.ingress
                      request checks, caps, every error's shape         engram_ray.serve.api_guard

Built from Ray Serve LLM's parts: `LLMConfig`, `build_llm_deployment` with the replica class
swapped for an engram-ray engine, and its OpenAI ingress.
"""

from __future__ import annotations

from engram_ray.planning.grouping import PeerGroupPlan
from engram_ray.serve.config import ServeAppConfig


def engine_kwargs(app: ServeAppConfig) -> dict:
    """vLLM engine arguments of every replica (the peer-group settings are added per replica).

    CUDA graphs and prefix caching as vLLM decides, except for architectures that need other
    settings (`engram_ray.vllm.engine_settings`: the tiny model's per-KV-slot n-gram
    history needs eager mode and no prefix caching). `serving.host_kv_cache_gib` becomes
    vLLM's `kv_offloading_size` (native CPU KV-cache offloading, GiB per engine)."""
    from engram_ray.planning.host_kv import KV_OFFLOADING_ARG
    from engram_ray.vllm.engine_settings import architecture_engine_kwargs

    srv = app.serving
    kwargs = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "disable_log_stats": False,
              **architecture_engine_kwargs(srv.model_source)}
    if srv.max_model_len is not None:
        kwargs["max_model_len"] = srv.max_model_len
    if srv.data_parallel_size > 1:
        kwargs.update(data_parallel_size=srv.data_parallel_size,
                      enable_expert_parallel=srv.enable_expert_parallel)
    host_kv_gib = app.host_kv_offloading_gib()
    if host_kv_gib is not None:
        kwargs[KV_OFFLOADING_ARG] = host_kv_gib
    kwargs.update(srv.engine_kwargs)  # never kv_offloading_size with it (refused in the config)
    return kwargs


def llm_config(app: ServeAppConfig, group: PeerGroupPlan):
    """The Ray Serve LLM `LLMConfig` of the engines of peer group `group`."""
    from ray.serve.llm import LLMConfig

    from engram_ray.serve.replica import APP_CONFIG_KEY, GROUP_KEY

    srv, dep = app.serving, app.deployment
    deployment_config = {
        "health_check_period_s": dep.health_check_interval_s,
        # A member that does not answer max_missed_pings health checks in a row is taken for
        # dead (Serve then restarts its whole group); a dead actor is noticed at once.
        "health_check_timeout_s": dep.health_check_interval_s * dep.max_missed_pings,
        "max_ongoing_requests": 256,
        "ray_actor_options": {"num_cpus": 0},  # its CPUs are in the bundle
        **srv.deployment_options,  # passthrough; the keys groups own are refused in the config
    }
    # log_engine_metrics False by default: vLLM's own vllm:* series go to the engine's
    # /metrics. True (serving.llm_config): Ray's stat logger replaces vLLM's prometheus one,
    # so they go to Ray's metrics export as ray_vllm_* instead (never both: vLLM adds its own
    # only when no given logger is a PrometheusStatLogger).
    options = {"log_engine_metrics": False, **srv.llm_config}
    return LLMConfig(
        model_loading_config={"model_id": srv.model_id, "model_source": srv.model_source},
        engine_kwargs=engine_kwargs(app),
        deployment_config=deployment_config,
        placement_group_config={"bundles": [dict(dep.bundle)]},
        experimental_configs={APP_CONFIG_KEY: app.to_dict(),
                              GROUP_KEY: {"group_id": group.group_id,
                                          "domain_id": group.domain.domain_id}},
        **options,
    )


def ingress_options(srv) -> dict:
    """The ingress deployment's options: `serving.ingress` replicas (or autoscaling), no CPUs
    (the engines take every CPU), and a new replica started before an old one stops when a
    changed config rolls out (`max_surge_percent`: the front door is never down)."""
    options = {"ray_actor_options": {"num_cpus": 0}, "max_surge_percent": 100}
    if srv.ingress.autoscaling_config is not None:
        return {**options, "autoscaling_config": dict(srv.ingress.autoscaling_config)}
    return {**options, "num_replicas": srv.ingress.num_replicas}


def server_class(app: ServeAppConfig):
    from engram_ray.serve.replica import EngramDPServer, EngramLLMServer

    return EngramDPServer if app.serving.data_parallel_size > 1 else EngramLLMServer


def build_app(args: dict):
    """Serve application from the YAML `args` ({deployment: ..., serving: ...})."""
    return build_engram_app(args)


def build_engram_app(args: dict, server_cls=None):
    """`build_app` with the engine class replaced by `server_cls` (tests: a server that only
    records where it runs; Serve's builders take exactly one argument)."""
    from ray.serve.llm import build_llm_deployment

    from engram_ray.actors.coordinator import coordinator_name
    from engram_ray.actors.coordinator_lookup import get_coordinator
    from engram_ray.actors.lifetime import saved_settings
    from engram_ray.actors.placement import gang_options, plan_groups
    from engram_ray.serve.library_options import check_engine_kwargs, check_llm_options

    app = ServeAppConfig.from_dict(args, "build_app args")
    check_engine_kwargs(engine_kwargs(app))  # a typo fails here, not in every engine
    check_llm_options(app.serving)
    dep = app.deployment
    server_cls = server_cls or server_class(app)
    # Groups stay where they run (a rebuild of a serving application, a group placed again
    # after its domain was lost: the coordinator's saved domains).
    kept = saved_settings(coordinator_name(dep.name))
    groups = plan_groups(dep, app.serving.num_peer_groups, keep=kept and kept["domains"])
    get_coordinator(app.to_dict(), {g.group_id: g.domain.domain_id for g in groups}, dep.name)
    configs = [llm_config(app, g) for g in groups]
    from engram_ray.serve.member_router import ROUTER_PATH

    # A changed config rolls out (serving.rollout): 'beside' starts each group's new gang next
    # to the serving one (max_surge_percent: a whole extra gang), 'restart' replaces it.
    surge = 100 if app.serving.rollout.mode == "beside" else 0
    engines = [build_llm_deployment(config, deployment_cls=server_cls, override_serve_options={
        "name": f"{server_cls.__name__}:{dep.name}:{g.group_id}", **gang_options(dep, g),
        "max_surge_percent": surge,
        "request_router_config": {"request_router_class": ROUTER_PATH}})
        for config, g in zip(configs, groups)]
    return _ingress(configs[0], {g.group_id: e for g, e in zip(groups, engines)}, dep.name)


def _ingress(config, engines: dict, deployment_name: str):
    """Ray Serve LLM's OpenAI ingress over the groups' deployments
    (`engram_ray.serve.ingress.PeerGroupIngress`)."""
    from ray import serve
    from ray.llm._internal.common.dict_utils import deep_merge_dicts
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.ingress import make_fastapi_ingress

    from engram_ray.serve.api_guard import guarded_ingress_app
    from engram_ray.serve.ingress import PeerGroupIngress
    from engram_ray.serve.replica import APP_CONFIG_KEY

    serving = ServeAppConfig.from_dict(config.experimental_configs[APP_CONFIG_KEY]).serving
    # Ray Serve LLM's default is one replica autoscaled at 1e9 requests (never): replaced.
    options = PeerGroupIngress.get_deployment_options([config])
    options.pop("autoscaling_config", None)
    options = deep_merge_dicts(options, ingress_options(serving))
    # Checks, caps, error shape; max_model_len bounds a request that sets no max_tokens.
    ingress_app = guarded_ingress_app(serving.request_limits, serving.max_model_len)
    ingress_cls = make_fastapi_ingress(PeerGroupIngress, app=ingress_app)
    return serve.deployment(ingress_cls, **options).bind(
        llm_deployments={config.model_id: next(iter(engines.values()))},
        model_cards={config.model_id: to_model_metadata(config.model_id, config)},
        lora_paths={}, peer_groups={config.model_id: engines}, deployment_name=deployment_name)

"""The Ray Serve application of engram-ray: `import_path: engram_ray.serve:build_app`.

    serve deploy cluster_configs/serve_local_tiny.yaml      # args: {deployment, serving}

An OpenAI-compatible API (completions, chat completions, streaming) over every engine of the
deployment, built with Ray Serve LLM: its ingress (`OpenAiIngress`, routing across replicas)
and builders (`build_openai_app`; for data-parallel gangs `build_dp_deployment` behind the same
ingress), with the replica class swapped for an engram-ray engine (`LLMConfig.server_cls`,
`deployment_cls`; `engram_ray.serving.server`): rank in a peer group, table settings for vLLM,
metrics.
"""

from __future__ import annotations

from engram_ray.serving.config import ServeAppConfig


def engine_kwargs(app: ServeAppConfig) -> dict:
    """vLLM engine arguments of every replica (the peer-group settings are added per replica).

    CUDA graphs and prefix caching as vLLM decides, except for architectures that need other
    settings (`engram_ray.models.engine_settings`: the tiny model's per-KV-slot n-gram
    history needs eager mode and no prefix caching)."""
    from engram_ray.models.engine_settings import architecture_engine_kwargs

    srv = app.serving
    kwargs = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "disable_log_stats": False,
              **architecture_engine_kwargs(srv.model_source)}
    if srv.max_model_len is not None:
        kwargs["max_model_len"] = srv.max_model_len
    if srv.data_parallel_size > 1:
        kwargs.update(data_parallel_size=srv.data_parallel_size,
                      enable_expert_parallel=srv.enable_expert_parallel)
    kwargs.update(srv.engine_kwargs)
    return kwargs


def llm_config(app: ServeAppConfig):
    """The Ray Serve LLM `LLMConfig` of the application's engines."""
    from ray.serve.llm import LLMConfig

    from engram_ray.serving.server import APP_CONFIG_KEY, EngramDPServer, EngramLLMServer

    srv, dep = app.serving, app.deployment
    is_dp = srv.data_parallel_size > 1
    bundle = dict(dep.bundle)
    deployment_config = {
        "health_check_period_s": max(1, int(dep.health_check_interval_s * 2)),
        "health_check_timeout_s": 30,
        "max_ongoing_requests": 256,
        "ray_actor_options": {"num_cpus": 0},  # its CPUs are in the bundle
    }
    # For DPServer num_replicas counts gangs; it multiplies by data_parallel_size itself.
    deployment_config["num_replicas"] = app.num_replicas // srv.data_parallel_size
    return LLMConfig(
        model_loading_config={"model_id": srv.model_id, "model_source": srv.model_source},
        engine_kwargs=engine_kwargs(app),
        deployment_config=deployment_config,
        placement_group_config={"bundles": [bundle]},
        server_cls=EngramDPServer if is_dp else EngramLLMServer,
        log_engine_metrics=False,  # vLLM's own vllm:* series go to the engine's /metrics
        experimental_configs={APP_CONFIG_KEY: app.to_dict()},
    )


INGRESS_OPTIONS = {"ray_actor_options": {"num_cpus": 0}}  # the engines take every CPU


def build_app(args: dict):
    """Serve application from the YAML `args` ({deployment: ..., serving: ...})."""
    from ray.serve.llm import build_openai_app

    app = ServeAppConfig.from_dict(args, "build_app args")
    config = llm_config(app)
    if app.serving.data_parallel_size > 1:
        return _build_dp_app(config)
    return build_openai_app({"llm_configs": [config], "ingress_deployment_config":
                             INGRESS_OPTIONS})


def _build_dp_app(config):
    """Ray Serve LLM's data-parallel app with `EngramDPServer` replicas.

    Written here because `build_dp_openai_app` always uses `DPServer` (it ignores
    `server_cls`); this assembles the same parts: `build_dp_deployment(deployment_cls=...)`
    behind the OpenAI ingress."""
    from ray import serve
    from ray.llm._internal.common.dict_utils import deep_merge_dicts
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.builder import IngressClsConfig
    from ray.llm._internal.serve.core.ingress.ingress import make_fastapi_ingress
    from ray.serve.llm import build_dp_deployment

    from engram_ray.serving.server import EngramDPServer

    engines = build_dp_deployment(config, deployment_cls=EngramDPServer)
    ingress = IngressClsConfig()
    options = deep_merge_dicts(ingress.ingress_cls.get_deployment_options([config]),
                               INGRESS_OPTIONS)
    return serve.deployment(make_fastapi_ingress(ingress.ingress_cls), **options).bind(
        llm_deployments={config.model_id: engines},
        model_cards={config.model_id: to_model_metadata(config.model_id, config)},
        lora_paths={}, **ingress.ingress_extra_kwargs)

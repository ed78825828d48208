"""The Ray Serve application of engram-ray: `import_path: engram_ray.serve:build_app`.

    serve deploy cluster_configs/serve_local_tiny.yaml      # args: {deployment, serving}

An OpenAI-compatible API (completions, chat completions, streaming) over every engine of the
deployment, built with Ray Serve LLM: its ingress (`OpenAiIngress`, routing across replicas)
and builders (`build_openai_app`, or `build_dp_openai_app` for data-parallel gangs), with the
replica class swapped through `LLMConfig.server_cls` for an engram-ray engine
(`engram_ray.serving.server`): rank in a peer group, table settings for vLLM, metrics.
"""

from __future__ import annotations

from engram_ray.serving.config import ServeAppConfig


def engine_kwargs(app: ServeAppConfig) -> dict:
    """vLLM engine arguments of every replica (the peer-group settings are added per replica).

    Eager mode and no prefix caching: the Engram n-gram history is kept per KV slot."""
    srv = app.serving
    kwargs = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "enforce_eager": True,
              "enable_prefix_caching": False, "disable_log_stats": False}
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
    if not is_dp:  # DPServer sizes itself: one replica per data-parallel rank
        deployment_config["num_replicas"] = app.num_replicas
    return LLMConfig(
        model_loading_config={"model_id": srv.model_id, "model_source": srv.model_source},
        engine_kwargs=engine_kwargs(app),
        deployment_config=deployment_config,
        placement_group_config={"bundles": [bundle]},
        server_cls=EngramDPServer if is_dp else EngramLLMServer,
        log_engine_metrics=False,  # vLLM's own vllm:* series go to the engine's /metrics
        experimental_configs={APP_CONFIG_KEY: app.to_dict()},
    )


def build_app(args: dict):
    """Serve application from the YAML `args` ({deployment: ..., serving: ...})."""
    from ray.serve.llm import build_dp_openai_app, build_openai_app

    app = ServeAppConfig.from_dict(args, "build_app args")
    ingress = {"ray_actor_options": {"num_cpus": 0}}
    config = llm_config(app)
    if app.serving.data_parallel_size > 1:
        return build_dp_openai_app({"llm_config": config, "ingress_deployment_config": ingress})
    return build_openai_app({"llm_configs": [config], "ingress_deployment_config": ingress})

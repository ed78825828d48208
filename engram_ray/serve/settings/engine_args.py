"""The vLLM engine arguments an app config gives every engine (the build sets them in each
group's `LLMConfig`; a member sets them again when its settings roll in place)."""

from __future__ import annotations

from engram_ray.serve.settings.config import ServeAppConfig


def engine_kwargs(app: ServeAppConfig, on_engine_node: bool = False) -> dict:
    """vLLM engine arguments of every replica (the peer-group settings are added per replica).

    CUDA graphs and prefix caching as vLLM decides, except for architectures that need other
    settings (`engram_ray.vllm.engine_settings`: the tiny model's per-KV-slot n-gram
    history needs eager mode and no prefix caching), read from the model's config.json where
    it can be: `on_engine_node` (a member, on its own node) refuses a config it cannot read;
    the build leaves them to the members then. `serving.host_kv_cache_gib` becomes vLLM's
    `kv_offloading_size` (native CPU KV-cache offloading, GiB per engine)."""
    from engram_ray.planning.host_kv import KV_OFFLOADING_ARG
    from engram_ray.vllm.engine_settings import architecture_engine_kwargs

    srv = app.serving
    kwargs = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "disable_log_stats": False,
              **architecture_engine_kwargs(srv.model_source, on_engine_node)}
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

"""The options engram-ray passes through to vLLM and Ray Serve LLM (`serving.engine_kwargs`,
`serving.llm_config`, `serving.deployment_options`, `serving.ingress.autoscaling_config`):
the keys the app owns, refused by name with where to write each instead, and the check of the
rest against the libraries' own names (at build time, where vLLM and Ray are imported)."""

from engram_ray.errors import ConfigError

# vLLM arguments with a serving field of their own: in engine_kwargs they would override it
# after its checks (engine_kwargs are applied last), e.g. TP=2 past "must be 1".
OWN_ENGINE_ARGS = {key: f"serving.{key} (checked there; engine_kwargs would override it "
                        "unchecked)" for key in ("tensor_parallel_size", "pipeline_parallel_size",
                                                 "data_parallel_size", "enable_expert_parallel",
                                                 "max_model_len")}

# LLMConfig options engram_ray.serve.app sets itself: where to write each instead.
APP_LLM_CONFIG = {
    "model_loading_config": "serving.model_id and serving.model_source",
    "engine_kwargs": "serving.engine_kwargs",
    "deployment_config": "serving.deployment_options (and deployment.health_check_*)",
    "placement_group_config": "deployment.num_gpus_per_engine / num_cpus_per_engine",
    "experimental_configs": "nothing: it carries the app's own settings to the engines",
    "server_cls": "nothing: the engram-ray engine class is the replica",
    "llm_engine": "nothing: the engines are vLLM's"}
# Serve deployment options each peer group's gang owns (engram_ray.serve.app, actors/placement.py).
GROUP_DEPLOYMENT_OPTIONS = {
    **{key: "serving.num_peer_groups and deployment.peer_group_size (one gang per group)"
       for key in ("num_replicas", "autoscaling_config", "gang_scheduling_config")},
    "max_surge_percent": "serving.rollout.mode",
    **{key: "nothing: each group's bundles are placed in its NVLink domain"
       for key in ("placement_group_bundles", "placement_group_strategy",
                   "placement_group_bundle_label_selector", "ray_actor_options",
                   "max_replicas_per_node")},
    "health_check_period_s": "deployment.health_check_interval_s",
    "health_check_timeout_s": "deployment.max_missed_pings",
    "request_router_config": "nothing: requests go to the members that serve "
                             "(engram_ray.serve.edge.member_router)",
    "name": "deployment.name"}


def refuse_owned_options(srv) -> None:
    """A key of engine_kwargs, llm_config or deployment_options that the app sets itself (or
    that a serving field of its own checks) is a ConfigError naming where to write it."""
    for section, owners, problem in (
            ("engine_kwargs", OWN_ENGINE_ARGS, "is set in engine_kwargs"),
            ("llm_config", APP_LLM_CONFIG, "is set by the app"),
            ("deployment_options", GROUP_DEPLOYMENT_OPTIONS, "is owned by the peer groups")):
        owned = [key for key in owners if key in getattr(srv, section)]
        if owned:
            raise ConfigError(f"{section}.{owned[0]}", problem, owners[owned[0]])


def _nearest(name: str, valid) -> str:
    import difflib

    close = difflib.get_close_matches(name, sorted(valid), n=1, cutoff=0.6)
    return f"`{close[0]}`" if close else "a vLLM engine argument"


def check_engine_kwargs(kwargs: dict) -> None:
    """Every key of `kwargs` is a vLLM engine argument (`AsyncEngineArgs`) or an OpenAI
    frontend argument (`FrontendArgs`), the two sets Ray Serve LLM splits engine_kwargs into;
    else a ConfigError naming the key and the nearest valid name. Skipped with a warning where
    vLLM cannot be imported (there, each engine would fail on it at start)."""
    import dataclasses
    import logging

    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.cli_args import FrontendArgs
    except Exception as exc:  # noqa: BLE001 (no vLLM, or one of another layout)
        logging.getLogger(__name__).warning(
            "serving.engine_kwargs not checked: vLLM's argument names cannot be imported "
            "(%s: %s)", type(exc).__name__, exc)
        return
    valid = {f.name for cls in (AsyncEngineArgs, FrontendArgs)
             for f in dataclasses.fields(cls)}
    for key in kwargs:
        if key not in valid:
            raise ConfigError(f"serving.engine_kwargs.{key}", "is not a vLLM engine argument",
                              _nearest(key, valid))


def check_llm_options(srv) -> None:
    """Of `srv` (a `ServingConfig`): `serving.llm_config` keys are `LLMConfig` fields,
    `serving.deployment_options` keys Serve deployment options and
    `serving.ingress.autoscaling_config` keys Serve's `AutoscalingConfig` fields (Ray imported
    here, at build time)."""
    from ray.serve.llm import LLMConfig
    from ray.serve.schema import DeploymentSchema

    from ray.serve.config import AutoscalingConfig

    for section, options, valid in (
            ("llm_config", srv.llm_config, set(LLMConfig.model_fields)),
            ("deployment_options", srv.deployment_options, set(DeploymentSchema.model_fields)),
            ("ingress.autoscaling_config", srv.ingress.autoscaling_config or {},
             set(AutoscalingConfig.model_fields))):
        for key in options:
            if key not in valid:
                raise ConfigError(f"serving.{section}.{key}", "is not an option there",
                                  _nearest(key, valid))

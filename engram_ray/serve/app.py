"""The Ray Serve applications of engram-ray: a front door and one application per peer group.

    serve deploy cluster_configs/serve_local_tiny.yaml

    engram_ray.serve.app:build_app     (the front door; args: {deployment, serving})
      plan groups     each of serving.num_peer_groups gets a domain   actors/placement.py
      coordinator     generations, store folders, slices, targets      actors/coordinator.py
      ingress         OpenAI API, requests spread over the groups      serve.edge.ingress
                      request checks, caps, every error's shape         serve.edge.api_guard
    engram_ray.serve.app:build_group   (one per group, `<deployment.name>-group-<i>`;
                                        args: `group_args`, the same settings and `group`)
      per group       one Serve deployment = one gang of P engines,    engram_ray.serve.member
                      bundles label-selected to the group's domain,
                      requests only to members that serve      engram_ray.serve.edge.member_router

Why one application per group: Serve gives every deployment of an application the code version
of the whole (a hash of its args) and restarts every replica when it changes. Apart, a group's
code version changes only with its own settings: `serving.num_peer_groups` up or down adds or
deletes group applications and leaves the others' engines running (`FRONT_DOOR_SETTINGS`
are not in the groups' args).

Built from Ray Serve LLM's parts: `LLMConfig`, `build_llm_deployment` with the replica class
swapped for an engram-ray engine, and its OpenAI ingress.
"""

from __future__ import annotations

from contextlib import contextmanager

from engram_ray.errors import ConfigError, EngramRayError
from engram_ray.planning.grouping import PeerGroupPlan, PlacementError
from engram_ray.serve.settings.config import MAX_ONGOING_REQUESTS, ServeAppConfig
from engram_ray.serve.settings.engine_args import engine_kwargs
from engram_ray.serve.settings.group_apps import group_app_name, group_applications


def llm_config(app: ServeAppConfig, group: PeerGroupPlan):
    """The Ray Serve LLM `LLMConfig` of the engines of peer group `group`."""
    from ray.serve.llm import LLMConfig

    from engram_ray.serve.member.server import APP_CONFIG_KEY, GROUP_KEY

    srv, dep = app.serving, app.deployment
    deployment_config = {
        "health_check_period_s": dep.health_check_interval_s,
        # A member that does not answer max_missed_pings health checks in a row is taken for
        # dead (Serve then restarts its whole group); a dead actor is noticed at once.
        "health_check_timeout_s": dep.health_check_interval_s * dep.max_missed_pings,
        "max_ongoing_requests": MAX_ONGOING_REQUESTS,
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


# Serve's throughput settings (the first two of RAY_SERVE_THROUGHPUT_OPTIMIZED) for the ingress
# alone: its code is async only, so it and its handles' router run on the replica's own event
# loop, saving the hand-offs between three threads that each request otherwise makes: its CPU
# per request is then Ray's own ingress's (benchmarks/bench_ingress.py, docs/operators.md).
INGRESS_ENV_VARS = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def ingress_options(srv) -> dict:
    """The ingress deployment's options: `serving.ingress` replicas (or autoscaling), no CPUs
    (the engines take every CPU), its code on the replica's event loop (`INGRESS_ENV_VARS`),
    and a new replica started before an old one stops when a changed config rolls out
    (`max_surge_percent`: the front door is never down)."""
    options = {"ray_actor_options": {"num_cpus": 0,
                                     "runtime_env": {"env_vars": dict(INGRESS_ENV_VARS)}},
               "max_surge_percent": 100}
    if srv.ingress.autoscaling_config is not None:
        return {**options, "autoscaling_config": dict(srv.ingress.autoscaling_config)}
    return {**options, "num_replicas": srv.ingress.num_replicas}


def server_class(app: ServeAppConfig):
    from engram_ray.serve.member.server import EngramDPServer, EngramLLMServer

    return EngramDPServer if app.serving.data_parallel_size > 1 else EngramLLMServer


def engine_deployment_name(server_cls, deployment_name: str, group_id: str) -> str:
    return f"{server_cls.__name__}:{deployment_name}:{group_id}"


def group_engines(server_cls, deployment_name: str, group_ids) -> dict[str, tuple[str, str]]:
    """{group id: (its engine deployment, its application)}: where the ingress sends a
    group's requests."""
    return {g: (engine_deployment_name(server_cls, deployment_name, g),
                group_app_name(deployment_name, g)) for g in group_ids}


def build_app(args: dict):
    """The front door's Serve application from the YAML `args` ({deployment, serving}): the
    coordinator (placement of every group, rollout) and the OpenAI ingress over the groups'
    applications (`build_group`, one per group, named by `group_app_name`)."""
    with refused_at_once():
        return build_front_door(args)


def build_group(args: dict):
    """One peer group's Serve application from the YAML `args` (`group_args`)."""
    with refused_at_once():
        return build_group_app(args)


@contextmanager
def refused_at_once():
    """An engram-ray refusal (`EngramRayError`: a setting, a placement, a change the rollout
    mode cannot apply) is the same on every try, so it fails the deploy on the first build.
    Serve's build task (`build_serve_application`, Ray 2.60) retries any exception 3 times, each
    in a new worker, but a `RayServeException` it takes as the build's answer: its message alone
    is the application's DEPLOY_FAILED status. Any other error keeps Serve's retries."""
    try:
        yield
    except EngramRayError as error:
        from ray.serve.exceptions import RayServeException

        # A refusal raised in an actor (the coordinator) comes as Ray's RayTaskError subclass
        # of it: its message is the task's stack; the refusal's own is its cause's.
        cause = getattr(error, "cause", None)
        message = str(cause if isinstance(cause, EngramRayError) else error)
        raise RayServeException(message) from None


def build_front_door(args: dict, server_cls=None):
    """`build_app` with the engine class replaced by `server_cls` (tests: a server that only
    records where it runs; Serve's builders take exactly one argument)."""
    from engram_ray.actors.coordinator import coordinator_name
    from engram_ray.actors.coordinator_lookup import get_coordinator
    from engram_ray.actors.lifetime import saved_settings
    from engram_ray.actors.placement import plan_groups

    app = ServeAppConfig.from_dict(args, "build_app args")
    dep = app.deployment
    # Groups stay where they run (a rebuild of a serving application, a group placed again
    # after its domain was lost: the coordinator's saved domains).
    kept = saved_settings(coordinator_name(dep.name))
    groups = plan_groups(dep, app.serving.num_peer_groups, keep=kept and kept["domains"])
    get_coordinator(app.to_dict(), {g.group_id: g.domain.domain_id for g in groups}, dep.name,
                    check=lambda: check_library_options(app))
    # Only now the engine class, which imports Ray Serve LLM and vLLM (9 s measured on 2 busy
    # cores): a refused change fails the build before it.
    server_cls = server_cls or server_class(app)
    engines = group_engines(server_cls, dep.name, [g.group_id for g in groups])
    return _ingress(llm_config(app, groups[0]), engines, dep.name)


def build_group_app(args: dict, server_cls=None):
    """`build_group` with the engine class replaced by `server_cls` (tests)."""
    from engram_ray.actors.coordinator_lookup import group_domain, refused_change
    from engram_ray.actors.placement import discover_domains, gang_options
    from engram_ray.serve.edge.member_router import ROUTER_PATH
    from engram_ray.serve.settings.config_change import in_place_changes, setting_paths

    args = dict(args)
    group_id = args.pop("group", None)
    if not isinstance(group_id, str) or not group_id.startswith("group-"):
        raise ConfigError("build_group args: group", f"is {group_id!r}",
                          "the group's id, group-<i> "
                          "(engram_ray.serve.settings.group_apps.group_args)")
    own = ServeAppConfig.from_dict(args, "build_group args")
    dep = own.deployment
    # A change the front door refused fails here at once; else a typo in an option name
    # fails here too, not after the wait for the front door.
    refused = refused_change(own.to_dict(), dep.name)
    if refused:
        raise EngramRayError(refused)
    check_library_options(own)
    # The front door's build placed the group and set the coordinator up with these settings:
    # the engines run the coordinator's (the front door's), rollout and in-place ones included.
    # Args that hold in-place settings come from a deploy whose rollout is not in_place.
    domain_id, settings = group_domain(own.to_dict(), group_id, dep.name,
                                       dep.placement_timeout_s + 60,
                                       in_place_written=in_place_changes(setting_paths(args)))
    app = ServeAppConfig.from_dict(settings, "coordinator")
    server_cls = server_cls or server_class(app)
    domain = next((d for d in discover_domains(dep) if d.domain_id == domain_id), None)
    if domain is None:
        raise PlacementError(f"{group_id} of {dep.name!r} was placed in domain {domain_id}, "
                             "which has no alive node now; deploy again to place it anew")
    group = PeerGroupPlan(group_id, domain, int(group_id.split("-")[1]), dep.peer_group_size)
    # A changed group setting rolls out (serving.rollout): 'beside' starts the group's new gang
    # next to the serving one (max_surge_percent: a whole extra gang), 'restart' replaces it;
    # 'in_place' changes reach the engines through the coordinator, not a new build.
    surge = 100 if app.serving.rollout.mode == "beside" else 0
    from ray.serve.llm import build_llm_deployment  # Ray Serve LLM and vLLM: past every refusal

    return build_llm_deployment(llm_config(app, group), deployment_cls=server_cls,
                                override_serve_options={
        "name": engine_deployment_name(server_cls, dep.name, group_id),
        **gang_options(dep, group), "max_surge_percent": surge,
        "request_router_config": {"request_router_class": ROUTER_PATH}})


def engram_applications(args: dict, app_name: str, route_prefix: str = "/",
                        server_cls=None) -> list[tuple[str, str | None, object]]:
    """[(application name, route prefix, Serve application)] of a deployment started with
    `serve.run` (tests; the local deployment runs `serve deploy`): the front door first
    (its build sets the coordinator up), then every group's. `serve deploy` builds the same
    from the YAML."""
    apps = [(app_name, route_prefix, build_front_door(args, server_cls))]
    for name, group in group_applications(args).items():
        apps.append((name, None, build_group_app(group, server_cls)))
    return apps


def check_library_options(app: ServeAppConfig) -> None:
    """`app`'s engine arguments and LLMConfig options against vLLM's and Ray Serve LLM's own
    names (a typo fails the build, not every engine)."""
    from engram_ray.serve.settings.library_options import check_engine_kwargs, check_llm_options

    check_engine_kwargs(engine_kwargs(app))
    check_llm_options(app.serving)


def _ingress(config, engines: dict, deployment_name: str):
    """Ray Serve LLM's OpenAI ingress over the groups' deployments, `engines`: {group id:
    (deployment name, application name)} (`engram_ray.serve.edge.ingress.PeerGroupIngress`)."""
    from ray import serve
    from ray.llm._internal.common.dict_utils import deep_merge_dicts
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.ingress import make_fastapi_ingress

    from engram_ray.serve.edge.api_guard import guarded_ingress_app
    from engram_ray.serve.edge.ingress import PeerGroupIngress
    from engram_ray.serve.member.server import APP_CONFIG_KEY

    serving = ServeAppConfig.from_dict(config.experimental_configs[APP_CONFIG_KEY]).serving
    # Ray Serve LLM's default is one replica autoscaled at 1e9 requests (never): replaced.
    options = PeerGroupIngress.get_deployment_options([config])
    options.pop("autoscaling_config", None)
    options = deep_merge_dicts(options, ingress_options(serving))
    # Checks, caps, error shape; max_model_len bounds a request that sets no max_tokens.
    ingress_app = guarded_ingress_app(serving.request_limits, serving.max_model_len)
    ingress_cls = make_fastapi_ingress(PeerGroupIngress, app=ingress_app)
    return serve.deployment(ingress_cls, **options).bind(
        model_cards={config.model_id: to_model_metadata(config.model_id, config)},
        lora_paths={}, peer_groups={config.model_id: engines}, deployment_name=deployment_name)

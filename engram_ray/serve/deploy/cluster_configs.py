"""Checks of the YAMLs in `cluster_configs/`: Serve deploy files and `ray up` cluster files.

- Serve files: Ray's `ServeDeploySchema`, then every application whose import path is
  `engram_ray.serve.app:build_app` (the front door) through `ServeAppConfig` (unknown keys and
  bad values refused, naming the field), and its groups' `build_group` applications.
- ray up files: Ray's autoscaler JSON schema (`ray/autoscaler/ray-schema.json`), then what
  engram-ray needs: engram-ray[gpu] installed by the setup commands, and every worker's
  `ray start` labelled with its NVLink domain (`engram-ray node-labels`).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from engram_ray.errors import ConfigError
from engram_ray.serve.settings.config import ServeAppConfig

APP_IMPORT_PATH = "engram_ray.serve.app:build_app"
GROUP_IMPORT_PATH = "engram_ray.serve.app:build_group"


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), f"is not valid YAML ({exc})", "a YAML mapping") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), f"holds a {type(data).__name__}", "a YAML mapping")
    return data


def check_serve_config(data: dict, source: str) -> dict[str, ServeAppConfig]:
    """Validate a `serve deploy` document; front door application name -> its engram-ray app
    config. Every front door needs its groups' applications (`check_group_applications`)."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    from engram_ray.serve.settings.library_options import check_engine_kwargs, check_llm_options

    try:
        schema = ServeDeploySchema.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{source}: {where}", first["msg"],
                          "a document Ray Serve's ServeDeploySchema accepts") from None
    apps = {}
    for idx, app in enumerate(schema.applications):
        if app.import_path == APP_IMPORT_PATH:
            apps[app.name] = config = ServeAppConfig.from_dict(
                app.args, f"{source}: applications[{idx}].args")
            check_engine_kwargs(config.serving.engine_kwargs)  # as build_app does
            check_llm_options(config.serving)
    if not apps:
        raise ConfigError(f"{source}: applications", f"has no {APP_IMPORT_PATH} application",
                          f"one application with import_path {APP_IMPORT_PATH}")
    check_group_applications(schema.applications, source)
    return apps


def check_group_applications(applications, source: str) -> None:
    """Each front door (`build_app`) has one `build_group` application per group, named
    `<deployment.name>-group-<i>`, with no route, the front door's runtime_env and its args
    as `group_args` makes them; no group application is left without a front door."""
    from engram_ray.serve.settings.group_apps import group_applications
    from engram_ray.serve.settings.config_change import changed_settings

    groups = {app.name: (idx, app) for idx, app in enumerate(applications)
              if app.import_path == GROUP_IMPORT_PATH}
    shape = (f"import_path {GROUP_IMPORT_PATH}, route_prefix null, the front door's "
             "runtime_env, args {group: group-<i>, deployment: <the front door's>, serving: "
             "<the front door's but num_peer_groups, ingress, request_limits, rollout and, with "
             "rollout.mode in_place, engine_kwargs (but load_format), max_model_len, "
             "host_kv_cache_gib, host_kv_reserve_gib>} (YAML anchors: "
             "cluster_configs/serve_local_tiny.yaml)")
    for door in (app for app in applications if app.import_path == APP_IMPORT_PATH):
        for name, args in group_applications(door.args).items():
            if name not in groups:
                raise ConfigError(f"{source}: applications", f"have no application {name!r} "
                                  f"for {args['group']} of {door.name!r} (serving."
                                  "num_peer_groups counts it)", f"one named {name} with {shape}")
            idx, app = groups.pop(name)
            where = f"{source}: applications[{idx}]"
            if app.args != args:
                raise ConfigError(f"{where}.args", "differ from what the front door "
                                  f"{door.name!r} runs its groups with in "
                                  + ", ".join(changed_settings(app.args, args)), shape)
            if app.route_prefix is not None:
                raise ConfigError(f"{where}.route_prefix", f"is {app.route_prefix!r}", shape)
            if app.runtime_env != door.runtime_env:
                raise ConfigError(f"{where}.runtime_env", f"differs from the front door "
                                  f"{door.name!r}'s (its engines run in it)", shape)
    if groups:
        name, (idx, app) = next(iter(groups.items()))
        raise ConfigError(f"{source}: applications[{idx}]", f"is group application {name!r} "
                          "of no front door (no build_app application's serving.num_peer_groups"
                          " and deployment.name count it)", "remove it, or raise the front "
                          "door's serving.num_peer_groups")


def group_app_configs(door: dict, import_path: str = GROUP_IMPORT_PATH) -> list[dict]:
    """The Serve config entries of the groups' applications of the front door entry `door`
    (what `check_group_applications` wants; `import_path`: another builder, tests)."""
    from engram_ray.serve.settings.group_apps import group_applications

    return [{"name": name, "route_prefix": None, "import_path": import_path,
             "runtime_env": door.get("runtime_env"), "args": args}
            for name, args in group_applications(door["args"]).items()]


def load_serve_config(path: str | Path) -> dict[str, ServeAppConfig]:
    return check_serve_config(read_yaml(path), str(path))


def check_ray_up_config(data: dict, source: str, label_key: str) -> None:
    """Ray's autoscaler schema, the engram-ray install, and domain labels on `ray start`."""
    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    try:
        jsonschema.validate(data, schema)
    except jsonschema.ValidationError as exc:
        where = ".".join(str(p) for p in exc.absolute_path) or "top level"
        raise ConfigError(f"{source}: {where}", exc.message,
                          "a cluster config Ray's autoscaler schema accepts") from None
    setup = " ".join(data.get("setup_commands", []))
    if "engram-ray[gpu]" not in setup:
        raise ConfigError(f"{source}: setup_commands", "do not install engram-ray[gpu]",
                          "a pip install of engram-ray[gpu] on every node")
    workers = " ".join(data.get("worker_start_ray_commands", []))
    if "ray start" not in workers or "engram-ray node-labels" not in workers:
        raise ConfigError(f"{source}: worker_start_ray_commands",
                          "do not label nodes with their NVLink domain",
                          '`ray start ... --labels="$(engram-ray node-labels)"`')
    head = " ".join(data.get("head_start_ray_commands", []))
    if f"{label_key}=" not in head:
        raise ConfigError(f"{source}: head_start_ray_commands",
                          f"do not set the {label_key} label on the head",
                          f'--labels="{label_key}=none" (a head without GPUs is no domain)')
    if data["provider"]["type"] == "local":
        for name, node_type in data.get("available_node_types", {}).items():
            if node_type.get("labels"):
                raise ConfigError(f"{source}: available_node_types.{name}.labels",
                                  "are ignored by the local provider",
                                  "labels on the `ray start` commands")


def load_ray_up_config(path: str | Path, label_key: str) -> dict:
    data = read_yaml(path)
    check_ray_up_config(data, str(path), label_key)
    return data

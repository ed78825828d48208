"""The Serve applications a front door's `args` make: one per peer group, its name and its args
(the front door's settings less those only the front door reads, plus `group`)."""

from __future__ import annotations

from engram_ray.serve.settings.config import ServeAppConfig


def group_app_name(deployment_name: str, group_id: str) -> str:
    """The Serve application of one peer group (the front door finds its engines by it)."""
    return f"{deployment_name}-{group_id}"


def group_args(args: dict, group_id: str) -> dict:
    """A group application's `args`: the front door's without the settings only the front
    door reads (`FRONT_DOOR_SETTINGS` of `engram_ray.serve.settings.config`: a change of them
    leaves every group's code version, and so its engines, alone), plus `group`."""
    from engram_ray.serve.settings.config_change import group_settings

    return {"group": group_id, **group_settings(args)}


def group_applications(args: dict) -> dict[str, dict]:
    """{application name: args} of every peer group of the front door's `args`."""
    app = ServeAppConfig.from_dict(args, "args")
    return {group_app_name(app.deployment.name, f"group-{i}"): group_args(args, f"group-{i}")
            for i in range(app.serving.num_peer_groups)}

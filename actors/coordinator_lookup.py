"""Where a Serve application finds its coordinator (`actors/coordinator.py`): `get_coordinator`
(the build: create, reuse, reconfigure for a rolling change, or replace), `find_coordinator`
(replicas, the ingress, the CLI: by name).

One left by an earlier deployment of the same name is reused when it was made with the same
settings and groups; replaced when it differs and has no members; reconfigured when it has
members and the change rolls out (`rolls_out`, `serving.rollout`); replaced when the change
is applied whole (`serving.rollout.mode: restart`); refused (naming the settings) otherwise.
"""

from __future__ import annotations

import logging
import time

import ray

from engram_ray.actors.coordinator import Coordinator, coordinator_name
from engram_ray.errors import EngramRayError

logger = logging.getLogger(__name__)
HEAD_RESOURCE = "node:__internal_head__"  # Ray gives it to the head node only


def get_coordinator(app_config_dict: dict, domains: dict[str, str], deployment_name: str):
    """The application's coordinator (see module docstring for reuse and replacement)."""
    coordinator = _coordinator_actor(app_config_dict, domains, deployment_name)
    made_with, num_members = ray.get(coordinator.describe.remote())
    if tuple(made_with) == (app_config_dict, domains):
        return coordinator
    if num_members and rolls_out(made_with[0], app_config_dict, deployment_name):
        from engram_ray.serve.config_change import group_settings

        groups_roll = group_settings(made_with[0]) != group_settings(app_config_dict)
        if groups_roll and \
                app_config_dict.get("serving", {}).get("rollout", {}).get("mode") != "restart":
            from engram_ray.actors.placement import check_room_beside
            from engram_ray.config import DeploymentConfig

            check_room_beside(DeploymentConfig.from_dict(app_config_dict["deployment"]),
                              domains)
        ray.get(coordinator.reconfigure.remote(app_config_dict, domains))
        return coordinator
    logger.info("replacing %s: made with other settings, no members",
                coordinator_name(deployment_name))
    ray.kill(coordinator, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get_actor(coordinator_name(deployment_name), namespace="engram")
            time.sleep(0.2)
        except ValueError:  # the name is free again
            break
    return _coordinator_actor(app_config_dict, domains, deployment_name)


def rolls_out(old: dict, new: dict, deployment_name: str) -> bool:
    """True when a running deployment's change rolls out (the coordinator is reconfigured);
    False when it is applied whole (`serving.rollout.mode: restart`: the coordinator is
    replaced, Serve restarts every group); EngramRayError naming the settings that cannot roll
    beside the serving groups otherwise."""
    from engram_ray.serve.config_change import changed_settings, fixed_changes

    fixed = fixed_changes(changed_settings(old, new))
    mode = new.get("serving", {}).get("rollout", {}).get("mode", "beside")
    if not fixed:
        return True
    if mode == "restart":
        return False
    raise EngramRayError(
        f"deployment {deployment_name!r} serves, and this change of {', '.join(fixed)} cannot "
        "roll out beside its groups (old and new engines would not read the same rows or serve "
        "the same model); set serving.rollout.mode: restart to restart every group at once (an "
        "outage of one cold start), or serve shutdown first")


def group_domain(app_config_dict: dict, group_id: str, deployment_name: str,
                 timeout_s: float) -> str:
    """The domain id of `group_id`, once the front door's build set the coordinator up with
    the settings of `app_config_dict` (but for the front door's own) and placed the group;
    EngramRayError naming what is missing after `timeout_s`, or at once for a change the
    front door refuses (`rolls_out`)."""
    from engram_ray.serve.config_change import changed_settings, group_settings

    wanted, deadline, seen = group_settings(app_config_dict), time.monotonic() + timeout_s, None
    while True:
        try:
            made_with, num_members = ray.get(find_coordinator(deployment_name).describe.remote())
        except (ValueError, ray.exceptions.RayActorError):  # not made yet, or being replaced
            made_with = None
        if made_with is not None:
            settings, domains = made_with
            if group_settings(settings) == wanted and group_id in domains:
                return domains[group_id]
            if num_members:
                rolls_out(settings, app_config_dict, deployment_name)  # raises if refused
            seen = (changed_settings(group_settings(settings), wanted), sorted(domains))
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    why = ("no coordinator was made" if seen is None else
           f"the coordinator has groups {seen[1]}" + (
               f" and other values of {', '.join(seen[0])}" if seen[0] else ""))
    raise EngramRayError(
        f"{group_id} of deployment {deployment_name!r} waited {timeout_s:.0f} s for its front "
        f"door ({why}): deploy the application with import_path engram_ray.serve.app:build_app "
        f"and the same settings, whose serving.num_peer_groups counts {group_id}, in the same "
        "serve deploy")


def find_coordinator(deployment_name: str):
    """The running coordinator (replicas ask for it by name; build_app created it)."""
    return ray.get_actor(coordinator_name(deployment_name), namespace="engram")


def _coordinator_actor(app_config_dict: dict, domains: dict[str, str], deployment_name: str):
    # NOTES: on the head node, whichever node that is (a restarted head has another node id):
    # a soft node affinity was measured to spill to a worker node when the head was busy,
    # where the coordinator died with that node. "DEFAULT" keeps it out of any placement
    # group of its creator.
    return Coordinator.options(
        name=coordinator_name(deployment_name), namespace="engram", get_if_exists=True,
        lifetime="detached", resources={HEAD_RESOURCE: 0.001}, scheduling_strategy="DEFAULT",
    ).remote(app_config_dict, domains)

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
        if app_config_dict.get("serving", {}).get("rollout", {}).get("mode") != "restart":
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

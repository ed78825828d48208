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
from collections.abc import Sequence

import ray

from engram_ray.actors.coordinator import Coordinator, coordinator_name
from engram_ray.errors import ConfigError, EngramRayError

logger = logging.getLogger(__name__)
HEAD_RESOURCE = "node:__internal_head__"  # Ray gives it to the head node only


def get_coordinator(app_config_dict: dict, domains: dict[str, str], deployment_name: str,
                    check=None):
    """The application's coordinator (see module docstring for reuse and replacement).
    `check()` (the build's checks against vLLM's own option names: an import of vLLM, tens
    of seconds on a busy node) runs once before a coordinator is made, reconfigured or
    replaced, after a refusal of the change (which needs none: a refused deploy fails its
    builds before they import vLLM)."""
    checked = []

    def check_once():
        if check is not None and not checked:
            check()
            checked.append(True)

    try:
        coordinator = find_coordinator(deployment_name)
    except ValueError:  # none yet
        check_once()
        coordinator = _coordinator_actor(app_config_dict, domains, deployment_name)
    made_with, num_members = ray.get(coordinator.describe.remote())
    if tuple(made_with) == (app_config_dict, domains):
        return coordinator
    if num_members and _rolls_out_or_refuse(coordinator, made_with, app_config_dict, domains,
                                            deployment_name):
        check_once()
        ray.get(coordinator.reconfigure.remote(app_config_dict, domains))
        return coordinator
    check_once()
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


def _rolls_out_or_refuse(coordinator, made_with, app_config_dict: dict, domains: dict,
                         deployment_name: str) -> bool:
    """`rolls_out` (and room beside the groups for `beside`); a refusal is also left with the
    coordinator, so that the group applications' builds of this deploy fail with it at once."""
    from engram_ray.serve.settings.config_change import group_settings, rollout_mode

    try:
        if not rolls_out(made_with[0], app_config_dict, deployment_name):
            return False
        groups_roll = group_settings(made_with[0]) != group_settings(app_config_dict)
        if groups_roll and rollout_mode(app_config_dict) == "beside":
            from engram_ray.actors.placement import check_room_beside
            from engram_ray.config import DeploymentConfig

            check_room_beside(DeploymentConfig.from_dict(app_config_dict["deployment"]),
                              domains)
        return True
    except EngramRayError as exc:
        ray.get(coordinator.refuse.remote(group_settings(app_config_dict), str(exc)))
        raise


def rolls_out(old: dict, new: dict, deployment_name: str) -> bool:
    """True when a running deployment's change rolls out (the coordinator is reconfigured:
    engines restarted in place, gangs started beside or replaced, as `serving.rollout.mode`
    says); False when it is applied whole (`restart` with a `FIXED_WHILE_SERVING` change: the
    coordinator is replaced, Serve restarts every group); EngramRayError naming the settings
    the mode cannot apply otherwise (nothing changes: the groups serve on)."""
    from engram_ray.serve.settings.config_change import (changed_settings, fixed_changes,
                                                group_settings, rollout_mode)

    fixed = fixed_changes(changed_settings(old, new))
    mode = rollout_mode(new)
    if fixed:
        if mode == "restart":
            return False
        raise EngramRayError(
            f"deployment {deployment_name!r} serves, and this change of {', '.join(fixed)} "
            "cannot roll out beside its groups or in place (old and new engines would not read "
            "the same rows or serve the same model); set serving.rollout.mode: restart to "
            "restart every group at once (an outage of one cold start), or serve shutdown first")
    if mode == "in_place":
        from engram_ray.serve.settings.config_change import in_place_changes

        gangs = changed_settings(group_settings(old, "in_place"), group_settings(new))
        if gangs:
            raise EngramRayError(
                f"deployment {deployment_name!r} serves with serving.rollout.mode in_place, "
                f"and this change of {', '.join(gangs)} needs new gangs (an engine restarted "
                "in place applies only serving.engine_kwargs, max_model_len, host_kv_cache_gib "
                "and host_kv_reserve_gib); set serving.rollout.mode: beside (needs "
                "deployment.peer_group_size free engine slots in each group's domain) or "
                "restart (an outage of one cold start) for it. Nothing was changed")
    return True


def refused_change(app_config_dict: dict, deployment_name: str) -> str | None:
    """Why the front door's build of this deploy refused the change of the group settings of
    `app_config_dict` (a group application's config), if it has already; None otherwise."""
    from engram_ray.serve.settings.config_change import group_settings

    try:
        coordinator = find_coordinator(deployment_name)
        return ray.get(coordinator.refusal.remote(group_settings(app_config_dict)))
    except (ValueError, ray.exceptions.RayActorError):  # none, or being replaced
        return None


def group_domain(app_config_dict: dict, group_id: str, deployment_name: str,
                 timeout_s: float, in_place_written: Sequence[str] = ()) -> tuple[str, dict]:
    """(domain id of `group_id`, the coordinator's app config), once the front door's build
    set the coordinator up with the group settings of `app_config_dict` (a group
    application's config) and placed the group; EngramRayError naming what is missing after
    `timeout_s`, or at once for a change the front door refuses (`rolls_out`).

    `in_place_written`: the in-place settings the group's args set. Only a deploy whose
    rollout mode is not in_place writes them there (`group_settings`), and Serve builds a
    deploy's applications in no order: while the coordinator still runs in_place (the front
    door's build of a switch to beside or restart not done yet), the group waits; past
    `timeout_s`, ConfigError naming them (in_place: the front door's serving only)."""
    from engram_ray.serve.settings.config_change import (changed_settings, group_settings,
                                                         rollout_mode)

    deadline, seen = time.monotonic() + timeout_s, None
    while True:
        try:
            coordinator = find_coordinator(deployment_name)
            made_with, _ = ray.get(coordinator.describe.remote())
        except (ValueError, ray.exceptions.RayActorError):  # not made yet, or being replaced
            made_with = None
        if made_with is not None:
            settings, domains = made_with
            mode = rollout_mode(settings)
            wanted = group_settings(app_config_dict, mode)
            stale_mode = bool(in_place_written) and mode == "in_place"
            if group_settings(settings) == wanted and group_id in domains and not stale_mode:
                return domains[group_id], settings
            # The front door's build of this deploy refused it: so is this group's.
            refused = ray.get(coordinator.refusal.remote(group_settings(app_config_dict)))
            if refused:
                raise EngramRayError(refused)
            seen = (changed_settings(group_settings(settings), wanted), sorted(domains),
                    stale_mode)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if seen is not None and seen[2] and not seen[0]:
        raise ConfigError(
            f"build_group args: {', '.join(in_place_written)}", "are set in a group "
            "application while serving.rollout.mode is in_place",
            "these settings in the front door's serving only (the coordinator restarts the "
            "engines with them; engram-ray check shows the layout)")
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

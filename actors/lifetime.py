"""How long the coordinator lives: through its own death, not past its application.

Its own death: the actor restarts (`max_restarts=-1`; Ray re-runs its constructor with the same
arguments and retries the calls that were in flight). What it decided is kept in Ray's KV store
(GCS) before any call that depends on it is answered: its settings (`save_settings`, JSON: the
build reads them too) and its state (`save_state`: every group's generations with their roles,
members, restarts in place and DP restart epochs, the in-place roll's turns, stop and start,
the metric targets, the replica actors it watches). A restarted coordinator restores both
before it answers its first call, so it makes the decisions the old one would have made, and
the calls Ray retries on it (join, member_restarting, ...) are answered as the first try would
have been. Its members still rejoin (each asks for the coordinator's incarnation every
`MEMBER_CHECK_S`), which confirms what they hold. A coordinator that finds no saved state (its
predecessor ran an older release) rebuilds from the rejoins alone, for up to `REBUILD_WAIT_S`.

Its application: the coordinator is detached (a `serve deploy` build task that creates it ends
at once), so it watches Serve for the application it belongs to, the one whose engine
deployments carry its deployment name (`engram_ray.serve.app`). Once it has seen that
application, it goes when the application goes (`serve shutdown`, `serve delete`): store
folders removed, targets emptied, the http_sd port closed, the actor ended for good. Serve shut
down after the coordinator saw it running ends it too, even when no engine deployment was ever
seen (every group's build failed).
"""

from __future__ import annotations

import json
import logging

import ray
from ray import cloudpickle

logger = logging.getLogger(__name__)

MEMBER_CHECK_S = 1.0     # how often a member asks for the coordinator's incarnation
# How long a restarted coordinator waits at most for its members (it goes on as soon as every
# serving gang is back). Past it, a group none of whose members rejoined is "not started" and
# the ingress answers 503 for it: 5 s was too short on 2 busy cores (2026-12-06, test_faults:
# the members rejoined 7.2 s after its new process started).
REBUILD_WAIT_S = 30.0
APP_CHECK_S = 5.0        # how often the coordinator looks for its Serve application


def is_restarted_actor() -> bool:
    """True in an actor that Ray restarted after its process died."""
    try:
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - no state API (a worker without GCS access): assume not
        return False


def application_names(deployment_name: str) -> tuple[set[str], set[str]] | None:
    """(names of the Serve applications, not being deleted, that hold the engine deployments
    of `deployment_name` (named `<class>:<deployment name>:group-<i>`), names of every
    application not being deleted); None when Serve cannot be asked now (its controller
    restarting); two empty sets when Serve was shut down (no controller)."""
    from ray import serve
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    from engram_ray.actors.placement import engine_deployment_marker

    try:
        applications = serve.status().applications
    except Exception:  # noqa: BLE001 - no answer: Serve shut down, or its controller restarts
        try:
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:  # `serve shutdown`: no controller, no application
            return set(), set()
        return None
    marker = engine_deployment_marker(deployment_name)
    live = {name for name, app in applications.items()
            if getattr(app.status, "value", app.status) != "DELETING"}
    return {name for name in live
            if any(marker in d for d in applications[name].deployments)}, live


class ApplicationWatch:
    """`gone()` is True once the application was seen and is no longer there.

    NOTES: "there" is by application name, not only by its engine deployments: while `serve
    deploy` (the declarative path, also KubeRay's) builds an application again, Serve lists it
    with no deployments at all; read as gone, that ended a serving coordinator."""

    def __init__(self, deployment_name: str):
        self.deployment_name, self.names = deployment_name, set()
        self.saw_serve = False  # Serve's controller answered once

    def gone(self) -> bool:
        found = application_names(self.deployment_name)
        if found is None:
            return False
        holding, live = found
        if holding:
            self.names |= holding
            return False
        if self.names:
            return not (self.names & live)
        # Never seen (every group's build failed): gone once Serve itself went after running
        # (`serve shutdown`).
        running = _serve_running()
        self.saw_serve = self.saw_serve or running
        return self.saw_serve and not running


def _serve_running() -> bool:
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return True
    except ValueError:
        return False


def _settings_key(name: str) -> bytes:
    return f"engram-coordinator-settings:{name}".encode()


def save_settings(name: str, app_config_dict: dict | None, domains: dict | None = None,
                  lineage: str | None = None) -> None:
    """Keep the coordinator's current settings and lineage in Ray's KV store (a rolled-out
    config outlives a restart); None removes them and its state."""
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

    if app_config_dict is None:
        _internal_kv_del(_settings_key(name))
        _internal_kv_del(_state_key(name))
        return
    _internal_kv_put(_settings_key(name), json.dumps({
        "app": app_config_dict, "domains": domains, "lineage": lineage}), overwrite=True)


def saved_settings(name: str) -> dict | None:
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(_settings_key(name))
    return json.loads(raw) if raw else None


def _state_key(name: str) -> bytes:
    return f"engram-coordinator-state:{name}".encode()


def save_state(name: str, state: dict) -> None:
    """Keep the coordinator's state (module doc) in Ray's KV store, pickled: its book's
    dataclasses and the replica actors' handles as they are."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(_state_key(name), cloudpickle.dumps(state), overwrite=True)


def saved_state(name: str) -> dict | None:
    """The state `save_state` kept, or None (none kept, or one this release cannot read:
    then the coordinator rebuilds from its members' rejoins)."""
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(_state_key(name))
    if not raw:
        return None
    try:
        return cloudpickle.loads(raw)
    except Exception:  # noqa: BLE001 - another release's classes: rebuild from the members
        logger.exception("engram-ray: the saved state of coordinator %s cannot be read; it "
                         "rebuilds from its members", name)
        return None

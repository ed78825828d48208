"""How long the coordinator lives: through its own death, not past its application.

Its own death: the actor restarts (`max_restarts=-1`; Ray re-runs its constructor with the same
arguments and retries the calls that were in flight). A restarted coordinator holds nothing, so
for `REBUILD_WAIT_S` it waits for the members to tell it what they hold (each replica asks for
the coordinator's incarnation every `MEMBER_CHECK_S` and rejoins when it changed,
`engram_ray.serve.member.link`); calls that read or change groups wait until then, so the
ingress keeps routing on the table it had and no gang opens a second generation.

Its application: the coordinator is detached (a `serve deploy` build task that creates it ends
at once), so it watches Serve for the application it belongs to, the one whose engine
deployments carry its deployment name (`engram_ray.serve.app`). Once it has seen that
application, it goes when the application goes (`serve shutdown`, `serve delete`): store
folders removed, targets emptied, the http_sd port closed, the actor ended for good.
"""

from __future__ import annotations

import json
import logging

import ray

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
    restarting); two empty sets when Serve was shut down."""
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

    def gone(self) -> bool:
        found = application_names(self.deployment_name)
        if found is None:
            return False
        holding, live = found
        if holding:
            self.names |= holding
            return False
        return bool(self.names) and not (self.names & live)


def _settings_key(name: str) -> bytes:
    return f"engram-coordinator-settings:{name}".encode()


def save_settings(name: str, app_config_dict: dict | None, domains: dict | None = None,
                  lineage: str | None = None) -> None:
    """Keep the coordinator's current settings and lineage in Ray's KV store (a rolled-out
    config outlives a restart); None removes them."""
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

    if app_config_dict is None:
        _internal_kv_del(_settings_key(name))
        return
    _internal_kv_put(_settings_key(name), json.dumps({
        "app": app_config_dict, "domains": domains, "lineage": lineage}), overwrite=True)


def saved_settings(name: str) -> dict | None:
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(_settings_key(name))
    return json.loads(raw) if raw else None

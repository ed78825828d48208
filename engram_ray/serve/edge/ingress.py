"""The OpenAI ingress over peer groups: Ray Serve LLM's `OpenAiIngress`, with one engine
deployment per peer group behind each model id instead of one.

Routing: requests go in turn to the groups that serve (the coordinator's `routing`, long-polled
by `GroupRouting`); inside a group Serve's router picks one of the members that serve
(`engram_ray.serve.edge.member_router.LiveMemberRouter`, reading `live_replica_ids`). A member whose
engine restarts gets no requests while its group's other members serve on; a group stops
getting requests the moment the coordinator marks it broken (a member lost) or this ingress
sees it fail. Faults as the client sees them:

    member or group fails before anything  once the coordinator's routing changes (a member
    was sent                               restarting, a group broken: within a second), the
                                           request goes to a member or group that serves; with
                                           none left: 503 + Retry-After
    fails mid-stream                       the stream ends with an error event, then [DONE]
                                           (as vLLM's own server ends a stream whose engine
                                           died), never with a clean end and no finish_reason
"""

# Over 300 lines: the routing table the ingress follows (`GroupRouting`) and the request path
# that reads it at every pick and retry (`PeerGroupIngress`) change together.

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import logging
import time

from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress

logger = logging.getLogger("ray.serve")

RETRY_AFTER_S = 5          # a restarting group serves again after tens of seconds at best
ROUTING_POLL_S = 10.0      # long-poll timeout of the coordinator's routing table
# After a failure before the first chunk: how long to wait for the coordinator's word (a
# member restarting, a group broken: a change since the request was sent) before the request
# is tried again or the error stands.
BROKEN_WAIT_S = 1.0
MAX_ATTEMPTS = 4           # tries of one request (each after the routing changed)
# A group this ingress saw fail is skipped this long unless the coordinator's routing changes
# sooner (a new generation, or a member restarting while the others serve); after that the
# coordinator's word (it finds a dead member within a second) decides, so a transient error
# cannot take a healthy group out for good.
LOST_HINT_S = 10.0
# The failures of a group (not of a request): the replica or its engine is gone.
GROUP_FAILURES = {"RayActorError", "ActorDiedError", "ActorUnavailableError",
                  "DeploymentUnavailableError", "EngineDeadError", "EngineGenerateError",
                  "MemberRetiredError"}
# A member of a gang a rolling change replaced refuses new requests: not a failure of its
# group (which serves on the new gang), so it is tried again after this pause, not skipped.
RETIRED_FAILURE, RETIRED_WAIT_S = "MemberRetiredError", 0.5

_picked = contextvars.ContextVar("engram_picked_handle", default=None)
# Where a request went ({"group", "generation"}), filled by `_get_response` for the
# response headers GROUP_HEADER / GENERATION_HEADER.
_route_note = contextvars.ContextVar("engram_route_note", default=None)
GROUP_HEADER, GENERATION_HEADER = "x-engram-peer-group", "x-engram-generation"
# The version of the engine settings that answered (`engram_ray.serve.settings.config_change`).
CONFIG_HEADER = "x-engram-config"


class GroupsUnavailable(Exception):
    """No peer group of the model serves now."""


class GroupLeft(Exception):
    """The coordinator stopped routing to the group before its first chunk came (its members
    stopped, e.g. its application was deleted by `serve deploy`): nothing was sent yet, so the
    request goes to another group."""


# The replica ids of every member that serves, as this process's ingress last heard from the
# coordinator (None: not known yet); read by `engram_ray.serve.edge.member_router` in this process.
_live_replicas: set[str] | None = None


def live_replica_ids() -> set[str] | None:
    return _live_replicas


def is_group_failure(exc: BaseException) -> bool:
    """True for the exceptions a dead replica or engine raises (also wrapped by Ray)."""
    return is_failure_named(exc, *GROUP_FAILURES)


def is_failure_named(exc: BaseException, *names: str) -> bool:
    """True when `exc` or one of its causes (Ray wraps them) has one of these class names."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if type(exc).__name__ in names:
            return True
        exc = getattr(exc, "cause", None) or exc.__cause__
    return False


def error_event(message: str, code: int = 503) -> str:
    """An OpenAI-style error event of a stream (`data: {"error": ...}`)."""
    return "data: " + json.dumps({"error": {"message": message, "type": "ServiceUnavailable",
                                            "param": None, "code": code}}) + "\n\n"


class GroupRouting:
    """The coordinator's routing table as this ingress last saw it, plus the groups this
    ingress saw fail (until the coordinator reports a new generation for them)."""

    def __init__(self, deployment_name: str):
        self.deployment_name = deployment_name
        self.table: dict[str, dict] | None = None  # None: not known yet (route to every group)
        self.lost: dict[tuple[str, str | None], float] = {}  # (group, generation) -> when
        self.version = 0  # bumped by every change the coordinator reports
        self._updated = asyncio.Event()
        self._task: asyncio.Task | None = None

    def ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        from engram_ray.actors.coordinator_lookup import find_coordinator

        version = -1
        while True:
            try:
                # A lookup in the GCS, off the event loop the replica's requests share.
                coordinator = await asyncio.to_thread(find_coordinator, self.deployment_name)
                while True:
                    seen = version
                    version, table = await coordinator.routing.remote(version, ROUTING_POLL_S)
                    self._update(table, changed=version != seen)
            except Exception as exc:  # coordinator restarting: route on what is known
                logger.warning("engram-ray ingress: routing table unavailable: %s", exc)
                await asyncio.sleep(1.0)

    def _update(self, table: dict[str, dict], changed: bool = True) -> None:
        global _live_replicas
        if table != self.table:
            logger.info("engram-ray ingress: routing %s", {
                g: f"serving ({len(r['serving_members'])} members)" if r["serving"]
                else r["reason"] for g, r in table.items()})
        self.table = table
        _live_replicas = {m for r in table.values() if r["serving"] for m in r["serving_members"]}
        # A group this ingress saw fail stays skipped until the coordinator speaks again: a
        # changed table that still has it serving (a member restarting, its other members
        # serve) is the coordinator's word on that failure.
        self.lost = {(g, gen): at for (g, gen), at in self.lost.items()
                     if table.get(g, {}).get("generation") == gen
                     and not (changed and table[g].get("serving"))}
        if changed:
            self.version += 1
            self._updated.set()
            self._updated = asyncio.Event()

    async def wait_change(self, since: int, timeout_s: float) -> bool:
        """True once the coordinator's routing has changed since `version` was `since`
        (at once if it has already; else within `timeout_s`)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.version == since:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._updated.wait(), remaining)
            except asyncio.TimeoutError:
                return False
        return True

    def generation(self, group_id: str) -> str | None:
        return (self.table or {}).get(group_id, {}).get("generation")

    def is_serving(self, group_id: str) -> bool:
        lost_at = self.lost.get((group_id, self.generation(group_id)))
        if lost_at is not None and time.monotonic() - lost_at < LOST_HINT_S:
            return False
        return self.table is None or self.table.get(group_id, {}).get("serving", False)

    def has_left(self, group_id: str) -> bool:
        """The coordinator's table no longer has `group_id` serving (gone, or not serving)."""
        return self.table is not None and not self.table.get(group_id, {}).get("serving")

    async def first_chunk(self, stream, group_id: str):
        """`stream`'s first chunk; `GroupLeft` when the routing changes before it comes and
        `group_id` no longer serves (a request queued for a group whose replicas Serve
        stops would otherwise wait until its ingress replica is stopped)."""
        first = asyncio.ensure_future(stream.__anext__())
        try:
            while True:
                changed = asyncio.ensure_future(self.wait_change(self.version, ROUTING_POLL_S))
                done, _ = await asyncio.wait({first, changed},
                                             return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                if first in done:
                    return first.result()
                if self.has_left(group_id):
                    raise GroupLeft(group_id)
        finally:
            if not first.done():
                first.cancel()

    def mark_lost(self, group_id: str, generation: str | None) -> None:
        self.lost.setdefault((group_id, generation), time.monotonic())

    def describe(self) -> str:
        if self.table is None:
            return "routing not known yet"
        return "; ".join(f"{g}: {r['reason'] or 'serving'}" for g, r in self.table.items())


class PeerGroupIngress(OpenAiIngress):
    def __init__(self, model_cards: dict, *, peer_groups: dict, deployment_name: str,
                 **kwargs):
        """`peer_groups`: {model id: {group id: (engine deployment, its application)}}: each
        group is an application of its own (`engram_ray.serve.app`), found by name."""
        from ray import serve

        handles = {model_id: {group_id: serve.get_deployment_handle(
            deployment, app_name, _check_exists=False, _record_telemetry=False)
            for group_id, (deployment, app_name) in groups.items()}
            for model_id, groups in peer_groups.items()}
        super().__init__({m: next(iter(g.values())) for m, g in handles.items()}, model_cards,
                         **kwargs)
        self._group_handles = {model_id: {group_id: h.options(stream=True)
                                          for group_id, h in groups.items()}
                               for model_id, groups in handles.items()}
        self._turn = itertools.count()
        self._routing = GroupRouting(deployment_name)

    async def check_health(self):
        self._routing.ensure_started()

    def _get_configured_serve_handle(self, model_id: str):
        picked = _picked.get()
        if picked is not None:
            return picked
        return super()._get_configured_serve_handle(model_id)

    def _pick(self, model_id: str, tried: set) -> tuple[str, object]:
        groups = self._group_handles[model_id]
        order = list(groups)
        start = next(self._turn)
        for i in range(len(order)):
            group_id = order[(start + i) % len(order)]
            if group_id not in tried and self._routing.is_serving(group_id):
                return group_id, groups[group_id]
        raise GroupsUnavailable(f"no peer group of {model_id!r} serves now "
                                f"({self._routing.describe()}); retry in {RETRY_AFTER_S} s")

    async def _get_response(self, *, body, call_method: str, raw_request=None):
        self._routing.ensure_started()
        model_id = await self._get_model_id(body.model)
        if model_id not in self._group_handles:  # e.g. a LoRA id: Ray Serve LLM's own routing
            async for item in super()._get_response(body=body, call_method=call_method,
                                                    raw_request=raw_request):
                yield item
            return
        tried: set[str] = set()
        for attempt in range(1, MAX_ATTEMPTS + 1):
            group_id, handle = self._pick(model_id, tried)
            generation, seen = self._routing.generation(group_id), self._routing.version
            token = _picked.set(handle)
            try:
                stream = super()._get_response(body=body, call_method=call_method,
                                               raw_request=raw_request)
                first = await self._routing.first_chunk(stream, group_id)
            except StopAsyncIteration:
                return
            except GroupLeft:
                logger.warning("engram-ray ingress: %s stopped serving before a request's first "
                               "chunk; sending it to a group that serves", group_id)
                tried.add(group_id)
                if attempt == MAX_ATTEMPTS:
                    raise GroupsUnavailable(f"peer group {group_id} stopped serving; retry in "
                                            f"{RETRY_AFTER_S} s") from None
                continue
            except Exception as exc:
                if not is_group_failure(exc) or attempt == MAX_ATTEMPTS:
                    raise
                if is_failure_named(exc, RETIRED_FAILURE):
                    # A replaced gang's member, still known to Serve's router while the new
                    # one is not yet: its group serves (on the new gang); try again shortly.
                    await asyncio.sleep(RETIRED_WAIT_S)
                    continue
                if not await self._routing.wait_change(seen, BROKEN_WAIT_S):
                    self._lost(group_id, generation, exc)
                    tried.add(group_id)
                continue
            finally:
                _picked.reset(token)
            if (_is_server_error(first) and attempt < MAX_ATTEMPTS
                    and await self._routing.wait_change(seen, BROKEN_WAIT_S)):
                logger.warning("engram-ray ingress: a member of %s failed a request before "
                               "its first chunk; trying a member that serves", group_id)
                await stream.aclose()
                continue
            break
        note = _route_note.get()
        if note is not None:
            note.update(group=group_id, generation=generation, config=_config_of(first))
        yield first
        try:
            async for item in stream:
                yield item
        except Exception as exc:  # after the first chunk: the client must see it fail
            # A dead engine or replica: the coordinator's routing moves the next requests.
            if not is_group_failure(exc):
                logger.exception("engram-ray ingress: stream of %s failed", group_id)
            yield error_event(f"an engine of peer group {group_id} failed while serving this "
                              "request; retry it")

    def _lost(self, group_id: str, generation: str | None, exc: BaseException) -> None:
        logger.warning("engram-ray ingress: %s (generation %s) lost: %s", group_id,
                       generation, type(exc).__name__)
        self._routing.mark_lost(group_id, generation)

    async def _process_llm_request(self, body, call_method: str, raw_request=None):
        from starlette.responses import JSONResponse

        note = {}
        _route_note.set(note)
        try:
            response = await super()._process_llm_request(body, call_method, raw_request)
            if note.get("group"):
                response.headers[GROUP_HEADER] = note["group"]
                response.headers[GENERATION_HEADER] = note["generation"] or ""
                response.headers[CONFIG_HEADER] = note.get("config") or ""
            return response
        except GroupsUnavailable as exc:
            return JSONResponse(status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)},
                                content={"error": {"message": str(exc),
                                                   "type": "ServiceUnavailable",
                                                   "param": None, "code": 503}})


def _config_of(chunk) -> str | None:
    """The settings version in a first chunk's `system_fingerprint`
    (`engram_ray.serve.edge.fingerprint.tag_generation`): a response, an SSE packet, or a list."""
    from engram_ray.serve.edge.fingerprint import fingerprint_parts

    first = chunk[0] if isinstance(chunk, list) and chunk else chunk
    fingerprint = getattr(first, "system_fingerprint", None)
    if isinstance(first, str) and '"system_fingerprint"' in first:
        try:
            fingerprint = json.loads(first.partition("data: ")[2]).get("system_fingerprint")
        except (ValueError, AttributeError):
            fingerprint = None
    return fingerprint_parts(fingerprint)[1]


def _is_server_error(chunk) -> bool:
    """A first chunk that is an engine-side 5xx (vLLM's answer once its engine is dead)."""
    first = chunk[0] if isinstance(chunk, list) and chunk else chunk
    error = getattr(first, "error", None)
    return getattr(error, "code", 0) >= 500 if error is not None else False

"""The one place that checks requests and shapes every error of the OpenAI endpoint.

    ApiGuard(app, limits)      pure ASGI middleware, outermost (outside Starlette's
                               ServerErrorMiddleware too: `guarded_ingress_app`)
      POST JSON endpoint       Content-Type (415), body size (413), JSON with finite numbers
                               and encodable strings (400 naming the field), per-request caps
                               (400 naming the cap, `RequestLimits`); then the body is
                               replayed to the app unchanged
      status >= 400            body rewritten to `engram_ray.serve.edge.api_errors`' shape
                               (headers kept: Retry-After on 503s); 5xx generic + request id,
                               the full text to the log
      text/event-stream        `data: {"error": ...}` events rewritten the same way; every
                               other event passes through as sent, chunk by chunk; a stream
                               that ends with neither [DONE] nor an error event (its
                               generator raised) gets an error event and [DONE]
      uncaught exception       a clean 500 before the response started

    guarded_ingress_app(limits, max_model_len) -> FastAPI   Ray Serve LLM's ingress app with it
"""

from __future__ import annotations

import functools
import json
import logging
import re
import uuid

from engram_ray.serve.edge import api_errors, request_caps, request_checks
from engram_ray.serve.settings.config import RequestLimits
from engram_ray.serve.edge.request_checks import RequestRefused

logger = logging.getLogger("engram_ray.api_guard")
MAX_ERROR_BODY_BYTES = 1 << 20  # an upstream error body is read this far, the rest dropped
MAX_DRAIN_FACTOR = 4  # an oversized declared body is read (and dropped) up to 4x the cap


class ApiGuard:
    def __init__(self, app, limits: RequestLimits | None = None,
                 max_model_len: int | None = None):
        self.app = app
        self.limits = limits or RequestLimits()
        self.max_model_len = max_model_len  # what a choice without max_tokens may generate

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = _request_id(scope)
        endpoint = _endpoint(scope)
        if scope["method"] == "POST" and endpoint in request_checks.JSON_ENDPOINTS:
            try:
                raw = await self._checked_body(scope, receive, endpoint)
            except RequestRefused as refused:
                return await _send_error(send, refused.status, refused.message, refused.param)
            receive = _replay(raw, receive)
        shaped = _ShapedSend(send, request_id, scope)
        try:
            await self.app(scope, receive, shaped)
        except Exception:  # noqa: BLE001 - the last place an error can be shaped
            logger.exception("request %s %s failed (request id %s)", scope["method"],
                             scope["path"], request_id)
            await shaped.fail()

    async def _checked_body(self, scope, receive, endpoint: str) -> bytes:
        request_checks.check_content_type(_header(scope, b"content-type"))
        raw = await _read_body(receive, _header(scope, b"content-length"),
                               self.limits.max_body_bytes)
        body = request_checks.parse_body(raw)
        request_caps.check_request(endpoint, body, self.limits, self.max_model_len)
        return raw


def guarded_ingress_app(limits: RequestLimits | None = None, max_model_len: int | None = None):
    """Ray Serve LLM's OpenAI ingress FastAPI app (`init()`: its exception handling, CORS,
    metrics and request-id middleware) with `ApiGuard` around everything, Starlette's
    ServerErrorMiddleware included. Pass it to `make_fastapi_ingress(..., app=...)`."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from ray.llm._internal.serve.core.ingress.ingress import init

    app = init()
    app.add_exception_handler(RequestValidationError, _validation_error)
    # NOTES: Starlette builds the stack on the first request (`build_middleware_stack`);
    # `add_middleware` would put the guard inside ServerErrorMiddleware, whose 500s would
    # then bypass it. The partial pickles with the app (Serve ships the app to replicas).
    app.build_middleware_stack = functools.partial(_guarded_stack, FastAPI, app, limits,
                                                   max_model_len)
    return app


def _guarded_stack(app_cls, app, limits, max_model_len):
    return ApiGuard(app_cls.build_middleware_stack(app), limits, max_model_len)


async def _validation_error(request, exc):
    """The request model refused a field: its path as `param` (Ray's own handler puts the
    refused input there, e.g. a whole oversized `stop` list)."""
    from starlette.responses import JSONResponse

    first = exc.errors()[0] if exc.errors() else {}
    loc = _field_path(first.get("loc", ())[1:]) or None
    what = f"Invalid value for {loc}" if loc else "Invalid request body"
    payload = api_errors.error_payload(400, f"{what}: {first.get('msg', 'invalid')}", loc)
    return JSONResponse(payload, status_code=400)


def _field_path(loc) -> str:
    """("messages", 0, "content") -> "messages[0].content"; pydantic's union-branch tags
    ("list[constrained-int]", "ChatCompletionUserMessageParam") are dropped."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", str(part)):
            path += f".{part}" if path else str(part)
    return path


class _ShapedSend:
    """`send` of the app, with error responses and stream error events rewritten."""

    def __init__(self, send, request_id: str, scope):
        self.send, self.request_id, self.scope = send, request_id, scope
        self.start = None        # the app's http.response.start of an error response
        self.error_body = b""
        self.is_started = False  # a response start went to the client
        self.is_stream = False
        self.is_done = False
        self.carry = b""         # an event stream's incomplete last event
        self.is_last_done = False     # the last complete event was data: [DONE]
        self.has_error_event = False  # an error event went out on this stream

    async def __call__(self, message):
        kind = message["type"]
        if kind == "http.response.start":
            if message["status"] >= 400:
                self.start = message
                return
            self.is_stream = b"text/event-stream" in _headers_value(message, b"content-type")
            self.is_started = True
            return await self.send(message)
        if kind != "http.response.body":
            return await self.send(message)
        if self.start is not None:
            return await self._collect_error(message)
        if self.is_stream:
            return await self._stream_body(message)
        self.is_done = not message.get("more_body", False)
        return await self.send(message)

    async def _collect_error(self, message):
        room = MAX_ERROR_BODY_BYTES - len(self.error_body)
        self.error_body += message.get("body", b"")[:max(room, 0)]
        if message.get("more_body", False):
            return
        status = self.start["status"]
        headers = [(k, v) for k, v in self.start.get("headers", [])
                   if k.lower() not in (b"content-length", b"content-type")]
        retry_after = _headers_value(self.start, b"retry-after").decode() or None
        body, upstream = api_errors.clean_error(status, self.error_body, self.request_id,
                                                retry_after)
        self._log(status, upstream)
        self.start = None
        await _send_json(self.send, status, body, headers)
        self.is_started = self.is_done = True

    async def _stream_body(self, message):
        data = self.carry + message.get("body", b"")
        more = message.get("more_body", False)
        last = data.rfind(b"\n\n")
        end = (last + 2 if last >= 0 else 0) if more else len(data)
        events, self.carry = data[:end], data[end:]
        if b'"error"' in events:
            events = b"".join(self._clean_event(e) for e in events.split(b"\n\n"))
        if events.strip():
            self.is_last_done = events.rstrip().endswith(b"data: [DONE]")
        if not more and not (self.is_last_done or self.has_error_event):
            # NOTES: Ray's exception middleware (a BaseHTTPMiddleware) ends the body cleanly
            # when the stream's generator raises; without this the client sees a clean end.
            logger.error("event stream of %s (request id %s) ended without [DONE]",
                         self.scope["path"], self.request_id)
            events += self._error_event()
        self.is_done = not more
        if events or not more:
            await self.send({"type": "http.response.body", "body": events, "more_body": more})

    def _error_event(self) -> bytes:
        message = api_errors.generic_message(500, self.request_id)
        self.has_error_event = True
        return b"data: " + api_errors.error_bytes(500, message) + b"\n\ndata: [DONE]\n\n"

    def _clean_event(self, event: bytes) -> bytes:
        if not event:
            return b""
        payload = event[5:].strip() if event.startswith(b"data:") else b""
        try:
            doc = json.loads(payload) if payload.startswith(b"{") else None
        except ValueError:
            doc = None
        if not (isinstance(doc, dict) and "error" in doc):
            return event + b"\n\n"
        code = doc["error"].get("code") if isinstance(doc["error"], dict) else None
        status = code if isinstance(code, int) and 400 <= code <= 599 else 500
        body, upstream = api_errors.clean_error(status, payload, self.request_id)
        self._log(status, upstream, "stream error event")
        self.has_error_event = True
        return b"data: " + body + b"\n\n"

    async def fail(self):
        """The app raised: a clean 500 if nothing was sent, else end the stream visibly."""
        if not self.is_started:
            message = api_errors.generic_message(500, self.request_id)
            await _send_json(self.send, 500, api_errors.error_bytes(500, message), [])
        elif self.is_stream and not self.is_done:
            await self.send({"type": "http.response.body", "body": self._error_event(),
                             "more_body": False})
        # A plain response cut off after its start: nothing valid can follow.

    def _log(self, status: int, upstream: str, what: str = "error response"):
        log = logger.error if status >= 500 else logger.info
        log("%s %d to %s %s (request id %s): %s", what, status, self.scope["method"],
            self.scope["path"], self.request_id, upstream[:4000])


async def _read_body(receive, content_length: str | None, max_bytes: int) -> bytes:
    declared = int(content_length) if content_length and content_length.isdigit() else None
    too_big = RequestRefused(413, f"The body is larger than the server's limit max_body_bytes"
                                  f" = {max_bytes} bytes.")
    if declared is not None and declared > MAX_DRAIN_FACTOR * max_bytes:
        raise too_big
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise RequestRefused(400, "The client went away before sending the whole body.")
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size <= max_bytes:
            chunks.append(chunk)
        elif declared is None:  # no declared size: stop reading at the cap
            raise too_big
    if size > max_bytes:  # read to the end so the client gets the 413, not a reset
        raise too_big
    return b"".join(chunks)


def _replay(raw: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()  # http.disconnect when the client goes away

    return replayed


async def _send_error(send, status: int, message: str, param: str | None):
    await _send_json(send, status, api_errors.error_bytes(status, message, param), [])


async def _send_json(send, status: int, body: bytes, headers: list):
    headers = list(headers) + [(b"content-type", b"application/json"),
                               (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _headers_value(message, name: bytes) -> bytes:
    return next((v for k, v in message.get("headers", []) if k.lower() == name), b"")


def _request_id(scope) -> str:
    """Serve's proxy sets x-request-id; without one (tests, direct ASGI) one is made and put
    in the headers, where Ray's SetRequestIdMiddleware finds the same id."""
    request_id = _header(scope, b"x-request-id")
    if not request_id:
        request_id = str(uuid.uuid4())
        scope["headers"] = list(scope.get("headers", [])) + [(b"x-request-id",
                                                               request_id.encode())]
    return request_id


def _endpoint(scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    path = path[len(root):] if root and path.startswith(root) else path
    return path.rstrip("/") or "/"

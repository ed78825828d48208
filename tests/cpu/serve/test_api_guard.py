"""The API guard around Ray Serve LLM's real OpenAI ingress, with no network and no engine.

The app is Ray's own (`init()`: its exception handling, CORS, metrics, request-id middleware)
with the guard as `build_app` installs it, and the routes are Ray's `OpenAiIngress` methods
(Ray's request models, model lookup, stream wrapping, error conversion). Only the engine
deployment handle is replaced: it answers as Ray's `LLMServer` does (responses, SSE chunk
lists, `ErrorResponse`s) or raises as a dead replica does.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from fastapi import HTTPException
from ray.llm._internal.serve.core.configs.openai_api_models import (CompletionResponse, ErrorInfo,
                                                                    ErrorResponse, ModelCard)
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS, OpenAiIngress, init
from starlette.responses import JSONResponse
from starlette.testclient import TestClient

from engram_ray.errors import ConfigError
from engram_ray.local.probes import check_response, probe_summary, probe_table
from engram_ray.serve.edge.api_errors import MAX_MESSAGE_CHARS, leaks
from engram_ray.serve.edge.api_guard import ApiGuard, guarded_ingress_app
from engram_ray.serve.settings.config import RequestLimits, ServingConfig

MODEL = "engram-tiny"
JSON_HEADERS = {"content-type": "application/json"}
# What a dead replica's error looks like at the ingress (a RayTaskError's text).
RAY_TASK_ERROR = ('ray.exceptions.RayTaskError(UnicodeEncodeError): ray::ServeReplica:'
                  'engram:EngramLLMServer.handle_request_streaming() (pid=4242)\n'
                  'Traceback (most recent call last):\n  File "/usr/lib/python3.11/site-'
                  'packages/vllm/entrypoints/openai/serving_completion.py", line 120, in '
                  "create_completion\nUnicodeEncodeError: 'utf-8' codec can't encode "
                  "character '\\ud800' in position 1: surrogates not allowed" + " x" * 3000)
LEAKY_MESSAGE = 'Traceback (most recent call last):\n  File "/root/engine.py", line 3'


def completion_response(text: str = " flows") -> CompletionResponse:
    return CompletionResponse.model_validate({
        "id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}})


def sse(doc) -> str:
    return f"data: {json.dumps(doc)}\n\n"


def chunk(text: str, finish=None) -> str:
    return sse({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
                "choices": [{"index": 0, "text": text, "finish_reason": finish}]})


class Engine:
    """The engine deployment handle: `.completions.remote(body, raw)` as `LLMServer` answers,
    chosen by the prompt."""

    def __init__(self):
        self.requests = []

    def options(self, **_):
        return self

    def __getattr__(self, method):
        if method not in ("completions", "chat"):
            raise AttributeError(method)
        engine = self

        class Method:
            @staticmethod
            def remote(body, raw_request_info):
                engine.requests.append(body)
                return engine.answer(body)

        return Method

    async def answer(self, body):
        prompt = getattr(body, "prompt", None) or "chat"
        if prompt == "engine-400":  # vLLM refused it inside the engine
            yield ErrorResponse(error=ErrorInfo(
                message="This model's maximum context length is 512 tokens. However, you "
                        "requested 900 tokens.", type="BadRequestError", code=400))
        elif prompt == "engine-crash":
            raise RuntimeError(RAY_TASK_ERROR)
        elif prompt == "unavailable":
            raise HTTPException(503, "peer group 0 is restarting", headers={"Retry-After": "3"})
        elif prompt == "stream-error":
            yield [chunk(" flows")]
            yield [sse({"error": {"message": LEAKY_MESSAGE, "type": "EngineDeadError",
                                  "param": None, "code": 500}})]
        elif prompt == "stream-raise":
            yield [chunk(" flows")]
            raise RuntimeError(RAY_TASK_ERROR)
        elif getattr(body, "stream", False):
            yield [chunk(" flows")]
            yield [chunk(" on", "length")]
        else:
            yield completion_response()


def ingress_app(app, engine: Engine):
    """Ray's OpenAI ingress routes, bound to one instance, on `app`."""
    card = ModelCard(id=MODEL, object="model", owned_by="test", permission=[], metadata={})
    ingress = OpenAiIngress({MODEL: engine}, {MODEL: card})
    for name, route in DEFAULT_ENDPOINTS.items():
        route(app)(getattr(ingress, name))

    @app.get("/test/unavailable")  # a 503 response returned (not raised) by a route
    async def unavailable():
        return JSONResponse({"detail": "no healthy peer group"}, status_code=503,
                            headers={"Retry-After": "7"})

    return app


@pytest.fixture(scope="module")
def engine():
    return Engine()


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(ingress_app(guarded_ingress_app(), engine),
                    raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def bare_client():
    """Ray's app without the guard: what the user saw in issue 20."""
    with TestClient(ingress_app(init(), Engine()), raise_server_exceptions=False) as c:
        yield c


def post(client, path, doc, **kw):
    return client.post(path, content=json.dumps(doc).encode(), headers=JSON_HEADERS, **kw)


def assert_clean(response, status):
    assert response.status_code == status, response.text
    assert len(response.content) <= 1024, len(response.content)
    assert not leaks(response.text), (leaks(response.text), response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and len(error["message"]) <= MAX_MESSAGE_CHARS
    return error


@pytest.mark.parametrize("probe", probe_table(MODEL), ids=lambda p: p.name)
def test_every_probe_gets_its_4xx_with_a_clean_body(client, probe):
    response = client.request(probe.method, probe.path, headers=probe.headers,
                              content=probe.body)
    result = check_response(probe, response.status_code, response.content)
    assert result.ok, (result, response.text[:500])


def test_probes_are_what_broke_without_the_guard(bare_client):
    """The table finds issue 20's failures on Ray's bare app (so the test above can fail)."""
    by_name = {}
    for probe in probe_table(MODEL):
        response = bare_client.request(probe.method, probe.path, headers=probe.headers,
                                       content=probe.body)
        by_name[probe.name] = check_response(probe, response.status_code, response.content)
    assert by_name["wrong_content_type"].status == 500
    assert by_name["n_1000"].status == 200
    assert by_name["stop_list_39kb"].body_size > 20_000
    assert "internal name" in by_name["unknown_path"].leaks or not by_name["unknown_path"].ok
    summary = probe_summary(list(by_name.values()))
    assert summary["malformed_ok"] < summary["malformed_probes"] / 2, summary


def test_caps_are_refused_naming_the_cap_and_its_limit(client):
    limits = RequestLimits()
    good = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    cases = [({"n": 9}, "max_n = 8", "n"),
             ({"n": 8, "max_tokens": 8193}, "max_generated_tokens = 65536", "max_tokens"),
             ({"stop": ["a"] * 5}, "max_stop_sequences = 4", "stop"),
             ({"stop": "s" * 257}, "max_stop_chars = 256", "stop"),
             ({"logprobs": 21}, "max_logprobs = 20", "logprobs"),
             ({"prompt": ["x"] * 65}, "max_prompts = 64", "prompt")]
    for fields, named, param in cases:
        error = assert_clean(post(client, "/v1/completions", {**good, **fields}), 400)
        assert named in error["message"] and error["param"] == param, error
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    error = assert_clean(post(client, "/v1/chat/completions",
                              {**chat, "n": 2, "max_completion_tokens": 40_000}), 400)
    assert "max_completion_tokens" in error["message"]
    body = json.dumps({**good, "prompt": "x" * limits.max_body_bytes}).encode()
    error = assert_clean(client.post("/v1/completions", content=body, headers=JSON_HEADERS),
                         413)
    assert f"max_body_bytes = {limits.max_body_bytes}" in error["message"]


def test_caps_come_from_the_serving_config():
    serving = ServingConfig.from_dict({"request_limits": {"max_n": 2}})
    assert serving.request_limits == RequestLimits(max_n=2)
    assert ServingConfig.from_dict(serving.to_dict()) == serving  # as replicas get it
    with pytest.raises(ConfigError, match="serving: request_limits: max_nn: is not a known"):
        ServingConfig.from_dict({"request_limits": {"max_nn": 2}}, "serving")
    with pytest.raises(ConfigError, match="max_n: is 0"):
        RequestLimits(max_n=0)
    with TestClient(ingress_app(guarded_ingress_app(RequestLimits(max_n=2)), Engine())) as c:
        assert "max_n = 2" in post(c, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                          "n": 3}).json()["error"]["message"]
        assert post(c, "/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}).is_success


def test_good_requests_pass_byte_identical(client, bare_client, engine):
    doc = {"model": MODEL, "prompt": "The river", "max_tokens": 4, "temperature": 0.0,
           "stop": ["\n"], "n": 2}
    guarded, bare = post(client, "/v1/completions", doc), post(bare_client, "/v1/completions",
                                                                   doc)
    assert guarded.status_code == bare.status_code == 200
    assert guarded.content == bare.content
    assert engine.requests[-1].model_dump() == {**engine.requests[-1].model_dump(), **doc}
    stream = {**doc, "stream": True}
    guarded, bare = post(client, "/v1/completions", stream), post(bare_client,
                                                                  "/v1/completions", stream)
    assert guarded.content == bare.content and guarded.content.endswith(b"data: [DONE]\n\n")
    models = client.get("/v1/models")
    assert models.content == bare_client.get("/v1/models").content


def test_body_reaches_the_app_unchanged_and_streams_are_not_buffered():
    """ApiGuard around a raw ASGI app: the app reads the exact bytes sent; its three stream
    chunks leave as three sends, each as sent."""
    sent_body = json.dumps({"model": MODEL, "prompt": "é \U0001F600 \\u00e9",
                            "max_tokens": 3}, ensure_ascii=False).encode()
    chunks = [b"data: {\"a\": 1}\n\n", b"data: {\"b\": 2}\n\ndata: {\"c\": 3}\n\n",
              b"data: [DONE]\n\n"]
    received, outgoing = [], []

    async def app(scope, receive, send):
        message = await receive()
        received.append(message["body"])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i, data in enumerate(chunks):
            await send({"type": "http.response.body", "body": data,
                        "more_body": i < len(chunks) - 1})

    async def run():
        messages = [{"type": "http.request", "body": sent_body[:10], "more_body": True},
                    {"type": "http.request", "body": sent_body[10:], "more_body": False}]

        async def receive():
            return messages.pop(0)

        async def send(message):
            outgoing.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(b"content-type", b"application/json")]}
        await ApiGuard(app)(scope, receive, send)

    asyncio.run(run())
    assert received == [sent_body]
    assert [m["body"] for m in outgoing[1:]] == chunks


def test_engine_errors_lose_internal_names_and_tracebacks(client, bare_client):
    doc = {"model": MODEL, "prompt": "engine-400", "max_tokens": 4}
    bare = post(bare_client, "/v1/completions", doc)
    assert "OpenAIHTTPException" in bare.text  # what issue 20 found
    error = assert_clean(post(client, "/v1/completions", doc), 400)
    assert error["message"].startswith("This model's maximum context length is 512 tokens")
    crash = {**doc, "prompt": "engine-crash"}
    assert "Traceback" in post(bare_client, "/v1/completions", crash).text
    request_id = "req-0451"
    response = client.post("/v1/completions", content=json.dumps(crash).encode(),
                           headers={**JSON_HEADERS, "x-request-id": request_id})
    error = assert_clean(response, 500)
    assert request_id in error["message"] and error["type"] == "server_error"


def test_503_keeps_retry_after_raised_or_returned(client):
    response = post(client, "/v1/completions", {"model": MODEL, "prompt": "unavailable"})
    error = assert_clean(response, 503)
    assert response.headers["retry-after"] == "3" and "retry in 3 s" in error["message"]
    response = client.get("/test/unavailable")
    assert_clean(response, 503)
    assert response.headers["retry-after"] == "7"


def test_stream_error_events_are_sanitized(client):
    doc = {"model": MODEL, "prompt": "stream-error", "max_tokens": 4, "stream": True}
    response = post(client, "/v1/completions", doc)
    events = [e for e in response.text.split("\n\n") if e]
    assert events[0] == chunk(" flows").strip() and events[-1] == "data: [DONE]"
    error = json.loads(events[1][len("data: "):])["error"]
    assert error["code"] == 500 and not leaks(events[1]) and "request id" in error["message"]


def test_exception_mid_stream_ends_with_an_error_event(client):
    doc = {"model": MODEL, "prompt": "stream-raise", "max_tokens": 4, "stream": True}
    response = post(client, "/v1/completions", doc)
    events = [e for e in response.text.split("\n\n") if e]
    assert events[0] == chunk(" flows").strip(), response.text
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == 500, events
    assert events[-1] == "data: [DONE]" and not leaks(response.text)


def test_guard_survives_the_pickling_serve_does():
    """`serve.ingress` freezes the app as below, and ships it to replicas the same way."""
    from ray import cloudpickle
    from ray._common.serialization import pickle_dumps
    from ray.serve._private.utils import ensure_serialization_context

    ensure_serialization_context()
    app = cloudpickle.loads(pickle_dumps(ingress_app(guarded_ingress_app(), Engine()), "app"))
    with TestClient(app) as c:
        response = c.post("/v1/completions", content=b'{"model": "x"}')
    assert_clean(response, 415)


def test_readme_lists_every_request_limit():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    for name in RequestLimits.model_fields:
        assert f"| `{name}` |" in readme, name


@pytest.fixture(scope="module")
def http_url():
    """The guarded ingress app behind uvicorn on 127.0.0.1 (real HTTP, as Serve's proxy)."""
    import threading

    import uvicorn

    from engram_ray.local.prometheus import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(ingress_app(guarded_ingress_app(), Engine()),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_run_probes_over_http_and_the_probe_command(http_url, capsys):
    from engram_ray.cli import main
    from engram_ray.local.probes import run_probes

    results = run_probes(http_url, MODEL)
    assert all(r.ok for r in results), [r for r in results if not r.ok]
    summary = probe_summary(results)
    assert summary["malformed_4xx"] == summary["malformed_probes"] == len(probe_table(MODEL))
    assert summary["tracebacks_in_bodies"] == 0
    assert main(["probe", "--url", http_url, "--model", MODEL]) == 0
    assert f"{len(results)} of {len(results)} probes got a clean 4xx" in capsys.readouterr().out
    with pytest.raises(ValueError, match="loopback only"):
        run_probes("http://10.0.0.1:8000", MODEL)

"""The API guard inside a real Serve application (slow: starts Ray; no vLLM engine): the app
frozen and shipped to the ingress replica by Serve, requests through Serve's HTTP proxy on
127.0.0.1. Every probe gets its clean 4xx; a good completion and a stream pass."""

from __future__ import annotations

import json
import urllib.request

import pytest

from engram_ray.local.probes import probe_summary, run_probes
from engram_ray.local.prometheus import free_port

pytestmark = pytest.mark.slow
MODEL = "engram-tiny"


@pytest.fixture(scope="module")
def serve_url():
    import ray
    from ray import serve

    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             num_cpus=2, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(_app(), name="guard", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _app():
    from ray import serve
    from ray.llm._internal.serve.core.configs.openai_api_models import ModelCard
    from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress, make_fastapi_ingress

    from engram_ray.serve.edge.api_guard import guarded_ingress_app

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Engine:
        """Answers as Ray Serve LLM's LLMServer does: one response, or SSE chunk lists."""

        async def completions(self, body, raw_request_info):
            from ray.llm._internal.serve.core.configs.openai_api_models import CompletionResponse

            if body.stream:
                chunk = {"id": "c", "object": "text_completion", "created": 1, "model": MODEL,
                         "choices": [{"index": 0, "text": " flows", "finish_reason": "length"}]}
                yield [f"data: {json.dumps(chunk)}\n\n"]
                return
            yield CompletionResponse.model_validate({
                "id": "c", "object": "text_completion", "created": 1, "model": MODEL,
                "choices": [{"index": 0, "text": " flows", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}})

    card = ModelCard(id=MODEL, object="model", owned_by="test", permission=[], metadata={})
    ingress = make_fastapi_ingress(OpenAiIngress, app=guarded_ingress_app())
    return serve.deployment(ingress, ray_actor_options={"num_cpus": 0}).bind(
        llm_deployments={MODEL: Engine.bind()}, model_cards={MODEL: card})


def test_probes_through_serve_get_clean_4xx(serve_url):
    results = run_probes(serve_url, MODEL)
    summary = probe_summary(results)
    assert summary["malformed_ok"] == summary["malformed_probes"], (
        summary, [r for r in results if not r.ok])


def test_good_requests_pass_through_serve(serve_url):
    for stream in (False, True):
        body = json.dumps({"model": MODEL, "prompt": "The river", "max_tokens": 1,
                           "stream": stream}).encode()
        request = urllib.request.Request(f"{serve_url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            text = resp.read().decode()
        assert resp.status == 200 and " flows" in text
        assert text.endswith("data: [DONE]\n\n") if stream else json.loads(text)["choices"]

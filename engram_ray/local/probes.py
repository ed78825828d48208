"""Malformed requests a server must refuse with a short, clean 4xx; and a runner for them.

    probe_table(model_id, limits) -> [Probe]      name, method, path, headers, raw body,
                                                   expected status
    run_probes(base_url, model_id) -> [ProbeResult]    127.0.0.1 only; `result.ok`
    leaks(text) -> ["traceback" | "file path" | "internal name"]   (api_errors.leaks)
    probe_summary(results) -> {malformed_probes, malformed_4xx, tracebacks_in_bodies, ...}

A result is `ok` when its status is the expected one (a 4xx), its body is the OpenAI error
shape, at most MAX_CLEAN_BODY_BYTES long, and leaks nothing. Pass the deployment's
`serving.request_limits` when it sets its own (the cap probes go just past each limit).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from engram_ray.serve.edge.api_errors import leaks
from engram_ray.serve.settings.config import RequestLimits

__all__ = ["Probe", "ProbeResult", "leaks", "probe_summary", "probe_table", "run_probes"]

MAX_CLEAN_BODY_BYTES = 1024
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
JSON = {"content-type": "application/json"}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass(frozen=True)
class Probe:
    name: str
    method: str
    path: str
    headers: dict
    body: bytes
    expected_status: int


@dataclass(frozen=True)
class ProbeResult:
    name: str
    expected_status: int
    status: int | None            # None: no HTTP answer (transport_error says why)
    body_size: int
    leaks: list = field(default_factory=list)
    is_error_shape: bool = False  # {"error": {"message": str, ...}}
    message: str = ""
    transport_error: str | None = None

    @property
    def ok(self) -> bool:
        return (self.status == self.expected_status and 400 <= self.status < 500
                and self.is_error_shape and not self.leaks
                and self.body_size <= MAX_CLEAN_BODY_BYTES)


def _json(doc) -> bytes:
    return json.dumps(doc).encode()


def probe_table(model_id: str, limits: RequestLimits | None = None) -> list[Probe]:
    # Long by design: one line per probe, the whole table readable in one place.
    lim = limits or RequestLimits()
    good = {"model": model_id, "prompt": "The river", "max_tokens": 4}
    chat = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    over_tokens = lim.max_generated_tokens // lim.max_n + 1

    def completion(name, status=400, **fields):
        return Probe(name, "POST", COMPLETIONS, JSON, _json({**good, **fields}), status)

    def raw(name, body: bytes, status=400, headers=JSON, path=COMPLETIONS):
        return Probe(name, "POST", path, headers, body, status)

    no_model = {k: v for k, v in good.items() if k != "model"}
    return [
        raw("invalid_json", b'{"model": "x", "prompt": '),
        raw("empty_body", b""),
        raw("json_array", b"[1, 2, 3]"),
        raw("json_string", b'"The river"'),
        raw("invalid_utf8", b'{"model": "\xff\xfe", "prompt": "x"}'),
        raw("deeply_nested", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        raw("integer_of_5000_digits", b'{"model": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
        raw("number_1e999", _json(good)[:-1] + b', "temperature": 1e999}'),
        raw("nan_literal", _json(good)[:-1] + b', "temperature": NaN}'),
        raw("infinity_literal", _json(good)[:-1] + b', "top_p": -Infinity}'),
        raw("lone_surrogate_prompt", b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 4}'
            % model_id.encode()),
        raw("lone_surrogate_chat", _json(chat).replace(b'"hi"', b'"\\udfff"'), path=CHAT),
        raw("wrong_content_type", _json(good), 415, {"content-type": "text/plain"}),
        raw("form_content_type", _json(good), 415,
            {"content-type": "application/x-www-form-urlencoded"}),
        raw("no_content_type", _json(good), 415, {}),
        raw("oversized_body", _json({**good, "prompt": "x" * lim.max_body_bytes}), 413),
        raw("missing_model", _json(no_model)),
        completion("unknown_model", 404, model="no-such-model"),
        completion("model_not_a_string", model=["a"]),
        completion("wrong_type_max_tokens", max_tokens="many"),
        completion("wrong_type_prompt", prompt={"text": "x"}),
        completion("wrong_type_temperature", temperature="hot"),
        completion("negative_max_tokens", max_tokens=-5),
        completion("huge_max_tokens", max_tokens=10**9),
        completion("n_over_cap", n=lim.max_n + 1),
        completion("n_1000", n=1000),
        completion("n_times_max_tokens_over_cap", n=lim.max_n, max_tokens=over_tokens),
        completion("too_many_prompts", prompt=["x"] * (lim.max_prompts + 1)),
        completion("stop_entries_over_cap", stop=["s"] * (lim.max_stop_sequences + 1)),
        completion("stop_list_39kb", stop=["stop-sequence-%d" % i * 2 for i in range(1000)]),
        completion("stop_entry_too_long", stop=["s" * (lim.max_stop_chars + 1)]),
        completion("logprobs_over_cap", logprobs=lim.max_logprobs + 1),
        completion("prompt_logprobs_over_cap", prompt_logprobs=lim.max_logprobs + 1),
        raw("chat_messages_missing", _json({"model": model_id}), path=CHAT),
        raw("chat_messages_wrong_type", _json({**chat, "messages": "hi"}), path=CHAT),
        raw("chat_top_logprobs_over_cap",
            _json({**chat, "logprobs": True, "top_logprobs": lim.max_logprobs + 1}), path=CHAT),
        raw("chat_max_completion_tokens_huge",
            _json({**chat, "max_completion_tokens": 10**9}), path=CHAT),
        raw("chat_n_over_cap", _json({**chat, "n": lim.max_n + 1}), path=CHAT),
        Probe("unknown_path", "POST", "/v1/no-such-endpoint", JSON, _json(good), 404),
        Probe("get_on_post_endpoint", "GET", COMPLETIONS, {}, b"", 405),
    ]


def check_response(probe: Probe, status: int, body: bytes) -> ProbeResult:
    text = body.decode("utf-8", "replace")
    try:
        doc = json.loads(body)
        is_shape = isinstance(doc["error"]["message"], str)
        message = doc["error"]["message"]
    except (ValueError, KeyError, TypeError):
        is_shape, message = False, text[:200]
    return ProbeResult(probe.name, probe.expected_status, status, len(body), leaks(text),
                       is_shape, message)


def run_probes(base_url: str, model_id: str, limits: RequestLimits | None = None,
               timeout_s: float = 60.0) -> list[ProbeResult]:
    """Sends every probe of `probe_table` to `base_url` (http://127.0.0.1:PORT, no /v1)."""
    import httpx

    host = urlsplit(base_url).hostname
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"run_probes sends malformed requests to loopback only, not {host!r}")
    results = []
    with httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s, trust_env=False) as c:
        for probe in probe_table(model_id, limits):
            try:
                response = c.request(probe.method, probe.path, headers=probe.headers,
                                     content=probe.body)
            except httpx.HTTPError as exc:
                results.append(ProbeResult(probe.name, probe.expected_status, None, 0,
                                           transport_error=f"{type(exc).__name__}: {exc}"))
                continue
            results.append(check_response(probe, response.status_code, response.content))
    return results


def probe_summary(results: list[ProbeResult]) -> dict:
    """Figures for a results file: every probe should be a clean 4xx."""
    return {"malformed_probes": len(results),
            "malformed_4xx": sum(r.status is not None and 400 <= r.status < 500
                                 for r in results),
            "malformed_ok": sum(r.ok for r in results),
            "tracebacks_in_bodies": sum("traceback" in r.leaks for r in results),
            "bodies_leaking": sum(bool(r.leaks) for r in results),
            "failed": [r.name for r in results if not r.ok]}

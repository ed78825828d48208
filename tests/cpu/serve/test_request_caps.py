"""The caps of `serving.request_limits` (`engram_ray.serve.edge.request_caps`): each refusal is
a 400 naming the field, the cap and its setting; a request just under each cap passes."""

import pytest

from engram_ray.serve.settings.config import RequestLimits
from engram_ray.serve.edge.request_caps import check_request
from engram_ray.serve.edge.request_checks import CHAT, COMPLETIONS, RequestRefused

LIMITS = RequestLimits()
COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 4}
CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refusal(endpoint, body, limits=LIMITS, max_model_len=None) -> RequestRefused:
    with pytest.raises(RequestRefused) as info:
        check_request(endpoint, body, limits, max_model_len)
    assert info.value.status == 400
    return info.value


def test_chat_without_max_tokens_counts_the_context_per_choice():
    """Issue 29: n 8 with no max_tokens was counted as 0 generated tokens; vLLM then generates
    up to max_model_len per choice."""
    check_request(CHAT, {**CHAT_BODY, "n": 1}, LIMITS, 65536)  # 65,536: at the cap
    error = refusal(CHAT, {**CHAT_BODY, "n": 8}, LIMITS, 65536)
    assert "up to 524288 generated tokens" in error.message, error.message
    assert "serving.request_limits.max_generated_tokens = 65536" in error.message
    assert "no max_tokens: up to max_model_len 65536" in error.message
    assert error.param == "max_tokens"
    check_request(CHAT, {**CHAT_BODY, "n": 8, "max_completion_tokens": 8192}, LIMITS, 65536)
    # Context length unknown: one choice may take the whole cap, two are over it.
    check_request(CHAT, CHAT_BODY, LIMITS)
    assert "context length unknown" in refusal(CHAT, {**CHAT_BODY, "n": 2}).message


def test_completion_without_max_tokens_counts_vllms_default_and_token_prompts_their_rest():
    no_max = {"model": "m", "prompt": "hi", "n": 8}
    check_request(COMPLETIONS, no_max, LIMITS, 65536)  # vLLM's default 16 per choice
    limits = RequestLimits(max_generated_tokens=100)
    body = {"model": "m", "prompt": [[1] * 90, [2] * 95], "n": 1, "max_tokens": None}
    check_request(COMPLETIONS, body, limits, 100)  # 16 + 16
    chat_limits = RequestLimits(max_generated_tokens=10)
    error = refusal(CHAT, {**CHAT_BODY, "n": 2}, chat_limits, 8)
    assert "up to 16 generated tokens" in error.message  # 2 x (8 - unknown prompt)


@pytest.mark.parametrize("field, value, cap, setting", [
    ("guided_json", {"type": "object", "properties": {"a": {"enum": ["x" * 40_000]}}},
     "max_guided_chars", 32768),
    ("guided_regex", "a" * 32769, "max_guided_chars", 32768),
    ("guided_grammar", "root ::= " + "x" * 32768, "max_guided_chars", 32768),
    ("guided_choice", ["x" * 20_000, "y" * 20_000], "max_guided_chars", 32768),
    ("structured_outputs", {"json": {"description": "x" * 40_000}}, "max_guided_chars", 32768),
    ("response_format", {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"description": "x" * 40_000}}}, "max_guided_chars", 32768),
    ("logit_bias", {str(i): 1 for i in range(301)}, "max_logit_bias", 300),
    ("tools", [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)],
     "max_tools", 128),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "description": "x" * 40_000}}}], "max_guided_chars", 32768),
    ("min_tokens", 8193, "max_min_tokens", 8192),
])
def test_each_new_cap_is_refused_naming_it_and_its_setting(field, value, cap, setting):
    for endpoint, body in ((COMPLETIONS, COMPLETION), (CHAT, {**CHAT_BODY, "max_tokens": 4})):
        error = refusal(endpoint, {**body, field: value})
        assert f"over the server's limit serving.request_limits.{cap} = {setting}." \
            in error.message, error.message
        assert error.param == field


def test_just_under_each_new_cap_passes_and_caps_are_settings():
    body = {**CHAT_BODY, "max_tokens": 4, "guided_regex": "a" * 32768,
            "logit_bias": {str(i): 1 for i in range(300)}, "min_tokens": 4,
            "tools": [{"type": "function", "function": {"name": "f"}}] * 128,
            "response_format": {"type": "json_object"}}
    check_request(CHAT, body, LIMITS)
    error = refusal(CHAT, body, RequestLimits(max_logit_bias=10))
    assert "logit_bias holds 300 entries" in error.message
    assert "serving.request_limits.max_logit_bias = 10" in error.message


def test_existing_caps_name_their_setting_too():
    error = refusal(COMPLETIONS, {**COMPLETION, "n": 9})
    assert error.message == "n is 9, over the server's limit serving.request_limits.max_n = 8."
    assert refusal(COMPLETIONS, {**COMPLETION, "stop": ["a"] * 5}).param == "stop"
    assert refusal(COMPLETIONS, {**COMPLETION, "min_tokens": -1}).message == \
        "min_tokens must be at least 0, got -1."

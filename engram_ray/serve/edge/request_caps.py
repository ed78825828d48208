"""The caps of one completion or chat request (`serving.request_limits`): pure functions.

    check_request(endpoint, body, limits, max_model_len)   400: no model; over a cap

A refusal names the field (`param`), the cap and its setting: "n is 9, over the server's
limit serving.request_limits.max_n = 8.". Fields of a wrong type are left to vLLM's request
model, which refuses them with their path.

Generated tokens = sum over prompts of n x (max_tokens, or what vLLM allows without it):
chat without max_completion_tokens / max_tokens may generate up to max_model_len less the
prompt, per choice; the prompt's length is known here only for token-id prompts, so a text
prompt counts max_model_len (the most it can be). A completion without max_tokens gets vLLM's
default (16). With no known max_model_len a choice counts the whole max_generated_tokens.
"""

from __future__ import annotations

import json

from engram_ray.serve.settings.config import RequestLimits
from engram_ray.serve.edge.request_checks import COMPLETIONS, CHAT, RequestRefused, json_kind

VLLM_DEFAULT_COMPLETION_TOKENS = 16  # CompletionRequest.max_tokens when the client sends none
# Guided decoding: vLLM compiles each into a grammar before the first token (CPU time and
# memory grow with its size). `structured_outputs` / `response_format` hold their schema inside.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice",
                 "structural_tag", "structured_outputs", "response_format")


def check_request(endpoint: str, body: dict, limits: RequestLimits,
                  max_model_len: int | None = None) -> None:
    """/v1/completions and /v1/chat/completions: `model` given (OpenAI requires it; Ray's
    ingress would pick the only model for a client that forgot it) and the caps of `limits`."""
    if endpoint not in (COMPLETIONS, CHAT):
        return
    if body.get("model") is None:
        raise RequestRefused(400, "model is required (the model id, as /v1/models lists it).",
                             "model")
    n = _integer(body, "n", 1, limits, "max_n") or 1
    if endpoint == COMPLETIONS:
        _integer(body, "logprobs", 0, limits, "max_logprobs")
    else:
        _integer(body, "top_logprobs", 0, limits, "max_logprobs")
    _integer(body, "prompt_logprobs", 0, limits, "max_logprobs")
    _check_generated(endpoint, body, n, limits, max_model_len)
    _integer(body, "min_tokens", 0, limits, "max_min_tokens")
    _check_stop(body.get("stop"), limits)
    _check_guided(body, limits)
    _check_count(body, "logit_bias", dict, "entries", limits, "max_logit_bias")
    _check_count(body, "tools", list, "tools", limits, "max_tools")


def _over(what: str, cap: str, limits: RequestLimits, param: str, fix: str = "") -> None:
    raise RequestRefused(400, f"{what}, over the server's limit serving.request_limits.{cap} = "
                              f"{getattr(limits, cap)}{fix}.", param)


def _integer(body: dict, name: str, minimum: int, limits: RequestLimits | None = None,
             cap: str | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestRefused(400, f"{name} must be an integer, not {json_kind(value)}.", name)
    if value < minimum:
        raise RequestRefused(400, f"{name} must be at least {minimum}, got {value}.", name)
    if cap is not None and value > getattr(limits, cap):
        _over(f"{name} is {value}", cap, limits, name)
    return value


def _check_generated(endpoint: str, body: dict, n: int, limits: RequestLimits,
                     max_model_len: int | None) -> None:
    if endpoint == COMPLETIONS:
        field = "max_tokens"
        prompt_lengths = _prompt_lengths(body.get("prompt"), limits)
    else:
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        prompt_lengths = [None]  # messages: their length is known only after the template
    max_tokens = _integer(body, field, 1)
    if max_tokens is None and endpoint == COMPLETIONS:
        max_tokens = VLLM_DEFAULT_COMPLETION_TOKENS
    if max_tokens is not None:
        per_choice, shown = [max_tokens] * len(prompt_lengths), f"{field} {max_tokens}"
    else:
        per_choice = [_allowed(length, limits, max_model_len) for length in prompt_lengths]
        shown = (f"no {field}: up to max_model_len {max_model_len}" if max_model_len
                 else f"no {field}: context length unknown, up to the cap")
    generated = n * sum(per_choice)
    if generated > limits.max_generated_tokens:
        _over(f"The request asks for up to {generated} generated tokens (prompts "
              f"{len(prompt_lengths)} x n {n} x {shown})", "max_generated_tokens", limits,
              field, f"; set or lower {field}, or lower n")


def _allowed(prompt_length: int | None, limits: RequestLimits,
             max_model_len: int | None) -> int:
    """Tokens vLLM may generate for one choice with no max_tokens."""
    if not max_model_len:
        return limits.max_generated_tokens
    return max(1, max_model_len - (prompt_length or 0))


def _prompt_lengths(prompt, limits: RequestLimits) -> list[int | None]:
    """Token count of each prompt where it is token ids, else None (text)."""
    # A list of strings or of token-id lists is a batch; a list of ints is one tokenized prompt.
    is_batch = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    prompts = prompt if is_batch else [prompt]
    if len(prompts) > limits.max_prompts:
        _over(f"prompt holds {len(prompts)} prompts", "max_prompts", limits, "prompt")
    return [len(p) if isinstance(p, list) else None for p in prompts]


def _check_stop(stop, limits: RequestLimits) -> None:
    entries = [stop] if isinstance(stop, str) else stop
    if not isinstance(entries, list):
        return  # null or a wrong type: the request model refuses the latter
    if len(entries) > limits.max_stop_sequences:
        _over(f"stop holds {len(entries)} entries", "max_stop_sequences", limits, "stop")
    for i, entry in enumerate(entries):
        if isinstance(entry, str) and len(entry) > limits.max_stop_chars:
            _over(f"stop[{i}] is {len(entry)} characters long", "max_stop_chars", limits,
                  "stop")


def _check_guided(body: dict, limits: RequestLimits) -> None:
    for name in GUIDED_FIELDS:
        value = body.get(name)
        if value is None or (name == "response_format" and not _has_schema(value)):
            continue
        size = len(value) if isinstance(value, str) else len(json.dumps(value))
        if size > limits.max_guided_chars:
            _over(f"{name} is {size} characters long (as JSON)", "max_guided_chars", limits,
                  name)
    # A tool's parameters are a JSON schema too: vLLM compiles it when a call is required.
    tools = body.get("tools")
    for idx, tool in enumerate(tools if isinstance(tools, list) else ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        schema = function.get("parameters") if isinstance(function, dict) else None
        size = len(json.dumps(schema)) if schema is not None else 0
        if size > limits.max_guided_chars:
            _over(f"tools[{idx}].function.parameters is {size} characters long (as JSON)",
                  "max_guided_chars", limits, "tools")


def _has_schema(response_format) -> bool:
    """json_object / text carry no schema; json_schema and structural_tag do."""
    return not (isinstance(response_format, dict)
                and response_format.get("type") in ("text", "json_object"))


def _check_count(body: dict, name: str, kind: type, what: str, limits: RequestLimits,
                 cap: str) -> None:
    value = body.get(name)
    if isinstance(value, kind) and len(value) > getattr(limits, cap):
        _over(f"{name} holds {len(value)} {what}", cap, limits, name)

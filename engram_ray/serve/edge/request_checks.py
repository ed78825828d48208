"""Checks of one OpenAI request body before it reaches an engine: pure functions.

    check_content_type(value)                  415 unless application/json (UTF-8)
    parse_body(raw) -> dict                    400: not UTF-8, not JSON, not an object,
                                               a number outside float range, NaN/Infinity,
                                               a string UTF-8 cannot encode (lone surrogate)

The caps of a completion or chat request (`check_request`) are in `request_caps`.

Each failure raises `RequestRefused(status, message, param)`; `param` is the field path
("messages[0].content", "stop[2]").
"""

from __future__ import annotations

import json
import math
import re

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# Every POST route of Ray Serve LLM's OpenAI ingress that takes a JSON body
# (ray.llm._internal.serve.core.ingress.ingress.DEFAULT_ENDPOINTS; transcriptions is a form).
JSON_ENDPOINTS = (COMPLETIONS, CHAT, "/v1/embeddings", "/v1/score", "/tokenize", "/detokenize")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class RequestRefused(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def check_content_type(value: str | None) -> None:
    if not value:
        raise RequestRefused(415, "The request has no Content-Type; send the JSON body with "
                                  "Content-Type: application/json.")
    media_type, _, params = value.partition(";")
    charset = re.search(r"charset\s*=\s*\"?([\w-]+)", params, re.IGNORECASE)
    if media_type.strip().lower() != "application/json" or (
            charset and charset.group(1).lower() not in ("utf-8", "utf8")):
        shown = value if len(value) <= 80 else value[:77] + "..."
        raise RequestRefused(415, f"Content-Type {shown!r} is not supported; send the JSON "
                                  "body with Content-Type: application/json.")


def parse_body(raw: bytes) -> dict:
    """The request's JSON object; numbers outside float range and strings that cannot be
    encoded are refused with their field path."""
    is_odd_number = []

    def parse_float(text):
        value = float(text)
        if not math.isfinite(value):
            is_odd_number.append(text)
        return value

    def parse_constant(text):  # NaN, Infinity, -Infinity: not JSON, Python accepts them
        is_odd_number.append(text)
        return math.nan

    try:
        body = json.loads(raw.decode("utf-8"), parse_float=parse_float,
                          parse_constant=parse_constant)
    except UnicodeDecodeError as exc:
        raise RequestRefused(400, f"The body is not valid UTF-8 (byte {exc.start}).") from None
    except RecursionError:
        raise RequestRefused(400, "The JSON body is nested too deeply.") from None
    except ValueError as exc:  # json.JSONDecodeError, or an integer of more than 4300 digits
        where = f" (line {exc.lineno}, column {exc.colno})" if hasattr(exc, "lineno") else ""
        raise RequestRefused(400, f"The body is not valid JSON{where}: "
                                  f"{str(getattr(exc, 'msg', 'integer too long'))[:80]}.") \
            from None
    if not isinstance(body, dict):
        raise RequestRefused(400, f"The body must be a JSON object, not {json_kind(body)}.")
    if is_odd_number or _SURROGATE_ESCAPE.search(raw):
        _check_values(body)
    return body


def _check_values(body: dict) -> None:
    stack = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise RequestRefused(400, f"{path} is not a finite number (JSON numbers must be "
                                      "within the float range; NaN and Infinity are not JSON).",
                                 path)
        if isinstance(value, str) and not _encodes(value):
            raise RequestRefused(400, f"{path} holds a lone UTF-16 surrogate (\\ud800-\\udfff "
                                      "without its pair), which no text can contain.", path)
        if isinstance(value, dict):
            for key, item in value.items():
                if not _encodes(key):
                    raise RequestRefused(400, f"A key in {path or 'the body'} holds a lone "
                                              "UTF-16 surrogate.", path or None)
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_kind(value) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")

"""The one error shape of the OpenAI endpoint, and the check that a body leaks nothing.

    {"error": {"message": str (<= MAX_MESSAGE_CHARS), "type": str, "param": str | null,
               "code": int (the HTTP status)}}

Messages never carry a traceback, a file path or an internal module/class name
(`leaks(text)` finds them); 5xx messages are generic and name the request id, whose full text
is in the server log. Pure functions: `engram_ray.serve.edge.api_guard` applies them to every
response, `engram_ray.local.probes` checks bodies with `leaks`.
"""

from __future__ import annotations

import json
import re

MAX_MESSAGE_CHARS = 300
MAX_PARAM_CHARS = 64
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 408: "timeout_error",
               409: "conflict_error", 413: "invalid_request_error",
               415: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable_error"}

# What a client must never see. Internal names: dotted paths into the server's packages
# (`ray.llm._internal...`), and CamelCase exception class names (`OpenAIHTTPException`).
LEAK_PATTERNS = {
    "traceback": re.compile(r"Traceback \(most recent call last\)|^\s+File \"|\bline \d+, in\b",
                            re.MULTILINE),
    "file path": re.compile(r"[\w.-]+\.py\b|site-packages|dist-packages|"
                            r"(?<![\w/])/(?:home|root|tmp|usr|opt|var|proc|dev|srv|mnt|lib|etc"
                            r"|workspace|work)/"),
    "internal name": re.compile(r"\b(?:ray|vllm|engram_ray|starlette|fastapi|pydantic|"
                                r"pydantic_core|torch|uvicorn|asyncio|builtins)\.\w|"
                                r"\b[A-Z][A-Za-z0-9]*(?:Exception|Error)\b|"
                                r"<class '|object at 0x"),
}
_RAY_WRAPPED = re.compile(r"^Message: (.*?)(?:, Internal exception: .*)?$", re.DOTALL)
_REQUEST_ID = re.compile(r"\s*\(Request ID: [^)]*\)")
# An error body inside a message (vLLM's own, forwarded as text), whole or cut off.
_INNER_MESSAGE = re.compile(r'"message"\s*:\s*"((?:[^"\\]|\\.)*)')
_INNER_PARAM = re.compile(r'"param"\s*:\s*"([^"\\]{1,64})"')
# pydantic's text of a validator's ValueError: keep the reason, drop the echoed input and link.
_PYDANTIC = re.compile(r"^\d+ validation errors? for \w+\s+(?:(?!Value error)[\w.\[\]]+\s+)?"
                       r"(?:Value error, )?(.*?)\s*(?:\[type=.*)?$", re.DOTALL)
_CLASS_PREFIX = re.compile(r"^[A-Z]\w*(?:Error|Exception): ")
_LONG_LIST = re.compile(r"\[([^\[\]]*)(\]|$)")
MAX_LIST_ITEMS = 3  # items of a long list kept in a message ("[512, 513, 514, ... 61 more]")


def leaks(text: str) -> list[str]:
    """Kinds of internal detail in `text`: any of "traceback", "file path", "internal name"."""
    return [kind for kind, pattern in LEAK_PATTERNS.items() if pattern.search(text)]


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def shorten(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def generic_message(status: int, request_id: str, retry_after: str | None = None) -> str:
    """The whole message of every 5xx: what happened in general and the id to look up."""
    if status == 503:
        retry = f" in {retry_after} s" if retry_after and retry_after.isdigit() else " later"
        return (f"The service is temporarily unavailable; retry{retry} "
                f"(request id {request_id}).")
    if status == 504 or status == 408:
        return f"The request timed out on the server (request id {request_id})."
    return (f"The server failed to handle the request (request id {request_id}); "
            "its log has the details.")


def client_message(reason: str) -> str | None:
    """An `unwrap`ped `reason` fit for a client (long lists counted, at most
    MAX_MESSAGE_CHARS), or None when it still leaks internals."""
    text = shorten_lists(reason)
    if not text.strip() or leaks(text):
        return None
    return shorten(text)


def unwrap(text: str) -> tuple[str, str | None]:
    """(the reason, the param it names) of an upstream message: Ray's "Message: X, Internal
    exception: Y" cut to X, an error body inside it (vLLM's, as JSON text, maybe cut off)
    opened, pydantic's "1 validation error for ... Value error, X [type=...]" cut to X, a
    leading exception class name and request-id suffixes dropped."""
    param = None
    for _ in range(4):  # each wrapper once: Ray around vLLM's body around Ray's "Message:"
        text = text.strip()
        match = _RAY_WRAPPED.match(text)
        text = match.group(1).strip() if match else text
        inner = _INNER_MESSAGE.search(text) if text.startswith("{") else None
        if inner is None:
            break
        named = _INNER_PARAM.search(text)
        param = param or (named.group(1) if named else None)
        text = _json_unescape(inner.group(1))
    match = _PYDANTIC.match(text)
    text = match.group(1) if match else text
    return _REQUEST_ID.sub("", _CLASS_PREFIX.sub("", text)).strip(), param


def _json_unescape(text: str) -> str:
    try:
        return json.loads(f'"{text}"')
    except ValueError:  # cut inside an escape
        return text.replace('\\"', '"')


def shorten_lists(text: str) -> str:
    """Each bracketed list of more than MAX_LIST_ITEMS + 1 items as its first MAX_LIST_ITEMS
    and a count: "[512, 513, 514, ... 61 more]" (a list cut off at the end counts what is
    left of it)."""
    def count(match):
        items = [item.strip() for item in match.group(1).split(",") if item.strip()]
        if len(items) <= MAX_LIST_ITEMS + 1:
            return match.group(0)
        cut = "" if match.group(2) else " (cut)"
        return (f"[{', '.join(items[:MAX_LIST_ITEMS])}, ... "
                f"{len(items) - MAX_LIST_ITEMS} more{cut}]")

    return _LONG_LIST.sub(count, text)


def client_param(param) -> str | None:
    """The offending field's name, when `param` is one (never an echoed input value)."""
    if not isinstance(param, str) or len(param) > MAX_PARAM_CHARS or leaks(param):
        return None
    return param if re.fullmatch(r"[\w.\[\]-]+", param) else None


def error_payload(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": status}}


def error_bytes(status: int, message: str, param: str | None = None) -> bytes:
    return json.dumps(error_payload(status, message, param)).encode()


def message_and_param(body: bytes) -> tuple[str, object]:
    """Message and param of an error body in any shape the app's parts write: OpenAI/vLLM
    `{"error": {"message", "param"}}`, FastAPI `{"detail": str | [{"msg", "loc"}]}`, or text."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace"), None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        return str(doc["error"].get("message", "")), doc["error"].get("param")
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return doc["error"], None
    if isinstance(doc, dict) and isinstance(doc.get("detail"), str):
        return doc["detail"], None
    if isinstance(doc, dict) and isinstance(doc.get("detail"), list) and doc["detail"]:
        first = doc["detail"][0] if isinstance(doc["detail"][0], dict) else {}
        loc = ".".join(str(p) for p in first.get("loc", ())[1:])
        return f"{first.get('msg', 'invalid request')}" + (f" at {loc}" if loc else ""), loc
    return "", None


def clean_error(status: int, body: bytes, request_id: str,
                retry_after: str | None = None) -> tuple[bytes, str]:
    """(clean body, full upstream text for the log) of an error response with `status`."""
    text, param = message_and_param(body)
    if status >= 500:
        return error_bytes(status, generic_message(status, request_id, retry_after)), text
    # Generic only where the reason itself would leak internals (it then goes to the log).
    reason, inner_param = unwrap(text)
    message = client_message(reason) or f"The request was refused (HTTP {status})."
    return error_bytes(status, message, client_param(param) or client_param(inner_param)), text

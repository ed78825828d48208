"""OpenAI completion and chat requests for property-based tests (hypothesis): valid ones drawn
from a JSON schema of each endpoint's request (the fields clients send, with OpenAI's ranges;
hypothesis-jsonschema), and broken ones made from a valid one by one mutation (a field of the
wrong type or out of range, a required field dropped, an unknown field, a body that is not an
object, or not JSON at all).

    requests = openai_requests("engram-tiny")   # strategy of (path, raw body bytes)
"""

from __future__ import annotations

import json

from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_TEXT = {"type": "string", "maxLength": 40}
_STOP = {"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "maxItems": 4}]}
# Small generations keep a run of many requests short on a CPU engine.
_COMMON = {
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 2},
    "stream": {"type": "boolean"},
    "stop": _STOP,
    "seed": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "logit_bias": {"type": "object", "maxProperties": 3,
                   "propertyNames": {"pattern": "^[1-9][0-9]{0,2}$"},
                   "additionalProperties": {"type": "integer", "minimum": -100,
                                            "maximum": 100}},
    "user": _TEXT,
}


def _schema(model: str, chat: bool) -> dict:
    if chat:
        message = {"type": "object", "required": ["role", "content"],
                   "additionalProperties": False,
                   "properties": {"role": {"enum": ["system", "user", "assistant"]},
                                  "content": _TEXT}}
        own = {"messages": {"type": "array", "items": message, "minItems": 1, "maxItems": 3},
               "logprobs": {"type": "boolean"},
               "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
               "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 8}}
        required = ["model", "messages"]
    else:
        own = {"prompt": {"anyOf": [_TEXT, {"type": "array", "items": _TEXT,
                                            "minItems": 1, "maxItems": 2}]},
               "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
               "echo": {"type": "boolean"}}
        required = ["model", "prompt"]
    return {"type": "object", "required": required, "additionalProperties": False,
            "properties": {"model": {"const": model}, **_COMMON, **own}}


# A value of any JSON type, for fields given the wrong one.
_ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=6)


@st.composite
def _broken(draw, valid: dict, schema: dict) -> bytes:
    """One mutation of `valid` (module doc), as raw bytes."""
    how = draw(st.sampled_from(["wrong value", "dropped", "unknown field", "not an object",
                                "not JSON"]))
    body = dict(valid)
    if how == "wrong value":
        body[draw(st.sampled_from(sorted(schema["properties"])))] = draw(_ANY_JSON)
    elif how == "dropped":
        body.pop(draw(st.sampled_from(schema["required"])))
    elif how == "unknown field":
        body[draw(st.text(min_size=1, max_size=12))] = draw(_ANY_JSON)
    elif how == "not an object":
        return json.dumps(draw(_ANY_JSON.filter(lambda v: not isinstance(v, dict)))).encode()
    else:
        return json.dumps(body).encode()[:draw(st.integers(0, 40))]
    return json.dumps(body).encode()


@st.composite
def openai_requests(draw, model: str) -> tuple[str, bytes]:
    """(path, body): a valid completion or chat request, or a broken one (module doc)."""
    chat = draw(st.booleans())
    schema = _schema(model, chat)
    valid = draw(from_schema(schema))
    body = draw(_broken(valid, schema)) if draw(st.booleans()) else json.dumps(valid).encode()
    return (CHAT if chat else COMPLETIONS), body

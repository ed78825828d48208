"""Which generation and which engine settings produced an answer: OpenAI's
`system_fingerprint` ("the backend configuration the model runs with") set to
`<generation>+<settings version>` by the member (`tag_generation`), read back by the ingress
for its `x-engram-config` header and by the load generator (`fingerprint_parts`). Light: the
ingress imports it on its request path.
"""

from __future__ import annotations

import json


async def tag_generation(stream, generation: str, config_version: str | None = None):
    """The engine's answers with `system_fingerprint` = `<generation>+<config version>`: the
    generation and the settings that produced them (`fingerprint_parts`). Whole responses are
    tagged; of a stream, its first SSE packet (the ingress reads it for its headers)."""
    fingerprint = f"{generation}+{config_version}" if config_version else generation
    is_first = True
    async for item in stream:
        if hasattr(item, "system_fingerprint"):
            item.system_fingerprint = fingerprint
        elif is_first and isinstance(item, str):
            item = _fingerprinted(item, fingerprint)
        elif is_first and isinstance(item, list) and item and isinstance(item[0], str):
            item = [_fingerprinted(item[0], fingerprint), *item[1:]]
        is_first = False
        yield item


def _fingerprinted(packet: str, fingerprint: str) -> str:
    """An SSE packet `data: {...}` with `system_fingerprint` set (others as they are)."""
    head, sep, rest = packet.partition("data: ")
    if not sep or not rest.lstrip().startswith("{"):
        return packet
    body, newlines = rest.rstrip("\n"), rest[len(rest.rstrip("\n")):]
    try:
        event = json.loads(body)
    except ValueError:
        return packet
    if not isinstance(event, dict) or "error" in event:
        return packet
    event["system_fingerprint"] = fingerprint
    return f"{head}data: {json.dumps(event)}{newlines}"


def fingerprint_parts(fingerprint: str | None) -> tuple[str | None, str | None]:
    """(generation, config version) of a `system_fingerprint` made by `tag_generation`."""
    if not fingerprint:
        return None, None
    generation, _, version = fingerprint.partition("+")
    return generation, version or None

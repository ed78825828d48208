"""What a request meets before an engine: the OpenAI ingress over the peer groups and its
routing table (`ingress`), the request router that sends a group's requests only to members
that serve (`member_router`), the request guard (`api_guard`: body size, JSON, caps from
`request_caps` and `request_checks`) and the one shape of every error (`api_errors`), and the
generation and settings an answer names (`fingerprint`, also used by the member).

Imports: of `engram_ray.serve`, this room and `settings` only (never the member or `app`).
"""

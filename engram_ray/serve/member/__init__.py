"""The member: one engine of a peer group inside its Serve replica, from its join to its leave.

`server.EngramServerMixin` is Ray Serve LLM's server class plus Serve's hooks (start, health
check, requests, stop); each hook hands the work to one of the member's parts, which hold
their own state and reach each other through the server:

    link.CoordinatorLink     join, rejoin after a coordinator restart, member_check answers
    requests.MemberRequests  requests counted while they stream, refused when retired, drained
    engine.MemberEngine      the engine's arguments, its start, its death watch, its restart
    restart.InPlaceRestart   an engine death: restart in place (with its DP gang) or lost
    roll.SettingsRoll        the engine's settings from the coordinator and their roll

Imports: the parts import nothing of `server`; the member imports from `engram_ray.serve` only
`config`, `config_change`, `engine_args` and `fingerprint` (never `app` or the ingress, which
import the member), and the coordinator only as `engram_ray.actors.coordinator_lookup` and
`lifetime` (tests/cpu/test_imports.py).
"""

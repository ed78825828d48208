"""The Ray Serve side, one room per idea:

    app.py      the `serve deploy` entry points (`engram_ray.serve.app:build_app`, `build_group`):
                the front door (ingress + coordinator) and one application per peer group
    settings/   the app's settings: parsed, compared, turned into engine arguments
    edge/       what a request meets before an engine: ingress, routing, request guard, errors
    member/     one engine of a peer group in its replica, from its join to its leave
    deploy/     the cluster files a deployment is checked against, a group placed again

Data flow: `serve deploy` -> app (settings -> coordinator, gangs) -> edge (a request) -> member
(its engine, vLLM with the Engram patch). Imports point the same way: `settings` imports no
other room, `edge` and `deploy` import only `settings`, the member `settings` and
`edge.fingerprint`, and `app` assembles them (tests/cpu/test_imports.py).
"""

"""The Ray Serve application: `app.build_app` (the `serve deploy` import path
`engram_ray.serve.app:build_app`), its config (`config`), the replicas (`replica`), the
ingress that routes to serving peer groups (`ingress`), the request guard (`api_guard`,
`api_errors`, `request_checks`), engine death and shared memory, KV-cache headroom.
"""

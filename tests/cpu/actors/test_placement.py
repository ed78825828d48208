"""Peer groups placed by Ray's scheduler inside NVLink domains, on a real multi-node Ray
(`ray.cluster_utils.Cluster`): two domains of two labelled nodes each (2 fake GPUs per node),
the real Serve application of `engram_ray.serve.app.build_app` with engines that only record where
they run (tests/support/recording_server.py). Checks every member's node labels, DEP gangs
nested in groups, an infeasible group reported in one line within placement_timeout_s (in the
Serve application's status too), a group restarted as one while the other keeps running, and
the same group placed again in the other domain once every node of its own is killed.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from support import recording_server  # noqa: E402
from support.recording_server import RecordingDPServer, RecordingServer, records_dir  # noqa: E402

KEY = "engram.io/nvlink-domain"
DOMAINS = {"dom-a": ("a1", "a2"), "dom-b": ("b1", "b2")}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    from ray import serve
    from ray.cluster_utils import Cluster

    # A node killed outright is taken for dead after 3 missed 1 s health checks (Ray: 5 x 3 s).
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "node_ip_address": "127.0.0.1", "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
    cluster.domain_nodes = {domain: [_add_node(cluster, domain, node) for node in nodes]
                            for domain, nodes in DOMAINS.items()}
    ray.init(address=cluster.address, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(recording_server)  # workers cannot import tests/
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    yield cluster
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def _add_node(cluster, domain: str, node: str):
    return cluster.add_node(num_cpus=2, num_gpus=2, node_ip_address="127.0.0.1",
                            labels={KEY: domain, "test/node": node})


def _args(tmp_path, name: str, peer_group_size: int, num_groups: int, dp: int = 1,
          placement_timeout_s: float = 20.0) -> dict:
    return {"deployment": {"name": name, "model": "deepseek-v4.1-flash",
                           "peer_group_size": peer_group_size, "table_backend": "cuda",
                           "fill": "synthetic", "domain_label_key": KEY,
                           "peer_group_store": str(tmp_path / "store"),
                           "num_gpus_per_engine": 1, "num_cpus_per_engine": 0.1,
                           "placement_timeout_s": placement_timeout_s,
                           "health_check_interval_s": 1, "max_missed_pings": 10},
            "serving": {"model_id": "rec", "model_source": str(tmp_path), "device": "cuda",
                        "num_peer_groups": num_groups, "data_parallel_size": dp,
                        "enable_expert_parallel": dp > 1, "num_cpus_per_replica": 0.1,
                        "engine_kwargs": {"load_format": "dummy"},
                        "prometheus_targets_file": str(tmp_path / "targets.json")}}


def _records(tmp_path) -> list[dict]:
    return [json.loads(Path(p).read_text())
            for p in glob.glob(os.path.join(records_dir(str(tmp_path / "store")), "*.json"))]


def _deploy(tmp_path, args, server_cls=RecordingServer, name="placement"):
    """`serve.run` of the front door and every group's application; their records once all
    run."""
    from ray.serve.api import _run

    from engram_ray.serve.app import engram_applications

    for app_name, route_prefix, app in engram_applications(args, name, f"/{name}", server_cls):
        _run(app, _blocking=False, name=app_name, route_prefix=route_prefix)
    _wait_running(name)
    return _records(tmp_path)


def _applications(name: str) -> dict:
    """Serve's status of the front door `name` and of its groups' applications."""
    from ray import serve

    return {app_name: app for app_name, app in serve.status().applications.items()
            if app_name == name or app_name.startswith(f"{name}-group-")}


def _wait_running(name: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        apps = _applications(name)
        assert not any(a.status == "DEPLOY_FAILED" for a in apps.values()), {
            n: a.message for n, a in apps.items()}
        if len(apps) > 1 and all(a.status == "RUNNING" for a in apps.values()):
            return
        time.sleep(1)
    raise AssertionError(f"{name} not running after {timeout_s:.0f} s: {_applications(name)}")


def _by_group(records: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(record["group_id"], []).append(record)
    return {gid: sorted(members, key=lambda r: r["rank"]) for gid, members in groups.items()}


def _check_inside_domains(records, peer_group_size: int, num_groups: int) -> dict:
    groups = _by_group(records)
    assert len(groups) == num_groups and len(records) == num_groups * peer_group_size
    for gid, members in groups.items():
        domains = {m["node_labels"][KEY] for m in members}
        assert domains == {members[0]["domain_id"]}, (gid, members)  # one domain, the planned
        assert [m["rank"] for m in members] == list(range(peer_group_size))
        assert {m["world_size"] for m in members} == {peer_group_size}
        assert len({m["gang_id"] for m in members}) == 1
        assert len({m["generation"] for m in members}) == 1
        assert [m["member_rank"] for m in members] == list(range(peer_group_size))
    return groups


def _shutdown_app(name="placement", store=None):
    """`serve delete` of the front door and the groups: the coordinator goes by itself with
    the applications (it looks every APP_CHECK_S), taking the store folders with it."""
    from ray import serve

    from engram_ray.actors.coordinator_lookup import find_coordinator
    from engram_ray.actors.lifetime import APP_CHECK_S

    for app_name in _applications(name):
        serve.delete(app_name)
    deadline = time.monotonic() + 3 * APP_CHECK_S + 10
    while time.monotonic() < deadline:
        try:
            find_coordinator(name)
        except ValueError:  # gone
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the coordinator of {name} outlived its application")
    if store is not None:
        assert not list(Path(store, name).glob("group-*/*")), list(Path(store).rglob("*"))


# Groups filling both domains (two of 4, four of 2): test_dep_gangs_nest_inside_one_group
# deploys them and makes the same checks (two deploys fewer: each takes a minute on 2 cores).
@pytest.mark.parametrize("peer_group_size,num_groups", [(2, 1), (4, 1)])
def test_every_member_of_a_group_runs_in_its_domain(cluster, tmp_path, peer_group_size,
                                                    num_groups):
    """P = 2 and 4; one group leaves a domain unused."""
    args = _args(tmp_path, "placement", peer_group_size, num_groups)
    try:
        groups = _check_inside_domains(_deploy(tmp_path, args), peer_group_size, num_groups)
        if num_groups == 1:
            (members,) = groups.values()
            assert peer_group_size == 2 or {m["node_labels"]["test/node"]
                                            for m in members} == set(DOMAINS[members[0]
                                                                             ["domain_id"]])
    finally:
        _shutdown_app(store=tmp_path / "store")


@pytest.mark.parametrize("peer_group_size,num_groups", [(4, 2), (2, 4)])
def test_dep_gangs_nest_inside_one_group(cluster, tmp_path, peer_group_size, num_groups):
    """DEP2: DP ranks r % 2 of DP gangs r // 2 of each group; a DP gang never spans groups.
    Both fill both domains: two groups of two DP gangs, four groups of one (two a domain)."""
    args = _args(tmp_path, "placement", peer_group_size, num_groups, dp=2)
    try:
        groups = _check_inside_domains(_deploy(tmp_path, args, RecordingDPServer),
                                       peer_group_size, num_groups)
        dp_gangs: dict[str, set] = {}
        for gid, members in groups.items():
            for m in members:
                assert (m["dp_rank"], m["dp_size"]) == (m["rank"] % 2, 2)
                assert m["dp_gang_id"] == f"{m['gang_id']}-dp{m['rank'] // 2}"
                dp_gangs.setdefault(m["dp_gang_id"], set()).add(gid)
        assert len(dp_gangs) == num_groups * peer_group_size // 2
        assert all(len(gids) == 1 for gids in dp_gangs.values())
    finally:
        _shutdown_app()


def test_a_group_that_fits_no_domain_fails_the_deploy_in_one_line(cluster, tmp_path):
    """Three groups of 4 on two domains of 4: `serve deploy` (the controller builds the app)
    reports within placement_timeout_s what is missing, in the application's status."""
    from ray import serve
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    args = _args(tmp_path, "infeasible", 4, 3, placement_timeout_s=30)
    config = ServeDeploySchema.parse_obj({"applications": [{
        "name": "infeasible", "route_prefix": "/infeasible",
        "import_path": "engram_ray.serve.app:build_app", "args": args}]})
    started = time.monotonic()
    serve_start().deploy_apps(config)
    status = None
    while time.monotonic() - started < 240:
        status = serve.status().applications.get("infeasible")
        if status is not None and status.status == "DEPLOY_FAILED":
            break
        time.sleep(1)
    assert status is not None and status.status == "DEPLOY_FAILED", status
    # A refusal is not retried (Serve retries other failed builds 3 times, each in a new
    # worker of 10-20 s here): one worker start and one timeout, where a second build would
    # pass 2 x 30 s.
    elapsed = time.monotonic() - started
    print(f"DEPLOY_FAILED {elapsed:.1f} s after the deploy (placement_timeout_s 30)")
    assert elapsed < 2 * 30, elapsed
    # The refusal alone, after Serve's own first line: no traceback.
    assert "Traceback" not in status.message, status.message
    lines = status.message.splitlines()
    assert len(lines) == 2 and "cannot be placed" in lines[1], status.message
    line = lines[1]
    assert "group-2 of 3 cannot be placed within 30 s" in line
    assert "each needs 4 x {'GPU': 1.0, 'CPU': 0.1} in one NVLink domain" in line
    assert "dom-a 4/4, dom-b 4/4" in line and "group-0 in dom-a, group-1 in dom-b" in line
    serve.delete("infeasible")


def _all_healthy(name: str) -> bool:
    return all(d.status == "HEALTHY" for app in _applications(name).values()
               for d in app.deployments.values())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0


def test_a_dead_member_restarts_its_group_and_a_lost_domain_moves_it_the_other_untouched(
        cluster, tmp_path):
    """`serve deploy` of two groups of 2 (group-0 in dom-a, group-1 in dom-b, 2 slots free in
    each). A member killed: group-0 restarts as one (new gang, new generation, the survivor's
    process gone). Then both nodes of dom-a killed outright (raylets and workers): after
    replace_lost_group_after_s, group-0's deployment alone is pointed at dom-b and its new
    gang serves there as a new generation. group-1's members are never touched. dom-a's nodes
    come back afterwards (for the tests after this one)."""
    from engram_ray.actors.coordinator_lookup import find_coordinator

    name = "placement"
    args = _args(tmp_path, name, 2, 2)
    args["deployment"]["replace_lost_group_after_s"] = 3
    try:
        before = _check_inside_domains(_serve_deploy(tmp_path, name, args), 2, 2)
        assert [before[g][0]["domain_id"] for g in ("group-0", "group-1")] == ["dom-a", "dom-b"]
        restarted = _kill_a_member_of_group_0(tmp_path, name, before)
        moved = _kill_the_domain_of_group_0(cluster, tmp_path, name, before["group-0"] + restarted)
        assert len({m["generation"] for m in moved + restarted + before["group-0"]}) == 3
        assert _by_group(_records(tmp_path))["group-1"] == before["group-1"]
        assert all(_alive(m["pid"]) for m in before["group-1"])
        coordinator = find_coordinator(name)
        assert ray.get(coordinator.status.remote())["group-0"]["domain"] == "dom-b"
        routing = ray.get(coordinator.routing.remote())[1]
        assert routing["group-0"]["serving"] and routing["group-1"]["serving"], routing
    finally:
        if not cluster.domain_nodes["dom-a"]:
            cluster.domain_nodes["dom-a"] = [_add_node(cluster, "dom-a", node)
                                             for node in DOMAINS["dom-a"]]
        _shutdown_app(name, store=tmp_path / "store")  # group-0's folders from dom-a too


def _serve_deploy(tmp_path, name: str, args: dict) -> list[dict]:
    """`serve deploy` (declarative) of the recording engines; their records once it runs.
    tests/ goes on the application's PYTHONPATH (workers cannot import it otherwise)."""
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    from engram_ray.serve.deploy.cluster_configs import group_app_configs

    tests_dir = str(Path(__file__).resolve().parents[2])
    door = {"name": name, "route_prefix": f"/{name}", "args": args,
            "import_path": "support.recording_server:build_recording_app",
            "runtime_env": {"env_vars": {"PYTHONPATH": f"{tests_dir}:${{PYTHONPATH}}"}}}
    groups = group_app_configs(door, "support.recording_server:build_recording_group")
    serve_start().deploy_apps(ServeDeploySchema.model_validate({"applications": [door, *groups]}))
    _wait_running(name)
    return _records(tmp_path)


def _kill_a_member_of_group_0(tmp_path, name: str, before: dict) -> list[dict]:
    """Kill member 1 of group-0: the whole group restarts (its new members returned)."""
    victim = before["group-0"][1]
    actor = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                 if victim["replica_id"] in a["name"])
    killed_at = time.monotonic()
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    new = _new_gang_of_group_0(tmp_path, name, before["group-0"], killed_at + 120)
    print(f"group-0 restarted as one and healthy {time.monotonic() - killed_at:.1f} s after "
          "the kill")
    assert {m["generation_index"] for m in new} == {2}
    assert {m["replica_id"] for m in new}.isdisjoint(m["replica_id"] for m in before["group-0"])
    assert not any(_alive(m["pid"]) for m in before["group-0"])  # the survivor stopped too
    return new


def _kill_the_domain_of_group_0(cluster, tmp_path, name: str, earlier: list[dict]) -> list:
    """Kill every node of dom-a (group-0's domain): group-0 serves again in dom-b."""
    killed_at = time.monotonic()
    for node in cluster.domain_nodes["dom-a"]:
        cluster.remove_node(node, allow_graceful=False)
    cluster.domain_nodes["dom-a"] = []
    moved = _new_gang_of_group_0(tmp_path, name, earlier, killed_at + 180)
    print(f"group-0 serving again in dom-b {time.monotonic() - killed_at:.1f} s after dom-a's "
          "nodes were killed")
    assert {m["node_labels"][KEY] for m in moved} == {"dom-b"} == {m["domain_id"] for m in moved}
    return moved


def _new_gang_of_group_0(tmp_path, name: str, earlier: list[dict], deadline: float) -> list:
    """The two members of group-0's gang that is none of `earlier`'s, once Serve has every
    deployment of `name` HEALTHY (AssertionError at `deadline`)."""
    old_gangs = {m["gang_id"] for m in earlier}
    new: list[dict] = []
    while time.monotonic() < deadline:
        new = [m for m in _by_group(_records(tmp_path))["group-0"]
               if m["gang_id"] not in old_gangs]
        if len(new) == 2 and len({m["gang_id"] for m in new}) == 1 and _all_healthy(name):
            return new
        time.sleep(0.5)
    raise AssertionError(f"group-0 has no new serving gang: {new}")

"""Peer groups placed by Ray's scheduler inside NVLink domains, on a real multi-node Ray
(`ray.cluster_utils.Cluster`): two domains of two labelled nodes each (2 fake GPUs per node),
the real Serve application of `engram_ray.serve.app.build_app` with engines that only record where
they run (tests/support/recording_server.py). Checks every member's node labels, DEP gangs
nested in groups, an infeasible group reported in one line within placement_timeout_s (in the
Serve application's status too), and a group restarted as one while the other keeps running.
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

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    for domain, nodes in DOMAINS.items():
        for node in nodes:
            cluster.add_node(num_cpus=2, num_gpus=2, node_ip_address="127.0.0.1",
                             labels={KEY: domain, "test/node": node})
    ray.init(address=cluster.address, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(recording_server)  # workers cannot import tests/
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    yield cluster
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


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
    from ray import serve

    from engram_ray.serve.app import build_engram_app

    serve.run(build_engram_app(args, server_cls=server_cls), name=name, route_prefix=f"/{name}")
    return _records(tmp_path)


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
    """`serve delete`: the coordinator goes by itself with its application (it looks every
    APP_CHECK_S), taking the store folders with it."""
    from ray import serve

    from engram_ray.actors.coordinator_lookup import find_coordinator
    from engram_ray.actors.lifetime import APP_CHECK_S

    serve.delete(name)
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


# Two groups of 4 filling both domains: test_dep_gangs_nest_inside_one_group[4-2] deploys
# them and makes the same checks (one deploy fewer: each takes minutes on 2 cores).
@pytest.mark.parametrize("peer_group_size,num_groups", [(2, 4), (2, 1), (4, 1)])
def test_every_member_of_a_group_runs_in_its_domain(cluster, tmp_path, peer_group_size,
                                                    num_groups):
    """P = 2 and 4; four groups of 2 fill both domains, one group leaves a domain unused."""
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


@pytest.mark.parametrize("peer_group_size,num_groups", [(4, 2), (2, 2)])
def test_dep_gangs_nest_inside_one_group(cluster, tmp_path, peer_group_size, num_groups):
    """DEP2: DP ranks r % 2 of DP gangs r // 2 of each group; a DP gang never spans groups."""
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
    # Serve retries a failed build 3 times, each in a new worker (10-20 s here); the retries
    # keep the first deadline, so: one timeout + 4 worker starts (106 s measured on 2 busy
    # cores), where 4 timeouts + 4 worker starts would pass 160 s.
    elapsed = time.monotonic() - started
    print(f"DEPLOY_FAILED {elapsed:.1f} s after the deploy (placement_timeout_s 30)")
    assert elapsed < 4 * 30 + 40, elapsed
    lines = [line for line in status.message.splitlines() if "cannot be placed" in line]
    assert lines, status.message
    line = lines[-1]
    assert "group-2 of 3 cannot be placed within 30 s" in line
    assert "each needs 4 x {'GPU': 1.0, 'CPU': 0.1} in one NVLink domain" in line
    assert "dom-a 4/4, dom-b 4/4" in line and "group-0 in dom-a, group-1 in dom-b" in line
    serve.delete("infeasible")


def test_a_dead_member_restarts_its_whole_group_and_the_other_keeps_running(cluster,
                                                                             tmp_path):
    args = _args(tmp_path, "placement", 2, 2)
    try:
        before = _by_group(_deploy(tmp_path, args))
        victim = before["group-0"][1]
        actor = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                     if victim["replica_id"] in a["name"])
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
        deadline = killed_at + 120
        while time.monotonic() < deadline:
            after = _by_group(_records(tmp_path))
            new = [m for m in after["group-0"] if m["gang_id"] != victim["gang_id"]]
            if len(new) == 2:
                break
            time.sleep(0.5)
        assert len(new) == 2, after
        while time.monotonic() < deadline and not _all_healthy("placement"):
            time.sleep(0.5)
        restarted_s = time.monotonic() - killed_at
        assert {m["generation_index"] for m in new} == {2}
        assert len({m["generation"] for m in new}) == 1
        assert {m["replica_id"] for m in new}.isdisjoint(m["replica_id"] for m in before["group-0"])
        old_pids = [m["pid"] for m in before["group-0"]]
        assert not any(_alive(pid) for pid in old_pids)  # the survivor stopped with its gang
        others = [m for m in after["group-1"]]
        assert others == before["group-1"]  # the other group was not touched
        assert _all_healthy("placement"), "group deployments not all HEALTHY after the restart"
        print(f"group-0 restarted as one and healthy {restarted_s:.1f} s after the kill")
    finally:
        _shutdown_app()


def _all_healthy(app_name: str) -> bool:
    from ray import serve

    deployments = serve.status().applications[app_name].deployments
    return all(d.status == "HEALTHY" for d in deployments.values())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0

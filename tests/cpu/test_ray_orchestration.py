"""Ray orchestration on a real 3-node Ray cluster (one machine, fake GPUs, domain labels).

Domain A = two nodes x 2 GPUs, domain B = one node x 2 GPUs. Engines use the shm table backend
with a tiny model, and every lookup is compared with `torch.equal` to the full-table reference.
Run inside a loopback-only namespace:
    bash scripts/in_netns.sh python3 -m pytest tests/cpu/test_ray_orchestration.py
"""

from __future__ import annotations

import json
import os
import stat
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from engram_ray.config import DEFAULT_DOMAIN_LABEL_KEY, DeploymentConfig  # noqa: E402
from engram_ray.deploy import deploy  # noqa: E402
from engram_ray.grouping import PeerGroupPlan, PlacementError  # noqa: E402
from engram_ray.layout import EngramLayout  # noqa: E402
from engram_ray.reference import lookup_reference  # noqa: E402
from engram_ray.synthetic import synthetic_rows  # noqa: E402

TINY_MODEL = {"engram_layer_ids": [1, 3], "engram_vocab_size": 1000, "engram_max_ngram_size": 3,
              "engram_n_heads": 2, "engram_head_dim": 32, "engram_compressed_vocab_size": 500,
              "engram_pad_token_id": 2}
SEED = 7
WAIT_S = 90


def _node_args(domain: str) -> dict:
    return dict(num_cpus=1, num_gpus=2, node_ip_address="127.0.0.1",
                labels={DEFAULT_DOMAIN_LABEL_KEY: domain}, object_store_memory=80 << 20)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    head = dict(_node_args("A"), include_dashboard=False)
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cluster.add_node(**_node_args("A"))
    cluster.add_node(**_node_args("B"))
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_model")
    (path / "config.json").write_text(json.dumps(TINY_MODEL))
    return path


@pytest.fixture(scope="module")
def layout():
    return EngramLayout.from_config(TINY_MODEL)


@pytest.fixture(scope="module")
def full_tables(layout):
    return {lid: synthetic_rows(0, rows, layout.head_dim, SEED)
            for lid, rows in zip(layout.layer_ids, layout.rows_per_table)}


def _config(model_dir, tmp_path, **changes) -> DeploymentConfig:
    base = dict(name="t", model=str(model_dir), peer_group_size=2,
                peer_group_store=str(tmp_path / "store"), table_backend="shm", seed=SEED,
                num_cpus_per_engine=0, rendezvous_timeout_s=60, placement_timeout_s=10,
                health_check_interval_s=0.5, max_missed_pings=20)
    return DeploymentConfig(**dict(base, **changes))


def _row_ids(layout, layer_id, gen) -> torch.Tensor:
    rows = layout.rows_per_table[layout.layer_idx(layer_id)]
    ids = torch.randint(0, rows, (5, 4), generator=gen, dtype=torch.int64)
    ids[0, 0], ids[1, 1], ids[2, 2] = -1, rows - 1, 0  # no row, last row, first row
    return ids


def _check_bit_exact(engines, layout, full_tables) -> None:
    gen = torch.Generator().manual_seed(len(engines))
    for layer_id in layout.layer_ids:
        ids = _row_ids(layout, layer_id, gen)
        expected = lookup_reference(full_tables[layer_id], ids, layout.head_dim, "packed")
        for got in ray.get([e.lookup.remote(layer_id, ids) for e in engines], timeout=60):
            assert torch.equal(got, expected)


def _labels_by_node() -> dict[str, str]:
    return {n["NodeID"]: n["Labels"].get(DEFAULT_DOMAIN_LABEL_KEY)
            for n in ray.nodes() if n["Alive"]}


def _wait_for(predicate, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class TestGroupsOfTwo:
    """peer_group_size=2: three groups (two in A, one in B); then restart and coordinator loss."""

    @pytest.fixture(scope="class")
    def deployment(self, cluster, model_dir, tmp_path_factory):
        dep = deploy(_config(model_dir, tmp_path_factory.mktemp("pg2")))
        yield dep
        dep.shutdown()

    def test_three_groups_each_inside_one_domain(self, deployment):
        status = deployment.status()
        assert len(status) == 3 and deployment.unused == {}
        labels = _labels_by_node()
        domains = sorted(s["domain_id"] for s in status.values())
        assert domains == ["A", "A", "B"]
        for s in status.values():
            assert s["state"] == "ready" and s["generation_index"] == 1
            node_domains = {labels[m["node_id"]] for m in s["members"]}
            assert node_domains == {s["domain_id"]}
            assert all(b and b > 0 for b in s["bytes_per_rank"])

    def test_lookups_through_every_engine_are_bit_exact(self, deployment, layout, full_tables):
        engines = [e for group in deployment.engines().values() for e in group]
        assert len(engines) == 6
        _check_bit_exact(engines, layout, full_tables)

    def test_killed_engine_restarts_group_with_new_generation(self, deployment, layout,
                                                              full_tables):
        group_id = sorted(deployment.groups)[0]
        before = deployment.status()[group_id]
        assert os.path.isdir(before["store_dir"])
        ray.kill(deployment.engines(group_id)[1], no_restart=True)
        coordinator = deployment.coordinators[group_id]

        def restarted():
            s = ray.get(coordinator.status.remote())
            return s if s["state"] == "ready" and s["generation"] != before["generation"] else None
        after = _wait_for(restarted, "the group to restart")
        assert after["generation_index"] == before["generation_index"] + 1
        assert after["num_restarts"] == 1
        ids_before = [m["actor_id"] for m in before["members"]]
        ids_after = [m["actor_id"] for m in after["members"]]
        assert ids_after[0] == ids_before[0]  # the survivor rebuilt in place
        assert ids_after[1] != ids_before[1]  # the dead one recreated in its bundle
        assert after["members"][1]["node_id"] == before["members"][1]["node_id"]
        assert not os.path.exists(before["store_dir"])
        assert stat.S_IMODE(os.stat(after["store_dir"]).st_mode) == 0o700
        engines = deployment.engines(group_id)
        assert all(ray.get([e.is_healthy.remote() for e in engines]))
        _check_bit_exact(engines, layout, full_tables)

    def test_killed_coordinator_stops_its_engines(self, deployment, layout):
        group_id = sorted(deployment.groups)[-1]
        engines = deployment.engines(group_id)
        ray.kill(deployment.coordinators[group_id], no_restart=True)

        def all_stopped():
            health = ray.get([e.health.remote() for e in engines], timeout=30)
            return health if not any(h["is_healthy"] for h in health) else None
        health = _wait_for(all_stopped, "engines to stop serving", timeout_s=30)
        assert all(h["state"] == "stopped" for h in health)
        ids = torch.zeros((1, 1), dtype=torch.int64)
        with pytest.raises(ray.exceptions.RayTaskError, match="refused"):
            ray.get(engines[0].lookup.remote(layout.layer_ids[0], ids))
        others = [e for gid, group in deployment.engines().items() if gid != group_id
                  for e in group]
        assert all(ray.get([e.is_healthy.remote() for e in others]))

    def test_group_without_coordinator_can_be_restarted(self, deployment, layout, full_tables):
        group_id = sorted(deployment.groups)[-1]
        status = deployment.restart_group(group_id)
        assert status["state"] == "ready" and status["domain_id"] == "B"
        _check_bit_exact(deployment.engines(group_id), layout, full_tables)


def test_groups_of_four_fill_domain_a_and_report_b(cluster, model_dir, tmp_path, layout,
                                                  full_tables):
    dep = deploy(_config(model_dir, tmp_path, peer_group_size=4))
    try:
        status = dep.status()
        assert [s["domain_id"] for s in status.values()] == ["A"]
        assert set(dep.unused) == {"B"}
        assert dep.unused["B"][0].num_slots == 2
        assert "unable to form a peer group" in dep.unused["B"][0].reason
        labels = _labels_by_node()
        (group,) = status.values()
        assert len({m["node_id"] for m in group["members"]}) == 2
        assert {labels[m["node_id"]] for m in group["members"]} == {"A"}
        _check_bit_exact(dep.engines(group["group_id"]), layout, full_tables)
    finally:
        dep.shutdown()


def test_groups_of_eight_fail_with_clear_error(cluster, model_dir, tmp_path):
    started = time.monotonic()
    with pytest.raises(PlacementError) as info:
        deploy(_config(model_dir, tmp_path, peer_group_size=8))
    assert time.monotonic() - started < 10
    message = str(info.value)
    assert "peer_group_size=8" in message
    assert "A: 4 free slot(s) on 2 node(s)" in message
    assert "B: 2 free slot(s) on 1 node(s)" in message


def test_infeasible_placement_group_times_out_listing_domains(cluster, model_dir, tmp_path):
    from engram_ray.actors.placement import discover_domains, reserve_group

    config = _config(model_dir, tmp_path, placement_timeout_s=1.5)
    domain_b = next(d for d in discover_domains(config) if d.domain_id == "B")
    started = time.monotonic()
    with pytest.raises(PlacementError, match="was not placed within 1.5 s") as info:
        reserve_group(PeerGroupPlan("B-g0", domain_b, 0, 4), config)
    assert time.monotonic() - started < 10
    assert "B: 2 free slot(s)" in str(info.value) and "4 bundles" in str(info.value)


def test_cpu_engines_use_cpu_bundles_on_one_node(cluster, model_dir, tmp_path, layout,
                                                 full_tables):
    config = _config(model_dir, tmp_path, num_gpus_per_engine=0, num_cpus_per_engine=0.25,
                     max_peer_groups=1)
    dep = deploy(config)
    try:
        (group,) = dep.status().values()
        assert group["domain_id"].startswith("node-")
        assert len({m["node_id"] for m in group["members"]}) == 1
        assert dep.groups[group["group_id"]].placement_group.bundle_specs == [{"CPU": 0.25}] * 2
        _check_bit_exact(dep.engines(group["group_id"]), layout, full_tables)
    finally:
        dep.shutdown()


def test_engine_failure_surfaces_at_the_caller_with_its_cause(cluster, model_dir, tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    config = _config(model_dir, tmp_path, fill="checkpoint", checkpoint=str(missing),
                     max_peer_groups=1)
    with pytest.raises(ray.exceptions.RayTaskError, match="no-such-checkpoint"):
        deploy(config)
    assert ray.available_resources().get("GPU") == 6  # the failed group was removed
    assert not os.path.exists(tmp_path / "store" / "t")

"""`Deployment.restart_group` on a real Ray cluster: bounded, and it frees every slot of the group.

Uses the 3-node cluster of `test_ray_orchestration` (fake GPUs, domain labels). Run inside a
loopback-only namespace:
    bash scripts/in_netns.sh python3 -m pytest tests/cpu/test_restart_group.py
"""

from __future__ import annotations

import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from engram_ray.deploy import GroupRestartError, deploy  # noqa: E402
from test_ray_orchestration import _check_bit_exact, _config, _wait_for  # noqa: E402
# Fixtures of the orchestration tests: pytest finds them by name in this module.
from test_ray_orchestration import cluster, full_tables, layout, model_dir  # noqa: E402,F401

# A group that misses an engine (its bundle held by a leftover one) fails its rendezvous
# after this long; a restart must be done well before.
RENDEZVOUS_S = 20


@pytest.fixture
def deployment(cluster, model_dir, tmp_path):
    dep = deploy(_config(model_dir, tmp_path, max_peer_groups=1,
                         rendezvous_timeout_s=RENDEZVOUS_S))
    yield dep
    dep.shutdown()


def _is_dead(actor) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=10)
    except ray.exceptions.ActorUnavailableError:
        return False
    except ray.exceptions.RayActorError:
        return True
    return False


def test_restart_kills_an_engine_the_coordinator_made_but_the_driver_never_saw(
        deployment, layout, full_tables):
    (group_id,) = deployment.groups
    seen = deployment.engines(group_id)
    coordinator = deployment.coordinators[group_id]
    ray.kill(seen[1], no_restart=True)

    def restarted():
        s = ray.get(coordinator.status.remote(), timeout=30)
        return s if s["state"] == "ready" and s["generation_index"] == 2 else None
    _wait_for(restarted, "the coordinator to recreate rank 1")
    # Asked behind the deployment's back: `deployment.engines` still holds the old rank 1.
    unseen = ray.get(coordinator.get_engines.remote())[1]
    ray.kill(coordinator, no_restart=True)
    started = time.monotonic()
    status = deployment.restart_group(group_id)
    assert time.monotonic() - started < RENDEZVOUS_S
    assert status["state"] == "ready" and status["generation_index"] == 1
    assert _is_dead(unseen)  # its bundle went to the new rank 1
    _check_bit_exact(deployment.engines(group_id), layout, full_tables)


def test_restart_is_bounded_when_the_coordinator_is_frozen(deployment, layout, full_tables):
    (group_id,) = deployment.groups
    old_engines = deployment.engines(group_id)
    coordinator = deployment.coordinators[group_id]
    pid = ray.get(coordinator.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGSTOP)  # alive to Ray, answers nothing
    try:
        started = time.monotonic()
        status = deployment.restart_group(group_id, timeout_s=60)
        assert time.monotonic() - started < 60
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert status["state"] == "ready"
    assert all(_is_dead(e) for e in old_engines)
    _check_bit_exact(deployment.engines(group_id), layout, full_tables)


def test_restart_names_the_group_and_the_ranks_that_did_not_come_up(deployment):
    (group_id,) = deployment.groups
    pg = deployment.groups[group_id].placement_group

    @ray.remote
    class Squatter:
        def ping(self):
            return "here"

    # The squatter is no engine of the group: restart_group leaves it, and rank 1 finds no slot.
    engines = deployment.engines(group_id)
    ray.kill(deployment.coordinators[group_id], no_restart=True)  # else it recreates rank 1
    ray.kill(engines[1], no_restart=True)
    squatter = Squatter.options(num_gpus=1, num_cpus=0, scheduling_strategy=(
        PlacementGroupSchedulingStrategy(placement_group=pg,
                                         placement_group_bundle_index=1))).remote()
    try:
        ray.get(squatter.ping.remote(), timeout=30)
        started = time.monotonic()
        with pytest.raises(GroupRestartError) as info:
            deployment.restart_group(group_id, timeout_s=5)
        assert time.monotonic() - started < 30
        message = str(info.value)
        assert f"peer group {group_id} did not become ready within 5 s" in message
        assert "rank(s) 1 have no running engine" in message
        assert ray.get(squatter.ping.remote(), timeout=10) == "here"
    finally:
        ray.kill(squatter, no_restart=True)

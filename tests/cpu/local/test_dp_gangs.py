"""Data-parallel gangs (DEP2, the shape of every shipped GPU config) on the local deployment:
one peer group of 4 CPU engines as two vLLM DP groups of 2 (the tiny model with 4 experts per
MLP: vLLM forms DP groups only for MoE models), under a load generator that counts a request
as served only if its client saw it complete.

- kill -9 of one EngineCore: its DP gang restarts in place (both engines: the peer's dies
  with its DP group), same generation, slices re-attached, on a new DP master; the group's
  other gang answers every request sent until the pair serves again; answers token-identical.
- `serve deploy` of a changed engine setting (`serving.rollout.mode: in_place`): the gangs
  restart in place with it one DP gang at a time, through a coordinator killed (kill -9) as
  the first gang restarts; not one request fails, no gang restarts whole.
"""

import time

import pytest

from engram_ray.local.loadgen import LOST, Traffic
from engram_ray.local.prometheus import free_port

pytestmark = pytest.mark.slow
NAME = "dpgangs"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    from engram_ray.local.deployment import LocalDeployment, LocalOptions

    workdir = tmp_path_factory.mktemp("dp")
    local = LocalDeployment(LocalOptions(workdir=str(workdir), port=free_port(),
                                         num_peer_groups=1, peer_group_size=4,
                                         data_parallel_size=2, num_experts=4, name=NAME,
                                         num_logical_cpus=4))
    try:
        local.start()
        local.wait_ready()
        yield local
    finally:
        local.stop()


def _traffic(deployment) -> Traffic:
    return Traffic(f"{deployment.url}/v1", deployment.model_id, concurrency=6,
                   max_tokens=24).start()


def test_an_engine_kill_restarts_its_dp_gang_in_place_while_the_other_gang_answers(deployment):
    from engram_ray.local.faults import group_status, kill_under_load, reference_answers

    members = group_status(NAME, "group-0")["members"]
    assert len(members) == 4
    traffic = _traffic(deployment)
    try:
        time.sleep(4.0)
        kill = kill_under_load(deployment, traffic, "engine_core", "group-0",
                               reference=reference_answers(traffic.results))
    finally:
        results = traffic.stop()
    print(kill)
    assert not [r for r in results if r.outcome == LOST]
    # The pair of one DP gang restarted, in its generation; the other gang served on.
    assert kill["same_generation"] and kill["recovery"]["ranks"] in ([0, 1], [2, 3]), kill
    assert kill["window_requests"] > 0 and kill["window_failed"] == 0, kill
    assert kill["answers_checked"] > 0 and kill["answers_differing"] == 0, kill
    status = group_status(NAME, "group-0")
    assert not status["broken"] and status["members"] == members  # no replica replaced
    assert {r["epoch"] for r in status["restarts"]} == {1}


def test_an_engine_setting_rolls_in_place_one_dp_gang_at_a_time_through_a_coordinator_kill(
        deployment):
    """The coordinator is killed (kill -9) as the first DP gang restarts for the roll: the
    restarted one keeps that gang's turn and restart number (one DP master for both engines),
    gives the other gang its turn only after, and the roll ends with 4 restarts, no gang
    restarted whole, not one request failed."""
    from engram_ray.local.faults import reference_answers
    from engram_ray.local.rollout import coordinator_kill_when, roll_under_load

    kill = coordinator_kill_when(NAME, "restarting")
    traffic = _traffic(deployment)
    try:
        time.sleep(3.0)
        roll = roll_under_load(deployment, traffic, {"serving": {"engine_kwargs": {
            "max_num_seqs": 96}}}, reference=reference_answers(traffic.results), during=kill)
    finally:
        results = traffic.stop()
    print(roll)
    assert kill.killed_at is not None
    assert roll["stopped"] is None and roll["same_generation"] == {"group-0": True}, roll
    restarted = roll["member_restarts"]
    assert len(restarted) == 4, roll
    assert roll["window_failed"] == 0 and roll["lost_silently"] == 0, roll
    assert roll["answers_checked"] > 0 and roll["answers_differing"] == 0, roll
    assert sum(r.ok for r in results) == len(results)

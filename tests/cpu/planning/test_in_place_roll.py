"""The in-place roll's turns (`engram_ray.planning.in_place_roll`): one member of a group at a
time, `max_groups_at_once` groups, a stop at a member whose new engine failed, a fresh start
for new settings."""

from engram_ray.planning.in_place_roll import InPlaceRoll


def _roll(members: dict[str, str], version: str = "v1") -> InPlaceRoll:
    roll = InPlaceRoll(version)
    for replica_id in members:
        roll.running(replica_id, version)
    return roll


def test_one_member_of_a_group_at_a_time_and_one_group_at_a_time_by_default():
    members = {"a0": "g0", "a1": "g0", "b0": "g1"}
    roll = _roll(members)
    assert not roll.next_turn("a0", "g0", True, 1)  # nothing to roll yet
    assert roll.set_target("v2") and not roll.set_target("v2")
    assert roll.next_turn("a0", "g0", True, 1)
    assert roll.next_turn("a0", "g0", True, 1)        # asked again: still its turn
    assert not roll.next_turn("a1", "g0", True, 1)    # never two members of one group
    assert not roll.next_turn("b0", "g1", True, 1)    # max_groups_at_once 1
    assert roll.next_turn("b0", "g1", True, 2)        # ... 2: another group may
    roll.running("a0", "v2")
    roll.running("b0", "v2")
    assert not roll.next_turn("a0", "g0", True, 1)    # runs them already
    assert not roll.next_turn("a1", "g0", False, 1)   # its group is not whole
    assert roll.next_turn("a1", "g0", True, 1)
    roll.running("a1", "v2")
    progress = roll.progress(members)
    assert progress["done"] == progress["members"] == 3 and not progress["restarting"]
    assert [r["replica_id"] for r in progress["restarted"]] == ["a0", "b0", "a1"]


def test_a_failed_member_stops_the_roll_until_the_settings_change():
    roll = _roll({"a0": "g0", "a1": "g0"})
    roll.set_target("v2")
    assert roll.next_turn("a0", "g0", True, 1)
    roll.stop("a0", "engine did not start")
    roll.running("a0", "v1")                          # back on its old settings
    assert roll.progress(["a0", "a1"])["stopped"]["reason"] == "engine did not start"
    assert not roll.next_turn("a1", "g0", True, 1)
    assert not roll.next_turn("a0", "g0", True, 1)
    roll.set_target("v3")                             # new settings: the roll starts again
    assert roll.progress(["a0", "a1"])["stopped"] is None
    assert roll.next_turn("a1", "g0", True, 1)


def test_a_member_gone_with_its_turn_frees_its_group():
    roll = _roll({"a0": "g0", "a1": "g0"})
    roll.set_target("v2")
    assert roll.next_turn("a0", "g0", True, 1)
    roll.forget("a0")                                 # its replica left (gang restarted)
    assert roll.next_turn("a1", "g0", True, 1)
    assert roll.progress(["a1"])["members"] == 1


def test_a_data_parallel_gang_takes_its_turn_together():
    roll = InPlaceRoll("v1")
    for r in ("a", "b", "c", "d"):
        roll.running(r, "v1")
    roll.set_target("v2")
    assert roll.next_turn("a", "group-0", True, 1)
    roll.join_turn("b", "group-0")  # a's DP peer: same turn, same group
    assert roll.next_turn("b", "group-0", True, 1)  # asked: still its turn
    assert not roll.next_turn("c", "group-0", True, 1)  # the group's other gang waits
    roll.running("a", "v2"), roll.running("b", "v2")
    assert roll.next_turn("c", "group-0", True, 1)
    assert [r["replica_id"] for r in roll.progress("abcd")["restarted"]] == ["a", "b"]

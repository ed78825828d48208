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


def _dp_book(tmp_path, num_groups: int = 2):
    """Groups of 4 members in DP gangs of 2, every member joined and ready."""
    from pathlib import Path

    from engram_ray.model.layout import load_layout
    from engram_ray.planning.generations import GenerationBook
    from engram_ray.serve.deploy.cluster_configs import load_serve_config
    from engram_ray.serve.settings.config import ServeAppConfig

    configs = Path(__file__).resolve().parents[3] / "cluster_configs"
    raw = next(iter(load_serve_config(configs / "serve_local_tiny.yaml").values())).to_dict()
    raw["deployment"].update(peer_group_store=str(tmp_path / "store"), name="turns",
                             model="deepseek-v4.1-flash", peer_group_size=4)
    config = ServeAppConfig.from_dict(raw, "test").deployment
    book = GenerationBook(config, load_layout(config.model),
                          {f"group-{g}": f"d{g}" for g in range(num_groups)}, dp_size=2)
    for g in range(num_groups):
        for r in range(4):
            book.join(f"group-{g}", f"gang{g}", r, 4, f"g{g}m{r}")
            book.member_ready(f"g{g}m{r}")
    return book


def test_take_turn_restarts_a_dp_gang_whole_one_group_at_a_time(tmp_path):
    """The coordinator's turn (`take_turn`) over a real book: the member and its DP peer are
    marked restarting under one epoch, its group routes to the other gang, no other group
    gets a turn (max 1), a member asking again keeps its turn, and nothing is given in
    another mode or to a member on the target settings."""
    from engram_ray.planning.in_place_roll import take_turn

    book = _dp_book(tmp_path)
    roll = InPlaceRoll("v1")
    for rid in book.member_ids():
        roll.running(rid, "v1")
    assert take_turn(roll, book, "g0m0", "v1", "in_place", 1) == (None, False)
    roll.set_target("v2")
    assert take_turn(roll, book, "g0m0", "v1", "beside", 1) == (None, False)
    assert take_turn(roll, book, "g0m0", "v1", "in_place", 1) == ("v2", True)
    route = book.routing()["group-0"]
    assert route["restarting_ranks"] == [0, 1] and route["serving_members"] == ["g0m2", "g0m3"]
    assert (book.restart_epoch("g0m1"), book.restart_epoch("g0m2")) == (1, None)
    assert take_turn(roll, book, "g0m1", "v1", "in_place", 1) == ("v2", False)  # its peer
    assert take_turn(roll, book, "g0m0", "v1", "in_place", 1) == ("v2", False)  # again
    assert take_turn(roll, book, "g0m2", "v1", "in_place", 1) == (None, False)  # same group
    assert take_turn(roll, book, "g1m0", "v1", "in_place", 1) == (None, False)  # max 1 group
    assert take_turn(roll, book, "g1m0", "v1", "in_place", 2)[0] == "v2"       # max 2
    for rid in ("g0m0", "g0m1"):
        book.member_ready(rid)
        roll.running(rid, "v2")
    assert take_turn(roll, book, "g0m0", "v2", "in_place", 2) == (None, False)  # on target
    assert take_turn(roll, book, "g0m3", "v1", "in_place", 2)[0] == "v2"


def test_take_turn_drops_the_turn_of_a_gang_that_is_gone(tmp_path):
    from engram_ray.planning.in_place_roll import take_turn

    book = _dp_book(tmp_path, num_groups=1)
    roll = InPlaceRoll("v1")
    roll.set_target("v2")
    assert take_turn(roll, book, "g0m0", "v1", "in_place", 1)[0] == "v2"
    for r in range(4):  # Serve restarted the gang: a new one joins
        book.leave(f"g0m{r}")
    for r in range(4):
        book.join("group-0", "gang-new", r, 4, f"n{r}")
        book.member_ready(f"n{r}")
        roll.running(f"n{r}", "v2")  # a new gang starts on the coordinator's settings
    assert take_turn(roll, book, "n0", "v2", "in_place", 1) == (None, False)
    assert roll.turns == {}  # the old gang's turn went with it


def test_a_dp_gang_restarts_with_the_settings_of_its_turn_across_a_deploy(tmp_path):
    """A deploy lands between a member's turn and its DP peer's check (seen in the chaos
    harness: the peers fetched two settings, their DP group never formed, the gang was
    lost): the peer gets the turn's version and its settings; a failure of those settings
    ends the turn without stopping the roll of the new target, which then goes on."""
    from engram_ray.planning.in_place_roll import take_turn

    book = _dp_book(tmp_path, num_groups=1)
    roll = InPlaceRoll("v1", {"v": 1})
    for rid in book.member_ids():
        roll.running(rid, "v1")
    roll.set_target("v2", {"v": 2})
    assert take_turn(roll, book, "g0m0", "v1", "in_place", 1)[0] == "v2"
    roll.set_target("v3", {"v": 3})  # deployed while g0m0's gang restarts for v2
    assert take_turn(roll, book, "g0m1", "v1", "in_place", 1)[0] == "v2"
    assert roll.settings_for("v2") == ("v2", {"v": 2})
    assert roll.settings_for(None) == ("v3", {"v": 3})
    assert not roll.stop("g0m0", "v2 will not start", "v2")  # not the target: no stop
    roll.running("g0m0", "v1")
    roll.running("g0m1", "v1")
    for rid in ("g0m0", "g0m1"):
        book.member_ready(rid)
    assert roll.stopped is None and set(roll.settings) == {"v1", "v3"}  # v1: what they run
    assert take_turn(roll, book, "g0m0", "v1", "in_place", 1)[0] == "v3"
    assert roll.stop("g0m0", "v3 will not start", "v3") and roll.stopped is not None


def test_a_gang_started_while_the_roll_is_stopped_takes_the_settings_that_start():
    """Seen in the chaos harness (seeds 5 and 11): a will-not-start deploy stopped the roll,
    then a hung start lost a gang; its new gang took the target and never served. While the
    roll is stopped a new engine starts on the settings the stopped member serves on again;
    new settings deployed end the stop."""
    roll = InPlaceRoll("v1", {"v": 1})
    for rid in ("a", "b"):
        roll.running(rid, "v1")
    roll.set_target("v2", {"v": 2})
    assert roll.settings_for(None) == ("v2", {"v": 2})
    assert roll.next_turn("a", "g0", True, 1)
    assert roll.stop("a", "v2 will not start", "v2")
    roll.running("a", "v1")
    assert roll.settings_for(None) == ("v1", {"v": 1})  # a new gang's start
    roll.set_target("v3", {"v": 3})
    assert roll.settings_for(None) == ("v3", {"v": 3})

"""Peer groups inside NVLink domains, generation ids, slice assignment, store folders. No Ray."""

from __future__ import annotations

import os
import stat

import pytest

from engram_ray.model.layout import EngramLayout
from engram_ray.planning.assignment import (MAX_GENERATION_CHARS, create_store_dir, generation_id,
                                            generation_store_dir, remove_store_dir, slices_of)
from engram_ray.planning.grouping import (NODE_ID_LABEL_KEY, NodeSlots, domain_summary, domains_of,
                                          place_groups, replacement_domain)
from engram_ray.planning.lost_domains import LostDomainWatch
from engram_ray.planning.memory import rows_per_rank

KEY = "engram.io/nvlink-domain"
TINY = EngramLayout(layer_ids=(1, 3), vocab_size=1000, max_ngram_size=3, n_heads=2,
                    head_dim=32, compressed_vocab_size=500, pad_token_id=2)

# The acceptance cluster: domain A = two nodes x 2 GPUs, domain B = one node x 2 GPUs.
CLUSTER = [NodeSlots("a1", "A", 2, 2), NodeSlots("a2", "A", 2, 2), NodeSlots("b1", "B", 2, 2)]


def _place(nodes, size, num_groups):
    placed, num_missing = place_groups(domains_of(nodes, KEY), size, num_groups)
    return [(g.group_id, g.domain.domain_id) for g in placed], num_missing


def test_domains_join_nodes_by_label():
    domains = domains_of(CLUSTER, KEY)
    assert [(d.domain_id, d.node_ids, d.num_slots) for d in domains] == [
        ("A", ("a1", "a2"), 4), ("B", ("b1",), 2)]
    assert domains[0].selector == {KEY: "A"} and not domains[0].is_single_host
    assert domains[1].is_single_host


def test_groups_go_to_the_domains_in_turn_until_they_are_full():
    assert _place(CLUSTER, 2, 2) == ([("group-0", "A"), ("group-1", "B")], 0)
    assert _place(CLUSTER, 2, 4) == ([("group-0", "A"), ("group-1", "B"), ("group-2", "A")], 1)


def test_groups_of_four_fit_only_the_domain_of_four():
    assert _place(CLUSTER, 4, 1) == ([("group-0", "A")], 0)
    assert _place(CLUSTER, 4, 2) == ([("group-0", "A")], 1)
    assert _place(CLUSTER, 8, 1) == ([], 1)


def test_a_rebuild_keeps_groups_where_they_run_while_there_is_room():
    """`keep`: group-0 was placed again in B after A was lost; A is back, B has its gang
    (own gangs count as free in a rebuild): nothing moves back; a kept domain too full for
    its group lets it go where the others would."""
    domains = domains_of(CLUSTER, KEY)
    placed, missing = place_groups(domains, 2, 2, keep={"group-0": "B", "group-1": "A"})
    assert [(g.group_id, g.domain.domain_id, g.index) for g in placed] == [
        ("group-0", "B", 0), ("group-1", "A", 1)] and missing == 0
    placed, _ = place_groups(domains, 4, 2, keep={"group-0": "B"})  # B has 2 slots, not 4
    assert [(g.group_id, g.domain.domain_id) for g in placed] == [("group-0", "A")]
    placed, missing = place_groups(domains, 2, 3, keep={"group-1": "A", "gone": "B"})
    assert [(g.group_id, g.domain.domain_id) for g in placed] == [
        ("group-0", "A"), ("group-1", "A"), ("group-2", "B")] and missing == 0


def test_a_lost_group_goes_to_a_free_domain_holding_no_group_first():
    nodes = [NodeSlots("a1", "A", 2, 2), NodeSlots("b1", "B", 4, 4), NodeSlots("c1", "C", 2, 2),
             NodeSlots("d1", "D", 1, 2)]
    domains = domains_of(nodes, KEY)
    assert replacement_domain(domains, 2, holding_groups=set()).domain_id == "B"  # most free
    assert replacement_domain(domains, 2, holding_groups={"B"}).domain_id == "A"
    assert replacement_domain(domains, 2, holding_groups={"A", "B", "C"}).domain_id == "B"
    assert replacement_domain(domains, 8, holding_groups=set()) is None
    isolated = domains_of([NodeSlots("n1", None, 4, 4)], KEY)
    assert replacement_domain(isolated, 2, set()) is None
    assert replacement_domain(isolated, 1, set()).selector == {NODE_ID_LABEL_KEY: "n1"}


def test_a_group_is_due_after_its_domain_is_lost_for_the_grace_time():
    domains = domains_of(CLUSTER, KEY)
    on_a, on_b, on_gone = {KEY: "A"}, {KEY: "B"}, {KEY: "Z"}
    watch = LostDomainWatch(grace_s=10)
    selectors = {"group-0": on_gone, "group-1": on_b}
    assert watch.due(selectors, domains, 2, now=100) == []
    assert watch.due(selectors, domains, 2, now=109.9) == []
    assert watch.due(selectors, domains, 2, now=110) == ["group-0"]
    watch.placed("group-0", now=110)  # Serve still shows the old selector for a moment
    assert watch.due(selectors, domains, 2, now=115) == []
    assert watch.due({"group-0": on_a, "group-1": on_b}, domains, 2, now=116) == []
    assert watch.lost_since == {}
    # A domain too small for the group now (a node of it gone) counts as lost; back: not due.
    shrunk = domains_of([NodeSlots("a1", "A", 2, 2)], KEY)
    assert watch.due({"group-0": on_a}, shrunk, 4, now=200) == []
    assert watch.due({"group-0": on_a}, domains, 4, now=205) == []
    assert watch.due({"group-0": on_a}, shrunk, 4, now=300) == []
    assert watch.due({"group-0": on_a}, shrunk, 4, now=310) == ["group-0"]
    assert watch.due({}, shrunk, 4, now=311) == [] and watch.lost_since == {}


def test_unlabelled_and_none_nodes_are_isolated():
    nodes = [NodeSlots("n1", None, 4, 4), NodeSlots("n2", "none", 2, 2)]
    assert _place(nodes, 2, 1) == ([], 1)
    singles, _ = place_groups(domains_of(nodes, KEY), 1, 6)  # groups of one need no NVLink
    assert len(singles) == 6 and singles[0].domain.selector == {NODE_ID_LABEL_KEY: "n1"}
    assert "(isolated)" in domain_summary(domains_of(nodes, KEY))


def test_cpu_engines_make_every_node_a_domain():
    domains = domains_of(CLUSTER, KEY, node_is_domain=True)
    assert len(domains) == 3 and all(d.is_single_host for d in domains)
    assert {tuple(d.selector) for d in domains} == {(NODE_ID_LABEL_KEY,)}


def test_domain_summary_gives_free_and_total_slots():
    nodes = [NodeSlots("a1", "A", 1, 2), NodeSlots("a2", "A", 0, 2), NodeSlots("b1", "B", 2, 2)]
    assert domain_summary(domains_of(nodes, KEY)) == "A 1/4, B 2/2"


def test_generation_ids_are_valid_unique_and_bounded():
    gens = {generation_id("engram", f"mnnvl-{'ab' * 16}-32766-g{i}", 1, "c0ffee") for i in (0, 1)}
    assert len(gens) == 2
    for gen in gens:
        assert len(gen) <= MAX_GENERATION_CHARS and gen.endswith(".1.c0ffee")
    assert generation_id("t", "A-g0", 3, "abc123") == "t-A-g0.3.abc123"


def test_slices_cover_every_row_once():
    per_rank = [slices_of(TINY, rank, 3) for rank in range(3)]
    for idx, (layer_id, rows) in enumerate(zip(TINY.layer_ids, TINY.rows_per_table)):
        slices = [ranks[idx] for ranks in per_rank]
        assert all(s.layer_id == layer_id for s in slices)
        assert slices[0].start == 0 and slices[-1].end == rows
        assert all(a.end == b.start for a, b in zip(slices, slices[1:]))
        assert slices[0].end - slices[0].start == rows_per_rank(rows, 3)


def test_store_dirs_are_private_and_never_reused(tmp_path):
    path = generation_store_dir(str(tmp_path / "store"), "t", "A-g0", "t-A-g0.1.x")
    create_store_dir(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    with pytest.raises(FileExistsError):
        create_store_dir(path)
    remove_store_dir(path)
    assert not os.path.exists(path)

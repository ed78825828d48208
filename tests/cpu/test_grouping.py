"""Peer groups inside NVLink domains, generations, slice assignment, member states. No Ray."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from engram_ray.assignment import (MAX_GENERATION_CHARS, create_store_dir, generation_id,
                                   generation_store_dir, make_assignments, remove_store_dir)
from engram_ray.config import DeploymentConfig
from engram_ray.deploy import limit_groups
from engram_ray.grouping import (NODE_ID_LABEL_KEY, NodeSlots, PlacementError,
                                 check_has_groups, domains_of, form_peer_groups)
from engram_ray.layout import EngramLayout
from engram_ray.member import GroupMember, NotServingError
from engram_ray.plan import rows_per_rank
from engram_ray.reference import lookup_reference
from engram_ray.synthetic import synthetic_rows

KEY = "engram.io/nvlink-domain"
TINY = EngramLayout(layer_ids=(1, 3), vocab_size=1000, max_ngram_size=3, n_heads=2,
                    head_dim=32, compressed_vocab_size=500, pad_token_id=2)

# The acceptance cluster: domain A = two nodes x 2 GPUs, domain B = one node x 2 GPUs.
CLUSTER = [NodeSlots("a1", "A", 2), NodeSlots("a2", "A", 2), NodeSlots("b1", "B", 2)]


def _plan(nodes, size):
    return form_peer_groups(domains_of(nodes, KEY), size)


def test_domains_join_nodes_by_label():
    domains = domains_of(CLUSTER, KEY)
    assert [(d.domain_id, d.node_ids, d.num_slots) for d in domains] == [
        ("A", ("a1", "a2"), 4), ("B", ("b1",), 2)]
    assert domains[0].selector == {KEY: "A"} and not domains[0].is_single_host
    assert domains[1].is_single_host


def test_groups_of_two_use_every_gpu():
    plan = _plan(CLUSTER, 2)
    assert [(g.group_id, g.domain.domain_id) for g in plan.groups] == [
        ("A-g0", "A"), ("A-g1", "A"), ("B-g0", "B")]
    assert plan.unused == ()


def test_groups_of_four_report_the_domain_that_cannot_form_one():
    plan = _plan(CLUSTER, 4)
    assert [g.group_id for g in plan.groups] == ["A-g0"]
    (unused,) = plan.unused
    assert (unused.domain_id, unused.num_slots) == ("B", 2)
    assert "unable to form a peer group" in unused.reason


def test_leftover_gpus_are_reported_not_used():
    plan = _plan([NodeSlots("n1", "D", 8), NodeSlots("n2", "D", 2)], 4)
    assert len(plan.groups) == 2
    (unused,) = plan.unused
    assert unused.num_slots == 2 and "left over after 2 group(s) of 4" in unused.reason


def test_groups_of_eight_fail_naming_every_domain():
    plan = _plan(CLUSTER, 8)
    assert plan.groups == ()
    with pytest.raises(PlacementError) as info:
        check_has_groups(plan)
    message = str(info.value)
    assert "A: 4 free slot(s) on 2 node(s)" in message and "B: 2 free slot(s)" in message
    assert "peer_group_size=8" in message


def test_unlabelled_and_none_nodes_are_isolated():
    nodes = [NodeSlots("n1", None, 4), NodeSlots("n2", "none", 2)]
    plan = _plan(nodes, 2)
    assert plan.groups == ()
    assert all("cannot be peers" in u.reason for u in plan.unused)
    singles = _plan(nodes, 1)  # groups of one need no NVLink
    assert len(singles.groups) == 6
    assert singles.groups[0].domain.selector == {NODE_ID_LABEL_KEY: "n1"}


def test_cpu_engines_make_every_node_a_domain():
    domains = domains_of(CLUSTER, KEY, node_is_domain=True)
    assert len(domains) == 3 and all(d.is_single_host for d in domains)
    assert {tuple(d.selector) for d in domains} == {(NODE_ID_LABEL_KEY,)}


def test_max_peer_groups_reports_the_groups_not_started():
    plan = limit_groups(_plan(CLUSTER, 2), 1)
    assert [g.group_id for g in plan.groups] == ["A-g0"]
    assert sorted((u.domain_id, u.num_slots) for u in plan.unused) == [("A", 2), ("B", 2)]


def test_generation_ids_are_valid_unique_and_bounded():
    gens = {generation_id("engram", f"mnnvl-{'ab' * 16}-32766-g{i}", 1, "c0ffee") for i in (0, 1)}
    assert len(gens) == 2
    for gen in gens:
        assert len(gen) <= MAX_GENERATION_CHARS and gen.endswith(".1.c0ffee")
    assert generation_id("t", "A-g0", 3, "abc123") == "t-A-g0.3.abc123"


def test_assignments_cover_every_row_once():
    assignments = make_assignments(TINY, "A-g0", 3, "t-A-g0.1.x", 1, "/s")
    assert [a.rank for a in assignments] == [0, 1, 2]
    for idx, (layer_id, rows) in enumerate(zip(TINY.layer_ids, TINY.rows_per_table)):
        slices = [a.slices[idx] for a in assignments]
        assert all(s.layer_id == layer_id for s in slices)
        assert slices[0].start == 0 and slices[-1].end == rows
        assert all(a.end == b.start for a, b in zip(slices, slices[1:]))
        assert slices[0].end - slices[0].start == rows_per_rank(rows, 3)
    spec = assignments[2].peer_group_spec(timeout_s=5)
    assert (spec.size, spec.rank, spec.generation) == (3, 2, "t-A-g0.1.x")
    assert spec.handle_type is None
    assert assignments[2].peer_group_spec(5, "posix_fd").handle_type == "posix_fd"


def test_store_dirs_are_private_and_never_reused(tmp_path):
    path = generation_store_dir(str(tmp_path / "store"), "t", "A-g0", "t-A-g0.1.x")
    create_store_dir(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    with pytest.raises(FileExistsError):
        create_store_dir(path)
    remove_store_dir(path)
    assert not os.path.exists(path)


def test_member_serves_only_a_built_generation(tmp_path):
    config = DeploymentConfig(model="unused", table_backend="shm", seed=3,
                              peer_group_store=str(tmp_path), rendezvous_timeout_s=10)
    member = GroupMember(TINY, config)
    ids = torch.tensor([[0, -1, TINY.rows_per_table[0] - 1]], dtype=torch.int64)
    with pytest.raises(NotServingError, match="idle"):
        member.lookup(1, ids)
    (assignment,) = make_assignments(TINY, "A-g0", 1, "t-A-g0.1.m", 1,
                                     create_store_dir(str(tmp_path / "gen1")))
    report = member.build(assignment)
    assert member.is_healthy and report["owned_bytes"] == TINY.table_bytes[0] + TINY.table_bytes[1]
    table = synthetic_rows(0, TINY.rows_per_table[0], TINY.head_dim, 3)
    assert torch.equal(member.lookup(1, ids), lookup_reference(table, ids, TINY.head_dim))
    member.drop("restart")
    assert member.health()["state"] == "idle"
    with pytest.raises(NotServingError, match="restart"):
        member.lookup(1, ids)
    member.stop("coordinator died")
    with pytest.raises(NotServingError, match="stopped"):
        member.build(assignment)

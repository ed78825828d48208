"""The peer group's one rendezvous (FileStore): agreement, timeouts, store safety.

Members run as threads of this process here (each with its own FileStore, as separate
processes have); `test_peer_shm.py` runs whole groups as processes.
"""

import os
import stat
import threading
import time

import pytest

from engram_ray.model.layout import EngramLayout
from engram_ray.tables.rendezvous import STORE_FILE, Rendezvous, RendezvousError
from engram_ray.tables.settings import PeerGroupSettings
from engram_ray.tables.table import open_group_tables

TINY = EngramLayout(layer_ids=(1, 3), vocab_size=1000, max_ngram_size=3, n_heads=2,
                    head_dim=64, compressed_vocab_size=100, pad_token_id=0)


def meet(store_dir, size, records, generation="g1", timeout_s=5.0, ranks=None):
    """Run ranks' gather+finish in threads; {rank: records or the exception}."""
    outcome = {}

    def member(rank):
        try:
            rdv = Rendezvous(str(store_dir), generation, size, rank, timeout_s)
            got = rdv.gather(records[rank])
            rdv.finish()
            outcome[rank] = got
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome[rank] = exc

    threads = [threading.Thread(target=member, args=(r,)) for r in (ranks or range(size))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcome


def test_members_gather_everyones_record_in_rank_order(tmp_path):
    records = [{"fingerprint": "f", "pid": 100 + r} for r in range(4)]
    outcome = meet(tmp_path / "store", 4, records)
    for rank in range(4):
        assert [r["pid"] for r in outcome[rank]] == [100, 101, 102, 103]
        assert [r["rank"] for r in outcome[rank]] == [0, 1, 2, 3]
        assert all(r["generation"] == "g1" and r["size"] == 4 for r in outcome[rank])
    assert stat.S_IMODE(os.stat(tmp_path / "store").st_mode) == 0o700
    assert not (tmp_path / "store" / STORE_FILE).exists()  # the last member removed it


def test_store_file_is_private_while_in_use(tmp_path):
    rdv = Rendezvous(str(tmp_path / "store"), "g1", 2, 0, 1.0)
    assert stat.S_IMODE(os.stat(tmp_path / "store" / STORE_FILE).st_mode) == 0o600
    rdv.close()


def test_missing_member_is_named_within_the_timeout(tmp_path):
    outcome = meet(tmp_path / "store", 3, [{"fingerprint": "f"}] * 3, timeout_s=1.0,
                   ranks=[0, 2])
    for rank in (0, 2):
        assert isinstance(outcome[rank], RendezvousError)
        assert "ranks [1] of 3 did not publish its record within 1 s" in str(outcome[rank])
        assert "(arrived: [0, 2])" in str(outcome[rank])


def test_mismatched_layout_is_refused_by_everyone(tmp_path):
    records = [{"fingerprint": "aaaa"}, {"fingerprint": "bbbb"}]
    outcome = meet(tmp_path / "store", 2, records)
    for rank in (0, 1):
        assert isinstance(outcome[rank], RendezvousError)
        assert "layout (table sizes and row format)" in str(outcome[rank])


def test_mismatched_layout_through_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGRAM_RAY_SHM_DIR", str(tmp_path))
    other = EngramLayout(layer_ids=(1, 3), vocab_size=2000, max_ngram_size=3, n_heads=2,
                         head_dim=64, compressed_vocab_size=100, pad_token_id=0)
    outcome = {}

    def member(rank, layout):
        spec = PeerGroupSettings(size=2, rank=rank, store_dir=str(tmp_path / "store"),
                             generation="g1", timeout_s=10)
        try:
            outcome[rank] = open_group_tables(layout, spec)
        except Exception as exc:  # noqa: BLE001
            outcome[rank] = exc

    threads = [threading.Thread(target=member, args=(0, TINY)),
               threading.Thread(target=member, args=(1, other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(outcome[r], RendezvousError) for r in (0, 1)), outcome
    assert [p for p in os.listdir(tmp_path) if p.startswith("engram-ray-")] == []


def test_mismatched_group_size_is_refused(tmp_path):
    outcome = {}

    def member(rank, size):
        try:
            rdv = Rendezvous(str(tmp_path / "store"), "g1", size, rank, 2.0)
            outcome[rank] = rdv.gather({"fingerprint": "f"})
        except Exception as exc:  # noqa: BLE001
            outcome[rank] = exc

    threads = [threading.Thread(target=member, args=(0, 2)),
               threading.Thread(target=member, args=(1, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert isinstance(outcome[0], RendezvousError) and "group size" in str(outcome[0])


def test_store_dir_open_to_others_is_refused(tmp_path):
    store = tmp_path / "store"
    store.mkdir(mode=0o755)
    os.chmod(store, 0o755)
    with pytest.raises(RendezvousError, match="has mode 0755, expected 0700"):
        Rendezvous(str(store), "g1", 2, 0, 1.0)


def test_store_file_open_to_others_is_refused(tmp_path):
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    (store / STORE_FILE).write_bytes(b"")
    os.chmod(store / STORE_FILE, 0o644)
    with pytest.raises(RendezvousError, match="has mode 0644, expected 0600"):
        Rendezvous(str(store), "g1", 2, 0, 1.0)


def test_store_of_another_generation_is_never_joined(tmp_path):
    store = tmp_path / "store"
    stale = Rendezvous(str(store), "old-gen", 2, 0, 1.0)  # its members never finished
    with pytest.raises(RendezvousError, match="belongs to generation 'old-gen', not 'new-gen'"):
        Rendezvous(str(store), "new-gen", 2, 1, 1.0)
    stale.close()


def test_same_rank_twice_is_refused(tmp_path):
    first = Rendezvous(str(tmp_path / "store"), "g1", 2, 0, 1.0)
    first._store.set("member/0", "{}")  # rank 0 already published
    second = Rendezvous(str(tmp_path / "store"), "g1", 2, 0, 1.0)
    with pytest.raises(RendezvousError, match="rank 0 of generation 'g1' was already published"):
        second.gather({"fingerprint": "f"})


def test_late_arrival_still_leaves_the_mapping_barrier_its_own_timeout(tmp_path):
    """The last barrier (peers mapped) gets its own timeout_s: a member that arrives just
    inside the first timeout must not make the early ones fail at the second barrier."""
    outcome = {}

    def member(rank, delay_s, map_s):
        time.sleep(delay_s)
        try:
            rdv = Rendezvous(str(tmp_path / "store"), "g1", 2, rank, 1.0)
            rdv.gather({"fingerprint": "f"})
            time.sleep(map_s)  # mapping the peers' slices
            rdv.finish()
            outcome[rank] = "ok"
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome[rank] = exc

    threads = [threading.Thread(target=member, args=(0, 0.0, 0.0)),
               threading.Thread(target=member, args=(1, 0.6, 0.6))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcome == {0: "ok", 1: "ok"}, outcome


def test_failed_member_stops_the_others_at_once(tmp_path):
    """A member's `fail` reaches the waiting ones through `count/error`, long before their
    timeout, with its rank and reason."""
    store = tmp_path / "store"
    failing = Rendezvous(str(store), "g1", 3, 1, 30.0)
    failing.fail("ValueError: no memory")
    start = time.monotonic()
    outcome = meet(store, 3, [{"fingerprint": "f"}] * 3, timeout_s=30.0, ranks=[0, 2])
    failing.close()
    assert time.monotonic() - start < 10
    for rank in (0, 2):
        assert isinstance(outcome[rank], RendezvousError), outcome
        assert "peer group 'g1': rank 1 failed: ValueError: no memory" in str(outcome[rank])


def test_two_members_given_one_rank_at_once_one_is_refused(tmp_path):
    """Both claim `member/0` in the same instant: compare_set lets exactly one in."""
    outcome, ready = {}, threading.Barrier(2)

    def member(idx):
        rdv = Rendezvous(str(tmp_path / "store"), "g1", 2, 0, 1.0)
        ready.wait()
        try:
            outcome[idx] = rdv.gather({"fingerprint": "f", "member": idx})
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome[idx] = exc

    threads = [threading.Thread(target=member, args=(idx,)) for idx in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    messages = sorted(str(outcome[idx]) for idx in (0, 1))
    assert all(isinstance(outcome[idx], RendezvousError) for idx in (0, 1)), outcome
    assert sum("rank 0 of generation 'g1' was already published" in m for m in messages) == 1
    assert sum("ranks [1] of 2 did not publish its record within 1 s" in m
               for m in messages) == 1


def test_missing_member_at_the_mapping_barrier_is_named(tmp_path):
    outcome = {}

    def member(rank):
        try:
            rdv = Rendezvous(str(tmp_path / "store"), "g1", 2, rank, 1.0)
            rdv.gather({"fingerprint": "f"})
            if rank == 0:  # rank 1 never maps its peers' slices
                rdv.finish()
            outcome[rank] = "ok"
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome[rank] = exc

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcome[1] == "ok"
    assert isinstance(outcome[0], RendezvousError), outcome
    assert ("ranks [1] of 2 did not map its peers' slices within 1 s (arrived: [0])"
            in str(outcome[0]))


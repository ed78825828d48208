"""Slice holders on the shm backend, with real processes: a member killed with SIGKILL while its
peer reads its rows, then restarted, re-attaching every slice from the holders (which run here,
as in a Serve replica); the peer's reads stay bitwise equal to the reference throughout, and
nothing is left in the shared-memory folder once the holders close."""

import os
import stat

import pytest
import torch

from engram_ray.model.layout import EngramLayout
from engram_ray.tables.local_group import Members, kill_and_restart, serve_member, wait_ready
from engram_ray.tables.settings import PeerGroupSettings
from engram_ray.tables.slice_holder import (SliceHolder, SliceHolderError, deposit, fetch,
                                            holder_path, sampled_digest)
from engram_ray.tables.table import open_group_tables

TINY = EngramLayout(layer_ids=(1, 3), vocab_size=1000, max_ngram_size=3, n_heads=2,
                    head_dim=64, compressed_vocab_size=100, pad_token_id=0)
GENERATION = "holders-1"


@pytest.fixture
def store(tmp_path):
    path = tmp_path / ("deep-store-folder-" * 6)  # past AF_UNIX's 107 bytes with the name
    path.mkdir(mode=0o700)
    return str(path)


def test_a_killed_member_restarts_from_the_holders_while_its_peer_reads_on(tmp_path, shm_dir,
                                                                         store):
    control = tmp_path / "control"
    control.mkdir()
    holders = [SliceHolder(store, GENERATION, rank) for rank in range(2)]
    assert stat.S_IMODE(os.stat(holders[0].path).st_mode) == 0o600
    members = Members(serve_member, (TINY, 2, store, GENERATION, str(control)),
                      env={"ENGRAM_RAY_SHM_DIR": str(shm_dir)})
    try:
        victim = members.start(0, key=0)
        members.start(1, key=1)
        wait_ready(str(control), 0)
        wait_ready(str(control), 1)
        assert all(h.is_full for h in holders)
        assert os.listdir(shm_dir) == []  # unlinked at the rendezvous: held by descriptors
        # rank 1 keeps reading rank 0's rows from the dead process's memory, then rank 0
        # restarts from the holders
        results = kill_and_restart(members, victim, 0, str(control), read_after_kill_s=1.0,
                                   timeout_s=120)
    finally:
        for holder in holders:
            holder.close()
    killed, survivor, restarted = results
    assert not killed.is_ok  # SIGKILL: no result
    for result in (survivor, restarted):
        assert result.is_ok, result.value
        assert result.value["equal_rounds"] == result.value["rounds"] > 0, result.value
    assert survivor.value["rounds_after_kill"] > 0 and not survivor.value["reattached"]
    assert restarted.value["reattached"]
    assert restarted.value["stats"]["rendezvous_seconds"] == 0.0
    assert not os.path.exists(holders[0].path)
    assert os.listdir(shm_dir) == []


def test_a_slice_changed_since_fill_is_refused_at_reattach(tmp_path, shm_dir, store):
    holder = SliceHolder(store, GENERATION, 0)
    settings = PeerGroupSettings(size=1, rank=0, store_dir=store, generation=GENERATION,
                                 holders=True)
    try:
        first = open_group_tables(TINY, settings)
        assert first.reattach_seconds is None and holder.is_full
        again = open_group_tables(TINY, settings)  # the holder has them: re-attached
        assert again.reattach_seconds is not None
        assert torch.equal(again.tables[3].local, first.tables[3].local)
        again.close()
        first.tables[3].local[0, 0] ^= 0xFF  # what a stray write would do
        with pytest.raises(SliceHolderError, match="slice of table 3 does not match"):
            open_group_tables(TINY, settings)
        first.close()
    finally:
        holder.close()
    assert os.listdir(shm_dir) == []


def test_holders_refuse_what_is_not_theirs(tmp_path, store):
    holder = SliceHolder(store, GENERATION, 1)
    path = holder_path(store, 1)
    data = tmp_path / "slice"
    data.write_bytes(bytes(64))
    fd = os.open(data, os.O_RDONLY)
    meta = [{"key": 1, "shape": [1, 64], "nbytes": 64, "digest": "x", "kind": "shm"}]
    try:
        assert fetch(path, GENERATION) == ([], [])  # first start: nothing held
        with pytest.raises(SliceHolderError, match="asked for 'other'"):
            fetch(path, "other")
        with pytest.raises(SliceHolderError, match="rank 0 deposited at the holder of rank 1"):
            deposit(path, GENERATION, 0, meta, [fd])
        with pytest.raises(SliceHolderError, match="1 slices came with 2 descriptors"):
            deposit(path, GENERATION, 1, meta, [fd, fd])
        deposit(path, GENERATION, 1, meta, [fd])
        with pytest.raises(SliceHolderError, match="deposited its slices twice"):
            deposit(path, GENERATION, 1, meta, [fd])
        slices, fds = fetch(path, GENERATION)
        assert slices == meta and len(fds) == 1 and os.fstat(fds[0]).st_size == 64
        os.close(fds[0])
        with pytest.raises(SliceHolderError, match="cannot listen"):
            SliceHolder(store, GENERATION, 1)  # one holder per rank and generation
    finally:
        os.close(fd)
        holder.close()
    with pytest.raises(SliceHolderError, match="its replica is gone"):
        fetch(path, GENERATION)
    os.chmod(store, 0o755)
    with pytest.raises(SliceHolderError, match="has mode 0755, expected 0700"):
        SliceHolder(store, GENERATION, 0)


def test_sampled_digest_sees_shape_and_rows():
    torch.set_default_dtype(torch.bfloat16)  # as vLLM builds models (bf16 would round picks)
    try:
        big = (torch.arange(4151 * 66, dtype=torch.int64) % 251).to(torch.uint8).view(4151, 66)
        assert sampled_digest(big) == sampled_digest(big.clone())
        last = big.clone()
        last[4150, 0] += 1  # the last row is sampled whatever the default dtype
        assert sampled_digest(last) != sampled_digest(big)
    finally:
        torch.set_default_dtype(torch.float32)
    rows = torch.arange(70 * 66, dtype=torch.int64).to(torch.uint8).view(70, 66)
    assert sampled_digest(rows) == sampled_digest(rows.clone())
    changed = rows.clone()
    changed[69, 3] += 1  # the last row is always sampled
    assert sampled_digest(changed) != sampled_digest(rows)
    assert sampled_digest(rows[:69]) != sampled_digest(rows)


def test_a_holder_answers_only_callers_with_its_generations_token(tmp_path, store):
    """A process of the same user that finds the socket (another Ray job on the node) gets
    nothing without the token the coordinator gave the generation's members."""
    import secrets

    token = secrets.token_hex(16)
    holder = SliceHolder(store, GENERATION, 0, token)
    path = holder_path(store, 0)
    data = tmp_path / "slice"
    data.write_bytes(bytes(64))
    fd = os.open(data, os.O_RDONLY)
    meta = [{"key": 1, "shape": [1, 64], "nbytes": 64, "digest": "x", "kind": "shm"}]
    try:
        with pytest.raises(SliceHolderError, match="lacks the group's holder token"):
            deposit(path, GENERATION, 0, meta, [fd])
        deposit(path, GENERATION, 0, meta, [fd], token)
        for wrong in (None, secrets.token_hex(16)):
            with pytest.raises(SliceHolderError, match="not a member of generation"):
                fetch(path, GENERATION, wrong)
        slices, fds = fetch(path, GENERATION, token)
        assert slices == meta and len(fds) == 1
        os.close(fds[0])
    finally:
        os.close(fd)
        holder.close()


def test_a_generation_gives_its_members_a_token_no_status_shows(tmp_path):
    from engram_ray.model.layout import load_layout
    from engram_ray.planning.generations import GenerationBook
    from engram_ray.serve.settings.config import ServeAppConfig

    raw = {"deployment": {"model": "deepseek-v4.1-flash", "peer_group_size": 2,
                          "peer_group_store": str(tmp_path / "s"), "name": "tok",
                          "table_backend": "shm", "num_gpus_per_engine": 0},
           "serving": {"model_source": "m", "device": "cpu"}}
    config = ServeAppConfig.from_dict(raw, "test").deployment
    book = GenerationBook(config, load_layout(config.model), {"group-0": "a"})
    first, second = (book.join("group-0", "g", r, 2, f"m{r}") for r in range(2))
    assert len(first["holder_token"]) == 32 and first["holder_token"] == second["holder_token"]
    assert first["holder_token"] not in repr(book.status()) + str(os.listdir(first["store_dir"]))
    settings = PeerGroupSettings(size=2, store_dir=first["store_dir"], rank=0,
                                 generation=first["generation"],
                                 holder_token=first["holder_token"])
    assert PeerGroupSettings.from_additional_config(settings.to_additional_config()) == settings
    next_gang = book.join("group-0", "h", 0, 2, "n0")
    assert next_gang["holder_token"] != first["holder_token"]  # a new generation, a new token

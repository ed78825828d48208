"""Slice holders on the cuda backend (POSIX-FD exports of CUDA VMM slices): the process that
filled and exported a slice is killed with SIGKILL while another maps and reads it; the reader
keeps looking up that slice's rows bitwise equal to the reference for 10 s, and a new process
re-attaches the slice from its holder (a process with no CUDA context, like a Serve replica:
a fresh child of this pytest process, so that the check holds whatever tests ran before) and
reads the same bytes. One GPU: both readers map the slice of a group of one;
two GPUs: a group of two, its rank 0 killed and restarted while rank 1 reads on.
"""


import multiprocessing

import pytest
import torch

from engram_ray.model.layout import EngramLayout
from engram_ray.tables.local_group import Members, kill_and_restart, serve_member, wait_ready
from engram_ray.tables.slice_holder import SliceHolder

# ~20K-row buckets: ~0.49M rows per table (122 MiB)
SMALL = EngramLayout(layer_ids=(1, 14), vocab_size=20_000, max_ngram_size=4, n_heads=8,
                     head_dim=256, compressed_vocab_size=1000, pad_token_id=2)
READ_AFTER_KILL_S = 10.5


def _kill_read_restart(tmp_path, size: int) -> list:
    store, control = tmp_path / "store", tmp_path / "control"
    store.mkdir(mode=0o700)
    control.mkdir()
    generation = f"failover-{size}"
    holders = [SliceHolder(str(store), generation, rank) for rank in range(size)]
    members = Members(serve_member, (SMALL, size, str(store), generation, str(control), "cuda",
                                     "cuda", 3, 64, 120.0), start_method="spawn")
    try:
        victim = members.start(0, key=0)
        for rank in range(1, size):
            members.start(rank, key=rank)
        wait_ready(str(control), 0)
        if size == 1:  # the reader: a second process mapping rank 0's slice from its holder
            members.start(0, key=1)
            wait_ready(str(control), 0, count=2)
        for rank in range(1, size):
            wait_ready(str(control), rank)
        results = kill_and_restart(members, victim, 0, str(control), READ_AFTER_KILL_S)
    finally:
        for holder in holders:
            holder.close()
    return results, torch.cuda.is_initialized()


def _holders_child(conn, tmp_path, size: int) -> None:
    try:
        conn.send(("ok", *_kill_read_restart(tmp_path, size)))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        conn.send(("error", f"{type(exc).__name__}: {exc}", None))


def _kill_read_restart_without_cuda(tmp_path, size: int) -> list:
    """`_kill_read_restart` in a fresh process (spawned: no CUDA context inherited, whatever
    this pytest process initialized); its results, and it asserts that holding the slices
    never initialized CUDA there."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_holders_child, args=(child, tmp_path, size))
    proc.start()
    child.close()
    try:
        status, results, cuda_initialized = parent.recv()
    finally:
        proc.join(60)
    assert status == "ok", results
    assert not cuda_initialized  # the holders need no CUDA context
    return results


def _check(results) -> None:
    killed, reader, restarted = results
    print({"reader": {k: v for k, v in reader.value.items() if k != "stats"}
           if reader.is_ok else reader.value,
           "restarted": {k: v for k, v in restarted.value.items() if k != "stats"}
           if restarted.is_ok else restarted.value})
    assert not killed.is_ok
    for result in (reader, restarted):
        assert result.is_ok, result.value
        assert result.value["equal_rounds"] == result.value["rounds"] > 0, result.value
        assert result.value["stats"]["handle_type"] == "posix_fd"
    assert reader.value["seconds_read_after_kill"] >= 10.0, reader.value
    assert restarted.value["reattached"] and restarted.value["stats"]["rendezvous_seconds"] == 0
    # Peers' slices are mapped read-only where the driver allows it (the line says which).
    print("peer_access", restarted.value["stats"]["peer_access"])
    assert restarted.value["stats"]["peer_access"] in ("read", "") or \
        restarted.value["stats"]["peer_access"].startswith("readwrite (read-only refused")


@pytest.mark.gpu
def test_one_gpu_slice_outlives_its_exporter_and_is_reattached(tmp_path):
    _check(_kill_read_restart_without_cuda(tmp_path, 1))


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_two_gpus_member_killed_and_restarted_while_its_peer_reads(tmp_path):
    _check(_kill_read_restart_without_cuda(tmp_path, 2))

"""vLLM's shared-memory ring buffers (/dev/shm/psm_*) outlive an engine that is killed or not
shut down: a replica records the segments its process tree maps, and they are removed once no
live process uses them (never before). Real processes and real POSIX shared memory."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from engram_ray.private_dirs import UnsafeFolderError
from engram_ray.serve.member import engine_shm

# A child that maps a segment the way vLLM's executor does (multiprocessing.shared_memory),
# untracked, so only engram-ray can remove it; it prints the path and waits to be killed.
CHILD = textwrap.dedent("""
    import sys, time
    from multiprocessing import resource_tracker, shared_memory
    segment = shared_memory.SharedMemory(create=True, size=1 << 20)
    resource_tracker.unregister(segment._name, "shared_memory")
    print("/dev/shm/" + segment.name, flush=True)
    time.sleep(600)
""")


@pytest.fixture
def child(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_shm, "RECORDS", tmp_path / "records")
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    path = proc.stdout.readline().strip()
    yield proc, path
    proc.kill()
    proc.wait()
    proc.stdout.close()
    if os.path.exists(path):
        os.unlink(path)


def test_segments_of_a_process_tree_are_found_recorded_and_released_once_unused(child):
    proc, path = child
    assert path.startswith("/dev/shm/psm_") and os.path.exists(path)
    assert path in engine_shm.mapped_segments()  # the child is below this process
    assert path in engine_shm.mapped_segments(proc.pid)
    assert proc.pid in engine_shm.descendants(os.getpid())
    record = engine_shm.record_segments("replica-1")
    assert path in record.read_text()
    assert engine_shm.release_recorded("replica-1") == [path]  # mapped by the live child
    assert os.path.exists(path) and record.exists()
    proc.send_signal(signal.SIGKILL)  # an engine killed with its replica: nothing cleans up
    proc.wait()
    assert os.path.exists(path)
    engine_shm.record_segments("replica-1")  # recorded again: what it knew stays
    assert path in record.read_text()
    assert engine_shm.release_recorded() == []
    assert not os.path.exists(path) and not record.exists()


def test_an_engine_that_dies_while_it_starts_leaves_its_segments_recorded(tmp_path,
                                                                         monkeypatch):
    """The replica records while the engine starts (`recording_segments`, from a thread: the
    start blocks the replica's event loop): the segment of an engine process that made it and
    was killed before the engine served is recorded, and released by the next start or stop
    on the node."""
    import time

    monkeypatch.setattr(engine_shm, "RECORDS", tmp_path / "records")
    with engine_shm.recording_segments("replica-2", period_s=0.1):
        proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                                text=True)
        path = proc.stdout.readline().strip()
        time.sleep(0.5)  # the engine loads, blocking (a few record periods)
        proc.kill()  # a worker dies: the engine's start fails, nothing cleans up
        proc.wait()
        proc.stdout.close()
    try:
        assert os.path.exists(path)
        assert path in json.loads((engine_shm.RECORDS / "replica-2.json").read_text())
        assert engine_shm.release_recorded() == []
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_an_unreadable_record_is_dropped_and_segments_of_others_stay(child, tmp_path):
    proc, path = child
    engine_shm.RECORDS.mkdir(mode=0o700)
    (engine_shm.RECORDS / "half-written.json").write_text("[\"/dev/shm/psm_")
    assert engine_shm.release_recorded() == []
    assert not list(engine_shm.RECORDS.iterdir())
    assert os.path.exists(path)  # never recorded: not engram-ray's to remove


def test_only_own_psm_segments_in_dev_shm_are_ever_unlinked(child, tmp_path):
    """A record is a list of names: whatever it names, only this user's /dev/shm/psm_* files
    go (a planted record must not make the Ray user delete its files)."""
    proc, path = child
    proc.kill()
    proc.wait()
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    link = "/dev/shm/psm_%s" % os.urandom(4).hex()
    os.symlink(victim, link)
    try:
        names = [str(victim), "/dev/shm/psm_../../" + str(victim), "/dev/shm/other", link,
                 path, 7]
        assert [engine_shm.is_own_segment(n) for n in names] == [False] * 4 + [True, False]
        record = engine_shm.record_segments("replica-2", proc.pid)  # makes the private folder
        record.write_text(json.dumps(names))
        assert engine_shm.release_recorded() == []
        assert victim.read_text() == "keep me" and os.path.islink(link)
        assert not os.path.exists(path)
    finally:
        os.unlink(link)


def test_an_open_records_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_shm, "RECORDS", tmp_path / "records")
    (tmp_path / "records").mkdir()
    os.chmod(tmp_path / "records", 0o777)
    with pytest.raises(UnsafeFolderError, match="has mode 0777, expected 0700"):
        engine_shm.release_recorded()
    with pytest.raises(UnsafeFolderError, match="has mode 0777"):
        engine_shm.record_segments("replica-3")


def test_semaphores_of_killed_processes_go_and_live_ones_stay():
    """A process killed with a multiprocessing semaphore leaves /dev/shm/sem.mp-*; those a
    live process created (this one, a child: each maps it only under glibc's deleted temporary
    name, so only its inode tells) are in use and stay."""
    import _multiprocessing
    import secrets

    def name() -> str:
        return "/mp-" + secrets.token_hex(4)

    leaked, live, opened = name(), name(), name()
    make = ("import _multiprocessing, os, signal, sys, time; "
            "s = _multiprocessing.SemLock(1, 1, 1, sys.argv[1], False); ")
    subprocess.run([sys.executable, "-c", make + "os.kill(os.getpid(), signal.SIGKILL)", leaked])
    own = _multiprocessing.SemLock(1, 1, 1, live, False)  # noqa: F841 - held while released
    holder = subprocess.Popen([sys.executable, "-c", make + "print(1, flush=True); "
                               "time.sleep(60)", opened], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"1"
        paths = {n: f"/dev/shm/sem.{n[1:]}" for n in (leaked, live, opened)}
        assert all(os.path.exists(p) for p in paths.values())
        removed = engine_shm.release_semaphores()
        assert paths[leaked] in removed
        assert not os.path.exists(paths[leaked])
        assert os.path.exists(paths[live]) and os.path.exists(paths[opened])
    finally:
        holder.kill()
        holder.wait()
        for n in (live, opened):
            try:
                _multiprocessing.sem_unlink(n)
            except FileNotFoundError:
                pass

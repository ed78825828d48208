"""vLLM's shared-memory ring buffers (/dev/shm/psm_*) outlive an engine that is killed or not
shut down: a replica records the segments its process tree maps, and they are removed once no
live process uses them (never before). Real processes and real POSIX shared memory."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from engram_ray.serve import engine_shm

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


def test_an_unreadable_record_is_dropped_and_segments_of_others_stay(child, tmp_path):
    proc, path = child
    engine_shm.RECORDS.mkdir(parents=True)
    (engine_shm.RECORDS / "half-written.json").write_text("[\"/dev/shm/psm_")
    assert engine_shm.release_recorded() == []
    assert not list(engine_shm.RECORDS.iterdir())
    assert os.path.exists(path)  # never recorded: not engram-ray's to remove

"""`engram-ray local` cleans what an interrupted run left, but never a live run's shared
memory: a second start with the same deployment name is refused, naming the process, and
removes nothing (no Ray needed: a plain process holds a slice)."""

import os
import subprocess
import sys
import textwrap

import pytest

from engram_ray.errors import EngramRayError
from engram_ray.local.deployment import LocalDeployment, LocalOptions
from engram_ray.serve.member.engine_shm import processes_using


@pytest.fixture
def local(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("ENGRAM_RAY_SHM_DIR", str(shm))
    deployment = LocalDeployment(LocalOptions(workdir=str(tmp_path / "work")))
    name = deployment.config.deployment.name
    store = os.path.join(deployment.config.deployment.peer_group_store, name)
    os.makedirs(store)
    slices = [shm / f"engram-ray-{name}-g0-r{rank}" for rank in range(2)]
    for path in slices:
        path.write_bytes(b"\0" * 4096)
    return deployment, slices, store


def _hold(path, how):
    """A process that maps (or only opens) `path` until killed; returns once it holds it."""
    code = textwrap.dedent(f"""
        import mmap, sys
        f = open({str(path)!r}, "r+b")
        m = mmap.mmap(f.fileno(), 0) if {how == "map"!r} else None
        if m is not None:
            f.close()
        print("holding", flush=True)
        sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


@pytest.mark.parametrize("how", ["map", "open"])
def test_a_live_runs_slices_are_refused_and_kept(local, how):
    deployment, slices, store = local
    holder = _hold(slices[1], how)
    try:
        assert processes_using([str(p) for p in slices]) == {holder.pid}
        with pytest.raises(EngramRayError, match=rf"is in use: process\(es\) \[{holder.pid}\]"
                                                 r".*Nothing was removed"):
            deployment.clean_stale()
        assert all(p.exists() for p in slices) and os.path.isdir(store)
    finally:
        holder.kill()
        holder.communicate()
    deployment.clean_stale()                        # the holder is gone: stale, removed
    assert not any(p.exists() for p in slices) and not os.path.exists(store)


def test_stopping_removes_its_own_slices_while_still_held(local):
    """stop() runs while this run's engine processes may still be exiting."""
    deployment, slices, store = local
    holder = _hold(slices[0], "map")
    try:
        deployment.clean_stale(refuse_live=False)
        assert not any(p.exists() for p in slices) and not os.path.exists(store)
    finally:
        holder.kill()
        holder.communicate()


def test_nothing_held_is_cleaned(local):
    deployment, slices, store = local
    assert processes_using([str(p) for p in slices]) == set()
    deployment.clean_stale()
    assert not any(p.exists() for p in slices) and not os.path.exists(store)

"""An engine process ends with its parent (`engram_ray.vllm.orphan_watch`): a multiprocessing
child whose parent is killed with SIGKILL exits within seconds; one whose parent lives keeps
running; a process that is no multiprocessing child starts no watch."""

import subprocess
import sys
import textwrap
import time

import psutil

MIDDLE = textwrap.dedent("""
    import multiprocessing, os, sys, time

    def engine(path):
        from engram_ray.vllm.orphan_watch import watch_parent
        assert watch_parent()
        open(path, "w").write(str(os.getpid()))
        time.sleep(120)

    if __name__ == "__main__":
        child = multiprocessing.get_context("spawn").Process(target=engine, args=(sys.argv[1],))
        child.start()
        time.sleep(120)
""")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_an_engine_process_ends_when_its_parent_is_killed(tmp_path):
    script, pid_file = tmp_path / "middle.py", tmp_path / "child.pid"
    script.write_text(MIDDLE)
    middle = subprocess.Popen([sys.executable, str(script), str(pid_file)])
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(pid_file.read_text())
        time.sleep(2.5)  # the parent lives: the child runs on
        assert not _gone(child)
        middle.kill()
        middle.wait()
        killed_at = time.monotonic()
        while not _gone(child) and time.monotonic() - killed_at < 15:
            time.sleep(0.1)
        assert _gone(child), "the orphaned engine process still runs"
        assert time.monotonic() - killed_at < 5  # one check period, then SIGTERM
    finally:
        middle.kill()
        if pid_file.exists() and pid_file.read_text() and not _gone(int(pid_file.read_text())):
            psutil.Process(int(pid_file.read_text())).kill()


def test_no_watch_outside_a_multiprocessing_child():
    from engram_ray.vllm.orphan_watch import watch_parent

    assert not watch_parent()  # pytest's process: no multiprocessing parent


def test_orphaned_engine_processes_are_ended_and_live_ones_kept():
    """An engine process whose replica died before vLLM loaded the plugin (its handshake) has
    no watch: `kill_orphaned_engines` ends it (reparented to init); one whose parent lives
    stays."""
    from engram_ray.vllm.orphan_watch import kill_orphaned_engines

    sleep = [sys.executable, "-c", "import time; time.sleep(120)", "VLLM::EngineCore"]
    kept = subprocess.Popen(sleep)  # our child: its parent (this process) lives
    launcher = subprocess.run(  # its child exits at once: the sleeper is reparented to init
        ["sh", "-c", '"$@" >/dev/null 2>&1 & echo $!', "sh", *sleep], capture_output=True,
        text=True, timeout=30)
    orphan = int(launcher.stdout.split()[0])
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(orphan).ppid() != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        if psutil.Process(orphan).ppid() != 1:
            import pytest
            pytest.skip("orphans are not reparented to init here (a subreaper)")
        assert orphan in kill_orphaned_engines()
        assert _gone(orphan) and not _gone(kept.pid)
    finally:
        kept.kill()
        kept.wait()
        if not _gone(orphan):
            psutil.Process(orphan).kill()

"""Shared memory of a replica's vLLM engine: the ring buffers (/dev/shm/psm_*, up to hundreds of
MiB each) that vLLM's executor and workers create. Ray Serve LLM does not shut the engine down
with its replica, and a killed engine cannot, so these files outlive the run. A replica records
the segments its engine maps while it starts (`recording_segments`) and once it runs
(`record_segments`), and releases them when it stops;
the local deployment releases every recorded segment when it starts and stops
(`release_recorded`). A segment that a live process still maps or holds open is never removed.

Records live in a private folder (`engram_ray.private_dirs`), and a record is still only a
list of names: a segment is unlinked only when it is one of this user's own regular files
directly in /dev/shm with a name Python's shared_memory makes (`is_own_segment`), whatever
path a record gives.

Semaphores: a killed engine process also leaves the POSIX semaphores of Python's
multiprocessing (/dev/shm/sem.mp-*, 32 bytes each; its resource tracker died with it).
`release_semaphores` unlinks those of this user that no live process maps. A process maps a
semaphore under its name, or (the one that created it: glibc makes it under a temporary name,
then links it) under a deleted temporary name, so users are found by inode, not by name.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import stat
import threading
import time
from pathlib import Path

from engram_ray.private_dirs import PROJECT_TMP, private_dir

RECORDS = Path(PROJECT_TMP, "engine-shm")
STARTING_RECORD_EVERY_S = 0.5  # while an engine starts (`recording_segments`)
# psm_ + token_hex (multiprocessing.shared_memory._make_filename): nothing else, no "/" or "..".
SEGMENT_NAME = re.compile(r"/dev/shm/psm_[0-9a-f]{8,32}")
# sem.mp- + 8 of [a-z0-9_] (multiprocessing.synchronize.SemLock._make_name, as glibc stores it)
SEMAPHORE_NAME = re.compile(r"/dev/shm/sem\.mp-[0-9a-z_]{8}")


def _mapped_path(line: str) -> str:
    """The file of one /proc/<pid>/maps line ('' for anonymous mappings)."""
    if line.count(" ") < 5:
        return ""
    return line.split(None, 5)[-1].rstrip("\n").removesuffix(" (deleted)")


def _users(paths: list[str]) -> dict[str, set[int]]:
    """Each of `paths` that a live process other than this one maps or holds open, with those
    processes' ids (one pass over /proc/<pid>/maps and /proc/<pid>/fd; processes this user may
    not inspect are skipped)."""
    wanted = {os.path.realpath(path): path for path in paths}
    users: dict[str, set[int]] = {}
    if not wanted:
        return users
    for proc in glob.glob("/proc/[0-9]*"):
        pid = int(os.path.basename(proc))
        if pid == os.getpid():
            continue
        try:
            with open(os.path.join(proc, "maps")) as maps:
                found = {wanted[m] for m in map(_mapped_path, maps) if m in wanted}
            for fd in os.listdir(os.path.join(proc, "fd")):
                target = os.readlink(os.path.join(proc, "fd", fd))
                if target in wanted:
                    found.add(wanted[target])
        except OSError:  # gone, or not ours to inspect
            continue
        for path in found:
            users.setdefault(path, set()).add(pid)
    return users


def mapped_shm_inodes() -> set[int] | None:
    """Inodes of every file in /dev/shm that a live process this user may inspect maps
    (this one included); None when /proc cannot be read."""
    shm_dev = os.stat("/dev/shm").st_dev
    major, minor = os.major(shm_dev), os.minor(shm_dev)
    inodes, seen_any = set(), False
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            with open(os.path.join(proc, "maps")) as maps:
                for line in maps:
                    fields = line.split(None, 5)
                    if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                        dev = fields[3].split(":")
                        if (int(dev[0], 16), int(dev[1], 16)) == (major, minor):
                            inodes.add(int(fields[4]))
            seen_any = True
        except (OSError, ValueError, IndexError):
            continue
    return inodes if seen_any else None


def release_semaphores() -> list[str]:
    """Unlink this user's multiprocessing semaphores (`SEMAPHORE_NAME`, regular files) that
    no live process maps (killed engines leave them); the names removed."""
    candidates = []
    for path in glob.glob("/dev/shm/sem.mp-*"):
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        if SEMAPHORE_NAME.fullmatch(path) and stat.S_ISREG(st.st_mode) \
                and st.st_uid == os.getuid():
            candidates.append((path, st.st_ino))
    mapped = mapped_shm_inodes() if candidates else set()
    if mapped is None:
        return []
    removed = []
    for path, inode in candidates:
        if inode not in mapped:
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


def processes_using(paths: list[str]) -> set[int]:
    """Ids of live processes other than this one that map or hold open any of `paths`."""
    return set().union(*_users(paths).values())


def descendants(pid: int) -> list[int]:
    """`pid` and every live process below it (parent links from /proc/<pid>/stat)."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as file:
                fields = file.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def is_own_segment(path) -> bool:
    """True for a segment engram-ray may remove: named as `SEGMENT_NAME`, a regular file (not a
    symlink) of this user."""
    if not isinstance(path, str) or not SEGMENT_NAME.fullmatch(path):
        return False
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def mapped_segments(pid: int | None = None) -> list[str]:
    """/dev/shm/psm_* files mapped by process `pid` (default: this one) or its descendants."""
    found: set[str] = set()
    for proc in descendants(pid or os.getpid()):
        try:
            with open(f"/proc/{proc}/maps") as maps:
                found.update(p for p in map(_mapped_path, maps) if SEGMENT_NAME.fullmatch(p))
        except OSError:
            continue
    return sorted(found)


def record_segments(owner: str, pid: int | None = None) -> Path:
    """Add the segments `pid`'s process tree maps now to RECORDS/<owner>.json (an engine
    creates some only once it serves, so a replica records again while it runs)."""
    record = Path(private_dir(RECORDS, "engine shared-memory records"), f"{owner}.json")
    try:
        known = set(json.loads(record.read_text()))
    except (OSError, ValueError):
        known = set()
    fresh = known | set(mapped_segments(pid))
    if fresh != known or not record.exists():
        partial = record.with_suffix(".part")
        partial.write_text(json.dumps(sorted(fresh)))
        os.replace(partial, record)
    return record


@contextlib.contextmanager
def recording_segments(owner: str, period_s: float = STARTING_RECORD_EVERY_S):
    """While the body runs (an engine starting), record the segments this process's tree maps
    every `period_s` (`record_segments`), from a thread: Ray Serve LLM makes the engine on the
    replica's event loop, blocking it. vLLM makes its ring buffers before the engine serves,
    and an engine that dies while it starts (a worker killed, a failed load) would otherwise
    leave them unrecorded, so that nothing ever released them."""
    done = threading.Event()

    def record() -> None:
        while True:
            record_segments(owner)
            if done.wait(period_s):
                return

    thread = threading.Thread(target=record, name="engram-shm-record", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def release_segments(paths: list[str]) -> list[str]:
    """Unlink those of `paths` that are this user's segments (`is_own_segment`) and no other
    live process uses; returns the ones kept (still in use). Other paths are left alone."""
    paths = [path for path in paths if is_own_segment(path)]
    in_use = _users(paths)
    for path in paths:
        if path not in in_use:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    return [path for path in paths if path in in_use]


def release_recorded(owner: str | None = None, wait_s: float = 0.0) -> list[str]:
    """Release the segments of every record (or `owner`'s); a record goes once none of its
    segments is in use. Segments still in use are retried for up to `wait_s` (engine
    processes exiting after a stop). Returns the segments kept."""
    deadline = time.monotonic() + wait_s
    while True:
        records = {}
        private_dir(RECORDS, "engine shared-memory records")
        for record in RECORDS.glob(f"{owner}.json" if owner else "*.json"):
            try:
                records[record] = [s for s in json.loads(record.read_text())
                                   if isinstance(s, str)]
            except (OSError, ValueError, TypeError):  # half-written by a killed replica
                records[record] = []
        kept = set(release_segments(sorted({s for segments in records.values()
                                            for s in segments})))
        for record, segments in records.items():
            if not kept.intersection(segments):
                record.unlink(missing_ok=True)
        if not kept or time.monotonic() >= deadline:
            return sorted(kept)
        time.sleep(0.5)


def release_leftovers(owner: str | None = None, wait_s: float = 0.0) -> list[str]:
    """Orphaned engine processes ended (`kill_orphaned_engines`), `release_recorded(owner,
    wait_s)`, then every unused semaphore (`release_semaphores`):
    what a replica runs when it starts and stops, so that what killed replicas and engines
    left on its node goes with the next one to start or stop there. Returns the segments
    kept."""
    from engram_ray.vllm.orphan_watch import kill_orphaned_engines

    kill_orphaned_engines()  # first: what they map is theirs until they are gone
    kept = release_recorded(owner, wait_s)
    release_semaphores()
    return kept

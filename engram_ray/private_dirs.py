"""Private folders: every folder the project makes is 0700 and this user's, and one it finds
in its place must be too.

A folder under a shared temporary directory (`/tmp/engram-ray/...`) can be made first by any
local user: made 0700 by someone else, or left open, it lets that user plant records the
project acts on (shared-memory segments to unlink, scrape targets, store files). So a folder
that is missing is created 0700 (parents too); one that exists must be a real directory (not a
symlink) of this user with no group or other access, else it is refused: nothing is chmod-ed
or chown-ed behind the operator's back.

    private_dir(path, what)        create or check `path`; under PROJECT_TMP every folder from
                                   PROJECT_TMP down is checked too
    check_private(path, what, ...) the check alone, for a folder or a file (mode 0600)
"""

from __future__ import annotations

import os
import stat
import tempfile

from engram_ray.errors import EngramRayError

# The project's own root in the shared temporary directory (engine-shm, model-targets, the
# local deployment's workdir).
PROJECT_TMP = os.path.join(tempfile.gettempdir(), "engram-ray")


def is_shared_tmp(path: str) -> bool:
    """True when `path` lies in the shared temporary directory (/tmp), where any local user
    can create folders."""
    tmp = os.path.realpath(tempfile.gettempdir())
    return os.path.realpath(path).startswith(tmp + os.sep)


class UnsafeFolderError(EngramRayError):
    """A folder or file the project writes exists but is not private to this user."""


def check_private(path: str, what: str, kind: str = "directory", mode: int = 0o700,
                  st: os.stat_result | None = None, error=UnsafeFolderError) -> None:
    """Refuse `path` (`kind` 'directory' or 'file') unless it is a real `kind` of this user
    with no group/other access; `st` an lstat/fstat already taken; `error` the exception class
    the caller's users know (raised with one message argument)."""
    st = st or os.stat(path, follow_symlinks=False)
    is_dir = stat.S_ISDIR(st.st_mode)
    if stat.S_ISLNK(st.st_mode) or is_dir != (kind == "directory") or (
            kind == "file" and not stat.S_ISREG(st.st_mode)):
        raise error(f"{what} {path} is not a plain {kind} (found {_file_kind(st)}), expected "
                    f"a {kind} made by engram-ray: remove it, or use another path")
    if st.st_uid != os.getuid():
        raise error(f"{what} {path} belongs to uid {st.st_uid}, not this user ({os.getuid()}); "
                    f"another user made it first: remove it (as that user or root), or use "
                    "another path; every process of one deployment runs as one user")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise error(f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}, expected "
                    f"{mode:04o} (only this user may read or plant files there): run "
                    f"`chmod {mode:o} {path}`, or use another path")


def private_dir(path: str, what: str, error=UnsafeFolderError, exist_ok: bool = True) -> str:
    """`path` as a private folder (created 0700 with missing parents, or checked); returns it.
    `exist_ok=False`: FileExistsError when `path` itself exists (a folder never reused).
    Inside PROJECT_TMP every folder from PROJECT_TMP down to `path` is created or checked the
    same way (whoever owns a parent can rename the folder away); elsewhere only `path` itself
    (its parents are the operator's choice: /mnt/shared, Ray's /tmp/ray)."""
    path = os.path.abspath(path)
    top = PROJECT_TMP if path == PROJECT_TMP or path.startswith(PROJECT_TMP + os.sep) else path
    todo = [path]
    while todo[-1] != top:
        todo.append(os.path.dirname(todo[-1]))
    os.makedirs(os.path.dirname(top), mode=0o700, exist_ok=True)
    for folder in reversed(todo):
        _make_or_check(folder, what, error, exist_ok or folder != path)
    return path


def _make_or_check(folder: str, what: str, error, exist_ok: bool) -> None:
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        if not exist_ok:
            raise
        check_private(folder, what, error=error)
        return
    os.chmod(folder, 0o700)  # mkdir's mode is masked by the umask (0277 would leave 0500)


def _file_kind(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "a symlink"
    return "a directory" if stat.S_ISDIR(st.st_mode) else "a file"

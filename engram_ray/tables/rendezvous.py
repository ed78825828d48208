"""The one startup rendezvous of a peer group, through a torch `FileStore`.

Each member publishes one record (rank, host, GPU uuid, pid, handle types, exported handles,
slice ranges, layout fingerprint, group size, generation), waits until all `size` members have
published, and checks that they agree. After the peers' slices are mapped, one barrier lets
every exporter know its handles were taken. Nothing is exchanged after that.

Store directory: created 0700, files 0600 (an exported handle is a key to GPU memory); a
directory readable by others is refused. The store holds the generation id that opened it;
a store left by another generation is never joined.

Keys: `generation`, `member/<rank>` (JSON record), `mapped/<rank>`, `error/<rank>` (a member
that failed says why, so the others fail at once instead of waiting out the timeout).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from datetime import timedelta

import torch.distributed as dist

from engram_ray.errors import EngramRayError
from engram_ray.private_dirs import check_private, private_dir

STORE_FILE = "rendezvous.filestore"
_POLL_START_S = 0.001
_POLL_MAX_S = 0.02


class RendezvousError(EngramRayError):
    """The peer group could not meet: a member missing, in disagreement, or an unsafe store."""


def prepare_store_dir(store_dir: str) -> str:
    """Create `store_dir` 0700 (or check an existing one) and the store file 0600; its path."""
    private_dir(store_dir, "peer_group_store directory", RendezvousError)
    path = os.path.join(store_dir, STORE_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        # It holds exported GPU memory handles: a key to every member's slice.
        check_private(path, "peer_group_store file", "file", 0o600, os.fstat(fd),
                      RendezvousError)
    finally:
        os.close(fd)
    return path


class Rendezvous:
    """One member's side of the group's meeting: `gather(record)`, then `finish()`."""

    def __init__(self, store_dir: str, generation: str, size: int, rank: int,
                 timeout_s: float):
        self.generation, self.size, self.rank = generation, size, rank
        self.timeout_s, self.store_dir = timeout_s, store_dir
        self._deadline = time.monotonic() + timeout_s
        self._path = prepare_store_dir(store_dir)
        self._store = dist.FileStore(self._path, size)
        self._store.set_timeout(timedelta(seconds=timeout_s))
        self._claim_generation()

    def _claim_generation(self) -> None:
        found = self._store.compare_set("generation", "", self.generation).decode()
        if found != self.generation:
            raise RendezvousError(
                f"peer_group_store {self.store_dir} belongs to generation {found!r}, not "
                f"{self.generation!r}: a store is never reused; the coordinator must give each "
                "generation a fresh directory")

    # --- the meeting ----------------------------------------------------------------------

    def gather(self, record: dict) -> list[dict]:
        """Publish this member's record; all `size` records by rank once they agree."""
        if self._store.check([f"member/{self.rank}"]):
            self.fail("rank published twice")
            raise RendezvousError(
                f"rank {self.rank} of generation {self.generation!r} was already published in "
                f"{self.store_dir}: two members were given the same rank")
        record = dict(record, rank=self.rank, size=self.size, generation=self.generation)
        self._store.set(f"member/{self.rank}", json.dumps(record))
        self._wait_all("member", "publish its record")
        records = [json.loads(self._store.get(f"member/{r}")) for r in range(self.size)]
        try:
            check_agreement(records, record)
        except RendezvousError as exc:
            self.fail(str(exc))
            raise
        return records

    def finish(self) -> None:
        """Barrier: every member has mapped its peers' slices. Releases the store."""
        self._store.set(f"mapped/{self.rank}", "1")
        # A fresh timeout: the first deadline may be all but spent waiting for a late member.
        self._deadline = time.monotonic() + self.timeout_s
        self._wait_all("mapped", "map its peers' slices")
        self.close()
        self._remove_store_file()

    def fail(self, reason: str) -> None:
        """Tell the other members why this one gives up (they stop waiting at once)."""
        if self._store is not None:
            self._store.set(f"error/{self.rank}", reason[:2000])

    def close(self) -> None:
        """Drop the store; the last of the `size` members to drop it deletes the file."""
        self._store = None

    def _remove_store_file(self) -> None:
        """NOTES: torch deletes the store file when the last of the `size` FileStore objects is
        destroyed; once, under CI load, a group of 4 left it behind. So each member also marks
        that its store is dropped (`left-<rank>`, after torch's destructor ran: none can open
        the file again), and a member that finds every mark removes the file and the marks."""
        marks = [os.path.join(self.store_dir, f"left-{r}") for r in range(self.size)]
        os.close(os.open(marks[self.rank], os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
        if all(os.path.exists(mark) for mark in marks):
            for path in (self._path, *marks):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def _wait_all(self, prefix: str, what: str) -> None:
        pending, pause = set(range(self.size)), _POLL_START_S
        while True:
            pending = {r for r in pending if not self._store.check([f"{prefix}/{r}"])}
            if not pending:
                return
            self._raise_peer_errors()
            if time.monotonic() > self._deadline:
                arrived = sorted(set(range(self.size)) - pending)
                raise RendezvousError(
                    f"peer group {self.generation!r}: ranks {sorted(pending)} of {self.size} did "
                    f"not {what} within {self.timeout_s:g} s (arrived: {arrived}); check that "
                    f"every member started with peer_group_store {self.store_dir}")
            time.sleep(pause)
            pause = min(_POLL_MAX_S, pause * 2)

    def _raise_peer_errors(self) -> None:
        for r in range(self.size):
            if r != self.rank and self._store.check([f"error/{r}"]):
                reason = self._store.get(f"error/{r}").decode()
                raise RendezvousError(f"peer group {self.generation!r}: rank {r} failed: {reason}")


def check_agreement(records: list[dict], own: dict) -> None:
    """Every record has the same layout fingerprint, group size and generation as `own`."""
    for field, what in (("generation", "generation id"), ("size", "group size"),
                        ("fingerprint", "layout (table sizes and row format)")):
        odd = [r["rank"] for r in records if r.get(field) != own.get(field)]
        if odd:
            theirs = records[odd[0]].get(field)
            raise RendezvousError(
                f"peer group {own['generation']!r}: ranks {odd} have {what} {theirs!r}, rank "
                f"{own['rank']} has {own.get(field)!r}: every member must load the same model "
                "config and group settings")
    ranks = [r["rank"] for r in records]
    if ranks != list(range(len(records))):
        raise RendezvousError(f"peer group {own['generation']!r}: records carry ranks {ranks}, "
                              f"expected 0..{len(records) - 1}")

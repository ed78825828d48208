"""The one startup rendezvous of a peer group, through a torch `FileStore`.

Each member publishes one record (rank, host, GPU uuid, pid, handle types, exported handles,
slice ranges, layout fingerprint, group size, generation), waits until all `size` members have
published, and checks that they agree. After the peers' slices are mapped, one barrier lets
every exporter know its handles were taken. Nothing is exchanged after that.

Store directory: created 0700, files 0600 (an exported handle is a key to GPU memory); a
directory readable by others is refused. The store holds the generation id that opened it;
a store left by another generation is never joined.

Keys: `generation`, `member/<rank>` (JSON record), `mapped/<rank>`, `error/<rank>` (a member
that failed says why, so the others fail at once instead of waiting out the timeout) and
`count/error` (how many did: `store.add` after the reason).

Cost after the last arrival: O(1) store operations per member per poll, O(P) in all. A waiting
member polls with one `check` of all P keys (one shared-lock read of the store file; torch looks
the P names up in its in-memory copy) and one `check` of `count/error`; the reasons are read
only when that count grew, the P records by one `multi_get`, and the ranks still missing one by
one only when a wait times out.

NOTES: polling every rank's key one `check` at a time (P store operations per poll, each
opening and locking the file, in every member) made the meeting grow as P^2: on 2 cores 0.17 s
at P=72 against 0.023 s at P=18; now 0.073 s and 0.025 s (`benchmarks/bench_rendezvous.py`).
`count/error` is read with `check` + `get`, never `add(key, 0)`: an add appends to the store
file, which every member then reads.
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
        self._num_errors_seen = 0  # `count/error` when this member last read the reasons
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
        record = dict(record, rank=self.rank, size=self.size, generation=self.generation)
        self._publish(json.dumps(record))
        self._wait_all("member", "publish its record")
        values = self._store.multi_get([f"member/{r}" for r in range(self.size)])
        records = [json.loads(value) for value in values]
        try:
            check_agreement(records, record)
        except RendezvousError as exc:
            self.fail(str(exc))
            raise
        return records

    def _publish(self, payload: str) -> None:
        """Claim `member/<rank>` with `payload` (compare_set: of two members given one rank,
        the second is refused, even when both arrive at once)."""
        found = self._store.compare_set(f"member/{self.rank}", "", payload).decode()
        if found != payload:
            self.fail("rank published twice")
            raise RendezvousError(
                f"rank {self.rank} of generation {self.generation!r} was already published in "
                f"{self.store_dir}: two members were given the same rank")

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
            self._store.add("count/error", 1)

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
        """Until every `<prefix>/<rank>` key is set: a peer's failure or the deadline raises."""
        keys, pause = [f"{prefix}/{r}" for r in range(self.size)], _POLL_START_S
        while not self._store.check(keys):
            self._raise_peer_errors()
            if time.monotonic() > self._deadline:
                self._raise_missing(keys, what)
            time.sleep(pause)
            pause = min(_POLL_MAX_S, pause * 2)

    def _raise_missing(self, keys: list[str], what: str) -> None:
        """Name the ranks whose key is missing: one read per rank, only once a wait timed out
        (none missing: the last key came in meanwhile, and the wait ends at its next poll)."""
        pending = {r for r, key in enumerate(keys) if not self._store.check([key])}
        if pending:
            arrived = sorted(set(range(self.size)) - pending)
            raise RendezvousError(
                f"peer group {self.generation!r}: ranks {sorted(pending)} of {self.size} did "
                f"not {what} within {self.timeout_s:g} s (arrived: {arrived}); check that "
                f"every member started with peer_group_store {self.store_dir}")

    def _raise_peer_errors(self) -> None:
        """The lowest other rank's reason, read only when `count/error` has grown."""
        num_errors = (int(self._store.get("count/error"))
                      if self._store.check(["count/error"]) else 0)
        if num_errors == self._num_errors_seen:
            return
        self._num_errors_seen = num_errors
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

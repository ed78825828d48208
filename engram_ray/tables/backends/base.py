"""The interface every peer memory backend implements.

A backend holds, for each table of a peer group, this rank's own slice (allocated here,
writable) and every peer's slice (mapped from the handle the peer exported). The life of one:

    mem = Backend(rank=r, size=P, device=..., tag=..., handle_type=None, cross_node=False)
    local = mem.allocate(key, num_rows, row_bytes)   # [num_rows, row_bytes] uint8, fill it
    fd = mem.holder_fd(key)                          # for this rank's holder (can_hold)
    record = mem.describe()                          # JSON: host, GPU, handle types, FABRIC
    ... rendezvous publishes `record` and gathers everyone's ...
    mem.map_peers(records)                           # checks; FABRIC handles imported
    mem.attach(rank, key, fd, shape, nbytes)         # each peer's slice from its holder
                                                     # (peers_from_holders)
    mem.after_rendezvous()                           # every peer has mapped ours
    mem.slices(key) / mem.peer_bases(key)            # what lookups read
    mem.close()                                      # unmap, release; idempotent

Descriptors travel between the members' processes through their holders' sockets
(`engram_ray.tables.slice_holder`, `engram_ray.tables.holding`), never by taking them from
another process: no engine is open to ptrace. A restarted engine's fresh backend maps every
rank's slice, its own included, from the holders (`attach`) instead of allocating and meeting
the group.
"""

from __future__ import annotations

import os
import socket
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: doctor imports this module without torch
    import torch

from engram_ray.errors import EngramRayError

DEFAULT_SHM_DIR = "/dev/shm"


def shm_dir() -> str:
    """Folder of the shm backend's slice files (here, not in `shm`: doctor reads it without
    torch)."""
    return os.environ.get("ENGRAM_RAY_SHM_DIR", DEFAULT_SHM_DIR)


class PeerMemoryError(EngramRayError):
    """A slice could not be allocated, exported, imported or mapped."""


def host_identity() -> dict:
    """Host name and boot id: two members share memory by file descriptor only on one host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return {"host": socket.gethostname(), "boot_id": boot_id, "pid": os.getpid()}


def same_host(a: dict, b: dict) -> bool:
    return a["host"] == b["host"] and a["boot_id"] == b["boot_id"]


class PeerMemory(ABC):
    """Slices of one peer group's tables, keyed by table (model layer id)."""

    name: str = ""

    def __init__(self, *, rank: int, size: int, device: str, tag: str):
        self.rank, self.size, self.device, self.tag = rank, size, device, tag
        self.is_closed = False

    @abstractmethod
    def allocate(self, key: int, num_rows: int, row_bytes: int) -> torch.Tensor:
        """This rank's slice of table `key`: `[num_rows, row_bytes]` uint8, to be filled."""

    @abstractmethod
    def describe(self) -> dict:
        """JSON-able record for the rendezvous: identity, handle types, exported handles."""

    @abstractmethod
    def map_peers(self, records: list[dict]) -> None:
        """Check the group's records (indexed by rank) and import what they carry (FABRIC
        handles); slices that come from holders are mapped by `attach` afterwards."""

    def after_rendezvous(self) -> None:
        """Every peer has mapped this rank's slices (nothing to do by default)."""

    @abstractmethod
    def slices(self, key: int) -> list[torch.Tensor]:
        """Every rank's slice of table `key`, by rank (own included), as tensors."""

    def peer_bases(self, key: int) -> torch.Tensor:
        """`[size]` int64 device addresses of every rank's slice of `key` (device backends)."""
        raise PeerMemoryError(f"the {self.name} backend has no device addresses")

    @property
    def can_hold(self) -> bool:
        """True when `holder_fd` works (a holder can keep this rank's slices and hand them to
        peers); False for FABRIC-only memory."""
        return True

    @property
    def peers_from_holders(self) -> bool:
        """After `map_peers`: True when the peers' slices come from their holders (`attach`),
        False when `map_peers` imported them already (FABRIC handles in the records)."""
        return True

    @abstractmethod
    def holder_fd(self, key: int) -> int:
        """A new file descriptor (the caller's to close) that keeps this rank's slice of `key`
        alive in whichever process holds it."""

    @abstractmethod
    def attach(self, rank: int, key: int, fd: int, shape: list[int], nbytes: int) -> None:
        """Map rank `rank`'s slice of `key` (`shape` `[rows, row_bytes]`, `nbytes` mapped) from
        a holder's descriptor `fd` (the caller closes it)."""

    @abstractmethod
    def allocated_bytes(self, key: int) -> int:
        """Bytes this rank holds for table `key` (allocation granularity included)."""

    @property
    @abstractmethod
    def handle_type(self) -> str:
        """How slices travel between members (e.g. `shm_file`, `posix_fd`, `fabric`)."""

    @abstractmethod
    def close(self) -> None:
        """Unmap peers' slices and release own ones. Idempotent."""

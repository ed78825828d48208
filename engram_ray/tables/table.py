"""Peer-group tables: each member holds one slice of every Engram table, reads peers' in place.

Table of `rows` rows over a group of P: `rows_per_rank = ceil(rows / P)`; rank r owns rows
`[r * rows_per_rank, min(rows, (r + 1) * rows_per_rank))` (`engram_ray.planning.memory.slice_range`) and
allocates `rows_per_rank` packed rows `[rows_per_rank, row_bytes]` uint8 (padding rows of the
last rank are zero). `open_group_tables` allocates and fills this rank's slices, then does the
group's one rendezvous (`engram_ray.tables.rendezvous`); lookups read every slice in place.

P = 1 is the same path with one member: a whole local table.
"""

from __future__ import annotations

import importlib
import re
import time
from dataclasses import dataclass

import torch

from engram_ray.errors import ConfigError
from engram_ray.model.layout import EngramLayout
from engram_ray.tables.backends.base import PeerMemory
from engram_ray.tables.backends.handle_types import check_handle_request
from engram_ray.planning.memory import rows_per_rank, slice_range
from engram_ray.model.reference import row_bytes_for
from engram_ray.tables import BACKENDS, FILLS
from engram_ray.tables.rendezvous import Rendezvous

_GENERATION = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class PeerGroupSpec:
    """This member's place in a peer group; validates on construction, naming the bad field."""

    size: int                   # P, members of the group
    rank: int                   # 0 <= rank < size
    store_dir: str              # peer_group_store directory for this generation
    generation: str             # generation id chosen by the coordinator ([A-Za-z0-9._-]{1,64})
    timeout_s: float = 120.0    # how long the rendezvous waits for every member
    handle_type: str | None = None  # cuda backend: "fabric" | "posix_fd" only, None: group picks
    cross_node: bool = False    # the group spans hosts: needs handle_type "fabric"

    def __post_init__(self):
        for name, value in (("size", self.size), ("rank", self.rank)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"peer_group.{name}", f"is {value!r}", "an integer")
        if self.size < 1:
            raise ConfigError("peer_group.size", f"is {self.size}", "an integer >= 1")
        if not 0 <= self.rank < self.size:
            raise ConfigError("peer_group.rank", f"is {self.rank}", f"0 <= rank < {self.size}")
        if not isinstance(self.store_dir, str) or not self.store_dir:
            raise ConfigError("peer_group.store_dir", f"is {self.store_dir!r}",
                              "a directory path (peer_group_store)")
        if not isinstance(self.generation, str) or not _GENERATION.fullmatch(self.generation):
            raise ConfigError("peer_group.generation", f"is {self.generation!r}",
                              "1-64 characters of letters, digits, '.', '_' or '-'")
        if (not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool)
                or not self.timeout_s > 0):
            raise ConfigError("peer_group.timeout_s", f"is {self.timeout_s!r}",
                              "a positive number of seconds")
        check_handle_request(self.handle_type, self.cross_node, "peer_group")


class PeerGroupTable:
    """One Engram table (one model layer) split over the group; this rank's slice is `local`."""

    def __init__(self, layer_id: int, num_rows: int, head_dim: int, spec: PeerGroupSpec,
                 memory: PeerMemory):
        self.layer_id, self.num_rows, self.head_dim = layer_id, num_rows, head_dim
        self.row_bytes = row_bytes_for(head_dim)
        self.rows_per_rank = rows_per_rank(num_rows, spec.size)
        self.slice_start, self.slice_end = slice_range(num_rows, spec.size, spec.rank)
        self._memory = memory
        self.local = memory.allocate(layer_id, self.rows_per_rank, self.row_bytes)
        self._peer_bases: torch.Tensor | None = None
        self._reader = None

    @property
    def num_owned_rows(self) -> int:
        return self.slice_end - self.slice_start

    def fill(self, fill: str, seed: int = 0, checkpoint: str | None = None) -> None:
        """Write this rank's rows: synthetic (`engram_ray.model.synthetic`) or from a checkpoint."""
        from engram_ray.tables import fill as table_fill
        owned = self.local[:self.num_owned_rows]
        if fill == "synthetic":
            table_fill.fill_synthetic_slice(owned, self.slice_start, self.head_dim, seed,
                                            label=f"layer {self.layer_id}")
        elif fill == "checkpoint":
            table_fill.fill_from_checkpoint(owned, checkpoint, self.layer_id, self.slice_start,
                                            self.num_rows, self.head_dim)
        else:
            raise ConfigError("fill", f"is {fill!r}", f"one of {', '.join(FILLS)}")
        self.local[self.num_owned_rows:].zero_()

    def lookup(self, row_ids: torch.Tensor, out: str = "packed",
               into: torch.Tensor | None = None) -> torch.Tensor:
        """row_ids int32/int64 `[T, C]` (-1 = no row) -> uint8 `[T, C, row_bytes]` or bf16
        `[T, C, head_dim]` (written into `into` when given), read from whichever rank owns
        each row, through `reader`."""
        return self.reader.lookup(row_ids, out, into)

    @property
    def reader(self):
        """This table's `engram_ray.tables.lookup.TableLookup` over every rank's slice (made
        once, after the rendezvous mapped the peers' slices)."""
        if self._reader is None:
            from engram_ray.tables.lookup import TableLookup
            if self._memory.name == "shm":
                # Owned rows only, so ids past the table's end fail instead of reading padding.
                slices = [s[:max(0, self.num_rows - r * self.rows_per_rank)]
                          for r, s in enumerate(self._memory.slices(self.layer_id))]
                self._reader = TableLookup(self.head_dim, slices=slices,
                                           rows_per_rank=self.rows_per_rank)
            else:
                self._reader = TableLookup(self.head_dim, peer_bases=self.peer_bases,
                                           rows_per_rank=self.rows_per_rank)
        return self._reader

    @property
    def peer_bases(self) -> torch.Tensor:
        """`[P]` int64 device addresses of every rank's slice (cuda backend), for calling
        `engram_ray.kernels.lookup.engram_lookup` directly (e.g. with `into=`)."""
        if self._peer_bases is None:
            self._peer_bases = self._memory.peer_bases(self.layer_id)
        return self._peer_bases

    def release(self) -> None:
        """Drop references to the slice memory (its owner is about to unmap it)."""
        self.local = None
        self._peer_bases = self._reader = None

    def stats(self) -> dict:
        return {"layer_id": self.layer_id, "rows": self.num_rows,
                "slice": [self.slice_start, self.slice_end], "rows_per_rank": self.rows_per_rank,
                "local_bytes": self._memory.allocated_bytes(self.layer_id),
                "row_bytes": self.row_bytes}


class PeerGroupTables:
    """Every Engram table of a model for one member of a peer group (see `open_group_tables`)."""

    def __init__(self, layout: EngramLayout, spec: PeerGroupSpec, memory: PeerMemory,
                 tables: dict[int, PeerGroupTable], rendezvous_seconds: float,
                 rendezvous_started_at: float = 0.0):
        self.layout, self.spec, self.tables = layout, spec, tables
        self.rendezvous_seconds = rendezvous_seconds
        self.rendezvous_started_at = rendezvous_started_at  # epoch seconds of arrival
        self._memory = memory

    def lookup(self, layer_id: int, row_ids: torch.Tensor, out: str = "packed",
               into: torch.Tensor | None = None) -> torch.Tensor:
        """`[T, C]` int32/int64 -> `[T, C, row_bytes]` uint8 (packed) or `[T, C, head_dim]`
        bf16, written into `into` when given (`PeerGroupTable.lookup`)."""
        if layer_id not in self.tables:
            self.layout.layer_idx(layer_id)  # raises, naming the layers that have tables
        return self.tables[layer_id].lookup(row_ids, out, into)

    def stats(self) -> dict:
        return {"backend": self._memory.name, "handle_type": self._memory.handle_type,
                "generation": self.spec.generation, "rank": self.spec.rank,
                "size": self.spec.size, "rendezvous_seconds": self.rendezvous_seconds,
                "rendezvous_started_at": self.rendezvous_started_at,
                "tables": [t.stats() for t in self.tables.values()]}

    def close(self) -> None:
        """Unmap peers' slices and release own ones (shm files, CUDA mappings). Idempotent."""
        for table in self.tables.values():
            table.release()
        self._memory.close()


def make_memory(backend: str, spec: PeerGroupSpec, device: str) -> PeerMemory:
    """This member's backend; the spec's handle_type and cross_node reach its constructor
    (the cuda backend honours them, the shm backend refuses a CUDA handle type)."""
    if backend not in BACKENDS:
        raise ConfigError("backend", f"is {backend!r}", f"one of {', '.join(BACKENDS)}")
    module_name, class_name = BACKENDS[backend].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(rank=spec.rank, size=spec.size, device=device, tag=spec.generation,
               handle_type=spec.handle_type, cross_node=spec.cross_node)


def open_group_tables(layout: EngramLayout, spec: PeerGroupSpec, *, backend: str = "shm",
                      device: str = "cpu", fill: str = "synthetic", seed: int = 0,
                      checkpoint: str | None = None) -> PeerGroupTables:
    """Allocate this rank's slice of every Engram table of the model, fill it, and do the ONE
    rendezvous of the group (blocks until all `size` members arrive or timeout_s passes)."""
    if fill not in FILLS:
        raise ConfigError("fill", f"is {fill!r}", f"one of {', '.join(FILLS)}")
    if fill == "checkpoint" and not checkpoint:
        raise ConfigError("checkpoint", "is missing", "a safetensors file or folder for "
                          "fill='checkpoint'")
    memory = make_memory(backend, spec, device)
    try:
        tables = {}
        for layer_id, num_rows in zip(layout.layer_ids, layout.rows_per_table):
            tables[layer_id] = PeerGroupTable(layer_id, num_rows, layout.head_dim, spec, memory)
            tables[layer_id].fill(fill, seed, checkpoint)
        return join_group(layout, spec, memory, tables)
    except BaseException:
        memory.close()
        raise


def join_group(layout: EngramLayout, spec: PeerGroupSpec, memory: PeerMemory,
               tables: dict[int, PeerGroupTable]) -> PeerGroupTables:
    """The group's one rendezvous: publish this rank's slices, map every peer's. On failure the
    others are told why (they stop at once) and the caller still owns `memory`."""
    started_at, start = time.time(), time.perf_counter()
    rendezvous = Rendezvous(spec.store_dir, spec.generation, spec.size, spec.rank,
                            spec.timeout_s)
    try:
        slices = {str(lid): [t.slice_start, t.slice_end] for lid, t in tables.items()}
        records = rendezvous.gather(dict(memory.describe(), slices=slices,
                                         fingerprint=layout.fingerprint()))
        memory.map_peers(records)
        rendezvous.finish()
        memory.after_rendezvous()
    except BaseException as exc:
        rendezvous.fail(f"{type(exc).__name__}: {exc}")
        rendezvous.close()
        raise
    return PeerGroupTables(layout, spec, memory, tables, time.perf_counter() - start,
                           started_at)

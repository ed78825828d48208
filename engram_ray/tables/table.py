"""Engram tables as one engine holds them: whole, or this member's slice of a peer group.

`EngramTables` is every Engram table of a model in one engine, behind one interface (`lookup`,
`reader`, `load_checkpoint_tensor`, `stats`, `close`), made one of two ways:

- `EngramTables.whole(layout, device)`: every table whole in this process (packed
  `[rows, row_bytes]` uint8), filled by vLLM's weight loading (`load_checkpoint_tensor`).
- `EngramTables.member(layout, settings, device)`: this member's slices. A table of `rows`
  rows over a group of P: `rows_per_rank = ceil(rows / P)`; rank r owns rows
  `[r * rows_per_rank, min(rows, (r + 1) * rows_per_rank))`
  (`engram_ray.planning.memory.slice_range`) in `rows_per_rank` packed rows (padding rows of
  the last rank are zero). Slices are allocated (`add_table`) and filled before the group's one
  rendezvous (`join`); lookups then read every slice in place. `open_group_tables` does it all.
  With `metrics` (`engram_ray.metrics.engine.EngineMetrics`) the joined member's lookups are
  timed and their local/remote rows counted (one `engram_ray.metrics.lookup_meter.LookupMeter`
  per table: every lookup on CPU, one in `GPU_SAMPLE_EVERY` on GPU through CUDA events, no
  device sync, never inside a capture), and what it allocated is published.

Each table is an `EngramTable`; a whole table is the P = 1 case without a memory backend.
"""

# Over 300 lines: one table's memory, fill, lookup and peer view (`EngramTable`) and the
# engine's set of them with its one group join (`EngramTables`) share the slice lifecycle.

from __future__ import annotations

import time

import torch

from engram_ray.errors import ConfigError
from engram_ray.model.layout import EngramLayout
from engram_ray.model.reference import row_bytes_for
from engram_ray.planning.memory import rows_per_rank, slice_range
from engram_ray.tables import FILLS
from engram_ray.tables.backends import make_memory
from engram_ray.tables.backends.base import PeerMemory
from engram_ray.tables.rendezvous import Rendezvous
from engram_ray.tables.settings import PeerGroupSettings


class EngramTable:
    """One Engram table (one model layer): rows `[slice_start, slice_end)` of `num_rows` in
    `local` (`[rows_per_rank, row_bytes]` uint8; the whole table in a group of one)."""

    def __init__(self, layer_id: int, num_rows: int, head_dim: int, *, size: int = 1,
                 rank: int = 0, memory: PeerMemory | None = None,
                 device: str | torch.device = "cpu", local: torch.Tensor | None = None):
        """`local`: this rank's slice, mapped already (re-attached from its holder)."""
        self.layer_id, self.num_rows, self.head_dim = layer_id, num_rows, head_dim
        self.row_bytes = row_bytes_for(head_dim)
        self.rows_per_rank = rows_per_rank(num_rows, size)
        self.slice_start, self.slice_end = slice_range(num_rows, size, rank)
        self._memory = memory
        if local is not None:
            self.local = local
        elif memory is None:
            self.local = torch.zeros(self.rows_per_rank, self.row_bytes, dtype=torch.uint8,
                                     device=device)
        else:
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

    def load_columns(self, kind: str, weight: torch.Tensor, name: str) -> None:
        """vLLM's weight loading of a whole table: `kind` "weight" (fp8 values, the first
        head_dim bytes of each row) or "weight_scale_inv" (the scale bytes after them)."""
        columns = (slice(0, self.head_dim) if kind == "weight"
                   else slice(self.head_dim, self.row_bytes))
        raw = weight if weight.dtype == torch.uint8 else weight.view(torch.uint8)
        if raw.shape != self.local[:, columns].shape:
            raise ValueError(f"{name} is {tuple(raw.shape)}; expected "
                             f"{tuple(self.local[:, columns].shape)} from config.json")
        self.local[:, columns] = raw.to(self.local.device)

    def lookup(self, row_ids: torch.Tensor, out: str = "packed",
               into: torch.Tensor | None = None) -> torch.Tensor:
        """row_ids int32/int64 `[T, C]` (-1 = no row) -> uint8 `[T, C, row_bytes]` or bf16
        `[T, C, head_dim]` (written into `into` when given), read from whichever rank owns
        each row, through `reader`."""
        return self.reader.lookup(row_ids, out, into)

    @property
    def reader(self):
        """This table's `engram_ray.tables.lookup.TableLookup` over every rank's slice (made
        once; for a group, after the rendezvous mapped the peers' slices)."""
        if self._reader is None:
            from engram_ray.tables.lookup import TableLookup
            if self._memory is None:
                self._reader = TableLookup(self.head_dim, table=self.local)
            elif self._memory.name == "shm":
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
        local_bytes = (self._memory.allocated_bytes(self.layer_id) if self._memory is not None
                       else self.local.numel())
        return {"layer_id": self.layer_id, "rows": self.num_rows,
                "slice": [self.slice_start, self.slice_end], "rows_per_rank": self.rows_per_rank,
                "local_bytes": local_bytes, "row_bytes": self.row_bytes}


class EngramTables:
    """Every Engram table of a model in one engine, whole or this member's slices (module doc)."""

    def __init__(self, layout: EngramLayout, *, settings: PeerGroupSettings | None = None,
                 memory: PeerMemory | None = None, device: str | torch.device = "cpu",
                 metrics=None):
        self.layout, self.settings, self.device, self.metrics = layout, settings, device, metrics
        self.tables: dict[int, EngramTable] = {}
        self.rendezvous_seconds = 0.0
        self.rendezvous_started_at = 0.0  # epoch seconds of arrival at the rendezvous
        self.is_joined = settings is None  # whole tables need no rendezvous
        self.reattach_seconds: float | None = None  # mapped from holders after a restart
        self.memory = memory
        self._loaded: set[int] = set()

    @classmethod
    def whole(cls, layout: EngramLayout, device: str | torch.device = "cpu") -> "EngramTables":
        tables = cls(layout, device=device)
        for layer_id in layout.layer_ids:
            tables.add_table(layer_id)
        return tables

    @classmethod
    def member(cls, layout: EngramLayout, settings: PeerGroupSettings, device: str,
               metrics=None) -> "EngramTables":
        """This member's tables, none allocated yet (`add_table`), not joined (`join`); or,
        when its slice holder holds them already (the engine restarted), every table
        re-attached from the holders and joined (`engram_ray.tables.holding.reattach`)."""
        from engram_ray.tables import holding

        tables = cls(layout, settings=settings, memory=make_memory(settings, device),
                     device=device, metrics=metrics)
        try:
            if settings.holders and holding.holds_slices(settings):
                holding.reattach(tables)
        except BaseException:
            tables.close()
            raise
        return tables

    @property
    def size(self) -> int:
        return self.settings.size if self.settings else 1

    @property
    def rank(self) -> int:
        return self.settings.rank if self.settings else 0

    def add_table(self, layer_id: int, local: torch.Tensor | None = None) -> EngramTable:
        """Allocate this engine's rows of the layer's table (all of them for a whole table),
        or take `local`, this rank's slice mapped from its holder."""
        if layer_id in self.tables:
            raise RuntimeError(f"Engram table of layer {layer_id} was built twice in one engine")
        num_rows = self.layout.rows_per_table[self.layout.layer_idx(layer_id)]
        self.tables[layer_id] = EngramTable(layer_id, num_rows, self.layout.head_dim,
                                            size=self.size, rank=self.rank,
                                            memory=self.memory, device=self.device, local=local)
        return self.tables[layer_id]

    def layer_of(self, num_embeddings: int, head_sizes: tuple[int, ...]) -> int:
        """The layer whose table has these rows and bucket primes (primes are never reused)."""
        for layer_idx, layer_id in enumerate(self.layout.layer_ids):
            if (self.layout.rows_per_table[layer_idx] == num_embeddings
                    and tuple(self.layout.primes[layer_idx]) == tuple(head_sizes)):
                return layer_id
        raise ConfigError("ParallelEngramEmbedding", f"has {num_embeddings} rows",
                          f"one of the config's tables {list(self.layout.rows_per_table)}")

    def mark_loaded(self, layer_id: int) -> None:
        """vLLM loaded this table's rows; once every table is loaded the member joins."""
        self._loaded.add(layer_id)
        if not self.is_joined and self._loaded == set(self.layout.layer_ids):
            self.join()

    def join(self) -> None:
        """The group's one rendezvous: publish this rank's record, map every peer's slices
        (from their holders, or FABRIC handles from the records). On failure the others are
        told why (they stop at once) and these tables still own their memory."""
        from engram_ray.tables import holding

        settings, memory = self.settings, self.memory
        started_at, start = time.time(), time.perf_counter()
        rendezvous = Rendezvous(settings.store_dir, settings.generation, settings.size,
                                settings.rank, settings.timeout_s)
        try:
            slices = {str(lid): [t.slice_start, t.slice_end] for lid, t in self.tables.items()}
            with holding.offered(self):  # until every peer has mapped this rank's slices
                records = rendezvous.gather(dict(memory.describe(), slices=slices,
                                                 fingerprint=self.layout.fingerprint()))
                memory.map_peers(records)
                if memory.peers_from_holders:
                    holding.attach_peers(self)
                rendezvous.finish()
            memory.after_rendezvous()
        except BaseException as exc:
            rendezvous.fail(f"{type(exc).__name__}: {exc}")
            rendezvous.close()
            raise
        self.rendezvous_seconds = time.perf_counter() - start
        self.rendezvous_started_at = started_at
        self.is_joined = True
        if self.metrics is not None:
            self._measure(self.metrics)
            self.metrics.reattached.labels(**self.metrics.identity.labels()).set(0)

    def mark_reattached(self, seconds: float) -> None:
        """Every slice was mapped from its holder and checked (`engram_ray.tables.holding`)."""
        self.reattach_seconds, self.is_joined = seconds, True
        if self.metrics is not None:
            self._measure(self.metrics)
            self.metrics.set_reattached(seconds)

    def reader(self, layer_id: int):
        """The layer's `engram_ray.tables.lookup.TableLookup` (for a group: every slice mapped,
        peer base addresses on the device, so made at `join`, not inside a CUDA-graph capture)."""
        if not self.is_joined:
            raise RuntimeError(
                f"Engram peer group {self.settings.generation}: lookup before the group was "
                f"joined (tables loaded: {sorted(self._loaded)} of {list(self.layout.layer_ids)})")
        if layer_id not in self.tables:
            self.layout.layer_idx(layer_id)  # raises, naming the layers that have tables
        return self.tables[layer_id].reader

    def lookup(self, layer_id: int, row_ids: torch.Tensor, out: str = "packed",
               into: torch.Tensor | None = None) -> torch.Tensor:
        """`[T, C]` int32/int64 -> `[T, C, row_bytes]` uint8 (packed) or `[T, C, head_dim]`
        bf16, written into `into` when given (`engram_ray.tables.lookup.TableLookup.lookup`)."""
        return self.reader(layer_id).lookup(row_ids, out, into)

    def load_checkpoint_tensor(self, name: str, weight: torch.Tensor) -> None:
        """vLLM's weight loading of one table tensor: written into a whole table; for a group
        only checked, since this rank's rows were read from the checkpoint before the
        rendezvous and peers may be reading them already."""
        from engram_ray.tables.fill import parse_table_tensor
        layer_id, kind = parse_table_tensor(name)
        if self.settings is None:
            self.tables[layer_id].load_columns(kind, weight, name)

    def _measure(self, metrics) -> None:
        """Meters on every table's reads and the memory really allocated (module doc)."""
        from engram_ray.metrics.lookup_meter import LookupMeter
        from engram_ray.planning.memory import make_plan
        for layer_id, table in self.tables.items():
            table.reader.meter = LookupMeter(metrics, layer_id, table.rows_per_rank, self.rank)
        metrics.set_table_memory(self, baseline=make_plan(self.layout, "hbm"))

    def stats(self) -> dict:
        memory = self.memory
        return {"backend": memory.name if memory else "local",
                "handle_type": memory.handle_type if memory else None,
                # how peers' slices are mapped here ("read" where the backend maps them
                # read-only: the cuda backend's `peer_access`; shm maps them PROT_READ)
                "peer_access": getattr(memory, "peer_access", "read") if memory else None,
                "generation": self.settings.generation if self.settings else None,
                "rank": self.rank, "size": self.size,
                "rendezvous_seconds": self.rendezvous_seconds,
                "rendezvous_started_at": self.rendezvous_started_at,
                "reattach_seconds": self.reattach_seconds,
                "tables": [t.stats() for t in self.tables.values()]}

    def close(self) -> None:
        """Unmap peers' slices and release own ones (shm files, CUDA mappings). Idempotent."""
        for table in self.tables.values():
            table.release()
        if self.memory is not None:
            self.memory.close()


def open_group_tables(layout: EngramLayout, settings: PeerGroupSettings, *,
                      device: str = "cpu", fill: str = "synthetic", seed: int = 0,
                      checkpoint: str | None = None, metrics=None) -> EngramTables:
    """Allocate this rank's slice of every Engram table of the model, fill it, and do the ONE
    rendezvous of the group (blocks until all `size` members arrive or timeout_s passes). With
    `settings.holders` the filled slices go to this member's holder first, and an engine whose
    holder holds them already (it restarted) maps every member's slices from their holders."""
    if fill not in FILLS:
        raise ConfigError("fill", f"is {fill!r}", f"one of {', '.join(FILLS)}")
    if fill == "checkpoint" and not checkpoint:
        raise ConfigError("checkpoint", "is missing", "a safetensors file or folder for "
                          "fill='checkpoint'")
    tables = EngramTables.member(layout, settings, device, metrics)
    if tables.is_joined:  # re-attached: its engine restarted
        return tables
    try:
        for layer_id in layout.layer_ids:
            tables.add_table(layer_id).fill(fill, seed, checkpoint)
        tables.join()
        return tables
    except BaseException:
        tables.close()
        raise

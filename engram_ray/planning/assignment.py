"""What the coordinator hands each engine of its peer group: generation, store, slices. Pure.

Generation ids name one life of a group: `<deployment>-<group>.<index>.<token>` (hashed to at
most 64 characters), unique per host because the shm backend names its files after them and
the rendezvous refuses a store of another generation. Each generation gets a fresh store folder
`<peer_group_store>/<deployment>/<group>/<generation>` (0700); the previous one is removed once
the new generation starts (its old members are gone by then: Serve stops a whole gang).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from engram_ray.model.layout import EngramLayout
from engram_ray.planning.memory import slice_range
from engram_ray.private_dirs import private_dir

MAX_GENERATION_CHARS = 64  # tables.settings.PeerGroupSettings accepts [A-Za-z0-9._-]{1,64}
_INVALID = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class TableSlice:
    """Rows [start, end) of the table at model layer `layer_id` owned by one rank."""

    layer_id: int
    start: int
    end: int
    row_bytes: int

    @property
    def num_bytes(self) -> int:
        return (self.end - self.start) * self.row_bytes


def generation_id(deployment: str, group_id: str, index: int, token: str) -> str:
    """`<deployment>-<group>.<index>.<token>`; the prefix hashed down when it is too long."""
    suffix = f".{index}.{token}"
    prefix = _INVALID.sub("-", f"{deployment}-{group_id}")
    room = MAX_GENERATION_CHARS - len(suffix)
    if len(prefix) > room:
        digest = hashlib.sha256(prefix.encode()).hexdigest()[:8]
        prefix = prefix[:room - 9] + "-" + digest
    return prefix + suffix


def group_store_root(peer_group_store: str, deployment: str, group_id: str) -> str:
    return os.path.join(peer_group_store, deployment, group_id)


def deaths_dir(peer_group_store: str, deployment: str) -> Path:
    """Where a deployment's replicas record engine deaths (`engram_ray.serve.member.engine_death`):
    beside its groups' store folders, removed with them (`GenerationBook.remove_stores`)."""
    return Path(peer_group_store, deployment, "engine-deaths")


def generation_store_dir(peer_group_store: str, deployment: str, group_id: str,
                         generation: str) -> str:
    return os.path.join(group_store_root(peer_group_store, deployment, group_id), generation)


def slices_of(layout: EngramLayout, rank: int, size: int) -> tuple[TableSlice, ...]:
    """Rank `rank`'s rows of every table in a group of `size` (`engram_ray.planning.memory.slice_range`,
    the function the engines' tables use too)."""
    return tuple(TableSlice(layer_id, *slice_range(rows, size, rank), layout.row_bytes)
                 for layer_id, rows in zip(layout.layer_ids, layout.rows_per_table))


def create_store_dir(store_dir: str) -> str:
    """Create a generation's store folder 0700 (parents 0700 too, `private_dir`); it must not
    exist yet (FileExistsError: a generation is never reused)."""
    return private_dir(store_dir, "peer_group_store folder", exist_ok=False)


def remove_store_dir(store_dir: str | None) -> None:
    if store_dir:
        shutil.rmtree(store_dir, ignore_errors=True)

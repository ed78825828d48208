"""A member's slices and their holders (`engram_ray.tables.slice_holder`): handed over once
filled, mapped back when the member's engine restarts inside its replica.

    first start   fill ─► deposit(tables) ─► rendezvous (EngramTables.join)
    restart       holds_slices(settings) ─► reattach(tables): every rank's slice from its
                  holder, digests checked, no fill, no rendezvous

The generation rule: engines serve side by side only when they read the same rows. A restarted
engine reads exactly the memory its peers kept mapping, checked against the digests taken at
fill; a member whose holder is gone (its replica, GPU or node lost) cannot re-attach, and its
group starts a new generation.
"""

from __future__ import annotations

import logging
import os
import time

from engram_ray.tables.slice_holder import (SliceHolderError, deposit as deposit_to, fetch,
                                            holder_path, sampled_digest)

logger = logging.getLogger("vllm.engram_ray.tables")


def deposit(tables) -> None:
    """Hand this rank's filled slices (`tables`: `engram_ray.tables.table.EngramTables`) to its
    holder, with their shapes and digests."""
    settings, memory = tables.settings, tables.memory
    slices, fds = [], []
    try:
        for layer_id, table in tables.tables.items():
            fds.append(memory.holder_fd(layer_id))
            slices.append({"key": layer_id, "shape": list(table.local.shape),
                           "nbytes": memory.allocated_bytes(layer_id), "kind": memory.name,
                           "digest": sampled_digest(table.local)})
        deposit_to(holder_path(settings.store_dir, settings.rank), settings.generation,
                   settings.rank, slices, fds)
    finally:
        for fd in fds:
            os.close(fd)


def holds_slices(settings) -> bool:
    """True when this member's holder holds its slices already (its engine restarted)."""
    slices, fds = fetch(holder_path(settings.store_dir, settings.rank), settings.generation)
    for fd in fds:
        os.close(fd)
    return bool(slices)


def reattach(tables) -> None:
    """Map every rank's slices from their holders into `tables` (none allocated yet) and
    check each against its digest from fill; SliceHolderError names the first that fails."""
    settings, layout, memory = tables.settings, tables.layout, tables.memory
    start = time.perf_counter()
    held = {}
    try:
        for rank in range(settings.size):
            held[rank] = fetch(holder_path(settings.store_dir, rank), settings.generation)
            keys = sorted(s["key"] for s in held[rank][0])
            if keys != sorted(layout.layer_ids):
                raise SliceHolderError(
                    f"the holder of rank {rank} of generation {settings.generation!r} holds "
                    f"tables {keys}, expected {sorted(layout.layer_ids)}")
            for meta, fd in zip(*held[rank]):
                memory.attach(rank, meta["key"], fd, meta["shape"], meta["nbytes"])
    finally:
        for _, fds in held.values():
            for fd in fds:
                os.close(fd)
    for layer_id in layout.layer_ids:
        tables.add_table(layer_id, local=memory.slices(layer_id)[settings.rank])
    for rank, (slices, _) in held.items():
        for meta in slices:
            found = sampled_digest(memory.slices(meta["key"])[rank])
            if found != meta["digest"]:
                raise SliceHolderError(
                    f"rank {rank}'s slice of table {meta['key']} does not match what was filled "
                    f"(digest {found} against {meta['digest']}): its memory changed; the group "
                    "must start a new generation")
    seconds = time.perf_counter() - start
    tables.mark_reattached(seconds)
    logger.info("Engram tables: rank %d re-attached the slices of all %d ranks from their "
                "holders (generation %s) in %.3f s, digests match; no checkpoint read",
                settings.rank, settings.size, settings.generation, seconds)

"""A member's slices and their holders (`engram_ray.tables.slice_holder`): offered to the peers
at the rendezvous, kept while the member's engine restarts, mapped back when it has.

    first start   fill ─► offered(tables): this rank's slices at its holder ─► rendezvous
                  (EngramTables.join): attach_peers(tables), every peer's slice from its
                  holder, digests checked
    restart       holds_slices(settings) ─► reattach(tables): every rank's slice from its
                  holder, digests checked, no fill, no rendezvous

The holder is the replica's (`settings.holders`: it keeps the slices for restarts) or, for a
member without one, a holder in the engine process that closes when the rendezvous ends.
FABRIC handles (groups across hosts) travel in the rendezvous records instead.

The generation rule: engines serve side by side only when they read the same rows. A restarted
engine reads exactly the memory its peers kept mapping, checked against the digests taken at
fill; a member whose holder is gone (its replica, GPU or node lost) cannot re-attach, and its
group starts a new generation.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

from engram_ray.tables.slice_holder import (SliceHolder, SliceHolderError, deposit as deposit_to,
                                            fetch, holder_path, sampled_digest)

logger = logging.getLogger("vllm.engram_ray.tables")


def _own_slices(tables) -> tuple[list[dict], list[int]]:
    """This rank's filled slices as a holder keeps them: their shapes and digests, and a new
    descriptor each (the caller's to close)."""
    memory, slices, fds = tables.memory, [], []
    try:
        for layer_id, table in tables.tables.items():
            fds.append(memory.holder_fd(layer_id))
            slices.append({"key": layer_id, "shape": list(table.local.shape),
                           "nbytes": memory.allocated_bytes(layer_id), "kind": memory.name,
                           "digest": sampled_digest(table.local)})
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return slices, fds


def deposit(tables) -> None:
    """Hand this rank's filled slices (`tables`: `engram_ray.tables.table.EngramTables`) to the
    holder in its replica."""
    settings = tables.settings
    slices, fds = _own_slices(tables)
    try:
        deposit_to(holder_path(settings.store_dir, settings.rank), settings.generation,
                   settings.rank, slices, fds, settings.holder_token)
    finally:
        for fd in fds:
            os.close(fd)


@contextlib.contextmanager
def offered(tables):
    """While the rendezvous runs, this rank's slices wait for its peers at its holder's socket:
    deposited with the replica's holder (`settings.holders`; kept there afterwards), else held
    by one in this process until the block ends. FABRIC-only memory offers nothing here."""
    settings, memory = tables.settings, tables.memory
    if not memory.can_hold:  # FABRIC-only: an engine death restarts the gang
        yield
        return
    if settings.holders:
        deposit(tables)
        yield
        return
    holder = SliceHolder(settings.store_dir, settings.generation, settings.rank,
                         settings.holder_token)
    try:
        holder.hold(*_own_slices(tables))
        yield
    finally:
        holder.close()


def holds_slices(settings) -> bool:
    """True when this member's holder holds its slices already (its engine restarted)."""
    slices, fds = fetch(holder_path(settings.store_dir, settings.rank), settings.generation,
                        settings.holder_token)
    for fd in fds:
        os.close(fd)
    return bool(slices)


def _attach(tables, ranks) -> dict[int, list[dict]]:
    """Map the slices of `ranks` from their holders into `tables.memory`; what each held."""
    settings, layout, memory = tables.settings, tables.layout, tables.memory
    held = {}
    for rank in ranks:
        slices, fds = fetch(holder_path(settings.store_dir, rank), settings.generation,
                            settings.holder_token)
        try:
            keys = sorted(s["key"] for s in slices)
            if keys != sorted(layout.layer_ids):
                raise SliceHolderError(
                    f"the holder of rank {rank} of generation {settings.generation!r} holds "
                    f"tables {keys}, expected {sorted(layout.layer_ids)}")
            for meta, fd in zip(slices, fds):
                memory.attach(rank, meta["key"], fd, meta["shape"], meta["nbytes"])
        finally:
            for fd in fds:
                os.close(fd)
        held[rank] = slices
    return held


def _check_digests(tables, held: dict[int, list[dict]]) -> None:
    """SliceHolderError naming the first mapped slice that differs from its digest at fill."""
    for rank, slices in held.items():
        for meta in slices:
            found = sampled_digest(tables.memory.slices(meta["key"])[rank])
            if found != meta["digest"]:
                raise SliceHolderError(
                    f"rank {rank}'s slice of table {meta['key']} does not match what was filled "
                    f"(digest {found} against {meta['digest']}): its memory changed; the group "
                    "must start a new generation")


def attach_peers(tables) -> None:
    """At the rendezvous: map every peer's slices from its holder and check their digests."""
    rank = tables.settings.rank
    _check_digests(tables, _attach(tables, [r for r in range(tables.settings.size)
                                            if r != rank]))


def reattach(tables) -> None:
    """Map every rank's slices from their holders into `tables` (none allocated yet) and
    check each against its digest from fill; SliceHolderError names the first that fails."""
    settings = tables.settings
    start = time.perf_counter()
    held = _attach(tables, range(settings.size))
    for layer_id in tables.layout.layer_ids:
        tables.add_table(layer_id, local=tables.memory.slices(layer_id)[settings.rank])
    _check_digests(tables, held)
    seconds = time.perf_counter() - start
    tables.mark_reattached(seconds)
    logger.info("Engram tables: rank %d re-attached the slices of all %d ranks from their "
                "holders (generation %s) in %.3f s, digests match; no checkpoint read",
                settings.rank, settings.size, settings.generation, seconds)

"""Engram tables of a model served by vLLM (`engram_ray.tables.table.EngramTables`).

- No `engram_peer_group` in vLLM's `additional_config`: every table whole in this process
  (packed `[rows, row_bytes]` uint8), filled by vLLM's weight loading.
- With one: this engine's slices (`engram_ray.tables.table.open_group_tables`; backend from
  the settings, `shm` on CPU), filled from the checkpoint with this rank's rows only before the
  group's rendezvous; vLLM's weight loading then skips the tables. With the Serve app's
  model-process metrics endpoint, lookups are timed and their local/remote rows counted.

Both look up with the same bit-exact row reads, so completions do not depend on the split.
"""

from __future__ import annotations

import atexit
import logging

import torch

from engram_ray.model.layout import EngramLayout
from engram_ray.tables.settings import PeerGroupSettings
from engram_ray.tables.table import EngramTables, open_group_tables

# Under vLLM's logger, whose handler vLLM configures in every engine process.
logger = logging.getLogger("vllm.engram_ray.tables")


def open_model_tables(layout: EngramLayout, vllm_config) -> EngramTables:
    """Tables for the model being built in this vLLM worker (see module doc)."""
    settings = PeerGroupSettings.for_engine(vllm_config)
    device = "cpu" if vllm_config.device_config.device.type == "cpu" else "cuda"
    if settings is None:
        logger.info("Engram tables: whole in this engine (%s), no peer group configured", device)
        return EngramTables.whole(layout, device)
    from engram_ray.metrics.exposition import start_process_metrics

    from engram_ray.vllm.held_memory import base_load_format

    is_dummy = base_load_format(vllm_config.load_config) == "dummy"
    metrics = start_process_metrics(vllm_config.additional_config)
    tables = open_group_tables(
        layout, settings,
        device="cpu" if settings.backend == "shm" else f"cuda:{torch.cuda.current_device()}",
        fill="synthetic" if is_dummy else "checkpoint",
        checkpoint=None if is_dummy else vllm_config.model_config.model, metrics=metrics)
    atexit.register(tables.close)
    logger.info("Engram tables: rank %d of a peer group of %d (generation %s, %s backend), "
                "rendezvous %.3f s; lookup metrics %s", settings.rank, settings.size,
                settings.generation, settings.backend, tables.rendezvous_seconds,
                metrics.server.target if metrics else "off")
    return tables

"""Engram tables of a model served by vLLM: whole in this engine, or a peer-group slice.

- No `engram_peer_group` in vLLM's `additional_config`: `HostTables`, every table whole in
  this process (packed `[rows, row_bytes]` uint8), filled by vLLM's weight loading.
- With one: this engine's slices through `engram_ray.tables.table.open_group_tables` (backend from
  the settings, `shm` on CPU), filled from the checkpoint with this rank's rows only before the
  group's rendezvous; vLLM's weight loading then skips the tables.

Both look up with the same bit-exact row reads, so completions do not depend on the split.
"""

from __future__ import annotations

import atexit
import logging
import re

import torch

from engram_ray.model.layout import EngramLayout
from engram_ray.metrics.lookup_meter import LookupMeter
from engram_ray.vllm.peer_settings import PeerGroupSettings
from engram_ray.tables.lookup import TableLookup

# Under vLLM's logger, whose handler vLLM configures in every engine process.
logger = logging.getLogger("vllm.engram_ray.tables")

_TABLE_TENSOR = re.compile(r"layers\.(\d+)\.engram\.embed\.(weight|weight_scale_inv)$")


def parse_table_tensor(name: str) -> tuple[int, str]:
    """(layer id, "weight" | "weight_scale_inv") of a checkpoint table tensor name."""
    match = _TABLE_TENSOR.search(name)
    if match is None:
        raise ValueError(f"{name!r} is not an Engram table tensor "
                         "(expected '...layers.<id>.engram.embed.weight[_scale_inv]')")
    return int(match.group(1)), match.group(2)


class HostTables:
    """Whole tables in this process, filled from vLLM's weight iterator."""

    def __init__(self, layout: EngramLayout, device: str | torch.device = "cpu"):
        self.layout = layout
        self.tables = {layer_id: torch.zeros(rows, layout.row_bytes, dtype=torch.uint8,
                                             device=device)
                       for layer_id, rows in zip(layout.layer_ids, layout.rows_per_table)}
        self.readers = {layer_id: TableLookup(layout.head_dim, table=table)
                        for layer_id, table in self.tables.items()}

    def load_checkpoint_tensor(self, name: str, weight: torch.Tensor) -> None:
        layer_id, kind = parse_table_tensor(name)
        table = self.tables[layer_id]
        columns = (slice(0, self.layout.head_dim) if kind == "weight"
                   else slice(self.layout.head_dim, self.layout.row_bytes))
        raw = weight if weight.dtype == torch.uint8 else weight.view(torch.uint8)
        if raw.shape != table[:, columns].shape:
            raise ValueError(f"{name} is {tuple(raw.shape)}; expected "
                             f"{tuple(table[:, columns].shape)} from config.json")
        table[:, columns] = raw.to(table.device)

    def lookup(self, layer_id: int, row_ids: torch.Tensor, out: str = "bf16",
               into: torch.Tensor | None = None) -> torch.Tensor:
        """int32/int64 `[T, C]` -> bf16 `[T, C, head_dim]` (or packed uint8
        `[T, C, row_bytes]`), written into `into` when given (`TableLookup.lookup`)."""
        return self.readers[layer_id].lookup(row_ids, out, into)

    def close(self) -> None:
        self.tables, self.readers = {}, {}


class GroupTables:
    """This engine's slices of a peer group (`engram_ray.tables.table.PeerGroupTables`).

    With `metrics` (the Serve app's model-process endpoint), lookups are timed and their
    local/remote rows counted by one `engram_ray.metrics.lookup_meter.LookupMeter` per table: every
    lookup on CPU, one in `GPU_SAMPLE_EVERY` on GPU through CUDA events (no device sync), and
    never inside a CUDA-graph capture.
    """

    def __init__(self, group_tables, metrics=None):
        self.group = group_tables
        self.metrics = metrics
        self.readers = {}
        for layer_id, table in group_tables.tables.items():
            reader = table.reader
            if metrics is not None:
                reader.meter = LookupMeter(metrics, layer_id, table.rows_per_rank,
                                           group_tables.spec.rank)
            self.readers[layer_id] = reader

    def load_checkpoint_tensor(self, name: str, weight: torch.Tensor) -> None:
        # This rank's rows were read from the checkpoint before the rendezvous; peers may be
        # reading them already, so weight loading must not write them again.
        parse_table_tensor(name)

    def lookup(self, layer_id: int, row_ids: torch.Tensor, out: str = "bf16",
               into: torch.Tensor | None = None) -> torch.Tensor:
        if layer_id not in self.readers:
            self.group.layout.layer_idx(layer_id)  # raises, naming the layers with tables
        return self.readers[layer_id].lookup(row_ids, out, into)

    def close(self) -> None:
        self.readers = {}
        self.group.close()


def open_model_tables(layout: EngramLayout, vllm_config) -> HostTables | GroupTables:
    """Tables for the model being built in this vLLM worker (see module doc)."""
    settings = PeerGroupSettings.for_engine(vllm_config)
    device = "cpu" if vllm_config.device_config.device.type == "cpu" else "cuda"
    if settings is None:
        logger.info("Engram tables: whole in this engine (%s), no peer group configured", device)
        return HostTables(layout, device)
    from engram_ray.tables.table import open_group_tables

    from engram_ray.metrics.exposition import start_process_metrics

    is_dummy = str(vllm_config.load_config.load_format) == "dummy"
    metrics = start_process_metrics(vllm_config.additional_config)
    tables = GroupTables(open_group_tables(
        layout, settings.to_spec(), backend=settings.backend,
        device="cpu" if settings.backend == "shm" else f"cuda:{torch.cuda.current_device()}",
        fill="synthetic" if is_dummy else "checkpoint",
        checkpoint=None if is_dummy else vllm_config.model_config.model), metrics)
    atexit.register(tables.close)
    if metrics is not None:  # measured here: what this member really allocated
        from engram_ray.metrics.engine import set_table_memory
        from engram_ray.planning.memory import make_plan
        set_table_memory(metrics, tables.group, baseline=make_plan(layout, "hbm"))
    logger.info("Engram tables: rank %d of a peer group of %d (generation %s, %s backend), "
                "rendezvous %.3f s; lookup metrics %s", settings.rank, settings.size,
                settings.generation, settings.backend, tables.group.rendezvous_seconds,
                metrics.server.target if metrics else "off")
    return tables

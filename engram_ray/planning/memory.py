"""Slice assignment and memory plans. Pure functions: no Ray, no GPU.

Slices follow vLLM's own split: `rows_per_rank = ceil(rows / P)`, rank r owns
`[r * rows_per_rank, min(rows, (r + 1) * rows_per_rank))`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engram_ray.errors import ConfigError
from engram_ray.model.layout import EngramLayout

GIB = 1 << 30
PLACEMENTS = ("hbm", "host", "peer")
HOST_MODES = ("per-engine", "dp-split", "per-node")


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(name, f"is {value!r}", "a positive integer")


def rows_per_rank(num_rows: int, group_size: int) -> int:
    """ceil(num_rows / group_size)."""
    _check_positive("num_rows", num_rows)
    _check_positive("peer_group_size", group_size)
    if group_size > num_rows:
        raise ConfigError("peer_group_size", f"is {group_size}, more than the {num_rows} rows",
                          f"at most {num_rows}")
    return -(-num_rows // group_size)


def slice_range(num_rows: int, group_size: int, rank: int) -> tuple[int, int]:
    """[start, end) rows owned by `rank`; the last ranks may own fewer rows (or none)."""
    per_rank = rows_per_rank(num_rows, group_size)
    if not 0 <= rank < group_size:
        raise ConfigError("rank", f"is {rank}", f"0 <= rank < {group_size}")
    start = min(num_rows, rank * per_rank)
    return start, min(num_rows, start + per_rank)


def owner_of(row_ids, rows_per_rank_: int):
    """(rank, local row) of global rows: works on ints, numpy arrays and torch tensors."""
    return row_ids // rows_per_rank_, row_ids % rows_per_rank_


@dataclass(frozen=True)
class MemoryPlan:
    """Engram table memory for one placement. Bytes per GPU, per node and per table."""

    placement: str
    description: str
    hbm_bytes_per_gpu: int
    host_bytes_per_gpu: int
    host_bytes_per_node: int
    table_rows: tuple[int, ...]
    table_bytes: tuple[int, ...]
    hbm_bytes_per_gpu_by_table: tuple[int, ...]
    peer_group_size: int = 1
    label: str = ""  # short column heading: the placement and its one parameter (`peer P=8`)

    def kv_gain_vs(self, other: "MemoryPlan") -> int:
        """HBM per GPU this plan leaves for KV cache beyond `other` (negative: less)."""
        return other.hbm_bytes_per_gpu - self.hbm_bytes_per_gpu

    def host_freed_vs(self, other: "MemoryPlan") -> tuple[int, int]:
        """(per GPU, per node) host memory this plan frees against `other` (negative: needs
        more)."""
        return (other.host_bytes_per_gpu - self.host_bytes_per_gpu,
                other.host_bytes_per_node - self.host_bytes_per_node)

    def to_dict(self) -> dict:
        out = asdict(self)
        for key in ("hbm_bytes_per_gpu", "host_bytes_per_gpu", "host_bytes_per_node"):
            out[key.replace("bytes", "gib")] = gib(getattr(self, key))
        return out


def gib(num_bytes: int) -> float:
    """GiB (2^30 bytes), rounded to 0.01."""
    return round(num_bytes / GIB, 2)


def make_plan(layout: EngramLayout, placement: str, *, peer_group_size: int = 1,
              host_mode: str = "per-engine", dp_size: int = 1,
              gpus_per_node: int = 8) -> MemoryPlan:
    """Memory plan of one placement.

    - hbm: every GPU holds both tables whole.
    - host: pinned host memory; `per-engine` one copy per GPU, `dp-split` heads split over a
      data-parallel group of `dp_size` (total / dp_size per GPU), `per-node` one shared copy.
    - peer: rows split over `peer_group_size` GPUs; per GPU: rows_per_rank * row_bytes per table.
    """
    _check_positive("gpus_per_node", gpus_per_node)
    rows, table_bytes = layout.rows_per_table, layout.table_bytes
    common = dict(table_rows=rows, table_bytes=table_bytes)
    if placement == "hbm":
        # No host copy: host per node is 0 (it read total x GPUs per node, HBM's figure).
        return MemoryPlan("hbm", "whole tables in every GPU's HBM", layout.total_bytes, 0, 0,
                          hbm_bytes_per_gpu_by_table=table_bytes, label="hbm", **common)
    if placement == "host":
        return _host_plan(layout, host_mode, dp_size, gpus_per_node, common)
    if placement == "peer":
        per_table = tuple(rows_per_rank(r, peer_group_size) * layout.row_bytes for r in rows)
        return MemoryPlan("peer", f"rows split over a peer group of {peer_group_size} GPUs",
                          sum(per_table), 0, 0, hbm_bytes_per_gpu_by_table=per_table,
                          peer_group_size=peer_group_size, label=f"peer P={peer_group_size}",
                          **common)
    raise ConfigError("--placement", f"is {placement!r}", f"one of {', '.join(PLACEMENTS)}")


def _host_plan(layout, host_mode, dp_size, gpus_per_node, common) -> MemoryPlan:
    zero = tuple(0 for _ in layout.table_bytes)
    total = layout.total_bytes
    if host_mode == "per-engine":
        return MemoryPlan("host", "CPU offload, one copy per engine", 0, total,
                          total * gpus_per_node, hbm_bytes_per_gpu_by_table=zero,
                          label="host per engine", **common)
    if host_mode == "dp-split":
        _check_positive("--dp-size", dp_size)
        if dp_size > layout.n_heads:
            raise ConfigError("--dp-size", f"is {dp_size}, more than the {layout.n_heads} heads",
                              f"at most {layout.n_heads}")
        per_gpu = -(-total // dp_size)
        return MemoryPlan("host", f"CPU offload, heads split over DP={dp_size}", 0, per_gpu,
                          per_gpu * gpus_per_node, hbm_bytes_per_gpu_by_table=zero,
                          label=f"host DP={dp_size}", **common)
    if host_mode == "per-node":
        return MemoryPlan("host", "CPU offload, one shared copy per node", 0,
                          -(-total // gpus_per_node), total,
                          hbm_bytes_per_gpu_by_table=zero, label="host per node", **common)
    raise ConfigError("--host-mode", f"is {host_mode!r}", f"one of {', '.join(HOST_MODES)}")

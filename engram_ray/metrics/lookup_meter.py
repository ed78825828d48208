"""Lookup metrics without device syncs: latency and local/remote rows of sampled lookups.

`LookupMeter(metrics, layer_id, rows_per_rank, rank)` feeds `EngineMetrics.observe_lookup`.
`meter.wants(row_ids)` says whether this call is sampled: every call on CPU, one in
`gpu_sample_every` on CUDA, never inside a CUDA-graph capture (a replay runs no Python).
`meter.measure(read, row_ids, out)` runs `read(row_ids, out)`:

- CPU: host clock around the call, rows counted at once (CPU work is synchronous anyway).
- CUDA: two timing events around the launch, the local and valid row counts computed on the
  device and copied to pinned host memory on the same stream, and a third event after the
  copy. Nothing waits: `drain()` publishes the samples whose last event has completed; it runs
  at every sampled call and in the metrics endpoint's scrape (`EngineMetrics.add_drain`).
"""

from __future__ import annotations

import threading
from collections import deque

from engram_ray.metrics.engine import table_name, time_on_host

GPU_SAMPLE_EVERY = 64
MAX_PENDING = 16  # samples in flight; beyond that (metrics far behind) calls go unsampled


class LookupMeter:
    """Samples one table's lookups for the engine's metrics (module doc)."""

    def __init__(self, metrics, layer_id: int, rows_per_rank: int, rank: int,
                 gpu_sample_every: int = GPU_SAMPLE_EVERY):
        self.metrics, self.layer_id, self.table = metrics, layer_id, table_name(layer_id)
        self.rows_per_rank, self.rank = rows_per_rank, rank
        self.gpu_sample_every = gpu_sample_every
        self.num_calls = 0
        self._pending: deque = deque()
        self._counts = None  # pinned int64 [MAX_PENDING, 2] (local, valid), made on first use
        self._next_slot = 0
        self._lock = threading.Lock()
        metrics.add_drain(self.drain)

    def wants(self, row_ids) -> bool:
        self.num_calls += 1
        if not row_ids.is_cuda:
            return True
        if self.num_calls % self.gpu_sample_every:
            return False
        import torch
        return (not torch.cuda.is_current_stream_capturing()
                and len(self._pending) < MAX_PENDING)

    def measure(self, read, row_ids, out):
        if not row_ids.is_cuda:
            return time_on_host(self.metrics, self.layer_id, self.rows_per_rank, self.rank,
                                lambda: read(row_ids, out), row_ids)
        self.drain()
        return self._measure_cuda(read, row_ids, out)

    def _measure_cuda(self, read, row_ids, out):
        import torch
        if self._counts is None:
            self._counts = torch.zeros(MAX_PENDING, 2, dtype=torch.int64, pin_memory=True)
        start, end, copied = (torch.cuda.Event(enable_timing=True),
                              torch.cuda.Event(enable_timing=True), torch.cuda.Event())
        start.record()
        result = read(row_ids, out)
        end.record()
        valid = row_ids >= 0
        local = valid & (row_ids // self.rows_per_rank == self.rank)
        slot = self._next_slot
        self._next_slot = (slot + 1) % MAX_PENDING
        counts = torch.stack([local.sum(dtype=torch.int64), valid.sum(dtype=torch.int64)])
        self._counts[slot].copy_(counts, non_blocking=True)
        copied.record()
        self._pending.append((start, end, copied, slot))
        return result

    def drain(self) -> int:
        """Publish the completed samples (never waits); returns how many."""
        if not self._lock.acquire(blocking=False):
            return 0  # the other side (serving thread or scrape) is publishing
        try:
            published = 0
            while self._pending and self._pending[0][2].query():
                start, end, _, slot = self._pending.popleft()
                num_local, num_valid = (int(v) for v in self._counts[slot].tolist())
                self.metrics.observe_lookup(self.table, start.elapsed_time(end) / 1e3,
                                            num_local, num_valid - num_local)
                published += 1
            return published
        finally:
            self._lock.release()

"""Id ordering of sorted lookups (kernels/lookup_launch.py): `torch.sort` of the ids, replayed
from a CUDA graph per size bucket instead of launched op by op.

`GraphSort()(row_ids, stream)` -> `(sorted_ids, dst_rows)`: the first `row_ids.numel()`
entries are `row_ids.reshape(-1).sort()`'s values and indices (buffers of the bucket's size,
owned by the sorter and rewritten by its next call), or None where the caller must sort
itself (outside [MIN_GRAPH_ROWS, MAX_GRAPH_ROWS], during a CUDA-graph capture, or the first
time a size bucket is met: `engram_lookup` makes a launcher per call, and a capture costs
2.5-12 ms of host time).

NOTES:
- `torch.sort` of 65K-1.57M int32 ids costs 69-76 us of host time per call on the H200 machine
  (torch 2.11: a copy, cub's radix-sort passes, allocations, each launched from Python);
  presized output buffers, `stable=False` or 16-bit keys change that by < 7 us. A graph that
  sorts a static buffer and re-pads it costs one copy in + one replay: 16.5-18 us
  (benchmarks/results/lookup_host_vs_vllm_h200_beabf19.md).
- Buffers are padded to the next power of two with the dtype's largest value: pads sort last,
  and cub's radix sort is stable, so the first num_rows pairs are torch.sort's own. Padding
  costs GPU time only inside the bucket (0.156 vs 0.151 ms at 1.57M rows; 0.062 vs 0.069 ms
  at 65K, fewer launch gaps).
- Buffers are reused call after call: on one stream the next copy in is queued after the last
  launch that read them; a call on another stream first makes that stream wait for the last
  one (`wait_stream`, only when the stream changes).
"""

from __future__ import annotations

import torch

MIN_GRAPH_ROWS = 1 << 15  # below: torch.sort (the policy sorts host lookups from 32,784 rows)
MAX_GRAPH_ROWS = 1 << 21  # above: torch.sort (bounds the buffers: 16 bytes a row per dtype)
_is_capturing = (getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)  # ~1 us less
                 or torch.cuda.is_current_stream_capturing)


class GraphSort:
    """Sorted ids and their positions for one launcher's lookups (module doc)."""

    def __init__(self):
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (bucket, dtype) -> graph
        self._buffers: dict[torch.dtype, tuple] = {}  # dtype -> (keys, values, indices)
        self._seen: set[tuple] = set()  # buckets met once: the second call captures
        self._pool = None
        self._stream = self._torch_stream = None  # the last call's stream: handle, torch

    def __call__(self, row_ids: torch.Tensor, stream) -> tuple | None:
        num_rows = row_ids.numel()
        if not MIN_GRAPH_ROWS <= num_rows <= MAX_GRAPH_ROWS or _is_capturing():
            return None
        if stream != self._stream:  # new stream: it waits for the buffers' last readers
            current = torch.cuda.current_stream(row_ids.device)
            if self._torch_stream is not None:
                current.wait_stream(self._torch_stream)
            self._stream, self._torch_stream = stream, current
        key = (1 << (num_rows - 1).bit_length(), row_ids.dtype)
        graph = self._graphs.get(key)
        if graph is None:
            if key not in self._seen:  # a launcher made for one call never captures
                self._seen.add(key)
                return None
            graph = self._capture(*key, row_ids.device)
        keys, values, indices = self._buffers[row_ids.dtype]
        keys[:num_rows].view(row_ids.shape).copy_(row_ids)
        graph.replay()
        return values, indices

    def _capture(self, bucket: int, dtype: torch.dtype, device) -> torch.cuda.CUDAGraph:
        """The bucket's graph: sort keys[:bucket] into values/indices, then re-pad keys
        (buffers grown to the bucket first; graphs over smaller buffers are dropped)."""
        pad = torch.iinfo(dtype).max
        if dtype not in self._buffers or self._buffers[dtype][0].numel() < bucket:
            self._graphs = {k: g for k, g in self._graphs.items() if k[1] != dtype}
            self._buffers[dtype] = (torch.full((bucket,), pad, dtype=dtype, device=device),
                                    torch.empty(bucket, dtype=dtype, device=device),
                                    torch.empty(bucket, dtype=torch.int64, device=device))
        keys, values, indices = (b[:bucket] for b in self._buffers[dtype])
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: cub sizes its workspace outside the capture
            torch.sort(keys, out=(values, indices))
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            torch.sort(keys, out=(values, indices))
            keys.fill_(pad)
        self._pool = graph.pool()  # graphs replay one at a time on one stream: one pool
        self._graphs[bucket, dtype] = graph
        return graph

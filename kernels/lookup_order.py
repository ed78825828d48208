"""Id ordering of sorted lookups (kernels/lookup_launch.py), replayed from CUDA graphs.

`GraphSort(order, table_rows)` orders ids by row (`order="sort"`: torch.sort) or by table
block (`"blocks"`: a counting sort by `row >> shift`, kernels/lookup_order_kernel.py; blocks
of at least `MIN_BLOCK_BYTES`, at most `MAX_BLOCKS` of them). Two ways in:

- `sorter.run_fused(call_key(row_ids, out), row_ids, stream, launch)`: the whole sorted
  lookup as one graph replay, captured per call key (the ids' and the output's addresses,
  shapes, strides and dtypes: vLLM's staging buffers keep theirs call after call) the
  `FUSE_AT`-th time it is met: ordering of exactly these ids and `launch(sorted_ids,
  dst_rows)`, the lookup kernel. True if the call's lookup ran so. The launcher looks its
  calls up in `sorter.fused` before anything else and replays a hit (`sorter.replay`).
- `sorter(row_ids, stream)` -> `(sorted_ids, dst_rows)`: the first `row_ids.numel()` entries
  ordered (buffers of the size bucket's size, owned by the sorter, rewritten by its next
  call), for the caller to launch on; from a graph per size bucket, captured the second time
  the bucket is met.

Both give None / False where the caller must sort itself: outside [MIN_GRAPH_ROWS,
MAX_GRAPH_ROWS], during a CUDA-graph capture, before the capture (`engram_lookup` makes a
launcher per call, and a capture costs 2.5-12 ms of host time).

NOTES:
- `torch.sort` of 65K-1.57M int32 ids costs 69-76 us of host time per call on the H200 machine
  (torch 2.11: a copy, cub's radix-sort passes, allocations, each launched from Python); a
  graph that sorts a static buffer and re-pads it costs one copy in + one replay: 16.5-18 us;
  with the lookup kernel launched after it, 27-42 us (benchmarks/results/model_lookup/
  history.jsonl, run f2bdaad).
  One replay of ordering + lookup leaves the replay alone.
- The lookup writes row i of the ids to output row i whatever order it reads them in, so
  any ordering gives the same output bit for bit; the order only decides which rows are
  read together (for host tables: which page translations are shared).
- Bucket buffers are padded to the next power of two with the dtype's largest value: pads
  order last (cub's radix sort is stable; the counting sort leaves them out).
- Buffers are reused call after call: on one stream the next copy in is queued after the last
  launch that read them; a call on another stream first makes that stream wait for the last
  one (`wait_stream`, only when the stream changes).
"""

from __future__ import annotations

import torch

MIN_GRAPH_ROWS = 1 << 15  # below: torch.sort (the policy sorts host lookups from 32,784 rows)
MAX_GRAPH_ROWS = 1 << 21  # above: torch.sort (bounds the buffers: 16 bytes a row per dtype)
ORDERS = ("sort", "blocks")
FUSE_AT = 3  # sightings of one fused key before its capture (the bucket graph: 2)
MAX_FUSED = 64  # fused graphs per sorter (one per distinct ids/output address and size)
MAX_BLOCKS = 1 << 15  # counting-sort blocks: one program scans them
MIN_BLOCK_BYTES = 1 << 18  # 256 KiB blocks at least (host translation reach: ~128 MiB)
ROW_BYTES_FOR_BLOCKS = 264
_ORDER_BLOCK = 1024  # ids per program of the counting-sort kernels
_is_capturing = (getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)  # ~1 us less
                 or torch.cuda.is_current_stream_capturing)


def block_shift(table_rows: int, row_bytes: int = ROW_BYTES_FOR_BLOCKS) -> tuple[int, int]:
    """(shift, number of blocks) of the counting sort for a table of `table_rows` rows: blocks
    of 2^shift rows, at least MIN_BLOCK_BYTES each, at most MAX_BLOCKS of them."""
    shift = 0
    while (1 << shift) * row_bytes < MIN_BLOCK_BYTES:
        shift += 1
    while -(-table_rows // (1 << shift)) > MAX_BLOCKS:
        shift += 1
    return shift, max(1, -(-table_rows // (1 << shift)))


def order_by_blocks(ids: torch.Tensor, values: torch.Tensor, indices: torch.Tensor,
                    counts: torch.Tensor, starts: torch.Tensor, shift: int,
                    num_blocks: int) -> None:
    """values/indices[:n] = the n ids `[T, C]` (any token stride) and their flat positions,
    ordered by block `row >> shift` (order inside a block: arbitrary; pads left out). counts:
    int32 `[num_blocks]` zeros (left zeroed), starts: int32 scratch of that size."""
    import triton

    from engram_ray.kernels.lookup_order_kernel import _count_blocks, _scan_blocks, _scatter_ids
    num_rows = ids.numel()
    ids_cols, ids_stride = 0, 0
    if not ids.is_contiguous():
        ids_cols, ids_stride = ids.shape[1], ids.stride(0)
    grid = (-(-num_rows // _ORDER_BLOCK),)
    shape = dict(SHIFT=shift, NUM_BLOCKS=num_blocks, PAD=torch.iinfo(ids.dtype).max,
                 IDS_COLS=ids_cols, BLOCK=_ORDER_BLOCK)
    _count_blocks[grid](ids, counts, num_rows, ids_stride, **shape, num_warps=4)
    _scan_blocks[(1,)](counts, starts, NUM_SLOTS=triton.next_power_of_2(num_blocks),
                       NUM_BLOCKS=num_blocks, num_warps=16)
    _scatter_ids[grid](ids, starts, values, indices, num_rows, ids_stride, **shape, num_warps=4)


def call_key(row_ids: torch.Tensor, out: torch.Tensor) -> tuple:
    """What a fused graph bakes in of a call: the ids' and the output's address, shape,
    strides and dtype (the launch decisions follow from these)."""
    return (row_ids.data_ptr(), row_ids.shape, row_ids.stride(), row_ids.dtype,
            out.data_ptr(), out.shape, out.stride(), out.dtype)


class GraphSort:
    """Ordered ids and their positions for one launcher's lookups (module doc)."""

    def __init__(self, order: str = "sort", table_rows: int = 1):
        if order not in ORDERS:
            raise ValueError(f"order is {order!r}; expected one of {ORDERS}")
        self.order = order
        self.shift, self.num_blocks = block_shift(table_rows)
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (bucket, dtype) -> graph
        # call key (`call_key`) -> (graph, ids dtype); read by the launcher before anything
        # else, so changed in place only
        self.fused: dict[tuple, tuple] = {}
        self._buffers: dict[torch.dtype, tuple] = {}  # dtype -> (keys, values, indices)
        self._seen: dict[tuple, int] = {}  # sightings of buckets and fused keys
        self._counts = self._starts = None  # counting sort: int32 [num_blocks] each
        self._pool = self._device = None
        self._stream = self._torch_stream = None  # the last call's stream: handle, torch

    def run_fused(self, key: tuple, row_ids: torch.Tensor, stream, launch) -> bool:
        """This call's lookup as one replay of ordering + `launch` (module doc); `key` is
        `call_key(row_ids, out)`."""
        if _is_capturing():  # the caller's capture records the ordering op by op
            return False
        fused = self.fused.get(key)
        if fused is None:
            num_rows = row_ids.numel()
            if (not MIN_GRAPH_ROWS <= num_rows <= MAX_GRAPH_ROWS or len(self.fused) >= MAX_FUSED
                    or self._sighted(key) < FUSE_AT):
                return False
            fused = self._capture_fused(key, row_ids, launch)
        return self.replay(fused, stream)

    def replay(self, fused: tuple, stream) -> bool:
        """Replay a fused graph (an entry of `fused`) on the current stream; False inside a
        caller's capture (nothing done)."""
        if _is_capturing():
            return False
        if stream != self._stream:
            self._use_stream(stream, None)
        fused[0].replay()
        return True

    def __call__(self, row_ids: torch.Tensor, stream) -> tuple | None:
        num_rows = row_ids.numel()
        if not MIN_GRAPH_ROWS <= num_rows <= MAX_GRAPH_ROWS or _is_capturing():
            return None
        key = (1 << (num_rows - 1).bit_length(), row_ids.dtype)
        graph = self._graphs.get(key)
        if graph is None:
            if self._sighted(key) < 2:  # a launcher made for one call never captures
                return None
            graph = self._capture_bucket(*key, row_ids.device)
        self._use_stream(stream, row_ids.device)
        keys, values, indices = self._buffers[row_ids.dtype]
        keys[:num_rows].view(row_ids.shape).copy_(row_ids)
        graph.replay()
        return values, indices

    def order_now(self, row_ids: torch.Tensor) -> tuple:
        """`(sorted_ids, dst_rows)` of `row_ids` in fresh tensors, op by op (the first call of
        a bucket, sizes outside the graphs' range, inside a caller's CUDA-graph capture)."""
        if self.order == "sort":
            return row_ids.reshape(-1).sort()
        num_rows, device = row_ids.numel(), row_ids.device
        values = torch.empty(num_rows, dtype=row_ids.dtype, device=device)
        indices = torch.empty(num_rows, dtype=torch.int64, device=device)
        counts = torch.zeros(self.num_blocks, dtype=torch.int32, device=device)
        order_by_blocks(row_ids, values, indices, counts, torch.empty_like(counts), self.shift,
                        self.num_blocks)
        return values, indices

    def _sighted(self, key: tuple) -> int:
        if len(self._seen) > 4 * MAX_FUSED:  # many one-off keys: start counting afresh
            self._seen.clear()
        self._seen[key] = seen = self._seen.get(key, 0) + 1
        return seen

    def _use_stream(self, stream, device) -> None:
        if stream != self._stream:  # new stream: it waits for the buffers' last readers
            current = torch.cuda.current_stream(device or self._device)
            if self._torch_stream is not None:
                current.wait_stream(self._torch_stream)
            self._stream, self._torch_stream = stream, current

    def _order(self, ids: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> None:
        """values/indices[:n] = `ids` (n of them, `[T, C]`, any token stride) in order."""
        num_rows = ids.numel()
        if self.order == "sort":
            keys = self._buffers[ids.dtype][0][:num_rows]
            if ids.data_ptr() != keys.data_ptr():
                keys.view(ids.shape).copy_(ids)
            torch.sort(keys, out=(values[:num_rows], indices[:num_rows]))
            keys.fill_(torch.iinfo(ids.dtype).max)
            return
        if self._counts is None:
            self._counts = torch.zeros(self.num_blocks, dtype=torch.int32, device=ids.device)
            self._starts = torch.empty_like(self._counts)
        order_by_blocks(ids, values, indices, self._counts, self._starts, self.shift,
                        self.num_blocks)

    def _grow(self, bucket: int, dtype: torch.dtype, device) -> None:
        """Buffers of at least `bucket` entries for `dtype` (graphs over smaller ones dropped)."""
        self._device = device
        if dtype not in self._buffers or self._buffers[dtype][0].numel() < bucket:
            self._graphs = {k: g for k, g in self._graphs.items() if k[1] != dtype}
            for stale in [k for k, g in self.fused.items() if g[1] == dtype]:
                del self.fused[stale]
            pad = torch.iinfo(dtype).max
            self._buffers[dtype] = (torch.full((bucket,), pad, dtype=dtype, device=device),
                                    torch.empty(bucket, dtype=dtype, device=device),
                                    torch.empty(bucket, dtype=torch.int64, device=device))

    def _capture(self, device, work) -> torch.cuda.CUDAGraph:
        """`work()` captured (run once first on a side stream: cub sizes its workspace and
        Triton compiles outside the capture); graphs share one pool (one stream, in turn)."""
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            work()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            work()
        self._pool = graph.pool()
        return graph

    def _capture_bucket(self, bucket: int, dtype: torch.dtype, device) -> torch.cuda.CUDAGraph:
        """The bucket's graph: order keys[:bucket] into values/indices, re-pad keys."""
        self._grow(bucket, dtype, device)
        keys, values, indices = (b[:bucket] for b in self._buffers[dtype])

        def work():
            self._order(keys.view(bucket, 1), values, indices)
            if self.order != "sort":  # the sort re-pads its keys itself
                keys.fill_(torch.iinfo(dtype).max)

        self._graphs[bucket, dtype] = graph = self._capture(device, work)
        return graph

    def _capture_fused(self, key: tuple, row_ids: torch.Tensor, launch) -> torch.cuda.CUDAGraph:
        """The key's graph: order `row_ids` (read where they lie) and launch the lookup."""
        num_rows = row_ids.numel()
        self._grow(1 << (num_rows - 1).bit_length(), row_ids.dtype, row_ids.device)
        _, values, indices = self._buffers[row_ids.dtype]

        def work():
            self._order(row_ids, values, indices)
            launch(values, indices)

        self.fused[key] = fused = (self._capture(row_ids.device, work), row_ids.dtype)
        return fused

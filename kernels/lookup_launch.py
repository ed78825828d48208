"""Prepared launches of the Engram lookup kernel (kernels/lookup_kernel.py) for one table.

`LookupLauncher(head_dim=..., table=... | peer_bases=..., rows_per_rank=...)` checks the table
once and, per (tiles, sort, output, ids dtype and layout, pointer alignment), makes the launch
decisions once: tile config from the policy (`kernels/lookup_policy.py`), persistent-grid cap,
constexprs, and, after the first launch through Triton's JIT, the compiled kernel's handle.
A call `launcher(row_ids, out)` then only counts programs and launches, writing `out` in place.

NOTES:
- Triton's JIT costs ~20 us of host time per launch (binding and specializing every argument,
  a cache-key hash, launch hooks); the decisions it makes depend only on what the entry key
  holds (argument dtypes, 16-byte pointer alignment, constexprs; the three ints are not
  specialized), so a compiled kernel found once is launched directly after that.
- Sorted lookups order their ids through `GraphSort` (kernels/lookup_order.py): once an
  (ids address, output address, size) has come back `FUSE_AT` times, ordering and lookup
  replay as one CUDA graph; other calls replay the ordering from a graph per size bucket and
  launch the kernel after it (torch.sort op by op: 69-76 us of host time).
- vLLM hands each layer's hashes as a column slice of `[T, L, C]` int32: the kernel reads them
  through their token stride (IDS_COLS), so no id is converted or copied before the launch.
"""

# Over 300 lines: one table's launch path (its checks, the decisions made once per entry key,
# direct and JIT launches, the sorted and fused-graph paths, the host-pointer fallback) in one
# class whose state every step shares; the policy and the ordering live in their own files.

from __future__ import annotations

import contextlib
import inspect
import math

import torch

from engram_ray.kernels.lookup_kernel import SCALE_WORDS, _engram_lookup_kernel
from engram_ray.kernels.lookup_order import GraphSort, call_key
from engram_ray.kernels.lookup_policy import (ORDER_BY, SORT_MIN_ROWS, choose_block_rows,
                                              large_tile_window, split_words, tile_config)
from engram_ray.model.reference import row_bytes_for
from engram_ray.tables.backends.host_memory import is_huge_page_backed

OUT_DTYPES = {torch.uint8: "packed", torch.bfloat16: "bf16"}
MAX_ROWS_PER_LAUNCH = 1 << 30
_PARAMS = inspect.signature(_engram_lookup_kernel.fn).parameters
_RUNTIME_ARGS = 8  # src, row_ids, dst_rows, out, num_rows, rows_per_rank, num_programs, ids_stride
# Non-empty while Triton accepts pinned host tensors as pointers (it resolves their UVA address).
_HOST_POINTERS_OK = [True]


def table_placement(table: torch.Tensor | None, peer_bases: torch.Tensor | None) -> str:
    """'hbm', 'host' (pinned small pages), 'host_thp' (registered huge pages) or 'peer'."""
    if peer_bases is not None:
        return "peer"
    if table.is_cuda:
        return "hbm"
    return "host_thp" if is_huge_page_backed(table) else "host"


def check_table(head_dim, table, peer_bases, rows_per_rank, is_interpreted=False) -> None:
    """ValueError naming what is wrong with a table (or peer slices) for the kernel.
    `is_interpreted`: launches on CPU tensors (Triton's interpreter) read any memory."""
    if head_dim // 32 not in SCALE_WORDS or head_dim % 32:
        # NOTES: rows are head_dim + head_dim / 32 bytes; the kernel tells Triton their real
        # alignment (gcd(row bytes, 8)), so 264-byte rows load as 8-byte vectors and 33-, 66- and
        # 132-byte rows as narrower ones; the scale word is as wide as the row's alignment.
        raise ValueError(f"head_dim is {head_dim}; the kernel supports "
                         f"{sorted(32 * n for n in SCALE_WORDS)}; use "
                         "engram_ray.model.reference.lookup_reference otherwise")
    if (table is None) == (peer_bases is None):
        raise ValueError("pass exactly one of table= (packed [rows, row_bytes]) or "
                         "peer_bases= (int64 CUDA [P] slice addresses) with rows_per_rank=")
    if table is not None:
        if table.dtype != torch.uint8 or table.dim() != 2 or not table.is_contiguous():
            raise ValueError(f"table is {table.dtype} {tuple(table.shape)}; expected a "
                             "contiguous packed uint8 [rows, row_bytes] tensor")
        if table.shape[1] != row_bytes_for(head_dim):
            raise ValueError(f"table rows are {table.shape[1]} bytes; expected "
                             f"{row_bytes_for(head_dim)} for head_dim {head_dim}")
        if not (table.is_cuda or table.is_pinned() or is_interpreted):
            raise ValueError("table is in pageable host memory; expected a CUDA tensor or "
                             "pinned host memory (engram_ray.tables.backends.host_memory.allocate_host_table)")
    else:
        if (peer_bases.dtype != torch.int64 or peer_bases.dim() != 1
                or not (peer_bases.is_cuda or is_interpreted)):
            raise ValueError(f"peer_bases is {peer_bases.dtype} {tuple(peer_bases.shape)} on "
                             f"{peer_bases.device}; expected int64 CUDA [P]")
        if not rows_per_rank or rows_per_rank < 1:
            raise ValueError(f"rows_per_rank is {rows_per_rank!r}; expected a positive int "
                             "with peer_bases")


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # CPU tensors: Triton's interpreter (tests/cpu)
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch_hooks():
    """Triton's launch-hook chain (a profiler adds hooks): direct launches skip hooks, so they
    are used only while the chain is empty. None where this Triton has no such chain."""
    try:
        from triton import knobs
        return getattr(knobs.runtime.launch_enter_hook, "calls", None)
    except (ImportError, AttributeError):
        return None


class _Launch:
    """The decisions for one entry key, and the compiled kernel once Triton's JIT found it."""

    __slots__ = ("block_rows", "max_programs", "num_warps", "is_sorted", "constexprs",
                 "direct", "direct_args")

    def __init__(self, block_rows, max_programs, num_warps, is_sorted, constexprs):
        self.block_rows, self.max_programs, self.num_warps = block_rows, max_programs, num_warps
        self.is_sorted, self.constexprs = is_sorted, constexprs
        self.direct = self.direct_args = None

    def adopt(self, compiled) -> None:
        """Keep what a direct launch needs, if Triton returned a compiled kernel: the call
        `direct(grid, 1, 1, stream, *direct_args, *kernel_args)` is the one Triton's JIT makes
        (`kernel.run(..., function, packed_metadata, launch_metadata, enter_hook, exit_hook,
        *args)`, no hooks), or, where the launcher needs no scratch memory, the C launch it
        wraps (`launch(..., function, cooperative, pdl, scratch, profile_scratch, ...)`)."""
        if not all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
            return
        run = compiled.run  # the launcher; loads the module on first access
        tail = (compiled.packed_metadata, None, None, None)
        if (getattr(run, "global_scratch_size", 1) == 0
                and getattr(run, "profile_scratch_size", 1) == 0
                and callable(getattr(run, "launch", None))
                and hasattr(run, "launch_cooperative_grid") and hasattr(run, "launch_pdl")):
            self.direct = run.launch
            self.direct_args = (compiled.function, run.launch_cooperative_grid, run.launch_pdl,
                                None, None, *tail)
        else:
            self.direct, self.direct_args = run, (compiled.function, *tail)


class LookupLauncher:
    """Lookups of one table into caller-owned outputs (module doc).

    `launcher(row_ids, out)`: row_ids int32/int64 `[T, C]` (-1 = no row), contiguous or with
    unit column stride, on `device`; out contiguous uint8 `[T, C, row_bytes]` (packed) or bf16
    `[T, C, head_dim]`, on `device`. Returns `out`. Options (`block_rows`, `programs_per_sm`,
    `num_warps`, `prefetch`, `sort_rows`, `order`: "sort" by row or "blocks" by table block):
    None = the measured policy; `fuse_graphs=False` keeps sorted lookups off fused graphs.
    """

    def __init__(self, *, head_dim: int, table: torch.Tensor | None = None,
                 peer_bases: torch.Tensor | None = None, rows_per_rank: int | None = None,
                 device: torch.device | None = None, block_rows: int | None = None,
                 programs_per_sm: int | None = None, num_warps: int | None = None,
                 prefetch: bool | None = None, sort_rows: bool | None = None,
                 order: str | None = None, fuse_graphs: bool = True):
        self.head_dim, self.row_bytes = head_dim, row_bytes_for(head_dim)
        is_interpreted = device is not None and device.type == "cpu"
        check_table(head_dim, table, peer_bases, rows_per_rank, is_interpreted)
        self.placement = table_placement(table, peer_bases)
        if table is not None and not table.is_cuda and not _HOST_POINTERS_OK:
            peer_bases, rows_per_rank = self._host_as_peer(table, device)
            table = None
        self.table, self.peer_bases = table, peer_bases
        self.rows_per_rank = rows_per_rank or 1
        self.device = device or self._default_device()
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        self._options = dict(block_rows=block_rows, programs_per_sm=programs_per_sm,
                             num_warps=num_warps, prefetch=prefetch, sort_rows=sort_rows)
        self._num_sms = _num_sms(self.device)
        self._table_rows = (self.table.shape[0] if self.table is not None
                            else self.rows_per_rank * self.peer_bases.numel())
        self._large_rows = large_tile_window(self.placement, self._table_rows)
        self._sort_min_rows = SORT_MIN_ROWS[self.placement]
        self._launches: dict[tuple, _Launch] = {}
        self._hooks = _launch_hooks()
        self._fuse_graphs = fuse_graphs
        self._stream = self._current_device = self._graph_sort = None
        self._fused = {}  # the sorter's fused graphs by call key (empty: no sorted lookups)
        if self.device.type == "cuda":
            self._graph_sort = GraphSort(order or ORDER_BY[self.placement], self._table_rows)
            if fuse_graphs:
                self._fused = self._graph_sort.fused
            from triton.runtime import driver
            self._stream = driver.active.get_current_stream
            self._current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)

    def _default_device(self) -> torch.device:
        for tensor in (self.peer_bases, self.table):
            if tensor is not None and tensor.is_cuda:
                return tensor.device
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    @staticmethod
    def _host_as_peer(table, device):
        """A one-rank peer table at the pinned table's address (Triton refused host pointers)."""
        device = device or torch.device("cuda", torch.cuda.current_device())
        return torch.tensor([table.data_ptr()], dtype=torch.int64, device=device), table.shape[0]

    @property
    def src(self) -> torch.Tensor:
        return self.table if self.table is not None else self.peer_bases

    def __call__(self, row_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        # Long because it is the serving hot path (< 20 us of host time a call): checks, the
        # prepared launch, the sorted and fused branches and the launch itself inline, with
        # no helper calls that would each cost Python overhead.
        fused = self._fused
        if fused:  # a sorted lookup met before at these addresses: one replay
            graph = fused.get(call_key(row_ids, out))
            if (graph is not None and not self._hooks
                    and self._graph_sort.replay(graph, self._stream(self._device_index))):
                return out
        num_rows = row_ids.numel()
        if num_rows == 0:
            return out
        if not num_rows < MAX_ROWS_PER_LAUNCH:
            raise ValueError(f"lookup of {num_rows} rows; expected fewer than 2^30 per call")
        ids_cols, ids_stride = 0, 0
        if not row_ids.is_contiguous():
            if row_ids.dim() == 2 and row_ids.stride(1) == 1:
                ids_cols, ids_stride = row_ids.shape[1], row_ids.stride(0)
            else:
                row_ids = row_ids.contiguous()
        large_min, large_max = self._large_rows
        out_dtype = out.dtype
        key = (large_min <= num_rows < large_max, num_rows >= self._sort_min_rows, out_dtype,
               row_ids.dtype, ids_cols, row_ids.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0)
        launch = self._launches.get(key)
        if launch is None:
            launch = self._prepare(key, num_rows, row_ids, out)
        width = self.row_bytes if out_dtype == torch.uint8 else self.head_dim
        device_index = out.get_device()
        if (out.numel() != num_rows * width or not out.is_contiguous()
                or device_index != self._device_index or row_ids.get_device() != device_index):
            raise ValueError(f"out is {out.dtype} {tuple(out.shape)} on {out.device} for ids "
                             f"{tuple(row_ids.shape)} on {row_ids.device}; expected a contiguous "
                             f"{tuple(row_ids.shape) + (width,)} output and ids on {self.device}")
        ids = dst_rows = row_ids
        num_programs = min(-(-num_rows // launch.block_rows), launch.max_programs)
        is_direct = (launch.direct is not None and not self._hooks
                     and self._current_device() == device_index)
        if launch.is_sorted:
            sorter = self._graph_sort
            if sorter is None:  # CPU tensors (Triton's interpreter)
                ids, dst_rows = row_ids.reshape(-1).sort()
            else:
                stream = self._stream(device_index)
                if is_direct and self._fuse_graphs and sorter.run_fused(
                        call_key(row_ids, out), row_ids, stream,
                        lambda ids, dst: self._launch_direct(launch, ids, dst, out, num_rows,
                                                             num_programs, device_index)):
                    return out  # ordering + lookup: one graph replay
                ids, dst_rows = sorter(row_ids, stream) or sorter.order_now(row_ids)
            ids_stride = 0
        args = (self.src, ids, dst_rows, out, num_rows, self.rows_per_rank, num_programs,
                ids_stride, *launch.constexprs)
        if is_direct:
            launch.direct(num_programs, 1, 1, self._stream(device_index), *launch.direct_args,
                          *args)
        elif not self._launch_jit(launch, args, num_programs):
            return self(row_ids, out)  # the table is now read as a one-rank peer table
        return out

    def _launch_direct(self, launch: _Launch, ids, dst_rows, out, num_rows, num_programs,
                       device_index) -> None:
        """A sorted launch of the compiled kernel on the current stream (inside a capture:
        the capture's)."""
        launch.direct(num_programs, 1, 1, self._stream(device_index), *launch.direct_args,
                      self.src, ids, dst_rows, out, num_rows, self.rows_per_rank, num_programs,
                      0, *launch.constexprs)

    def _launch_jit(self, launch: _Launch, args: tuple, num_programs: int) -> bool:
        """Launch through Triton's JIT (compiling on first use) and keep the compiled kernel.
        False if Triton refused the pinned host table's pointer: the launcher then reads it as
        a one-rank peer table at its UVA address, and the call must be repeated."""
        is_cuda = self.device.type == "cuda"
        try:
            with torch.cuda.device(self._device_index) if is_cuda else contextlib.nullcontext():
                compiled = _engram_lookup_kernel[(num_programs,)](*args,
                                                                   num_warps=launch.num_warps)
        except ValueError as exc:
            if (self.table is None or self.table.is_cuda
                    or "cannot be accessed" not in str(exc)):
                raise
            _HOST_POINTERS_OK.clear()
            self.peer_bases, self.rows_per_rank = self._host_as_peer(self.table, self.device)
            self.table, self._launches = None, {}
            return False
        launch.adopt(compiled)
        return True

    def _prepare(self, key: tuple, num_rows: int, row_ids, out) -> _Launch:
        """The decisions for this entry key (module doc), made once."""
        _, is_sorted, out_dtype, _, ids_cols, _, _ = key
        if out_dtype not in OUT_DTYPES:
            raise ValueError(f"out is {out_dtype}; expected uint8 (packed rows) or bfloat16")
        if row_ids.dtype not in (torch.int32, torch.int64) or row_ids.dim() != 2:
            raise ValueError(f"row_ids are {row_ids.dtype} {tuple(row_ids.shape)}; expected "
                             "int32 or int64 [num_tokens, num_cols]")
        opts = self._options
        out_kind = OUT_DTYPES[out_dtype]
        block_rows = opts["block_rows"] or choose_block_rows(num_rows, self.row_bytes,
                                                             self.placement, self._table_rows)
        config = tile_config(self.placement, block_rows)
        prefetch = config.prefetch if opts["prefetch"] is None else opts["prefetch"]
        sort = is_sorted if opts["sort_rows"] is None else opts["sort_rows"]
        is_peer = self.peer_bases is not None
        constexprs = dict(
            HEAD_DIM=self.head_dim, SCALE_WORD=SCALE_WORDS[self.head_dim // 32],
            BLOCK_R=block_rows, IS_PEER=is_peer, IS_SORTED=bool(sort),
            IS_BF16=out_kind == "bf16", PREFETCH=prefetch, ROW_ALIGN=math.gcd(self.row_bytes, 8),
            ROWS_32=is_peer and config.rows_32
            and self.rows_per_rank * self.peer_bases.numel() < 2**31,
            SPLIT_WORDS=split_words(config, self.head_dim, out_kind),
            IDS_COLS=0 if sort else ids_cols)
        # Every constexpr in the kernel's parameter order, defaults included (a direct launch
        # passes all parameters, as Triton's JIT does).
        ordered = tuple(constexprs[name] if name in constexprs else param.default
                        for name, param in list(_PARAMS.items())[_RUNTIME_ARGS:])
        launch = _Launch(block_rows, self._num_sms * (opts["programs_per_sm"]
                                                      or config.programs_per_sm),
                         opts["num_warps"] or config.num_warps, bool(sort), ordered)
        self._launches[key] = launch  # options are fixed per launcher: the key says it all
        return launch

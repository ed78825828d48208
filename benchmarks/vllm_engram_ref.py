"""vLLM's own Engram lookup (`_engram_lookup_kernel`) of a supported release (0.33 or 0.34),
loaded at run time from its wheel's `vllm/models/deepseek_v41/common/engram.py` (never
committed: `.vllm_ref/<version>/engram.py`, from `pip download --no-deps vllm==<version>.0` +
unzip; see benchmarks/gpu_model_lookup.sh), and launched the way
`ParallelEngramEmbedding.lookup` launches it. The two releases' kernels are the same text
(benchmarks/results/vllm_compat/ keeps its digest per release).

That file imports vLLM, which the GPU machines lack: only the `@triton.jit` kernel's source is
taken (by `ast`), written with triton/tl imports into a scratch module and imported (Triton's
JIT needs a source file). `_SORTED_IS_CONSTEXPR` is False as vLLM computes it on CUDA.
"""

from __future__ import annotations

import ast
import importlib.util
import tempfile
from pathlib import Path

import torch
import triton

REF_DIR = Path(__file__).resolve().parents[1] / ".vllm_ref"
VERSIONS = ("0.33", "0.34")  # engram_ray.vllm.compat.SUPPORTED["vllm"]
KERNEL = "_engram_lookup_kernel"
_HEADER = ("import triton\nimport triton.language as tl\n\n"
           "_SORTED_IS_CONSTEXPR = tl.constexpr(False)  # vLLM: Triton 3.8 on ROCm only\n\n\n")


def engram_file(version: str) -> Path:
    """`.vllm_ref/<version>/engram.py`: that release's engram.py, unzipped from its wheel."""
    if version not in VERSIONS:
        raise ValueError(f"vLLM {version}: expected one of {VERSIONS}")
    return REF_DIR / version / "engram.py"


def kernel_text(source: str, where: str) -> str:
    """`_engram_lookup_kernel`'s source, decorators included, from an engram.py's text."""
    found = [node for node in ast.parse(source).body
             if isinstance(node, ast.FunctionDef) and node.name == KERNEL]
    if not found:
        raise ValueError(f"{where} has no function {KERNEL}")
    node = found[0]
    start = min(d.lineno for d in node.decorator_list) - 1
    return "\n".join(source.splitlines()[start:node.end_lineno]) + "\n"


def load_kernel(version: str):
    """vLLM `version`'s `_engram_lookup_kernel` (a Triton JITFunction) from its engram.py."""
    path = engram_file(version)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: unzip it from the vLLM {version}.0 wheel "
                                "(benchmarks/gpu_model_lookup.sh says how)")
    scratch = Path(tempfile.mkdtemp(prefix="vllm_engram_")) / "vllm_engram_kernel.py"
    scratch.write_text(_HEADER + kernel_text(path.read_text(), str(path)))
    spec = importlib.util.spec_from_file_location("vllm_engram_kernel", scratch)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, KERNEL)


class VllmTable:
    """One table in vLLM's layout: values `[rows, dim]` fp8 + scales `[rows, dim // 32]`
    (HBM or pinned host), or peer buffers (`PEER_ROWS` rows of values, then their scales, per
    rank) addressed by a `[P]` int64 pointer table. `lookup(ids, out, sort)` is vLLM's
    `ParallelEngramEmbedding.lookup` for TP = 1, one shard (no head split)."""

    def __init__(self, kernel, packed_parts: list[torch.Tensor], head_dim: int,
                 placement: str, num_sms: int):
        """packed_parts: engram-ray's packed rows `[rows, row_bytes]` on the GPU (one table, or
        one part per peer rank); vLLM's copy is made from them (pinned host for "host")."""
        self.kernel, self.dim, self.num_sms = kernel, head_dim, num_sms
        self.peer_rows = 0
        if placement == "peer":
            self.peer_rows = packed_parts[0].shape[0]
            self.buffers = [torch.cat([p[:, :head_dim].reshape(-1), p[:, head_dim:].reshape(-1)])
                            for p in packed_parts]
            self.weight = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64,
                                       device="cuda:0")
            self.scales = self.weight  # unused with PEER_ROWS
            self.num_rows = self.peer_rows * len(packed_parts)
        else:
            (packed,) = packed_parts
            pin = placement == "host"
            self.weight = _copy_columns(packed, 0, head_dim, pin).view(torch.float8_e4m3fn)
            self.scales = _copy_columns(packed, head_dim, packed.shape[1], pin)
            self.num_rows = packed.shape[0]

    def lookup(self, indices: torch.Tensor, out: torch.Tensor, sort: bool = False) -> None:
        """vLLM's lookup of `indices` `[T, C]` (any strides) into `out` `[T, C, width]`."""
        num_cols = indices.shape[1]
        rows = indices.shape[0] * num_cols
        if not rows:
            return
        ids_stride_t, ids_stride_h = indices.stride()
        dst = indices
        if sort:  # vLLM's path past its sort threshold (GB200): ids in table order
            local = indices[:, 0:num_cols] - 0
            indices, dst = local.flatten().sort()
            dst = dst.int()
        grid = min(triton.cdiv(rows, 16), self.num_sms)
        self.kernel[(grid,)](
            self.weight, self.scales, indices, dst, out, 0, self.num_rows, rows, ids_stride_t,
            ids_stride_h, HEAD_START=0, LOCAL_HEADS=num_cols, TOTAL_HEADS=num_cols,
            DIM=self.dim, QUANT_BLOCK=32, BLOCK_R=16, GRID=grid, SORTED=sort,
            PACKED=out.dtype == torch.uint8, OUT_STRIDE=out.stride(0),
            PEER_ROWS=self.peer_rows)


def _copy_columns(packed: torch.Tensor, start: int, end: int, pin: bool) -> torch.Tensor:
    """Columns [start, end) of a packed table as their own contiguous tensor (pinned host or
    on the table's device), copied in chunks."""
    columns = torch.empty(packed.shape[0], end - start, dtype=torch.uint8,
                          device="cpu" if pin else packed.device, pin_memory=pin)
    chunk = 1 << 22
    for first in range(0, packed.shape[0], chunk):
        columns[first:first + chunk].copy_(packed[first:first + chunk, start:end])
    return columns

"""Pinned host memory for Engram tables that GPUs read through UVA.

`use_thp=True`: an anonymous mmap advised MADV_HUGEPAGE, aligned to 2 MiB, prefaulted so the
kernel backs it with transparent huge pages, then registered with CUDA (cudaHostRegister,
portable + mapped). Fewer, larger pages mean fewer translation misses for random row reads.
Any failure falls back to ordinary pinned memory (torch's `pin_memory`), with the reason logged.
"""

from __future__ import annotations

import logging
import mmap
import weakref

import numpy as np
import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every context, device-visible.
_REGISTER_FLAGS = 0x1 | 0x2
# [start, end) address ranges of live huge-page registrations.
_HUGE_PAGE_RANGES: dict[int, int] = {}


def allocate_host_table(num_bytes: int, *, use_thp: bool = False) -> torch.Tensor:
    """Pinned host uint8 `[num_bytes]`, on transparent huge pages if `use_thp` and possible."""
    if num_bytes <= 0:
        raise ValueError(f"num_bytes is {num_bytes}; expected a positive size")
    if use_thp:
        tensor, reason = _allocate_huge_pages(num_bytes)
        if tensor is not None:
            return tensor
        logger.warning("Engram huge-page host table unavailable (%s); using ordinary pinned "
                       "memory", reason)
    # Ordinary pinned pages (cudaHostAlloc through torch's host allocator).
    return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)


def is_huge_page_backed(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lies in a registered huge-page allocation of this module."""
    if tensor.is_cuda:
        return False
    address = tensor.data_ptr()
    return any(start <= address < end for start, end in _HUGE_PAGE_RANGES.items())


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """AnonHugePages (bytes) of the mappings that hold `tensor`, from /proc/self/smaps."""
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low < end and high > start
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def _allocate_huge_pages(num_bytes: int) -> tuple[torch.Tensor | None, str]:
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None, "this platform has no MADV_HUGEPAGE"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as mode_file:
            mode = mode_file.read()
        if "[never]" in mode:
            return None, f"transparent huge pages are disabled ({mode.strip()})"
    except OSError:
        pass
    size = num_bytes + HUGE_PAGE_BYTES  # room to align the start to a huge page
    try:
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:
        return None, f"mmap/madvise failed: {exc}"
    owner = np.frombuffer(mapping, dtype=np.uint8)
    skip = -owner.ctypes.data % HUGE_PAGE_BYTES
    owner = owner[skip:skip + num_bytes]
    # Fault every page in before CUDA pins it, so the kernel can back it with huge pages.
    owner[::mmap.PAGESIZE] = 0
    tensor = torch.from_numpy(owner)
    pointer = tensor.data_ptr()
    result = torch.cuda.cudart().cudaHostRegister(pointer, num_bytes, _REGISTER_FLAGS)
    if int(getattr(result, "value", result)) != 0:
        return None, f"cudaHostRegister returned {result}"
    _HUGE_PAGE_RANGES[pointer] = pointer + num_bytes
    # The tensor's storage holds `owner`: unregister (then unmap) once the last view is gone.
    weakref.finalize(owner, _release, pointer, mapping)
    if not tensor.is_pinned():
        return None, "CUDA did not report the registered mapping as pinned"
    return tensor, ""


def _release(pointer: int, mapping: mmap.mmap) -> None:
    _HUGE_PAGE_RANGES.pop(pointer, None)
    torch.cuda.cudart().cudaHostUnregister(pointer)
    try:
        mapping.close()
    except BufferError:  # a buffer export is still alive; the OS frees it at exit
        pass

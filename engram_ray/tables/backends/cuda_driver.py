"""The CUDA driver through cuda-bindings, and the probes the peer path needs.

Supports `from cuda.bindings import driver` (cuda-bindings >= 12.6) and `from cuda import
cuda` (older cuda-python). Probes (used by the `cuda` backend and by `engram-ray doctor`):
VMM support, FABRIC handles (the device attribute can say yes while `cuMemCreate` returns
CUDA_ERROR_NOT_PERMITTED without an IMEX channel, so a trial allocation decides), POSIX-FD
export.
"""

from __future__ import annotations

import os
from functools import lru_cache

from engram_ray.tables.backends.base import PeerMemoryError

IMEX_CHANNEL_DIR = "/dev/nvidia-caps-imex-channels"


@lru_cache(maxsize=1)
def driver():
    """The cuda-bindings driver module (initialised), or raise with what to install."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        try:
            from cuda import cuda as cu
        except ImportError:
            raise PeerMemoryError("the cuda backend needs cuda-bindings: pip install "
                                  "'cuda-python>=12.6' (engram-ray[gpu])") from None
    check(cu.cuInit(0), "cuInit")
    return cu


def check(result, what: str):
    """Unpack a cuda-bindings `(CUresult, *values)` tuple; raise naming the error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise PeerMemoryError(f"{what} failed: {error_name(err)}")
    return values[0] if len(values) == 1 else (tuple(values) or None)


def use_device(device_idx: int):
    """Make `device_idx`'s primary context (the one torch uses) current; it, retained."""
    cu = driver()
    context = check(cu.cuDevicePrimaryCtxRetain(device_idx), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    return context


def error_name(err) -> str:
    cu = driver()
    _, name = cu.cuGetErrorName(err)
    return name.decode() if isinstance(name, bytes) else str(name)


def handle_type_enum(name: str):
    cu = driver()
    kinds = {"posix_fd": "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
             "fabric": "CU_MEM_HANDLE_TYPE_FABRIC"}
    return getattr(cu.CUmemAllocationHandleType, kinds[name])


def allocation_prop(device_idx: int, handle_types: list[str]):
    """Pinned device memory on `device_idx`, exportable as every type in `handle_types`."""
    cu = driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_idx
    flags = [handle_type_enum(t) for t in handle_types]
    prop.requestedHandleTypes = flags[0]
    if len(flags) > 1:
        try:  # a bit mask of every type; bindings that take enum members only keep the first
            prop.requestedHandleTypes = int(flags[0]) | int(flags[1])
        except (TypeError, ValueError, OverflowError):
            pass
    return prop


def granularity(prop) -> int:
    cu = driver()
    return int(check(cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity"))


def device_attribute(device_idx: int, name: str) -> int:
    cu = driver()
    return int(check(cu.cuDeviceGetAttribute(getattr(cu.CUdevice_attribute, name), device_idx),
                     f"cuDeviceGetAttribute({name})"))


def imex_channels() -> list[str]:
    """IMEX channel devices of this node (FABRIC handles need one)."""
    try:
        return sorted(os.listdir(IMEX_CHANNEL_DIR))
    except OSError:
        return []


def trial_allocation(device_idx: int, handle_type: str) -> str:
    """Create (and export) one granule with `handle_type`: 'ok' or the CUDA error name.
    Needs a current context on the device (`use_device`)."""
    cu = driver()
    try:
        prop = allocation_prop(device_idx, [handle_type])
        size = granularity(prop)
    except PeerMemoryError as exc:
        return str(exc)
    err, handle = cu.cuMemCreate(size, prop, 0)
    if int(err) != 0:
        return error_name(err)
    try:
        err, shareable = cu.cuMemExportToShareableHandle(handle, handle_type_enum(handle_type), 0)
        if int(err) != 0:
            return f"export: {error_name(err)}"
        if handle_type == "posix_fd":
            os.close(int(shareable))
        return "ok"
    finally:
        cu.cuMemRelease(handle)


@lru_cache(maxsize=None)
def usable_handle_types(device_idx: int) -> tuple[str, ...]:
    """Handle types this process can allocate and export on `device_idx`, best first.

    `ENGRAM_RAY_HANDLE_TYPE=posix_fd|fabric` restricts the choice (for tests and debugging)."""
    wanted = os.environ.get("ENGRAM_RAY_HANDLE_TYPE", "fabric,posix_fd").split(",")
    usable = []
    if "fabric" in wanted and device_attribute(
            device_idx, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"):
        if trial_allocation(device_idx, "fabric") == "ok":
            usable.append("fabric")
    if "posix_fd" in wanted and trial_allocation(device_idx, "posix_fd") == "ok":
        usable.append("posix_fd")
    return tuple(usable)

"""Memory backends of peer-group tables, behind one interface (`base.PeerMemory`): `shm`
(CPU, shared-memory files) and `cuda` (CUDA VMM slices, FABRIC or POSIX-FD handles); the handle
type a group's slices travel as (`handle_types`), the driver and its probes (`cuda_driver`) and
pinned host memory (`host_memory`). Descriptors pass between members through their slice
holders (`engram_ray.tables.slice_holder`)."""

import importlib

from engram_ray.tables import BACKENDS


def make_memory(settings, device: str):
    """This member's `base.PeerMemory` for its `engram_ray.tables.settings.PeerGroupSettings`:
    the class `engram_ray.tables.BACKENDS` names for `settings.backend`, which gets handle_type
    and cross_node (the cuda backend honours them, the shm backend refuses a CUDA handle type)."""
    module_name, class_name = BACKENDS[settings.backend].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(rank=settings.rank, size=settings.size, device=device, tag=settings.generation,
               handle_type=settings.handle_type, cross_node=settings.cross_node)

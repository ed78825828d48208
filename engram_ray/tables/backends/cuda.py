"""GPU backend: slices in CUDA virtual memory (cuMemCreate + cuMemAddressReserve + cuMemMap +
cuMemSetAccess), exported as FABRIC handles (IMEX) or POSIX file descriptors (one host).

Allocation requests every handle type this process can use (`usable_handle_types`: FABRIC only
after a trial allocation succeeds), or only the requested one (`handle_type`; `cross_node`
requests FABRIC), failing at construction when this GPU cannot use the request; the group's
type is the request every member made, else the first type every member offers, so all
members decide alike from the rendezvous records (`engram_ray.tables.backends.handle_types`). POSIX FDs
reach the peers through the members' slice holders (SCM_RIGHTS over a Unix socket:
`engram_ray.tables.holding`; no engine is open to ptrace); FABRIC handles travel in the records.
Peer slices are mapped with access for this GPU; `peer_bases` is the `[P]` int64 device tensor
of every rank's slice base, own included, that the lookup kernel reads.
"""

from __future__ import annotations

import torch

from engram_ray.tables.backends import cuda_driver as drv
from engram_ray.tables.backends.base import PeerMemory, PeerMemoryError, host_identity
from engram_ray.tables.backends.handle_types import (choose_handle_type, offered_types,
                                                     requested_type)


class _DeviceArray:
    """Exposes `[num_rows, row_bytes]` uint8 at a device address to torch.as_tensor."""

    def __init__(self, address: int, num_rows: int, row_bytes: int):
        self.__cuda_array_interface__ = {"shape": (num_rows, row_bytes), "typestr": "|u1",
                                         "data": (address, False), "strides": None,
                                         "version": 3}


class _Mapping:
    """One mapped allocation: `handle` mapped at `address` for `nbytes` (granule multiple)."""

    def __init__(self, handle, address: int, nbytes: int):
        self.handle, self.address, self.nbytes = handle, address, nbytes

    def release(self) -> None:
        cu = drv.driver()
        drv.check(cu.cuMemUnmap(self.address, self.nbytes), "cuMemUnmap")
        drv.check(cu.cuMemAddressFree(self.address, self.nbytes), "cuMemAddressFree")
        drv.check(cu.cuMemRelease(self.handle), "cuMemRelease")


class CudaPeerMemory(PeerMemory):
    name = "cuda"

    def __init__(self, *, rank: int, size: int, device: str = "cuda", tag: str,
                 handle_type: str | None = None, cross_node: bool = False):
        """`handle_type`: offer only this type ("fabric" | "posix_fd"; None: every usable
        one); `cross_node`: the group spans hosts, so only FABRIC. Raises PeerMemoryError
        when this GPU cannot use what is asked (see `offered_types`)."""
        super().__init__(rank=rank, size=size, device=device, tag=tag)
        dev = torch.device(device)
        if dev.type != "cuda":
            raise PeerMemoryError(f"the cuda backend needs a CUDA device, not {device!r}")
        self.requested = requested_type(handle_type, cross_node)  # published at rendezvous
        self.device_idx = dev.index if dev.index is not None else torch.cuda.current_device()
        drv.use_device(self.device_idx)
        try:
            self.offered = offered_types(drv.usable_handle_types(self.device_idx),
                                         self.requested, self.device_idx)
        except PeerMemoryError:
            drv.driver().cuDevicePrimaryCtxRelease(self.device_idx)  # no close() will follow
            raise
        self._own: dict[int, _Mapping] = {}
        self._shapes: dict[int, tuple[int, int]] = {}
        self._peers: dict[int, dict[int, _Mapping]] = {}
        self._bases: dict[int, torch.Tensor] = {}
        self._chosen = ""
        self.peer_access = ""  # how this GPU maps peers' slices (`_set_access`)

    @property
    def handle_type(self) -> str:
        return self._chosen or "/".join(self.offered)

    def _access_desc(self, writable: bool = True):
        cu = drv.driver()
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.device_idx
        desc.flags = (cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE if writable
                      else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ)
        return desc

    def _set_access(self, mapping: _Mapping, writable: bool) -> None:
        """This GPU's access to `mapping`: read-write for its own slices, read-only for a
        peer's (a bug or a stranger in this process cannot rewrite another member's rows),
        read-write where the driver refuses read-only device access (`peer_access` says
        which it got)."""
        cu = drv.driver()
        if not writable:
            err, = cu.cuMemSetAccess(mapping.address, mapping.nbytes,
                                     [self._access_desc(False)], 1)
            if int(err) == 0:
                self.peer_access = "read"
                return
            self.peer_access = f"readwrite (read-only refused: {drv.error_name(err)})"
        drv.check(cu.cuMemSetAccess(mapping.address, mapping.nbytes,
                                    [self._access_desc(True)], 1), "cuMemSetAccess")

    def _map(self, handle, nbytes: int, alignment: int, writable: bool = True) -> _Mapping:
        """Reserve, map and enable access for this GPU (`writable`: for its own slices);
        on failure nothing stays held."""
        cu = drv.driver()
        try:
            address = int(drv.check(cu.cuMemAddressReserve(nbytes, alignment, 0, 0),
                                    "cuMemAddressReserve"))
        except PeerMemoryError:
            cu.cuMemRelease(handle)
            raise
        try:
            drv.check(cu.cuMemMap(address, nbytes, 0, handle, 0), "cuMemMap")
        except PeerMemoryError:
            cu.cuMemAddressFree(address, nbytes)
            cu.cuMemRelease(handle)
            raise
        mapping = _Mapping(handle, address, nbytes)
        try:
            self._set_access(mapping, writable)
        except PeerMemoryError:
            mapping.release()
            raise
        return mapping

    def allocate(self, key: int, num_rows: int, row_bytes: int) -> torch.Tensor:
        cu = drv.driver()
        prop = drv.allocation_prop(self.device_idx, list(self.offered))
        granule = drv.granularity(prop)
        nbytes = -(-num_rows * row_bytes // granule) * granule
        err, handle = cu.cuMemCreate(nbytes, prop, 0)
        if int(err) != 0:
            raise PeerMemoryError(f"cuMemCreate of {nbytes / 2**30:.2f} GiB on GPU "
                                  f"{self.device_idx} for table {key} failed: "
                                  f"{drv.error_name(err)}")
        self._own[key] = self._map(handle, nbytes, granule)
        self._shapes[key] = (num_rows, row_bytes)
        self._peers[key] = {}
        return self._tensor(self._own[key].address, num_rows, row_bytes)

    def _tensor(self, address: int, num_rows: int, row_bytes: int) -> torch.Tensor:
        with torch.cuda.device(self.device_idx):
            return torch.as_tensor(_DeviceArray(address, num_rows, row_bytes),
                                   device=f"cuda:{self.device_idx}")

    def describe(self) -> dict:
        torch.cuda.synchronize(self.device_idx)  # fills are done before peers read
        handles = {}
        for key, mapping in self._own.items():
            handles[str(key)] = {"nbytes": mapping.nbytes, "shape": list(self._shapes[key]),
                                 **self._export(mapping)}
        uuid = str(torch.cuda.get_device_properties(self.device_idx).uuid)
        return dict(host_identity(), gpu_uuid=uuid, handle_types=list(self.offered),
                    handle_request=self.requested, handles=handles)

    def _export(self, mapping: _Mapping) -> dict:
        """The FABRIC handle, if offered (POSIX FDs go through the holders: `holder_fd`)."""
        if "fabric" not in self.offered:
            return {}
        shareable = drv.check(drv.driver().cuMemExportToShareableHandle(
            mapping.handle, drv.handle_type_enum("fabric"), 0), "export (fabric)")
        return {"fabric": bytes(shareable.data).hex()}

    def map_peers(self, records: list[dict]) -> None:
        gpus = [(r["host"], r["gpu_uuid"]) for r in records]
        if len(set(gpus)) != len(gpus):
            raise PeerMemoryError(f"two members of the group use one GPU ({gpus}): give each "
                                  "member its own GPU (one engine per GPU)")
        self._chosen = choose_handle_type(records)
        if self._chosen != "fabric":
            return  # POSIX FDs: from the peers' holders (`attach`)
        for record in records:
            if record["rank"] == self.rank:
                continue
            for key_text, handle in record["handles"].items():
                imported = self._import_fabric(record["rank"], handle["fabric"])
                self._peers[int(key_text)][record["rank"]] = self._map(
                    imported, handle["nbytes"], 0, writable=False)

    @property
    def can_hold(self) -> bool:
        return "posix_fd" in self.offered

    @property
    def peers_from_holders(self) -> bool:
        return self._chosen == "posix_fd"

    def _import_fabric(self, rank: int, handle_hex: str):
        cu = drv.driver()
        fabric = cu.CUmemFabricHandle()
        fabric.data = bytes.fromhex(handle_hex)
        return drv.check(cu.cuMemImportFromShareableHandle(
            fabric, drv.handle_type_enum("fabric")), f"FABRIC import of rank {rank}'s slice")

    def holder_fd(self, key: int) -> int:
        if "posix_fd" not in self.offered:
            raise PeerMemoryError(
                f"slice {key} of rank {self.rank} is exported as {list(self.offered)} only: a "
                "holder keeps a slice through a POSIX-FD export (FABRIC-only groups restart "
                "their whole gang when an engine dies)")
        return int(drv.check(drv.driver().cuMemExportToShareableHandle(
            self._own[key].handle, drv.handle_type_enum("posix_fd"), 0), "export for the holder"))

    def attach(self, rank: int, key: int, fd: int, shape: list[int], nbytes: int) -> None:
        cu = drv.driver()
        handle = drv.check(cu.cuMemImportFromShareableHandle(fd, drv.handle_type_enum("posix_fd")),
                           f"import of rank {rank}'s slice of table {key} from its holder")
        mapping = self._map(handle, nbytes, 0, writable=rank == self.rank)
        self._shapes[key] = tuple(shape)
        if rank == self.rank:
            self._own[key] = mapping
        else:
            self._peers.setdefault(key, {})[rank] = mapping
        self._chosen = "posix_fd"

    def slices(self, key: int) -> list[torch.Tensor]:
        """For inspection: lookups read through `peer_bases`. torch attributes a peer's
        tensor to the device that holds its memory."""
        num_rows, row_bytes = self._shapes[key]
        own = self._own[key]
        return [self._tensor(own.address if r == self.rank else self._peers[key][r].address,
                             num_rows, row_bytes) for r in range(self.size)]

    def peer_bases(self, key: int) -> torch.Tensor:
        if key not in self._bases:
            addresses = [self._own[key].address if r == self.rank
                         else self._peers[key][r].address for r in range(self.size)]
            self._bases[key] = torch.tensor(addresses, dtype=torch.int64,
                                            device=f"cuda:{self.device_idx}")
        return self._bases[key]

    def allocated_bytes(self, key: int) -> int:
        return self._own[key].nbytes

    def close(self) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        # Release everything even if one step fails (a failed peer unmap must not strand
        # tens of GiB of own slices), then raise the first error.
        errors = []
        steps = [lambda: torch.cuda.synchronize(self.device_idx), self._bases.clear]
        steps += [m.release for peers in self._peers.values() for m in peers.values()]
        steps += [m.release for m in self._own.values()]
        steps.append(lambda: drv.check(drv.driver().cuDevicePrimaryCtxRelease(self.device_idx),
                                       "cuDevicePrimaryCtxRelease"))
        for step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 (re-raised below)
                errors.append(exc)
        self._peers.clear()
        self._own.clear()
        if errors:
            raise errors[0]

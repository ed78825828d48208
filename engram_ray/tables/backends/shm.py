"""CPU backend for development and CI: each slice is a shared-memory file, peers map it read-only.

Files live in `$ENGRAM_RAY_SHM_DIR` (default /dev/shm), named
`engram-ray-<generation>-r<rank>-t<layer id>`, mode 0600. Once every peer has mapped them (the
rendezvous' last barrier) they are unlinked: the memory lives exactly as long as the mappings,
so a crashed member leaves nothing behind after that point.

Handle types: slices always travel as open files (`shm_file`), passed through the members'
slice holders (`engram_ray.tables.holding`) between processes of one host.
`handle_type` must stay None and `cross_node` False: "fabric" and "posix_fd" are CUDA handle
types and a cross-node group cannot share files, so both are refused at construction rather
than ignored.
"""

from __future__ import annotations

import mmap
import os
import warnings

import torch

from engram_ray.tables.backends.base import (PeerMemory, PeerMemoryError, host_identity, same_host,
                                             shm_dir)


def _as_tensor(mm: mmap.mmap, num_rows: int, row_bytes: int) -> torch.Tensor:
    with warnings.catch_warnings():  # peers' maps are read-only on purpose
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mm, dtype=torch.uint8).view(num_rows, row_bytes)


class ShmPeerMemory(PeerMemory):
    name = "shm"

    def __init__(self, *, rank: int, size: int, device: str = "cpu", tag: str,
                 handle_type: str | None = None, cross_node: bool = False):
        if device != "cpu":
            raise PeerMemoryError(f"the shm backend keeps tables on the CPU, not {device!r}: "
                                  "use backend='cuda' for GPU tables")
        if handle_type is not None:
            raise PeerMemoryError(
                f"handle_type {handle_type!r} was requested with the shm backend: 'fabric' and "
                "'posix_fd' are CUDA handle types (shm slices travel as shared-memory files); "
                "drop handle_type, or use backend='cuda' for GPU tables")
        if cross_node:
            raise PeerMemoryError("cross_node was requested with the shm backend, whose "
                                  "slices are files of one host: keep the group on one host, "
                                  "or use backend='cuda' with handle_type='fabric'")
        super().__init__(rank=rank, size=size, device=device, tag=tag)
        self._maps: dict[int, list[mmap.mmap | None]] = {}
        self._tensors: dict[int, list[torch.Tensor | None]] = {}
        self._paths: dict[int, str] = {}  # own files not yet unlinked

    @property
    def handle_type(self) -> str:
        return "shm_file"

    def _path(self, key: int) -> str:
        return os.path.join(shm_dir(), f"engram-ray-{self.tag}-r{self.rank}-t{key}")

    def allocate(self, key: int, num_rows: int, row_bytes: int) -> torch.Tensor:
        path, nbytes = self._path(key), num_rows * row_bytes
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            raise PeerMemoryError(f"{path} exists: another member uses rank {self.rank} of "
                                  f"generation {self.tag!r}, or one crashed; remove the file "
                                  "or start a new generation") from None
        self._paths[key] = path
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise PeerMemoryError(f"could not allocate {nbytes} bytes in {path}: {exc}; check "
                                  "free space in the shared-memory folder") from exc
        finally:
            os.close(fd)
        self._maps[key] = [None] * self.size
        self._tensors[key] = [None] * self.size
        self._maps[key][self.rank] = mm
        self._tensors[key][self.rank] = tensor = _as_tensor(mm, num_rows, row_bytes)
        return tensor

    def describe(self) -> dict:
        return dict(host_identity(), handle_types=[self.handle_type])

    def map_peers(self, records: list[dict]) -> None:
        """Every member on this host: their files come from their holders (`attach`)."""
        own = records[self.rank]
        for record in records:
            if not same_host(own, record):
                raise PeerMemoryError(
                    f"rank {record['rank']} runs on host {record['host']}, rank {self.rank} on "
                    f"{own['host']}: the shm backend needs one host; use backend='cuda'")

    def holder_fd(self, key: int) -> int:
        if key not in self._paths:
            raise PeerMemoryError(f"slice {key} of rank {self.rank} was unlinked already: hand "
                                  "it to its holder before the rendezvous ends")
        return os.open(self._paths[key], os.O_RDONLY | os.O_NOFOLLOW)  # peers only read it

    def attach(self, rank: int, key: int, fd: int, shape: list[int], nbytes: int) -> None:
        num_rows, row_bytes = shape
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_size < nbytes:
            raise PeerMemoryError(
                f"rank {rank}'s slice of table {key} has owner {st.st_uid} and {st.st_size} "
                f"bytes, expected owner {os.getuid()} and {nbytes} bytes")
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        self._maps.setdefault(key, [None] * self.size)[rank] = mm
        self._tensors.setdefault(key, [None] * self.size)[rank] = _as_tensor(mm, num_rows,
                                                                             row_bytes)

    def after_rendezvous(self) -> None:
        self._unlink()

    def _unlink(self) -> None:
        for path in self._paths.values():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._paths.clear()

    def slices(self, key: int) -> list[torch.Tensor]:
        return self._tensors[key]

    def allocated_bytes(self, key: int) -> int:
        return len(self._maps[key][self.rank])

    def close(self) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        self._unlink()
        self._tensors.clear()
        for maps in self._maps.values():
            for mm in maps:
                if mm is not None:
                    try:
                        mm.close()
                    except BufferError:  # a caller still holds a tensor: unmapped when it goes
                        pass
        self._maps.clear()

"""Slice holders: how a member's table slices reach its peers, and what keeps them alive while
its engine restarts.

A member's slices are made by its engine's model process (an shm file, or `cuMemCreate` on a
GPU), and that process can die while the member's Serve replica lives on. So once its slices
are filled, the engine hands the holder in its replica one file descriptor per slice (shm: the
slice file, opened before the rendezvous unlinks it; cuda: a POSIX-FD export of the
allocation), with its shape and a digest of sampled rows taken at fill (`sampled_digest`). An
open descriptor keeps the memory alive with no CUDA context (checked on an H200: DESIGN.md), so
the replica needs none. A restarted engine asks every member's holder of its generation for
their descriptors and maps them (`EngramTables.reattach`): no checkpoint read, no rendezvous;
every slice's digest must match the one kept at fill before the engine serves.

Peers take a member's slices from its holder at the rendezvous too (`EngramTables.join`):
descriptors pass between processes of one user over the socket, so no engine lets others
ptrace it to take them. Every request carries its generation's holder token (128 random bits
the coordinator draws per generation and hands its members with their assignment; never in
the store folder, its names or `status`): a holder answers only its group's processes, not any
process of the same user that finds the socket. A member without a holder in its replica (DP gangs, benchmarks) runs
one in its engine process for the rendezvous only (`engram_ray.tables.holding.offered`).

Transport: one Unix socket per member, `<store_dir>/holder-r<rank>.sock`, inside the
generation's 0700 store folder; descriptors travel as SCM_RIGHTS; a client of another uid is
refused (SO_PEERCRED), and so is one without the holder's token. A request is one JSON line,
the answer one JSON line with the descriptors as ancillary data:

    {"op": "deposit", "generation", "token", "rank", "slices": [SLICE, ...]} + fds -> {"ok": true}
    {"op": "fetch", "generation", "token"}  ->  {"ok": true, "rank", "slices": [SLICE, ...]} + fds
    SLICE = {"key": layer id, "shape": [rows, row_bytes], "nbytes", "digest", "kind"}

`fetch` from a holder that holds nothing answers `"slices": []` (the engine's first start).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading

from engram_ray.errors import EngramRayError
from engram_ray.private_dirs import check_private

logger = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 1 << 20
MAX_FDS = 253          # SCM_MAX_FD
DIGEST_ROWS = 4096     # rows sampled per slice by `sampled_digest`
CLIENT_TIMEOUT_S = 30.0
SLICE_KEYS = frozenset({"key", "shape", "nbytes", "digest"})


class SliceHolderError(EngramRayError):
    """A holder could not be started, reached, or gave what was asked."""


def holder_path(store_dir: str, rank: int) -> str:
    """The socket of member `rank`'s holder in its generation's store folder."""
    return os.path.join(store_dir, f"holder-r{rank}.sock")


@contextlib.contextmanager
def _short(path: str):
    """`path` as a socket address: a store folder can be deeper than AF_UNIX's 107 bytes, so
    the folder is opened and named through /proc/self/fd."""
    folder = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{folder}/{os.path.basename(path)}"
    finally:
        os.close(folder)


def sampled_digest(rows) -> str:
    """blake2b of `DIGEST_ROWS` rows of `rows` `[num_rows, row_bytes]` uint8 (any device),
    evenly spaced, first and last included, with the shape: cheap on a 23 GiB slice, and a
    slice mapped from the wrong memory or overwritten since it was filled does not match."""
    import torch

    num_rows, num_picks = rows.shape[0], min(rows.shape[0], DIGEST_ROWS)
    # Integer steps: vLLM builds models under a bf16 default dtype, where linspace rounds.
    picks = (torch.arange(num_picks, dtype=torch.int64, device=rows.device) * (num_rows - 1)
             // max(1, num_picks - 1))
    sample = rows.index_select(0, picks).cpu().contiguous()
    digest = hashlib.blake2b(digest_size=16)
    digest.update(struct.pack("<qq", *rows.shape))
    digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def _send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode() + b"\n"
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def _receive(sock: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, MAX_FDS)
    fds = list(fds)
    try:
        for fd in fds:  # received descriptors are inheritable; no child process gets one
            os.set_inheritable(fd, False)
        while data and not data.endswith(b"\n"):  # the fds came with the first part
            more = sock.recv(MAX_MESSAGE_BYTES)
            if not more:
                break
            data += more
        return json.loads(data), fds
    except ValueError:
        _close_all(fds)
        raise SliceHolderError(f"a holder message was not JSON ({len(data)} bytes)") from None
    except BaseException:
        _close_all(fds)
        raise


class SliceHolder:
    """Member `rank`'s holder (in its Serve replica): a thread serving its socket; with a
    `token`, only to callers that send it."""

    def __init__(self, store_dir: str, generation: str, rank: int, token: str | None = None):
        self.path, self.generation, self.rank = holder_path(store_dir, rank), generation, rank
        self.token = token
        self.slices: list[dict] = []
        self.fds: list[int] = []
        self._lock = threading.Lock()
        try:
            check_private(store_dir, "slice holder folder", error=SliceHolderError)
        except FileNotFoundError:
            raise SliceHolderError(
                f"slice holder folder {store_dir} does not exist: the coordinator makes each "
                "generation's store folder; peer_group_store must be a folder every member of "
                "the group (one host) sees") from None
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with _short(self.path) as address:
                self._server.bind(address)
        except OSError as exc:
            self._server.close()
            raise SliceHolderError(
                f"slice holder {self.path}: cannot listen ({exc}); if the socket exists, "
                f"another replica holds rank {rank} of generation {generation!r} or one left "
                "it: the coordinator gives each generation a fresh store folder") from exc
        os.chmod(self.path, 0o600)
        self._server.listen(16)
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name=f"engram-slice-holder-r{rank}")
        self._thread.start()

    @property
    def is_full(self) -> bool:
        """True once the engine deposited its slices (a restart can re-attach them)."""
        with self._lock:
            return bool(self.slices)

    @property
    def held_bytes(self) -> int:
        """Bytes of the slices it holds (device memory with the cuda backend)."""
        with self._lock:
            return sum(int(s["nbytes"]) for s in self.slices)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed
                return
            with conn:
                conn.settimeout(CLIENT_TIMEOUT_S)  # a client that never sends blocks no one
                try:
                    self._answer(conn)
                except Exception as exc:  # noqa: BLE001 - one bad client must not stop the holder
                    logger.warning("engram-ray slice holder r%d: %s: %s", self.rank,
                                   type(exc).__name__, exc)

    def _answer(self, conn: socket.socket) -> None:
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  struct.calcsize("3i")))[1]
        if uid != os.getuid():
            _send(conn, {"ok": False, "error": f"uid {uid} may not use this holder"})
            return
        request, fds = _receive(conn)
        if not isinstance(request, dict):
            _close_all(fds)
            _send(conn, {"ok": False, "error": "a request must be a JSON object"})
            return
        op = request.get("op")
        if self.token is not None and not hmac.compare_digest(
                str(request.get("token") or ""), self.token):
            _close_all(fds)
            _send(conn, {"ok": False, "error": f"not a member of generation {self.generation!r}"
                         ": the request lacks the group's holder token"})
        elif request.get("generation") != self.generation:
            _close_all(fds)
            _send(conn, {"ok": False, "error": f"holder of generation {self.generation!r} "
                         f"asked for {request.get('generation')!r}"})
        elif op == "deposit":
            _send(conn, self._deposit(request, fds))
        elif op == "fetch":
            with self._lock:
                _send(conn, {"ok": True, "rank": self.rank, "slices": self.slices}, self.fds)
        else:
            _close_all(fds)
            _send(conn, {"ok": False, "error": f"unknown op {op!r}"})

    def _deposit(self, request: dict, fds: list[int]) -> dict:
        if request.get("rank") != self.rank:
            _close_all(fds)
            return {"ok": False, "error": f"rank {request.get('rank')} deposited at the holder "
                                          f"of rank {self.rank}"}
        try:
            self.hold(request.get("slices") or [], fds)
        except SliceHolderError as exc:
            return {"ok": False, "error": str(exc)}
        return {"ok": True}

    def hold(self, slices: list[dict], fds: list[int]) -> None:
        """Keep `fds` (one per slice of `slices`; the holder's from now on, closed on error)."""
        with self._lock:
            error = None
            if self.slices:
                error = f"rank {self.rank} deposited its slices twice"
            elif len(slices) != len(fds) or not fds:
                error = f"{len(slices)} slices came with {len(fds)} descriptors"
            elif not all(isinstance(s, dict) and SLICE_KEYS <= s.keys() for s in slices):
                error = f"a slice lacks one of {sorted(SLICE_KEYS)}"
            if error:
                _close_all(fds)
                raise SliceHolderError(error)
            self.slices, self.fds = list(slices), list(fds)
        logger.info("engram-ray slice holder r%d holds %d slices (%.1f MiB) of generation %s",
                    self.rank, len(slices), sum(s["nbytes"] for s in slices) / 2**20,
                    self.generation)

    def close(self) -> None:
        """Stop serving and drop the descriptors (the memory goes once no engine maps it)."""
        try:  # wakes the thread blocked in accept() (a close alone does not, on Linux)
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        with self._lock:
            _close_all(self.fds)
            self.fds, self.slices = [], []


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _call(path: str, message: dict, fds: list[int] = ()) -> tuple[dict, list[int]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CLIENT_TIMEOUT_S)
    try:
        with _short(path) as address:
            sock.connect(address)
        _send(sock, message, fds)
        answer, got = _receive(sock)
    except OSError as exc:
        raise SliceHolderError(f"slice holder {path}: {exc} (its replica is gone, or the "
                               "generation ended)") from exc
    finally:
        sock.close()
    if not answer.get("ok"):
        _close_all(got)
        raise SliceHolderError(f"slice holder {path}: {answer.get('error')}")
    return answer, got


def deposit(path: str, generation: str, rank: int, slices: list[dict], fds: list[int],
            token: str | None = None) -> None:
    """Hand `fds` (one per slice of `slices`, kept open by the caller's side too) to a holder."""
    _call(path, {"op": "deposit", "generation": generation, "token": token, "rank": rank,
                 "slices": slices}, fds)


def fetch(path: str, generation: str, token: str | None = None) -> tuple[list[dict], list[int]]:
    """(slices, their descriptors, now this process's to close) from a holder."""
    answer, fds = _call(path, {"op": "fetch", "generation": generation, "token": token})
    if len(fds) != len(answer["slices"]):
        _close_all(fds)
        raise SliceHolderError(f"slice holder {path}: {len(answer['slices'])} slices came "
                               f"with {len(fds)} descriptors")
    return answer["slices"], fds

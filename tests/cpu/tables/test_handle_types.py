"""A requested CUDA handle type (`handle_type`, `cross_node`) reaches the backend and is honoured.

Pure decisions (`engram_ray.tables.backends.handle_types`) on their own; then the path from vLLM's
`additional_config` through `PeerGroupSettings` and `make_memory` into real backend
objects: the shm backend refuses CUDA handle types, and `CudaPeerMemory` is built on this CPU
machine with only the driver calls it makes outside allocation stubbed (what "this GPU" can
use, its context, its uuid), so its constructor, rendezvous record and type choice run as on a
GPU. Members meet through a real rendezvous in threads (`test_rendezvous.py` does the same).
"""

import contextlib
import os
import threading
from types import SimpleNamespace

import pytest
import torch

from engram_ray.errors import ConfigError
from engram_ray.model.layout import EngramLayout
from engram_ray.tables.backends import cuda_driver as drv
from engram_ray.tables.backends import make_memory
from engram_ray.tables.backends.base import PeerMemoryError
from engram_ray.tables.backends.handle_types import (choose_handle_type, offered_types,
                                                     requested_type)
from engram_ray.tables.rendezvous import RendezvousError
from engram_ray.tables.settings import PeerGroupSettings
from engram_ray.tables.table import EngramTables

TINY = EngramLayout(layer_ids=(1, 3), vocab_size=1000, max_ngram_size=3, n_heads=2,
                    head_dim=64, compressed_vocab_size=100, pad_token_id=0)
BOTH = ("fabric", "posix_fd")


def _record(rank, offers=BOTH, request=None, host="node-a"):
    return {"rank": rank, "host": host, "boot_id": f"boot-{host}", "pid": 100 + rank,
            "handle_types": list(offers), "handle_request": request}


# --- pure decisions -----------------------------------------------------------------------

@pytest.mark.parametrize("usable, requested, offered", [
    (BOTH, None, BOTH),
    (("posix_fd",), None, ("posix_fd",)),
    (BOTH, "posix_fd", ("posix_fd",)),
    (BOTH, "fabric", ("fabric",)),
])
def test_a_member_offers_only_its_request(usable, requested, offered):
    assert offered_types(usable, requested) == offered


@pytest.mark.parametrize("usable, requested, match", [
    (("posix_fd",), "fabric", r"handle_type 'fabric' was requested but GPU 3 cannot use it "
                              r"\(it offers \['posix_fd'\]\).*IMEX channel.*engram-ray doctor"
                              r".*drop handle_type"),
    (("fabric",), "posix_fd", r"'posix_fd' was requested but GPU 3 .*\['fabric'\].*doctor"),
    ((), "posix_fd", r"GPU 3 cannot use it \(it offers no handle type\)"),
    ((), None, r"GPU 3 can export neither FABRIC nor POSIX-FD handles"),
])
def test_a_request_this_gpu_cannot_use_is_refused(usable, requested, match):
    with pytest.raises(PeerMemoryError, match=match):
        offered_types(usable, requested, device_idx=3)


def test_cross_node_requests_fabric():
    assert requested_type(None) is None
    assert requested_type("posix_fd") == "posix_fd"
    assert requested_type("fabric", cross_node=True) == "fabric"
    assert requested_type(None, cross_node=True) == "fabric"
    with pytest.raises(PeerMemoryError, match="'posix_fd' was requested for a cross-node group"):
        requested_type("posix_fd", cross_node=True)
    with pytest.raises(PeerMemoryError, match="'ipc' is not a CUDA handle type"):
        requested_type("ipc")


@pytest.mark.parametrize("records, chosen", [
    ([_record(0), _record(1)], "fabric"),                          # preference
    ([_record(0), _record(1, ("posix_fd",))], "posix_fd"),         # what all offer
    ([_record(0, request="posix_fd"), _record(1, request="posix_fd")], "posix_fd"),
    ([_record(0, ("posix_fd",), "posix_fd"), _record(1, ("posix_fd",), "posix_fd")], "posix_fd"),
    ([_record(0, ("fabric",), "fabric"), _record(1, ("fabric",), "fabric", host="node-b")],
     "fabric"),
    ([{k: v for k, v in _record(r).items() if k != "handle_request"} for r in (0, 1)],
     "fabric"),                                                    # records without requests
])
def test_group_type_honours_the_request(records, chosen):
    assert choose_handle_type(records) == chosen


@pytest.mark.parametrize("requests, shown", [
    (("posix_fd", "fabric"), "{0: 'posix_fd', 1: 'fabric'}"),
    (("posix_fd", None), "{0: 'posix_fd', 1: None}"),
])
def test_different_requests_are_refused_naming_ranks(requests, shown):
    records = [_record(rank, request=request) for rank, request in enumerate(requests)]
    with pytest.raises(PeerMemoryError) as info:
        choose_handle_type(records)
    assert f"members requested different handle types (by rank: {shown}" in str(info.value)
    assert "same handle_type" in str(info.value)


def test_posix_fd_never_crosses_hosts():
    records = [_record(0, request="posix_fd"), _record(1, request="posix_fd", host="node-b")]
    with pytest.raises(PeerMemoryError, match=r"'posix_fd' was requested for a group on several "
                                              r"hosts \(\['node-a', 'node-b'\]\).*'fabric'"):
        choose_handle_type(records)
    with pytest.raises(PeerMemoryError, match=r"no handle type every member can use"):
        choose_handle_type([_record(0, ("posix_fd",)), _record(1, host="node-b")])
    with pytest.raises(PeerMemoryError, match=r"the requested handle type 'fabric' is not "
                                              r"offered by every member"):
        choose_handle_type([_record(0, ("fabric",), "fabric"),
                            _record(1, ("posix_fd",), "fabric")])


# --- settings and spec ----------------------------------------------------------------------

def _settings(tmp_path, **extra) -> PeerGroupSettings:
    raw = {"size": 2, "store_dir": str(tmp_path / "store"), "rank": 0, "generation": "g1"} | extra
    return PeerGroupSettings.from_additional_config({"engram_peer_group": raw})


def test_settings_carry_the_request(tmp_path):
    settings = _settings(tmp_path, backend="cuda", handle_type="posix_fd")
    assert (settings.handle_type, settings.cross_node) == ("posix_fd", False)
    settings = _settings(tmp_path, backend="cuda", handle_type="fabric", cross_node=True,
                         size=4).for_dp_rank(1, 2)
    assert (settings.rank, settings.handle_type, settings.cross_node) == (1, "fabric", True)
    assert _settings(tmp_path).handle_type is None


@pytest.mark.parametrize("handle_type", ["fabric", "posix_fd"])
def test_settings_refuse_a_cuda_handle_type_with_shm(tmp_path, handle_type):
    with pytest.raises(ConfigError, match=rf"engram_peer_group.handle_type: is '{handle_type}' "
                                          r"with backend 'shm'.*CUDA handle types"):
        _settings(tmp_path, handle_type=handle_type)


@pytest.mark.parametrize("kwargs, match", [
    (dict(handle_type="ipc"), r"peer_group.handle_type: is 'ipc'"),
    (dict(cross_node=True), r"peer_group.handle_type: is None for a cross-node group"),
    (dict(cross_node=True, handle_type="posix_fd"), r"is 'posix_fd' for a cross-node group"),
    (dict(cross_node="yes", handle_type="fabric"), r"peer_group.cross_node: is 'yes'"),
])
def test_settings_name_a_bad_request(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        PeerGroupSettings(size=2, rank=0, store_dir="/tmp/x", generation="g1", **kwargs)


# --- shm backend ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(handle_type="posix_fd"), r"handle_type 'posix_fd' was requested with the shm "
                                   r"backend: 'fabric' and 'posix_fd' are CUDA handle types"),
    (dict(handle_type="fabric", cross_node=True), r"'fabric' was requested with the shm"),
])
def test_shm_backend_refuses_cuda_handle_types(tmp_path, monkeypatch, kwargs, match):
    # PeerGroupSettings already refuses these (test_settings_refuse_a_cuda_handle_type_with_shm);
    # the backend refuses them too, for callers that construct it directly.
    from engram_ray.tables.backends.shm import ShmPeerMemory

    monkeypatch.setenv("ENGRAM_RAY_SHM_DIR", str(tmp_path))
    with pytest.raises(PeerMemoryError, match=match):
        ShmPeerMemory(rank=0, size=1, device="cpu", tag="g1", **kwargs)
    assert os.listdir(tmp_path) == []  # refused before any slice file or store


def test_shm_backend_refuses_cross_node():
    from engram_ray.tables.backends.shm import ShmPeerMemory

    with pytest.raises(PeerMemoryError, match="cross_node was requested with the shm backend"):
        ShmPeerMemory(rank=0, size=2, tag="g1", cross_node=True)


# --- cuda backend, driver stubbed -----------------------------------------------------------

@pytest.fixture
def gpu(monkeypatch):
    """What "this GPU" can use (`gpu.usable`) and which primary contexts were released."""
    state = SimpleNamespace(usable=BOTH, released=[])
    fake_driver = SimpleNamespace(
        cuDevicePrimaryCtxRelease=lambda idx: state.released.append(idx) or 0)
    monkeypatch.setattr(drv, "use_device", lambda idx: None)
    monkeypatch.setattr(drv, "usable_handle_types", lambda idx: state.usable)
    monkeypatch.setattr(drv, "driver", lambda: fake_driver)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda idx=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda idx: SimpleNamespace(uuid=f"GPU-uuid-{idx}"))
    return state


@pytest.mark.parametrize("extra, offered", [
    (dict(), BOTH),
    (dict(handle_type="posix_fd"), ("posix_fd",)),
    (dict(handle_type="fabric"), ("fabric",)),
    (dict(handle_type="fabric", cross_node=True), ("fabric",)),
])
def test_settings_reach_the_cuda_backend(tmp_path, gpu, extra, offered):
    memory = make_memory(_settings(tmp_path, backend="cuda", **extra), "cuda:0")
    assert memory.offered == offered
    assert memory.describe()["handle_types"] == list(offered)
    assert memory.describe()["handle_request"] == extra.get("handle_type")
    memory.close()


def test_deepseek_engine_member_passes_the_request(tmp_path, gpu):
    tables = EngramTables.member(TINY, _settings(tmp_path, backend="cuda",
                                                 handle_type="posix_fd"), "cuda:0")
    assert tables.memory.offered == ("posix_fd",)
    tables.close()


def test_cuda_backend_refuses_a_request_this_gpu_cannot_use(tmp_path, gpu):
    gpu.usable = ("posix_fd",)
    settings = _settings(tmp_path, backend="cuda", handle_type="fabric")
    with pytest.raises(PeerMemoryError, match=r"handle_type 'fabric' was requested but GPU 1 "
                                              r"cannot use it \(it offers \['posix_fd'\]\)"):
        make_memory(settings, "cuda:1")
    assert gpu.released == [1]  # the context it retained is let go


def _meet(tmp_path, requests: list[str | None], monkeypatch) -> dict:
    """Members of one group, each requesting its type, meet (threads); {rank: stats or error}.
    The driver is stubbed and no table allocated: nothing passes through the slice holders."""
    from engram_ray.tables import holding

    monkeypatch.setattr(holding, "offered", lambda tables: contextlib.nullcontext())
    monkeypatch.setattr(holding, "attach_peers", lambda tables: None)
    outcome = {}

    def member(rank):
        settings = PeerGroupSettings(size=len(requests), rank=rank,
                                     store_dir=str(tmp_path / "store"), generation="g1",
                                     timeout_s=20, backend="cuda", handle_type=requests[rank])
        tables = EngramTables.member(TINY, settings, f"cuda:{rank}")
        try:
            tables.join()
            outcome[rank] = tables.stats()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome[rank] = exc
        finally:
            tables.close()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcome


def test_group_uses_the_requested_type(tmp_path, gpu, monkeypatch):
    outcome = _meet(tmp_path, ["posix_fd", "posix_fd"], monkeypatch)
    assert [outcome[r]["handle_type"] for r in (0, 1)] == ["posix_fd", "posix_fd"], outcome


def test_group_of_different_requests_fails_naming_them(tmp_path, gpu, monkeypatch):
    outcome = _meet(tmp_path, ["posix_fd", "fabric"], monkeypatch)
    for rank in (0, 1):
        assert isinstance(outcome[rank], (PeerMemoryError, RendezvousError)), outcome
        assert "by rank: {0: 'posix_fd', 1: 'fabric'}" in str(outcome[rank])

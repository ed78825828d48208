"""Peer-group tables on the cuda backend: one process per GPU (spawn), CUDA VMM slices exported
and imported (POSIX FDs on one host), lookups through the kernel bitwise equal to the reference;
a requested handle type is the one used, and one the GPU cannot use is refused at start-up.
"""

import pytest
import torch

from engram_ray.model.layout import EngramLayout
from engram_ray.tables.local_group import check_member, file_barrier, run_group

# 24 columns of ~400K-row buckets: 9.6M rows of 264 bytes per table (2.4 GiB), 1.2 GiB a slice.
MEDIUM = EngramLayout(layer_ids=(1, 14), vocab_size=400_000, max_ngram_size=4, n_heads=8,
                      head_dim=256, compressed_vocab_size=1000, pad_token_id=2)
# ~20K-row buckets: ~0.49M rows per table (122 MiB), for tests of handles rather than size.
SMALL = EngramLayout(layer_ids=(1, 14), vocab_size=20_000, max_ngram_size=4, n_heads=8,
                     head_dim=256, compressed_vocab_size=1000, pad_token_id=2)
GRANULE = 2 << 20


def member_with_memory(rank, layout, size, store_dir, generation, handle_type=None):
    """check_member, plus this GPU's memory held once every member has closed (a peer's
    import keeps a slice's memory alive until that peer closes too)."""
    torch.cuda.set_device(rank)
    free_before = torch.cuda.mem_get_info()[0]
    result = check_member(rank, layout, size, store_dir, generation, "cuda", "cuda", seed=3,
                          num_tokens=64, timeout_s=60, handle_type=handle_type)
    file_barrier(store_dir + "-closed", "closed", rank, list(range(size)))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    result["leaked_bytes"] = free_before - torch.cuda.mem_get_info()[0]
    return result


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_two_gpus_lookups_equal_reference(tmp_path):
    results = run_group(member_with_memory, [0, 1],
                        (MEDIUM, 2, str(tmp_path / "store"), "gpu-2"), timeout_s=240,
                        start_method="spawn")
    for r in results:
        assert r.is_ok, r.value
        assert all(r.value["equal"].values()), (r.rank, r.value["equal"])
        stats = r.value["stats"]
        assert stats["handle_type"] in ("posix_fd", "fabric")
        for table in stats["tables"]:
            plan_bytes = table["rows_per_rank"] * table["row_bytes"]
            assert plan_bytes <= table["local_bytes"] < plan_bytes + GRANULE
        # Every mapping and allocation released (the torch caching allocator may keep a little).
        assert r.value["leaked_bytes"] < 256 << 20, r.value["leaked_bytes"]


@pytest.mark.gpu
def test_single_gpu_group_is_a_whole_local_table(tmp_path):
    results = run_group(member_with_memory, [0],
                        (MEDIUM, 1, str(tmp_path / "store"), "gpu-1"), timeout_s=240,
                        start_method="spawn")
    assert results[0].is_ok, results[0].value
    assert all(results[0].value["equal"].values())
    tables = results[0].value["stats"]["tables"]
    assert [t["slice"] for t in tables] == [[0, rows] for rows in MEDIUM.rows_per_table]


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_two_gpus_use_the_requested_posix_fd(tmp_path):
    results = run_group(member_with_memory, [0, 1],
                        (SMALL, 2, str(tmp_path / "store"), "gpu-2-posix", "posix_fd"),
                        timeout_s=240, start_method="spawn")
    for r in results:
        assert r.is_ok, r.value
        assert all(r.value["equal"].values()), (r.rank, r.value["equal"])
        assert r.value["stats"]["handle_type"] == "posix_fd"


@pytest.mark.gpu
def test_single_gpu_group_uses_the_requested_posix_fd(tmp_path):
    results = run_group(member_with_memory, [0],
                        (SMALL, 1, str(tmp_path / "store"), "gpu-1-posix", "posix_fd"),
                        timeout_s=240, start_method="spawn")
    assert results[0].is_ok, results[0].value
    assert all(results[0].value["equal"].values())
    assert results[0].value["stats"]["handle_type"] == "posix_fd"


def member_requesting_unusable(rank, layout, store_dir):
    """Request a handle type this GPU cannot use (if there is one); what the backend said."""
    from engram_ray.tables.backends import cuda_driver as drv
    from engram_ray.tables.backends.base import PeerMemoryError
    from engram_ray.tables.backends.handle_types import HANDLE_TYPES

    torch.cuda.set_device(rank)
    drv.use_device(rank)
    usable = drv.usable_handle_types(rank)
    missing = [kind for kind in HANDLE_TYPES if kind not in usable]
    if not missing:
        return {"usable": list(usable)}
    try:
        check_member(rank, layout, 1, store_dir, "gpu-unusable", "cuda", "cuda",
                     timeout_s=30, handle_type=missing[0])
    except PeerMemoryError as exc:
        return {"usable": list(usable), "requested": missing[0], "error": str(exc)}
    return {"usable": list(usable), "requested": missing[0], "error": None}


@pytest.mark.gpu
def test_requested_type_this_gpu_cannot_use_is_refused(tmp_path):
    result = run_group(member_requesting_unusable, [0], (SMALL, str(tmp_path / "store")),
                       timeout_s=240, start_method="spawn")[0]
    assert result.is_ok, result.value
    if "requested" not in result.value:
        pytest.skip(f"GPU 0 can use every handle type ({result.value['usable']})")
    requested, error = result.value["requested"], result.value["error"]
    assert error is not None, f"{requested!r} was not refused"
    assert (f"handle_type {requested!r} was requested but GPU 0 cannot use it (it offers "
            f"{result.value['usable'] or 'no handle type'})") in error
    assert "engram-ray doctor" in error

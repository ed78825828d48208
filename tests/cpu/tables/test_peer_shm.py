"""Peer-group tables on the shm backend: real processes (spawn) form groups of 1-4 members.

Every member's lookups of random ids (packed and bf16, -1 padding included) must be bitwise
equal to the reference over the same synthetic rows; a missing member fails the others within
the timeout naming it; closing leaves nothing in the shared-memory folder.
"""

import os

import pytest
import torch

from engram_ray.errors import ConfigError
from engram_ray.model.layout import EngramLayout
from engram_ray.planning.memory import make_plan, rows_per_rank, slice_range
from engram_ray.tables.local_group import check_member, expected_rows, random_row_ids, run_group
from engram_ray.tables.settings import PeerGroupSettings
from engram_ray.tables.table import open_group_tables

# Two tables of 4,062 and 4,152 rows, 66-byte rows: small, and not multiples of any P used.
TINY = EngramLayout(layer_ids=(1, 3), vocab_size=1000, max_ngram_size=3, n_heads=2,
                    head_dim=64, compressed_vocab_size=100, pad_token_id=0)


def member_env(shm_dir) -> dict:
    return {"ENGRAM_RAY_SHM_DIR": str(shm_dir)}


@pytest.mark.parametrize("size", [2, 3, 4])
def test_group_lookups_equal_reference(size, tmp_path, shm_dir):
    results = run_group(check_member, list(range(size)),
                        (TINY, size, str(tmp_path / "store"), f"gen-{size}"),
                        env=member_env(shm_dir), timeout_s=90)
    for result in results:
        assert result.is_ok, result.value
        assert all(result.value["equal"].values()), (result.rank, result.value["equal"])
    plan = make_plan(TINY, "peer", peer_group_size=size)
    for result in results:
        stats = result.value["stats"]
        assert (stats["rank"], stats["size"], stats["backend"]) == (result.rank, size, "shm")
        assert [t["local_bytes"] for t in stats["tables"]] == list(plan.hbm_bytes_per_gpu_by_table)
    # Slices tile each table: consecutive, disjoint, covering every row.
    for idx, rows in enumerate(TINY.rows_per_table):
        ranges = [r.value["stats"]["tables"][idx]["slice"] for r in results]
        assert ranges[0][0] == 0 and ranges[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert os.listdir(shm_dir) == []
    assert not os.path.exists(tmp_path / "store" / "rendezvous.filestore")
    assert not list((tmp_path / "store").glob("left-*"))  # the marks of members that left
    # Each member's slices reached its peers through the holder its process ran for the
    # rendezvous (no replica holder here); every holder closed with the meeting.
    assert not list((tmp_path / "store").glob("holder-r*.sock"))


def test_single_member_is_a_whole_local_table(tmp_path, shm_dir):
    spec = PeerGroupSettings(size=1, rank=0, store_dir=str(tmp_path / "store"), generation="solo")
    tables = open_group_tables(TINY, spec, seed=7)
    assert [t.local.shape[0] for t in tables.tables.values()] == list(TINY.rows_per_table)
    ids = random_row_ids(TINY.rows_per_table[1], (33, TINY.num_cols), seed=1)
    assert torch.equal(tables.lookup(3, ids, "bf16"), expected_rows(ids, TINY.head_dim, 7, "bf16"))
    with pytest.raises(ConfigError, match="layer_id: 2 has no Engram table"):
        tables.lookup(2, ids)
    tables.close()
    tables.close()  # idempotent
    assert os.listdir(shm_dir) == []


def test_missing_member_fails_others_naming_it(tmp_path, shm_dir):
    results = run_group(check_member, [0, 1],
                        (TINY, 3, str(tmp_path / "store"), "gen-missing", "shm", "cpu", 0, 8, 2.0),
                        env=member_env(shm_dir), timeout_s=60)
    for result in results:
        assert not result.is_ok
        assert "ranks [2] of 3 did not publish its record within 2 s" in result.value
        assert "(arrived: [0, 1])" in result.value
        assert result.seconds < 30
    assert os.listdir(shm_dir) == []


def test_own_slice_file_in_use_is_refused(tmp_path, shm_dir):
    (shm_dir / "engram-ray-dup-r0-t1").write_bytes(b"")
    spec = PeerGroupSettings(size=1, rank=0, store_dir=str(tmp_path / "store"), generation="dup")
    with pytest.raises(Exception, match="engram-ray-dup-r0-t1 exists: another member uses rank 0"):
        open_group_tables(TINY, spec)
    assert os.listdir(shm_dir) == ["engram-ray-dup-r0-t1"]  # only the intruder's file


@pytest.mark.parametrize("field,kwargs,message", [
    ("size", dict(size=0), "peer_group.size: is 0"),
    ("rank", dict(rank=2), "peer_group.rank: is 2 (expected 0 <= rank < 2)"),
    ("store_dir", dict(store_dir=""), "peer_group.store_dir: is ''"),
    ("generation", dict(generation="a/b"), "peer_group.generation: is 'a/b'"),
    ("timeout_s", dict(timeout_s=0), "peer_group.timeout_s: is 0"),
])
def test_settings_name_the_bad_field(field, kwargs, message):
    args = dict(size=2, rank=0, store_dir="/tmp/x", generation="g1") | kwargs
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PeerGroupSettings(**args)


@pytest.mark.parametrize("scale_suffix", ["scale", "weight_scale_inv"])
def test_checkpoint_fill_reads_only_own_rows(tmp_path, shm_dir, scale_suffix):
    """A safetensors checkpoint (fp8 values, e8m0 scales) fills each rank's rows exactly."""
    from safetensors.torch import save_file

    from engram_ray.model.reference import random_table
    from engram_ray.tables import fill

    tables = {lid: random_table(rows, TINY.head_dim, generator=torch.Generator().manual_seed(lid))
              for lid, rows in zip(TINY.layer_ids, TINY.rows_per_table)}
    tensors = {}
    for lid, table in tables.items():
        prefix = f"model.layers.{lid}.engram.embed"
        tensors[f"{prefix}.weight"] = table[:, :TINY.head_dim].view(torch.float8_e4m3fn)
        tensors[f"{prefix}.{scale_suffix}"] = table[:, TINY.head_dim:].view(torch.float8_e8m0fnu)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    # P=5 slices of the real plan: the last rank owns fewer rows than rows_per_rank.
    for lid, table in tables.items():
        per_rank = rows_per_rank(table.shape[0], 5)
        assert table.shape[0] % per_rank  # the last slice is short, so padding is checked
        for rank in range(5):
            owned = torch.full((per_rank, TINY.row_bytes), 0xAB, dtype=torch.uint8)
            start, end = slice_range(table.shape[0], 5, rank)
            fill.fill_from_checkpoint(owned[:end - start], str(path), lid, start,
                                      table.shape[0], TINY.head_dim, chunk_rows=97)
            assert torch.equal(owned[:end - start], table[start:end])
            assert bool((owned[end - start:] == 0xAB).all())  # nothing past the slice written
    with pytest.raises(ConfigError, match=r"has no tensor named '\*layers.2.engram.embed.weight'"):
        fill.find_table_tensors(str(path), 2)


def test_checkpoint_scales_of_another_dtype_are_named(tmp_path):
    """fp32 scales (DeepSeek-V3-style block scales) are refused naming the tensor and dtype,
    not copied as raw bytes of the wrong width."""
    from safetensors.torch import save_file

    from engram_ray.tables import fill
    rows = TINY.rows_per_table[0]
    prefix = "model.layers.1.engram.embed"
    save_file({f"{prefix}.weight": torch.zeros(rows, TINY.head_dim).to(torch.float8_e4m3fn),
               f"{prefix}.weight_scale_inv": torch.ones(rows, TINY.head_dim // 32)},
              str(tmp_path / "model.safetensors"))
    owned = torch.zeros(10, TINY.row_bytes, dtype=torch.uint8)
    with pytest.raises(ConfigError, match=r"engram.embed.weight_scale_inv: has dtype F32"):
        fill.fill_from_checkpoint(owned, str(tmp_path / "model.safetensors"), 1, 0, rows,
                                  TINY.head_dim)

"""Module-scoped lookup tables for the GPU tests (shapes in lookup_support.py): one random
table in HBM, its copies in pinned host memory and on transparent huge pages, and two slices
of it on two GPUs."""

import pytest
import torch

from engram_ray.model.reference import random_table

from lookup_support import HEAD_DIM, NUM_ROWS, ROW_BYTES, ROWS_PER_RANK


@pytest.fixture(scope="module")
def hbm_table():
    generator = torch.Generator(device="cuda:0").manual_seed(2026)
    return random_table(NUM_ROWS, HEAD_DIM, generator=generator, device="cuda:0")


def _host_copy(hbm_table, use_thp):
    from engram_ray.tables.backends.host_memory import allocate_host_table
    table = allocate_host_table(hbm_table.numel(), use_thp=use_thp).view(-1, ROW_BYTES)
    table.copy_(hbm_table)
    return table


@pytest.fixture(scope="module")
def host_table(hbm_table):
    return _host_copy(hbm_table, use_thp=False)


@pytest.fixture(scope="module")
def thp_table(hbm_table):
    return _host_copy(hbm_table, use_thp=True)


@pytest.fixture(scope="module")
def two_gpu_slices(hbm_table):
    """Slice 0 on cuda:0 (a view of the table), slice 1 (the last, shorter) on cuda:1."""
    from engram_ray.kernels.lookup import enable_peer_access
    enable_peer_access(0, 1)
    enable_peer_access(1, 0)
    return [hbm_table[:ROWS_PER_RANK], hbm_table[ROWS_PER_RANK:].to("cuda:1")]

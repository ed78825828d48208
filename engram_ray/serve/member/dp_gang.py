"""What a data-parallel gang's members agree on when they restart in place together: a new
vLLM DP master for each restart, and a barrier before any of them stops its engine.

The engines of a DP gang (`serving.data_parallel_size` > 1, DEP2 on the shipped configs) form
one vLLM DP group: an engine whose peer stops dies with it (the group's collectives fail), so
the gang restarts whole, on a fresh master address and port each time. Both go through Ray's
GCS key-value store, as Ray Serve LLM's `GangMasterInfoRegistry` does at the first start; the
keys name the DP gang and the restart (`<gang id>@<round>`), so a restart never reads the
address of an earlier one.
"""

from __future__ import annotations

import asyncio
import time

BARRIER_PREFIX = "engram_ray:dp_barrier/"
# Ray Serve LLM's `GangMasterInfoRegistry._KEY_PREFIX` (Ray 2.60; a test holds them equal),
# spelled out so that the coordinator, which never imports vLLM, can remove the keys.
MASTER_PREFIX = "LLMServeRegistry:serve_global:gang_dp_master/"
POLL_S = 0.1


async def meet_dp_master(key: str, dp_rank: int, timeout_s: float) -> tuple[str, int]:
    """(address, port) of the DP master of restart `key`: DP rank 0 picks a free port on its
    node and registers it, the other ranks wait for it (`TimeoutError` after `timeout_s`)."""
    from ray.llm._internal.serve.serving_patterns.data_parallel.dp_server import (
        GangMasterInfoRegistry)

    if dp_rank == 0:
        import ray
        from ray.util.collective.collective import get_address_and_port

        address, port = get_address_and_port()
        GangMasterInfoRegistry.register(key, address, port,
                                        ray.get_runtime_context().get_node_id())
        return address, port
    address, port, _ = await GangMasterInfoRegistry.get(key, timeout=timeout_s)
    return address, port


def forget_dp_round(key: str, dp_size: int) -> None:
    """Restart `key`'s master entry and barrier keys removed (DP rank 0, once its gang's
    engines serve: every rank has read them)."""
    from ray.experimental.internal_kv import _internal_kv_del
    from ray.llm._internal.serve.serving_patterns.data_parallel.dp_server import (
        GangMasterInfoRegistry)

    GangMasterInfoRegistry.unregister(key)
    for rank in range(dp_size):
        _internal_kv_del(_barrier_key(key, rank))


def dp_gang_id(serve_gang_id: str, dp_gang: int) -> str:
    """The id of DP gang `dp_gang` (peer ranks [dp_gang * D, (dp_gang + 1) * D)) of a peer
    group's Serve gang: every key of its rounds starts with it."""
    return f"{serve_gang_id}-dp{dp_gang}"


def forget_gang(serve_gang_id: str) -> int:
    """Every DP master and barrier key of the DP gangs of Serve gang `serve_gang_id`, once
    the coordinator knows it gone (its generation ended): rounds that ended in a failure or
    a gang restart leave theirs. The number of keys removed."""
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_list

    removed = 0
    for prefix in (BARRIER_PREFIX, MASTER_PREFIX):
        for key in _internal_kv_list(f"{prefix}{dp_gang_id(serve_gang_id, 0)[:-1]}".encode()):
            _internal_kv_del(key)
            removed += 1
    return removed


def _barrier_key(key: str, rank: int) -> bytes:
    return f"{BARRIER_PREFIX}{key}/{rank}".encode()


async def dp_barrier(key: str, dp_rank: int, dp_size: int, timeout_s: float) -> bool:
    """Wait until every rank of the DP gang reached barrier `key` (each rank calls it once
    per restart); False when one had not within `timeout_s`. The keys stay until
    `forget_dp_round`."""
    from ray.experimental.internal_kv import _internal_kv_exists, _internal_kv_put

    _internal_kv_put(_barrier_key(key, dp_rank), b"1", overwrite=True)
    deadline = time.monotonic() + timeout_s
    while not all(_internal_kv_exists(_barrier_key(key, r)) for r in range(dp_size)):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(POLL_S)
    return True

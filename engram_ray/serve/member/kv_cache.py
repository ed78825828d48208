"""KV-cache capacity of a vLLM engine, bytes and tokens, behind the headroom gauges
(`engram_kv_cache_capacity_bytes`, `engram_kv_cache_headroom_bytes`).

Two sources, best first (`KVCacheCapacity.source` and the replica's log say which was used):
- `kv_cache_config` (exact): each worker's `KVCacheConfig`, the plan vLLM allocated the KV cache
  from. Every cache the model declares is in it: K/V or MLA latents and the extra per-layer
  caches a formula misses (DeepSeek-V4.1's compressor state, a `SlidingWindowMLASpec`, and its
  indexer keys; sliding-window and Mamba groups).
- `formula` (fallback): `formula_capacity`, exact only when every layer caches K and V (or one
  MLA latent) of the model's head shape.

Why a worker extension: the front-end (vLLM's AsyncLLM, where Ray Serve LLM's server runs) never
receives the KVCacheConfig. The engine core builds it (`EngineCore._initialize_kv_caches`,
vllm/v1/engine/core.py:261 in 0.32, :251 in 0.33) and sends the front-end only an
`EngineCoreReadyResponse` (vllm/v1/engine/__init__.py:73 / :74): blocks, block size and a token
count, no bytes. `collective_rpc` reaches the workers, but without
VLLM_ALLOW_INSECURE_SERIALIZATION only by method name and only with msgpack-native results
(vllm/v1/serial_utils.py `enc_hook`), and no stock worker method returns the config that way.
Worse, a result msgpack cannot encode (`get_kv_cache_spec` carries torch dtypes) kills the engine
core's output thread (`process_output_sockets`) and the caller waits forever: tried on 0.32.
`KVCacheProbe`, set as vLLM's `worker_extension_cls`, adds one method that answers in plain
ints, and the replica waits at most `PROBE_TIMEOUT_S` for it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

# Under Ray Serve's logger, which writes the replica's log.
logger = logging.getLogger("ray.serve.engram_ray.kv_cache")

KV_PROBE_CLS = "engram_ray.serve.member.kv_cache.KVCacheProbe"
KV_PROBE_METHOD = "engram_kv_cache_bytes"
PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class KVCacheCapacity:
    """KV cache of one engine: `capacity_bytes` on its devices, `capacity_tokens` it can hold,
    and the `source` of the bytes ("kv_cache_config" or "formula")."""

    capacity_bytes: int
    capacity_tokens: int
    source: str


def kv_cache_config_bytes(kv_cache_config) -> int:
    """Device bytes of one worker's KV cache: the size of the one backing allocation its
    `kv_cache_tensors` place their layers in.

    NOTES: in vLLM 0.32 and 0.33 `KVCacheTensor.size` is the "total size of the backing
    allocation" (num_blocks * bytes per block, `get_kv_cache_config_from_groups`), repeated on
    every tensor, and `allocate_kv_cache` (vllm/v1/worker/utils.py:564) allocates it once, so
    summing the sizes would count it once per tensor. Host-resident tensors (HiSparse's host
    pool) are not device KV cache and are left out. Several device sizes mean several
    allocations (a 0.33 platform `KVCacheConfigBuilder` may do that), which tensor sizes alone
    cannot tell apart: refused, so the capacity falls back to the formula.
    """
    sizes = {tensor.size for tensor in kv_cache_config.kv_cache_tensors
             if not getattr(tensor, "host_resident", False)}
    if len(sizes) > 1:
        raise ValueError(f"the KV cache tensors name {len(sizes)} backing sizes "
                         f"{sorted(sizes)}; expected one shared allocation (vLLM 0.32/0.33 "
                         "layout): the capacity falls back to the formula")
    return sizes.pop() if sizes else 0


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (nested lists allowed): views of one
    buffer count once."""
    import torch

    by_address: dict[int, int] = {}
    pending = list(tensors)
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            by_address[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return sum(by_address.values())


class KVCacheProbe:
    """vLLM worker extension (`worker_extension_cls`): the KV cache this worker planned and
    allocated, as plain ints `collective_rpc` can carry to the front-end."""

    def engram_kv_cache_bytes(self) -> dict[str, int]:
        """{"config_bytes": from the KVCacheConfig, "allocated_bytes": storages the model
        runner holds, "num_blocks": blocks per layer}."""
        runner = self.model_runner
        config = runner.kv_cache_config
        return {"config_bytes": int(kv_cache_config_bytes(config)),
                "allocated_bytes": int(storage_bytes(runner.kv_caches)),
                "num_blocks": int(config.num_blocks)}


def probe_engine_kwargs(engine_kwargs: dict) -> dict:
    """vLLM engine arguments that install `KVCacheProbe`: none when the deployment sets its own
    `worker_extension_cls` (vLLM takes one; theirs wins and the capacity uses the formula)."""
    if engine_kwargs.get("worker_extension_cls"):
        return {}
    return {"worker_extension_cls": KV_PROBE_CLS}


def formula_capacity(vllm_config) -> tuple[int, int]:
    """(bytes, tokens) of the KV cache: blocks * block_size tokens, each token
    2 (K and V; 1 for MLA, whose latent is one vector) * layers * kv_heads * head_size *
    element bytes. NOTES: counts one worker's share (the Serve app runs TP = PP = 1); misses
    extra per-layer caches (DeepSeek-V4.1's compressor and indexer caches) and per-group
    shapes (sliding-window, hybrid): the fallback of `engine_capacity`."""
    import torch

    cache, model, parallel = (vllm_config.cache_config, vllm_config.model_config,
                              vllm_config.parallel_config)
    tokens = int(cache.num_gpu_blocks or 0) * int(cache.block_size)
    dtype = model.dtype if cache.cache_dtype == "auto" else getattr(torch, "uint8")
    num_tensors = 1 if getattr(model, "use_mla", False) else 2
    per_token = (num_tensors * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel)
                 * model.get_head_size() * torch.empty((), dtype=dtype).element_size())
    return tokens * per_token, tokens


def capacity_from_probes(probes: list[dict], block_size: int) -> KVCacheCapacity:
    """Engine capacity from every worker's `engram_kv_cache_bytes`: bytes summed over workers
    (each holds its own KV cache), tokens = the smallest worker's blocks * `block_size` (the
    scheduler's block pool has that many)."""
    if not probes:
        raise ValueError("collective_rpc returned no worker results")
    return KVCacheCapacity(sum(int(p["config_bytes"]) for p in probes),
                           min(int(p["num_blocks"]) for p in probes) * int(block_size),
                           "kv_cache_config")


async def engine_capacity(engine_client) -> KVCacheCapacity:
    """Capacity of a started engine (`engine_client`: vLLM's AsyncLLM): exact from its workers'
    KVCacheConfig when they carry `KVCacheProbe`, else `formula_capacity`. Logs which, and
    why the exact one was not available."""
    config = engine_client.vllm_config
    try:
        probes = await asyncio.wait_for(
            engine_client.collective_rpc(KV_PROBE_METHOD, timeout=PROBE_TIMEOUT_S),
            PROBE_TIMEOUT_S)
        capacity = capacity_from_probes(probes, config.cache_config.block_size)
    except Exception as exc:  # any failure leaves the formula, which needs no worker
        capacity = KVCacheCapacity(*formula_capacity(config), "formula")
        reason = str(exc) or f"no answer in {PROBE_TIMEOUT_S:g} s"
        logger.warning("engram-ray: KV-cache capacity from the formula (%d bytes, %d tokens): "
                       "the workers' kv_cache_config was not reachable (%s: %s); extra "
                       "per-layer caches are not counted", capacity.capacity_bytes,
                       capacity.capacity_tokens, type(exc).__name__, reason)
        return capacity
    logger.info("engram-ray: KV-cache capacity from kv_cache_config: %d bytes (%d allocated "
                "over %d workers), %d tokens", capacity.capacity_bytes,
                sum(int(p["allocated_bytes"]) for p in probes), len(probes),
                capacity.capacity_tokens)
    return capacity

"""An engine restarted in place declares the table slice its replica holds
(`engram_ray.vllm.held_memory`), checked with vLLM's own start-up memory check and loader
registry from the installed vLLM, fed the shipped numbers: an H200 (140.4 GiB), DeepSeek-V4.1-
Flash in peer groups of 8 (its slice per GPU from the project's plan), gpu_memory_utilization
0.92 (serve_deepseek_v41_flash.yaml)."""

import math

import pytest

pytest.importorskip("vllm", reason="vLLM's own memory check and loader registry")

H200_BYTES = int(140.4 * 2**30)
UTILIZATION = 0.92
OTHER_BYTES = 2**30  # CUDA context and the like, outside the engine's budget


def _flash_slice_bytes() -> int:
    from engram_ray.model.layout import load_layout
    from engram_ray.planning.memory import make_plan

    return make_plan(load_layout("deepseek-v4.1-flash"), "peer", peer_group_size=8
                     ).hbm_bytes_per_gpu


def _snapshot(free_bytes: int):
    from vllm.utils.mem_utils import MemorySnapshot

    snapshot = MemorySnapshot(device="cpu", auto_measure=False)
    snapshot.total_memory, snapshot.free_memory = H200_BYTES, free_bytes
    return snapshot


def _cache_config():
    from vllm.config import CacheConfig

    return CacheConfig(gpu_memory_utilization=UTILIZATION)


def _external_bytes(engine_kwargs: dict) -> int:
    """What vLLM's GPU worker asks before its memory check: the loader of the load format."""
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from engram_ray.vllm.held_memory import register_held_loader

    register_held_loader()
    load_config = LoadConfig(load_format=engine_kwargs.get("load_format", "auto"),
                             model_loader_extra_config=engine_kwargs.get(
                                 "model_loader_extra_config") or {})
    return get_model_loader(load_config).get_external_weight_memory(None)


def test_a_restart_holding_its_slice_passes_vllms_check_with_the_first_starts_kv_budget():
    from vllm.v1.worker.utils import request_memory

    from engram_ray.vllm.held_memory import held_load_kwargs

    slice_bytes = _flash_slice_bytes()
    assert round(slice_bytes / 2**30, 1) == 23.6
    weights_and_peaks = 60 * 2**30  # any: the engine's own non-KV bytes, the same both starts
    # First start: the whole device is free; the slice is allocated while the model loads,
    # among the engine's own allocations.
    first = request_memory(_snapshot(H200_BYTES - OTHER_BYTES), _cache_config(),
                           _external_bytes({}))
    assert first == math.ceil(H200_BYTES * UTILIZATION)
    first_kv = first - (weights_and_peaks + slice_bytes)
    # Restart in place, as before: the holder keeps the slice, vLLM finds less free than asked.
    held_free = H200_BYTES - OTHER_BYTES - slice_bytes
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        request_memory(_snapshot(held_free), _cache_config(), _external_bytes({}))
    # Restart in place now: the held slice declared through the loader hook.
    kwargs = held_load_kwargs({"load_format": "auto"}, slice_bytes)
    restarted = request_memory(_snapshot(held_free), _cache_config(), _external_bytes(kwargs))
    assert restarted == first - slice_bytes
    assert restarted - weights_and_peaks == first_kv  # the slice is not allocated again


def test_the_held_loader_loads_with_the_deployments_own_format_and_its_extra_config():
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    from engram_ray.vllm.held_memory import (HELD_FORMAT, base_load_format, held_load_kwargs,
                                             register_held_loader)

    register_held_loader()
    kwargs = held_load_kwargs({"load_format": "dummy", "model_loader_extra_config": {}}, 4096)
    assert kwargs["load_format"] == HELD_FORMAT
    again = held_load_kwargs(kwargs, 8192)  # a second restart keeps the first format
    assert again["model_loader_extra_config"] == {"engram_base_load_format": "dummy",
                                                  "engram_held_bytes": 8192}
    load_config = LoadConfig(**again)
    loader = get_model_loader(load_config)
    assert isinstance(loader.base, DummyModelLoader)
    assert loader.get_external_weight_memory(None) == 8192
    assert base_load_format(load_config) == "dummy"
    assert base_load_format(LoadConfig(load_format="auto")) == "auto"

"""KV-cache capacity behind the headroom gauges (engram_ray.serve.member.kv_cache): exact bytes from
the workers' KVCacheConfig, the formula as fallback.

Fast tests build KV-cache configs with vLLM's own planner; the slow one starts the tiny model in
one AsyncLLM (the engine client Ray Serve LLM's server holds) and checks the exact bytes against
what the worker really allocated.
"""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engram_ray.serve.member import kv_cache
from engram_ray.serve.member.kv_cache import (KV_PROBE_CLS, KV_PROBE_METHOD, engine_capacity,
                                              formula_capacity, kv_cache_config_bytes,
                                              probe_engine_kwargs, storage_bytes)

BLOCK_SIZE, NUM_LAYERS, AVAILABLE_BYTES = 64, 4, 1 << 30


def mla_model_config(num_blocks: int):
    """vLLM config stand-in for the formula: MLA, 4 layers, one 576-wide bf16 latent."""
    model = SimpleNamespace(dtype=torch.bfloat16, use_mla=True,
                            get_num_layers=lambda p: NUM_LAYERS, get_num_kv_heads=lambda p: 1,
                            get_head_size=lambda: 576)
    cache = SimpleNamespace(num_gpu_blocks=num_blocks, block_size=BLOCK_SIZE, cache_dtype="auto")
    return SimpleNamespace(cache_config=cache, model_config=model, parallel_config=None)


def planned_config(specs: dict):
    """vLLM's KVCacheConfig for `specs` (layer name -> spec) packed in one group, as vLLM plans
    DeepSeek-V4's caches, with `AVAILABLE_BYTES` of memory."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, UniformTypeKVCacheSpecs
    from vllm.v1.kv_cache_layout import KVCacheLayout
    try:  # vLLM 0.33 moved the planner
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

    group = KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size=BLOCK_SIZE,
                                                                  kv_cache_specs=specs))
    cache = SimpleNamespace(get_resolved_kv_cache_layout=lambda: KVCacheLayout.BLHNC,
                            num_gpu_blocks_override=None, prefix_cache_retention_interval=None)
    vllm_config = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None),
                                  cache_config=cache)
    return get_kv_cache_config_from_groups(vllm_config, [group], AVAILABLE_BYTES)


def test_exact_bytes_count_the_indexer_caches_the_formula_misses():
    """DeepSeek-V4-like layers: an MLA latent (576 x bf16) and an indexer key cache (132 uint8)
    per layer. The formula sees only the latents."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    latent = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=576,
                              dtype=torch.bfloat16)
    indexer = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=132,
                               dtype=torch.uint8, tokens_per_state=4)
    specs = {f"layers.{i}.attn": latent for i in range(NUM_LAYERS)}
    specs |= {f"layers.{i}.indexer": indexer for i in range(NUM_LAYERS)}
    config = planned_config(specs)

    per_block = NUM_LAYERS * (latent.page_size_bytes + indexer.page_size_bytes)
    assert config.num_blocks == AVAILABLE_BYTES // per_block
    exact = kv_cache_config_bytes(config)
    assert exact == config.num_blocks * per_block
    formula_bytes, formula_tokens = formula_capacity(mla_model_config(config.num_blocks))
    assert formula_tokens == config.num_blocks * BLOCK_SIZE
    assert exact - formula_bytes == config.num_blocks * NUM_LAYERS * indexer.page_size_bytes
    # Every tensor repeats the one backing allocation's size: a sum would count it twice.
    assert sum(t.size for t in config.kv_cache_tensors) == 2 * exact


def test_exact_bytes_equal_the_formula_for_plain_latents():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    latent = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=576,
                              dtype=torch.bfloat16)
    config = planned_config({f"layers.{i}.attn": latent for i in range(NUM_LAYERS)})
    assert kv_cache_config_bytes(config) == formula_capacity(
        mla_model_config(config.num_blocks))[0]


def test_host_resident_tensors_are_left_out_and_unknown_layouts_refused():
    from vllm.v1.kv_cache_interface import KVCacheTensor

    def tensor(size, host_resident=False):
        return KVCacheTensor(size=size, layers=["layers.0.attn"], layer_stride=0, block_stride=1,
                             host_resident=host_resident)

    config = SimpleNamespace(kv_cache_tensors=[tensor(1000), tensor(1000), tensor(7, True)])
    assert kv_cache_config_bytes(config) == 1000
    assert kv_cache_config_bytes(SimpleNamespace(kv_cache_tensors=[])) == 0
    with pytest.raises(ValueError, match=r"2 backing sizes \[1000, 2000\]"):
        kv_cache_config_bytes(SimpleNamespace(kv_cache_tensors=[tensor(1000), tensor(2000)]))


def test_storage_bytes_count_a_shared_buffer_once():
    buffer = torch.zeros(4096, dtype=torch.int8)
    other = torch.zeros(10, dtype=torch.float32)
    assert storage_bytes([buffer[:1024].view(torch.bfloat16), buffer[2048:], [other, buffer]]) \
        == 4096 + 40


def test_probe_is_installed_unless_the_deployment_brings_its_own_extension():
    assert probe_engine_kwargs({}) == {"worker_extension_cls": KV_PROBE_CLS}
    assert probe_engine_kwargs({"worker_extension_cls": "rlhf.WeightSync"}) == {}


class FakeClient:
    def __init__(self, answer):
        self.vllm_config, self.answer = mla_model_config(100), answer

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert method == KV_PROBE_METHOD
        if isinstance(self.answer, BaseException):
            raise self.answer
        if self.answer == "hang":
            await asyncio.sleep(3600)
        return self.answer


def test_engine_capacity_prefers_the_workers_and_falls_back_to_the_formula(monkeypatch,
                                                                           caplog):
    probes = [{"config_bytes": 5000, "allocated_bytes": 5000, "num_blocks": 100},
              {"config_bytes": 7000, "allocated_bytes": 7000, "num_blocks": 90}]
    capacity = asyncio.run(engine_capacity(FakeClient(probes)))
    assert (capacity.capacity_bytes, capacity.capacity_tokens, capacity.source) == (
        12000, 90 * BLOCK_SIZE, "kv_cache_config")

    formula = formula_capacity(mla_model_config(100))
    monkeypatch.setattr("engram_ray.serve.member.kv_cache.PROBE_TIMEOUT_S", 0.1)
    # Under "ray.serve", which stops propagating to the root logger once Ray is imported.
    monkeypatch.setattr(kv_cache.logger, "handlers", [caplog.handler])
    for answer in (Exception("Method 'engram_kv_cache_bytes' is not implemented."), "hang", []):
        capacity = asyncio.run(engine_capacity(FakeClient(answer)))
        assert (capacity.capacity_bytes, capacity.capacity_tokens) == formula, answer
        assert capacity.source == "formula"
    assert "no answer in 0.1 s" in caplog.text
    assert "Method 'engram_kv_cache_bytes' is not implemented." in caplog.text


_ENGINE = r"""
import asyncio, dataclasses, json, logging, sys
from types import SimpleNamespace

sys.path.insert(0, sys.argv[3])  # tests/, for support.engine_runner
from support.engine_runner import apply_cpu_defaults, generate_async, start_async_engine
from engram_ray.metrics.engine import EngineIdentity, EngineMetrics
from engram_ray.serve.member.kv_cache import KV_PROBE_METHOD, formula_capacity, probe_engine_kwargs
from engram_ray.serve.member.server import EngramServerMixin


async def main(model_dir):
    engine = await start_async_engine(model_dir, **probe_engine_kwargs({}))
    try:
        # The replica's own path: `self.engine._engine_client` is this AsyncLLM.
        replica = SimpleNamespace(engine=SimpleNamespace(_engine_client=engine),
                                  engram_metrics=EngineMetrics(EngineIdentity("m", "e", "g", 0)))
        await EngramServerMixin._attach_stat_logger(replica)
        await generate_async(engine, ["The river"], max_tokens=4)
        registry = replica.engram_metrics.registry
        labels = {"model": "m", "engine": "e", "peer_group": "g", "rank": "0"}
        cache = engine.vllm_config.cache_config
        return {"capacity": dataclasses.astuple(replica.kv_cache_capacity),
                "probes": await engine.collective_rpc(KV_PROBE_METHOD),
                "formula": list(formula_capacity(engine.vllm_config)),
                "num_gpu_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
                "gauge": registry.get_sample_value("engram_kv_cache_capacity_bytes", labels),
                "headroom": registry.get_sample_value("engram_kv_cache_headroom_bytes", labels)}
    finally:
        engine.shutdown()


logging.basicConfig(level=logging.INFO)  # Ray Serve configures the replica's logger
apply_cpu_defaults()
with open(sys.argv[2], "w") as out:
    json.dump(asyncio.run(main(sys.argv[1])), out)
"""


@pytest.mark.slow
def test_exact_bytes_are_what_the_engine_allocated(tmp_path):
    """One tiny-model AsyncLLM with the probe, capacity read as the Serve replica reads it."""
    from engram_ray.vllm.tiny_checkpoint import write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    result_path, log_path = tmp_path / "result.json", tmp_path / "engine.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, "-c", _ENGINE, str(model), str(result_path),
                               str(Path(__file__).resolve().parents[2])],
                              env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                              timeout=600)
    if proc.returncode != 0 or not result_path.exists():
        pytest.fail(f"engine exited {proc.returncode}:\n{log_path.read_text()[-4000:]}")
    result = json.loads(result_path.read_text())

    capacity_bytes, capacity_tokens, source = result["capacity"]
    (probe,) = result["probes"]  # TP = PP = 1: one worker
    assert source == "kv_cache_config"
    assert capacity_bytes == probe["config_bytes"] == probe["allocated_bytes"]
    # VLLM_CPU_KVCACHE_SPACE=1: the engine plans whole blocks into 1 GiB.
    bytes_per_block = capacity_bytes // probe["num_blocks"]
    assert 0 <= (1 << 30) - capacity_bytes < bytes_per_block
    assert capacity_tokens == result["num_gpu_blocks"] * result["block_size"]
    # The tiny model caches only K and V: the formula agrees.
    assert [capacity_bytes, capacity_tokens] == result["formula"]
    assert result["gauge"] == capacity_bytes
    assert 0 < result["headroom"] <= capacity_bytes
    assert "KV-cache capacity from kv_cache_config" in (tmp_path / "engine.log").read_text()

"""vLLM general plugin (entry point group `vllm.general_plugins`), run in every vLLM process.

`register()`:
- registers `EngramTinyForCausalLM` (engram_ray.models.tiny_engram) as a vLLM architecture,
  by name only, so nothing heavy is imported here;
- arranges for DeepSeek-V4.1's Engram table class to be patched (engram_ray.deepseek_patch)
  when, and only when, vLLM imports `vllm.models.deepseek_v41.common.engram`.
"""

from __future__ import annotations

TINY_ARCHITECTURE = "EngramTinyForCausalLM"
TINY_MODEL_CLASS = "engram_ray.models.tiny_engram:EngramTinyForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    if TINY_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(TINY_ARCHITECTURE, TINY_MODEL_CLASS)

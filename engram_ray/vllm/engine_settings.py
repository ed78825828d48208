"""vLLM engine settings a model architecture needs beyond vLLM's defaults, and why.

Everything else runs as vLLM decides (DeepSeek-V4.1: CUDA graphs on, prefix caching as vLLM
chooses for the model). The architecture comes from the model's `config.json`: a local folder,
or the Hugging Face cache for a hub id, read where the engines run (each replica sets its
engine's arguments on its own node, `engram_ray.serve.member.engine`): the app's build may run
on a head node without the model's folder, and then sets none of them. An engine whose node
cannot read it is refused, naming the path: no model runs with another model's settings (the
tiny model's eager mode would turn CUDA graphs off on every engine of a cluster).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engram_ray.errors import EngramRayError
from engram_ray.vllm.tiny_checkpoint import ARCHITECTURE as TINY_ARCHITECTURE

logger = logging.getLogger(__name__)

# The tiny model's n-gram history (engram_ray.vllm.ngram_history) holds each token's
# compressed id per KV slot, written by the step that computes that token, in Python on the
# host: a prefix-cache hit skips those steps (the slots would keep another request's ids), and
# a CUDA-graph replay (or torch.compile) runs no Python, so nothing would be written or read.
NGRAM_HISTORY_SETTINGS = {"enforce_eager": True, "enable_prefix_caching": False}
ARCHITECTURE_SETTINGS = {TINY_ARCHITECTURE: NGRAM_HISTORY_SETTINGS}


def model_architectures(model_source: str) -> list[str] | None:
    """`architectures` of the model's config.json, or None where it cannot be read here."""
    path = Path(model_source) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache
            cached = try_to_load_from_cache(model_source, "config.json")
        except Exception:  # noqa: BLE001 (not a hub id, no hub client: unknown)
            cached = None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        return list(json.loads(path.read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return None


def architecture_engine_kwargs(model_source: str, on_engine_node: bool = False) -> dict:
    """Engine kwargs the model's architecture needs (module doc); {} = vLLM's defaults, or
    (not `on_engine_node`: the app's build) a config not readable here, which the engines
    read where they run. `on_engine_node`: EngramRayError naming the path if it cannot be
    read there."""
    architectures = model_architectures(model_source)
    if architectures is None:
        if on_engine_node:
            raise EngramRayError(
                f"no config.json readable for serving.model_source {model_source!r} on this "
                "engine's node: the engine could not load the model either; mount or copy the "
                "model folder to the same path on every engine node (or give a Hugging Face id "
                "that is in this node's cache)")
        logger.info("no config.json readable for %s where the app is built: each engine "
                    "reads its architecture's settings on its own node", model_source)
        return {}
    settings = {}
    for architecture in architectures:
        settings.update(ARCHITECTURE_SETTINGS.get(architecture, {}))
    return settings
